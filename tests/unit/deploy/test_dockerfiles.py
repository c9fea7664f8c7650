"""Dockerfiles, checked without a Docker engine: non-root, health checks, sources that exist and
are not excluded by .dockerignore, entrypoints and ports that match the code."""

from __future__ import annotations

import fnmatch
import http.server
import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest
import yaml

from tests.unit.deploy import stack

DOCKERFILES = sorted(stack.DOCKER.glob("*.Dockerfile"))
IDS = [p.stem for p in DOCKERFILES]


def _dockerignored(rel: str) -> bool:
    """Docker's rule: the last matching pattern wins; `!` re-includes; dirs cover contents."""
    patterns = [
        line.strip()
        for line in (stack.ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    parts = rel.strip("/").split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for pat in patterns:
        negate = pat.startswith("!")
        pat = pat.lstrip("!").rstrip("/")
        hit = pat == "**" or any(
            fnmatch.fnmatch(p, pat) or fnmatch.fnmatch(p, pat.replace("**/", "*/"))
            for p in prefixes
        )
        if hit:
            ignored = not negate
    return ignored


def test_dockerignore_matcher_can_fail() -> None:
    assert _dockerignored("tests/conftest.py")
    assert _dockerignored("retriever/__pycache__/x.pyc")
    assert not _dockerignored("retriever/cli.py")


def test_one_dockerfile_per_service() -> None:
    assert {p.stem for p in DOCKERFILES} == set(stack.IMAGES)


def _copied_packages(path: Path) -> set[str]:
    """Top-level directories the build stages COPY into /src (what the wheel is built from)."""
    out = set()
    for ins, rest in stack.parse_dockerfile(path, final_stage_only=False).instructions:
        *sources, dest = rest.split()
        if ins == "COPY" and dest.startswith("/src/") and not rest.startswith("--"):
            out |= {s.rstrip("/") for s in sources if (stack.ROOT / s).is_dir()}
    return out


@pytest.mark.parametrize("path", DOCKERFILES, ids=IDS)
def test_the_image_holds_every_package_its_service_imports(path: Path) -> None:
    """`searchr1 <service>` runs stack.cli, then the service's CLI: every package of this
    repository they can import (transitively, lazy imports too) is copied into the build and
    passes .dockerignore."""
    modules, _ = stack.service_imports(path.stem)
    packages = {m.split(".")[0] for m in modules}
    assert {"stack", "searchr1", path.stem} <= packages
    missing = packages - _copied_packages(path)
    assert not missing, f"{path.name} does not COPY {sorted(missing)}"
    for pkg in packages:
        assert not _dockerignored(f"{pkg}/__init__.py"), f"{pkg} is excluded by .dockerignore"


def test_the_import_closure_can_fail(tmp_path: Path) -> None:
    """The closure follows lazy and relative imports: without them the gateway would seem to
    need no tokenizer, and gateway.core none of its siblings."""
    modules, third = stack.service_imports("gateway")
    assert {"gateway.wiring", "gateway.core", "engine_client.client"} <= modules
    assert {"transformers", "fastapi", "redis"} <= third  # transformers: imported in a function
    df = tmp_path / "gateway.Dockerfile"
    df.write_text((stack.DOCKER / "gateway.Dockerfile").read_text().replace(
        "COPY engine_client /src/engine_client\n", ""))  # fmt: skip
    assert "engine_client" not in _copied_packages(df)


def _cpu_image_installs() -> set[str]:
    """On the python base the deps stage installs the lock's entries for pyproject.toml's
    runtime dependencies (install-deps.sh): their canonical names."""
    req = _load("requirements")
    pyproject, lock = stack.ROOT / "pyproject.toml", stack.ROOT / "requirements.lock"
    return {
        req.requirement_name(line)
        for line in req.locked(lock, req.dependencies(pyproject))
        if not line.lstrip().startswith("--")
    }


@pytest.mark.parametrize("service", ["gateway", "orchestrator"])
def test_the_cpu_image_installs_what_its_service_imports(service: str) -> None:
    """Every third-party package the service's code can import is installed in its image (not
    only in an extra, or merely present in this venv): the `openai` client the gateway's tests
    drive it with, for one, is a dev extra and must stay out of the gateway's code."""
    from importlib.metadata import packages_distributions

    req = _load("requirements")
    installed = _cpu_image_installs()
    assert "transformers" in installed and "openai" not in installed  # the check can fail
    dists = packages_distributions()
    _, third = stack.service_imports(service)
    for name in sorted(third):
        assert name in dists, f"{service} imports {name}, which no installed package provides"
        provided = {req.canonical(d) for d in dists[name]}
        assert provided & installed, f"{service} imports {name} ({provided}): not in the image"


@pytest.mark.parametrize("path", DOCKERFILES, ids=IDS)
def test_copy_sources_exist_and_reach_the_build(path: Path) -> None:
    for ins, rest in stack.parse_dockerfile(path, final_stage_only=False).instructions:
        if ins not in ("COPY", "ADD"):
            continue
        args = rest.split()
        if any(a.startswith("--from=") for a in args):
            continue
        sources = [a for a in args if not a.startswith("--")][:-1]
        assert sources, rest
        for src in sources:
            assert (stack.ROOT / src).exists(), f"{path.name}: COPY {src} does not exist"
            assert not _dockerignored(src), f"{path.name}: {src} is excluded by .dockerignore"


@pytest.mark.parametrize("path", DOCKERFILES, ids=IDS)
def test_final_stage_runs_non_root_with_a_healthcheck(path: Path) -> None:
    text = path.read_text()
    df = stack.parse_dockerfile(path)
    users = df.all("USER")
    assert users, f"{path.name}: no USER in the final stage"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, "numeric non-root uid (Kubernetes runAsNonRoot)"
    assert f"--uid {uid}" in text, "the uid is created"
    hc = df.all("HEALTHCHECK")
    assert len(hc) == 1 and "CMD" in hc[0]
    service, probe = stack.healthcheck_probe(yaml.safe_load(hc[0].split("CMD", 1)[1]))
    assert service == path.stem and probe in stack.served_paths()


@pytest.mark.parametrize("path", DOCKERFILES, ids=IDS)
def test_builds_without_a_registry_frontend(path: Path) -> None:
    """A `# syntax=` line makes BuildKit pull a frontend image from Docker Hub; the engine's
    built-in frontend handles everything used here (ARG before FROM, RUN --mount)."""
    text = path.read_text()
    assert not re.search(r"^#\s*syntax\s*=", text, re.M | re.I)
    assert "RUN --mount=type=cache" in text
    froms = [
        rest for ins, rest in stack.parse_dockerfile(path, False).instructions if ins == "FROM"
    ]
    stages = {f.split(" AS ")[1] for f in froms if " AS " in f}
    for f in froms:  # every base is the overridable BASE_IMAGE or an earlier stage
        assert f.split()[0] in ({"${BASE_IMAGE}"} | stages), f


def _layers(path: Path) -> list[tuple[str, str]]:
    """The instructions that make filesystem layers (or feed them), with BASE_IMAGE's default
    left out: equal lists mean equal layers on the same base."""
    metadata = {"ENV", "LABEL", "USER", "WORKDIR", "EXPOSE", "HEALTHCHECK", "ENTRYPOINT", "CMD"}
    return [
        (ins, rest)
        for ins, rest in stack.parse_dockerfile(path, final_stage_only=False).instructions
        if ins not in metadata and not rest.startswith("BASE_IMAGE=")
    ]


def _shared_layers(path: Path) -> list[tuple[str, str]]:
    """`_layers` without the trainer's extras: its `extras` stage and the layer installing
    that stage's wheels."""
    out, in_extras = [], False
    for ins, rest in _layers(path):
        if ins == "FROM":
            in_extras = rest.endswith(" AS extras")
        if not in_extras and "from=extras" not in rest:
            out.append((ins, rest))
    return out


def test_the_images_share_every_layer() -> None:
    """On one base (the compose `cpu` profile) the images differ only in metadata and the
    trainer's extras layer, so the venv is stored once, not once per image."""
    first = _shared_layers(DOCKERFILES[0])
    assert any("COPY --from=deps /opt/venv" in f"{i} {r}" for i, r in first)
    for path in DOCKERFILES[1:]:
        assert _shared_layers(path) == first, f"{path.name} differs from {DOCKERFILES[0].name}"
    for path in DOCKERFILES:
        if path.stem != "trainer":
            assert _layers(path) == _shared_layers(path), f"{path.name} has extras"


def test_the_trainer_image_installs_the_megatron_extra_above_the_shared_venv() -> None:
    """`trainer.backend: megatron` needs megatron-core: the trainer image installs the
    `megatron` extra by default, in a layer of its own right above the shared venv (so the
    venv layer stays the one all images share)."""
    import tomllib

    layers = _layers(stack.DOCKER / "trainer.Dockerfile")
    final = layers[max(i for i, (ins, _) in enumerate(layers) if ins == "FROM") :]
    venv = next(i for i, (_, r) in enumerate(final) if r.startswith("--from=deps /opt/venv"))
    ins, rest = final[venv + 1]
    assert ins == "RUN" and "from=extras" in rest and "--no-deps --no-index" in rest
    extras_stage = [r for i, r in layers if i in ("ARG", "RUN")]
    assert "TRAINER_EXTRAS=megatron" in extras_stage
    assert any('install-deps.sh extras "$TRAINER_EXTRAS"' in r for r in extras_stage)
    extras = tomllib.loads((stack.ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert any(r.startswith("megatron-core") for r in extras["megatron"])


def test_the_layer_comparison_can_fail(tmp_path: Path) -> None:
    other = tmp_path / "x.Dockerfile"
    other.write_text(DOCKERFILES[0].read_text().replace("/opt/venv /opt/venv", "/opt/venv /v"))
    assert _layers(other) != _layers(DOCKERFILES[0])


@pytest.mark.parametrize("path", DOCKERFILES, ids=IDS)
def test_entrypoint_ports_and_host_match_the_code(path: Path) -> None:
    df = stack.parse_dockerfile(path)
    entry, cmd = df.exec_form("ENTRYPOINT"), df.exec_form("CMD")
    assert entry == ["searchr1", path.stem]
    stack.check_cli(entry[1:] + cmd)
    env = dict(kv.split("=", 1) for rest in df.all("ENV") for kv in rest.split() if "=" in kv)
    searchr1_env = {k: v for k, v in env.items() if k.startswith(stack.env_prefix())}
    for name in searchr1_env:
        assert stack.config_field_path(name), f"{path.name}: {name} is no config field"
    cfg = stack.load_with_env(searchr1_env)
    section = getattr(cfg, path.stem)
    assert section.http.host == "0.0.0.0"
    exposed = {int(p) for rest in df.all("EXPOSE") for p in rest.split()}
    assert section.http.port in exposed
    if path.stem == "retriever":
        assert section.grpc_port in exposed
    if path.stem == "trainer":
        assert section.weight_push.master_port in exposed


@pytest.mark.parametrize("path", DOCKERFILES, ids=IDS)
def test_base_images_are_pinned(path: Path) -> None:
    for ins, rest in stack.parse_dockerfile(path, final_stage_only=False).instructions:
        if ins == "ARG" and rest.startswith("BASE_IMAGE="):
            image = rest.split("=", 1)[1]
            assert ":" in image and not image.endswith(":latest"), image


def test_dependency_list_is_pyprojects() -> None:
    import tomllib

    mod = _load("requirements")
    project = tomllib.loads((stack.ROOT / "pyproject.toml").read_text())["project"]
    assert mod.dependencies(stack.ROOT / "pyproject.toml") == project["dependencies"]
    extras = project["optional-dependencies"]
    assert mod.extras(stack.ROOT / "pyproject.toml", "megatron") == extras["megatron"]
    assert mod.extras(stack.ROOT / "pyproject.toml", "megatron, dev") == (
        extras["megatron"] + extras["dev"]
    )
    assert mod.extras(stack.ROOT / "pyproject.toml", "") == []
    with pytest.raises(KeyError, match="no extra 'megatrom'"):
        mod.extras(stack.ROOT / "pyproject.toml", "megatrom")


def test_installed_reads_pips_install_report(tmp_path: Path) -> None:
    """What an extras install added (`pip install --report`), as pins for `pip wheel`."""
    import json

    report = tmp_path / "r.json"
    rows = [{"metadata": {"name": "megatron-core", "version": "0.16.1"}, "is_direct": False}]
    report.write_text(json.dumps({"version": "1", "install": rows}))
    assert _load("requirements").installed(report) == ["megatron-core==0.16.1"]


def _load(name: str):  # type: ignore[no-untyped-def]
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"docker_{name}", stack.DOCKER / f"{name}.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def http_server() -> Iterator[int]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/ready" else 503)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def test_healthcheck_script_probes_the_configured_port(http_server: int) -> None:
    from searchr1.redis_server import free_port

    hc = stack.healthcheck_module()
    env = {"SEARCHR1_RETRIEVER__HTTP__PORT": str(http_server),
           "SEARCHR1_TRAINER__HTTP__PORT": str(free_port())}  # fmt: skip
    with mock.patch.dict(os.environ, env):
        assert hc.check("retriever", "/ready")
        assert not hc.check("retriever", "/health")  # 503
        assert not hc.check("trainer", "/ready", timeout_s=1)  # nothing listens there


def test_the_copied_context_builds_the_package(tmp_path: Path) -> None:
    """Replay the build stages' COPY lines into a directory and build the wheel from it, as
    `pip wheel --no-deps /src` does in the image: nothing the build needs is left out."""
    import shutil
    import subprocess
    import sys
    import zipfile

    df = stack.parse_dockerfile(stack.DOCKER / "retriever.Dockerfile", final_stage_only=False)
    froms = [n for n, (ins, _) in enumerate(df.instructions) if ins == "FROM"]
    build_stages = df.instructions[froms[0] : froms[-1]]
    src = tmp_path / "src"
    for ins, rest in build_stages:
        *sources, dest = rest.split()
        if ins != "COPY" or not dest.startswith("/src"):
            continue
        target = src / dest.removeprefix("/src").strip("/")
        for s in sources:
            path = stack.ROOT / s
            if path.is_dir():
                shutil.copytree(path, target, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                target.mkdir(parents=True, exist_ok=True)
                shutil.copy(path, target / path.name)
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    r = subprocess.run([*cmd, str(src), "-w", str(tmp_path / "w")], capture_output=True,
                       text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    (wheel,) = (tmp_path / "w").glob("searchr1-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for pkg in stack.IMAGES:
        assert f"{pkg}/cli.py" in names
    assert {"protos/trajectory.proto", "stack/cli.py"} <= names
