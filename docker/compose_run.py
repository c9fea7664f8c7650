#!/usr/bin/env python3
"""`python3 dev.py compose`: the compose `cpu` profile (the demo in containers), start to finish.

1. engine: a Docker Engine that answers; as root on Debian without one, install `docker.io`
   and start `dockerd`; compose v2 and buildx plugins from Debian packages if the client lacks
   them;
2. base images: `SEARCHR1_PYTHON_IMAGE` and `SEARCHR1_REDIS_IMAGE` if set, else the registry's
   (python:3.11-slim-bookworm, redis:7.2-alpine), else images built here from Debian
   (debootstrap + the host's added CA certificates + `docker import`), kept for the next run;
3. build: `docker compose --profile cpu build` (layers cached); a local torch wheel found in
   pip's find-links is served as a PEP 503 index on loopback (the build uses the host network);
4. run: `docker compose --profile cpu up -d`, every health check followed, the run followed to
   the end of the demo-report container, its summary line checked (held-out EM gain), then
   `docker compose down -v` (also on failure or Ctrl-C). Exit 0 only if all of it worked.

Standard library only (it runs before anything is installed); a failure exits naming the step.
Timings (build, time to healthy, demo) are printed on the last line as key=value pairs.
"""

from __future__ import annotations

import argparse
import configparser
import contextlib
import functools
import http.server
import importlib.util
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("SEARCHR1_DOCKER_CACHE", "/var/cache/searchr1-docker"))
DEFAULT_PYTHON_IMAGE = "python:3.11-slim-bookworm"
DEFAULT_REDIS_IMAGE = "redis:7.2-alpine"
LOCAL_PYTHON_IMAGE = "searchr1-local/python:3.11-bookworm"
LOCAL_REDIS_IMAGE = "searchr1-local/redis:7-bookworm"
# The four images and the services of the `cpu` profile that must turn healthy.
SERVERS = ("redis", "retriever", "inference-cpu", "orchestrator", "trainer-cpu")
FINAL = "demo-report"
PROJECT = os.environ.get("SEARCHR1_COMPOSE_PROJECT", "searchr1-demo")
BUILD_CACHE_KEEP = os.environ.get("SEARCHR1_BUILD_CACHE_KEEP", "8GB")  # least recent goes first
TORCH_INDEX_PORT = int(os.environ.get("SEARCHR1_TORCH_INDEX_PORT", "47311"))
PLUGIN_PACKAGES = {"compose": "docker-compose", "buildx": "docker-buildx"}  # Debian trixie


ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


class StepFailed(Exception):
    """A step of the run failed; the message names it."""


def log(msg: str) -> None:
    print(f"[compose] {msg}", flush=True)


def run(cmd: list[str], what: str, **kw: object) -> subprocess.CompletedProcess[str]:
    """Run `cmd` (echoed); StepFailed naming `what` on a non-zero exit."""
    print("+", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, text=True, check=False, **kw)  # type: ignore[call-overload]
    if proc.returncode != 0:
        raise StepFailed(f"{what} failed (exit code {proc.returncode}): {' '.join(cmd)}")
    return proc


