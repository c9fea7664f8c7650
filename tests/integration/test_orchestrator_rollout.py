"""Rollouts against the real engine and the real retriever, both as processes.

The policy is the tiny model overfitted on a few Search-R1 episodes (see orchestrator_policy),
so greedy decoding searches, reads the real retriever's documents and answers.
"""

from __future__ import annotations

import asyncio
import math
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from engine_client.client import InferenceClient
from harness.orchestrator_policy import build_episodes, train_policy
from harness.orchestrator_stack import FACTS, SEARCHR1, Service, write_corpus
from orchestrator import metrics
from orchestrator.config import INVALID_ACTION_MESSAGE, RolloutConfig, SearchConfig
from orchestrator.observation import OBS_PREFIX, OBS_SUFFIX
from orchestrator.prompt import make_prompt_text, prompt_token_ids
from orchestrator.rollout import Rollout
from orchestrator.sample import Prompt, Sample, Status, new_group
from orchestrator.tokenizer import rust_tokenizer
from orchestrator.tools.search import SearchTool
from retriever.client import RetrieverClient
from searchr1.redis_server import free_port

TOPK = 2  # short observations keep the policy's training quick
# fact i's memorised episode: the actions of its turns
SCRIPTS = [
    ["search", "answer"],
    ["search", "answer"],
    ["search", "search", "answer"],
    ["invalid", "answer"],
]


@dataclass
class Stack:
    tmp: Path
    retriever: Service
    engine: Service
    policy_dir: Path
    tokenizer: Any
    prompts: list[Prompt]


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model_dir):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    tmp = tmp_path_factory.mktemp("orch-stack")
    corpus = write_corpus(tmp / "corpus.jsonl")
    subprocess.run(
        [
            *SEARCHR1,
            "retriever",
            "build",
            "--corpus",
            str(corpus),
            "--out",
            str(tmp / "index"),
            "--backend",
            "bm25",
        ],
        check=True,
        capture_output=True,
    )
    retriever = Service(
        ["retriever", "serve", "--index", str(tmp / "index"), "--grpc-port", "-1"],
        tmp / "retriever.log",
    ).start()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = [
        Prompt(f"toy/test/{i}", "toy", [{"role": "user", "content": make_prompt_text(q)}], [a])
        for i, (q, a, _) in enumerate(FACTS)
    ]
    facts = [(q, a) for q, a, _ in FACTS]
    episodes = asyncio.run(
        build_episodes(tokenizer, retriever.url, prompts, facts, SCRIPTS, topk=TOPK)
    )
    policy = train_policy(Path(tiny_model_dir), tmp / "policy", episodes)
    engine = Service(
        ["inference", "serve", "--engine", "torch", "--model", str(policy)], tmp / "engine.log"
    ).start()
    try:
        yield Stack(tmp, retriever, engine, policy, tokenizer, prompts)
    finally:
        engine.stop()
        retriever.stop()


def rollout_for(stack: Stack, retriever_url: str | None = None, **cfg: Any) -> Rollout:
    search_cfg = SearchConfig(
        retriever_url=retriever_url or stack.retriever.url, topk=TOPK, limits=cfg.pop("search", {})
    )
    # As the service builds them (orchestrator.wiring): aiohttp pools, the Rust tokenizer.
    retriever = RetrieverClient(search_cfg.retriever_url, timeout_s=2.0, http_backend="aiohttp")
    tool = SearchTool(retriever, search_cfg)
    engine = InferenceClient(stack.engine.url, max_retries=1, http_backend="aiohttp")
    tok = rust_tokenizer(stack.tokenizer)
    return Rollout(RolloutConfig(**cfg), engine, tool, tok, greedy=True)


async def run_one(rollout: Rollout, prompt: Prompt, group_size: int = 1) -> list[Sample]:
    ids = prompt_token_ids(rollout.tokenizer, prompt.messages)
    group = new_group(prompt, ids, group_size=group_size, rollout_step=0, run_id="it")
    try:
        return list(await asyncio.gather(*(rollout.run_sample(s) for s in group)))
    finally:
        await rollout.generator.aclose()
        await rollout.search_tool.client.aclose()


