"""Print the runtime dependencies declared in pyproject.toml, one per line (stdlib only).

Images install these before copying the source code, so the dependency layer stays cached
across code edits; the package itself is then installed with `--no-deps`.
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path


def dependencies(pyproject: Path) -> list[str]:
    with open(pyproject, "rb") as f:
        return list(tomllib.load(f)["project"]["dependencies"])


if __name__ == "__main__":
    path = Path(sys.argv[1] if len(sys.argv) > 1 else "pyproject.toml")
    print("\n".join(dependencies(path)))
