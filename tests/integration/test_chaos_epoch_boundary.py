"""Found by bench/chaos.py (50 rows, 4 prompts per step, 20 epochs): a step straddling two
epochs drew one prompt twice, its two groups shared one id, the step published 3 groups, and
the trainer waited forever for its 240th batch. Each draw is now a group of its own."""

from __future__ import annotations

from orchestrator.data import PromptSampler
from orchestrator.loop import step_groups
from orchestrator.sample import Prompt


def test_a_prompt_drawn_twice_in_a_step_makes_two_groups() -> None:
    prompts = [Prompt(f"src/train/{i}", "src", [], ["a"]) for i in range(50)]
    sampler = PromptSampler(prompts, 4, seed=0, epochs=20)
    repeats = [s for s in range(sampler.num_steps) if len(set(map(id, sampler.batch(s)))) < 4]
    assert repeats, "this data straddles epochs with a repeated prompt (the bench's case)"
    for step in range(sampler.num_steps):
        groups = step_groups("run", step, sampler.batch(step))
        assert len(groups) == 4
        assert all(gid == f"run/{step}/{p.prompt_id}" for gid, p in groups.items())
