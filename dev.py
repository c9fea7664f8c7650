#!/usr/bin/env python3
"""One entry point for a fresh machine: creates/updates `.venv`, then runs the demo or the tests.

    python3 dev.py demo [ARGS...]   # the main job: the local end-to-end demo
    python3 dev.py test [ARGS...]   # lint, generated-code check and the test suite (what CI runs)
    python3 dev.py slow [ARGS...]   # the `slow` tests: multi-rank, chaos, demo-sized (CI too)
    python3 dev.py sglang [ARGS...] # the contract tests against a real SGLang 0.5.21 (CI too)
    python3 dev.py compose [ARGS]   # the demo in containers: images built, `docker compose
                                    # --profile cpu up`, result checked, `down -v` (CI too)
    python3 dev.py gpu [ARGS]       # on a GPU machine: every GPU check in one call, one results
                                    # file (bench/gpu_checks.py; see docs/benchmarks.md)
    python3 dev.py gpu-wheels       # here: fetch the wheels `dev.py gpu` installs there (.whl/)
    python3 dev.py prepare          # .venv-sglang and the compose images only (CI starts it
                                    # beside `test`)
    python3 dev.py setup            # only create/update the environment
    python3 dev.py lock [UV ARGS]   # refresh requirements.lock (uv pip compile; e.g. --upgrade)

Only the Python standard library is used here, so it runs before anything is installed.
On Linux x86_64 with CPython 3.11 the environment is installed from requirements.lock (exact
pins, `--require-hashes`); elsewhere from pyproject.toml's ranges and constraints.txt, saying so.
It is rebuilt only when pyproject.toml, constraints.txt or requirements.lock change (a stamp file
holds their hash), so repeated runs start at once.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import venv
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
STAMP = VENV / ".searchr1-installed"
TORCH_PIN = "torch==2.13.0"
# Where the CPU-only torch build lives when no local wheel is configured (pip find-links).
TORCH_CPU_INDEX = os.environ.get("SEARCHR1_TORCH_INDEX", "https://download.pytorch.org/whl/cpu")

# The lock: every runtime, `dev` and `megatron` requirement pinned with its hashes, torch the CPU
# build. It is resolved for one platform, the one dev.py and the CPU images run on; elsewhere
# setup falls back to the unlocked ranges. `python3 dev.py lock` refreshes it with uv.
LOCK = ROOT / "requirements.lock"
LOCK_EXTRAS = ("dev", "megatron", "envs")
LOCK_PYTHON = "3.11"
LOCK_PLATFORM = "x86_64-manylinux_2_28"  # uv's name: x86_64 Linux, glibc >= 2.28
TORCH_LOCK_PIN = TORCH_PIN + "+cpu"
UV_PIN = "uv==0.13.8"

# A real SGLang server for the contract tests lives in its own venv: it cannot share `.venv`
# (it pins its own transformers and needs workarounds to run on CPU, see the README in
# SGLANG_SUPPORT).
SGLANG_VENV = ROOT / ".venv-sglang"
SGLANG_STAMP = SGLANG_VENV / ".sglang-installed"
SGLANG_SUPPORT = ROOT / "tests" / "support" / "sglang_cpu"
SGLANG_PIN = "sglang==0.5.21"
TORCHVISION_PIN = "torchvision==0.28.*"


def _bin(name: str, venv_dir: Path = VENV) -> Path:
    sub = "Scripts" if os.name == "nt" else "bin"
    return venv_dir / sub / name


def _run(cmd: list[str | os.PathLike[str]], **kw) -> int:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    return subprocess.call([str(c) for c in cmd], **kw)


def _check(cmd: list[str | os.PathLike[str]], what: str | None = None, **kw) -> None:
    """Run `cmd`; on failure exit with `what` (a message saying what failed) or a generic one."""
    rc = _run(cmd, **kw)
    if rc != 0:
        sys.exit(f"{what or 'dev.py: command failed'} (exit code {rc})")


# Bump when the install recipe changes in a way an existing .venv must pick up.
INSTALL_RECIPE = "2: bytecode compiled"


def _fingerprint() -> str:
    h = hashlib.sha256(INSTALL_RECIPE.encode())
    for name in ("pyproject.toml", "constraints.txt", LOCK.name):
        path = ROOT / name
        h.update(path.read_bytes() if path.exists() else b"(none)")
    h.update(sys.version.encode())
    return h.hexdigest()


def _install_torch(pip: list[str], what: str | None = None) -> None:
    """Install TORCH_PIN (CPU build) with the `pip` command of some venv; `what` as in _check."""
    # Torch first and pinned to the CPU build: otherwise a dependency pulls the multi-GB CUDA
    # build. A local wheel (pip's configured find-links) is preferred, installed without its
    # dependencies (they come from the package index in the next step); else the CPU index.
    if _run([*pip, "install", "-q", "--no-index", "--no-deps", TORCH_PIN]) == 0:
        return
    if sys.platform == "darwin":
        _check([*pip, "install", "-q", TORCH_PIN], what)  # macOS wheels on PyPI are CPU-only
    else:
        _check([*pip, "install", "-q", TORCH_PIN, "--index-url", TORCH_CPU_INDEX], what)


def lock_mismatch() -> str | None:
    """Why requirements.lock does not fit this interpreter and machine, or None when it does."""
    if not LOCK.exists():
        return f"there is no {LOCK.name}"
    libc, libc_version = platform.libc_ver()
    here = f"{platform.system()} {platform.machine()}, {platform.python_implementation()} "
    here += ".".join(map(str, sys.version_info[:2]))
    fits = (
        sys.platform == "linux"
        and platform.machine() == "x86_64"
        and platform.python_implementation() == "CPython"
        and ".".join(map(str, sys.version_info[:2])) == LOCK_PYTHON
        and libc == "glibc"
        and tuple(int(p) for p in libc_version.split(".")[:2]) >= (2, 28)
    )
    if fits:
        return None
    return f"{LOCK.name} is for Linux x86_64 (glibc >= 2.28), CPython {LOCK_PYTHON}; this is {here}"


def _lock_entry(name: str) -> str:
    """The lines of one package in requirements.lock (`name==version` and its `--hash`es)."""
    m = re.search(rf"^{re.escape(name)}==\S+(?: \\\n\s+--hash=\S+)+", LOCK.read_text(), re.M)
    if not m:
        sys.exit(f"dev.py: {LOCK.name} has no hashed entry for {name}")
    return m.group(0)


def _install_locked(pip: list[str]) -> None:
    """torch (the CPU build, hash-checked), then every pin of requirements.lock with
    --require-hashes (by uv, else pip), then searchr1 itself (editable, no dependencies)."""
    with tempfile.TemporaryDirectory() as tmp:
        torch_req = Path(tmp) / "torch.txt"
        torch_req.write_text(_lock_entry("torch") + "\n")
        hashed = [*pip, "install", "-q", "--require-hashes", "--no-deps", "-r", torch_req]
        # The local wheel first (pip's configured find-links), else the CPU index, as unlocked.
        if _run([*hashed, "--no-index"]) != 0:
            _check(
                [*hashed, "--index-url", TORCH_CPU_INDEX], f"dev.py: installing {TORCH_LOCK_PIN}"
            )
    if not _uv_install_locked(pip):
        _check(
            [*pip, "install", "-q", "--require-hashes", "-r", LOCK],
            f"dev.py: installing {LOCK.name}",
        )
    _check([*pip, "install", "-q", "--no-deps", "-e", ROOT], "dev.py: installing searchr1")


def _uv_install_locked(pip: list[str]) -> bool:
    """requirements.lock installed by uv (itself hash-checked from the lock): 25 s where pip
    takes ~95 s on a 2-core machine, most of the test command's install time. False (and pip
    does it) where uv cannot, e.g. no PyPI but a mirror in pip's own configuration, which uv
    does not read."""
    with tempfile.TemporaryDirectory() as tmp:
        uv_req = Path(tmp) / "uv.txt"
        uv_req.write_text(_lock_entry("uv") + "\n")
        if _run([*pip, "install", "-q", "--require-hashes", "--no-deps", "-r", uv_req]) != 0:
            print("dev.py: uv could not be installed; pip installs the lock", flush=True)
            return False
    uv = [_bin("uv"), "pip", "install", "-q", "--python", _bin("python")]
    if _run([*uv, "--require-hashes", "-r", LOCK]) != 0:
        print(f"dev.py: uv could not install {LOCK.name}; pip does", flush=True)
        return False
    return True


def ensure_env() -> None:
    """Create `.venv` and install searchr1 (editable, with the dev and megatron extras) unless
    already current: from requirements.lock where it fits, else from pyproject.toml's ranges."""
    if sys.version_info < (3, 11):  # noqa: UP036 - dev.py runs under any system python
        sys.exit("dev.py: searchr1 needs Python >= 3.11")
    if not _bin("python").exists():
        print(f"creating virtual environment in {VENV}", flush=True)
        venv.EnvBuilder(with_pip=True, clear=True).create(VENV)
    want = _fingerprint()
    if STAMP.exists() and STAMP.read_text() == want and _bin("searchr1").exists():
        return
    pip = [str(_bin("python")), "-m", "pip", "--disable-pip-version-check"]
    _check([*pip, "install", "-q", "--upgrade", "pip", "setuptools", "wheel"])
    why_not = lock_mismatch()
    if why_not is None:
        _install_locked(pip)
    else:
        print(f"dev.py: {why_not}: installing unlocked (pyproject.toml ranges)", flush=True)
        _install_torch(pip)
        # `megatron`: CI runs the Megatron backend's tests too.
        extras = ",".join(LOCK_EXTRAS)
        _check([*pip, "install", "-q", "-c", ROOT / "constraints.txt", "-e", f"{ROOT}[{extras}]"])
    compile_bytecode(_bin("python"))
    STAMP.write_text(want)


