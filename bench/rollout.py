"""Rollout scheduling: per-sample async loops vs a per-turn barrier across the batch.

Same engine (the reference torch engine serving a tiny policy, as a process), same retriever
(BM25, as a process), same samples, greedy decoding so both modes do identical work:
(a) every sample runs its own multi-turn loop (this orchestrator);
(b) each turn waits for every active sample of the batch to finish that turn (generation and
    search), as the original Search-R1 loop does.
The tiny policy is first overfitted on episodes with 0-3 searches, so turn counts vary; search
latency varies by a log-normal delay added in front of the real retriever (a remote or loaded
search service). Run from the repository root:

    OMP_NUM_THREADS=1 .venv/bin/python bench/rollout.py [--samples 64] [--latency-median 0.5]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_client.client import InferenceClient
from harness.orchestrator_policy import build_episodes, train_policy
from harness.orchestrator_stack import FACTS, SEARCHR1, Service, write_corpus
from orchestrator.config import RolloutConfig, SearchConfig
from orchestrator.prompt import make_prompt_text, prompt_token_ids
from orchestrator.rollout import Rollout
from orchestrator.sample import Prompt, Sample, new_group
from orchestrator.tools.search import SearchTool
from retriever.client import RetrieverClient

# Fact i's episode searches i times: 1 to 4 generation calls per sample.
SCRIPTS = [["search"] * i + ["answer"] for i in range(len(FACTS))]
TOPK = 2


class DelayedSearch:
    """The real retriever behind a log-normal delay (seeded per query, same in both modes)."""

    def __init__(self, inner: RetrieverClient, median_s: float, sigma: float) -> None:
        self.inner, self.median_s, self.sigma = inner, median_s, sigma
        self.delays: list[float] = []
        self._seen: dict[str, int] = {}

    async def search(self, queries: list[str], topk: int | None = None) -> list[list[Any]]:
        # Seeded by (query, occurrence): both modes draw the same multiset of delays.
        nth = self._seen[queries[0]] = self._seen.get(queries[0], 0) + 1
        rng = random.Random(f"{queries[0]}/{nth}")
        d = rng.lognormvariate(0.0, self.sigma) * self.median_s
        self.delays.append(d)
        await asyncio.sleep(d)
        return await self.inner.search(queries, topk)


def make_samples(tokenizer: Any, prompts: list[Prompt], n: int) -> list[Sample]:
    out = []
    for i in range(n):
        p = prompts[i % len(prompts)]
        [s] = new_group(
            p, prompt_token_ids(tokenizer, p.messages), group_size=1, rollout_step=i, run_id="bench"
        )
        out.append(s)
    return out


async def per_sample(rollout: Rollout, samples: list[Sample]) -> float:
    start = time.perf_counter()
    await asyncio.gather(*(rollout.run_sample(s) for s in samples))
    return time.perf_counter() - start


async def per_turn_barrier(rollout: Rollout, samples: list[Sample]) -> float:
    start = time.perf_counter()
    active = list(samples)
    while active:
        done = await asyncio.gather(*(rollout.step(s) for s in active))
        active = [s for s, d in zip(active, done, strict=True) if not d]
    return time.perf_counter() - start


async def measure(
    args: argparse.Namespace, engine_url: str, retriever_url: str, tok: Any, prompts: list[Prompt]
) -> dict[str, float]:
    cfg = RolloutConfig(turn_semantics="original", max_turns=4, max_tokens_per_turn=64)
    results: dict[str, float] = {}
    turns: dict[str, list[int]] = {}
    for mode, fn in (("per_sample", per_sample), ("barrier", per_turn_barrier)):
        engine = InferenceClient(engine_url)
        search = DelayedSearch(RetrieverClient(retriever_url), args.latency_median, args.sigma)
        tool = SearchTool(search, SearchConfig(topk=TOPK, limits={"timeout_s": 120}))
        rollout = Rollout(cfg, engine, tool, tok, greedy=True)
        samples = make_samples(tok, prompts, args.samples)
        wall = await fn(rollout, samples)
        results[f"{mode}_s"] = wall
        turns[mode] = [len(s.turns) for s in samples]
        results["searches"] = float(len(search.delays))
        results["search_delay_mean_s"] = sum(search.delays) / max(len(search.delays), 1)
        print(
            f"{mode:>11}: {wall:7.2f} s  turns/sample {sum(turns[mode]) / len(samples):.2f}  "
            f"searches {len(search.delays)}"
        )
        await engine.aclose()
        await search.inner.aclose()
    if turns["per_sample"] != turns["barrier"]:
        print("warning: the two modes did different work (turn counts differ)")
    results["speedup"] = results["barrier_s"] / results["per_sample_s"]
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--latency-median", type=float, default=0.5, help="Search delay median (s).")
    ap.add_argument("--sigma", type=float, default=1.0, help="Log-normal sigma of the delay.")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from inference.tiny_model import make_tiny_model

    tmp = Path(tempfile.mkdtemp(prefix="bench-rollout-"))
    base = make_tiny_model(tmp / "tiny")
    corpus = write_corpus(tmp / "corpus.jsonl")
    build = ["retriever", "build", "--corpus", str(corpus), "--out", str(tmp / "index")]
    subprocess.run([*SEARCHR1, *build, "--backend", "bm25"], check=True, capture_output=True)
    retriever = Service(
        ["retriever", "serve", "--index", str(tmp / "index"), "--grpc-port", "-1"],
        tmp / "retriever.log",
    ).start()
    engine = None
    try:
        tok = AutoTokenizer.from_pretrained(base)
        prompts = [
            Prompt(f"toy/test/{i}", "toy", [{"role": "user", "content": make_prompt_text(q)}], [a])
            for i, (q, a, _) in enumerate(FACTS)
        ]
        facts = [(q, a) for q, a, _ in FACTS]
        episodes = asyncio.run(
            build_episodes(tok, retriever.url, prompts, facts, SCRIPTS, topk=TOPK)
        )
        policy = train_policy(base, tmp / "policy", episodes)
        engine = Service(
            ["inference", "serve", "--engine", "torch", "--model", str(policy)], tmp / "engine.log"
        ).start()
        r = asyncio.run(measure(args, engine.url, retriever.url, tok, prompts))
    finally:
        if engine:
            engine.stop()
        retriever.stop()
    print(f"speedup (barrier / per-sample): {r['speedup']:.2f}x")
    print(
        f"samples={args.samples} search_median_s={args.latency_median} sigma={args.sigma} "
        f"searches={int(r['searches'])} search_delay_mean_s={r['search_delay_mean_s']:.3f} "
        f"per_sample_s={r['per_sample_s']:.2f} barrier_s={r['barrier_s']:.2f} "
        f"speedup={r['speedup']:.2f}"
    )


if __name__ == "__main__":
    main()
