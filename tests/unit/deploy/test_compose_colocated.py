"""docker-compose.colocated.yml: the colocated placement as an override of docker-compose.yml
(`docker compose -f docker-compose.yml -f docker-compose.colocated.yml --profile gpu|cpu`).

Checked offline: the override against the compose specification, and the two files merged by
the compose merge rules (docs.docker.com/reference/compose-file/merge, with !override and
!reset) into the model `docker compose config` would print; where Docker Compose is installed,
`docker compose config` itself renders it."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.unit.deploy import stack
from tests.unit.deploy.test_compose import _check_jsonschema

OVERRIDE = stack.ROOT / "docker-compose.colocated.yml"
PAIRS = {"gpu": ("inference", "trainer"), "cpu": ("inference-cpu", "trainer-cpu")}


class _Override:
    def __init__(self, value: Any) -> None:
        self.value = value


_RESET = object()


class _Loader(yaml.SafeLoader):
    pass


def _construct_override(loader: yaml.SafeLoader, node: yaml.Node) -> _Override:
    if isinstance(node, yaml.SequenceNode):
        return _Override(loader.construct_sequence(node, deep=True))
    if isinstance(node, yaml.MappingNode):
        return _Override(loader.construct_mapping(node, deep=True))
    return _Override(loader.construct_scalar(node))  # type: ignore[arg-type]


_Loader.add_constructor("!override", _construct_override)
_Loader.add_constructor("!reset", lambda loader, node: _RESET)


def _load_override() -> dict[str, Any]:
    return yaml.load(OVERRIDE.read_text(), Loader=_Loader)  # a SafeLoader with two tags


def _plain(value: Any) -> Any:
    """The override as a plain compose file: !override's value, !reset keys left out."""
    if isinstance(value, _Override):
        return _plain(value.value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if v is not _RESET}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _merge(base: Any, over: Any, key: str = "") -> Any:
    """Compose's merge: mappings merge by key, sequences append (command and entrypoint are
    replaced), scalars are replaced; !override replaces, !reset removes."""
    if isinstance(over, _Override):
        return _plain(over.value)
    if isinstance(base, dict) and isinstance(over, dict):
        out = dict(base)
        for k, v in over.items():
            if v is _RESET:
                out.pop(k, None)
            elif k in out:
                out[k] = _merge(out[k], v, k)
            else:
                out[k] = _plain(v)
        return out
    if isinstance(base, list) and isinstance(over, list) and key not in ("command", "entrypoint"):
        return base + _plain(over)
    return _plain(over)


MERGED = _merge(stack.compose_raw(), _load_override())
SERVICES = MERGED["services"]


def _env(name: str) -> dict[str, str]:
    raw = {k: str(v) for k, v in (SERVICES[name].get("environment") or {}).items()}
    return {k: stack._interpolate(v, {}) for k, v in raw.items()}


def _gpu_devices(svc: dict[str, Any]) -> list[dict[str, Any]]:
    devices = svc.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
    return [d for d in devices if "gpu" in d.get("capabilities", [])]


def test_override_and_merged_model_match_the_compose_specification(tmp_path: Path) -> None:
    for name, doc in (("override", _plain(_load_override())), ("merged", MERGED)):
        path = tmp_path / f"{name}.yml"
        path.write_text(yaml.safe_dump(doc))
        r = _check_jsonschema(path)
        assert r.returncode == 0, (name, r.stdout + r.stderr)


def test_override_only_adjusts_services_of_the_base_file() -> None:
    over = _load_override()["services"]
    assert set(over) <= set(stack.compose_raw()["services"])
    # No new images, commands or volumes: the same containers, placed differently.
    for name, svc in over.items():
        assert set(svc) <= {"ipc", "shm_size", "environment", "deploy"}, name


@pytest.mark.parametrize("profile", list(PAIRS))
def test_engine_and_trainer_share_ipc_and_dev_shm(profile: str) -> None:
    engine, trainer = (SERVICES[n] for n in PAIRS[profile])
    assert engine["ipc"] == "shareable"
    assert re.fullmatch(r"\d+gb", engine["shm_size"]), engine["shm_size"]
    # The trainer joins the engine's IPC namespace: same /dev/shm, SysV and POSIX IPC.
    assert trainer["ipc"] == f"service:{PAIRS[profile][0]}"
    assert "shm_size" not in trainer  # the engine's /dev/shm sizes both
    assert trainer["depends_on"][PAIRS[profile][0]]["condition"] == "service_healthy"
    assert profile in engine["profiles"] and profile in trainer["profiles"]


