"""Escape attempts against the `python` tool's sandbox (orchestrator/tools/sandbox.py), each as a
hostile policy would make it: code sent through `PythonTool.call` with the defaults. Every
attempt must fail, and the policy must read that it did (a ToolError's text, or the output).

Without `bwrap` these tests skip, unless this is root with apt-get (CI, where `dev.py test`
installs bubblewrap): there a missing bwrap fails them.
"""

from __future__ import annotations

import ast
import asyncio
import os
import re
import socket
import stat
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.tools.base import ToolError
from orchestrator.tools.python_exec import PythonTool
from orchestrator.tools.sandbox import SandboxError
from tests.unit.orchestrator.test_tools import need_bwrap

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def tool() -> PythonTool:
    need_bwrap()
    return PythonTool()


async def fails(tool: PythonTool, code: str, why: str) -> str:
    """The code's call is a ToolError whose text matches `why`; the text."""
    with pytest.raises(ToolError, match=why) as e:
        await tool.call({"code": code})
    return str(e.value)


def host_processes_with(marker: str) -> list[int]:
    found = []
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and marker.encode() in (p / "cmdline").read_bytes():
                found.append(int(p.name))
        except OSError:
            continue
    return found


# --- the file system ---------------------------------------------------------------------


@pytest.mark.parametrize("where", ["tmp_path", "repo", "/", "/usr", "/dev"])
async def test_no_write_outside_its_tmp(
    tool: PythonTool, tmp_path: Path, where: str, request: pytest.FixtureRequest
) -> None:
    name = f"pwned-{uuid.uuid4().hex}"
    target = {"tmp_path": tmp_path, "repo": ROOT}.get(where, Path(where)) / name
    request.addfinalizer(lambda: target.unlink(missing_ok=True))
    code = f"open({str(target)!r}, 'w').write('x')"
    await fails(tool, code, "FileNotFoundError|Read-only file system|PermissionError")
    assert not target.exists()


@pytest.mark.parametrize(
    "path",
    [
        str(ROOT / "README.md"),
        str(ROOT / "orchestrator" / "tools" / "sandbox.py"),
        "/etc/passwd",
        "/etc/hostname",
        str(Path(sys.executable).parent / "activate"),  # the service's venv
    ],
)
async def test_no_read_of_the_services_files(tool: PythonTool, path: str) -> None:
    if not Path(path).exists():
        pytest.skip(f"{path} is not on this host")
    await fails(tool, f"print(open({path!r}).read())", "FileNotFoundError")


@pytest.mark.parametrize("path", [str(ROOT), "/root", "/home", "/work", "/etc", "/var", "/run"])
async def test_no_listing_of_host_directories(tool: PythonTool, path: str) -> None:
    await fails(tool, f"import os\nprint(os.listdir({path!r}))", "FileNotFoundError")


async def test_the_view_is_usr_proc_dev_and_tmp(tool: PythonTool) -> None:
    out = await tool.call({"code": "import os\nprint(sorted(os.listdir('/')))"})
    system = {"bin", "sbin", "lib", "lib32", "lib64", "libx32", "usr"}
    assert set(ast.literal_eval(out.text)) <= system | {"dev", "proc", "tmp"}


# --- processes ---------------------------------------------------------------------------