def quiet(
    cmd: list[str], timeout: float = 60, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run `cmd` capturing its output; a missing program or a timeout is exit code 127."""
    try:
        return subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, check=False, env=env
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return subprocess.CompletedProcess(cmd, 127, "", str(e))


# -- 1. engine ------------------------------------------------------------------------------


def engine_answers() -> bool:
    return quiet(["docker", "info", "--format", "{{.ServerVersion}}"]).returncode == 0


def apt_install(*packages: str) -> None:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    cmd = ["apt-get", "install", "-y", "--no-install-recommends", *packages]
    # dev.py's lock (and deadline): CI builds here while `dev.py test` installs with apt.
    try:
        with dev_script().apt_lock():
            if quiet(cmd, timeout=900).returncode != 0:  # stale package lists: update, retry
                run(["apt-get", "update"], "apt-get update", env=env)
                run(cmd, f"installing {' '.join(packages)}", env=env)
    except TimeoutError as e:  # only the lock's wait raises it
        raise StepFailed(str(e)) from None


@functools.cache
def dev_script() -> ModuleType:
    """The repository's dev.py, loaded by path: a module called `docker` (this folder, or
    the Docker SDK) must not be what imports it."""
    spec = importlib.util.spec_from_file_location("searchr1_dev", ROOT / "dev.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def ensure_engine() -> None:
    if engine_answers():
        return
    if shutil.which("dockerd") is None:
        if os.geteuid() != 0 or shutil.which("apt-get") is None:
            raise StepFailed(
                "no Docker Engine answers and this is not root on Debian: start one "
                "(https://docs.docker.com/engine/install/) and run again"
            )
        log("installing Debian's docker.io")
        apt_install("docker.io")
    if os.geteuid() != 0:
        raise StepFailed("dockerd is installed but not running; start it (as root) and rerun")
    logfile = CACHE / "dockerd.log"
    CACHE.mkdir(parents=True, exist_ok=True)
    log(f"starting dockerd (log: {logfile})")
    with open(logfile, "ab") as out:
        # Its own session: it outlives this run, so the next one finds it (and its caches).
        subprocess.Popen(["dockerd"], stdout=out, stderr=out, start_new_session=True)
    deadline = time.monotonic() + 90
    while not engine_answers():
        if time.monotonic() > deadline:
            raise StepFailed(f"dockerd did not answer within 90 s (see {logfile})")
        time.sleep(1)


def debian_mirror(texts: list[str] | None = None) -> str:
    """The Debian mirror apt uses here (deb822 `URIs:` or one-line `deb` sources)."""
    if texts is None:
        files = [*Path("/etc/apt").glob("sources.list"), *Path("/etc/apt").glob("sources.list.d/*")]
        texts = [p.read_text() for p in files if p.is_file()]
    for text in texts:
        m = re.search(r"^(?:URIs:|deb(?: \[[^\]]*\])?)\s+(\S+/debian)/?(?:\s|$)", text, re.M)
        if m:
            return m.group(1)
    return "http://deb.debian.org/debian"


def ensure_plugins() -> None:
    """compose v2 and buildx as CLI plugins, from Debian trixie's packages if missing."""
    missing = [name for name in PLUGIN_PACKAGES if quiet(["docker", name, "version"]).returncode]
    if not missing:
        return
    if os.geteuid() != 0:
        raise StepFailed(f"the docker client lacks {', '.join(missing)}; install the plugin(s)")
    apt_dir = CACHE / "apt-trixie"
    (apt_dir / "lists" / "partial").mkdir(parents=True, exist_ok=True)
    (apt_dir / "sources.list").write_text(
        f"deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] {debian_mirror()} "
        "trixie main\n"
    )
    # A private apt configuration: trixie is never added to this machine's sources.
    opts = [
        f"-oDir::Etc::SourceList={apt_dir / 'sources.list'}",
        "-oDir::Etc::SourceParts=/nonexistent",
        f"-oDir::State::Lists={apt_dir / 'lists'}",
        f"-oDir::Cache={apt_dir / 'cache'}",
    ]
    run(["apt-get", *opts, "update"], "apt-get update (Debian trixie, for docker plugins)")
    plugins = Path(os.environ.get("DOCKER_CONFIG", Path.home() / ".docker")) / "cli-plugins"
    plugins.mkdir(parents=True, exist_ok=True)
    for name in missing:
        with tempfile.TemporaryDirectory() as tmp:
            run(
                ["apt-get", *opts, "download", PLUGIN_PACKAGES[name]],
                f"downloading {name}",
                cwd=tmp,
            )
            deb = next(Path(tmp).glob("*.deb"))
            run(["dpkg-deb", "-x", str(deb), f"{tmp}/x"], f"unpacking {deb.name}")
            found = list(Path(tmp, "x").rglob(f"cli-plugins/docker-{name}"))
            if not found:
                raise StepFailed(f"{deb.name} holds no cli-plugins/docker-{name}")
            shutil.copy2(found[0], plugins / f"docker-{name}")
        run(["docker", name, "version"], f"docker {name} (installed into {plugins})")


# -- 2. base images -------------------------------------------------------------------------


def image_exists(tag: str) -> bool:
    return quiet(["docker", "image", "inspect", tag]).returncode == 0