def compile_bytecode(python: Path) -> None:
    """Compile the venv's site-packages to .pyc once. uv writes none, and where
    PYTHONDONTWRITEBYTECODE is set (CI's image, this sandbox) no import writes one either, so
    every process compiled its imported modules at each start: the retriever's encoder took
    11.5 s to load instead of 6.9, the trainer's import 5.1 s instead of 3.2. ~30 s here."""
    # Its exit status is not checked: a few files are for other Pythons (func_timeout's
    # py2_raise.py) and never imported, so compile_dir always reports a failure.
    script = (
        "import compileall, sysconfig; "
        "compileall.compile_dir(sysconfig.get_paths()['purelib'], quiet=2, workers=0)"
    )
    # -W ignore: such files also print SyntaxWarnings ("is" with a literal) nobody can act on.
    _run([str(python), "-W", "ignore", "-c", script])


def write_lock(args: list[str]) -> int:
    """Resolve requirements.lock again with uv (installed into `.venv` with pip if missing):
    pyproject.toml's dependencies and the dev and megatron extras for Linux x86_64 and CPython
    3.11, every file hashed, torch the CPU build. Pins already in the lock are kept unless
    pyproject.toml needs others; `args` go to `uv pip compile` (`--upgrade`,
    `--upgrade-package NAME`)."""
    if not _bin("python").exists():
        print(f"creating virtual environment in {VENV}", flush=True)
        venv.EnvBuilder(with_pip=True, clear=True).create(VENV)
    pip = [str(_bin("python")), "-m", "pip", "--disable-pip-version-check"]
    _check([*pip, "install", "-q", UV_PIN], f"dev.py lock: installing {UV_PIN}")
    with tempfile.TemporaryDirectory() as tmp:
        wheels, out = Path(tmp) / "torch", Path(tmp) / LOCK.name
        # The CPU wheel (the local one first, else the CPU index): uv hashes it from here.
        get = [*pip, "download", "-q", "--no-deps", "-d", wheels, TORCH_LOCK_PIN]
        get += ["--only-binary", ":all:", "--python-version", LOCK_PYTHON.replace(".", "")]
        get += ["--platform", "manylinux_2_28_x86_64"]
        if _run([*get, "--no-index"]) != 0:
            _check(
                [*get, "--index-url", TORCH_CPU_INDEX], f"dev.py lock: fetching {TORCH_LOCK_PIN}"
            )
        constraint = Path(tmp) / "torch-cpu.txt"
        constraint.write_text(TORCH_LOCK_PIN + "\n")
        if LOCK.exists():
            shutil.copy(LOCK, out)  # uv keeps the pins of an existing output file
        cmd: list[str | os.PathLike[str]] = [_bin("uv"), "pip", "compile", "pyproject.toml"]
        for extra in LOCK_EXTRAS:
            cmd += ["--extra", extra]
        cmd += ["--generate-hashes", "--no-header", "--python-version", LOCK_PYTHON]
        cmd += ["--python-platform", LOCK_PLATFORM, "--find-links", wheels, "-c", constraint]
        cmd += ["--quiet", "-o", out, *args]
        _check(cmd, "dev.py lock: uv pip compile failed", cwd=ROOT)
        body = out.read_text().replace(str(constraint), f"dev.py ({TORCH_LOCK_PIN})")
    uv_version = subprocess.run(
        [str(_bin("uv")), "--version"], capture_output=True, text=True, check=True
    ).stdout.split()[1]
    header = _LOCK_HEADER.format(uv=uv_version, extras=",".join(LOCK_EXTRAS), torch=TORCH_LOCK_PIN)
    LOCK.write_text(header + body)
    print(f"dev.py lock: wrote {LOCK.name}; `python3 dev.py setup` installs it", flush=True)
    return 0


