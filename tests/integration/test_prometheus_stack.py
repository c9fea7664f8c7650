"""A real Prometheus (Debian's 2.42) scraping a short real stack run (issue 33).

The stack: a BM25 retriever, the torch engine serving a tiny policy that has memorised
Search-R1 episodes (so it searches, reads, answers and sometimes acts invalidly), and the
orchestrator and trainer under `searchr1 local` (embedded Redis, gloo weight pushes every step,
a checkpoint and a held-out evaluation every 2 steps, TIS on as in the slime recipe).
Prometheus scrapes the four services every second and loads the alert rules. Once 3 steps are
trained, at one instant:

- every target is up and `promtool check metrics` finds nothing in any service's /metrics;
- every Grafana dashboard expression has data, except the documented ones (NO_DATA: each
  legitimately empty on a healthy run, with the reason; docs/reliability.md, "Dashboard");
- every alert rule loads healthy, none is pending or firing, and each of its inputs (the
  expression before its threshold) has data: no rule is silent for want of a series.

Slow (`python3 dev.py slow`, ~1-2 minutes on 2 cores); skipped without `prometheus`.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from harness.orchestrator_policy import build_episodes, train_policy
from harness.orchestrator_stack import FACTS, SEARCHR1, Service, write_corpus
from harness.prometheus_server import (
    PROMETHEUS,
    PROMTOOL,
    PrometheusProcess,
    promtool_check_metrics,
)
from searchr1.redis_server import free_port

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "k8s" / "searchr1" / "dashboards" / "searchr1.json"
RULES = ROOT / "k8s" / "searchr1" / "alerts" / "searchr1.rules.yaml"
STEPS = 3  # trained before the dashboard is read
TOPK = 2
SCRIPTS = [["search", "answer"], ["search", "answer"], ["search", "search", "answer"],
           ["invalid", "answer"]]  # fmt: skip

NO_ROUTER = (
    "sglang-router's own metrics: this stack has no router (one torch engine, served directly); "
    "tests/integration/test_prometheus_router.py reads them from a real router (-m sglang)"
)
# Dashboard expressions with no data on this healthy run, and why (docs/reliability.md,
# "Dashboard": also those that depend on settings this run turns on).
NO_DATA: dict[str, str] = {
    "sum by (endpoint) (rate(smg_router_requests_total[5m]))": NO_ROUTER,
    "sum by (status_code) (rate(smg_router_upstream_responses_total[5m]))": NO_ROUTER,
    "histogram_quantile(0.95, sum by (endpoint, le) "
    "(rate(smg_router_request_duration_seconds_bucket[5m])))": NO_ROUTER,
    "sum(smg_worker_health)": NO_ROUTER,
    "max by (worker) (smg_worker_cb_state)": NO_ROUTER,
    "max by (worker) (smg_worker_cb_consecutive_failures)": NO_ROUTER,
}
NO_GATEWAY = (
    "the gateway's own metrics (the Gateway row): the gateway is optional, off by default, and "
    "not in this stack; tests/unit/deploy/test_monitoring.py checks the row's series exist"
)
# Alerts on a service this stack does not run: loaded, healthy and silent; their inputs have no
# series here (tests/unit/deploy/test_alerts.py fires them from synthetic series).
RULES_OF_ABSENT_SERVICES = {
    "SearchR1GatewaySessionsDeadLettered": NO_GATEWAY,
    "SearchR1GatewayRejectionsHigh": NO_GATEWAY,
}
NO_DATA.update(
    {
        t["expr"]: NO_GATEWAY
        for p in json.loads(DASHBOARD.read_text())["panels"]
        for t in p.get("targets", [])
        if "searchr1_gateway_" in t["expr"] or "searchr1_agent_" in t["expr"]
    }
)

# Expressions with data only under a setting this run turns on (off by default), and why:
# with the setting off they draw nothing on a healthy run either (docs/reliability.md).
NEEDS_SETTING: dict[str, str] = {
    'searchr1_trainer_metric{name="tis/clip_fraction"}': "trainer.tis.mode (off: no TIS weights)",
    'searchr1_trainer_metric{name="tis/effective_sample_size"}': (
        "trainer.tis.mode (off: no TIS weights; the ESS alert's input too)"
    ),
    'searchr1_eval_score{metric="em"}': (
        "orchestrator.eval_every_steps with data.val_path (none: no held-out evaluation; "
        "a labelled gauge, so no series before the first evaluation either)"
    ),
    "histogram_quantile(0.95, sum by (le) "
    "(rate(searchr1_trainer_checkpoint_seconds_bucket[15m])))": (
        "trainer.checkpoint.dir (none: nothing observed, NaN; also NaN over a 15-minute window "
        "without a checkpoint)"
    ),
    "histogram_quantile(0.95, sum by (le) "
    "(rate(searchr1_trainer_weight_push_seconds_bucket[15m])))": (
        "trainer.weight_push.mode (none: no pushes, NaN)"
    ),
}

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        PROMETHEUS is None or PROMTOOL is None,
        reason="prometheus/promtool not installed (Debian: apt-get install prometheus; "
        "python3 dev.py slow installs it)",
    ),
]


def dashboard_exprs() -> list[tuple[str, str]]:
    """(panel title, expression) of every dashboard query."""
    dash = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]


def alert_rules() -> list[dict[str, Any]]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def rule_inputs(expr: str) -> list[str]:
    """The operands of a rule's `or`, each without its threshold (`... > 0`)."""
    parts = re.split(r"\n\s*or\s*\n|\s+or\s+", expr.strip())
    return [re.sub(r"\s*(==|!=|>=|<=|>|<)\s*[0-9.e+-]+\s*$", "", p).strip() for p in parts]


