"""A synthetic run directory written through the real writers, for the inspector's tests and
bench: rollout logs by `orchestrator.rollout_log.RolloutLog`, `train_metrics.jsonl` by the
trainer's `JsonlLog`, with the keys the trainer and the orchestrator really produce.

Samples are built with the orchestrator's own `Sample` (append_model / append_observation), so
loss masks, logprobs and turns line up exactly as in a rollout.
"""

from __future__ import annotations

import json
import math
import random
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from inspector.server import create_app
from orchestrator.config import RolloutLogConfig
from orchestrator.observation import format_docs, observation_text
from orchestrator.rewards import components
from orchestrator.rollout_log import RolloutLog, mask_runs
from orchestrator.sample import Prompt, Sample, Status, TurnRecord, new_group
from retriever.client import SearchHit
from searchr1.redis_server import free_port
from trainer.metrics import JsonlLog

_TOKEN = re.compile(r"\s+|</?\w+>|\w+|[^\w\s]")


class WordTokenizer:
    """A tokenizer with a vocabulary grown on the fly: words, tags, spaces, punctuation."""

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}
        self.texts: list[str] = []

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = []
        for piece in _TOKEN.findall(text):
            if piece not in self.vocab:
                self.vocab[piece] = len(self.texts)
                self.texts.append(piece)
            ids.append(self.vocab[piece])
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return "".join(self.texts[i] for i in ids)

    def batch_decode(self, sequences: Sequence[Sequence[int]], **kw: Any) -> list[str]:
        return [self.decode(s) for s in sequences]


PEOPLE = ["Ada Brenner", "Tomas Ilves", "Mira Castell", "Jon Okafor", "Lena Varga", "Ivo Sand"]
CITIES = ["Quillon", "Marrowby", "Estenfeld", "Carrow", "Tiber Falls", "Oskhaven"]


def _prompt(i: int, split: str = "train") -> Prompt:
    person = PEOPLE[i % len(PEOPLE)]
    question = f"Where was {person} born?"
    text = (
        "Answer the given question. Reason inside <think> and </think>, search with <search> "
        f"query </search>, answer inside <answer> and </answer>. Question: {question}\n"
    )
    return Prompt(
        prompt_id=f"demo/{split}/{i}",
        data_source="demo" if i % 3 else "demo_hop",
        messages=[{"role": "user", "content": text}],
        golds=[CITIES[i % len(CITIES)]],
    )


def fill_sample(
    s: Sample,
    tok: WordTokenizer,
    rng: random.Random,
    *,
    searches: int,
    answer: str | None,
    filler_words: int = 0,
    invalid: bool = False,
    tool_error: bool = False,
    version: int = 0,
) -> Sample:
    """A rollout: think, `searches` search rounds (each with 3 passages), then an answer."""
    person = s.prompt.messages[0]["content"].rsplit("Where was ", 1)[-1].split(" born")[0]
    lp = lambda n: [round(-rng.random() * 3, 4) for _ in range(n)]  # noqa: E731

    def model(text: str, action: str, query: str = "") -> TurnRecord:
        ids = tok.encode(text)
        s.append_model(ids, lp(len(ids)), text)
        turn = TurnRecord(len(s.turns), action, query=query, generated_tokens=len(ids))
        turn.weight_version, turn.generate_latency_s = version, 0.05
        s.turns.append(turn)
        s.weight_versions.append(version)
        return turn

    filler = " ".join(f"note{rng.randrange(50)}" for _ in range(filler_words))
    for k in range(searches):
        query = f"{person} birthplace {k}" if k else f"{person} born"
        turn = model(
            f"<think> I need to find where {person} was born. {filler} </think>"
            f"<search> {query} </search>",
            "search",
            query,
        )
        docs = [
            SearchHit(
                f"{rng.randrange(10_000)}",
                f'"{person}"\n{person} was born in {rng.choice(CITIES)} and later moved. {filler}',
                None,
            )
            for _ in range(3)
        ]
        turn.doc_ids = [d.id for d in docs]
        turn.tool_attempts, turn.tool_latency_s = 1, round(rng.uniform(0.01, 0.2), 3)
        body = format_docs(docs)
        if tool_error and k == 0:
            turn.error, turn.tool_attempts = "retriever unreachable: connection refused", 4
            body = f"Search failed: {turn.error}. No results are available for this query."
        obs = observation_text(body)
        ids = tok.encode(obs)
        s.append_observation(ids, obs)
        turn.observation_tokens = len(ids)
    if invalid:
        model("<think> I am not sure what to do </think> maybe", "invalid")
        msg = "\nMy previous action is invalid. Let me try again.\n"
        ids = tok.encode(msg)
        s.append_observation(ids, msg)
        s.turns[-1].observation_tokens = len(ids)
    if answer is None:
        model("<think> still looking", "none")
        s.status = Status.TRUNCATED
    else:
        model(f"<think> The passages say it. </think><answer> {answer} </answer>", "answer")
        s.status = Status.ANSWERED
    s.reward_components = components(s.response_text, s.golds)
    s.reward = s.reward_components["em"]
    s.temperature = 1.0
    s.created_at, s.finished_at = 1_700_000_000.0, 1_700_000_001.5
    return s