_LOCK_HEADER = """\
# requirements.lock: searchr1's runtime dependencies and its [{extras}] extras, every version
# pinned, every file hashed (pip install --require-hashes -r requirements.lock).
# Resolved for Linux x86_64 (glibc >= 2.28) and CPython 3.11 only, the platform of dev.py's
# .venv and of the CPU images; elsewhere `python3 dev.py setup` installs from pyproject.toml's
# ranges instead (and says so). No nvidia-*/triton wheels: torch is the CPU build,
# {torch}, with one hash: that of the wheel on PyTorch's CPU index.
# Generated by `python3 dev.py lock` (uv {uv}, installed into .venv with pip: uv pip compile
# pyproject.toml --generate-hashes); refresh with `python3 dev.py lock` (keeps the pins
# pyproject.toml still allows) or `python3 dev.py lock --upgrade` (newest allowed versions).
# Do not edit by hand.
"""


def _sglang_fingerprint() -> str:
    h = hashlib.sha256()
    for pin in (TORCH_PIN, SGLANG_PIN, TORCHVISION_PIN):
        h.update(pin.encode() + b"\0")
    for path in sorted(SGLANG_SUPPORT.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            h.update(path.relative_to(SGLANG_SUPPORT).as_posix().encode() + b"\0")
            h.update(path.read_bytes())
    h.update(sys.version.encode())
    return h.hexdigest()


def ensure_sglang_env() -> Path:
    """Create `.venv-sglang` with a real SGLang server that runs on CPU; returns its python.

    The steps follow tests/support/sglang_cpu/README.md: CPU torch first, sglang and torchvision
    without their dependencies, torchvision patched, sglang's non-CUDA requirements (torch kept
    pinned by a constraint file), and a stub `sgl_kernel`. A stamp holding the hash of the
    support files and the Python version skips all of it when nothing changed. Any failure
    exits; nothing is skipped.
    """
    python = _bin("python", SGLANG_VENV)
    want = _sglang_fingerprint()
    if python.exists() and SGLANG_STAMP.exists() and SGLANG_STAMP.read_text() == want:
        return python
    if not python.exists():
        print(f"creating virtual environment in {SGLANG_VENV}", flush=True)
        venv.EnvBuilder(with_pip=True, clear=True).create(SGLANG_VENV)
    SGLANG_STAMP.unlink(missing_ok=True)  # a broken install must not look finished

    def fail(what: str) -> str:
        return f"dev.py sglang: {what} failed"

    pip = [str(python), "-m", "pip", "--disable-pip-version-check"]
    _check([*pip, "install", "-q", "--upgrade", "pip", "setuptools", "wheel"], fail("pip upgrade"))
    _install_torch(pip, fail(f"installing {TORCH_PIN} (CPU)"))
    _check([*pip, "install", "-q", "--no-deps", SGLANG_PIN], fail(f"installing {SGLANG_PIN}"))
    _check(
        [*pip, "install", "-q", "--no-deps", TORCHVISION_PIN], fail(f"installing {TORCHVISION_PIN}")
    )
    site_packages = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    if not site_packages or not Path(site_packages).is_dir():
        sys.exit(fail(f"finding the site-packages of {python}"))
    _check(
        [python, SGLANG_SUPPORT / "patch_torchvision.py", site_packages],
        fail("patching torchvision (patch_torchvision.py)"),
    )
    constraints = SGLANG_VENV / "constraints.txt"
    constraints.write_text(f"{TORCH_PIN}\n{TORCHVISION_PIN}\n")
    print("(pip will report sglang's CUDA-only requirements as missing: left out on purpose)")
    _check(
        [*pip, "install", "-q", "-c", constraints, "-r", SGLANG_SUPPORT / "requirements.txt"],
        fail("installing tests/support/sglang_cpu/requirements.txt"),
    )
    stub = Path(site_packages) / "sgl_kernel"
    shutil.rmtree(stub, ignore_errors=True)
    shutil.copytree(
        SGLANG_SUPPORT / "sgl_kernel", stub, ignore=shutil.ignore_patterns("__pycache__")
    )
    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", "OMP_NUM_THREADS": "1"}
    _check(
        [
            python,
            "-c",
            "import torchvision, sgl_kernel, sglang.srt.entrypoints.http_server, sglang_router",
        ],
        fail("importing sglang in .venv-sglang"),
        env=env,
    )
    SGLANG_STAMP.write_text(want)
    return python


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("MKL_NUM_THREADS", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env["PATH"] = f"{_bin('python').parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def ensure_debian(
    package: str, binaries: list[str], used_by: str, *, recommends: bool = False
) -> None:
    """Debian's `package` (providing `binaries`) for `used_by`: installed with apt when missing
    and running as root (CI is). Without it those tests skip, saying why."""
    if all(shutil.which(b) for b in binaries):
        return
    if not (hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("apt-get")):
        print(f"dev.py: no {package}, {used_by} will skip (apt-get install -y {package})")
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-qq", package]
    if not recommends:
        install.insert(-1, "--no-install-recommends")
    try:
        with apt_lock():
            if all(shutil.which(b) for b in binaries):  # installed while this waited
                return
            for cmd in (["apt-get", "update", "-qq"], install):
                if _run(cmd, env=env) != 0:
                    print(f"dev.py: installing {package} failed; {used_by} will skip", flush=True)
                    return
    except TimeoutError as e:
        print(f"dev.py: {e}; {used_by} will skip", flush=True)


# CI's `dev.py prepare` installs Docker while `dev.py test` installs chromium: apt's own locks
# fail at once instead of waiting, so both take this one first (docker/compose_run.py's
# apt_install calls this function).
APT_LOCK = Path(tempfile.gettempdir()) / "searchr1-apt.lock"
APT_LOCK_WAIT_S = 1200.0


@contextlib.contextmanager
def apt_lock() -> Iterator[None]:
    """Held while apt runs; TimeoutError after APT_LOCK_WAIT_S of waiting for it."""
    import fcntl  # POSIX only, like apt

    deadline = time.monotonic() + APT_LOCK_WAIT_S
    with open(APT_LOCK, "w") as f:
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"another install held {APT_LOCK} for {APT_LOCK_WAIT_S:.0f} s"
                    ) from None
                time.sleep(1)
        yield


