"""Drift: the ports, env var names, probe paths and commands in docker-compose.yml and the Helm
chart are the ones the services actually read and serve (derived from the code, see stack.py)."""

from __future__ import annotations

from urllib.parse import urlparse

import pytest

from tests.unit.deploy import stack

VALUES = list(stack.VALUES_FILES)


def all_containers() -> list[stack.Container]:
    out = list(stack.compose_containers().values())
    for v in VALUES:
        out.extend(stack.chart_containers(v))
    return [c for c in out if c.service]


CONTAINERS = all_containers()
IDS = [c.where for c in CONTAINERS]


def test_every_service_is_deployed_by_compose_and_chart() -> None:
    for where in ("compose", "k8s/default", "k8s/cluster"):
        services = {c.service for c in CONTAINERS if c.where.startswith(where)}
        # The gateway: in compose under its profile; in the chart only when enabled.
        optional = set(stack.OPTIONAL_SERVICES) if where == "compose" else set()
        assert services == set(stack.SERVICES) | optional, where
    gateway = {c.service for c in CONTAINERS if c.where.startswith("k8s/gateway:")}
    assert "gateway" in gateway and "orchestrator" not in gateway


@pytest.mark.parametrize("c", CONTAINERS, ids=IDS)
def test_command_parses_with_the_real_cli(c: stack.Container) -> None:
    stack.check_cli(c.argv)  # raises CliError on an unknown command, option or value


@pytest.mark.parametrize("c", CONTAINERS, ids=IDS)
def test_env_names_are_read_by_the_services(c: stack.Container) -> None:
    prefix = stack.env_prefix()
    for name in c.env_names:
        if name == stack.config_file_env() or name in stack.secret_env_names():
            continue
        if name.startswith(prefix):
            assert stack.config_field_path(name), f"{c.where}: {name} is no config field"
        else:
            # Not ours: NCCL/torch settings, or a helper variable expanded into another value.
            used = any(f"$({name})" in v or f"${{{name}}}" in v for v in c.raw_env.values())
            assert name.startswith(("NCCL_", "TORCH_")) or name == "NODE_RANK" or used, (
                f"{c.where}: {name} is read by nothing"
            )


@pytest.mark.parametrize("c", CONTAINERS, ids=IDS)
def test_config_loads_and_listens_where_the_file_says(c: stack.Container) -> None:
    cfg = stack.load_with_env({k: v for k, v in c.env.items() if k.startswith("SEARCHR1_")})
    section = getattr(cfg, c.service)
    # Reachable from outside the container, on a port the container declares.
    assert section.http.host == "0.0.0.0", c.where
    assert section.http.port in c.ports, c.where
    if c.service == "retriever" and section.grpc_port is not None:
        assert section.grpc_port in c.ports, c.where
    if c.service == "trainer" and c.where.startswith("k8s"):
        assert section.weight_push.master_port in c.ports, c.where


@pytest.mark.parametrize("c", CONTAINERS, ids=IDS)
def test_probes_hit_served_paths_on_the_service_port(c: stack.Container) -> None:
    cfg = stack.load_with_env({k: v for k, v in c.env.items() if k.startswith("SEARCHR1_")})
    port = getattr(cfg, c.service).http.port
    assert c.probes, f"{c.where} has no health probe"
    for kind, (probe_port, path) in c.probes.items():
        assert probe_port == port, f"{c.where} {kind} probes port {probe_port}, serves {port}"
        served = stack.inference_paths() if c.service == "inference" else stack.served_paths()
        assert path in served and path in ("/health", "/ready", "/health_generate"), c.where
    if c.where.startswith("k8s"):
        assert c.probes["livenessProbe"][1] == "/health"
        ready = c.probes["readinessProbe"][1]
        if c.argv[:4] == ["inference", "serve", "--engine", "sglang"]:
            # SGLang itself has no /ready; its real readiness check is a one-token generation,
            # which the reference engine serves too.
            assert ready == "/health_generate" and ready in stack.inference_paths()
        else:
            assert ready == "/ready"


def test_healthcheck_script_defaults_are_the_config_defaults() -> None:
    assert stack.default_ports() == stack.healthcheck_module().DEFAULT_PORTS


def _compose_targets() -> dict[str, set[int]]:
    """host name -> container ports, as other containers on the compose network see them."""
    targets: dict[str, set[int]] = {}
    raw = stack.compose_raw()["services"]
    for name, c in stack.compose_containers().items():
        names = {
            name,
            *((raw[name].get("networks") or {}).get("default", {}) or {}).get("aliases", []),
        }
        for n in names:
            targets.setdefault(n, set()).update(c.ports)
    targets["redis"] = {6379}
    return targets


