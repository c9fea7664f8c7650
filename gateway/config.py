"""Configuration of the gateway (`gateway` section) and of the agent runner (`agent` section).

The gateway serves the OpenAI chat API in front of one engine and records each session's
token ids as trajectories on the bus (docs/gateway.md); `searchr1 agent run` runs an agent
program against it.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Literal

from pydantic import Field, model_validator

from searchr1.sections import EnginesConfig, HttpConfig, Section
from searchr1.settings import ServiceSettings


class GatewayHttpConfig(HttpConfig):
    # Its own class (not HttpConfig(port=...)): a partial override such as
    # SEARCHR1_GATEWAY__HTTP__HOST must keep this default port.
    port: int = Field(default=8300, ge=0, le=65535)


class HistoryEdits(StrEnum):
    """What a request whose messages do not extend any turn of its session gets."""

    # A new trajectory segment from the template's rendering of the request (counted).
    FORK = "fork"
    # 409 (counted): the agent must keep its history as the gateway returned it.
    REJECT = "reject"


class GatewayConfig(Section):
    http: GatewayHttpConfig = Field(default_factory=GatewayHttpConfig)
    engine_url: str | None = Field(
        default=None,
        description="The engine, or sglang-router in front of several (`--policy manual`: a "
        "session's calls keep its id as routing key). Left out: the stack's engines section, "
        "as the orchestrator reads it: engines.router_url, else the one of engines.urls, else "
        "(several) our pool over them (engine_client.pool.EnginePool, keyed by session).",
    )
    tokenizer_path: str | None = Field(
        default=None, description="The served model's tokenizer; default: the engine's model."
    )
    served_model_name: str | None = Field(
        default=None,
        description="The model id of /v1/models; default: the engine's model directory name. "
        "Requests may name any model: the gateway serves one policy.",
    )
    temperature: float | None = Field(
        default=1.0,
        ge=0,
        description="Sampling temperature of every call, whatever the request says (the "
        "trainer divides the logits by it); null: the request's (default 1).",
    )
    top_p: float | None = Field(
        default=1.0, gt=0, le=1, description="As temperature: null takes the request's."
    )
    max_tokens: int = Field(
        default=1024, ge=1, description="New tokens per call when the request names no limit."
    )
    history_edits: HistoryEdits = HistoryEdits.FORK
    session_timeout_s: float = Field(
        default=900.0,
        gt=0,
        description="A session not ended with a reward this long after it started is "
        "dead-lettered (never trained on).",
    )
    group_timeout_s: float = Field(
        default=1800.0,
        gt=0,
        description="A group whose sessions have not all ended with rewards this long after "
        "its first session started is dead-lettered whole.",
    )
    max_sessions: int = Field(
        default=4096, ge=1, description="Live sessions; a new one beyond this gets 429."
    )
    max_in_flight: int = Field(
        default=256, ge=1, description="Engine calls in flight; more wait (queue_timeout_s)."
    )
    queue_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="How long a call waits for its session's previous call or a free engine "
        "slot before 429.",
    )
    engine_retry_s: float = Field(
        default=120.0, gt=0, description="One engine call's deadline, its retries included."
    )
    engine_start_timeout_s: float = Field(
        default=600.0, gt=0, description="Start-up: how long to wait for the engine."
    )
    max_abort_retries: int = Field(
        default=3,
        ge=0,
        description="A call the engine aborted (a weight update) is generated again this many "
        "times, then answered 503.",
    )
    publish_timeout_s: float = Field(
        default=600.0,
        gt=0,
        description="How long a done group may wait to be published (the bus's backlog bound "
        "holds it while the trainer is behind); past that it is lost, counted and logged.",
    )
    reap_interval_s: float = Field(
        default=1.0, gt=0, description="How often deadlines of sessions and groups are checked."
    )
    ended_ids_kept: int = Field(
        default=65536, ge=1, description="Ended sessions remembered (a late reward gets 409)."
    )


class AgentConfig(Section):
    """`searchr1 agent run`: an agent program run N times per row against the gateway."""

    gateway_url: str = "http://127.0.0.1:8300"
    program: str | None = Field(
        default=None,
        description="`pkg.module:function` or `/path/file.py:function`: `async def f(base_url, "
        "row)`, returning the reward (a number or a dict with `reward`), or anything the "
        "reward function scores.",
    )
    reward: str | None = Field(
        default=None, description="Dotted path of `f(row, result) -> float | dict` (or async)."
    )
    data_path: str | None = Field(default=None, description="Rows: JSON lines (or a JSON list).")
    task: str | None = Field(
        default=None,
        description="A task (a built-in's name or a dotted path, as orchestrator.task.name): its "
        "rows instead of data_path, and its rubric scores a session whose program returns None.",
    )
    task_options: dict[str, Any] = Field(
        default_factory=dict, description="The task's options (orchestrator.task.options)."
    )
    split: Literal["train", "eval"] = Field(default="train", description="The task's rows.")
    samples_per_row: int | None = Field(
        default=None, ge=1, description="Sessions per row (one GRPO group); default run.group_size."
    )
    concurrency: int = Field(default=16, ge=1, description="Sessions running at once.")
    timeout_s: float = Field(default=600.0, gt=0, description="One session's deadline.")
    limit: int | None = Field(default=None, ge=1, description="Only the first N rows.")


class GatewaySettings(ServiceSettings):
    """What `searchr1 gateway ...` and `searchr1 agent ...` load: the shared sections plus
    `gateway` and `agent`."""

    gateway: GatewayConfig = GatewayConfig()
    agent: AgentConfig = AgentConfig()
    engines: EnginesConfig = Field(
        default_factory=EnginesConfig,
        description="The engines (EnginesConfig): the gateway's unless gateway.engine_url.",
    )

    @model_validator(mode="after")
    def _engine_follows_engines(self) -> GatewaySettings:
        """gateway.engine_url left out: the router, or the one engine, of `engines`; several
        engines without a router stay None (the gateway pools them: `wiring.make_engine`)."""
        if self.gateway.engine_url is None:
            urls = self.engines.urls
            url = self.engines.router_url or (urls[0] if len(urls) == 1 else None)
            if url is not None:
                self.gateway.engine_url = url
        return self
