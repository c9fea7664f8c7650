#!/usr/bin/env python3
"""Make torchvision 0.28 importable next to the CPU build of torch 2.13 (standard library only).

PyPI's Linux torchvision wheel is built against the CUDA torch, so its C extension does not load
with the CPU torch wheel and the `torchvision::nms` / `torchvision::qnms` operators never get
defined. `torchvision/_meta_registrations.py` nevertheless registers fake (meta) kernels for those
two operators unconditionally, which raises at `import torchvision`, and SGLang imports
torchvision. This script makes those two registrations conditional on the extension having loaded,
exactly as the file already does for all its other registrations (`register_meta`).

    python patch_torchvision.py SITE_PACKAGES_DIR

Running it again on a patched file changes nothing; text it does not expect is an error.
"""

from __future__ import annotations

import sys
from pathlib import Path

OPS = ("nms", "qnms")
_NO_OP = "(lambda fn: fn)"


def _original(op: str) -> str:
    return f'@torch.library.register_fake("torchvision::{op}")\n'


def _patched(op: str) -> str:
    return (
        f'@(torch.library.register_fake("torchvision::{op}")'
        f" if torchvision.extension._has_ops() else {_NO_OP})\n"
    )


def patch(site_packages: Path) -> bool:
    """Patch torchvision under `site_packages`; returns whether the file was changed."""
    path = site_packages / "torchvision" / "_meta_registrations.py"
    if not path.is_file():
        raise SystemExit(f"patch_torchvision: {path} not found (is torchvision installed?)")
    text = original = path.read_text()
    if "import torchvision.extension" not in text:
        raise SystemExit(f"patch_torchvision: {path} no longer imports torchvision.extension")
    for op in OPS:
        if text.count(_patched(op)) == 1 and _original(op) not in text:
            continue  # already patched
        if text.count(_original(op)) != 1:
            raise SystemExit(
                f"patch_torchvision: expected one line {_original(op).strip()!r} in {path};"
                " the torchvision version is not the one this patch was written for"
            )
        text = text.replace(_original(op), _patched(op))
    if text == original:
        return False
    path.write_text(text)
    for cached in path.parent.glob("__pycache__/_meta_registrations.*.pyc"):
        cached.unlink()
    return True


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    changed = patch(Path(argv[0]))
    print("patch_torchvision:", "patched" if changed else "already patched")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
