"""Real service processes for the orchestrator integration tests and bench/rollout.py
(retriever, engine)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from searchr1.redis_server import free_port

SEARCHR1 = [sys.executable, "-m", "stack.cli"]

# question, gold answer, the passage that answers it
FACTS = [
    ("capital of france", "Paris", "Paris is the capital and most populous city of France."),
    ("who wrote hamlet", "Shakespeare", "Hamlet is a tragedy written by William Shakespeare."),
    ("largest planet", "Jupiter", "Jupiter is the largest planet in the Solar System."),
    ("tallest mountain", "Everest", "Mount Everest is the tallest mountain above sea level."),
]
FILLER = [
    ("Rivers", "The Nile and the Amazon are among the longest rivers on Earth."),
    ("Oceans", "The Pacific Ocean is the largest and deepest ocean."),
    ("Music", "A symphony is an extended musical composition for orchestra."),
    ("Birds", "Penguins are flightless birds living mostly in the Southern Hemisphere."),
]


def write_corpus(path: Path) -> Path:
    rows = [{"id": str(i), "contents": f'"{a}"\n{text}'} for i, (_, a, text) in enumerate(FACTS)]
    rows += [
        {"id": str(len(FACTS) + i), "contents": f'"{t}"\n{text}'}
        for i, (t, text) in enumerate(FILLER)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


class Service:
    """`searchr1 <args> --port N` as a child process; `start` waits for /ready."""

    def __init__(self, args: list[str], log_path: Path, port: int | None = None) -> None:
        self.args = args
        self.port = port or free_port()
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 120.0, wait: bool = True) -> Service:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd()}
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [*SEARCHR1, *self.args, "--port", str(self.port)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
        if wait:
            self.wait_ready(timeout_s)
        return self

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.args[:2]} exited: {self.log_path.read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"{self.args[:2]} not ready: {self.log_path.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
