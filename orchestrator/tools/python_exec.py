"""The `python` tool: model-written code run in a bubblewrap sandbox (`tools.sandbox`), since the
code is hostile input: a read-only /usr and nothing else of the host, a private size-capped
/tmp as its directory, its own PID namespace (every process it starts dies with the call), no
network, a clean environment, limits on memory, CPU time, file size and processes.

The tool refuses to start where no sandbox can be made (no `bwrap`, user namespaces forbidden),
naming what is missing; it never runs code with less isolation. `allow_network: true` shares
the host's network (its loopback services included) and logs a warning: the only isolation it
gives up. The interpreter is a python3 under /usr (not the service's venv, which stays out of
the sandbox); `python` and `ro_paths` choose another. The code is read from stdin by a fixed
bootstrap (`python -I -u`). The code's own errors (a traceback, a limit hit) are what the policy
reads (`ToolError`: not retried); failing to start the sandbox is the tool's trouble (retried).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
from typing import Any

from orchestrator.tools.base import ToolError, ToolResult
from orchestrator.tools.sandbox import Limits, Sandbox

log = logging.getLogger(__name__)

# Runs in the sandbox (limits already set by prlimit): the code from stdin, then stdin closed.
# At exit it says so when processes the code started are still there (the call kills them).
_BOOTSTRAP = """
import atexit, os, sys
def _left():
    left = [p for p in os.listdir("/proc") if p.isdigit() and int(p) not in (1, os.getpid())]
    if left:
        print(f"[{len(left)} processes the code left running are killed with it]", file=sys.stderr)
atexit.register(_left)
code = sys.stdin.read()
sys.stdin = open("/dev/null")
exec(compile(code, "<code>", "exec"), {"__name__": "__main__"})
"""


def default_python() -> tuple[str, list[str]]:
    """An interpreter the sandbox can run, and what to mount for it: this process's base
    interpreter when it lies under /usr, else the system's python3; failing both, the base
    interpreter with its installation mounted read-only."""
    base = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    if base.startswith("/usr/"):
        return base, []
    found = shutil.which("python3", path="/usr/local/bin:/usr/bin")
    if found is not None:
        return found, []
    return base, [sys.base_prefix]


class PythonTool:
    name = "python"
    description = (
        "Run Python code in a fresh sandboxed process without network; returns what it prints "
        "(stdout and stderr). Only the standard library; /tmp is the place to write files."
    )
    parameters: dict[str, Any] = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "A Python program."}},
        "required": ["code"],
        "additionalProperties": False,
    }

    def __init__(
        self,
        *,
        timeout_s: float = 5.0,
        cpu_time_s: int | None = None,
        memory_mb: int = 256,
        max_output_chars: int = 4000,
        max_file_mb: int = 16,
        disk_mb: int = 64,
        max_processes: int = 16,
        allow_network: bool = False,
        python: str | None = None,
        ro_paths: list[str] | None = None,
    ) -> None:
        self.timeout_s = timeout_s
        self.max_output_chars = max_output_chars
        # CPU seconds (RLIMIT_CPU): by default above the wall limit, which then ends it first
        self.limits = Limits(
            memory_bytes=memory_mb * 2**20,
            cpu_s=cpu_time_s or max(1, int(timeout_s) + 1),
            file_bytes=max_file_mb * 2**20,
            processes=max_processes,
            tmp_bytes=disk_mb * 2**20,
            output_bytes=4 * max_output_chars + 4,  # UTF-8: at most 4 bytes a character
        )
        mounts = list(ro_paths or [])
        if python is None:
            python, extra = default_python()
            mounts += extra
        self.python = python
        try:  # SandboxUnavailable (no bwrap, no user namespaces): the tool refuses to start
            self.sandbox = Sandbox(network=allow_network, ro_paths=mounts)
            self.sandbox.check([python, "-I", "-c", "pass"])
        except RuntimeError as e:
            raise ValueError(f"tool 'python': cannot sandbox code here: {e}") from None
        if allow_network:
            log.warning(
                "tool 'python': options.allow_network is set: the code shares the host's "
                "network, services on its loopback included"
            )

    async def call(self, arguments: dict[str, Any]) -> ToolResult:
        done = await self.sandbox.run(
            [self.python, "-I", "-u", "-c", _BOOTSTRAP],
            stdin=str(arguments["code"]).encode(errors="replace"),
            limits=self.limits,
            timeout_s=self.timeout_s,
        )
        if done.timed_out:
            raise ToolError(f"the code ran longer than {self.timeout_s}s")
        text = done.output.decode(errors="replace")
        if len(text) > self.max_output_chars or done.truncated:
            text = text[: self.max_output_chars] + "\n[output truncated]"
        if done.returncode != 0:
            if done.signal in (signal.SIGXCPU, signal.SIGKILL):
                text += f"\n[killed: CPU time limit of {self.limits.cpu_s}s]"
            elif done.signal is not None:
                text += f"\n[killed by signal {done.signal} ({signal.strsignal(done.signal)})]"
            raise ToolError(text.strip() or f"the code exited with status {done.returncode}")
        return ToolResult(text)
