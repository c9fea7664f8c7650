"""`searchr1 demo --quick`: the demo's whole path through the real stack, a few steps of each.

World -> MiniLM index -> tiny model + warm start -> held-out eval through the real retriever and
engine -> GRPO through `searchr1 local` (Redis, retriever, engine, orchestrator, trainer, gloo
weight pushes) -> eval of the trained model -> table, plot, key=value line.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.inspector_run import check_inspector_pages
from tests.support.engines import sglang_python
from tests.support.processes import alive


def _megatron() -> bool:
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except ModuleNotFoundError:
        return False


def run_quick_demo(
    out: Path, *args: str
) -> tuple[subprocess.CompletedProcess[str], dict[str, str]]:
    """`searchr1 demo --quick --out OUT ARGS...` (must exit 0): the run and its last line's
    key=value pairs."""
    exe = Path(sys.executable).with_name("searchr1")
    proc = subprocess.run(
        [str(exe), "demo", "--quick", "--out", str(out), *args],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=880,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    return proc, dict(kv.split("=", 1) for kv in last.split())


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    ("engine", "trainer_backend"),
    [
        ("torch", "hf"),
        pytest.param("sglang", "hf", marks=pytest.mark.sglang),
        # ~90 s under load: slow. The trainer on Megatron-Core (one CPU process, the CPU shims).
        pytest.param(
            "torch",
            "megatron",
            marks=[
                pytest.mark.slow,
                pytest.mark.skipif(not _megatron(), reason="megatron-core is not installed"),
            ],
        ),
    ],
)
def test_quick_demo_runs_the_whole_stack(tmp_path: Path, engine: str, trainer_backend: str) -> None:
    """With `sglang`, a real SGLang serves the evaluations and the GRPO steps: the trainer's
    gloo pushes must update it every step. With `megatron`, the trainer trains, pushes and
    exports on the Megatron backend."""
    out = tmp_path / "demo"
    extra = ["--engine", "sglang", "--sglang-python", sglang_python()] if engine == "sglang" else []
    proc, values = run_quick_demo(out, *extra, "--trainer-backend", trainer_backend)
    last = proc.stdout.strip().splitlines()[-1]
    assert values["engine"] == engine
    assert values["trainer_backend"] == trainer_backend
    trainer_log = (out / "logs" / "trainer.log").read_text()
    assert ("megatron.core.distributed" in trainer_log) == (trainer_backend == "megatron")
    if engine == "sglang":  # SGLang's own log: the two pushes moved its version 0 -> 1 -> 2
        served = (out / "logs" / "inference.log").read_text()
        assert "old_version='default' new_version='1'" in served
        assert "old_version='1' new_version='2'" in served
    for key in ("em_before", "em_after", "searches_per_question", "wall_s"):
        assert key in values, last
        float(values[key])

    # The trainer really trained and pushed weights: one metrics line per step.
    steps = [json.loads(line) for line in (out / "train_metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 2
    assert all("loss" in s and "reward/mean" in s for s in steps)
    # Both evaluations ran through the engine; the second one on the trained export.
    before = json.loads((out / "eval_before.json").read_text())
    after = json.loads((out / "eval_after.json").read_text())
    assert before["overall"]["n"] == after["overall"]["n"] == 8
    assert after["overall"]["response_tokens_mean"] > 0
    assert float(values["response_length_after"]) == pytest.approx(
        after["overall"]["response_tokens_mean"], abs=1e-3
    )
    assert after["model_path"].endswith("model-trained")
    assert (out / "demo.png").stat().st_size > 1000
    # The run inspector over this run: the command is printed, every page of it answers.
    assert f"searchr1 inspect {out}" in proc.stdout
    seen = check_inspector_pages(out)
    assert seen["steps"] == 2 and seen["evaluations"] == 2 and seen["trajectories"] > 16

    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out / "model-trained")  # a plain HF directory


def _descendants(pid: int) -> set[int]:
    """Every live process below `pid` (from /proc; the services run in their own sessions)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


@pytest.mark.slow  # over 10 s: CI's slow phase (issue 45)
@pytest.mark.timeout(300)
def test_sigterm_stops_the_demo_and_everything_it_started(tmp_path: Path) -> None:
    import signal
    import time

    exe = Path(sys.executable).with_name("searchr1")
    proc = subprocess.Popen(
        [str(exe), "demo", "--quick", "--out", str(tmp_path / "demo")],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:  # until the first evaluation's services are up
        seen.append(line)
        if "ready service=inference" in line:
            break
    else:
        pytest.fail("the demo ended before starting its services:\n" + "".join(seen[-30:]))
    tree = _descendants(proc.pid)
    assert len(tree) >= 2, tree  # at least the retriever and the engine
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, rest[-3000:]
    assert "stopped" in rest
    deadline = time.monotonic() + 10
    while any(alive(p) for p in tree) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in tree if alive(p)]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_guess_number_demo_runs_end_to_end(tmp_path: Path) -> None:
    """`--task guess-number`: a task whose environment answers every turn, warm-started on its
    scripted demonstrations, trained through `searchr1 local` without a retriever."""
    _, kv = run_quick_demo(tmp_path / "demo", "--task", "guess-number")
    assert {"em_before", "em_after", "reward_after", "turns_per_episode_after"} <= set(kv)
    assert (tmp_path / "demo" / "model-trained" / "config.json").exists()
    assert (tmp_path / "demo" / "eval_after.json").exists()
