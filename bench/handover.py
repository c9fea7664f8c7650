"""Weights handed over in memory vs broadcast over gloo, at the same size, into one engine.

    python bench/handover.py [--hidden 1024] [--layers 2] [--rounds 3] [--bucket-mb 256]
    python bench/handover.py --hidden 256 --layers 2 --rounds 2     # smallest, < 1 minute
    python bench/handover.py --device cuda --dtype bfloat16          # engine and buffer on GPU

One reference engine (`searchr1 inference serve`, a real process) serves a random model of
`--hidden`/`--layers`; this process plays the trainer and updates it with every tensor of that
model, best of `--rounds`, two ways:
  - push: `WeightSender` (the distributed path: a gloo group, one broadcast per tensor);
  - handover: `HandoverSender` (`/update_weights_from_tensor`: the bucket copied into a POSIX
    shared-memory segment, the engine copies out of it).
For each: the transfer time (first bucket sent to last answer, as `PushStats.seconds`) and the
peak memory above the resting RSS of the engine and of the sender (Linux's VmHWM, reset through
/proc/<pid>/clear_refs before each way). Then one colocated cycle: release all memory, resume,
hand over, and the time of each step; on `--device cuda` also the GPU memory the release gave
back (device-wide, `torch.cuda.mem_get_info`). The gloo push runs over the host either way (two
ranks on one GPU cannot form an NCCL group: the reason colocation hands over by CUDA IPC).

The last line is key=value pairs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine_client.client import InferenceClient
from harness.inference_server import InferenceServerProcess
from inference.tiny_model import make_tiny_model
from searchr1.redis_server import free_port
from searchr1.weightsync.handover import HandoverSender
from searchr1.weightsync.sender import WeightSender
from searchr1.weightsync.session import PushStats


def _status_kb(pid: int | str, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/{pid}/status")


class Peak:
    """Peak RSS above the resting RSS of a process, from Linux's high-water mark."""

    def __init__(self, pid: int | str) -> None:
        self.pid = pid

    def reset(self) -> None:
        Path(f"/proc/{self.pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
        self.rest_kb = _status_kb(self.pid, "VmRSS")

    def extra_mb(self) -> float:
        return (_status_kb(self.pid, "VmHWM") - self.rest_kb) / 1024


async def best_of(
    rounds: int, push: Callable[[], Coroutine[Any, Any, PushStats]], peaks: list[Peak]
) -> tuple[PushStats, list[float]]:
    for p in peaks:
        p.reset()
    best: PushStats | None = None
    for _ in range(rounds):
        stats = await push()
        best = stats if best is None or stats.seconds < best.seconds else best
    assert best is not None
    return best, [p.extra_mb() for p in peaks]


def gpu_used_mb(device: str) -> float:
    import torch

    if not device.startswith("cuda"):
        return 0.0
    free, total = torch.cuda.mem_get_info(torch.device(device))
    return (total - free) / 2**20


async def run(
    url: str, engine_pid: int, ckpt: Path, rounds: int, bucket_mb: int, device: str
) -> dict:
    import time

    from safetensors.torch import load_file

    named = list(load_file(str(ckpt)).items())
    client = InferenceClient(url, timeout_s=600)
    peaks = [Peak(engine_pid), Peak("self")]
    sender = WeightSender([client], master_port=free_port(), bucket_bytes=bucket_mb << 20)
    await sender.connect()
    try:
        push, (push_engine_mb, push_sender_mb) = await best_of(
            rounds, lambda: sender.push(named), peaks
        )
        handover_sender = HandoverSender([client], bucket_bytes=bucket_mb << 20, device=device)
        hand, (hand_engine_mb, hand_sender_mb) = await best_of(
            rounds, lambda: handover_sender.push(named), peaks
        )
        assert hand.bytes == push.bytes

        used = gpu_used_mb(device)
        start = time.perf_counter()
        await client.release_memory_occupation()
        released = time.perf_counter()
        gpu_freed = used - gpu_used_mb(device)
        await client.resume_memory_occupation()
        resumed = time.perf_counter()
        cycle = await handover_sender.push(named)
        await client.generate([1, 2, 3], max_new_tokens=1)  # serving again
    finally:
        await sender.close()  # closes the client too
    return {
        "model_mb": push.bytes / 1e6,
        "push_s": push.seconds,
        "handover_s": hand.seconds,
        "speedup": push.seconds / hand.seconds,
        "push_engine_peak_mb": push_engine_mb,
        "handover_engine_peak_mb": hand_engine_mb,
        "push_sender_peak_mb": push_sender_mb,
        "handover_sender_peak_mb": hand_sender_mb,
        "release_s": released - start,
        "resume_s": resumed - released,
        "cycle_handover_s": cycle.seconds,
        "gpu_freed_mb": gpu_freed,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bucket-mb", type=int, default=256)
    ap.add_argument("--device", default="cpu", help="the engine's (and the buffer's) device")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = ap.parse_args()
    env = {
        "SEARCHR1_INFERENCE__TORCH_ENGINE__DEVICE": args.device,
        "SEARCHR1_INFERENCE__TORCH_ENGINE__DTYPE": args.dtype,
    }
    with tempfile.TemporaryDirectory(prefix="bench-handover-") as tmp:
        model = make_tiny_model(Path(tmp) / "m", hidden_size=args.hidden, num_layers=args.layers)
        with InferenceServerProcess(model, env=env) as server:
            assert server.proc is not None
            r = asyncio.run(
                run(server.url, server.proc.pid, model / "model.safetensors", args.rounds,
                    args.bucket_mb, args.device)
            )  # fmt: skip
    print(f"model     : {r['model_mb']:.0f} MB")
    print(
        f"gloo push : {r['push_s']:.3f} s; peak above rest: engine "
        f"{r['push_engine_peak_mb']:.0f} MB, sender {r['push_sender_peak_mb']:.0f} MB"
    )
    print(
        f"hand-over : {r['handover_s']:.3f} s; peak above rest: engine "
        f"{r['handover_engine_peak_mb']:.0f} MB, sender {r['handover_sender_peak_mb']:.0f} MB"
    )
    print(
        f"colocated : release {r['release_s']:.3f} s, resume {r['resume_s']:.3f} s, "
        f"hand-over {r['cycle_handover_s']:.3f} s"
    )
    print(" ".join(f"{k}={v:.3f}" for k, v in r.items()))


if __name__ == "__main__":
    main()