def make_group(
    tok: WordTokenizer, rng: random.Random, step: int, i: int, group_size: int, run_id: str
) -> list[Sample]:
    p = _prompt(i)
    group = new_group(
        p,
        tok.encode(p.messages[0]["content"]),
        group_size=group_size,
        rollout_step=step,
        run_id=run_id,
    )
    for k, s in enumerate(group):
        right = rng.random() < 0.3 + 0.6 * min(step / 20, 1)
        fill_sample(
            s,
            tok,
            rng,
            searches=rng.choice([0, 1, 1, 2]),
            answer=(p.golds[0] if right else rng.choice(CITIES)) if k != 3 else None,
            invalid=k == 2 and step % 2 == 0,
            tool_error=k == 1 and step == 1,
            version=step,
        )
    return group


def trainer_record(step: int, rng: random.Random) -> dict[str, float]:
    """The keys `trainer/step.py`, `losses.py`, `tis.py` and `loop.py` write each step."""
    p = min(step / 20, 1.0)
    return {
        "reward/mean": 0.3 + 0.5 * p + rng.uniform(-0.05, 0.05),
        "reward/em": 0.3 + 0.5 * p + rng.uniform(-0.05, 0.05),
        "reward/std": 0.4,
        "kl": 0.001 * step + rng.uniform(0, 0.001),
        "entropy": 2.0 - p + rng.uniform(0, 0.1),
        "loss": rng.uniform(-0.1, 0.1),
        "clip_fraction_low": rng.uniform(0, 0.02),
        "clip_fraction_high": rng.uniform(0, 0.03),
        "grad_norm": 0.5 + rng.uniform(0, 0.5),
        "response_length/mean": 120 + 40 * p,
        "response_length/max": 300.0,
        "loss_mask/observation_fraction": 0.45 - 0.1 * p,
        "tis/effective_sample_size": 0.95 - 0.1 * rng.random(),
        "tis/clip_fraction": rng.uniform(0, 0.01),
        "throughput/tokens_per_s": 900 + rng.uniform(-50, 50),
        "time/step_s": 3.0 + rng.random(),
        "weight_version": float(step),
        "samples": 8.0,
        "train_tokens": 1000.0,
    }


