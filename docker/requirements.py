"""Print the runtime dependencies declared in pyproject.toml, one per line (stdlib only).

Images install these before copying the source code, so the dependency layer stays cached
across code edits; the package itself is then installed with `--no-deps`.

    python requirements.py pyproject.toml                   the dependencies
    python requirements.py pyproject.toml --extras megatron  an image's extras (comma-separated)
    python requirements.py --installed report.json          what a `pip install --report` run
                                                             installed, as name==version pins
"""

from __future__ import annotations

import json
import sys
import tomllib
from pathlib import Path


def _project(pyproject: Path) -> dict:
    with open(pyproject, "rb") as f:
        return tomllib.load(f)["project"]


def dependencies(pyproject: Path) -> list[str]:
    return list(_project(pyproject)["dependencies"])


def extras(pyproject: Path, names: str) -> list[str]:
    """The requirements of the comma-separated extras `names` ("" = none); KeyError names an
    extra pyproject.toml does not declare."""
    declared = _project(pyproject).get("optional-dependencies", {})
    out: list[str] = []
    for name in filter(None, (n.strip() for n in names.split(","))):
        if name not in declared:
            raise KeyError(f"pyproject.toml declares no extra {name!r} ({sorted(declared)})")
        out += declared[name]
    return out


def installed(report: Path) -> list[str]:
    """`name==version` of every distribution a `pip install --report` run installed."""
    rows = json.loads(report.read_text())["install"]
    return [f"{r['metadata']['name']}=={r['metadata']['version']}" for r in rows]


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["--installed"]:
        lines = installed(Path(args[1]))
    else:
        path = Path(args[0] if args else "pyproject.toml")
        lines = extras(path, args[2]) if args[1:2] == ["--extras"] else dependencies(path)
    print("\n".join(lines))