def check_alignment(tok: Any, s: Sample) -> None:
    """Token by token: text, masks over exactly the observation spans, logprobs."""
    prompt_text = tok.decode(s.prompt_ids, skip_special_tokens=False)
    whole = tok.decode(s.prompt_ids + s.response_ids, skip_special_tokens=False)
    assert whole == prompt_text + s.response_text
    assert len(s.response_ids) == len(s.loss_mask) == len(s.logprobs)
    pos = 0
    for i, t in enumerate(s.turns):
        model = slice(pos, pos + t.generated_tokens)
        assert s.loss_mask[model] == [1] * t.generated_tokens
        assert all(lp <= 0 and math.isfinite(lp) for lp in s.logprobs[model])
        pos += t.generated_tokens
        obs = slice(pos, pos + t.observation_tokens)
        assert s.loss_mask[obs] == [0] * t.observation_tokens
        assert s.logprobs[obs] == [0.0] * t.observation_tokens
        obs_text = tok.decode(s.response_ids[obs], skip_special_tokens=False)
        # A search in the last turn gets no observation when the sample ran out of turns or
        # of response budget (sampled outputs can do either); every other search gets one.
        cut_short = i == len(s.turns) - 1 and s.status in (Status.MAX_TURNS, Status.RESPONSE_BUDGET)
        if t.action == "search" and not cut_short:
            assert obs_text.startswith(OBS_PREFIX) and obs_text.endswith(OBS_SUFFIX)
        elif t.action == "search":
            assert t.observation_tokens == 0
        elif t.observation_tokens:
            assert obs_text == INVALID_ACTION_MESSAGE
        pos += t.observation_tokens
    assert pos == len(s.response_ids)


async def test_search_then_answer_is_token_exact(stack: Stack) -> None:
    [s] = await run_one(rollout_for(stack), stack.prompts[0])
    assert s.status == Status.ANSWERED, s.response_text
    assert [t.action for t in s.turns] == ["search", "answer"]
    assert s.turns[0].query == "capital of france"
    assert s.turns[0].doc_ids[0] == "0"  # the passage about Paris ranks first
    assert s.turns[0].engine_finish_reason == "stop"
    # The engine stopped at the tag: the turn's text ends with it, nothing after.
    first_turn = stack.tokenizer.decode(s.response_ids[: s.turns[0].generated_tokens])
    assert first_turn.endswith("</search>")
    assert "Paris is the capital" in s.response_text
    assert "<answer> Paris </answer>" in s.response_text
    check_alignment(stack.tokenizer, s)


async def test_invalid_action_then_answer(stack: Stack) -> None:
    [s] = await run_one(rollout_for(stack), stack.prompts[3])
    assert [t.action for t in s.turns] == ["invalid", "answer"]
    assert s.status == Status.ANSWERED
    check_alignment(stack.tokenizer, s)


async def test_turn_semantics(stack: Stack) -> None:
    [slime] = await run_one(rollout_for(stack, max_turns=2), stack.prompts[2])
    assert [t.action for t in slime.turns] == ["search", "search"]
    assert slime.status == Status.MAX_TURNS and slime.turns[1].observation_tokens == 0
    [orig] = await run_one(
        rollout_for(stack, max_turns=2, turn_semantics="original"), stack.prompts[2]
    )
    assert [t.action for t in orig.turns] == ["search", "search", "answer"]
    assert orig.status == Status.ANSWERED
    check_alignment(stack.tokenizer, orig)


async def test_per_turn_and_response_budgets(stack: Stack) -> None:
    [s] = await run_one(rollout_for(stack, max_tokens_per_turn=6), stack.prompts[0])
    assert s.turns[0].generated_tokens == 6 and s.turns[0].engine_finish_reason == "length"
    assert s.turns[0].action == "invalid"
    [s] = await run_one(
        rollout_for(stack, max_tokens_per_turn=20, max_response_tokens=30), stack.prompts[0]
    )
    assert s.status == Status.RESPONSE_BUDGET and len(s.response_ids) <= 30


async def test_group_sizes(stack: Stack) -> None:
    r = rollout_for(stack)
    r.greedy = False  # sampled: the group's members may differ
    group = await run_one(r, stack.prompts[1], group_size=4)
    assert [s.sample_index for s in group] == [0, 1, 2, 3]
    assert len({s.trajectory_id for s in group}) == 4
    for s in group:
        check_alignment(stack.tokenizer, s)


async def test_retriever_that_stays_down(stack: Stack) -> None:
    """The search waits for the retriever (its /ready fails too) up to breaker_max_wait_s,
    then fails with the wait and the last error."""
    before = metrics.SEARCH_FAILURES.labels("CircuitOpen")._value.get()
    dead = f"http://127.0.0.1:{free_port()}"
    search = {
        "max_attempts": 3, "backoff_initial_s": 0.01, "backoff_max_s": 0.02,
        "breaker_probe_s": 0.1, "breaker_max_wait_s": 0.5,
    }  # fmt: skip
    [s] = await run_one(rollout_for(stack, retriever_url=dead, search=search), stack.prompts[0])
    assert s.turns[0].action == "search" and s.turns[0].tool_attempts == 3
    assert s.turns[0].error.startswith("retriever down for more than 0.5s (RetrieverUnavailable")
    assert "<information>Search failed: retriever down for more than 0.5s" in s.response_text
    assert s.infrastructure_failure
    assert metrics.SEARCH_FAILURES.labels("CircuitOpen")._value.get() == before + 1
    check_alignment(stack.tokenizer, s)