def ensure_chromium() -> None:
    ensure_debian("chromium", ["chromium"], "the browser tests (tests/browser)", recommends=True)


def ensure_prometheus() -> None:
    # `prometheus` 2.42 and `promtool`: the alert rules' promtool tests
    # (tests/unit/deploy/test_alerts.py) and the real-Prometheus tests.
    ensure_debian(
        "prometheus", ["promtool", "prometheus"], "the promtool and real-Prometheus tests"
    )


def ensure_nftables() -> None:
    # `nft`: partitions between hosts of their own (harness/netns.py; bench/chaos.py --hosts
    # netns and its tests).
    ensure_debian("nftables", ["nft"], "the network-namespace partition tests")


def ensure_bubblewrap() -> None:
    # `bwrap`: the python tool runs code only in its sandbox (orchestrator/tools/sandbox.py) and
    # refuses to start without it; its tests fail without it where apt could install it.
    ensure_debian("bubblewrap", ["bwrap"], "the python tool and its sandbox tests")


def run_tests(args: list[str]) -> int:
    ensure_chromium()
    ensure_bubblewrap()
    ensure_prometheus()
    ensure_nftables()
    py = str(_bin("python"))
    env = _env()
    for cmd in (
        [py, "-m", "ruff", "check", "."],
        [py, "-m", "ruff", "format", "--check", "."],
        [py, "-m", "protos.generate", "--check"],
    ):
        rc = _run(cmd, cwd=ROOT, env=env)
        if rc != 0:
            return rc
    rc = _run([py, "-m", "pytest", *_workers(args), *args], cwd=ROOT, env=env)
    return 0 if rc == 5 and args else rc  # 5 = a filtered selection collected nothing


