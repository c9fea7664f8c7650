"""Config: YAML sections, env overrides, errors naming the field, secrets from env only."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from stack.cli import app
from stack.config import ConfigError, load_config


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "stack.yaml"
    path.write_text(text)
    return path


def test_defaults_without_a_file() -> None:
    cfg = load_config()
    assert cfg.retriever.http.port == 8000
    assert cfg.inference.http.port == 30000
    assert cfg.bus.group == "trainer"
    assert cfg.admin_token is None


def test_yaml_sections_and_env_override(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path, "retriever:\n  http:\n    port: 9100\nbus:\n  max_backlog: 3000\n")
    assert load_config(path).retriever.http.port == 9100
    monkeypatch.setenv("SEARCHR1_RETRIEVER__HTTP__PORT", "9200")
    cfg = load_config(path)
    assert cfg.retriever.http.port == 9200  # env beats the file
    assert cfg.bus.max_backlog == 3000  # the rest of the file still applies


def test_invalid_value_names_the_field(tmp_path: Path) -> None:
    path = write(tmp_path, "bus:\n  max_backlog: -3\n")
    with pytest.raises(ConfigError, match=r"bus\.max_backlog: Input should be greater than"):
        load_config(path)


def test_invalid_env_value_names_the_field(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SEARCHR1_TRAINER__HTTP__PORT", "eighty")
    with pytest.raises(ConfigError, match=r"trainer\.http\.port"):
        load_config()


def test_unknown_key_is_an_error_not_ignored(tmp_path: Path) -> None:
    path = write(tmp_path, "retriever:\n  htp:\n    port: 1\n")
    with pytest.raises(ConfigError, match=r"retriever\.htp: Extra inputs are not permitted"):
        load_config(path)


def test_secrets_only_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="SEARCHR1_ADMIN_TOKEN"):
        load_config(write(tmp_path, "admin_token: hunter2\n"))
    monkeypatch.setenv("SEARCHR1_ADMIN_TOKEN", "s3cret")
    cfg = load_config()
    assert cfg.admin_token is not None
    assert cfg.admin_token.get_secret_value() == "s3cret"
    assert "s3cret" not in repr(cfg)


@pytest.mark.parametrize("token", ["", "   ", "s3cret\n", " s3cret"])
def test_an_empty_or_padded_admin_token_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch, token: str
) -> None:
    # An empty token used to switch every guard off (SecretStr("") is falsy) and a trailing
    # newline (a secret file written with echo) could never match a header.
    monkeypatch.setenv("SEARCHR1_ADMIN_TOKEN", token)
    with pytest.raises(ConfigError, match="admin_token") as info:
        load_config()
    assert token.strip() == "" or token.strip() not in str(info.value)  # never echoed


def test_broken_yaml_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "retriever: [unclosed\n"))
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")


def test_cli_reports_the_field_and_exits_2(tmp_path: Path) -> None:
    path = write(tmp_path, "orchestrator:\n  http:\n    port: abc\n")
    result = CliRunner().invoke(app, ["config", "validate", "--config", str(path)])
    assert result.exit_code == 2
    assert "orchestrator.http.port" in result.output
    ok = CliRunner().invoke(app, ["config", "validate"])
    assert ok.exit_code == 0, ok.output


def test_cli_has_a_group_per_service() -> None:
    result = CliRunner().invoke(app, ["--help"])
    assert result.exit_code == 0
    for group in ("retriever", "inference", "orchestrator", "trainer"):
        assert group in result.output


@pytest.mark.parametrize(
    ("section", "port"),
    [("retriever", 8000), ("inference", 30000), ("orchestrator", 8100), ("trainer", 8200)],
)
def test_partial_override_keeps_the_section_defaults(
    tmp_path: Path, section: str, port: int
) -> None:
    # Setting only the host must not reset the service's own default port.
    cfg = load_config(write(tmp_path, f"{section}:\n  http:\n    host: 0.0.0.0\n"))
    http = getattr(cfg, section).http
    assert (http.host, http.port) == ("0.0.0.0", port)


def test_each_service_loads_its_own_section_and_the_shared_run(tmp_path: Path) -> None:
    """Orchestrator and trainer read one `run` section: they cannot disagree on the step size.
    A service skips other services' sections (even invalid ones); the stack checks them all."""
    from orchestrator.config import OrchestratorSettings
    from searchr1.settings import load_settings
    from trainer.config import TrainerSettings

    path = write(
        tmp_path,
        "run:\n  groups_per_step: 16\n  group_size: 4\n"
        "orchestrator:\n  mode: async\n"
        "trainer:\n  not_a_field: 1\n",
    )
    orch = load_settings(OrchestratorSettings, path)
    assert (orch.run.groups_per_step, orch.run.group_size, orch.orchestrator.mode) == (
        16,
        4,
        "async",
    )
    assert not hasattr(orch, "trainer")
    with pytest.raises(ConfigError, match=r"trainer\.not_a_field"):
        load_settings(TrainerSettings, path)
    with pytest.raises(ConfigError, match=r"trainer\.not_a_field"):
        load_config(path)
    # The old per-service copies of the shared numbers are refused, naming the field.
    old = write(tmp_path, "orchestrator:\n  rollout:\n    prompts_per_step: 16\n")
    with pytest.raises(ConfigError, match=r"orchestrator\.rollout\.prompts_per_step"):
        load_settings(OrchestratorSettings, old)


def test_backlog_must_hold_the_trainers_unacked_window(tmp_path: Path) -> None:
    """The trainer acks at checkpoints: a smaller bus bound would deadlock the two services."""
    text = (
        "bus:\n  max_backlog: 1000\n"
        "run:\n  group_size: 8\n  groups_per_step: 16\n"
        "trainer:\n  checkpoint:\n    dir: /tmp/ckpt\n    every_steps: 10\n"
    )
    with pytest.raises(ConfigError, match=r"bus\.max_backlog \(1000\) must be at least 1408"):
        load_config(write(tmp_path, text))
    assert load_config(write(tmp_path, text.replace("1000", "1408"))).bus.max_backlog == 1408
    # Without checkpoints the trainer acks after every step: one step must fit.
    no_ckpt = text.replace("    dir: /tmp/ckpt\n", "").replace("1000", "128")
    assert load_config(write(tmp_path, no_ckpt)).bus.max_backlog == 128
