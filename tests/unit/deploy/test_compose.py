"""docker-compose.yml: the compose specification, Redis, GPUs, profiles, start order, volumes."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import yaml

from tests.unit.deploy import stack

RAW = stack.compose_raw()
SERVICES = RAW["services"]


def _check_jsonschema(path: Path) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("check-jsonschema", path=str(Path(sys.executable).parent))
    assert exe, "check-jsonschema is not installed (pip install -e '.[dev]')"
    # The compose schema is vendored in the package: no network.
    cmd = [exe, "--builtin-schema", "vendor.compose-spec", str(path)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def test_matches_the_compose_specification() -> None:
    r = _check_jsonschema(stack.COMPOSE)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_schema_check_can_fail(tmp_path: Path) -> None:
    bad = yaml.safe_load(stack.COMPOSE.read_text())
    bad["services"]["redis"]["restart_policy"] = "always"  # not a service key
    path = tmp_path / "compose.yml"
    path.write_text(yaml.safe_dump(bad))
    assert _check_jsonschema(path).returncode != 0


def _profile_services(profile: str) -> dict[str, dict]:
    return {n: s for n, s in SERVICES.items() if profile in s.get("profiles", [profile])}


def _gpu_devices(svc: dict) -> list[dict]:
    devices = svc.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
    return [d for d in devices if "gpu" in d.get("capabilities", [])]


@pytest.mark.parametrize("profile", ["gpu", "cpu"])
def test_each_profile_runs_the_whole_stack(profile: str) -> None:
    active = _profile_services(profile)
    containers = stack.compose_containers()
    runs = {containers[n].service for n in active} - {None}
    assert runs == set(stack.SERVICES), profile
    assert "redis" in active
    gpu_users = {containers[n].service for n, s in active.items() if _gpu_devices(s)}
    assert gpu_users == ({"inference", "trainer"} if profile == "gpu" else set())
    # One engine per profile, reachable under the same name.
    engines = [n for n in active if containers[n].service == "inference"]
    assert len(engines) == 1


def test_gpu_services_use_different_gpus_and_engines() -> None:
    ids = [d["device_ids"] for n in ("inference", "trainer") for d in _gpu_devices(SERVICES[n])]
    assert len(ids) == 2 and ids[0] != ids[1]
    assert SERVICES["inference"]["command"][:3] == ["serve", "--engine", "sglang"]
    assert SERVICES["inference-cpu"]["command"][:3] == ["serve", "--engine", "torch"]


def test_redis_has_a_password_and_aof_persistence() -> None:
    redis = SERVICES["redis"]
    cmd = " ".join(redis["command"])
    assert "--appendonly yes" in cmd and "--requirepass" in cmd
    # The bus's zero-loss, exactly-once promise needs every ack on disk before it is answered.
    assert "--appendfsync always" in cmd
    assert any(v.endswith(":/data") for v in redis["volumes"])
    assert "redis-cli ping" in " ".join(redis["healthcheck"]["test"])
    # The URL the services use carries the same password variable.
    url = next(s["environment"]["SEARCHR1_REDIS__URL"] for s in SERVICES.values()
               if "SEARCHR1_REDIS__URL" in s.get("environment", {}))  # fmt: skip
    assert "${REDIS_PASSWORD" in url and "${REDIS_PASSWORD" in redis["environment"]["REDISCLI_AUTH"]


def test_start_order_follows_health_checks() -> None:
    for name, svc in SERVICES.items():
        for dep, cond in (svc.get("depends_on") or {}).items():
            assert cond["condition"] in ("service_healthy", "service_completed_successfully")
            if cond["condition"] == "service_healthy":
                assert "healthcheck" in SERVICES[dep], f"{name} waits on {dep}, which has none"
            if cond.get("required", True):  # a required dependency must be in the same profiles
                mine, theirs = set(svc.get("profiles", [])), set(SERVICES[dep].get("profiles", []))
                assert not theirs or (mine and mine <= theirs), (name, dep)


def test_volumes_for_index_corpus_models_checkpoints() -> None:
    assert {"index", "corpus", "models", "checkpoints", "data", "redis-data"} <= set(RAW["volumes"])
    mounts = {
        v.split(":")[0]: n
        for n, s in SERVICES.items()
        for v in s.get("volumes", [])
        if isinstance(v, str)
    }
    for vol in RAW["volumes"]:
        assert vol in mounts, f"volume {vol} is mounted nowhere"


def test_secrets_come_from_the_environment_only() -> None:
    text = stack.COMPOSE.read_text()
    for name in stack.secret_env_names() | {"REDIS_PASSWORD"}:
        for m in re.finditer(rf"\b{name}: (.*)", text):
            assert m.group(1).startswith("${"), f"{name} has a literal value"
    # Every variable the file interpolates is documented in docker/env.example.
    documented = (stack.DOCKER / "env.example").read_text()
    for var in set(re.findall(r"\$\{(\w+)", text)):
        assert var in documented, f"${{{var}}} is not in docker/env.example"


def test_every_service_mounts_the_same_config_file() -> None:
    for name, c in stack.compose_containers().items():
        if c.service:
            mounts = [v for v in SERVICES[name]["volumes"] if isinstance(v, dict)]
            assert any(m["target"] == c.env[stack.config_file_env()] for m in mounts), name


def test_every_image_can_come_from_elsewhere() -> None:
    """A site without Docker Hub names its own images: Redis, every base, every service."""
    for name, svc in SERVICES.items():
        assert svc["image"].startswith("${"), f"{name}: image {svc['image']} is hard-coded"
        build = svc.get("build")
        if build:
            base = build["args"]["BASE_IMAGE"]
            assert re.fullmatch(r"\$\{SEARCHR1_\w+_IMAGE:-[^}]+\}", base), (name, base)
            for arg in ("TORCH_INDEX", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_TRUSTED_HOST"):
                assert build["args"][arg].startswith("${SEARCHR1_"), (name, arg)
            assert build["network"].startswith("${SEARCHR1_BUILD_NETWORK"), name


def test_build_args_are_the_dockerfiles_arguments() -> None:
    for name, svc in SERVICES.items():
        if "build" in svc:
            text = (stack.ROOT / svc["build"]["dockerfile"]).read_text()
            declared = set(re.findall(r"^ARG (\w+)", text, re.M))
            assert set(svc["build"]["args"]) <= declared, name


def test_one_shot_containers_have_no_health_check() -> None:
    """They inherit the image's HEALTHCHECK otherwise, and show "unhealthy" once they exit 0."""
    for name, svc in SERVICES.items():
        if svc.get("restart") == "no":
            assert svc["healthcheck"] == {"disable": True}, name


