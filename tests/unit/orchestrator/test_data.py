"""Rows, the exact prompt, deterministic sampling, the fixed validation subset, prepare."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator.data import (
    DataError,
    PromptSampler,
    load_prompts,
    prepare_rows,
    validation_subset,
    write_parquet,
)
from orchestrator.prompt import make_prompt_text, make_row, preprocess_question

# The original repo's make_prefix (template "base"), verbatim, for "who wrote hamlet".
ORIGINAL = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first "
    "every time you get new information. After reasoning, if you find you lack some knowledge, "
    "you can call a search engine by <search> query </search> and it will return the top "
    "searched results between <information> and </information>. You can search as many times "
    "as your want. If you find no further external knowledge needed, you can directly provide "
    "the answer inside <answer> and </answer>, without detailed illustrations. For example, "
    "<answer> Beijing </answer>. Question: who wrote hamlet?\n"
)


def test_exact_prompt() -> None:
    assert make_prompt_text("  who wrote hamlet ") == ORIGINAL
    assert preprocess_question("why?") == "why?"
    with pytest.raises(ValueError):
        preprocess_question("   ")


def test_row_shape() -> None:
    row = make_row("q", ["a", "b"], data_source="nq", split="train", index=4)
    assert row["ability"] == "fact-reasoning"
    assert row["reward_model"] == {"style": "rule", "ground_truth": {"target": ["a", "b"]}}
    assert row["extra_info"] == {"split": "train", "index": 4}
    assert row["prompt"][0]["role"] == "user"


def rows(n: int, source: str = "nq") -> list[dict]:
    return [
        make_row(f"q{i}", [f"a{i}"], data_source=source, split="train", index=i) for i in range(n)
    ]


def test_parquet_and_jsonl_round_trip(tmp_path: Path) -> None:
    write_parquet(rows(3), tmp_path / "t.parquet")
    (tmp_path / "t.jsonl").write_text("\n".join(json.dumps(r) for r in rows(3)) + "\n")
    a, b = load_prompts(tmp_path / "t.parquet"), load_prompts(tmp_path / "t.jsonl")
    assert a == b
    assert a[2].prompt_id == "nq/train/2" and a[2].golds == ["a2"]


def test_bad_rows_name_the_problem(tmp_path: Path) -> None:
    (tmp_path / "x.jsonl").write_text('{"prompt": [{"role": "user", "content": "q"}]}\n')
    with pytest.raises(DataError, match="row 0: missing field 'reward_model'"):
        load_prompts(tmp_path / "x.jsonl")
    with pytest.raises(DataError, match="not found"):
        load_prompts(tmp_path / "nope.parquet")


def test_sampler_deterministic_epochs() -> None:
    prompts = [p for p in load_prompts_from(rows(10))]
    s1 = PromptSampler(prompts, 4, seed=7, epochs=2)
    s2 = PromptSampler(prompts, 4, seed=7, epochs=2)
    assert s1.num_steps == 5  # 20 // 4
    assert [p.prompt_id for p in s1.batch(3)] == [p.prompt_id for p in s2.batch(3)]
    ids = [p.prompt_id for b in s1 for p in b]
    # each epoch is a permutation of all prompts
    assert sorted(ids[:10]) == sorted(p.prompt_id for p in prompts) == sorted(ids[10:])
    assert ids[:10] != ids[10:]  # epochs are shuffled differently
    other = [p.prompt_id for p in PromptSampler(prompts, 4, seed=8).batch(0)]
    assert other != ids[:4]
    plain = PromptSampler(prompts, 5, shuffle=False)
    assert [p.prompt_id for p in plain.batch(1)] == [f"nq/train/{i}" for i in range(5, 10)]
    with pytest.raises(IndexError):
        plain.batch(2)


def test_validation_subset_fixed() -> None:
    prompts = load_prompts_from(rows(50))
    a = validation_subset(prompts, 8, seed=1)
    assert a == validation_subset(prompts, 8, seed=1) and len(a) == 8
    assert validation_subset(prompts, 100) == prompts


def load_prompts_from(r: list[dict]):  # type: ignore[no-untyped-def]
    from orchestrator.data import row_to_prompt

    return [row_to_prompt(x, i) for i, x in enumerate(r)]


def test_prepare_flashrag_layout(tmp_path: Path) -> None:
    for ds, split in (("nq", "test"), ("nq", "train"), ("bamboogle", "dev")):
        (tmp_path / ds).mkdir(exist_ok=True)
        (tmp_path / ds / f"{split}.jsonl").write_text(
            json.dumps({"id": "1", "question": f"{ds} {split} q", "golden_answers": ["x"]}) + "\n"
        )
    out, used = prepare_rows(tmp_path, ["nq", "bamboogle"], None)
    assert used == {"nq": "test", "bamboogle": "dev"}  # test, else dev, else train
    assert out[0]["prompt"][0]["content"].endswith("Question: nq test q?\n")
    assert out[1]["extra_info"] == {"split": "dev", "index": 0}
    out, used = prepare_rows(tmp_path, ["nq"], "train")
    assert used == {"nq": "train"}
    with pytest.raises(DataError, match="no test/dev/train file"):
        prepare_rows(tmp_path, ["popqa"], None)
