"""The multi-turn loop's token bookkeeping, checked token by token with a real tokenizer."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest
from prometheus_client import REGISTRY

from orchestrator.config import INVALID_ACTION_MESSAGE, RolloutConfig, SearchConfig
from orchestrator.metrics import step_summary
from orchestrator.observation import observation_text
from orchestrator.prompt import make_prompt_text, prompt_token_ids
from orchestrator.rollout import Rollout
from orchestrator.sample import Prompt, Status, new_group
from orchestrator.tokenizer import rust_tokenizer
from orchestrator.tools.search import SearchTool
from orchestrator.trajectory import to_trajectory
from protos.trajectory import FinishReason, decode, encode
from tests.unit.orchestrator.conftest import ScriptedEngine


@dataclass(frozen=True)
class Hit:
    id: str
    contents: str
    score: float | None = None


class FakeRetriever:
    def __init__(self, delay: float = 0.0) -> None:
        self.queries: list[str] = []
        self.delay = delay

    async def search(self, queries: list[str], topk: int | None = None) -> list[list[Hit]]:
        self.queries += queries
        await asyncio.sleep(self.delay)
        return [
            [Hit("7", '"Paris"\nParis is the capital of France.'), Hit("9", '"Lyon"\nA city.')]
            for _ in queries
        ]


PROMPT = Prompt(
    prompt_id="nq/train/0",
    data_source="nq",
    messages=[{"role": "user", "content": make_prompt_text("capital of france")}],
    golds=["Paris"],
)
TURN1 = "<think> look it up </think>\n<search> capital of france </search>"
TURN2 = "<think> it is paris </think>\n<answer> Paris </answer>"
DOCS = 'Doc 1(Title: "Paris") Paris is the capital of France.\nDoc 2(Title: "Lyon") A city.\n'


def make(tokenizer, turns, *, group_size=1, retriever=None, context_length=None, **cfg):  # type: ignore[no-untyped-def]
    engine = ScriptedEngine(tokenizer, turns)
    tool = SearchTool(retriever or FakeRetriever(), SearchConfig(topk=2))
    # The service's tokenizer (Rust backend called directly); expectations use transformers'.
    fast = rust_tokenizer(tokenizer)
    rollout = Rollout(RolloutConfig(**cfg), engine, tool, fast, context_length=context_length)
    ids = prompt_token_ids(tokenizer, PROMPT.messages)
    group = new_group(PROMPT, ids, group_size=group_size, rollout_step=3, run_id="r")
    return engine, rollout, group


async def test_search_then_answer_token_exact(tokenizer) -> None:  # type: ignore[no-untyped-def]
    engine, rollout, [s] = make(tokenizer, [TURN1, TURN2])
    await rollout.run_sample(s)
    assert s.status == Status.ANSWERED
    t1 = tokenizer.encode(TURN1, add_special_tokens=False)
    obs_txt = observation_text(DOCS)
    obs = tokenizer.encode(obs_txt, add_special_tokens=False)
    t2 = tokenizer.encode(TURN2, add_special_tokens=False)
    # Token by token: model ids as returned, observation ids tokenized once, in order.
    assert s.response_ids == t1 + obs + t2
    assert s.loss_mask == [1] * len(t1) + [0] * len(obs) + [1] * len(t2)
    n1, n2 = len(t1), len(t2)
    expected_lps = [-(i + 1) / 1000 for i in range(n1)] + [0.0] * len(obs)
    expected_lps += [-(n1 + i + 1) / 1000 for i in range(n2)]
    assert s.logprobs == pytest.approx(expected_lps)
    assert s.response_text == TURN1 + obs_txt + TURN2
    assert tokenizer.decode(s.response_ids) == s.response_text
    # The engine got token ids: prompt, then exactly the previous context.
    assert engine.calls[0]["input_ids"] == s.prompt_ids
    assert engine.calls[1]["input_ids"] == s.prompt_ids + t1 + obs
    assert engine.calls[0]["stop"] == ["</search>", "</answer>"]
    assert engine.calls[0]["no_stop_trim"] is True
    assert [t.action for t in s.turns] == ["search", "answer"]
    assert s.turns[0].query == "capital of france"
    assert s.turns[0].doc_ids == ["7", "9"]
    assert s.turns[0].observation_tokens == len(obs)
    assert s.turns[0].tool_attempts == 1


async def test_invalid_action_gets_correction_message(tokenizer) -> None:  # type: ignore[no-untyped-def]
    _, rollout, [s] = make(tokenizer, ["I think maybe", TURN2])
    await rollout.run_sample(s)
    msg = tokenizer.encode(INVALID_ACTION_MESSAGE, add_special_tokens=False)
    t0 = tokenizer.encode("I think maybe", add_special_tokens=False)
    assert s.response_ids[len(t0) : len(t0) + len(msg)] == msg
    assert s.loss_mask[len(t0) : len(t0) + len(msg)] == [0] * len(msg)
    assert [t.action for t in s.turns] == ["invalid", "answer"]
    assert s.response_text.startswith("I think maybe\nMy previous action is invalid.")


async def test_slime_max_turns_counts_generation_calls(tokenizer) -> None:  # type: ignore[no-untyped-def]
    retriever = FakeRetriever()
    engine, rollout, [s] = make(tokenizer, [TURN1], retriever=retriever, max_turns=2)
    await rollout.run_sample(s)
    assert len(engine.calls) == 2
    assert s.status == Status.MAX_TURNS
    # The last call's search is not executed: nothing could read its result.
    assert retriever.queries == ["capital of france"]
    assert s.loss_mask[-1] == 1


async def test_original_semantics_adds_final_turn(tokenizer) -> None:  # type: ignore[no-untyped-def]
    retriever = FakeRetriever()
    engine, rollout, [s] = make(
        tokenizer, [TURN1], retriever=retriever, max_turns=3, turn_semantics="original"
    )
    await rollout.run_sample(s)
    assert len(engine.calls) == 4  # 3 search rounds + 1 final answer-only turn
    assert len(retriever.queries) == 3
    assert s.status == Status.MAX_TURNS


async def test_per_turn_budget_passed_to_engine(tokenizer) -> None:  # type: ignore[no-untyped-def]
    engine, rollout, [s] = make(tokenizer, [TURN1, TURN2], max_tokens_per_turn=5)
    await rollout.run_sample(s)
    assert all(c["max_new_tokens"] == 5 for c in engine.calls)
    assert s.turns[0].engine_finish_reason == "length"
    assert s.turns[0].action == "invalid"  # cut before the closing tag


async def test_slime_ends_the_sample_on_a_length_turn(tokenizer) -> None:  # type: ignore[no-untyped-def]
    # slime's generate breaks on finish_reason "length": no correction, no further turn.
    engine, rollout, [s] = make(tokenizer, [TURN1, TURN2], max_tokens_per_turn=5, max_turns=3)
    await rollout.run_sample(s)
    assert len(engine.calls) == 1
    assert s.status == Status.TRUNCATED
    assert s.loss_mask == [1] * 5 and s.turns[0].observation_tokens == 0
    assert to_trajectory(s).finish_reason == FinishReason.FINISH_REASON_TRUNCATED
    assert step_summary([s], 1.0)["truncation_rate"] == 1.0


async def test_slime_length_turn_at_the_response_budget_is_labelled_so(tokenizer) -> None:  # type: ignore[no-untyped-def]
    engine, rollout, [s] = make(tokenizer, [TURN1], max_tokens_per_turn=50, max_response_tokens=5)
    await rollout.run_sample(s)
    assert len(engine.calls) == 1 and len(s.response_ids) == 5
    assert s.status == Status.RESPONSE_BUDGET


async def test_slime_length_turn_short_of_its_budget_is_the_context_limit(tokenizer) -> None:  # type: ignore[no-untyped-def]
    engine, rollout, [s] = make(tokenizer, [TURN1, TURN2], max_tokens_per_turn=5)
    orig = engine.generate

    async def context_full(input_ids, **kw):  # type: ignore[no-untyped-def]
        # The engine clamps to its context: "length" with fewer tokens than asked for.
        return await orig(input_ids, **{**kw, "max_new_tokens": 3})

    engine.generate = context_full  # type: ignore[method-assign]
    await rollout.run_sample(s)
    assert len(s.response_ids) == 3 and len(engine.calls) == 1
    assert s.status == Status.CONTEXT_LIMIT
    assert to_trajectory(s).finish_reason == FinishReason.FINISH_REASON_CONTEXT_LIMIT


async def test_original_semantics_continue_after_a_length_turn(tokenizer) -> None:  # type: ignore[no-untyped-def]
    engine, rollout, [s] = make(
        tokenizer, [TURN1, TURN2], max_tokens_per_turn=5, max_turns=2, turn_semantics="original"
    )
    await rollout.run_sample(s)
    # The cut turn is an invalid action: corrected, then the sample goes on.
    assert len(engine.calls) == 3
    assert [t.engine_finish_reason for t in s.turns] == ["length"] * 3
    assert [t.action for t in s.turns] == ["invalid"] * 3
    msg = tokenizer.encode(INVALID_ACTION_MESSAGE, add_special_tokens=False)
    assert s.turns[0].observation_tokens == len(msg)
    assert s.status == Status.MAX_TURNS


async def test_whole_response_budget(tokenizer) -> None:  # type: ignore[no-untyped-def]
    n1 = len(tokenizer.encode(TURN1, add_special_tokens=False))
    engine, rollout, [s] = make(
        tokenizer,
        [TURN1, TURN2],
        max_turns=4,
        max_response_tokens=n1 + 10,
        max_tokens_per_turn=n1,
    )
    await rollout.run_sample(s)
    # The observation (~40 tokens) does not fit in the 10 remaining tokens.
    assert s.status == Status.RESPONSE_BUDGET
    assert len(s.response_ids) <= n1 + 10
    assert len(engine.calls) == 1


async def test_observation_truncated_keeps_tags(tokenizer) -> None:  # type: ignore[no-untyped-def]
    _, rollout, [s] = make(tokenizer, [TURN1, TURN2], observation_max_tokens=12)
    await rollout.run_sample(s)
    obs_tokens = s.turns[0].observation_tokens
    assert obs_tokens <= 12
    obs_text = s.response_text[len(TURN1) : s.response_text.index("<think> it is")]
    assert obs_text.startswith("\n\n<information>Doc 1")
    assert obs_text.endswith("</information>\n\n")
    assert tokenizer.decode(s.response_ids) == s.response_text


async def test_group_and_trajectory(tokenizer) -> None:  # type: ignore[no-untyped-def]
    _, rollout, group = make(tokenizer, [TURN1, TURN2], group_size=3)
    await asyncio.gather(*(rollout.run_sample(s) for s in group))
    assert [s.trajectory_id for s in group] == [f"r/3/nq/train/0/{i}" for i in range(3)]
    traj = decode(encode(to_trajectory(group[1])))
    assert traj.group_size == 3 and traj.sample_index == 1
    assert traj.finish_reason == FinishReason.FINISH_REASON_ANSWERED
    assert list(traj.response_token_ids) == group[1].response_ids
    assert list(traj.loss_mask) == group[1].loss_mask
    assert traj.rollout_step == 3 and traj.has_rollout_logprobs
    assert [t.action for t in traj.turns] == ["search", "answer"]


@pytest.mark.parametrize("key", ["group", "sample", "none"])
async def test_every_engine_call_carries_the_routing_key(tokenizer, key) -> None:  # type: ignore[no-untyped-def]
    # What keeps a sample's turns (and by default its group) on one engine's prefix cache.
    engine, rollout, group = make(tokenizer, [TURN1, TURN2], group_size=2, routing_key=key)
    await asyncio.gather(*(rollout.run_sample(s) for s in group))
    want = {
        "group": ["r/3/nq/train/0"] * 4,
        "sample": ["r/3/nq/train/0/0"] * 2 + ["r/3/nq/train/0/1"] * 2,
        "none": [None] * 4,
    }[key]
    assert sorted((c["routing_key"] for c in engine.calls), key=str) == want


async def test_cached_tokens_reach_the_trajectory_and_the_hit_rate(tokenizer) -> None:  # type: ignore[no-untyped-def]
    engine, rollout, [s] = make(tokenizer, [TURN1, TURN2])

    def counted(turn: str, source: str) -> float:
        labels = {"turn": turn, "source": source}
        return REGISTRY.get_sample_value("searchr1_rollout_prefix_tokens_total", labels) or 0.0

    before = {
        (t, src): counted(t, src) for t in ("first", "later") for src in ("cacheable", "cached")
    }
    await rollout.run_sample(s)
    first, second = engine.calls
    turn1_ids = s.turns[0].generated_tokens
    # Turn 2 reads the prompt, turn 1's output and the observation: all but the last are cached.
    assert [t.cached_tokens for t in s.turns] == [0, len(first["input_ids"]) + turn1_ids]
    assert [t.cached_tokens for t in decode(encode(to_trajectory(s))).turns] == [
        0,
        s.turns[1].cached_tokens,
    ]
    grew = {k: counted(*k) - v for k, v in before.items()}
    assert (
        grew[("first", "cacheable")] == len(first["input_ids"]) and grew[("first", "cached")] == 0
    )
    assert grew[("later", "cacheable")] == grew[("later", "cached")] == s.turns[1].cached_tokens
    assert len(second["input_ids"]) > s.turns[1].cached_tokens


async def test_trajectory_carries_the_sampling_temperature(tokenizer) -> None:  # type: ignore[no-untyped-def]
    # The engine's logprobs are of logits / T: the trainer must know T to recompute them.
    engine, rollout, [s] = make(tokenizer, [TURN1, TURN2], temperature=0.7)
    await rollout.run_sample(s)
    assert [c["temperature"] for c in engine.calls] == [0.7, 0.7]
    assert decode(encode(to_trajectory(s))).temperature == pytest.approx(0.7)
    # Greedy (evaluation) sends temperature 0 and records 0: the trainer reads it as 1.
    engine, rollout, [s] = make(tokenizer, [TURN1, TURN2], temperature=0.7)
    rollout.greedy = True
    await rollout.run_sample(s)
    assert [c["temperature"] for c in engine.calls] == [0.0, 0.0]
    assert to_trajectory(s).temperature == 0.0


async def test_weight_version_min_and_max(tokenizer) -> None:  # type: ignore[no-untyped-def]
    engine, rollout, [s] = make(tokenizer, [TURN1, TURN2])
    orig = engine.generate

    async def bump(input_ids, **kw):  # type: ignore[no-untyped-def]
        r = await orig(input_ids, **kw)
        engine.weight_version += 1  # weights change between the two turns
        return r

    engine.generate = bump  # type: ignore[method-assign]
    engine.weight_version = 4
    await rollout.run_sample(s)
    traj = to_trajectory(s)
    assert (traj.weight_version, traj.max_weight_version) == (4, 5)
    assert [t.weight_version for t in traj.turns] == [4, 5]


async def test_samples_do_not_wait_for_each_other(tokenizer) -> None:  # type: ignore[no-untyped-def]
    # One sample searches (slow retriever), the other answers at once: the answering sample
    # finishes long before the searching one.
    slow = FakeRetriever(delay=0.3)
    engine = ScriptedEngine(tokenizer, [TURN1, TURN2])
    fast_engine = ScriptedEngine(tokenizer, [TURN2])
    cfg = RolloutConfig()
    ids = prompt_token_ids(tokenizer, PROMPT.messages)
    a, b = new_group(PROMPT, ids, group_size=2, rollout_step=0, run_id="r")
    ra = Rollout(cfg, engine, SearchTool(slow, SearchConfig()), tokenizer)
    rb = Rollout(cfg, fast_engine, SearchTool(slow, SearchConfig()), tokenizer)
    await asyncio.gather(ra.run_sample(a), rb.run_sample(b))
    assert b.finished_at < a.finished_at - 0.2


async def test_each_turn_asks_for_at_most_what_fits_in_the_context(tokenizer) -> None:  # type: ignore[no-untyped-def]
    # SGLang rejects prompt + max_new_tokens over its context: ask for what still fits.
    n_prompt = len(prompt_token_ids(tokenizer, PROMPT.messages))
    engine, rollout, [s] = make(
        tokenizer, [TURN1, TURN2], context_length=n_prompt + 9, max_tokens_per_turn=50
    )
    await rollout.run_sample(s)
    assert engine.calls[0]["max_new_tokens"] == 9
    assert len(s.response_ids) == 9 and s.status == Status.CONTEXT_LIMIT
    assert to_trajectory(s).finish_reason == FinishReason.FINISH_REASON_CONTEXT_LIMIT


async def test_a_turn_is_stamped_with_the_version_it_started_with(tokenizer) -> None:  # type: ignore[no-untyped-def]
    # A push landed mid-turn (SGLang's weight_versions spans: 3 then 4): the sample holds
    # version-3 tokens, so its staleness counts from 3, not from 4.
    engine, rollout, [s] = make(tokenizer, [TURN1, TURN2])
    engine.weight_version, engine.start_weight_version = 4, 3
    await rollout.run_sample(s)
    assert [t.weight_version for t in s.turns] == [3, 3]
    traj = to_trajectory(s)
    assert traj.weight_version == 3 and traj.max_weight_version == 4


async def test_an_input_sglang_would_refuse_ends_the_sample(tokenizer) -> None:  # type: ignore[no-untyped-def]
    # SGLang 0.5.21 refuses inputs over context - 6 tokens even with room left to generate.
    n_prompt = len(prompt_token_ids(tokenizer, PROMPT.messages))
    engine, rollout, [s] = make(tokenizer, [TURN1], context_length=n_prompt + 5)
    await rollout.run_sample(s)
    assert engine.calls == [] and s.status == Status.CONTEXT_LIMIT


def test_searches_count_search_tags_and_search_calls_alike() -> None:
    # A function-calling turn with two searches and a calculator call, a Search-R1 turn, an
    # answer: 3 searches. (step_summary counted `<search>` turns only: 0 for function calling.)
    from orchestrator.sample import Sample, ToolCallRecord, TurnRecord

    calls = [ToolCallRecord(n, "{}") for n in (SearchTool.name, SearchTool.name, "calculate")]
    prompt = Prompt("nq/test/0", "nq", [{"role": "user", "content": "q"}], ["a"])
    s = Sample(prompt, group_id="g", sample_index=0, group_size=1, prompt_ids=[1])
    s.turns = [TurnRecord(0, "tool", tool_calls=calls), TurnRecord(1, "search"),
               TurnRecord(2, "answer")]  # fmt: skip
    assert [t.searches for t in s.turns] == [2, 1, 0]
    assert step_summary([s], 1.0)["searches_mean"] == 3.0
    # The same rule on the trajectory proto's turns (the rollout log's num_searches).
    from orchestrator.sample import count_searches

    assert [count_searches(t) for t in to_trajectory(s).turns] == [2, 1, 0]