async def test_no_view_of_host_processes(tool: PythonTool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SEARCHR1_SANDBOX_SECRET", "hunter2")
    me = os.getpid()
    code = (
        "import os\n"
        "print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))\n"
        "print(sorted(os.environ))\n"
        f"open('/proc/{me}/environ').read()\n"
    )
    text = await fails(tool, code, "FileNotFoundError")
    pids, env = (ast.literal_eval(line) for line in text.splitlines()[:2])
    assert me not in pids and max(pids) < 10  # its own PID namespace: bwrap's init, itself
    assert env == ["HOME", "LANG", "PATH", "PWD", "TMPDIR"]  # --clearenv: nothing of the service
    assert "hunter2" not in text


async def test_a_daemon_dies_with_the_call(tool: PythonTool, tmp_path: Path) -> None:
    marker = f"searchr1-daemon-{uuid.uuid4().hex}"
    written = tmp_path / "daemon-was-here"
    code = f"""
import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        if os.fork() == 0:
            os.execv("/bin/sleep", [{marker!r}, "30"])
        time.sleep(2)
        open({str(written)!r}, "w").write("x")
        os._exit(0)
    os._exit(0)
time.sleep(0.3)
print("parent done")
"""
    t0 = time.monotonic()
    out = await tool.call({"code": code})
    assert time.monotonic() - t0 < 3  # the call does not wait for its daemon
    assert out.text.startswith("parent done\n")
    assert re.search(r"\[\d+ processes the code left running are killed with it\]", out.text)
    assert host_processes_with(marker) == []  # gone when the call returns
    time.sleep(2.5)
    assert not written.exists() and host_processes_with(marker) == []


async def test_a_call_cancelled_by_its_caller_leaves_no_process(tool: PythonTool) -> None:
    """The runner's own deadline cancels the call: the sandbox goes with it."""
    marker = f"searchr1-cancelled-{uuid.uuid4().hex}"
    code = f"import os\nif os.fork() == 0:\n    os.execv('/bin/sleep', [{marker!r}, '30'])\n"
    code += "import time\ntime.sleep(30)"
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(tool.call({"code": code}), 0.5)
    assert host_processes_with(marker) == []


async def test_a_fork_bomb_is_bounded(tool: PythonTool) -> None:
    t0 = time.monotonic()
    await fails(tool, "import os\nwhile True:\n    os.fork()", "Resource temporarily unavailable")
    assert time.monotonic() - t0 < tool.timeout_s


async def test_a_persistent_fork_bomb_ends_at_the_deadline(tool: PythonTool) -> None:
    code = """
import os
while True:
    try:
        os.fork()
    except OSError:
        pass
"""
    t0 = time.monotonic()
    await fails(tool, code, "ran longer than")
    assert time.monotonic() - t0 < tool.timeout_s + 3


async def test_no_new_namespaces_inside(tool: PythonTool) -> None:
    code = "import subprocess\nsubprocess.run(['unshare', '-r', 'true'], check=True)"
    await fails(tool, code, "CalledProcessError|FileNotFoundError")


# --- memory and disk ---------------------------------------------------------------------


async def test_memory_is_bounded(tool: PythonTool) -> None:
    await fails(tool, "x = [bytearray(2**20) for _ in range(10**4)]", "MemoryError")


async def test_one_large_file_hits_the_file_size_limit(tool: PythonTool) -> None:
    code = "open('/tmp/big', 'wb').write(bytes(64 * 2**20))"
    await fails(tool, code, "File too large")


@pytest.mark.parametrize("where", ["/tmp", "/dev/shm"])
async def test_many_files_hit_the_tmpfs_cap(tool: PythonTool, where: str) -> None:
    code = f"for i in range(100):\n    open(f'{where}/f{{i}}', 'wb').write(bytes(8 * 2**20))"
    await fails(tool, code, "No space left on device")


# --- network -----------------------------------------------------------------------------


async def test_no_tcp_to_a_host_loopback_server(tool: PythonTool) -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)"
        await fails(tool, code, "Network is unreachable|Connection refused")


@pytest.fixture
def unix_server(tmp_path: Path) -> Iterator[str]:
    path = str(tmp_path / "service.sock")
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(path)
        s.listen()
        os.chmod(path, stat.S_IRWXU | stat.S_IRWXG | stat.S_IRWXO)
        yield path


async def test_no_unix_socket_of_a_host_service(tool: PythonTool, unix_server: str) -> None:
    code = f"import socket\nsocket.socket(socket.AF_UNIX).connect({unix_server!r})"
    await fails(tool, code, "FileNotFoundError")


async def test_no_abstract_unix_socket_of_the_host(tool: PythonTool) -> None:
    name = f"\0searchr1-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(name)
        s.listen()
        code = f"import socket\nsocket.socket(socket.AF_UNIX).connect({name!r})"
        await fails(tool, code, "ConnectionRefusedError")


# --- start-up ----------------------------------------------------------------------------


def test_refuses_to_start_without_bwrap(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap there
    with pytest.raises(ValueError, match=r"no `bwrap` \(bubblewrap\).*apt-get install"):
        PythonTool()


@pytest.fixture
def failing_bwrap() -> Iterator[Path]:
    """A `bwrap` that fails as in a container forbidding user namespaces (in a directory that
    `nobody`, whom root runs the sandbox as, may enter)."""
    with tempfile.TemporaryDirectory() as d:
        os.chmod(d, 0o755)
        fake = Path(d) / "bwrap"
        fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\n"
                        "exit 1\n")  # fmt: skip
        fake.chmod(0o755)
        yield fake


def test_refuses_to_start_where_bwrap_cannot_sandbox(
    failing_bwrap: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", f"{failing_bwrap.parent}{os.pathsep}{os.environ['PATH']}")
    with pytest.raises(
        ValueError, match=r"No permissions to create new namespace.*user namespaces"
    ):
        PythonTool()


async def test_a_sandbox_that_fails_to_start_is_the_tools_trouble(
    tool: PythonTool, failing_bwrap: Path
) -> None:
    """A RuntimeError, which the runner retries; not a ToolError (the code's own fault)."""
    tool.sandbox.bwrap = str(failing_bwrap)
    with pytest.raises(SandboxError, match=r"did not start the sandbox.*No permissions"):
        await tool.call({"code": "print(1)"})
    assert not issubclass(SandboxError, ToolError) and issubclass(SandboxError, RuntimeError)
