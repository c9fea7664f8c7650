"""Configuration of the orchestrator service (its section of the stack config file).

Defaults follow slime's Search-R1 recipe (spec section 2): `max_turns=2` generation calls,
512 new tokens per turn, top-3 documents, 256 concurrent searches, 8 samples per prompt.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, ClassVar

from pydantic import Field, model_validator

from searchr1.sections import EnginesConfig, HttpConfig, Section
from searchr1.settings import ServiceSettings

INVALID_ACTION_MESSAGE = (
    "\nMy previous action is invalid. If I want to search, I should put the query between "
    "<search> and </search>. If I want to give the final answer, I should put the answer "
    "between <answer> and </answer>. Let me try again.\n"
)


class TurnSemantics(StrEnum):
    # slime: `max_turns` counts generation calls (2 = one usable search, then an answer).
    SLIME = "slime"
    # original Search-R1: `max_turns` search rounds, then one final generation without search.
    ORIGINAL = "original"


class DataConfig(Section):
    train_path: str | None = Field(default=None, description="Search-R1 parquet or JSONL rows.")
    val_path: str | None = Field(default=None, description="Validation rows (default: none).")
    val_size: int = Field(default=256, ge=1, description="Fixed validation subset size.")
    seed: int = 0
    shuffle: bool = True
    max_prompts: int | None = Field(default=None, ge=1, description="Cap on training rows read.")


class CallLimits(Section):
    """What every tool call and environment turn runs under (orchestrator/tools/runner.py): a
    concurrency cap, a deadline per attempt, bounded retries with backoff, a circuit breaker.

    One section, the same fields wherever it appears: `search.limits`, the `limits` of a
    `rollout.tools` entry, `task.limits`. Each owner has its own defaults (`LIMITS` of the
    owner); a partial `limits:` keeps the owner's defaults for the fields it leaves out."""

    max_concurrency: int = Field(default=64, ge=1, description="Global cap on calls in flight.")
    timeout_s: float = Field(default=10.0, gt=0, description="Deadline of one attempt.")
    max_attempts: int = Field(default=2, ge=1, description="1 + retries.")
    backoff_initial_s: float = Field(default=0.2, ge=0)
    backoff_max_s: float = Field(default=2.0, ge=0)
    breaker_failures: int = Field(
        default=5,
        ge=1,
        description="Calls failed in a row (after their retries) that open the circuit breaker: "
        "new calls then wait for the tool to be back instead of failing.",
    )
    breaker_probe_s: float = Field(
        default=2.0,
        gt=0,
        description="While open: probe the tool's readiness (search: the retriever's /ready) "
        "this often; a tool without a probe waits this long.",
    )
    breaker_max_wait_s: float = Field(
        default=60.0,
        gt=0,
        description="A call waits at most this long for the tool to be back, then fails (an "
        "infrastructure failure, left out of training by default).",
    )


class WithLimits(Section):
    """A section that owns a `limits` section, with its own defaults (`LIMITS`)."""

    LIMITS: ClassVar[dict[str, Any]] = {}
    limits: CallLimits = Field(default_factory=CallLimits, description="See `CallLimits`.")

    @model_validator(mode="before")
    @classmethod
    def _owner_defaults(cls, value: Any) -> Any:
        if not isinstance(value, dict):
            return value
        flat = sorted(set(value) & set(CallLimits.model_fields))
        if flat:  # the fields used to sit here, flat: say where they went
            raise ValueError(
                f"{', '.join(flat)}: set under `limits:` (e.g. limits: {{{flat[0]}: ...}})"
            )
        given = value.get("limits", {})
        if isinstance(given, CallLimits):
            given = given.model_dump(exclude_unset=True)
        if isinstance(given, dict):
            value = {**value, "limits": {**cls.LIMITS, **given}}
        return value


class SearchConfig(WithLimits):
    LIMITS: ClassVar[dict[str, Any]] = {
        "max_concurrency": 256,
        "max_attempts": 4,
        "backoff_max_s": 5.0,
        "breaker_failures": 3,
        "breaker_probe_s": 1.0,
        "breaker_max_wait_s": 600.0,
    }
    retriever_url: str = "http://127.0.0.1:8000"
    topk: int = Field(default=3, ge=1)
    failure_observation: str = Field(
        default="Search failed: {error}. No results are available for this query.",
        description="Shown inside <information> when retries are exhausted; {error} is filled.",
    )