@dataclass
class Run:
    prom: PrometheusProcess
    targets: dict[str, str]  # service -> host:port
    at: float  # the instant every query is evaluated at (the stack running, STEPS trained)
    stack_log: Path
    log_dir: Path  # one log per service


def write_stack(tmp: Path, retriever_url: str, policy: Path) -> tuple[Path, dict[str, int]]:
    from orchestrator.prompt import make_row

    rows = tmp / "rows.jsonl"
    rows.write_text(
        "".join(
            json.dumps(make_row(q, [a], data_source="toy", split="train", index=i)) + "\n"
            for i, (q, a, _) in enumerate(FACTS)
        )
    )
    ports = {name: free_port() for name in ("inference", "orchestrator", "trainer")}
    engine = f"http://127.0.0.1:{ports['inference']}"
    cfg = {
        "logging": {"level": "INFO", "json_format": True},
        "run": {"id": "prom", "groups_per_step": 2, "group_size": 2, "max_steps": 40},
        "inference": {"engine": "torch", "model_path": str(policy),
                      "http": {"port": ports["inference"]}},
        "engines": {"urls": [engine]},  # the orchestrator's and the trainer's
        "orchestrator": {
            "weight_poll_s": 0.1,
            "http": {"port": ports["orchestrator"]},
            "search": {"retriever_url": retriever_url, "topk": TOPK},
            "mode": "sync",
            "epochs": 40,
            "eval_every_steps": 2,
            "data": {"train_path": str(rows), "val_path": str(rows), "seed": 0},
            "rollout": {"max_turns": 3, "max_tokens_per_turn": 32, "max_response_tokens": 160,
                        "temperature": 1.0},
            "reward": {"function": "em"},
        },
        "trainer": {
            "http": {"port": ports["trainer"]},
            "model": {"path": str(policy), "dtype": "float32"},
            "optim": {"lr": 1e-5},
            # The recipe's TIS (configs/search-r1-slime-*.yaml): its panels and alert read it.
            "loss": {"old_logprobs": "recompute"},
            "tis": {"mode": "token", "cap": 2.0},
            "checkpoint": {"dir": str(tmp / "checkpoints"), "every_steps": 2},
            "weight_push": {"mode": "distributed", "backend": "gloo", "every_steps": 1,
                            "master_port": free_port()},
        },
        "local": {"services": ["inference", "orchestrator", "trainer"],
                  "log_dir": str(tmp / "logs"), "redis_dir": str(tmp / "redis")},
    }  # fmt: skip
    path = tmp / "stack.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path, ports


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[Run]:
    from transformers import AutoTokenizer

    from orchestrator.prompt import make_prompt_text
    from orchestrator.sample import Prompt

    tmp = tmp_path_factory.mktemp("prom-stack")
    corpus = write_corpus(tmp / "corpus.jsonl")
    subprocess.run(
        [*SEARCHR1, "retriever", "build", "--corpus", str(corpus), "--out", str(tmp / "index"),
         "--backend", "bm25"],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    retriever = Service(
        ["retriever", "serve", "--index", str(tmp / "index"), "--grpc-port", "-1"],
        tmp / "retriever.log",
    ).start()
    stack: subprocess.Popen[bytes] | None = None
    prom: PrometheusProcess | None = None
    try:
        tok = AutoTokenizer.from_pretrained(tiny_model_dir)
        prompts = [
            Prompt(f"toy/train/{i}", "toy", [{"role": "user", "content": make_prompt_text(q)}],
                   [a])
            for i, (q, a, _) in enumerate(FACTS)
        ]  # fmt: skip
        facts = [(q, a) for q, a, _ in FACTS]
        episodes = asyncio.run(build_episodes(tok, retriever.url, prompts, facts, SCRIPTS,
                                              topk=TOPK))  # fmt: skip
        policy = train_policy(Path(tiny_model_dir), tmp / "policy", episodes)
        config, ports = write_stack(tmp, retriever.url, policy)
        targets = {"retriever": f"127.0.0.1:{retriever.port}"}
        targets |= {name: f"127.0.0.1:{port}" for name, port in ports.items()}
        prom = PrometheusProcess({"searchr1": list(targets.values())}, rule_files=[RULES])
        prom.start()
        log = tmp / "stack.log"
        with log.open("wb") as out:
            stack = subprocess.Popen(
                [*SEARCHR1, "local", "--config", str(config)],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
            )  # fmt: skip

        def alive() -> None:
            assert stack is not None
            if stack.poll() is not None:
                raise RuntimeError(f"searchr1 local exited {stack.returncode}:\n"
                                   + log.read_text()[-4000:])  # fmt: skip

        prom.wait_for(f"searchr1_trainer_step >= {STEPS}", bool, timeout_s=400, alive=alive)
        # A held-out evaluation has finished, and every target was scraped after it.
        prom.wait_for("searchr1_eval_score", bool, timeout_s=120, alive=alive)
        time.sleep(3)
        yield Run(prom, targets, time.time(), log, tmp / "logs")
    finally:
        if stack is not None and stack.poll() is None:
            os.killpg(stack.pid, signal.SIGTERM)
            try:
                stack.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(stack.pid, signal.SIGKILL)
                stack.wait(10)
        if prom is not None:
            prom.close()
        retriever.stop()


def test_every_target_is_up_and_its_metrics_pass_promtool(run: Run) -> None:
    active = run.prom.api("/targets")["activeTargets"]
    assert sorted(t["scrapeUrl"].split("/")[2] for t in active) == sorted(run.targets.values())
    assert all(t["health"] == "up" for t in active), [(t["scrapeUrl"], t["lastError"])
                                                        for t in active]  # fmt: skip
    problems = {}
    for name, host in run.targets.items():
        text = httpx.get(f"http://{host}/metrics", timeout=10).text
        if found := promtool_check_metrics(text):
            problems[name] = found
    assert not problems, problems


@pytest.mark.parametrize(("title", "expr"), dashboard_exprs())
def test_dashboard_expression_has_data(run: Run, title: str, expr: str) -> None:
    result = run.prom.query(expr, at=run.at)
    if expr in NO_DATA:
        assert not result, f"{title}: documented as no data ({NO_DATA[expr]}), but has {result}"
        return
    assert result, f"{title}: `{expr}` is empty (Grafana: No data) on a healthy run"
    # NaN everywhere (e.g. a quantile of nothing observed) draws nothing either.
    assert any(math.isfinite(float(r["value"][1])) for r in result), (title, expr, result)


def test_no_data_lists_name_real_expressions() -> None:
    exprs = {e for _, e in dashboard_exprs()}
    for listed in (NO_DATA, NEEDS_SETTING):
        assert set(listed) <= exprs and all(listed.values())
    doc = (ROOT / "docs" / "reliability.md").read_text()
    for expr in [*NO_DATA, *NEEDS_SETTING]:  # each one documented
        assert f"`{expr}`" in doc, expr


@pytest.mark.parametrize("rule", alert_rules(), ids=lambda r: r["alert"])
def test_alert_rule_is_healthy_silent_and_has_its_inputs(run: Run, rule: dict[str, Any]) -> None:
    loaded = {r["name"]: r for g in run.prom.api("/rules")["groups"] for r in g["rules"]}
    got = loaded[rule["alert"]]
    assert got["health"] == "ok", got.get("lastError")
    assert got["state"] == "inactive" and not got["alerts"], got["alerts"]
    assert not run.prom.query(rule["expr"], at=run.at), "fires on a healthy run"
    if rule["alert"] in RULES_OF_ABSENT_SERVICES:  # their inputs exist only with the service
        return
    for part in rule_inputs(rule["expr"]):
        assert run.prom.query(part, at=run.at), f"`{part}` is empty: the rule can never fire"


def test_no_service_warns_of_deprecations(run: Run) -> None:
    """transformers' "`past_key_values` ... will be removed in version 5.40.0" used to be in
    every engine log (issue 33); no service log has a FutureWarning or DeprecationWarning."""
    for log in sorted(run.log_dir.glob("*.log")):
        text = log.read_text(errors="replace")
        for warning in ("FutureWarning", "DeprecationWarning", "past_key_values"):
            assert warning not in text, f"{log.name}: {warning}"