async def test_retriever_that_fails_then_recovers(stack: Stack) -> None:
    port = free_port()
    late = Service(
        ["retriever", "serve", "--index", str(stack.tmp / "index"), "--grpc-port", "-1"],
        stack.tmp / "late-retriever.log",
        port=port,
    )
    # It comes up ~1 s after the first search attempt; retries span up to ~30 s.
    starter = threading.Timer(1.0, lambda: late.start(wait=False))
    search = {"max_attempts": 60, "backoff_initial_s": 0.2, "backoff_max_s": 0.5}
    try:
        starter.start()
        t0 = time.monotonic()
        [s] = await run_one(
            rollout_for(stack, retriever_url=late.url, search=search), stack.prompts[0]
        )
        assert time.monotonic() - t0 >= 1.0
        assert s.turns[0].error == "" and s.turns[0].tool_attempts > 1
        assert s.turns[0].doc_ids and s.status == Status.ANSWERED
    finally:
        starter.join()
        late.stop()


# -- the orchestrator process ------------------------------------------------------------------


def write_config(
    stack: Stack, redis_url: str, path: Path, run: dict[str, Any] | None = None, **orch: Any
) -> Path:
    import json

    import yaml

    from orchestrator.prompt import make_row

    rows = [
        make_row(q, [a], data_source="toy", split="test", index=i)
        for i, (q, a, _) in enumerate(FACTS)
    ]
    data = stack.tmp / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    section = {
        "weight_poll_s": 0.1,
        "data": {"train_path": str(data), "seed": 1},
        "search": {"retriever_url": stack.retriever.url, "topk": TOPK},
        **orch,
    }
    cfg = {
        "redis": {"url": redis_url},
        "logging": {"json_format": True},
        "run": {"id": "e2e", "groups_per_step": 2, "group_size": 2, **(run or {})},
        "engines": {"urls": [stack.engine.url]},
        "orchestrator": section,
    }
    path.write_text(yaml.safe_dump(cfg))
    return path


def get_json(url: str) -> Any:
    import httpx

    return httpx.get(url, timeout=5).json()


async def drain(redis_url: str) -> list[Any]:
    from searchr1.bus import TrajectoryBus
    from searchr1.sections import BusConfig

    bus = TrajectoryBus.from_url(redis_url, BusConfig())
    try:
        out = []
        while batch := await bus.consume(100, block=0.2):
            out += batch
            await bus.ack(batch)
        return [d.trajectory for d in out]
    finally:
        await bus.close()


@pytest.mark.slow  # over 10 s: CI's slow phase (issue 45)
async def test_orchestrator_process_sync_mode_and_restart(stack: Stack, redis_server) -> None:  # type: ignore[no-untyped-def]
    import httpx

    cfg = write_config(stack, redis_server.url, stack.tmp / "sync.yaml", run={"max_steps": 2})
    orch = Service(["orchestrator", "run", "--config", str(cfg)], stack.tmp / "orch.log").start()
    try:
        deadline = time.monotonic() + 60
        while get_json(f"{orch.url}/status")["step"] != 1:  # step 0 done; step 1 needs v+1
            assert time.monotonic() < deadline, orch.log_path.read_text()[-2000:]
            await asyncio.sleep(0.1)
        text = httpx.get(f"{orch.url}/metrics").text
        assert "searchr1_rollout_groups_published_total 2.0" in text
        assert "searchr1_rollout_turns_per_sample_count" in text
        first = await drain(redis_server.url)
        assert len(first) == 4 and {t.rollout_step for t in first} == {0}
        base = first[0].weight_version
        assert {t.weight_version for t in first} == {base}
        # The trainer "pushes" new weights; the orchestrator then runs step 1 and exits 0.
        engine = InferenceClient(stack.engine.url)
        await engine.update_weights_from_disk(str(stack.policy_dir))
        await engine.aclose()
        assert orch.proc is not None and orch.proc.wait(60) == 0
        second = await drain(redis_server.url)
        assert len(second) == 4 and {t.rollout_step for t in second} == {1}
        assert {t.weight_version for t in second} == {base + 1}
        assert len({t.trajectory_id for t in first + second}) == 8
        for t in second:
            assert len(t.response_token_ids) == len(t.loss_mask) == len(t.rollout_logprobs)
            assert set(t.reward.components) >= {"em", "sub_em", "f1", "format"}
    finally:
        orch.stop()
    # Started again with the same run id after its last step: refused with what to do (it used
    # to publish nothing and exit 0 while a new run's trainer waited forever); nothing twice.
    again = Service(["orchestrator", "run", "--config", str(cfg)], stack.tmp / "orch2.log")
    again.start(wait=False)
    assert again.proc is not None and again.proc.wait(60) == 1
    assert "already rolled out all its 2 steps" in again.log_path.read_text()
    assert await drain(redis_server.url) == []