# Most of the suite waits on service processes (imports, start-up, polls): one pytest process
# keeps a 2-core machine about half idle. Two workers (pytest-xdist), each a whole file at a
# time, so a module's fixtures (a world, a warm start) are built once.
TEST_WORKERS = os.environ.get("SEARCHR1_TEST_WORKERS", "2")


def _workers(args: list[str]) -> list[str]:
    """xdist's options for the default run; none when ARGS choose (`-n 0`, `-p no:xdist`)."""
    chosen = any(a.startswith(("-n", "--numprocesses", "--dist")) or a == "no:xdist" for a in args)
    if chosen or TEST_WORKERS in ("", "0", "1"):
        return []
    # In collection order (tests/conftest.py puts the longest files first), not xdist's
    # default of the files with the most tests first.
    return ["-n", TEST_WORKERS, "--dist", "loadfile", "--no-loadscope-reorder"]


def run_slow_tests(args: list[str]) -> int:
    """The `slow`-marked tests the default suite leaves out (multi-rank Megatron parity, the
    3-fault chaos run, the soak's 40 s short form, three orchestrators with a kill, the fuzz run,
    demo-sized runs): CI runs them as their own step so `dev.py test` stays a few minutes."""
    ensure_prometheus()
    ensure_nftables()
    env = _env()
    cmd = [str(_bin("python")), "-m", "pytest", "-m", "slow and not sglang", *_workers(args)]
    cmd += args
    rc = _run(cmd, cwd=ROOT, env=env)
    if rc == 5:
        print("dev.py slow: no slow test was collected", file=sys.stderr)
        return 1
    return rc


