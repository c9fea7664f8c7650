"""A sandbox for code tools: model-written code is hostile input, so it runs under bubblewrap.

`Sandbox.run` starts a command with `bwrap` in new namespaces of every kind (user, PID, mount,
network, IPC, UTS, cgroup), nested user namespaces disabled, a clean environment and its own
session. What it sees: `/usr` (and the `/bin`, `/lib*` links into it) read-only, its own
`/proc`, a minimal `/dev`, and two private tmpfs of a capped size, `/tmp` (its working
directory) and `/dev/shm`; the root is read-only and nothing else of the host is there (no
`/etc`, `/home`, `/root`, `/work`, host `/tmp`, no Unix socket of any service). Limits, set by
`prlimit` inside before the command runs: address space, CPU seconds and file size per process,
processes (threads included) per sandbox, no core dumps. A service running as the host's root
runs the sandbox as `nobody`, since the kernel never applies RLIMIT_NPROC to root.

The deadline (or the end of the command) kills the sandbox's PID 1, and the kernel then kills
every process of its PID namespace, a double-forked daemon included; `run` returns once they are
gone. Where no sandbox can be made (no `bwrap`, user namespaces forbidden), `check` raises
`SandboxUnavailable` naming what is missing: a code tool refuses to start rather than run code
with less isolation. What the sandbox does not stop: docs/security.md, "Code tools".
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

NOBODY = 65534
# Inside the sandbox: only what /usr holds (mounted read-only) is there.
SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"
_SYSTEM_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# Name resolution and CA certificates, for `network=True` only.
_NETWORK_FILES = ("/etc/resolv.conf", "/etc/hosts", "/etc/nsswitch.conf", "/etc/ssl")
_INSTALL = "install the Debian package `bubblewrap` (apt-get install -y bubblewrap)"


class SandboxUnavailable(RuntimeError):
    """No sandbox can be made on this machine: a code tool refuses to start."""


class SandboxError(RuntimeError):
    """One call's sandbox did not start: the tool's trouble (retried), not the code's."""


@dataclass(frozen=True)
class Limits:
    memory_bytes: int = 256 * 2**20  # RLIMIT_AS, per process
    cpu_s: int = 6  # RLIMIT_CPU, per process
    file_bytes: int = 16 * 2**20  # RLIMIT_FSIZE: the largest file written
    processes: int = 16  # RLIMIT_NPROC: processes and threads, the sandbox's init included
    tmp_bytes: int = 64 * 2**20  # the size of /tmp, and of /dev/shm (tmpfs: memory)
    output_bytes: int = 1 * 2**20  # stdout and stderr kept; the rest is read and dropped


@dataclass(frozen=True)
class Finished:
    returncode: int  # the command's exit status; 128 + N when signal N killed it
    output: bytes  # stdout and stderr, interleaved
    timed_out: bool  # the deadline killed it
    truncated: bool  # output past Limits.output_bytes was dropped

    @property
    def signal(self) -> int | None:
        """The signal that killed the command, if one did (bwrap reports 128 + N)."""
        return self.returncode - 128 if 128 < self.returncode < 128 + 65 else None


def _global_root() -> bool:
    """Whether this process is root of the host (the initial user namespace's uid 0)."""
    if os.geteuid() != 0:
        return False
    try:
        first = Path("/proc/self/uid_map").read_text().split()
    except OSError:
        return True
    return first[:2] == ["0", "0"]


def _parent(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])  # after "pid (comm) state"


