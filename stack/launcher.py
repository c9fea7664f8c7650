"""`searchr1 local`: build the service processes from one config file and supervise them.

Every child gets the same config file (`--config`) and the Redis URL in its environment, so the
one config model drives this launcher, docker compose and the Helm chart alike.
"""

from __future__ import annotations

import logging
import secrets
import shutil
import signal
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import httpx
import typer
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console, Group
from rich.live import Live
from rich.progress import (
    BarColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table
from rich.text import Text

from searchr1.redis_server import RedisServer
from searchr1.supervisor import ChildFailed, ServiceSpec, Supervisor
from stack.config import StackConfig
from stack.scale import ControlServer, EngineScaler, control_file

log = logging.getLogger(__name__)
T = TypeVar("T")

# service -> (sub-command, may exit 0 when its job is done, its exit ends the run)
_COMMANDS = {
    "retriever": (["retriever", "serve"], False, False),
    "inference": (["inference", "serve"], False, False),
    "orchestrator": (["orchestrator", "run"], True, False),
    "trainer": (["trainer", "run"], True, True),
}
# service -> the services that must be ready before it starts: the retriever and the engines
# start side by side (neither calls the other), the trainer beside the orchestrator.
_AFTER = {
    "retriever": (),
    "inference": (),
    "orchestrator": ("retriever", "inference"),
    "trainer": ("inference",),
}


def searchr1_command() -> list[str]:
    exe = Path(sys.executable).with_name("searchr1")
    return [str(exe)] if exe.exists() else [shutil.which("searchr1") or "searchr1"]


def scaling_env(cfg: StackConfig, name: str) -> dict[str, str]:
    """What `local.control_port` (scaling engines) sets: every engine pulls from the weight
    store at start (a restart too), the trainer and orchestrator follow the announced engines."""
    if cfg.local.control_port is None:
        return {}
    store = cfg.trainer.weight_push.store_dir
    if not store:
        raise ValueError(
            "local.control_port (scaling engines during the run) needs "
            "trainer.weight_push.store_dir: added engines pull the current weights from it"
        )
    if name == "inference":
        return {"SEARCHR1_INFERENCE__JOIN__STORE_DIR": cfg.inference.join.store_dir or store}
    return {"SEARCHR1_ENGINES__DISCOVER": "true"} if name in ("trainer", "orchestrator") else {}


def engine_spec(cfg: StackConfig, config_path: Path, redis_url: str, index: int) -> ServiceSpec:
    """Engine `inference-<index>` added during the run: on its own port, announcing itself."""
    (spec,) = _specs(cfg, config_path, redis_url, "inference", [index], named=True)
    port = cfg.inference.http.port + index
    spec.optional = True  # one that fails to start is removed; the run goes on
    spec.env["SEARCHR1_INFERENCE__JOIN__ANNOUNCE"] = "true"
    spec.env["SEARCHR1_INFERENCE__JOIN__ADVERTISE_URL"] = f"http://127.0.0.1:{port}"
    return spec


def build_specs(cfg: StackConfig, config_path: Path, redis_url: str) -> list[ServiceSpec]:
    specs: list[ServiceSpec] = []
    kinds: list[str] = []  # each spec's service (an engine replica's name is inference-<i>)
    for name in cfg.local.services:
        if name not in _COMMANDS:
            raise ValueError(
                f"local.services: unknown service {name!r} (choose from {sorted(_COMMANDS)})"
            )
        replicas = cfg.local.inference_replicas if name == "inference" else 1
        new = _specs(cfg, config_path, redis_url, name, range(replicas), named=replicas > 1)
        specs += new
        kinds += [name] * len(new)
    for spec, kind in zip(specs, kinds, strict=True):
        spec.after = tuple(s.name for s, k in zip(specs, kinds, strict=True) if k in _AFTER[kind])
    return specs


def _specs(
    cfg: StackConfig,
    config_path: Path,
    redis_url: str,
    name: str,
    indices: Iterable[int],
    *,
    named: bool,
) -> list[ServiceSpec]:
    sub, may_finish, finishes = _COMMANDS[name]
    http = getattr(cfg, name).http
    host = "127.0.0.1" if http.host in ("0.0.0.0", "::") else http.host
    env = {"SEARCHR1_REDIS__URL": redis_url, "SEARCHR1_CONFIG": str(config_path)}
    env |= scaling_env(cfg, name)
    if name == "orchestrator" and not cfg.orchestrator.partition.worker_id:
        # Stable across the supervisor's restarts (the default hostname-pid is not): a
        # restarted orchestrator takes its own step claims back at once.
        env["SEARCHR1_ORCHESTRATOR__PARTITION__WORKER_ID"] = f"local-{name}"
    specs = []
    for i in indices:
        port, child_env, child = http.port + i, dict(env), name
        if named:  # each engine on its own port, by env over the shared file
            child, child_env["SEARCHR1_INFERENCE__HTTP__PORT"] = f"{name}-{i}", str(port)
        specs.append(
            ServiceSpec(
                name=child,
                command=[*searchr1_command(), *sub, "--config", str(config_path)],
                ready_url=f"http://{host}:{port}/ready",
                env=child_env,
                restart=cfg.local.restart,
                max_restarts=cfg.local.max_restarts,
                ready_timeout_s=cfg.local.ready_timeout_s,
                exit_ends_stack=finishes,
                may_finish=may_finish,
            )
        )
    return specs


@dataclass
class StackStatus:
    """What the progress view shows, scraped from the services' /metrics."""

    values: dict[str, float] = field(default_factory=dict)
    unreadable: set[str] = field(default_factory=set)  # warned about, once
    failing: set[str] = field(default_factory=set)  # its last scrape failed

    def scrape(
        self,
        client: httpx.Client,
        urls: dict[str, str],
        running: Callable[[str], bool] = lambda _: True,
    ) -> None:
        """`running(name)`: whether that service still runs; one that has finished (a clean
        end of the run) is not scraped. A failed scrape warns only when the next one fails
        too: a service shutting down at the end of a run closes its port before it exits."""
        for name, url in urls.items():
            if not running(name):
                continue
            try:
                resp = client.get(url)
                if resp.status_code != 200:
                    continue  # e.g. SGLang without --enable-metrics: its 404 is no metric text
                families = list(text_string_to_metric_families(resp.text))
            except (httpx.HTTPError, ValueError) as e:
                if name in self.failing and name not in self.unreadable and running(name):
                    # The view just lacks that service's numbers: said once.
                    self.unreadable.add(name)
                    log.warning("metrics unreadable", extra={"service": name, "error": str(e)})
                self.failing.add(name)
                continue
            self.failing.discard(name)
            for family in families:
                for sample in family.samples:
                    key = sample.name
                    if sample.labels.get("name"):
                        key += f"[{sample.labels['name']}]"
                    self.values[key] = sample.value


class StepsColumn(ProgressColumn):
    """Steps done, and of how many when that is known: `11/200`, or `11` (not `11/None`)."""

    def render(self, task: Task) -> Text:
        done = f"{task.completed:.0f}"
        return Text(done if task.total is None else f"{done}/{task.total:.0f}")


def _is_running(sup: Supervisor) -> Callable[[str], bool]:
    def running(name: str) -> bool:
        child = next((c for c in sup.children if c.spec.name == name), None)
        return (
            child is not None
            and child.status in ("starting", "ready")
            and (child.proc is not None and child.proc.poll() is None)
        )

    return running


def _render(sup: Supervisor, status: StackStatus, progress: Progress, task: int) -> Group:
    table = Table(title="searchr1 local", expand=False)
    for col in ("service", "status", "pid", "restarts", "log"):
        table.add_column(col)
    for c in sup.children:
        table.add_row(c.spec.name, c.status, str(c.pid or "-"), str(c.restarts), str(c.log_path))
    v = status.values
    step = v.get("searchr1_trainer_step", 0.0)
    progress.update(task, completed=step)
    summary = Table.grid(padding=(0, 2))
    summary.add_row(
        f"step {int(step)}",
        f"reward {v.get('searchr1_rollout_reward_mean', float('nan')):.3f}",
        f"EM {v.get('searchr1_rollout_em_mean', float('nan')):.3f}",
        f"samples/s {v.get('searchr1_rollout_samples_per_second', 0.0):.2f}",
        f"weights v{int(v.get('searchr1_trainer_weight_version', 0))}",
    )
    return Group(table, progress, summary)


@contextmanager
def logs_above(stderr: object) -> Iterator[None]:
    """Inside a `Live` started when `sys.stderr` was `stderr`: log lines go above the live
    view, each on its own line. The log handlers hold that real stderr, so they used to write
    into the view's last line; Live's redirect (a terminal only) prints through its console."""
    proxy = sys.stderr
    handlers = [
        h
        for h in logging.getLogger().handlers
        if isinstance(h, logging.StreamHandler) and h.stream is stderr and proxy is not stderr
    ]
    old = [h.setStream(proxy) for h in handlers]
    try:
        yield
    finally:
        for h, stream in zip(handlers, old, strict=True):
            h.setStream(stream)


@contextmanager
def live_view(console: Console | None = None) -> Iterator[Live]:
    """A `Live` view whose output never shares a line with the log: log lines go above it
    (`logs_above`), and its last line is ended when it stops (on a file or pipe Live leaves
    it open, and the next log line used to continue it)."""
    stderr = sys.stderr
    live = Live(console=console, refresh_per_second=2)
    try:
        with live, logs_above(stderr):
            yield live
    finally:
        if not live.console.is_terminal:
            live.console.line()


def run_local(cfg: StackConfig, config_path: Path, *, max_steps: int | None = None) -> None:
    """Start Redis (embedded unless configured) and the services; supervise until done."""
    redis: RedisServer | None = None
    redis_url = cfg.redis.url
    if not redis_url:
        redis = RedisServer(data_dir=cfg.local.redis_dir).start()
        redis_url = redis.url
        log.info("embedded redis started", extra={"url": redis_url})
    sup = Supervisor(
        build_specs(cfg, config_path, redis_url), cfg.local.log_dir, grace_s=cfg.local.grace_s
    )

    def metrics_urls() -> dict[str, str]:  # engines come and go (`searchr1 local scale`)
        return {
            c.spec.name: c.spec.ready_url.removesuffix("/ready") + "/metrics"
            for c in sup.children
            if c.spec.ready_url
        }

    control: ControlServer | None = None
    progress = Progress(
        TextColumn("training"), BarColumn(), StepsColumn(),
        TimeElapsedColumn(),
    )  # fmt: skip
    task = progress.add_task("train", total=max_steps)
    status = StackStatus()
    try:
        sup.start()
        running = _is_running(sup)
        scaler = None
        if cfg.local.control_port is not None:
            scaler = EngineScaler(
                sup,
                lambda i: engine_spec(cfg, config_path, redis_url, i),
                floor=cfg.local.inference_replicas,
                port=cfg.inference.http.port,
            )
            token = cfg.admin_token.get_secret_value() if cfg.admin_token else None
            control = ControlServer(
                scaler,
                cfg.local.control_port,
                token or secrets.token_urlsafe(24),
                control_file(cfg.local.log_dir),
            ).start()
        with httpx.Client(timeout=1.0) as client, live_view() as live:
            last_scrape = 0.0

            def tick() -> None:
                nonlocal last_scrape
                if scaler is not None:
                    scaler.apply_pending()
                if time.monotonic() - last_scrape > 1.0:
                    status.scrape(client, metrics_urls(), running)
                    last_scrape = time.monotonic()
                live.update(_render(sup, status, progress, task))

            sup.run(on_tick=tick)
    finally:
        if control is not None:
            control.stop()
        sup.stop()
        if redis is not None:
            redis.stop()


def run_supervised(fn: Callable[[], T]) -> T:
    """Run a job that starts service processes. SIGTERM takes Ctrl-C's path, so every `finally`
    stops its children (no orphans): exit 130; a dead child: its report, exit 1."""

    def on_sigterm(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        return fn()
    except ChildFailed as e:
        typer.secho(f"error: {e}", err=True, fg="red")
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        typer.echo("stopped")
        raise typer.Exit(130) from None
