"""Print the runtime dependencies declared in pyproject.toml, one per line (stdlib only).

Images install these before copying the source code, so the dependency layer stays cached
across code edits; the package itself is then installed with `--no-deps`.

    python requirements.py pyproject.toml                   the dependencies
    python requirements.py pyproject.toml --extras megatron  an image's extras (comma-separated)
    python requirements.py --installed report.json          what a `pip install --report` run
                                                             installed, as name==version pins

With `--locked requirements.lock`, each of these prints the entries of the lock instead (pins
with their `--hash` lines, for `pip install --require-hashes`): the ones the requirements need,
their dependencies included; or the packages named by `--names a,b`:

    python requirements.py pyproject.toml --locked requirements.lock [--extras megatron]
    python requirements.py --installed report.json --locked requirements.lock
    python requirements.py --names torch --locked requirements.lock
"""

from __future__ import annotations

import argparse
import json
import re
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


def canonical(name: str) -> str:
    """PEP 503's normalized name (`PyStemmer` and `pystemmer`, `ruamel.yaml` and `ruamel-yaml`)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    """The canonical project name a requirement string starts with (`torch>=2.11` -> torch)."""
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if not m:
        raise ValueError(f"no project name in {requirement!r}")
    return canonical(m.group(1))


def lock_entries(lock: Path) -> dict[str, tuple[list[str], set[str]]]:
    """Each package of a `uv pip compile --generate-hashes` file: canonical name -> (its lines,
    `name==version` and the `--hash=` ones; the canonical names of what requires it, from uv's
    `# via` annotations)."""
    entries: dict[str, tuple[list[str], set[str]]] = {}
    current: str | None = None
    for line in lock.read_text().splitlines():
        if m := re.match(r"([A-Za-z0-9][A-Za-z0-9._-]*)==", line):
            current = canonical(m.group(1))
            entries[current] = ([line], set())
        elif current and line.lstrip().startswith("--hash="):
            entries[current][0].append(line)
        elif current and line.lstrip().startswith("#"):
            # `# via torch`, `#   torch`, `#   searchr1 (pyproject.toml)`; `-c file`: no package
            via = line.strip().lstrip("#").strip().removeprefix("via").strip()
            if via and not via.startswith("-"):
                entries[current][1].add(requirement_name(via))
    return entries


def locked(lock: Path, requirements: list[str], closure: bool = True) -> list[str]:
    """The lock's entries that `requirements` need: those packages and (`closure`),
    transitively, what the lock says they require (a package is taken when anything taken
    requires it; the lock is resolved for one platform, so nothing is left out, at worst a
    little more is taken). A requirement the lock lacks is a KeyError: the lock is stale
    (`python3 dev.py lock`)."""
    entries = lock_entries(lock)
    wanted = {requirement_name(r) for r in requirements}
    missing = sorted(wanted - entries.keys())
    if missing:
        raise KeyError(f"{lock.name} lacks {missing}: refresh it (python3 dev.py lock)")
    grew = closure
    while grew:
        more = {n for n, (_, via) in entries.items() if n not in wanted and via & wanted}
        wanted |= more
        grew = bool(more)
    return [line for name, (lines, _) in entries.items() if name in wanted for line in lines]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pyproject", nargs="?", type=Path, default=Path("pyproject.toml"))
    parser.add_argument("--extras", help="these extras (comma-separated) instead")
    parser.add_argument("--installed", type=Path, help="a `pip install --report` file")
    parser.add_argument("--names", help="with --locked: these packages (comma-separated)")
    parser.add_argument("--locked", type=Path, help="requirements.lock: print its entries")
    args = parser.parse_args()
    closure = args.names is None and args.installed is None  # else: exactly those packages
    if args.names is not None:
        lines = args.names.split(",")
    elif args.installed:
        lines = installed(args.installed)
    elif args.extras is not None:
        lines = extras(args.pyproject, args.extras)
        if args.locked and lines:  # the extras and the runtime dependencies they sit on
            lines += dependencies(args.pyproject)
    else:
        lines = dependencies(args.pyproject)
    if args.locked and lines:
        lines = locked(args.locked, lines, closure)
    print("\n".join(lines))
