"""`searchr1 config show` of every shipped configuration equals its stored snapshot.

A config refactor (a field moved, a default derived) must not change what a shipped config
means by accident. Each snapshot under tests/unit/snapshots/ is the effective configuration:

- `configs/<name>.txt`: `searchr1 config show -c configs/<name>.yaml` (the CLI's own function;
  `docker-cpu-demo.txt`: docker/cpu-demo.yaml);
- `deploy-<name>.yaml`: a deployment (compose, each Helm values file): the stack config its
  file gives (Helm: the chart's `config:` values), and per searchr1 container the fields its
  environment changes (engine URLs, placement...), as `section.field: value`.

An intended change: regenerate with `SEARCHR1_UPDATE_SNAPSHOTS=1` (this test file only), read
the diff, and list each changed field in the commit message with why.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml

from searchr1.settings import ConfigError
from tests.unit.deploy import stack

SNAPSHOTS = Path(__file__).parent / "snapshots"
# Every stack config file shipped: configs/ and the compose CPU demo's.
CONFIGS = [*sorted((stack.ROOT / "configs").glob("*.yaml")), stack.DOCKER / "cpu-demo.yaml"]
CHART_VALUES = {
    "chart-default": None,
    "chart-cluster": stack.CHART / "values-cluster.yaml",
    "chart-cpu": stack.CHART / "values-cpu.yaml",
    "chart-colocated-slime": stack.CHART / "values-colocated-slime.yaml",
}
UPDATE = os.environ.get("SEARCHR1_UPDATE_SNAPSHOTS") == "1"


def _check(name: str, text: str) -> None:
    path = SNAPSHOTS / name
    if UPDATE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return
    assert path.exists(), f"no snapshot {path}: run with SEARCHR1_UPDATE_SNAPSHOTS=1"
    assert text == path.read_text(), (
        f"{name} changed: if intended, regenerate with SEARCHR1_UPDATE_SNAPSHOTS=1 and list "
        "each changed field in the commit message"
    )


@pytest.fixture
def no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith(stack.env_prefix()):
            monkeypatch.delenv(key)


def _name(path: Path) -> str:
    return path.stem if path.parent.name == "configs" else f"{path.parent.name}-{path.stem}"


@pytest.mark.parametrize("path", CONFIGS, ids=_name)
def test_config_show_of_each_shipped_config(
    path: Path, no_env: None, capsys: pytest.CaptureFixture[str]
) -> None:
    from stack.cli import config_show

    with contextlib.suppress(typer.Exit):  # an invalid shipped config: its error is the snapshot
        config_show(path)
    out = capsys.readouterr()
    _check(f"configs/{_name(path)}.txt", (out.out + out.err).replace(f"{stack.ROOT}/", ""))


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix.rstrip("."): value}


def _env_changes(env: dict[str, str], config_file: Path | None) -> dict[str, Any]:
    """The fields a container's environment sets, beyond what its config file says."""
    env = {k: v for k, v in env.items() if k.startswith(stack.env_prefix())}
    env.pop(stack.config_file_env(), None)
    base = _flat(stack.load_with_env({}, config_file).model_dump(mode="json"))
    try:
        mine = _flat(stack.load_with_env(env, config_file).model_dump(mode="json"))
    except ConfigError as e:
        return {"error": str(e).replace(str(config_file), "config.yaml")}
    return {k: v for k, v in mine.items() if base.get(k, "<unset>") != v}


def _deployment(config: dict[str, Any], containers: dict[str, dict[str, str]]) -> str:
    """The snapshot text of a deployment: its stack config and each container's changes."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        file = Path(tmp) / "config.yaml"
        file.write_text(yaml.safe_dump(config))
        try:
            full: Any = stack.load_with_env({}, file).model_dump(mode="json")
        except ConfigError as e:  # an invalid shipped config: its error is the snapshot (to fix)
            return str(e).replace(str(file), "config.yaml") + "\n"
        changes = {where: _env_changes(env, file) for where, env in sorted(containers.items())}
    return yaml.safe_dump({"config": full, "containers": changes}, sort_keys=False)


def test_compose_containers_config(no_env: None) -> None:
    from tests.unit.deploy.test_compose_colocated import _env as colocated_env

    config = yaml.safe_load((stack.ROOT / "configs" / "example.yaml").read_text())
    base = {n: c.env for n, c in stack.compose_containers().items() if c.service}
    _check("deploy-compose.yaml", _deployment(config, base))
    colocated = {n: colocated_env(n) for n in base}
    _check("deploy-compose-colocated.yaml", _deployment(config, colocated))


@pytest.mark.parametrize("name", CHART_VALUES)
def test_chart_containers_config(name: str, no_env: None) -> None:
    import helm_python as helm

    path = CHART_VALUES[name]
    values = yaml.safe_load(path.read_text()) if path else None
    with helm.Chart.load(stack.CHART) as chart:
        merged = chart.merge_values(values)
        rendered = chart.render(values, name="rl", namespace="ml")
    containers = {}
    for text in (t for n, t in sorted(rendered.items()) if n.endswith(".yaml")):
        for doc in (d for d in yaml.safe_load_all(text) if d):
            spec = stack.pod_spec(doc)
            for c in spec["containers"] if spec else []:
                if stack._k8s_argv(c):  # a searchr1 container
                    env, _ = stack._k8s_env(c)
                    containers[f"{doc['kind']}/{doc['metadata']['name']}/{c['name']}"] = env
    _check(f"deploy-{name}.yaml", _deployment(merged.get("config") or {}, containers))


@pytest.mark.parametrize("path", CONFIGS, ids=_name)
def test_each_shipped_config_loads(path: Path, no_env: None) -> None:
    stack.load_with_env({}, path)  # a snapshot may hold an error; a shipped config may not
