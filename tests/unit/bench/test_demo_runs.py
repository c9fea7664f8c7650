"""bench/demo_runs.py's hit-rate accounting over a rollout log, against hand-counted tokens."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bench.demo_runs import hit_rates


def turn(generated: int, observation: int, cached: int) -> dict[str, int]:
    return {
        "generated_tokens": generated,
        "observation_tokens": observation,
        "cached_tokens": cached,
    }


def test_hit_rates_count_what_the_previous_call_read_and_wrote(tmp_path: Path) -> None:
    rows = [
        # Prompt 10; turn 2 can reuse the prompt and turn 1's 5 tokens (not the 3 observed).
        {"prompt_token_ids": [1] * 10, "turns": [turn(5, 3, 0), turn(4, 0, 15)]},
        {"prompt_token_ids": [1] * 10, "turns": [turn(5, 3, 9), turn(4, 0, 7)]},
    ]
    folder = tmp_path / "rollouts" / "train"
    folder.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows), folder / "step-000000.parquet")
    rates = hit_rates(tmp_path)
    assert rates["hit_first"] == pytest.approx(9 / 20)
    assert rates["hit_later"] == pytest.approx((15 + 7) / 30)
