"""A task written in a file outside the repository trains through `searchr1 local`, named by
its path in the config and nothing else: no retriever, no PYTHONPATH, no code in the repo.

The stack runs for real (Redis, the reference engine, the orchestrator stepping the task's
episodes, the trainer pushing weights over gloo); the trainer's per-step metrics and the
rollout log show the task's samples were trained on, with their per-turn rewards."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from searchr1.redis_server import free_port

SEARCHR1 = [str(Path(sys.executable).with_name("searchr1"))]
TASK = textwrap.dedent(
    '''
    """A game outside the repository: say a word with an "e"; the environment answers."""
    from orchestrator.sample import Prompt
    from orchestrator.tasks import EnvStep, Episode, Task


    class Word(Episode):
        def __init__(self):
            self.turns = 0

        async def step(self, action):
            self.turns += 1
            if "e" in action:
                return EnvStep(reward=1.0, done=True)
            return EnvStep([{"role": "user", "content": "no e, again"}], reward=0.0)


    class WordTask(Task):
        name = "word-e"
        description = "say a word with an e"

        def rows(self, split):
            return [
                Prompt(f"word/{split}/{i}", "word", [{"role": "user", "content": f"word {i}"}],
                       ["e"])
                for i in range(8)
            ]

        def episode(self, prompt):
            return Word()
    '''
)


@pytest.mark.timeout(600)
def test_a_task_in_a_file_outside_the_repository_trains_through_searchr1_local(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    task_file = tmp_path / "elsewhere" / "word_task.py"
    task_file.parent.mkdir()
    task_file.write_text(TASK)
    ports = {name: free_port() for name in ("inference", "orchestrator", "trainer")}
    engine = f"http://127.0.0.1:{ports['inference']}"
    cfg = {
        "run": {"id": "task-local", "groups_per_step": 2, "group_size": 2, "max_steps": 2},
        "inference": {"engine": "torch", "model_path": str(tiny_model_dir),
                      "http": {"port": ports["inference"]}},
        "engines": {"urls": [engine]},  # the orchestrator's and the trainer's
        "orchestrator": {
            "weight_poll_s": 0.1,
            "http": {"port": ports["orchestrator"]},
            "task": {"name": f"{task_file}:WordTask"},
            "rollout": {"max_turns": 2, "max_tokens_per_turn": 8, "max_response_tokens": 64},
            "rollout_log": {"run_dir": str(tmp_path / "run")},
        },
        "trainer": {
            "http": {"port": ports["trainer"]},
            "model": {"path": str(tiny_model_dir), "dtype": "float32"},
            "optim": {"lr": 1e-5},
            "checkpoint": {"dir": str(tmp_path / "checkpoints"), "every_steps": 2},
            "weight_push": {"mode": "distributed", "backend": "gloo", "every_steps": 1,
                            "master_port": free_port()},
            "metrics_jsonl": str(tmp_path / "steps.jsonl"),
        },
        "local": {"services": ["inference", "orchestrator", "trainer"],
                  "log_dir": str(tmp_path / "logs"), "redis_dir": str(tmp_path / "redis")},
    }  # fmt: skip
    config = tmp_path / "stack.yaml"
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [*SEARCHR1, "local", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=540,
        cwd=tmp_path,  # not the repository: the task file is found by its path alone
        env={**env, "OMP_NUM_THREADS": "1"},
    )
    logs = "\n".join(p.read_text()[-2000:] for p in sorted((tmp_path / "logs").glob("*.log")))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + logs
    steps = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps][-1] == 2
    logged = [
        row
        for f in sorted((tmp_path / "run" / "rollouts" / "train").glob("*.parquet"))
        for row in pq.read_table(f).to_pylist()
    ]
    assert logged and all(r["data_source"] == "word" for r in logged)
    turns = [t for r in logged for t in r["turns"]]
    assert turns and all(t["action"] == "env" for t in turns)
    # Per-turn rewards on the wire: a turn with an "e" ended its game with 1.0.
    assert all(t["reward"] in (0.0, 1.0) for t in turns)
    assert all(r["reward"] == sum(t["reward"] for t in r["turns"]) for r in logged)
