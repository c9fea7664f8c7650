"""Full vs delta weight pushes over gloo, side by side in one run: bytes and seconds on loopback
and through 10 and 1 Gbit/s links, and the time for a new engine to join.

    python bench/weights.py            # the Qwen2.5-0.5B shape (24 layers), 2 rounds per link
    python bench/weights.py --quick    # 2 layers (same widths, vocabulary, tied embedding), 2
                                       # rounds per link: ~2 minutes on 2 cores

A Qwen2.5-0.5B-shaped model (hidden 896, MLP 4864, 14/2 heads, vocabulary 151936, tied
embedding; random init, built offline) trains here in fp32 with AdamW at slime's learning rate
(1e-6, betas 0.9/0.98, weight decay 0.1) on random tokens. Two reference engines
(`searchr1 inference serve`, bf16, real processes) take the weights after every step: one by
the plain push (`WeightSender`, one broadcast per tensor), the other by delta pushes
(`WeightSender` with a `Baseline`; the engine checks its weights against the trainer's checksum
every `--verify-every` pushes, the trainer's default 10). Each round trains one step, then
pushes both ways, the order alternating. Seconds are the whole `push()` call (casts, encoding,
transfer, decoding, any checksum).

The links: as root, the bench re-runs itself in a network namespace of its own (`unshare
--net`) and shapes its loopback with a token-bucket qdisc (`tc ... tbf rate 1gbit`: the kernel
paces every packet, both ways; this kernel has tbf but no netem). gloo's pair connections go to
addresses the peers publish through the rendezvous store, so a userspace proxy such as
`harness/link_proxy.py` cannot sit in their path. Without root the link rows are modelled
(loopback seconds + bytes / rate) and the line says `link=model`.

Join by pull (`join_s`): after the rounds the trainer publishes its weights to a weight store
(`searchr1.weightsync.store`: a full snapshot, then one more AdamW step as a delta), and a third
engine process starts with `inference.join.store_dir` on it: `join_s` is the engine's own
figure from its app's start to holding the newest version (read, SHA-256 checked, delta
applied, loaded, its weights' checksum compared with the trainer's), `join_wall_s` the whole
process start (model load included), `join_mb` the bytes it read; the running engines are not
involved. Join by push (`join_push_s`, per link): a fresh delta sender (empty baseline)
connects to the plain engine and brings it to the trainer's weights (connect plus a full,
checksummed push). Identical: no delta push was refused or failed its checksum, a last push
checks all the delta engine's weights against the trainer's (an error in any delta would
persist there), both engines answer a greedy request with the same tokens and logprobs, and
the joined engine's weights checksum is the trainer's.

The last line is key=value pairs (`bytes_ratio`, `time_ratio_1gbit`, `identical`, `join_s`, ...).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")  # the engines: one thread each
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from engine_client.client import InferenceClient
from harness.inference_server import InferenceServerProcess
from inference.tiny_model import make_tiny_model, qwen2_config
from searchr1.weightsync.baseline import RESYNCS, Baseline
from searchr1.weightsync.delta import bits
from searchr1.weightsync.sender import WeightSender
from searchr1.weightsync.store import WeightStoreWriter, read_index

NETNS_ENV = "SEARCHR1_BENCH_WEIGHTS_NETNS"
LINKS = {"loopback": None, "10gbit": ("10gbit", "4mb"), "1gbit": ("1gbit", "1mb")}
RATE_BITS = {"10gbit": 10e9, "1gbit": 1e9}
TOKEN = "bench-weights"


# ---- the link -----------------------------------------------------------------------------


def shaping_available() -> bool:
    if os.environ.get(NETNS_ENV) == "1":
        return True
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("tc"):
        return False
    probe = "ip link set lo up && tc qdisc add dev lo root tbf rate 1gbit burst 1mb latency 50ms"
    ok = subprocess.run(["unshare", "--net", "sh", "-c", probe], capture_output=True)
    return ok.returncode == 0


def reexec_in_netns() -> None:
    """This bench again, in a network namespace of its own (its loopback is ours to shape)."""
    env = {**os.environ, NETNS_ENV: "1", "GLOO_SOCKET_IFNAME": "lo"}
    os.execvpe("unshare", ["unshare", "--net", sys.executable, *sys.argv], env)


def set_link(name: str) -> None:
    subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], capture_output=True)
    spec = LINKS[name]
    if spec is not None:
        rate, burst = spec
        subprocess.run(
            ["tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", rate, "burst", burst,
             "latency", "100ms"],
            check=True,
        )  # fmt: skip


# ---- the model and its training -----------------------------------------------------------


class Trainer:
    """A Qwen2.5-0.5B-shaped model in fp32 taking real AdamW steps at lr 1e-6."""

    def __init__(self, layers: int, model_dir: Path, vocab: int = 151936) -> None:
        from transformers import Qwen2ForCausalLM

        make_tiny_model(model_dir)  # the tokenizer files; config and weights replaced below
        config = qwen2_config(
            vocab_size=vocab, hidden_size=896, intermediate_size=4864, num_layers=layers,
            num_heads=14, num_kv_heads=2, max_position_embeddings=32768,
            tie_word_embeddings=True, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
        )  # fmt: skip
        torch.manual_seed(0)
        self.model = Qwen2ForCausalLM(config).float()
        bf16 = {k: v.to(torch.bfloat16) for k, v in self.model.state_dict().items()}
        self.model.save_pretrained(model_dir, state_dict=bf16)
        self.opt = torch.optim.AdamW(
            self.model.parameters(), lr=1e-6, betas=(0.9, 0.98), weight_decay=0.1
        )
        self.vocab = config.vocab_size

    def step(self, tokens: int = 64) -> None:
        ids = torch.randint(0, self.vocab, (1, tokens))
        self.model(input_ids=ids, labels=ids).loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def named(self) -> list[tuple[str, torch.Tensor]]:
        return list(self.model.state_dict().items())

    @property
    def unique_bf16_bytes(self) -> int:
        return sum(p.numel() * 2 for p in self.model.parameters())


def changed_share(trainer: Trainer, held: dict[str, torch.Tensor]) -> float:
    """Share of the bf16 elements that differ from the last delta push (the baseline)."""
    changed = total = 0
    for p_name, p in trainer.named():
        if p_name in held:
            new = bits(p.detach().to(torch.bfloat16))
            changed += int(torch.count_nonzero(new ^ bits(held[p_name])))
            total += new.numel()
    return changed / max(total, 1)


# ---- the run ------------------------------------------------------------------------------


async def timed(sender: WeightSender, named: list[Any], version: int) -> tuple[float, Any]:
    start = time.perf_counter()
    stats = await sender.push(named, version=version)
    return time.perf_counter() - start, stats


async def same_answers(urls: list[str]) -> bool:
    answers = []
    for url in urls:
        async with InferenceClient(url, timeout_s=600, token=TOKEN) as c:
            out = await c.generate([1, 60, 61, 62], max_new_tokens=8, temperature=0)
            answers.append((out.output_ids, out.logprobs))
    return all(a == answers[0] for a in answers)


async def run(
    trainer: Trainer,
    plain_url: str,
    delta_url: str,
    links: list[str],
    rounds: int,
    verify_every: int,
) -> tuple[dict[str, dict[str, list[float]]], dict[str, float], bool]:
    def client(url: str) -> InferenceClient:
        return InferenceClient(url, timeout_s=900, token=TOKEN)

    baseline = Baseline(verify_every=verify_every)
    plain = WeightSender([client(plain_url)], master_port=0)
    delta = WeightSender([client(delta_url)], master_port=0, baseline=baseline)
    await asyncio.gather(plain.connect(), delta.connect())
    resyncs_before = sum(
        RESYNCS.labels(r)._value.get() for r in ("checksum", "stale_base", "refused")
    )
    rows: dict[str, dict[str, list[float]]] = {}
    joins: dict[str, float] = {}
    # Both start from the trainer's weights, then one step more: a trainer pushes every step,
    # so the delta sender's recycled buffers are warm from its second push on.
    for version in (1, 2):
        if version > 1:
            trainer.step()
        await plain.push(trainer.named(), version=version)
        await delta.push(trainer.named(), version=version)
    try:
        for li, link in enumerate(links):
            set_link(link)
            row = rows.setdefault(
                link, {k: [] for k in ("full_s", "delta_s", "full_b", "delta_b", "changed")}
            )
            for r in range(rounds):
                trainer.step()
                version += 1
                assert delta.baseline is not None
                row["changed"].append(changed_share(trainer, delta.baseline.tensors))
                named = trainer.named()
                order = ["full", "delta"] if (li + r) % 2 == 0 else ["delta", "full"]
                for kind in order:
                    sender = plain if kind == "full" else delta
                    seconds, stats = await timed(sender, named, version)
                    if kind == "delta":
                        assert stats.delta, "the delta push went full"
                    row[f"{kind}_s"].append(seconds)
                    row[f"{kind}_b"].append(stats.bytes)
                    print(f"{link:8s} round {r} {kind:5s}: {stats.bytes / 1e6:8.1f} MB "
                          f"{seconds:7.2f} s", flush=True)  # fmt: skip
            # A new engine joins: a fresh delta sender brings the plain engine up to date.
            joiner = WeightSender(
                [client(plain_url)], master_port=0, baseline=Baseline(verify_every=1)
            )
            start = time.perf_counter()
            await joiner.connect()
            stats = await joiner.push(trainer.named(), version=version)
            joins[link] = time.perf_counter() - start
            assert not stats.delta
            await joiner.close()
            plain.disconnect()  # its group was freed by the engine at the join
            await plain.connect()
            print(f"{link:8s} join: {joins[link]:.2f} s", flush=True)
        set_link("loopback")
        # The engine compares all its weights with the trainer's (an update of nothing but
        # the checksum): an error in any earlier delta would still be there.
        baseline.verify_next()
        final = await delta.push(trainer.named(), version=version)
        assert final.delta and final.bytes < 4096  # nothing changed: names of aliases only
        resyncs = sum(RESYNCS.labels(r)._value.get() for r in ("checksum", "stale_base", "refused"))
        identical = resyncs == resyncs_before and await same_answers([plain_url, delta_url])
    finally:
        await asyncio.gather(plain.close(), delta.close())
    return rows, joins, identical


def engine_metric(url: str, name: str) -> float:
    import httpx

    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise LookupError(name)


def pull_join(trainer: Trainer, tmp: Path, version: int, env: dict[str, str]) -> dict[str, Any]:
    """A new engine joins by pulling from the weight store (version: the trainer's newest)."""
    import httpx

    store = tmp / "store"
    writer = WeightStoreWriter(store, run="run")  # the engines' run.id (the default)
    full = writer.publish(version, trainer.named(), dtype=torch.bfloat16)
    trainer.step()
    delta = writer.publish(version + 1, trainer.named(), dtype=torch.bfloat16)
    assert (full.kind, delta.kind) == ("full", "delta"), (full, delta)
    join_env = {**env, "SEARCHR1_INFERENCE__JOIN__STORE_DIR": str(store)}
    start = time.perf_counter()
    with InferenceServerProcess(
        tmp / "model", admin_token=TOKEN, env=join_env, ready_timeout_s=600
    ) as joined:
        wall = time.perf_counter() - start
        auth = {"Authorization": f"Bearer {TOKEN}"}
        got = httpx.get(f"{joined.url}/weights_checksum", headers=auth, timeout=600).json()
        latest = read_index(store).latest
        assert latest is not None
        out = {
            "join_s": engine_metric(joined.url, "searchr1_inference_join_seconds"),
            "join_wall_s": wall,
            "join_mb": engine_metric(joined.url, "searchr1_inference_join_bytes") / 1e6,
            "join_identical": int(
                got["checksum"] == latest.checksum and got["weight_version"] == str(version + 1)
            ),
            "store_full_mb": full.bytes / 1e6,
            "store_delta_mb": delta.bytes / 1e6,
            "store_publish_s": delta.seconds,
        }
    print(f"pull join: {out['join_s']:.2f} s in the engine ({wall:.1f} s with its start), "
          f"{out['join_mb']:.1f} MB read; store full {full.bytes / 1e6:.1f} MB, delta "
          f"{delta.bytes / 1e6:.2f} MB written in {delta.seconds:.2f} s", flush=True)  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=2, help="training steps (push pairs) per link")
    ap.add_argument("--links", default="loopback,10gbit,1gbit")
    ap.add_argument("--vocab", type=int, default=151936, help="smaller: a smoke run only")
    ap.add_argument("--quick", action="store_true", help="--layers 2 --rounds 2")
    ap.add_argument(
        "--verify-every",
        type=int,
        default=10,
        help="the delta pushes' checksum interval (trainer.weight_push.delta_verify_every; "
        "1: every push checked, and timed with it)",
    )
    args = ap.parse_args()
    if args.quick:
        args.layers, args.rounds = 2, 2
    links = [x for x in args.links.split(",") if x]
    shaped = any(LINKS[x] for x in links) and shaping_available()
    if shaped and os.environ.get(NETNS_ENV) != "1":
        reexec_in_netns()
    if os.environ.get(NETNS_ENV) == "1":
        subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    measured = links if shaped else ["loopback"]
    torch.set_num_threads(os.cpu_count() or 1)  # the trainer's steps and casts
    env = {"SEARCHR1_INFERENCE__TORCH_ENGINE__DTYPE": "bfloat16"}
    with tempfile.TemporaryDirectory(prefix="bench-weights-") as tmp:
        trainer = Trainer(args.layers, Path(tmp) / "model", args.vocab)
        with (
            InferenceServerProcess(trainer_dir := Path(tmp) / "model", admin_token=TOKEN,
                                   env=env, ready_timeout_s=600) as plain_engine,
            InferenceServerProcess(trainer_dir, admin_token=TOKEN, env=env,
                                   ready_timeout_s=600) as delta_engine,
        ):  # fmt: skip
            rows, joins, identical = asyncio.run(
                run(
                    trainer,
                    plain_engine.url,
                    delta_engine.url,
                    measured,
                    args.rounds,
                    args.verify_every,
                )
            )
            version = 2 + len(measured) * args.rounds
            pulled = pull_join(trainer, Path(tmp), version + 1, env)
    out: dict[str, Any] = {}
    loop = rows["loopback"]
    full_b, delta_b = statistics.mean(loop["full_b"]), statistics.mean(loop["delta_b"])
    out["bytes_ratio"] = full_b / delta_b
    out["bytes_ratio_unique"] = trainer.unique_bf16_bytes / delta_b  # the tied embedding once
    for link in links:
        if link in rows:
            r = rows[link]
            full_s, delta_s = statistics.mean(r["full_s"]), statistics.mean(r["delta_s"])
        else:  # modelled: the loopback push plus the bytes at the link's rate
            rate = RATE_BITS[link] / 8
            full_s = statistics.mean(loop["full_s"]) + full_b / rate
            delta_s = statistics.mean(loop["delta_s"]) + delta_b / rate
        out[f"time_ratio_{link}"] = full_s / delta_s
        out[f"full_s_{link}"], out[f"delta_s_{link}"] = full_s, delta_s
    out["identical"] = int(identical and pulled["join_identical"])
    out |= pulled
    out["join_push_s"] = joins["loopback"] if "loopback" in joins else next(iter(joins.values()))
    for link, seconds in joins.items():
        if link != "loopback":
            out[f"join_push_s_{link}"] = seconds
    out["full_mb"], out["delta_mb"] = full_b / 1e6, delta_b / 1e6
    out["changed_pct"] = 100 * statistics.mean(x for r in rows.values() for x in r["changed"])
    out["layers"] = args.layers
    out["verify_every"] = args.verify_every
    out["params_m"] = trainer.unique_bf16_bytes / 2e6
    print(f"model: {out['params_m']:.0f}M params, {args.layers} layers; bf16 elements changed "
          f"per step: {out['changed_pct']:.2f}%")  # fmt: skip
    for link in links:
        full_s, delta_s, ratio = (out[f"{k}_{link}"] for k in ("full_s", "delta_s", "time_ratio"))
        note = "" if link in rows else " (modelled)"
        print(f"{link:8s}: full {full_s:.2f} s, delta {delta_s:.2f} s, x{ratio:.2f}{note}")
    line = " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in out.items())
    print(line + ("" if shaped else " link=model"))


if __name__ == "__main__":
    main()