class ActionFormat(StrEnum):
    """How the policy calls tools (docs/orchestrator.md, "Tools")."""

    # `<search> q </search>` / `<answer> a </answer>`, results in `<information>`: Search-R1's.
    SEARCH_R1 = "search_r1"
    # The chat template's function calling: `tools=` passed to the template, calls as
    # `<tool_call>{"name": ..., "arguments": ...}</tool_call>`, results as `tool` turns.
    FUNCTION_CALLING = "function_calling"


class McpServerConfig(Section):
    """An MCP server whose tools are discovered at start-up (one of `command` or `url`)."""

    command: list[str] = Field(
        default_factory=list, description="stdio transport: the server's command line."
    )
    url: str | None = Field(default=None, description="Streamable HTTP transport: its URL.")
    env: dict[str, str] = Field(default_factory=dict, description="Extra env (stdio).")
    include: list[str] | None = Field(
        default=None, description="Expose only these of its tools (default: all)."
    )
    connect_timeout_s: float = Field(
        default=30.0, gt=0, description="Start-up: connect, initialize and list its tools."
    )

    @model_validator(mode="after")
    def _one_transport(self) -> McpServerConfig:
        if bool(self.command) == bool(self.url):
            raise ValueError("mcp: set exactly one of command (stdio) or url (streamable HTTP)")
        return self


class ToolConfig(WithLimits):
    """One entry of `rollout.tools`: a built-in by name, a custom factory, or an MCP server.

    A plain string in the list is a built-in's name. `search` takes its settings from the
    `search` section; every other tool from the fields here, its `limits` included."""

    name: str = Field(min_length=1, description="search | calculator | python, or your name.")
    factory: str | None = Field(
        default=None,
        description="Dotted path `pkg.mod:factory`, called once at start-up with this "
        "ToolConfig; returns a tool (orchestrator.tools.base.Tool) or a list of tools.",
    )
    mcp: McpServerConfig | None = Field(default=None, description="Tools of an MCP server.")
    options: dict[str, Any] = Field(
        default_factory=dict, description="Passed to the built-in or the factory."
    )
    failure_observation: str = Field(
        default="Tool {name} failed: {error}",
        description="What the policy is shown when a call fails; {name} and {error} filled.",
    )

    @model_validator(mode="before")
    @classmethod
    def _from_name(cls, value: Any) -> Any:
        value = {"name": value} if isinstance(value, str) else value
        if isinstance(value, dict) and value.get("name") == "search":
            # They used to be ignored silently: search's settings are orchestrator.search's.
            ignored = sorted(set(value) - {"name", "factory", "mcp"})
            if ignored and not (value.get("factory") or value.get("mcp")):
                raise ValueError(
                    "rollout.tools: the built-in search takes its settings from orchestrator."
                    f"search, not from its tools entry (set there: {', '.join(ignored)})"
                )
        return value

    @model_validator(mode="after")
    def _one_source(self) -> ToolConfig:
        if self.factory and self.mcp:
            raise ValueError(f"tool {self.name!r}: set factory or mcp, not both")
        return self


class TaskConfig(WithLimits):
    """`orchestrator.task`: the environment to train on (orchestrator/tasks/, docs/tasks.md).

    Unset, the orchestrator runs today's Search-R1 loop over `data` and `rollout.tools`. Set, the
    task supplies the rows (train and eval), the first messages, the environment's turns and
    the rubric; the rollout's limits (turns, tokens) still apply. Each environment turn runs
    under `limits` (one attempt: a turn is never retried)."""

    LIMITS: ClassVar[dict[str, Any]] = {
        "max_concurrency": 256,
        "timeout_s": 30.0,
        "max_attempts": 1,
    }

    name: str = Field(
        min_length=1,
        description="A built-in task (`searchr1 task list`) or a dotted path `pkg.mod:MyTask` "
        "(a Task subclass, or a function of the options returning a Task).",
    )
    options: dict[str, Any] = Field(
        default_factory=dict, description="Passed to the task: its data, sizes, seeds."
    )

    @model_validator(mode="after")
    def _one_attempt(self) -> TaskConfig:
        if self.limits.max_attempts != 1:
            raise ValueError(
                "task.limits.max_attempts: an environment turn is never retried (a retry would "
                "replay the action into a stateful episode); leave it at 1"
            )
        return self


class ShapedScores(Section):
    """The v0.3 shaped reward table (spec section 4); configurable, defaults are the paper's.
    `RewardConfig` extends it, so the config section carries the table's fields as they are."""

    correct_valid: float = 1.0
    correct_invalid: float = 0.8
    valid_wrong: float = 0.2
    invalid_wrong: float = 0.1
    invalid_no_answer: float = 0.0
    retrieval_bonus: float = 0.0