def test_compose_urls_point_at_services_and_ports() -> None:
    targets = _compose_targets()
    for c in stack.compose_containers().values():
        if not c.service:
            continue
        cfg = stack.load_with_env({k: v for k, v in c.env.items() if k.startswith("SEARCHR1_")})
        urls = []
        if "SEARCHR1_REDIS__URL" in c.env:
            urls.append(cfg.redis.url)
        if c.service == "orchestrator":
            urls += [cfg.engines.router_url or cfg.engines.urls[0]]
            urls += [*cfg.engines.urls, cfg.orchestrator.search.retriever_url]
        if c.service == "gateway":
            urls.append(cfg.gateway.engine_url)
        if c.service == "trainer":
            urls += cfg.trainer.weight_push.engine_urls
            assert cfg.trainer.weight_push.master_addr in targets, c.where
        for url in urls:
            u = urlparse(url)
            assert u.port in targets.get(u.hostname or "", set()), f"{c.where}: {url}"


@pytest.mark.parametrize("values", VALUES)
def test_chart_urls_point_at_services_and_ports(values: str) -> None:
    docs = stack.render_chart(values)
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    sts = {d["metadata"]["name"]: d for d in docs if d["kind"] == "StatefulSet"}

    def check(url: str, where: str) -> None:
        u = urlparse(url)
        host = u.hostname or ""
        if host in services:
            ports = {p["port"] for p in services[host]["spec"]["ports"]}
        else:  # <statefulset>-<i>.<headless service>: a pod of a StatefulSet or Indexed Job
            pod, _, svc = host.partition(".")
            assert svc in services and services[svc]["spec"].get("clusterIP") == "None", url
            owner, _, idx = pod.rpartition("-")
            if owner in sts:
                assert int(idx) < sts[owner]["spec"]["replicas"], url
            ports = {p["port"] for p in services[svc]["spec"]["ports"]}
        assert u.port in ports, f"{where}: {url}"

    for c in stack.chart_containers(values):
        if not c.service:
            continue
        cfg = stack.load_with_env({k: v for k, v in c.env.items() if k.startswith("SEARCHR1_")})
        if "SEARCHR1_REDIS__URL" in c.env:
            check(cfg.redis.url, c.where)
        if c.service == "orchestrator":
            for url in [cfg.engines.router_url or cfg.engines.urls[0], *cfg.engines.urls]:
                check(url, c.where)
            check(cfg.orchestrator.search.retriever_url, c.where)
        if c.service == "gateway":
            check(cfg.gateway.engine_url, c.where)
        if c.service == "trainer":
            wp = cfg.trainer.weight_push
            urls = wp.engine_urls
            assert len(urls) == stack.chart_values(values)["inference"]["replicas"]
            for url in urls:
                check(url, c.where)
            check(f"http://{wp.master_addr}:{wp.master_port}", c.where)


def _model_arg(c: stack.Container) -> str:
    ctx = stack.check_cli(c.argv)
    return str(ctx.params["model"])


@pytest.mark.parametrize("where", ["compose:gpu", "compose:cpu", *[f"k8s/{v}" for v in VALUES]])
def test_trainer_trains_the_model_the_engines_serve(where: str) -> None:
    # Weight pushes overwrite the engines' parameters by name and shape: same model directory.
    if where.startswith("compose"):
        profile = where.split(":")[1]
        raw = stack.compose_raw()["services"]
        cs = [
            c
            for n, c in stack.compose_containers().items()
            if profile in raw[n].get("profiles", [profile])
        ]
    else:
        cs = [c for c in CONTAINERS if c.where.startswith(where + ":")]
    models = {c.service: _model_arg(c) for c in cs if c.service in ("inference", "trainer")}
    assert len(models) == 2 and models["inference"] == models["trainer"], models


def test_the_cli_check_can_fail() -> None:
    assert stack.check_cli(["retriever", "serve", "--index", "/i"]).params["index"]
    for argv in (
        ["retriever", "serve", "--indexx", "/i"],
        ["retriever", "serv"],
        ["inference", "serve", "--engine", "vllm"],
        ["trainer"],
    ):
        with pytest.raises(stack.CliError):
            stack.check_cli(argv)
    assert stack.config_field_path("SEARCHR1_RETRIEVER__HTTP__PORT") == [
        "retriever",
        "http",
        "port",
    ]
    assert stack.config_field_path("SEARCHR1_RETRIEVER__HTTP__PORTT") is None
    assert stack.config_field_path("SEARCHR1_RETRIEVER") == ["retriever"]


@pytest.mark.parametrize("c", [c for c in CONTAINERS if "sglang" in c.argv], ids=lambda c: c.where)
def test_sglang_serves_metrics_where_scraped(c: stack.Container) -> None:
    # SGLang (started by `inference serve --engine sglang` on the service port) serves /metrics
    # only with --enable-metrics.
    from inference.sglang_launcher import sglang_command

    cfg = stack.load_with_env({k: v for k, v in c.env.items() if k.startswith("SEARCHR1_")})
    cfg.inference.model_path = "/m"
    argv = sglang_command(cfg.inference, host=cfg.inference.http.host, port=cfg.inference.http.port)
    assert "--enable-metrics" in argv
    assert argv[argv.index("--port") + 1] == str(cfg.inference.http.port)
