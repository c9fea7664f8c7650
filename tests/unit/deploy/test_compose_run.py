"""docker/compose_run.py (`python3 dev.py compose`): the parts that need no Docker Engine."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import urllib.request
from pathlib import Path
from types import ModuleType
from unittest import mock

import pytest

from tests.unit.deploy import stack


def _module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("compose_run", stack.DOCKER / "compose_run.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


cr = _module()

REPORT = """\
searchr1-demo-report-1  | plot: /runs/demo.png  trained model: /runs/model-trained
searchr1-demo-report-1  | em_before=0.014 em_after=0.957 wall_s=485.687 engine=torch
"""


def test_the_summary_line_is_read_as_numbers() -> None:
    got = cr.parse_summary(REPORT)
    assert got == {"em_before": 0.014, "em_after": 0.957, "wall_s": 485.687}
    # As `docker compose logs` printed it in a real run: erase-line escapes, no prefix.
    real = "\x1b[2K\u2514\u2500\u2518\n\x1b[2Kem_before=0.014 em_after=0.928 engine=torch\n"
    assert cr.parse_summary(real)["em_after"] == 0.928
    with pytest.raises(cr.StepFailed, match="no summary line"):
        cr.parse_summary("searchr1-demo-report-1  | Traceback ...\n")


def test_the_mirror_is_the_one_apt_uses() -> None:
    deb822 = "Types: deb\nURIs: http://mirror.example/debian\nSuites: bookworm\n"
    security = "Types: deb\nURIs: http://deb.debian.org/debian-security\n"
    one_line = "deb [arch=amd64] http://other.example/debian bookworm main\n"
    assert cr.debian_mirror([security, deb822]) == "http://mirror.example/debian"
    assert cr.debian_mirror([one_line]) == "http://other.example/debian"
    assert cr.debian_mirror([security]) == "http://deb.debian.org/debian"


def test_a_local_torch_wheel_is_served_as_an_index(tmp_path: Path) -> None:
    pin = cr.torch_pin()
    wheel = tmp_path / f"torch-{pin}+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"
    wheel.write_bytes(b"not really a wheel")
    env = {"PIP_FIND_LINKS": str(tmp_path), "PIP_CONFIG_FILE": os.devnull}
    with mock.patch.dict(os.environ, env):
        os.environ.pop("SEARCHR1_TORCH_INDEX", None)
        with cr.torch_index() as build_env:
            assert build_env["SEARCHR1_BUILD_NETWORK"] == "host"  # the index is on loopback
            url = build_env["SEARCHR1_TORCH_INDEX"]
            page = urllib.request.urlopen(f"{url}/torch/", timeout=10).read().decode()
            href = page.split('href="', 1)[1].split('"', 1)[0]
            assert "%2Bcpu" in href  # PEP 503: the local version's "+" is escaped
            got = urllib.request.urlopen(f"{url}/torch/{href}", timeout=10).read()
            assert got == wheel.read_bytes()
        # An index the user names wins: nothing is served.
        named = {"SEARCHR1_TORCH_INDEX": "https://mirror/whl"}
        with mock.patch.dict(os.environ, named), cr.torch_index() as build_env:
            assert build_env == {}


def test_secrets_are_generated_only_when_missing() -> None:
    keep = {k: v for k, v in os.environ.items() if k not in ("REDIS_PASSWORD",)}
    with (
        mock.patch.dict(os.environ, {**keep, "SEARCHR1_ADMIN_TOKEN": "mine"}, clear=True),
        mock.patch.object(cr, "dotenv", return_value={}),
    ):
        env = cr.compose_env({"SEARCHR1_PYTHON_IMAGE": "base:1"})
    assert env["SEARCHR1_ADMIN_TOKEN"] == "mine"
    assert len(env["REDIS_PASSWORD"]) >= 24 and env["REDIS_PASSWORD"].isascii()
    assert env["COMPOSE_PROFILES"] == "cpu" and env["SEARCHR1_PYTHON_IMAGE"] == "base:1"
    assert env["SEARCHR1_CONFIG_FILE"] == "./docker/cpu-demo.yaml"


def test_dev_py_and_ci_run_it() -> None:
    usage = subprocess.run([sys.executable, str(stack.ROOT / "dev.py")], capture_output=True,
                           text=True, timeout=60)  # fmt: skip
    assert "dev.py compose" in usage.stdout
    steps = [line for line in (stack.ROOT / ".ci" / "run").read_text().splitlines()
             if line.startswith("phase ")]  # fmt: skip
    assert steps == ["phase test", "phase slow", "phase sglang", "phase compose"]


def test_it_runs_its_own_compose_project() -> None:
    """`down --volumes` at its start and end must not delete a user's `searchr1` volumes."""
    cmd = cr.compose("down", "--volumes")
    project = cmd[cmd.index("--project-name") + 1]
    assert project != stack.compose_raw()["name"]


def test_apt_install_takes_dev_pys_lock_and_fails_at_its_deadline(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The compose run's docker.io install and `dev.py test`'s installs share one lock (and
    its deadline): held past it, the step fails naming the lock, and apt never runs."""
    import fcntl

    dev = cr.dev_script()
    monkeypatch.setattr(dev, "APT_LOCK", tmp_path / "apt.lock")
    monkeypatch.setattr(dev, "APT_LOCK_WAIT_S", 0.3)
    with (
        mock.patch.object(cr, "quiet") as quiet,
        open(tmp_path / "apt.lock", "w") as held,
    ):
        fcntl.flock(held, fcntl.LOCK_EX)  # another install holds it
        with pytest.raises(cr.StepFailed, match=r"held .*apt\.lock"):
            cr.apt_install("docker.io")
    quiet.assert_not_called()
