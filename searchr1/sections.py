"""Config sections shared by several services (the run's shared numbers, the placement, the
engines, HTTP listener, logging, Redis, the bus).

Service-specific sections live in each service's own `config.py`.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Section(BaseModel):
    """Base for config sections: unknown keys are errors (a typo must not be ignored)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RunConfig(Section):
    """The numbers the orchestrator and the trainer must agree on, in one place."""

    id: str = Field(default="run", min_length=1, description="Names restart markers and group ids.")
    groups_per_step: int = Field(
        default=32,
        ge=1,
        description="Prompt groups per training step: the orchestrator rolls out this many per "
        "step, the trainer trains on this many.",
    )
    group_size: int = Field(default=8, ge=1, description="Samples per prompt (GRPO group).")
    max_steps: int | None = Field(
        default=None,
        ge=1,
        description="Training steps: the orchestrator rolls out no more, the trainer stops after.",
    )


class Placement(StrEnum):
    DISAGGREGATED = "disaggregated"  # engines and trainer ranks on separate devices
    # On the same devices, alternating (slime's --colocate, verl's hybrid engine): the engines
    # release their memory while the trainer trains and take its weights from its memory.
    COLOCATED = "colocated"


class EnginesConfig(Section):
    """The `engines` section: the inference engines, described once. The orchestrator generates
    on them (through `router_url` when set, else over `urls` itself); the trainer pushes
    weights to each of `urls` (unless trainer.weight_push.engine_urls names other addresses)."""

    urls: list[str] = Field(
        default=["http://127.0.0.1:30000"],
        description="Every engine (each gets the weight pushes). Without router_url the "
        "orchestrator generates on them: one directly; several over its own pool "
        "(engine_client.pool.EnginePool: by rollout.routing_key, least-loaded, failover), "
        "waiting for the oldest weight version among them.",
    )
    router_url: str | None = Field(
        default=None,
        description="sglang-router in front of the engines: the orchestrator generates through "
        "it (`--policy manual --assignment-mode min_load` keeps rollout.routing_key's calls "
        "together); weight pushes still go to each of urls.",
    )
    spill_at_in_flight: int | None = Field(
        default=None,
        ge=1,
        description="The orchestrator's pool (several urls, no router): a call whose engine "
        "already runs this many (its --max-running-requests) goes to the least-loaded engine "
        "instead. None: never.",
    )
    probe_s: float | None = Field(
        default=2.0,
        gt=0,
        description="The orchestrator's pool: every engine's /health is asked this often; one "
        "that misses probe_misses answers in a row (each due within probe_timeout_s) is "
        "frozen: avoided until it answers, its calls in flight retried elsewhere. None: off.",
    )
    probe_timeout_s: float = Field(default=5.0, gt=0)
    probe_misses: int = Field(default=2, ge=1)
    discover: bool = Field(
        default=False,
        description="Engines added during a run (inference.join.announce) count too: the "
        "trainer pushes to, and the orchestrator's pool routes to, urls plus the engines "
        "announced in the run's registry (Redis, <bus.stream>:engines), read again at each "
        'push and every few seconds (docs/deploy.md, "Scaling engines during a run").',
    )

    @model_validator(mode="after")
    def _some_engine(self) -> EnginesConfig:
        if not self.urls and not self.router_url:
            raise ValueError("engines: set urls (every engine) or router_url")
        if len(set(self.urls)) != len(self.urls):
            raise ValueError(f"engines.urls: each engine once, got {self.urls}")
        return self


class HttpConfig(Section):
    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
    graceful_shutdown_s: float = Field(
        default=30.0, gt=0, description="How long in-flight requests may finish after SIGTERM."
    )
    # uvicorn's default (5 s) is shorter than a rollout turn: the server closed idle connections
    # that the client then reused (a failed request and a retry, or an error). Longer than any
    # of our clients keeps an idle connection (aiohttp pools 60 s, httpx 5 s), so the client is
    # always the side that closes it.
    keep_alive_s: float = Field(
        default=75.0,
        gt=0,
        description="How long an idle keep-alive connection stays open (uvicorn's "
        "timeout_keep_alive); keep it above the clients' idle expiry.",
    )
    # Checked before anything parses the body: a JSON body is parsed on the event loop, so an
    # unbounded one stalls every other request, health probes included.
    max_body_bytes: int = Field(
        default=8 * 1024 * 1024,
        ge=1,
        description="Request bodies above this get 413 (Content-Length or counted while read).",
    )
    # Closed by default: without a token the guarded routes (weight updates, cache flush) are
    # open, which is fine on loopback and nowhere else.
    auth: Literal["token", "none"] = Field(
        default="token",
        description="token: listening beyond loopback needs SEARCHR1_ADMIN_TOKEN (the service "
        "refuses to start without it); none: serve without one, guarded routes open.",
    )


class LoggingConfig(Section):
    level: str = Field(default="INFO", pattern="^(DEBUG|INFO|WARNING|ERROR|CRITICAL)$")
    json_format: bool = True


class RedisConfig(Section):
    # None: `searchr1 local` starts an embedded server; services started alone require a URL.
    url: str | None = Field(default=None, description="e.g. redis://:password@host:6379/0")


class BusConfig(Section):
    stream: str = Field(default="searchr1:trajectories", min_length=1)
    group: str = Field(default="trainer", min_length=1)
    consumer: str | None = Field(
        default=None, description="Consumer name; default hostname-pid. Keep it stable to resume."
    )
    max_backlog: int = Field(
        default=4096, ge=1, description="Producer blocks while this many entries are unacked."
    )
    reclaim_idle_s: float = Field(
        default=60.0, gt=0, description="Entries pending this long on a consumer are reclaimed."
    )
    dedup_retention_s: float = Field(
        default=7 * 24 * 3600.0, gt=0, description="How long consumed trajectory ids are kept."
    )
    reconnect_timeout_s: float = Field(
        default=120.0,
        gt=0,
        description="Every Redis call (bus, orchestrator state, the trainer's lease, at "
        "start-up too) retries while Redis is unreachable (down, restarting, frozen), and "
        "raises after this long.",
    )
    socket_timeout_s: float = Field(
        default=5.0,
        gt=0,
        description="Each Redis reply is due within this long (redis-py's own default, set "
        "here explicitly): a frozen or cut-off Redis ends the try, which is retried until "
        "reconnect_timeout_s. A blocking read (the trainer's XREADGROUP BLOCK) waits in slices "
        "of half this, so no wait for new entries looks like an outage.",
    )
    tcp_timeout_s: float = Field(
        default=30.0,
        ge=1,
        description="A Redis connection whose peer stops answering at the TCP level (a silent "
        "network cut) is closed by the kernel after this long: keepalive probes on an idle "
        "connection, TCP_USER_TIMEOUT on unacknowledged data (Linux). Well above a GC pause; "
        "see docs/reliability.md, bounded waits.",
    )
    backpressure_poll_s: float = Field(default=0.05, gt=0)
    max_deliveries: int = Field(
        default=5,
        ge=1,
        description="An entry is handed to consumers at most this many times (restarts of a "
        "crashed consumer included); past that it goes to the dead-letter stream, never trained.",
    )
