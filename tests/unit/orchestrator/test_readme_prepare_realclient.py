"""The README's `searchr1 data prepare` examples do what their file names say: the one that
writes a train file writes train rows (it wrote test rows: the default split is test)."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

from typer.testing import CliRunner

from orchestrator.data import read_rows
from stack.cli import app

README = Path(__file__).resolve().parents[3] / "README.md"


def readme_commands() -> list[list[str]]:
    lines = re.findall(r"^searchr1 data prepare .*$", README.read_text(), re.MULTILINE)
    return [shlex.split(line.split("#")[0])[1:] for line in lines]


def test_the_readmes_prepare_examples_write_the_split_their_file_names(tmp_path: Path) -> None:
    for ds in ("nq", "hotpotqa"):
        for split in ("train", "dev", "test"):
            (tmp_path / "flashrag" / ds).mkdir(parents=True, exist_ok=True)
            row = {"question": f"{split} question?", "golden_answers": ["a"]}
            (tmp_path / "flashrag" / ds / f"{split}.jsonl").write_text(json.dumps(row) + "\n")
    commands = readme_commands()
    assert any("train" in " ".join(c) for c in commands), commands
    for argv in commands:
        argv = [a.replace("/data/", f"{tmp_path}/") for a in argv]
        done = CliRunner().invoke(app, argv)
        assert done.exit_code == 0, done.output
        out = Path(argv[argv.index("--out") + 1])
        want = next(s for s in ("train", "dev", "test") if s in out.name)
        splits = {row["extra_info"]["split"] for row in read_rows(out)}
        assert splits == {want}, (argv, splits)