def debootstrap_image(tag: str, include: list[str], changes: list[str], setup: str) -> None:
    """A Debian bookworm image: debootstrap minbase + `include`, the host's added CA
    certificates, `setup` run in the root filesystem, then `docker import` as `tag`."""
    if os.geteuid() != 0:
        raise StepFailed(f"building {tag} from Debian needs root (debootstrap)")
    if shutil.which("debootstrap") is None:
        apt_install("debootstrap")
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        rootfs = Path(tmp) / "rootfs"
        run(
            [
                "debootstrap",
                "--variant=minbase",
                f"--include={','.join(include)}",
                "bookworm",
                str(rootfs),
                debian_mirror(),
            ],
            f"debootstrap for {tag}",
        )
        cas = rootfs / "usr/local/share/ca-certificates"
        cas.mkdir(parents=True, exist_ok=True)
        for crt in Path("/usr/local/share/ca-certificates").glob("*.crt"):
            shutil.copy2(crt, cas / crt.name)
        script = (
            f"set -e; update-ca-certificates >/dev/null 2>&1 || true; {setup}; "
            "apt-get clean; rm -rf /var/lib/apt/lists/* /var/cache/debconf/*-old"
        )
        run(["chroot", str(rootfs), "sh", "-c", script], f"setting up {tag}")
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        args = [a for c in changes for a in ("--change", c)]
        run(["docker", "import", *args, "-", tag], f"docker import {tag}", stdin=tar.stdout)
        if tar.wait() != 0:
            raise StepFailed(f"tar of the {tag} root filesystem failed")


def pick_image(var: str, default: str, local: str, build: functools.partial[None]) -> str:
    """`var` if set (it must exist or pull); else the default if present or pullable; else the
    locally built `local` (built once, kept)."""
    if os.environ.get(var):
        tag = os.environ[var]
        if not image_exists(tag):
            run(["docker", "pull", tag], f"pulling {tag} ({var})")
        return tag
    for tag in (default, local):
        if image_exists(tag):
            return tag
    log(f"pulling {default}")
    # A slim image pulls in well under 3 minutes; a registry that hangs must not cost CI 10.
    if quiet(["docker", "pull", default], timeout=180).returncode == 0:
        return default
    log(f"no registry serves {default}: building {local} from Debian")
    build()
    return local


def ensure_base_images() -> dict[str, str]:
    python = pick_image(
        "SEARCHR1_PYTHON_IMAGE",
        DEFAULT_PYTHON_IMAGE,
        LOCAL_PYTHON_IMAGE,
        functools.partial(
            debootstrap_image,
            LOCAL_PYTHON_IMAGE,
            ["python3", "python3-venv", "python3-pip", "python-is-python3", "ca-certificates"],
            ['CMD ["python3"]', "ENV LANG=C.UTF-8"],
            "true",
        ),
    )
    redis = pick_image(
        "SEARCHR1_REDIS_IMAGE",
        DEFAULT_REDIS_IMAGE,
        LOCAL_REDIS_IMAGE,
        functools.partial(
            debootstrap_image,
            LOCAL_REDIS_IMAGE,
            ["redis-server"],
            ["WORKDIR /data", 'CMD ["redis-server"]'],
            # The official image's layout: /data, owned by the redis user, is the volume.
            "mkdir -p /data && chown redis:redis /data",
        ),
    )
    return {"SEARCHR1_PYTHON_IMAGE": python, "SEARCHR1_REDIS_IMAGE": redis}


# -- 3. build -------------------------------------------------------------------------------


def torch_pin() -> str:
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip().startswith("torch=="):
            return line.split("==", 1)[1].strip()
    raise StepFailed("constraints.txt pins no torch version")


def find_links() -> list[Path]:
    """pip's find-links folders on this machine (environment, then its config files)."""
    dirs = os.environ.get("PIP_FIND_LINKS", "").split()
    cfg = configparser.ConfigParser()
    cfg.read(
        [
            os.environ.get("PIP_CONFIG_FILE", ""),
            "/etc/pip.conf",
            "/etc/xdg/pip/pip.conf",
            str(Path.home() / ".pip/pip.conf"),
            str(Path.home() / ".config/pip/pip.conf"),
        ]
    )
    for section in ("global", "install"):
        dirs += cfg.get(section, "find-links", fallback="").split()
    return [Path(d.removeprefix("file://")) for d in dirs if not d.startswith("http")]


def local_torch_wheel() -> Path | None:
    for folder in find_links():
        for wheel in sorted(folder.glob(f"torch-{torch_pin()}*-cp311-cp311-*linux*x86_64.whl")):
            return wheel
    return None


