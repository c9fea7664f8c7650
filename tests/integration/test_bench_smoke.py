"""Every bench runs from the repository root with its smallest settings and exits (issue 33:
"every bench runs with its defaults from a fresh clone and exits").

Each bench is run as its docstring says (`python -m bench.<name>`, the repository root on the
path: `python bench/<name>.py` would let bench/retriever.py shadow the `retriever` package) in
a subprocess with a deadline; it must exit 0 and end with its `key=value` line. The benches
that are not run here are named with where they are: helpers with no bench of their own, and
the two whose smallest run is minutes long, smoked by their own slow tests.

Slow (`python3 dev.py slow`): `test_bench_smoke` ~4 minutes on 2 cores; the demo benches
(`test_demo_benches_smoke`: one quick demo, then demo_runs over it) are a second test, ~4 more.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.chromium import CHROMIUM

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
TMP = "{tmp}"  # replaced by the test's tmp_path

# bench -> (its smallest settings, deadline in seconds)
SMOKE: dict[str, tuple[list[str], int]] = {
    "bus": (["--n", "200", "--tokens", "64", "--batch", "16"], 60),
    # one service: tests/integration/test_fuzz_services.py fuzzes all five (127 -> 61 s, load 5)
    "fuzz": (["--examples", "1", "--services", "inference"], 180),
    # dev.py gpu's runner: on the CPU, its environment check and one bench through it.
    "gpu_checks": (["--cpu-smoke", "--only", "env,logprobs_memory", "--out", TMP], 180),
    # a Monte Carlo model of the game, no services
    "guess_signal": (["--steps", "5"], 60),
    "handover": (["--hidden", "64", "--layers", "1", "--rounds", "1", "--bucket-mb", "1"], 120),
    "inference": (["--requests", "4", "--new-tokens", "8", "--big-hidden", "64",
                   "--big-layers", "1", "--bucket-mb", "1"], 120),
    "inspect_pages": (["--tokens", "400", "--searches", "1", "--steps", "10",
                       "--repeats", "1"], 120),
    "logprobs": (["--tokens", "256", "--vocab", "4096", "--hidden", "64", "--chunk", "64",
                  "--repeats", "1", "--device", "cpu"], 120),
    "orchestrator_scale": (["--groups-per-step", "4", "--group-size", "2", "--steps", "1",
                            "--engines", "1", "--max-concurrent", "16", "--turn-tokens", "20",
                            "--timeout-s", "120"], 180),
    "prefix_routing": (["--routes", "pool", "--groups", "2", "--group-size", "2",
                        "--turns", "2", "--prompt-tokens", "32", "--observation-tokens", "16",
                        "--max-new-tokens", "8", "--concurrency", "4"], 180),
    "retriever": (["--rows", "300", "--words", "20", "--duration", "0.5", "--concurrency", "1",
                   "--big-requests", "1", "--check-queries", "5", "--cache-dir", TMP], 180),
    "retriever_scale": (["--n", "3000", "--hnsw-n", "1000", "--queries", "20", "--topics", "20",
                         "--nlist", "16", "--pq", "8", "--budget-s", "0.2"], 120),
    "rollout": (["--samples", "4"], 180),
    "trainer": (["--samples", "4", "--budget", "256", "--hidden", "32", "--layers", "1",
                 "--vocab", "256", "--repeats", "1"], 120),
    # both backends, each profiled: 120 s was outrun once on a loaded CI machine
    "trainer_step": (["--shape", "tiny", "--samples", "4", "--budget", "256", "--repeats", "1",
                      "--device", "cpu", "--profile", TMP], 300),
    "weights": (["--layers", "1", "--rounds", "1", "--links", "loopback", "--vocab", "4096"],
                180),
}  # fmt: skip
# Run by test_demo_benches_smoke, one feeding the other.
DEMO = {"demo_seeds", "demo_runs"}
ELSEWHERE = {
    "chaos": "tests/integration/test_chaos.py (slow: --quick --no-baseline, 4 runs, ~11 min)",
    "pipeline": "tests/integration/test_pipeline_bench.py (slow: --shape tiny)",
    "soak": "tests/integration/test_soak.py (slow: --quick --duration-s 40, ~3 min)",
}
HELPERS = {
    "pipeline_model": "bench/pipeline.py's cost model (no main)",
    "retriever_load": "bench/retriever.py's load generator (no main)",
    "searchr1_reference": "Search-R1's own retrieval server, for bench/retriever.py side by side",
    "profile_summary": "bench/trainer_step.py --profile's reduction of a profile (no main)",
}


def key_values(line: str) -> dict[str, str]:
    pairs = line.split()
    assert pairs and all("=" in p and not p.startswith("=") for p in pairs), line
    return dict(p.split("=", 1) for p in pairs)


def run_bench(name: str, args: list[str], deadline_s: int, cwd: Path) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    try:
        out = subprocess.run(
            [sys.executable, "-m", f"bench.{name}", *args],
            cwd=cwd, env=env, capture_output=True, text=True, timeout=deadline_s,
        )  # fmt: skip
    except subprocess.TimeoutExpired as e:
        tail = (e.stdout or b"")[-3000:] if isinstance(e.stdout, bytes) else (e.stdout or "")
        pytest.fail(f"bench/{name}.py did not exit within {deadline_s}s:\n{tail}")
    assert out.returncode == 0, f"bench/{name}.py: exit {out.returncode}\n" + (
        out.stdout[-3000:] + out.stderr[-3000:]
    )
    lines = out.stdout.strip().splitlines()
    assert lines, f"bench/{name}.py printed nothing"
    return key_values(lines[-1])


def test_every_bench_is_smoked_or_said_where() -> None:
    files = {p.stem for p in BENCH.glob("*.py")}
    listed = set(SMOKE) | DEMO | set(ELSEWHERE) | set(HELPERS)
    assert files == listed, f"not listed: {files - listed}; gone: {listed - files}"
    for name in ELSEWHERE:
        assert (ROOT / ELSEWHERE[name].split()[0]).exists()


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", sorted(SMOKE))
def test_bench_smoke(name: str, tmp_path: Path) -> None:
    if name == "inspect_pages" and not Path(CHROMIUM).exists():
        pytest.skip("no chromium (python3 dev.py test installs it: apt-get install chromium)")
    args, deadline_s = SMOKE[name]
    args = [str(tmp_path) if a == TMP else a for a in args]
    values = run_bench(name, args, deadline_s, ROOT)
    assert len(values) >= 2, values


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_demo_benches_smoke(tmp_path: Path) -> None:
    out = tmp_path / "seeds"
    seeds = run_bench(
        "demo_seeds", ["--quick", "--seeds", "1", "--modes", "plain", "--out", str(out)], 840,
        ROOT,
    )  # fmt: skip
    assert set(seeds) == {
        "task",
        "plain_em_min",
        "plain_em_mean",
        "plain_at_goal",
        "plain_gain_min",
        "plain_gain_mean",
        "plain_learned",
    }
    assert seeds["task"] == "search-r1"
    runs = run_bench("demo_runs", [str(out / "plain-seed1")], 60, ROOT)
    assert "plain_seed1_em_after" in runs and float(runs["plain_seed1_em_after"]) >= 0