def test_eval_command(stack: Stack, tmp_path: Path) -> None:
    import json

    cfg = write_config(stack, "redis://127.0.0.1:1/0", tmp_path / "eval.yaml")
    out = tmp_path / "eval.json"
    rows = stack.tmp / "rows.jsonl"
    proc = subprocess.run(
        [*SEARCHR1, "eval", "--config", str(cfg), "--data", str(rows), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "toy" in proc.stdout and "EM" in proc.stdout
    result = json.loads(out.read_text())
    toy = result["per_source"]["toy"]
    assert toy["n"] == 4 and toy["errors"] == 0
    assert toy["response_tokens_mean"] > 0  # the demo's before/after table reads it
    # Greedy: facts 0, 1 and 3 are answered right; fact 2 runs out of turns (slime max_turns=2).
    assert toy["em"] == pytest.approx(0.75)
    assert result["macro"]["em"] == pytest.approx(0.75)


async def test_async_staleness_bound_with_weight_updates(stack: Stack, redis_server) -> None:  # type: ignore[no-untyped-def]
    """The real engine's weights change during the run; what is published honours the bound."""
    from orchestrator.config import OrchestratorConfig
    from orchestrator.data import PromptSampler
    from orchestrator.loop import Orchestrator
    from orchestrator.scoring import Scorer
    from searchr1.bus import TrajectoryBus
    from searchr1.sections import BusConfig, RunConfig

    cfg = OrchestratorConfig.model_validate(
        {
            "mode": "async",
            "max_staleness": 0,
            "stale_policy": "drop",
            "epochs": 3,
        }
    )
    rollout = rollout_for(stack)
    rollout.greedy = False
    bus = TrajectoryBus.from_url(redis_server.url, BusConfig())
    orch = Orchestrator(
        cfg,
        run=RunConfig(id="stale", groups_per_step=4, group_size=2),
        rollout=rollout,
        scorer=Scorer(cfg.reward),
        engine=rollout.generator,
        bus=bus,
        sampler=PromptSampler(stack.prompts, 4, epochs=3),
    )
    stale_before = metrics.GROUPS_SKIPPED.labels("stale")._value.get()
    updater = InferenceClient(stack.engine.url)

    async def push_weights() -> None:
        while True:
            await asyncio.sleep(0.4)
            await updater.update_weights_from_disk(str(stack.policy_dir))

    pusher = asyncio.create_task(push_weights())
    try:
        await asyncio.wait_for(orch.run(), 120)
    finally:
        pusher.cancel()
        await updater.aclose()
        await bus.close()
        await rollout.generator.aclose()
        await rollout.search_tool.client.aclose()
    published = await drain(redis_server.url)
    dropped = metrics.GROUPS_SKIPPED.labels("stale")._value.get() - stale_before
    assert len(published) // 2 + dropped == 12  # every group: published or counted as stale
    for t in published:  # max_staleness 0: no sample mixes weights or lags the engine
        assert t.max_weight_version == t.weight_version
        assert all(turn.weight_version == t.weight_version for turn in t.turns)


@pytest.mark.slow
async def test_orchestrator_killed_mid_step_publishes_no_group_twice(
    stack: Stack, redis_server
) -> None:  # type: ignore[no-untyped-def]
    import httpx

    cfg = write_config(
        stack,
        redis_server.url,
        stack.tmp / "kill.yaml",
        run={"id": "kill", "groups_per_step": 4, "group_size": 4},
        mode="async",
        epochs=2,  # 4 rows, 4 prompts per step: two steps
        rollout={"max_concurrent_samples": 4},
    )
    orch = Service(["orchestrator", "run", "--config", str(cfg)], stack.tmp / "kill.log").start()
    published = "searchr1_rollout_groups_published_total"
    deadline = time.monotonic() + 60
    while True:  # one group at a time (max_concurrent_samples = group_size): kill after one
        metric = [
            ln
            for ln in httpx.get(f"{orch.url}/metrics").text.splitlines()
            if ln.startswith(published + " ")
        ]
        if metric and float(metric[0].split()[1]) >= 1:
            break
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    assert orch.proc is not None
    orch.proc.kill()
    orch.proc.wait(10)
    again = Service(["orchestrator", "run", "--config", str(cfg)], stack.tmp / "kill2.log")
    again.start(wait=False)
    assert again.proc is not None and again.proc.wait(120) == 0
    # It resumes step 0 from the claims in Redis: the published group is not run again.
    assert '"msg": "joined a started step"' in again.log_path.read_text()
    got = await drain(redis_server.url)
    ids = [t.trajectory_id for t in got]
    assert len(ids) == len(set(ids)) == 2 * 4 * 4