def test_cpu_profile_is_the_demo() -> None:
    """Setup, evaluation before, GRPO, report after: in this order, by the compose conditions."""

    def waits_for(name: str) -> dict[str, str]:
        return {d: c["condition"] for d, c in (SERVICES[name].get("depends_on") or {}).items()}

    assert waits_for("retriever")["demo-setup"] == "service_completed_successfully"
    assert waits_for("inference-cpu")["demo-setup"] == "service_completed_successfully"
    assert waits_for("demo-eval-before") == {
        "retriever": "service_healthy", "inference-cpu": "service_healthy"}  # fmt: skip
    assert waits_for("orchestrator")["demo-eval-before"] == "service_completed_successfully"
    assert waits_for("demo-report") == {"trainer-cpu": "service_completed_successfully"}
    # The engine serves, and the trainer trains, the model demo-setup warm-started.
    setup = SERVICES["demo-setup"]["command"]
    warm = setup[setup.index("--model") + 1]
    assert SERVICES["inference-cpu"]["command"][-2:] == ["--model", warm]
    assert SERVICES["trainer-cpu"]["command"][-2:] == ["--model", warm]
    cfg = stack.load_with_env({}, stack.DOCKER / "cpu-demo.yaml")
    assert cfg.trainer.model.path == cfg.inference.model_path == warm
    # What the report reads is on the volume the others write.
    assert cfg.trainer.metrics_jsonl.startswith("/runs/")
    for name in ("demo-setup", "demo-eval-before", "trainer-cpu", "demo-report"):
        assert "runs:/runs" in SERVICES[name]["volumes"], name


def test_demo_steps_parse_with_their_commands() -> None:
    import contextlib
    import io

    from demos import containers

    for name in ("demo-setup", "demo-report"):
        svc = SERVICES[name]
        assert svc["entrypoint"] == ["python", "-m", "demos.containers"]
        # The step's image is built with the demos package (it is no service's import).
        image = svc["image"].split("/")[-1].split(":")[0]
        dockerfile = (stack.DOCKER / f"{image}.Dockerfile").read_text()
        assert "COPY demos /src/demos" in dockerfile, image
        assert "!demos/" in (stack.ROOT / ".dockerignore").read_text().splitlines()
        with (
            mock.patch.object(containers, "setup") as setup,
            mock.patch.object(containers, "report") as report,
        ):
            containers.main(svc["command"])
        assert (setup if name == "demo-setup" else report).called
    with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()):
        containers.main(["setup", "--no-such-flag"])
    ctx = stack.check_cli(SERVICES["demo-eval-before"]["command"])
    assert str(ctx.params["data"]) == "/data/test.jsonl"


def test_env_file_is_ignored_by_git() -> None:
    ignored = (stack.ROOT / ".gitignore").read_text().splitlines()
    assert ".env" in ignored