def build_run(
    run_dir: Path,
    *,
    steps: int = 6,
    groups: int = 2,
    group_size: int = 4,
    seed: int = 0,
    rollout_steps: int | None = None,
    evaluations: bool = True,
) -> WordTokenizer:
    """Write a run directory: config, trainer metrics, rollout logs of `rollout_steps` steps
    (default: all), and two held-out evaluations of the same questions (before, after)."""
    rng = random.Random(seed)
    tok = WordTokenizer()
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "stack.yaml").write_text(
        f"run:\n  id: demo\n  group_size: {group_size}\n  groups_per_step: {groups}\n"
        "orchestrator:\n  rollout_log:\n    run_dir: " + str(run_dir) + "\n"
    )
    log = RolloutLog(RolloutLogConfig(run_dir=str(run_dir), groups_per_step=1), tok)
    metrics = JsonlLog(run_dir / "train_metrics.jsonl")
    for step in range(steps):
        if step < (steps if rollout_steps is None else rollout_steps):
            samples = [
                s for i in range(groups) for s in make_group(tok, rng, step, i, group_size, "demo")
            ]
            summary = {
                "reward_mean": sum(s.reward for s in samples) / len(samples),
                "searches_mean": sum(t.searches for s in samples for t in s.turns) / len(samples),
                "samples_per_s": 4.0,
            }
            log.write_step(step, samples, summary)
        record = trainer_record(step, rng)
        # The trainer counts from 1: training step k trains on rollout step k - 1 (sync).
        ids = [f"demo/{step}/x/{k}" for k in range(8)]
        metrics.write({"step": step + 1, **record, "trajectory_ids": ids})
    if evaluations:
        for label, p_right in (("model-warm v0", 0.2), ("model-trained v0", 0.7)):
            samples = []
            for i in range(6):
                p = _prompt(i, "test")
                [s] = new_group(
                    p,
                    tok.encode(p.messages[0]["content"]),
                    group_size=1,
                    rollout_step=-1,
                    run_id="demo-eval",
                )
                right = rng.random() < p_right
                fill_sample(
                    s, tok, rng, searches=1, answer=p.golds[0] if right else rng.choice(CITIES)
                )
                samples.append(s)
            em = sum(s.reward_components["em"] for s in samples) / len(samples)
            result = {"overall": {"em": em, "n": len(samples)}, "macro": {"em": em}}
            log.write_eval(samples, result, label)
    return tok


def long_trajectory_run(run_dir: Path, tokens: int = 8000, searches: int = 4) -> str:
    """A run holding one trajectory of about `tokens` response tokens with `searches` searches;
    returns its id."""
    rng = random.Random(1)
    tok = WordTokenizer()
    log = RolloutLog(RolloutLogConfig(run_dir=str(run_dir)), tok)
    p = _prompt(0)
    [s] = new_group(
        p, tok.encode(p.messages[0]["content"]), group_size=1, rollout_step=0, run_id="bench"
    )
    # Per search round: a thought and 3 passages each carry the filler (2 tokens per word),
    # plus about 130 tokens of tags, titles and sentences.
    filler = max(math.ceil((tokens / searches - 130) / 8), 0)
    fill_sample(s, tok, rng, searches=searches, answer=p.golds[0], filler_words=filler)
    log.write_step(0, [s], {})
    return s.trajectory_id


def synthetic_metrics(run_dir: Path, steps: int) -> None:
    """`steps` lines of trainer metrics (the overview benchmark's 1,000-step run)."""
    rng = random.Random(2)
    run_dir.mkdir(parents=True, exist_ok=True)
    with (run_dir / "train_metrics.jsonl").open("w") as f:
        for step in range(steps):
            f.write(json.dumps({"step": step + 1, **trainer_record(step, rng)}) + "\n")


class ServerThread:
    """An ASGI app served by uvicorn on a free loopback port, in a thread (for the browser)."""

    def __init__(self, app: Any) -> None:
        import threading

        import uvicorn

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_config=None)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ServerThread:
        import time

        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the inspector did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def check_inspector_pages(run_dir: Path) -> dict[str, int]:
    """Every inspector page over `run_dir` answers 200, and each logged trajectory's page shows
    one observation span per run of zeros in its loss mask; returns what it counted."""
    import pyarrow.parquet as pq
    from fastapi.testclient import TestClient

    client = TestClient(create_app(run_dir))
    for url in ("/", "/api/curves", "/trajectories", "/compare"):
        assert client.get(url).status_code == 200, url
    counts = {"steps": 0, "trajectories": 0, "evaluations": 0}
    for step_file in sorted((run_dir / "rollouts" / "train").glob("step-*.parquet")):
        step = int(step_file.stem.removeprefix("step-"))
        assert client.get(f"/steps/{step}").status_code == 200, step
        counts["steps"] += 1
    for f in sorted((run_dir / "rollouts").glob("*/*.parquet")):
        counts["evaluations"] += f.parent.name == "eval"
        for row in pq.read_table(f, columns=["trajectory_id", "loss_mask"]).to_pylist():
            page = client.get(f"/t/{f.parent.name}/{f.stem}/{row['trajectory_id']}")
            assert page.status_code == 200, row["trajectory_id"]
            zero_runs = sum(1 for v, _, _ in mask_runs(row["loss_mask"]) if v == 0)
            assert page.text.count('class="span obs" data-a=') == zero_runs
            counts["trajectories"] += 1
    return counts
