#!/usr/bin/env python3
"""One entry point for a fresh machine: creates/updates `.venv`, then runs the demo or the tests.

    python3 dev.py demo [ARGS...]   # the main job: the local end-to-end demo
    python3 dev.py test [ARGS...]   # lint, generated-code check and the test suite (what CI runs)
    python3 dev.py setup            # only create/update the environment

Only the Python standard library is used here, so it runs before anything is installed.
The environment is rebuilt only when pyproject.toml or constraints.txt change (a stamp file
holds their hash), so repeated runs start at once.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
STAMP = VENV / ".searchr1-installed"
TORCH_PIN = "torch==2.13.0"
# Where the CPU-only torch build lives when no local wheel is configured (pip find-links).
TORCH_CPU_INDEX = os.environ.get("SEARCHR1_TORCH_INDEX", "https://download.pytorch.org/whl/cpu")


def _bin(name: str) -> Path:
    sub = "Scripts" if os.name == "nt" else "bin"
    return VENV / sub / name


def _run(cmd: list[str | os.PathLike[str]], **kw) -> int:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    return subprocess.call([str(c) for c in cmd], **kw)


def _check(cmd: list[str | os.PathLike[str]], **kw) -> None:
    rc = _run(cmd, **kw)
    if rc != 0:
        sys.exit(f"dev.py: command failed with exit code {rc}")


def _fingerprint() -> str:
    h = hashlib.sha256()
    for name in ("pyproject.toml", "constraints.txt"):
        h.update((ROOT / name).read_bytes())
    h.update(sys.version.encode())
    return h.hexdigest()


def _install_torch(pip: list[str]) -> None:
    # Torch first and pinned to the CPU build: otherwise a dependency pulls the multi-GB CUDA
    # build. A local wheel (pip's configured find-links) is preferred, installed without its
    # dependencies (they come from the package index in the next step); else the CPU index.
    if _run([*pip, "install", "-q", "--no-index", "--no-deps", TORCH_PIN]) == 0:
        return
    if sys.platform == "darwin":
        _check([*pip, "install", "-q", TORCH_PIN])  # macOS wheels on PyPI are CPU-only
    else:
        _check([*pip, "install", "-q", TORCH_PIN, "--index-url", TORCH_CPU_INDEX])


def ensure_env() -> None:
    """Create `.venv` and install searchr1 (editable, with dev extras) unless already current."""
    if sys.version_info < (3, 11):  # noqa: UP036 - dev.py runs under any system python
        sys.exit("dev.py: searchr1 needs Python >= 3.11")
    if not _bin("python").exists():
        print(f"creating virtual environment in {VENV}", flush=True)
        venv.EnvBuilder(with_pip=True, clear=True).create(VENV)
    want = _fingerprint()
    if STAMP.exists() and STAMP.read_text() == want and _bin("searchr1").exists():
        return
    pip = [str(_bin("python")), "-m", "pip", "--disable-pip-version-check"]
    _check([*pip, "install", "-q", "--upgrade", "pip", "setuptools", "wheel"])
    _install_torch(pip)
    _check([*pip, "install", "-q", "-c", ROOT / "constraints.txt", "-e", f"{ROOT}[dev]"])
    STAMP.write_text(want)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("MKL_NUM_THREADS", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env["PATH"] = f"{_bin('python').parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def run_tests(args: list[str]) -> int:
    py = str(_bin("python"))
    env = _env()
    for cmd in (
        [py, "-m", "ruff", "check", "."],
        [py, "-m", "ruff", "format", "--check", "."],
        [py, "-m", "protos.generate", "--check"],
    ):
        rc = _run(cmd, cwd=ROOT, env=env)
        if rc != 0:
            return rc
    rc = _run([py, "-m", "pytest", *args], cwd=ROOT, env=env)
    return 0 if rc == 5 and args else rc  # 5 = a filtered selection collected nothing


def run_demo(args: list[str]) -> int:
    return _run([_bin("searchr1"), "demo", *args], cwd=ROOT, env=_env())


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] not in {"demo", "test", "setup"}:
        print(__doc__)
        return 2
    command, rest = sys.argv[1], sys.argv[2:]
    ensure_env()
    if command == "test":
        return run_tests(rest)
    if command == "demo":
        return run_demo(rest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
