"""Settings that follow from a choice: what `placement` sets, and the `engines` section that
the orchestrator and the trainer both read (issue 45 item 4). Each service derives them from
its own settings, so a container configured by its environment alone gets them too."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest

from orchestrator.config import OrchestratorSettings
from searchr1.settings import ConfigError, load_settings
from stack.config import load_config
from trainer.config import TrainerSettings


@pytest.fixture(autouse=True)
def no_env() -> Iterator[None]:
    keep = {k: v for k, v in os.environ.items() if not k.startswith("SEARCHR1_")}
    with mock.patch.dict(os.environ, keep, clear=True):
        yield


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "stack.yaml"
    path.write_text(text)
    return path


def test_colocated_sets_sync_rollouts_handover_and_release(tmp_path: Path) -> None:
    path = write(tmp_path, "placement: colocated\n")
    cfg = load_config(path)
    push = cfg.trainer.weight_push
    assert (cfg.orchestrator.mode, push.mode, push.release_engines_while_training) == (
        "sync",
        "handover",
        True,
    )
    # Each service alone derives its own part: the trainer's container reads no orchestrator.
    assert load_settings(OrchestratorSettings, path).orchestrator.mode == "sync"
    assert load_settings(TrainerSettings, path).trainer.weight_push.mode == "handover"


def test_colocated_from_the_environment_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SEARCHR1_PLACEMENT", "colocated")
    push = load_settings(TrainerSettings).trainer.weight_push
    assert push.mode == "handover" and push.release_engines_while_training
    # The same value named in the environment (compose and Helm name them) agrees.
    monkeypatch.setenv("SEARCHR1_TRAINER__WEIGHT_PUSH__RELEASE_ENGINES_WHILE_TRAINING", "true")
    assert load_settings(TrainerSettings).trainer.weight_push.release_engines_while_training
    monkeypatch.setenv("SEARCHR1_TRAINER__WEIGHT_PUSH__RELEASE_ENGINES_WHILE_TRAINING", "false")
    with pytest.raises(ConfigError, match=r"release_engines_while_training: false"):
        load_settings(TrainerSettings)


@pytest.mark.parametrize(
    ("named", "field"),
    [
        ("orchestrator:\n  mode: async\n", r"orchestrator\.mode: sync"),
        ("trainer:\n  weight_push:\n    mode: distributed\n", r"weight_push\.mode: handover"),
        (
            "trainer:\n  weight_push:\n    release_engines_while_training: false\n",
            r"release_engines_while_training: true",
        ),
    ],
)
def test_a_named_field_contradicting_colocated_is_refused(
    tmp_path: Path, named: str, field: str
) -> None:
    path = write(tmp_path, "placement: colocated\n" + named)
    with pytest.raises(ConfigError, match=rf"placement colocated sets .*{field}.*leave it out"):
        load_config(path)


def test_a_named_field_agreeing_with_colocated_is_kept(tmp_path: Path) -> None:
    text = "placement: colocated\norchestrator:\n  mode: sync\n"
    text += "trainer:\n  weight_push:\n    mode: handover\n    release_tags: [kv_cache]\n"
    push = load_config(write(tmp_path, text)).trainer.weight_push
    assert push.release_engines_while_training and push.release_tags == ["kv_cache"]


def test_release_on_separate_devices_is_refused(tmp_path: Path) -> None:
    text = (
        "trainer:\n  weight_push:\n    mode: handover\n    release_engines_while_training: true\n"
    )
    with pytest.raises(ConfigError, match=r"placement disaggregated sets trainer\.weight_push"):
        load_config(write(tmp_path, text))
    # Disaggregated leaves the orchestrator's mode to the file.
    async_text = "orchestrator:\n  mode: async\n"
    assert load_config(write(tmp_path, async_text)).orchestrator.mode == "async"


def test_the_trainer_pushes_to_the_engines_section(tmp_path: Path) -> None:
    text = "engines:\n  urls: [http://e0:30000, http://e1:30000]\n"
    cfg = load_config(write(tmp_path, text))
    assert cfg.trainer.weight_push.engine_urls == ["http://e0:30000", "http://e1:30000"]
    assert load_settings(TrainerSettings, write(tmp_path, text)).trainer.weight_push.engine_urls[
        1
    ] == ("http://e1:30000")


def test_the_engines_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SEARCHR1_ENGINES__URLS", '["http://engine:30000"]')
    monkeypatch.setenv("SEARCHR1_ENGINES__ROUTER_URL", "http://router:30000")
    assert load_settings(TrainerSettings).trainer.weight_push.engine_urls == ["http://engine:30000"]
    assert load_settings(OrchestratorSettings).engines.router_url == "http://router:30000"


def test_named_push_urls_win_over_the_engines_section(tmp_path: Path) -> None:
    # A trainer that reaches the engines elsewhere (a proxy; Helm colocated: its node's own).
    text = "engines:\n  urls: [http://e0:30000]\n"
    text += "trainer:\n  weight_push:\n    engine_urls: [http://proxy:9000]\n"
    cfg = load_config(write(tmp_path, text))
    assert cfg.trainer.weight_push.engine_urls == ["http://proxy:9000"]
    assert cfg.engines.urls == ["http://e0:30000"]


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("engine_url: http://e:1", r"engine_url moved to the stack-level engines\.urls"),
        ("engine_urls: [http://e:1]", r"engine_urls moved to the stack-level engines\.urls"),
        ("engine_probe_s: 1.0", r"engines\.probe_s"),
        ("engine_spill_at_in_flight: 4", r"engines\.spill_at_in_flight"),
    ],
)
def test_the_old_orchestrator_engine_fields_are_refused_naming_the_new(
    tmp_path: Path, old: str, new: str
) -> None:
    with pytest.raises(ConfigError, match=rf"orchestrator: .*{new}"):
        load_config(write(tmp_path, f"orchestrator:\n  {old}\n"))


def test_engines_need_an_engine_each_once(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"engines: set urls .* or router_url"):
        load_config(write(tmp_path, "engines:\n  urls: []\n"))
    with pytest.raises(ConfigError, match=r"each engine once"):
        load_config(write(tmp_path, "engines:\n  urls: [http://e:1, http://e:1]\n"))
    # A router alone serves the orchestrator (a trainer that pushes names where).
    assert load_config(write(tmp_path, "engines:\n  urls: []\n  router_url: http://r:1\n"))