class PartitionConfig(Section):
    worker_id: str | None = Field(
        default=None,
        description="This process's name on its claims, stable across its restarts (a restart "
        "takes its own claims back at once); default hostname-pid (stable in a container).",
    )
    claim_ttl_s: float = Field(
        default=30.0,
        gt=0,
        description="A claim not renewed for this long (its process died) is taken by another.",
    )
    poll_s: float = Field(
        default=0.2, gt=0, description="How often a process with nothing to claim looks again."
    )


class RolloutLogConfig(Section):
    run_dir: str | None = Field(
        default=None,
        description="Run directory; the log goes to <run_dir>/rollouts/ (None: no rollout log).",
    )
    groups_per_step: int = Field(default=1, ge=0, description="Whole groups logged per step.")
    log_failures: bool = Field(
        default=True, description="Also log every failed, truncated or invalid-action sample."
    )
    max_failures_per_step: int = Field(
        default=16, ge=0, description="Cap on those extra samples per step."
    )
    max_bytes: int = Field(
        default=1024**3, ge=1, description="Bound on train/ (oldest step files deleted first)."
    )
    evaluations: bool = Field(default=True, description="Log every held-out evaluation sample.")


class RoutingKey(StrEnum):
    """What keeps engine calls together on one engine, for its prefix cache."""

    GROUP = "group"  # a group's samples share their prompt, and each its own earlier turns
    SAMPLE = "sample"  # a sample's turns only: spreads a group over engines
    NONE = "none"  # no key: the router's (or the pool's least-loaded) choice per call


