"""`--engine sglang`: config -> SGLang / sglang-router command lines, and supervision.

SGLang cannot be installed on these machines, so supervision runs a stand-in module named
`sglang.launch_server` (a fake of an external program, like serper.dev elsewhere).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from inference.config import InferenceConfig
from inference.sglang_launcher import plan, sglang_command
from searchr1.redis_server import free_port


def cfg(**sglang: object) -> InferenceConfig:
    return InferenceConfig.model_validate(
        {"model_path": "/models/policy", "http": {"host": "0.0.0.0", "port": 30000},
         "sglang": {"python": "py", **sglang}}
    )  # fmt: skip


def test_config_maps_onto_launch_server_flags() -> None:
    cmd = sglang_command(
        cfg(tp_size=2, mem_fraction_static=0.8, context_length=8192, extra_args=["--x"]),
        host="0.0.0.0",
        port=30000,
    )
    assert cmd == [
        "py", "-m", "sglang.launch_server", "--model-path", "/models/policy",
        "--host", "0.0.0.0", "--port", "30000", "--tp-size", "2", "--dtype", "auto",
        "--enable-metrics",
        "--mem-fraction-static", "0.8", "--context-length", "8192", "--x",
    ]  # fmt: skip


def test_cpu_workaround_flags() -> None:
    cmd = sglang_command(
        cfg(device="cpu", attention_backend="torch_native", max_total_tokens=65536),
        host="h",
        port=1,
    )
    assert cmd[-6:] == [
        "--device", "cpu", "--attention-backend", "torch_native", "--max-total-tokens", "65536",
    ]  # fmt: skip


def test_replicas_put_the_router_in_front() -> None:
    planned = plan(cfg(), replicas=3)
    assert set(planned) == {"sglang-0", "sglang-1", "sglang-2", "router"}
    children = {name: argv for name, (argv, _) in planned.items()}
    assert children["sglang-1"][children["sglang-1"].index("--port") + 1] == "30002"
    assert children["sglang-1"][children["sglang-1"].index("--host") + 1] == "127.0.0.1"
    assert planned["sglang-1"][1] == "http://127.0.0.1:30002/health"
    assert planned["router"][1] == "http://127.0.0.1:30000/health"
    router = children["router"]
    assert router[:3] == ["py", "-m", "sglang_router.launch_router"]
    workers = router[router.index("--worker-urls") + 1 : router.index("--host")]
    assert workers == [f"http://127.0.0.1:{p}" for p in (30001, 30002, 30003)]
    assert router[router.index("--port") + 1] == "30000"
    # Affinity by default: a routing key's calls stay on one server, new keys go least-loaded.
    assert router[-4:] == ["--policy", "manual", "--assignment-mode", "min_load"]


def test_the_router_policy_is_configurable() -> None:
    c = cfg()
    c.sglang.router_policy = "round_robin"
    router = plan(c, replicas=2)["router"][0]
    assert router[-2:] == ["--policy", "round_robin"] and "--assignment-mode" not in router


FAKE = textwrap.dedent(
    """
    import sys, os, http.server
    port = int(sys.argv[sys.argv.index("--port") + 1])
    log = os.environ["FAKE_LOG"]
    first = not os.path.exists(log)
    with open(log, "a") as f:
        f.write(f"{os.getpid()}\\n")
    if first and os.environ.get("FAKE_HANG_FIRST"):
        import time
        time.sleep(3600)  # never becomes healthy
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
    """
)


def start_launcher(tmp_path: Path, port: int, **env: str) -> subprocess.Popen[bytes]:
    (tmp_path / "sglang").mkdir()
    (tmp_path / "sglang" / "__init__.py").write_text("")
    (tmp_path / "sglang" / "launch_server.py").write_text(FAKE)
    return subprocess.Popen(
        [sys.executable, "-m", "stack.cli", "inference", "serve", "--engine", "sglang",
         "--model", "/models/x", "--port", str(port)],
        env={
            **os.environ,
            "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.getcwd()}",
            "FAKE_LOG": str(tmp_path / "pids"),
            "SEARCHR1_INFERENCE__SGLANG__PYTHON": sys.executable,
            "SEARCHR1_INFERENCE__SGLANG__RESTART_BACKOFF_S": "0.2",
            **env,
        },
    )  # fmt: skip


def wait_health(port: int, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise TimeoutError("fake sglang not up")


@pytest.mark.slow  # over 10 s: CI's slow phase (issue 45)
def test_supervisor_restarts_a_dead_server_and_stops_on_sigterm(tmp_path: Path) -> None:
    port = free_port()
    pids = tmp_path / "pids"
    launcher = start_launcher(tmp_path, port)
    try:
        wait_health(port)
        first = int(pids.read_text().split()[0])
        os.kill(first, signal.SIGKILL)  # the server crashes
        time.sleep(0.5)
        wait_health(port)
        all_pids = [int(p) for p in pids.read_text().split()]
        assert len(all_pids) == 2 and all_pids[1] != first
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(20) == 0
        time.sleep(0.2)
        try:
            os.kill(all_pids[1], 0)
            alive = True
        except ProcessLookupError:
            alive = False
        assert not alive, "the launcher left its SGLang child running"
    finally:
        if launcher.poll() is None:
            launcher.kill()


def test_supervisor_replaces_a_server_that_never_becomes_healthy(tmp_path: Path) -> None:
    port = free_port()
    launcher = start_launcher(
        tmp_path, port, FAKE_HANG_FIRST="1", SEARCHR1_INFERENCE__SGLANG__START_TIMEOUT_S="2"
    )
    try:
        wait_health(port, timeout_s=40)
        assert len((tmp_path / "pids").read_text().split()) == 2
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(20) == 0
    finally:
        if launcher.poll() is None:
            launcher.kill()


def test_admin_token_reaches_sglang_as_admin_api_key_outside_argv(tmp_path: Path) -> None:
    from inference.sglang_launcher import write_secrets_file

    secrets = write_secrets_file(tmp_path, "s3cret")
    argv = sglang_command(cfg(dtype="float32"), host="h", port=1, secrets_file=secrets)
    assert "s3cret" not in " ".join(argv)  # never in the process list
    assert argv[argv.index("--config") + 1] == str(secrets)
    assert argv[argv.index("--dtype") + 1] == "float32"
    assert "--api-key" not in argv  # that one would also lock /generate
    assert secrets.read_text().strip() == "admin-api-key: s3cret"
    assert secrets.stat().st_mode & 0o777 == 0o600
