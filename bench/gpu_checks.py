"""Every GPU check, in one call of at most ~10 minutes: what `python3 dev.py gpu` runs.

    python -P bench/gpu_checks.py [--out DIR] [--budget-s 540] [--only NAME,...] [--cpu-smoke]

Runs each check as a process of its own with its own deadline, most important first, skips a
check when what is left of `--budget-s` would not hold it, and writes after every check:
`DIR/gpu-results.json` (per check: the command, exit code, seconds and the `key=value` pairs
of its last line) and `DIR/gpu-log.txt` (every check's output). DIR: `$OUT` where the device
tool sets it, else `runs/gpu`. `--cpu-smoke` runs the same list at tiny shapes on the CPU (the
plumbing, not the numbers). Exit code 1 if any check failed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


# The trainer step as it ran before issue 31 (docs/benchmarks.md, 2026-11-25).
BEFORE_ISSUE_31 = ["--budget", "4096", "--recompute", "full", "--logprob-chunk", "0"]
BEFORE_ISSUE_31 += ["--attention", "per-sequence"]


@dataclass(frozen=True)
class Check:
    name: str
    cmd: list[str]
    timeout_s: int
    what: str


def checks(smoke: bool, out: Path) -> list[Check]:
    py = [sys.executable, "-P"]
    step = [*py, "bench/trainer_step.py"]
    if smoke:
        step += ["--shape", "tiny", "--samples", "16", "--budget", "1024", "--device", "cpu"]
    else:
        step += ["--budget", "8192"]
    dev = ["--device", "cpu"] if smoke else ["--device", "cuda", "--dtype", "bfloat16"]
    parallel = ["-n", "3"] if importlib.util.find_spec("xdist") else []
    small = ["--tokens", "512", "--vocab", "8192", "--hidden", "256", "--chunk", "128"]
    return [
        Check(
            "env",
            [*py, "-c", _ENV],
            60,
            "the GPU, torch, and whether PyTorch's varlen attention kernel is there",
        ),
        Check(
            "trainer_profile",
            [*step, "--repeats", "1", "--profile", str(out)],
            220,
            "one step at slime's batch (MFU), then where its time goes: per pass, operators "
            "by GPU time, the GPU's busy fraction and the host's waits",
        ),
        Check(
            "trainer_step_forward_old",
            [*step, "--repeats", "1", "--old-logprobs", "forward"],
            200,
            "the step with the old logprobs from the training forward (one forward-only pass "
            "less; loss.old_logprobs: forward)",
        ),
        Check(
            "tests_gpu",
            # -n 3 (pytest-xdist, in the GPU image): the Megatron checks are torchrun launches
            # (~30 s each, free ports each); -rP: the passed tests' printed differences.
            [*py, "-m", "pytest", "-q", "-rP", *parallel, "-p", "no:cacheprovider", "tests/gpu"],
            180,
            "parity on CUDA: varlen vs per-sequence, chunked logprobs, Megatron vs HF fp32/bf16",
        ),
        Check(
            "trainer_step",
            [*step, "--repeats", "2"],
            300,
            "one GRPO step of Qwen2.5-3B at slime's batch, both backends, MFU (issue 31)",
        ),
        Check(
            "trainer_step_baseline",
            [*step, "--repeats", "1", *BEFORE_ISSUE_31],
            200,
            "the step as before issue 31 (per-sequence attention, full logits, full recompute, "
            "4,096-token micro-batches), on the same card",
        ),
        Check(
            "engine",
            [*py, "bench/inference.py", "--skip-weights", "--requests", "32", *dev],
            90,
            "the reference engine generating on the GPU",
        ),
        Check(
            "logprobs_memory",
            [*py, "bench/logprobs.py", *(small if smoke else []), "--device", dev[1]],
            90,
            "peak memory of logprobs + entropy: full logits vs chunks",
        ),
        Check(
            "handover",
            [*py, "bench/handover.py", "--rounds", "2", *dev],
            90,
            "colocated hand-over (CUDA IPC) vs push (issue 29)",
        ),
        Check(
            "trainer_step_recompute_full",
            [*step, "--repeats", "1", "--recompute", "full"],
            200,
            "the same step with full recompute: the memory/time trade-off",
        ),
        Check(
            "trainer_step_full_logits",
            [*step, "--repeats", "1", "--backends", "hf", "--logprob-chunk", "0"],
            150,
            "the HF step with full logits: what the chunks save",
        ),
    ]


_ENV = """
import torch, json
from trainer.attention import _flash_varlen
info = {"torch": torch.__version__, "cuda": torch.cuda.is_available(),
        "varlen_attn": _flash_varlen() is not None}
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    gib = round(p.total_memory / 2**30, 1)
    info.update(gpu=p.name, memory_gib=gib, sms=p.multi_processor_count)
print(json.dumps(info))
print(" ".join(f"{k}={str(v).replace(' ', '_')}" for k, v in info.items()))
"""


def _last_kv(output: str) -> dict[str, str]:
    for line in reversed(output.strip().splitlines()):
        pairs = [w.split("=", 1) for w in line.split() if "=" in w]
        if pairs and len(pairs) == len(line.split()):
            return {k: v for k, v in pairs}
    return {}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "runs" / "gpu"))
    ap.add_argument("--budget-s", type=float, default=540.0)
    ap.add_argument("--only", default="", help="comma-separated check names")
    ap.add_argument("--cpu-smoke", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, object]] = {}
    log = (out / "gpu-log.txt").open("w")
    start = time.monotonic()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    wanted = {n for n in args.only.split(",") if n}
    for check in checks(args.cpu_smoke, out):
        if wanted and check.name not in wanted:
            continue
        left = args.budget_s - (time.monotonic() - start)
        if left < check.timeout_s * 0.5:
            results[check.name] = {"skipped": f"{left:.0f} s left of the budget"}
            continue
        timeout = min(check.timeout_s, left)
        print(f"== {check.name} ({check.what}), at most {timeout:.0f} s", flush=True)
        log.write(f"== {check.name}: {' '.join(check.cmd)}\n")
        t0 = time.monotonic()
        try:
            proc = subprocess.run(
                check.cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
            )
            rc, output = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as e:
            rc = 124
            output = (e.stdout or b"").decode() + (e.stderr or b"").decode()  # type: ignore[union-attr]
        seconds = round(time.monotonic() - t0, 1)
        log.write(output + f"\n== {check.name}: rc={rc} in {seconds} s\n")
        log.flush()
        results[check.name] = {
            "what": check.what,
            "cmd": " ".join(check.cmd[1:]),
            "rc": rc,
            "seconds": seconds,
            "kv": _last_kv(output),
            "tail": output[-1500:] if rc else "",
        }
        print(f"   rc={rc} {seconds} s {' '.join(f'{k}={v}' for k, v in _last_kv(output).items())}")
        (out / "gpu-results.json").write_text(json.dumps(results, indent=1))
    (out / "gpu-results.json").write_text(json.dumps(results, indent=1))
    failed = [n for n, r in results.items() if r.get("rc") not in (None, 0)]
    print(f"checks={len(results)} failed={','.join(failed) or 'none'} out={out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
