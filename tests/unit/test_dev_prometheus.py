"""dev.py installs Debian's prometheus (promtool included) when it is missing, as it does
chromium and nftables: with apt, as root; a failed install or no root is a message, and the
tests that need it skip. `test`, `slow` and `sglang` all ensure it before their tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def dev(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    spec = importlib.util.spec_from_file_location("dev_under_test", ROOT / "dev.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "dev_under_test", module)
    spec.loader.exec_module(module)
    return module


def fake_system(
    monkeypatch: pytest.MonkeyPatch, dev: ModuleType, *, have: set[str], root: bool, rc: int = 0
) -> list[list[str]]:
    ran: list[list[str]] = []
    monkeypatch.setattr(
        dev.shutil, "which", lambda name: f"/usr/bin/{name}" if name in have else None
    )
    monkeypatch.setattr(dev.os, "geteuid", lambda: 0 if root else 1000)
    monkeypatch.setattr(dev, "_run", lambda cmd, **kw: ran.append(list(cmd)) or rc)
    return ran


def test_nothing_runs_when_both_binaries_are_there(monkeypatch, dev) -> None:  # type: ignore[no-untyped-def]
    ran = fake_system(monkeypatch, dev, have={"promtool", "prometheus", "apt-get"}, root=True)
    dev.ensure_prometheus()
    assert ran == []


def test_missing_is_installed_with_apt_as_root(monkeypatch, dev) -> None:  # type: ignore[no-untyped-def]
    ran = fake_system(monkeypatch, dev, have={"apt-get"}, root=True)
    dev.ensure_prometheus()
    assert ran[0][:2] == ["apt-get", "update"]
    assert ran[1][:2] == ["apt-get", "install"] and ran[1][-1] == "prometheus"


def test_a_failed_install_or_no_root_is_a_message(monkeypatch, dev, capsys) -> None:  # type: ignore[no-untyped-def]
    ran = fake_system(monkeypatch, dev, have={"apt-get"}, root=True, rc=100)
    dev.ensure_prometheus()  # returns: the promtool tests skip, saying why
    assert len(ran) == 1 and "installing prometheus failed" in capsys.readouterr().out
    ran = fake_system(monkeypatch, dev, have={"apt-get"}, root=False)
    dev.ensure_prometheus()
    assert ran == [] and "apt-get install -y prometheus" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["run_tests", "run_slow_tests", "run_sglang_tests"])
def test_each_test_command_ensures_it(monkeypatch, dev, command: str) -> None:  # type: ignore[no-untyped-def]
    called: list[str] = []
    monkeypatch.setattr(dev, "ensure_prometheus", lambda: called.append("prometheus"))
    monkeypatch.setattr(dev, "ensure_chromium", lambda: None)
    monkeypatch.setattr(dev, "ensure_nftables", lambda: called.append("nftables"))
    monkeypatch.setattr(dev, "ensure_sglang_env", lambda: Path(sys.executable))
    monkeypatch.setattr(dev, "_run", lambda cmd, **kw: 0)
    getattr(dev, command)(["-k", "nothing"])
    # nftables: the network-namespace partitions (harness/netns.py), in test and slow.
    want = ["prometheus"] if command == "run_sglang_tests" else ["prometheus", "nftables"]
    assert sorted(called) == sorted(want)


def test_nftables_is_installed_with_apt_as_root_without_recommends(monkeypatch, dev) -> None:  # type: ignore[no-untyped-def]
    ran = fake_system(monkeypatch, dev, have={"apt-get"}, root=True)
    dev.ensure_nftables()
    assert ran[1][:2] == ["apt-get", "install"] and ran[1][-2:] == [
        "--no-install-recommends",
        "nftables",
    ]


def test_an_install_waits_for_the_apt_lock_until_its_deadline(
    monkeypatch, dev, capsys, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    """CI's `prepare` (Docker) and the tests' installs take turns at apt; a lock held past
    the deadline is a message, never a wait without end."""
    import fcntl

    monkeypatch.setattr(dev, "APT_LOCK", tmp_path / "apt.lock")
    monkeypatch.setattr(dev, "APT_LOCK_WAIT_S", 0.5)
    ran = fake_system(monkeypatch, dev, have={"apt-get"}, root=True)
    with open(tmp_path / "apt.lock", "w") as held:  # another install holds it
        fcntl.flock(held, fcntl.LOCK_EX)
        dev.ensure_prometheus()
    assert ran == [] and "held" in capsys.readouterr().out
    dev.ensure_prometheus()  # released: installed
    assert ran[-1][:2] == ["apt-get", "install"]
