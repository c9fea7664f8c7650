"""The four HTTP services as real processes, ready to be fuzzed (harness/fuzz_http.py).

    with fuzz_targets(workdir, model_dir, ["retriever", "inference"]) as targets:
        for t in targets:
            fuzz_service(t.name, t.url, examples=20, **t.options)

retriever (BM25 over a synthetic corpus) and inference (the reference engine) run with an admin
token, so their guarded routes are fuzzed both with it and without it; orchestrator and trainer
(their read-only routes and the shared middleware) need Redis, which is started here, and the
orchestrator rolls out against the engine and retriever while it is fuzzed. Every service
listens on loopback.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from harness import synthetic
from harness.inference_server import InferenceServerProcess
from harness.orchestrator_stack import FACTS, Service
from harness.retriever_server import RetrieverProcess
from orchestrator.prompt import make_row
from retriever.build import build_index
from retriever.config import BuildConfig
from searchr1.redis_server import RedisServer

SERVICES = ("retriever", "inference", "orchestrator", "trainer")
TOKEN = "fuzz-admin-token"
# Guarded engine routes fuzzed as an intruder only (no token): with it, a pause or a weight
# update would stall the generation the fuzzer and the orchestrator are waiting for, and a
# group init would reach for machines named by the fuzzer.
ENGINE_ADMIN_UNTRUSTED = (
    "/pause_generation",
    "/begin_weight_update",
    "/end_weight_update",
    "/init_weights_update_group",
    "/update_weights_from_distributed",
    "/release_memory_occupation",  # generation would answer 503 until a resume
    "/resume_memory_occupation",
    "/update_weights_from_tensor",
)


@dataclass
class Target:
    name: str
    url: str
    options: dict[str, Any] = field(default_factory=dict)


def _retriever(stack: ExitStack, workdir: Path) -> Target:
    corpus = synthetic.write_corpus(workdir / "corpus.jsonl", 200, seed=2, words=25)
    build_index(corpus, workdir / "bm25", BuildConfig(backend="bm25", progress=False))
    rp = stack.enter_context(
        RetrieverProcess(workdir / "bm25", grpc=False, env={"SEARCHR1_ADMIN_TOKEN": TOKEN})
    )
    canary = ("POST", "/retrieve", {"queries": ["castle harbor"], "topk": 3})
    return Target("retriever", rp.url, {"token": TOKEN, "canary": canary})


def _inference(stack: ExitStack, model_dir: Path) -> Target:
    server = stack.enter_context(InferenceServerProcess(model_dir, admin_token=TOKEN))
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    options = {
        "token": TOKEN,
        "without_token": ENGINE_ADMIN_UNTRUSTED,
        "canary": ("POST", "/generate", body),
    }
    return Target("inference", server.url, options)


def _service(stack: ExitStack, args: list[str], log: Path) -> Service:
    service = Service(args, log).start()
    stack.callback(service.stop)
    return service


def _orchestrator(
    stack: ExitStack, workdir: Path, redis_url: str, engine: str, retriever: str
) -> Target:
    rows = [
        make_row(q, [a], data_source="toy", split="train", index=i)
        for i, (q, a, _) in enumerate(FACTS)
    ]
    data = workdir / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = {
        "redis": {"url": redis_url},
        "bus": {"stream": "fuzz:orchestrator"},
        "run": {"id": "fuzz", "groups_per_step": 1, "group_size": 2},
        "engines": {"urls": [engine]},
        "orchestrator": {
            "data": {"train_path": str(data)},
            "search": {"retriever_url": retriever},
        },
    }
    path = workdir / "orchestrator.yaml"
    path.write_text(yaml.safe_dump(cfg))
    service = _service(stack, ["orchestrator", "run", "--config", str(path)], workdir / "orch.log")
    return Target("orchestrator", service.url, {"canary": ("GET", "/status", None)})


def _trainer(stack: ExitStack, workdir: Path, redis_url: str, model_dir: Path) -> Target:
    cfg = {
        "redis": {"url": redis_url},
        "bus": {"stream": "fuzz:trainer"},  # nothing is published there: the trainer waits
        "trainer": {"model": {"path": str(model_dir)}, "lease_ttl_s": 2.0},
    }
    path = workdir / "trainer.yaml"
    path.write_text(yaml.safe_dump(cfg))
    service = _service(stack, ["trainer", "run", "--config", str(path)], workdir / "trainer.log")
    return Target("trainer", service.url, {"canary": ("GET", "/status", None)})


@contextmanager
def fuzz_targets(
    workdir: Path, model_dir: Path, services: list[str] | tuple[str, ...] = SERVICES
) -> Iterator[list[Target]]:
    """Start the named services (in dependency order); stop them all on exit."""
    unknown = set(services) - set(SERVICES)
    if unknown:
        raise ValueError(f"unknown services {sorted(unknown)}; choose from {SERVICES}")
    need_retriever = "retriever" in services or "orchestrator" in services
    need_engine = "inference" in services or "orchestrator" in services
    with ExitStack() as stack:
        started: dict[str, Target] = {}
        if need_retriever:
            started["retriever"] = _retriever(stack, workdir)
        if need_engine:
            started["inference"] = _inference(stack, model_dir)
        if "orchestrator" in services or "trainer" in services:
            redis = stack.enter_context(RedisServer(data_dir=workdir / "redis"))
            if "orchestrator" in services:
                started["orchestrator"] = _orchestrator(
                    stack, workdir, redis.url, started["inference"].url, started["retriever"].url
                )
            if "trainer" in services:
                started["trainer"] = _trainer(stack, workdir, redis.url, model_dir)
        yield [started[name] for name in SERVICES if name in services]