def test_gpu_pair_reserves_the_same_gpu() -> None:
    engine, trainer = (SERVICES[n] for n in PAIRS["gpu"])
    assert _gpu_devices(engine) == _gpu_devices(trainer)
    assert len(_gpu_devices(trainer)) == 1 and len(_gpu_devices(trainer)[0]["device_ids"]) == 1
    # Without the override the two differ (test_compose.py): the override changed that.
    assert _gpu_devices(stack.compose_raw()["services"]["trainer"]) != _gpu_devices(trainer)
    assert not _gpu_devices(SERVICES["inference-cpu"]) and not _gpu_devices(SERVICES["trainer-cpu"])


@pytest.mark.parametrize(("profile", "fmt"), [("gpu", "sglang"), ("cpu", "searchr1")])
def test_trainer_hands_weights_over_and_releases_the_engine(profile: str, fmt: str) -> None:
    env = _env(PAIRS[profile][1])
    cfg = stack.load_with_env({k: v for k, v in env.items() if k.startswith("SEARCHR1_")})
    push = cfg.trainer.weight_push
    assert push.mode == "handover" and push.release_engines_while_training
    assert push.handover_format == fmt  # SGLang's own pickles / our engine's described handles
    engine = PAIRS[profile][0]
    # The engine it pushes to is the one it shares the IPC namespace with.
    aliases = SERVICES[engine]["networks"]["default"]["aliases"]
    assert {u.split("//")[1].split(":")[0] for u in push.engine_urls} <= {engine, *aliases}


def test_every_container_sees_a_valid_colocated_stack() -> None:
    """stack.config checks placement colocated together with sync rollouts, handover and
    release: each searchr1 container's environment must be a valid stack on its own."""
    containers = stack.compose_containers()
    names = [n for n, c in containers.items() if c.service]
    assert {"retriever", "orchestrator", *PAIRS["gpu"], *PAIRS["cpu"]} <= set(names)
    for name in names:
        env = {k: v for k, v in _env(name).items() if k.startswith("SEARCHR1_")}
        for var in env.keys() - {stack.config_file_env()} - stack.secret_env_names():
            assert stack.config_field_path(var), f"{name}: {var} is no config field"
        cfg = stack.load_with_env(env)
        assert cfg.placement == "colocated", name
        assert cfg.orchestrator.mode == "sync", name


def test_override_variables_are_documented() -> None:
    documented = (stack.DOCKER / "env.example").read_text()
    for var in set(re.findall(r"\$\{(\w+)", OVERRIDE.read_text())):
        assert var in documented, f"${{{var}}} is not in docker/env.example"


def _docker_compose() -> list[str] | None:
    docker = shutil.which("docker")
    if docker is None:
        return None
    r = subprocess.run([docker, "compose", "version"], capture_output=True, text=True, timeout=30)
    return [docker, "compose"] if r.returncode == 0 else None


@pytest.mark.parametrize("profile", list(PAIRS))
def test_docker_compose_config_renders_the_colocated_pair(profile: str) -> None:
    """The real renderer, where installed (this check's merge above stands in elsewhere)."""
    compose = _docker_compose()
    if compose is None:
        pytest.skip("docker compose is not installed")
    env = {**os.environ, "REDIS_PASSWORD": stack.FAKE_SECRET,
           "SEARCHR1_ADMIN_TOKEN": stack.FAKE_SECRET}  # fmt: skip
    cmd = [*compose, "-f", str(stack.COMPOSE), "-f", str(OVERRIDE), "--profile", profile,
           "config", "--format", "json", "--no-interpolate"]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    services = json.loads(r.stdout)["services"]
    engine, trainer = (services[n] for n in PAIRS[profile])
    assert engine["ipc"] == "shareable" and trainer["ipc"] == f"service:{PAIRS[profile][0]}"
    # Compose keeps the list form of `environment` ("KEY=value") under --no-interpolate.
    raw = trainer["environment"]
    env_of = dict(e.split("=", 1) for e in raw) if isinstance(raw, list) else raw
    assert env_of["SEARCHR1_TRAINER__WEIGHT_PUSH__MODE"] == "handover"
    assert env_of["SEARCHR1_PLACEMENT"] == "colocated"
    if profile == "gpu":
        assert _gpu_devices(engine) == _gpu_devices(trainer)
