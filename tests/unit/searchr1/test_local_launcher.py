"""`searchr1 local` builds its processes from the one stack config."""

from __future__ import annotations

from pathlib import Path

import pytest

from stack.config import load_config
from stack.launcher import build_specs


def test_specs_follow_the_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "stack.yaml"
    path.write_text("trainer:\n  http:\n    port: 8299\nlocal:\n  restart: on-failure\n")
    monkeypatch.setenv("SEARCHR1_RETRIEVER__HTTP__HOST", "0.0.0.0")
    cfg = load_config(path)
    specs = build_specs(cfg, path, "redis://127.0.0.1:7000/0")
    assert [s.name for s in specs] == ["retriever", "inference", "orchestrator", "trainer"]
    by_name = {s.name: s for s in specs}
    assert by_name["trainer"].command[-3:] == ["run", "--config", str(path)]
    assert by_name["retriever"].command[-3:] == ["serve", "--config", str(path)]
    assert by_name["trainer"].ready_url == "http://127.0.0.1:8299/ready"
    # A wildcard listen address is probed on loopback.
    assert by_name["retriever"].ready_url == "http://127.0.0.1:8000/ready"
    assert all(s.env["SEARCHR1_REDIS__URL"] == "redis://127.0.0.1:7000/0" for s in specs)
    assert all(s.restart.value == "on-failure" for s in specs)
    assert [s.exit_ends_stack for s in specs] == [False, False, False, True]
    assert [s.may_finish for s in specs] == [False, False, True, True]
    # The orchestrator keeps one worker id across restarts (its claims come back at once).
    assert by_name["orchestrator"].env["SEARCHR1_ORCHESTRATOR__PARTITION__WORKER_ID"]


def test_unknown_service_is_named(tmp_path: Path) -> None:
    cfg = load_config(None, local={"services": ["retriever", "ranker"]})
    with pytest.raises(ValueError, match=r"local\.services: unknown service 'ranker'"):
        build_specs(cfg, tmp_path / "x.yaml", "redis://x")


def test_several_engines_each_on_their_own_port(tmp_path: Path) -> None:
    cfg = load_config(None, local={"inference_replicas": 2}, inference={"http": {"port": 31000}})
    specs = build_specs(cfg, tmp_path / "x.yaml", "redis://x")
    assert [s.name for s in specs] == [
        "retriever", "inference-0", "inference-1", "orchestrator", "trainer",
    ]  # fmt: skip
    by_name = {s.name: s for s in specs}
    # The retriever and the engines start side by side; the orchestrator after all of them,
    # the trainer after the engines it pushes to.
    assert by_name["retriever"].after == by_name["inference-0"].after == ()
    assert by_name["orchestrator"].after == ("retriever", "inference-0", "inference-1")
    assert by_name["trainer"].after == ("inference-0", "inference-1")
    for i in (0, 1):
        engine = by_name[f"inference-{i}"]
        assert engine.env["SEARCHR1_INFERENCE__HTTP__PORT"] == str(31000 + i)
        assert engine.ready_url == f"http://127.0.0.1:{31000 + i}/ready"
    assert "SEARCHR1_INFERENCE__HTTP__PORT" not in by_name["trainer"].env
