"""The `python` tool: code run in a separate process with a wall-time limit, CPU-time, memory
and file-size limits (`resource`, set in the child before the code runs), and no network.

No network: the process runs in a new network namespace (`unshare -rn`, util-linux; only a
loopback that is down), found at start-up. Where no namespace can be made (a container
without the privilege), the tool refuses to start unless `options.allow_network: true` says
to run without that isolation. The code is read from stdin by a fixed bootstrap (`python -I`:
no environment variables, no user site), in an empty temporary directory, with an empty
environment. The code's own errors (a traceback, a limit hit) are what the policy reads
(`ToolError`: not retried); failing to start a process is the tool's trouble (retried).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from typing import Any

from orchestrator.tools.base import ToolError, ToolResult

# Runs in the child: limits first (soft = hard, so the code cannot raise them), then the code.
_BOOTSTRAP = """
import resource, sys
mem, cpu, fsize = (int(a) for a in sys.argv[1:4])
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
code = sys.stdin.read()
sys.stdin = open("/dev/null")
exec(compile(code, "<code>", "exec"), {"__name__": "__main__"})
"""


def network_isolation() -> list[str] | None:
    """The command prefix that runs a process without network, or None where none works."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return None
    for flags in ("-rn", "-n"):  # -r: a user namespace, so no root is needed
        try:
            done = subprocess.run([unshare, flags, "true"], capture_output=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if done.returncode == 0:
            return [unshare, flags]
    return None


class PythonTool:
    name = "python"
    description = (
        "Run Python code in a fresh process without network; returns what it prints "
        "(stdout and stderr)."
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
        allow_network: bool = False,
        python: str = sys.executable,
    ) -> None:
        self.timeout_s = timeout_s
        # CPU seconds (RLIMIT_CPU): by default above the wall limit, which then ends it first
        self.cpu_time_s = cpu_time_s or max(1, int(timeout_s) + 1)
        self.memory_bytes = memory_mb * 1024 * 1024
        self.max_output_chars = max_output_chars
        self.max_file_bytes = max_file_mb * 1024 * 1024
        self.python = python
        prefix = network_isolation()
        if prefix is None and not allow_network:
            raise ValueError(
                "tool 'python': cannot run code without network here (no usable `unshare -n`); "
                "set options.allow_network: true to run it with the host's network"
            )
        self.prefix = prefix or []

    async def call(self, arguments: dict[str, Any]) -> ToolResult:
        cpu_s = self.cpu_time_s
        with tempfile.TemporaryDirectory(prefix="searchr1-python-") as cwd:
            proc = await asyncio.create_subprocess_exec(
                *self.prefix,
                self.python,
                "-I",
                "-c",
                _BOOTSTRAP,
                str(self.memory_bytes),
                str(cpu_s),
                str(self.max_file_bytes),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                cwd=cwd,
                env={"PATH": os.defpath},
                start_new_session=True,  # its own process group: killed as a whole
            )
            try:
                async with asyncio.timeout(self.timeout_s):
                    out, _ = await proc.communicate(str(arguments["code"]).encode())
            except TimeoutError:
                raise ToolError(f"the code ran longer than {self.timeout_s}s") from None
            finally:
                if proc.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    await proc.wait()
        text = out.decode(errors="replace")
        if len(text) > self.max_output_chars:
            text = text[: self.max_output_chars] + "\n[output truncated]"
        if proc.returncode != 0:
            if proc.returncode in (-signal.SIGXCPU, -signal.SIGKILL):
                text += f"\n[killed: CPU time limit of {cpu_s}s]"
            raise ToolError(text.strip() or f"the code exited with status {proc.returncode}")
        return ToolResult(text)
