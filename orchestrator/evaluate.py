"""`searchr1 eval`: greedy rollouts over a dataset, EM / sub-EM / F1 per data source."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from typing import Any

from orchestrator.config import OrchestratorConfig
from orchestrator.rollout import Rollout
from orchestrator.rollout_log import RolloutLog
from orchestrator.sample import Prompt, Sample, Status, new_group
from orchestrator.scoring import Scorer

METRICS = ("em", "sub_em", "f1")


async def evaluate(
    cfg: OrchestratorConfig,
    rollout: Rollout,
    prompts: list[Prompt],
    *,
    run_id: str,
    concurrency: int = 64,
    rollout_log: RolloutLog | None = None,
    label: str = "evaluation",
    step: int = -1,
) -> dict[str, Any]:
    """One greedy sample per prompt; scores are means per data source plus the overall mean.
    With a rollout log, every sample is logged under `label` (the inspector's compare page)."""
    scorer = Scorer(cfg.reward, scored_by_task=rollout.env is not None)
    sem = asyncio.Semaphore(concurrency)
    start = time.perf_counter()

    async def one(p: Prompt) -> Sample:
        async with sem:
            [s] = new_group(
                p,
                rollout.prompt_ids(p.messages),
                group_size=1,
                rollout_step=-1,
                run_id=f"{run_id}-eval",
            )
            await rollout.run_sample(s)
            await scorer.score_group([s])
            return s

    samples = list(await asyncio.gather(*(one(p) for p in prompts)))
    result = summarize(samples, time.perf_counter() - start)
    if rollout_log is not None:
        await rollout_log.log_eval(samples, result, label=label, step=step)
    return result


def summarize(samples: list[Sample], seconds: float) -> dict[str, Any]:
    by_source: dict[str, list[Sample]] = defaultdict(list)
    for s in samples:
        by_source[s.prompt.data_source].append(s)

    def means(group: list[Sample]) -> dict[str, float]:
        n = len(group)
        out = {m: sum(s.reward_components.get(m, 0.0) for s in group) / n for m in METRICS}
        out["reward"] = sum(s.reward for s in group) / n
        out["turns_mean"] = sum(len(s.turns) for s in group) / n
        out["n"] = n
        out["searches_mean"] = sum(t.searches for s in group for t in s.turns) / n
        out["response_tokens_mean"] = sum(len(s.response_ids) for s in group) / n
        out["errors"] = sum(s.status == Status.ERROR for s in group)
        return out

    per_source = {src: means(g) for src, g in sorted(by_source.items())}
    overall = means(samples) if samples else {}
    # The paper's headline number is the unweighted average over data sets.
    macro = (
        {m: sum(v[m] for v in per_source.values()) / len(per_source) for m in METRICS}
        if per_source
        else {}
    )
    return {"per_source": per_source, "overall": overall, "macro": macro, "seconds": seconds}


def format_table(result: dict[str, Any]) -> str:
    header = f"{'data_source':<20} {'n':>6} {'EM':>7} {'sub-EM':>7} {'F1':>7} {'errors':>7}"
    lines = [header, "-" * len(header)]
    rows = [*result["per_source"].items(), ("ALL (micro)", result["overall"])]
    for name, r in rows:
        if not r:
            continue
        lines.append(
            f"{name:<20} {r['n']:>6} {r['em']:>7.3f} {r['sub_em']:>7.3f} {r['f1']:>7.3f} "
            f"{r['errors']:>7}"
        )
    if result["macro"]:
        m = result["macro"]
        lines.append(
            f"{'AVG (macro)':<20} {'':>6} {m['em']:>7.3f} {m['sub_em']:>7.3f} {m['f1']:>7.3f}"
        )
    return "\n".join(lines)