@contextlib.contextmanager
def torch_index() -> Iterator[dict[str, str]]:
    """Build settings for torch: SEARCHR1_TORCH_INDEX if set; else a local wheel served as a
    PEP 503 index on loopback (the build then uses the host's network); else the default."""
    if os.environ.get("SEARCHR1_TORCH_INDEX") or (wheel := local_torch_wheel()) is None:
        yield {}
        return
    with tempfile.TemporaryDirectory() as tmp:
        project = Path(tmp, "simple", "torch")
        project.mkdir(parents=True)
        (project / wheel.name).symlink_to(wheel)
        href = wheel.name.replace("+", "%2B")
        (project / "index.html").write_text(f'<html><body><a href="{href}">{wheel.name}</a>\n')
        handler = functools.partial(_QuietHandler, directory=tmp)
        try:  # a fixed port: the URL is a build argument, part of the layer cache's key
            server = http.server.ThreadingHTTPServer(("127.0.0.1", TORCH_INDEX_PORT), handler)
        except OSError:
            log(f"port {TORCH_INDEX_PORT} is taken: the dependency layer is rebuilt")
            server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        log(f"serving {wheel} as a PEP 503 index on 127.0.0.1:{server.server_port}")
        try:
            yield {
                "SEARCHR1_TORCH_INDEX": f"http://127.0.0.1:{server.server_port}/simple",
                "SEARCHR1_BUILD_NETWORK": "host",
            }
        finally:
            server.shutdown()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


def copy_host_cas() -> None:
    """The host's locally added CA certificates as the images' extra CAs (a TLS proxy's root
    must be trusted by pip in the build, as it is here)."""
    target = ROOT / "docker" / "ca-certificates"
    for crt in Path("/usr/local/share/ca-certificates").glob("*.crt"):
        if not (target / crt.name).exists() or (target / crt.name).read_bytes() != crt.read_bytes():
            shutil.copy2(crt, target / crt.name)


# -- 4. run ---------------------------------------------------------------------------------


def dotenv() -> dict[str, str]:
    path = ROOT / ".env"
    if not path.exists():
        return {}
    pairs = (line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)
    return {k.strip(): v.strip() for k, v in pairs if not k.strip().startswith("#")}


def compose_env(images: dict[str, str]) -> dict[str, str]:
    env = {**os.environ, **images, "DOCKER_BUILDKIT": "1", "COMPOSE_PROFILES": "cpu"}
    env.setdefault("SEARCHR1_CONFIG_FILE", "./docker/cpu-demo.yaml")
    known = dotenv()
    for name in ("REDIS_PASSWORD", "SEARCHR1_ADMIN_TOKEN"):
        if name not in env and name not in known:  # a throwaway secret for this run
            env[name] = secrets.token_urlsafe(24)
    return env


def compose(*args: str) -> list[str]:
    # Its own project name: `down --volumes` must never touch a user's `searchr1` stack.
    return ["docker", "compose", "--project-directory", str(ROOT), "--project-name", PROJECT,
            "--profile", "cpu", *args]  # fmt: skip


def containers(env: dict[str, str]) -> dict[str, dict[str, object]]:
    """Service -> `docker compose ps` fields (State, Health, ExitCode), every container."""
    out = quiet(compose("ps", "--all", "--format", "json"), timeout=30, env=env)
    if out.returncode != 0:
        return {}
    text = out.stdout.strip()
    rows = json.loads(text) if text.startswith("[") else [json.loads(x) for x in text.splitlines()]
    return {str(r["Service"]): r for r in rows}


def parse_summary(logs: str) -> dict[str, float]:
    """The demo's last line `em_before=... em_after=... wall_s=... engine=torch` as numbers."""
    for raw in reversed(logs.splitlines()):
        # compose may prefix "<container>  | " and emit terminal escapes (erase-line)
        line = ANSI_ESCAPE.sub("", raw).split("|", 1)[-1].strip()
        if line.startswith("em_before="):
            pairs = (kv.split("=", 1) for kv in line.split())
            return {k: float(v) for k, v in pairs if re.fullmatch(r"-?[\d.]+|nan", v)}
    raise StepFailed(f"{FINAL} printed no summary line (em_before=... em_after=...)")


def follow(env: dict[str, str], timeout_s: float, t0: float) -> dict[str, float]:
    """Wait for every server's health check and for the final container; seconds since `t0`
    at which each turned healthy/finished, and `<name>_ready`: from its start to healthy.
    StepFailed on an unhealthy or failed container."""
    seen: dict[str, str] = {}
    times: dict[str, float] = {}
    started: dict[str, float] = {}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for name, c in containers(env).items():
            state = f"{c.get('State')}/{c.get('Health') or '-'}"
            if seen.get(name) != state:
                seen[name] = state
                log(f"{time.monotonic() - t0:6.0f} s  {name}: {state}")
            failed = None
            if c.get("Health") == "unhealthy":
                failed = f"service {name} is unhealthy"
            if c.get("State") == "exited" and int(c.get("ExitCode") or 0) != 0:
                failed = f"service {name} exited with code {c.get('ExitCode')}"
            if failed:
                tail = quiet(compose("logs", "--no-color", "--tail", "40", name), env=env)
                print(tail.stdout + tail.stderr, flush=True)
                raise StepFailed(failed)
            if c.get("State") == "running":
                started.setdefault(name, time.monotonic() - t0)
            if c.get("Health") == "healthy" and name not in times:
                times[name] = time.monotonic() - t0
                times[f"{name}_ready"] = times[name] - started.get(name, times[name])
            if name == FINAL and c.get("State") == "exited":
                times[FINAL] = time.monotonic() - t0
                return times
        time.sleep(2)
    raise StepFailed(f"the run did not finish within {timeout_s:.0f} s (--timeout-s)")