class RolloutConfig(Section):
    turn_semantics: TurnSemantics = TurnSemantics.SLIME
    max_turns: int = Field(default=2, ge=1)
    max_tokens_per_turn: int = Field(default=512, ge=1)
    max_response_tokens: int = Field(
        default=4096, ge=1, description="Whole-response budget (model + observation tokens)."
    )
    observation_max_tokens: int | None = Field(
        default=None, ge=1, description="Truncate each observation (original recipe: 500)."
    )
    temperature: float = Field(default=1.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = -1
    stop: list[str] = Field(default_factory=lambda: ["</search>", "</answer>"])
    invalid_action_message: str = INVALID_ACTION_MESSAGE
    max_abort_retries: int = Field(
        default=20, ge=0, description="Re-issue a turn the engine aborted (weight update)."
    )
    max_concurrent_samples: int = Field(
        default=1024, ge=1, description="Samples in flight at once (each is one async loop)."
    )
    custom_generate: str | None = Field(
        default=None, description="Dotted path `pkg.mod:fn` replacing the multi-turn loop."
    )
    over_sampling: int = Field(
        default=0,
        ge=0,
        description="Extra groups started per step beyond run.groups_per_step: with "
        "group_filter dropping groups, the step still publishes its groups_per_step; the "
        "groups beyond it are not started, or discarded when they finish (counted).",
    )
    group_filter: str | None = Field(
        default=None,
        description="Dynamic sampling: `reward_std` (keep groups whose rewards differ, as DAPO) "
        "or a dotted path `pkg.mod:fn(group) -> bool`. Rejected groups are never trained.",
    )
    tools: list[ToolConfig] = Field(
        default_factory=lambda: [ToolConfig(name="search")],
        description="The tools the policy may call, by name (`[search]`: Search-R1's); see "
        "ToolConfig. Built, and MCP servers asked for their tools, at start-up.",
    )
    action_format: ActionFormat = Field(
        default=ActionFormat.SEARCH_R1,
        description="search_r1: the tags (one tool, `search`); function_calling: the chat "
        "template's `<tool_call>` format (any tools).",
    )
    routing_key: RoutingKey = Field(
        default=RoutingKey.GROUP,
        description="Sent with every engine call (sglang-router's X-SMG-Routing-Key; the "
        "orchestrator's own pool over engines.urls routes by it too) so that a sample's turns, "
        "and by default its group's samples, land on the engine whose prefix cache holds their "
        "context.",
    )

    @model_validator(mode="after")
    def _check_tools(self) -> RolloutConfig:
        names = [t.name for t in self.tools]
        if len(set(names)) != len(names):
            raise ValueError(f"rollout.tools: names must be unique, got {names}")
        if self.action_format == ActionFormat.SEARCH_R1 and names != ["search"]:
            raise ValueError(
                "rollout.tools: the search_r1 action format has one tool, search "
                f"(got {names}); use rollout.action_format: function_calling for others"
            )
        return self


class RewardConfig(ShapedScores):
    function: str = Field(
        default="em",
        description="Built-in (em, sub_em, f1, shaped, weighted) or dotted path `pkg.mod:fn`.",
    )
    group: bool = Field(default=False, description="The function scores a whole group at once.")
    weights: dict[str, float] = Field(
        default_factory=lambda: {"em": 1.0},
        description="For `weighted`: coefficient per component (em, sub_em, f1, format, ...).",
    )


class Mode(StrEnum):
    SYNC = "sync"  # step k is generated with weights k, then waits for the trainer
    ASYNC = "async"  # run ahead of the trainer by at most `max_staleness` versions


class StalePolicy(StrEnum):
    DROP = "drop"
    REGENERATE = "regenerate"


class OrchestratorHttpConfig(HttpConfig):
    # Its own class (not HttpConfig(port=...)): a partial override such as
    # SEARCHR1_ORCHESTRATOR__HTTP__HOST must keep this default port.
    port: int = Field(default=8100, ge=0, le=65535)


# The flat engine fields this section had, and where each went (refused here, naming it).
MOVED_TO_ENGINES = {
    "engine_url": "engines.urls: [<url>] (an engine) or engines.router_url (a router)",
    "engine_urls": "engines.urls",
    "engine_spill_at_in_flight": "engines.spill_at_in_flight",
    "engine_probe_s": "engines.probe_s",
    "engine_probe_timeout_s": "engines.probe_timeout_s",
    "engine_probe_misses": "engines.probe_misses",
}


class OrchestratorConfig(Section):
    http: OrchestratorHttpConfig = Field(default_factory=OrchestratorHttpConfig)
    tokenizer_path: str | None = Field(
        default=None, description="Default: the engine's model_path (from /get_model_info)."
    )
    mode: Mode = Mode.SYNC
    max_staleness: int = Field(default=1, ge=0)
    stale_policy: StalePolicy = StalePolicy.DROP
    eval_every_steps: int | None = Field(
        default=None,
        ge=1,
        description="Greedy validation on the fixed subset of data.val_path every N steps.",
    )
    epochs: int = Field(default=1, ge=1)
    weight_poll_s: float = Field(default=1.0, gt=0)
    weight_wait_s: float = Field(
        default=1800.0,
        gt=0,
        description="How long a step waits for the engine to serve the weights it needs before "
        "the orchestrator stops with an error (exit 1). Above the trainer's step time plus its "
        "push retry deadline (trainer.weight_push.retry_deadline_s, 600 s) and a trainer restart.",
    )
    engine_retry_s: float = Field(
        default=600.0, gt=0, description="How long a sample waits for a down engine."
    )
    data: DataConfig = Field(default_factory=DataConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    search: SearchConfig = Field(default_factory=SearchConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    rollout_log: RolloutLogConfig = Field(default_factory=RolloutLogConfig)
    task: TaskConfig | None = Field(
        default=None,
        description="The task (environment) to train on; unset: Search-R1 over data and "
        "rollout.tools. See docs/tasks.md.",
    )
    partition: PartitionConfig = Field(default_factory=PartitionConfig)  # several processes
    ui: bool = Field(
        default=False, description="Serve the run inspector at /ui (over rollout_log.run_dir)."
    )

    @model_validator(mode="before")
    @classmethod
    def _engines_moved(cls, value: Any) -> Any:
        moved = sorted(set(value) & MOVED_TO_ENGINES.keys()) if isinstance(value, dict) else []
        if moved:  # they sat here, flat, and again under trainer.weight_push: now said once
            raise ValueError(
                "; ".join(f"{k} moved to the stack-level {MOVED_TO_ENGINES[k]}" for k in moved)
                + " (the engines section, read by the orchestrator and the trainer)"
            )
        return value

    @model_validator(mode="after")
    def _check(self) -> OrchestratorConfig:
        if self.ui and not self.rollout_log.run_dir:
            raise ValueError("ui needs rollout_log.run_dir (the run directory it shows)")
        if self.rollout.max_tokens_per_turn > self.rollout.max_response_tokens:
            raise ValueError("rollout.max_tokens_per_turn must be <= rollout.max_response_tokens")
        if self.eval_every_steps is not None and not self.data.val_path and self.task is None:
            raise ValueError("eval_every_steps needs data.val_path (the validation rows) or a task")
        return self


class OrchestratorSettings(ServiceSettings):
    """What `searchr1 orchestrator ...` and `searchr1 eval` load: the shared sections plus
    `orchestrator` (group size, groups per step, run id and step count come from `run`)."""

    orchestrator: OrchestratorConfig = OrchestratorConfig()
    engines: EnginesConfig = Field(
        default_factory=EnginesConfig, description="The engines it generates on (EnginesConfig)."
    )
