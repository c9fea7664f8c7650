"""A real sglang-router 0.3.2 in front of two of our engines, as a user runs it: generate,
version checks, pushes to each engine, flush (issue 33). The router comes from SGLang's
environment (`python3 dev.py sglang` installs it there), so the suite runs under `-m sglang`.

What the router lacks and how the stack copes: docs/inference.md ("Behind sglang-router").
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from engine_client.client import InferenceClient, InferencePartialFailure
from harness.inference_server import InferenceServerProcess, RouterProcess
from inference.tiny_model import make_tiny_model
from searchr1.redis_server import free_port
from tests.support.engines import sglang_python

pytestmark = pytest.mark.sglang

TOKEN = "router-realclient-token"
PROMPT = [1, 70, 71, 72, 73]


@dataclass(frozen=True)
class Stack:
    router: str
    engines: list[str]


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path) -> Iterator[Stack]:
    a = InferenceServerProcess(tiny_model_dir, admin_token=TOKEN).start()
    b = InferenceServerProcess(tiny_model_dir, admin_token=TOKEN).start()
    router = None
    try:
        router = RouterProcess([a.url, b.url], python=sglang_python(), policy="round_robin")
        router.start()
        yield Stack(router.url, [a.url, b.url])
    finally:
        if router is not None:
            router.stop()
        a.stop()
        b.stop()


@pytest.fixture
async def client(stack: Stack) -> AsyncIterator[InferenceClient]:
    async with InferenceClient(stack.router, token=TOKEN, timeout_s=60) as c:
        yield c


def push(checkpoint: Path, *urls: str) -> subprocess.CompletedProcess[str]:
    flags = [f for u in urls for f in ("--engine-url", u)]
    return subprocess.run(
        [sys.executable, "-m", "stack.cli", "inference", "push-weights", str(checkpoint),
         *flags, "--master-port", str(free_port()), "--bucket-mb", "1"],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1", "SEARCHR1_ADMIN_TOKEN": TOKEN},
    )  # fmt: skip


async def test_generate_through_the_router_is_what_an_engine_answers(
    client: InferenceClient, stack: Stack
) -> None:
    async with InferenceClient(stack.engines[0]) as direct:
        want = await direct.generate(PROMPT, max_new_tokens=8, temperature=0)
    for _ in range(2):  # round robin: both engines
        got = await client.generate(PROMPT, max_new_tokens=8, temperature=0)
        assert got.output_ids == want.output_ids
        # The engine that answered `want` holds the prompt in its prefix cache; served from it,
        # logprobs agree within 1e-5 (the cache's bound, docs/inference.md), not bit for bit.
        assert max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs, strict=True)) < 1e-5


async def test_a_flush_the_workers_refused_is_a_failure(
    client: InferenceClient, stack: Stack
) -> None:
    # The router does not pass the admin token on: both engines answer 401, the router 206.
    with pytest.raises(InferencePartialFailure, match=r"HTTP 206: .*0 succeeded, 2 failed"):
        await client.flush_cache()
    for url in stack.engines:  # the way that works: each engine directly
        async with InferenceClient(url, token=TOKEN) as engine:
            await engine.flush_cache()


async def test_version_checks_ask_every_engine_and_pushes_go_to_each(
    client: InferenceClient, stack: Stack, tmp_path: Path
) -> None:
    v0 = (await client.get_model_info())["weight_version"]
    seed1 = make_tiny_model(tmp_path / "seed1", seed=1)

    to_router = push(seed1, stack.router)  # the router has no weight routes
    assert to_router.returncode == 1, to_router.stderr[-2000:]
    assert "is sglang-router, which has no weight routes" in to_router.stderr
    assert all(f"--engine-url {u}" in to_router.stderr for u in stack.engines)

    one = push(seed1, stack.engines[0])  # one engine ahead: the check sees the other one
    assert one.returncode == 0, one.stderr[-2000:]
    info = await client.get_model_info()
    assert info["weight_version"] == v0 and info["workers_answered"] == 2

    both = push(seed1, *stack.engines)
    assert both.returncode == 0, both.stderr[-2000:]
    assert (await client.get_model_info())["weight_version"] >= v0 + 1