def run_sglang_tests(args: list[str]) -> int:
    """Every `sglang`-marked test, against real SGLang servers (the tests start and stop them
    on tiny models with the interpreter of `.venv-sglang`), on two workers. Never skips: a
    missing SGLang fails."""
    ensure_prometheus()  # the router row of the dashboard, read through a real Prometheus
    env = _env()
    env["SEARCHR1_SGLANG_PYTHON"] = str(ensure_sglang_env())
    # Two workers, a file each at a time, as the other phases: the tests mostly wait on SGLang
    # servers starting (one process kept a core idle).
    cmd = [str(_bin("python")), "-m", "pytest", "-m", "sglang", "-p", "no:cacheprovider"]
    cmd += [*_workers(args), *args]
    rc = _run(cmd, cwd=ROOT, env=env)
    if rc == 5:
        print("dev.py sglang: no sglang test was collected", file=sys.stderr)
        return 1
    return rc


def run_demo(args: list[str]) -> int:
    ensure_bubblewrap()
    env = _env()
    if "sglang" in args and ("--engine" in args or "--engine=sglang" in args):
        env["SEARCHR1_SGLANG_PYTHON"] = str(ensure_sglang_env())
    return _run([_bin("searchr1"), "demo", *args], cwd=ROOT, env=env)


