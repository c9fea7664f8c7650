"""Generate the Python code for the `.proto` contracts (the one documented command).

    python -m protos.generate           # (re)write protos/*_pb2.py, *_pb2.pyi, *_pb2_grpc.py
    python -m protos.generate --check   # exit 1 if the checked-in code is out of date

Generated files sit next to the `.proto` files and are committed, so services need no protoc.
grpcio-tools is pinned in pyproject.toml because the generated code embeds its version.
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
ROOT = PROTO_DIR.parent
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def generate(out_dir: Path) -> list[Path]:
    from grpc_tools import protoc  # dev dependency: only needed to regenerate

    protos = sorted(PROTO_DIR.glob("*.proto"))
    args = [
        "protoc",
        f"-I{ROOT}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(p.relative_to(ROOT)) for p in protos),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    return sorted((out_dir / "protos").glob("*_pb2*.py*"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare, write nothing")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        produced = generate(Path(tmp))
        stale = []
        for path in produced:
            target = PROTO_DIR / path.name
            if not target.exists() or not filecmp.cmp(path, target, shallow=False):
                stale.append(target)
                if not args.check:
                    target.write_bytes(path.read_bytes())
        expected = {p.name for p in produced}
        orphans = [
            p
            for p in PROTO_DIR.iterdir()
            if p.name.endswith(GENERATED_SUFFIXES) and p.name not in expected
        ]
    if args.check:
        if stale or orphans:
            names = ", ".join(p.name for p in [*stale, *orphans])
            print(f"generated protobuf code is out of date: {names}", file=sys.stderr)
            print("run: python -m protos.generate", file=sys.stderr)
            return 1
        print("generated protobuf code is up to date")
        return 0
    for p in orphans:
        p.unlink()
    print(f"wrote {len(stale)} file(s); removed {len(orphans)} orphan(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