class Sandbox:
    """Runs commands under bwrap. `network=True` shares the host's network namespace (its
    loopback services and abstract Unix sockets included); `ro_paths` are host paths mounted
    read-only at the same place (e.g. an interpreter outside /usr)."""

    def __init__(self, *, network: bool = False, ro_paths: Sequence[str] = ()) -> None:
        bwrap = shutil.which("bwrap")
        if bwrap is None:
            raise SandboxUnavailable(f"no `bwrap` (bubblewrap) on PATH: {_INSTALL}")
        prlimit = shutil.which("prlimit", path="/usr/bin:/bin")
        if prlimit is None or not prlimit.startswith("/usr/"):
            raise SandboxUnavailable("no `prlimit` in /usr/bin (Debian package util-linux)")
        missing = [p for p in ro_paths if not os.path.exists(p)]
        if missing:
            raise SandboxUnavailable(f"ro_paths do not exist: {', '.join(missing)}")
        self.bwrap = bwrap
        self.prlimit = prlimit
        self.network = network
        self.ro_paths = [os.path.abspath(p) for p in ro_paths]
        # The kernel does not apply RLIMIT_NPROC to the host's root: run as nobody instead.
        self.as_user: dict[str, object] = (
            {"user": NOBODY, "group": NOBODY, "extra_groups": []} if _global_root() else {}
        )

    def argv(self, command: Sequence[str], limits: Limits, info_fd: int | None = None) -> list[str]:
        """The bwrap command line running `command` under `limits`."""
        a = [self.bwrap, "--unshare-all", "--unshare-user", "--disable-userns"]
        a += ["--die-with-parent", "--new-session", "--hostname", "sandbox"]
        if self.network:
            a.append("--share-net")
        a += ["--ro-bind", "/usr", "/usr"]
        for path in _SYSTEM_LINKS:  # merged /usr: links; otherwise the directories
            if os.path.islink(path):
                a += ["--symlink", os.readlink(path), path]
            elif os.path.isdir(path):
                a += ["--ro-bind", path, path]
        for path in self.ro_paths:
            a += ["--ro-bind", path, path]
        if self.network:
            for path in _NETWORK_FILES:
                a += ["--ro-bind-try", path, path]
        size = str(limits.tmp_bytes)
        a += ["--proc", "/proc", "--dev", "/dev", "--size", size, "--tmpfs", "/dev/shm"]
        a += ["--remount-ro", "/dev", "--size", size, "--tmpfs", "/tmp", "--chdir", "/tmp"]
        a += ["--remount-ro", "/", "--clearenv"]
        env = {"PATH": SANDBOX_PATH, "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8"}
        for k, v in env.items():
            a += ["--setenv", k, v]
        if info_fd is not None:
            a += ["--info-fd", str(info_fd)]
        a += ["--", self.prlimit, f"--as={limits.memory_bytes}", f"--cpu={limits.cpu_s}"]
        a += [f"--fsize={limits.file_bytes}", f"--nproc={limits.processes}", "--core=0"]
        return [*a, "--", *command]

    def check(self, command: Sequence[str], timeout_s: float = 30.0) -> None:
        """At start-up: `command` (a no-op) must run in the sandbox, or SandboxUnavailable says
        why (user namespaces forbidden, an interpreter not inside, ...)."""
        try:
            done = subprocess.run(
                self.argv(command, Limits()),
                capture_output=True,
                timeout=timeout_s,
                env={},
                cwd="/",
                **self.as_user,  # type: ignore[arg-type]
            )
        except (OSError, subprocess.SubprocessError) as e:
            who = f" as uid {NOBODY} (the host's root runs it as nobody)" if self.as_user else ""
            raise SandboxUnavailable(f"bwrap ({self.bwrap}) does not run{who}: {e}") from None
        if done.returncode != 0:
            why = (done.stderr or done.stdout).decode(errors="replace").strip()
            hint = (
                "user namespaces must be allowed (a container needs seccomp and AppArmor "
                "profiles that permit them and an unmasked /proc)"
                if why.startswith("bwrap:")
                else f"{command[0]} must run with only /usr and ro_paths mounted"
            )
            raise SandboxUnavailable(
                f"the sandbox does not work here ({why or f'status {done.returncode}'}): {hint}"
            )

    async def run(
        self, command: Sequence[str], *, stdin: bytes, limits: Limits, timeout_s: float
    ) -> Finished:
        """Run `command` with `stdin`; every process of the sandbox is gone when this returns.
        SandboxError when bwrap could not set the sandbox up."""
        info_r, info_w = os.pipe()
        try:
            proc = await asyncio.create_subprocess_exec(
                *self.argv(command, limits, info_w),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                pass_fds=(info_w,),
                env={},
                cwd="/",
                start_new_session=True,
                **self.as_user,  # type: ignore[arg-type]
            )
        except OSError as e:
            os.close(info_r)
            raise SandboxError(f"cannot run {self.bwrap}: {e}") from e
        finally:
            os.close(info_w)
        info = asyncio.create_task(_read_info(info_r))
        timed_out = False
        try:
            async with asyncio.timeout(timeout_s):
                output, truncated = await _collect(proc, stdin, limits.output_bytes)
                await proc.wait()
        except TimeoutError:
            timed_out, output, truncated = True, b"", False
        finally:
            if proc.returncode is None:  # shielded: a second cancel must not leave it running
                await asyncio.shield(_stop(proc, info))
            child_pid = await _settle(info)
        if child_pid is None:  # bwrap failed before starting the command: no sandbox
            why = output.decode(errors="replace").strip()
            raise SandboxError(f"bwrap did not start the sandbox (status {proc.returncode}): {why}")
        assert proc.returncode is not None
        return Finished(proc.returncode, output, timed_out, truncated)


async def _read_info(fd: int) -> int | None:
    """The sandbox's PID 1 as bwrap reports it on --info-fd (None if it never did)."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    transport, _ = await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", 0)
    )
    try:
        data = await reader.read()
    finally:
        transport.close()
    try:
        pid = json.loads(data)["child-pid"]
    except (ValueError, KeyError, TypeError):
        return None
    return pid if isinstance(pid, int) and pid > 0 else None


async def _settle(info: asyncio.Task[int | None]) -> int | None:
    if not info.done():  # bwrap has exited, so its end of the pipe is closed: EOF is near
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(info), 1.0)
    if not info.done():
        info.cancel()
        return None
    return None if info.cancelled() or info.exception() else info.result()


async def _collect(proc: asyncio.subprocess.Process, stdin: bytes, cap: int) -> tuple[bytes, bool]:
    """Feeds stdin and reads stdout to its end, keeping the first `cap` bytes."""
    assert proc.stdin is not None and proc.stdout is not None

    async def feed() -> None:
        assert proc.stdin is not None
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            proc.stdin.write(stdin)
            await proc.stdin.drain()
        proc.stdin.close()

    feeding = asyncio.create_task(feed())
    kept, truncated = bytearray(), False
    try:
        while chunk := await proc.stdout.read(65536):
            room = cap - len(kept)
            kept += chunk[:room]
            truncated = truncated or len(chunk) > room
        await feeding
    finally:
        feeding.cancel()
    return bytes(kept), truncated


async def _stop(proc: asyncio.subprocess.Process, info: asyncio.Task[int | None]) -> None:
    """Kills the sandbox's PID 1 (the kernel then kills the rest of its PID namespace) and waits
    until bwrap has reaped it, so nothing of the sandbox outlives the call."""
    child = info.result() if info.done() and not info.exception() else None
    if child is not None and _parent(child) == proc.pid:  # still bwrap's child: not reused
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(proc.wait(), 5.0)
    if proc.returncode is None:  # bwrap before it reported its child: --die-with-parent
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