def prepare_later_phases() -> int:
    """What CI's sglang and compose phases install and build (`.venv-sglang`; Docker, the base
    images and the compose images): `.ci/run` starts this beside `dev.py test`, whose service
    processes leave a core idle, and those phases then find it done. Without it they do the
    same work themselves."""
    ensure_sglang_env()
    return run_compose(["--no-run"])


def run_compose(args: list[str]) -> int:
    """docker/compose_run.py: engine, images, the compose `cpu` profile run and checked."""
    return _run([sys.executable, ROOT / "docker" / "compose_run.py", *args], cwd=ROOT)


# What the GPU machine's image lacks (or holds at another version) that the GPU checks import,
# at requirements.lock's versions. That machine has no network: these travel as wheels.
GPU_WHEELS = (
    "annotated-types",
    "fastapi",
    "httpcore2",
    "httpx2",
    "huggingface-hub",
    "megatron-core",
    "opentelemetry-api",
    "protobuf",
    "pydantic",
    "pydantic-core",
    "pydantic-settings",
    "python-dotenv",
    "python-multipart",
    "redis",
    "sse-starlette",
    "starlette",
    "tenacity",
    "tokenizers",
    "transformers",
    "truststore",
    "typing-inspection",
    "uvicorn",
)
WHEELS = ROOT / ".whl"


def fetch_gpu_wheels() -> int:
    """Download GPU_WHEELS for CPython 3.12 on x86-64 Linux into .whl/ (git-ignored)."""
    WHEELS.mkdir(exist_ok=True)
    platforms = [f"manylinux_2_{n}_x86_64" for n in (17, 27, 28)] + ["manylinux2014_x86_64"]
    for name in GPU_WHEELS:
        pin = _lock_entry(name).split()[0]  # name==version
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
        cmd += ["--python-version", "3.12", "--implementation", "cp", "-d", str(WHEELS), pin]
        for plat in platforms:
            cmd += ["--platform", plat]
        _check(cmd, f"fetching {pin}")
    print(f"{len(GPU_WHEELS)} wheels in {WHEELS}: carry `.whl` to the GPU machine")
    return 0


def run_gpu_checks(args: list[str]) -> int:
    """On the GPU machine (its own Python, no .venv): install the carried wheels into a
    folder of their own, then every GPU check (bench/gpu_checks.py)."""
    env = dict(os.environ)
    python = sys.executable
    wheels = sorted(WHEELS.glob("*.whl"))
    if "--cpu-smoke" in args:  # the plumbing, here: this project's .venv, no wheels
        ensure_env()
        python, wheels = str(_bin("python")), []
    if wheels:
        site = Path(tempfile.gettempdir()) / "searchr1-gpu-site"
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps"]
        pip += ["--no-compile", "--upgrade", "--target", str(site), *map(str, wheels)]
        _check(pip, "installing the carried wheels")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH")) if p)
    cmd = [python, "-P", str(ROOT / "bench" / "gpu_checks.py"), *args]
    return subprocess.run(cmd, env=env, cwd=ROOT).returncode


def main() -> int:
    commands = {
        "demo", "test", "slow", "sglang", "setup", "compose", "prepare", "lock", "gpu",
        "gpu-wheels",
    }  # fmt: skip
    if len(sys.argv) < 2 or sys.argv[1] not in commands:
        print(__doc__)
        return 2
    command, rest = sys.argv[1], sys.argv[2:]
    if command == "lock":  # before ensure_env: the lock being refreshed may be stale
        return write_lock(rest)
    if command == "gpu":  # the GPU machine's own Python and packages, not .venv
        return run_gpu_checks(rest)
    if command == "gpu-wheels":
        return fetch_gpu_wheels()
    if command == "prepare":  # neither needs .venv, which `dev.py test` may be installing
        return prepare_later_phases()
    ensure_env()
    if command == "test":
        return run_tests(rest)
    if command == "demo":
        return run_demo(rest)
    if command == "slow":
        return run_slow_tests(rest)
    if command == "sglang":
        return run_sglang_tests(rest)
    if command == "compose":
        return run_compose(rest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