def run_stack(env: dict[str, str], args: argparse.Namespace) -> dict[str, float]:
    logdir = ROOT / "runs" / "compose"
    logdir.mkdir(parents=True, exist_ok=True)
    run(compose("down", "--volumes", "--remove-orphans"), "compose down (leftovers)", env=env)
    t0 = time.monotonic()
    up = subprocess.Popen(compose("up", "--detach", "--no-build"), env=env)
    with open(logdir / "compose.log", "w") as out:
        logs = None
        try:
            # `up --detach` returns once the last container started (after the whole run: the
            # final one waits for the trainer); meanwhile every log goes to the file.
            time.sleep(5)
            logs = subprocess.Popen(
                compose("logs", "--follow", "--no-color", "--timestamps"),
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
            times = follow(env, args.timeout_s, t0)
            if up.wait(timeout=120) != 0:
                raise StepFailed("docker compose up failed (see above)")
        finally:
            if up.poll() is None:
                up.terminate()
            if logs is not None:
                logs.terminate()
    log(f"full logs: {logdir / 'compose.log'}")
    report = run(
        compose("logs", "--no-color", "--no-log-prefix", FINAL),
        f"{FINAL} logs",
        env=env,
        capture_output=True,
    ).stdout
    print(report, flush=True)
    summary = parse_summary(report)
    gain = summary["em_after"] - summary["em_before"]
    if gain < args.min_gain:
        raise StepFailed(
            f"held-out EM went {summary['em_before']:.3f} -> {summary['em_after']:.3f} "
            f"(+{gain:.3f}), below the target +{args.min_gain}"
        )
    ready = {s: times[f"{s}_ready"] for s in SERVERS if f"{s}_ready" in times}
    log("from start to healthy: " + ", ".join(f"{s} {v:.0f} s" for s, v in ready.items()))
    healthy = max(times[s] for s in SERVERS if s in times)
    return {
        "healthy_s": healthy,
        "slowest_ready_s": max(ready.values()),
        "demo_s": times[FINAL],
        "em_gain": gain,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--min-gain", type=float, default=0.15, help="held-out EM gain required")
    p.add_argument("--timeout-s", type=float, default=3600, help="limit for the whole run")
    p.add_argument("--keep", action="store_true", help="leave the stack up (no down -v)")
    p.add_argument("--no-run", action="store_true", help="engine, base images and build only")
    args = p.parse_args(argv)
    env: dict[str, str] | None = None
    try:
        ensure_engine()
        ensure_plugins()
        images = ensure_base_images()
        copy_host_cas()
        t = time.monotonic()
        with torch_index() as torch_env:
            env = compose_env({**images, **torch_env})
            # One image first: compose builds services in parallel, and on a cache miss each
            # would install the same dependency layer at once; after it, the rest are hits.
            run(compose("build", "orchestrator"), "building the orchestrator image", env=env)
            run(compose("build"), "docker compose --profile cpu build", env=env, cwd=ROOT)
        # Images the rebuild replaced (and the one-shot services' duplicate tags) hold nothing
        # but old layers: without this a CI machine keeps a venv per dependency change.
        quiet(["docker", "image", "prune", "--force", "--filter", "label=searchr1.image"])
        # BuildKit keeps every old dependency layer (11 GB after a day of edits here): bound it.
        quiet(["docker", "builder", "prune", "--force", "--keep-storage", BUILD_CACHE_KEEP])
        numbers = {"build_s": time.monotonic() - t}
        if not args.no_run:
            numbers |= run_stack(env, args)
    except StepFailed as e:
        print(f"dev.py compose: {e}", file=sys.stderr, flush=True)
        if env is not None:
            print(quiet(compose("ps", "--all"), timeout=30, env=env).stdout, flush=True)
        return 1
    finally:
        if env is not None and not args.keep and not args.no_run:
            quiet(compose("down", "--volumes", "--remove-orphans"), timeout=300, env=env)
    print("compose: " + " ".join(f"{k}={v:.1f}" for k, v in numbers.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
