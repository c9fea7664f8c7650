"""Configuration of the inference service (its section of the stack config file)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from searchr1.sections import HttpConfig, Section
from searchr1.settings import ServiceSettings


class TorchEngineConfig(Section):
    """The reference engine (`--engine torch`): a Hugging Face causal LM served with batching."""

    device: str = Field(default="cpu", description="cpu, cuda or cuda:N")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        default="float32", description="Weights and activations; logprobs are always fp32."
    )
    max_running_requests: int = Field(
        default=128, ge=1, description="Requests decoded together in one batch at most."
    )
    max_queued_requests: int = Field(
        default=4096, ge=1, description="Waiting requests beyond this get 429 (back-pressure)."
    )
    max_prefill_per_step: int = Field(
        default=16, ge=1, description="New requests admitted (prefilled) between decode steps."
    )
    context_length: int | None = Field(
        default=None, ge=2, description="Prompt + output tokens; default: the model's maximum."
    )
    weight_group_timeout_s: float = Field(
        default=600.0, gt=0, description="Timeout of collectives on the weight-update group."
    )
    prefix_cache_tokens: int = Field(
        default=65536,
        ge=0,
        description="Prefix cache budget in tokens (0 = off): a radix tree of K/V over token "
        "ids, LRU-evicted, flushed on every weight update; a prompt's cached prefix is not "
        "prefilled again (multi-turn samples, GRPO groups sharing a prompt). The default is "
        "the token budget our CPU recipe gives SGLang (--max-total-tokens 65536); K/V per "
        "token is 2 x layers x kv_heads x head_dim x dtype bytes (25 KB for Qwen2.5-0.5B fp32).",
    )
    pause_lease_s: float = Field(
        default=60.0,
        gt=0,
        description="A pause (pause_generation) lasts this long after the last weight-update "
        "call, then the engine resumes by itself and drops a half-received push: a trainer "
        "that died mid-push must not leave it paused for good.",
    )
    weights_cpu_backup: bool = Field(
        default=False,
        description="Keep a CPU copy of the weights on release_memory_occupation and restore "
        "it on resume (SGLang's --enable-weights-cpu-backup). Off (SGLang's default): resumed "
        "weights have no content and generation answers 503 until a weight update lands.",
    )


class SglangConfig(Section):
    """`--engine sglang`: how our config maps onto `python -m sglang.launch_server`."""

    python: str = Field(default="python", description="Interpreter of SGLang's own venv/image.")
    tp_size: int = Field(default=1, ge=1, description="--tp-size")
    mem_fraction_static: float | None = Field(default=None, gt=0, le=1)
    context_length: int | None = Field(default=None, ge=1)
    device: str | None = Field(default=None, description="--device (cpu needs the workarounds)")
    attention_backend: str | None = None
    max_total_tokens: int | None = Field(default=None, ge=1)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto",
        description="--dtype. SGLang's auto serves a float32 checkpoint as float16: set float32 "
        "for logprobs that match a float32 trainer.",
    )
    extra_args: list[str] = Field(default_factory=list, description="Passed through verbatim.")
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Extra environment of the SGLang processes (e.g. SGLANG_USE_CPU_ENGINE=1).",
    )
    router_python: str | None = Field(
        default=None, description="Interpreter with sglang-router; default: `python`."
    )
    router_policy: Literal["manual", "cache_aware", "round_robin", "random", "power_of_two"] = (
        Field(
            default="manual",
            description="sglang-router's --policy. manual: calls that share an X-SMG-Routing-Key "
            "(orchestrator.rollout.routing_key) stay on one server, so later turns meet their "
            "prefix cache; a server that fails its health checks hands its keys on.",
        )
    )
    router_assignment_mode: Literal["min_load", "min_group", "random"] = Field(
        default="min_load",
        description="sglang-router's --assignment-mode (manual policy): where a new key goes.",
    )
    start_timeout_s: float = Field(default=600.0, gt=0)
    restart_backoff_s: float = Field(default=5.0, gt=0)
    max_restarts: int = Field(default=5, ge=0, description="Restarts in a row before giving up.")


class JoinConfig(Section):
    """Joining a running run by pulling (`inference.join`): the weights from the trainer's
    weight store, then an announcement in the engine registry (docs/deploy.md, "Scaling
    engines during a run")."""

    store_dir: str | None = Field(
        default=None,
        description="The trainer's weight store (trainer.weight_push.store_dir, a shared "
        "directory): at start-up the engine pulls the newest version from it and is ready only "
        "once it holds it. None: it serves its model_path weights at once.",
    )
    announce: bool = Field(
        default=False,
        description="Once ready, announce advertise_url in the run's engine registry (Redis: "
        "redis.url) so a trainer and orchestrator with engines.discover push to and route to "
        "this engine; withdrawn at shutdown, expired after announce_ttl_s if it dies.",
    )
    advertise_url: str | None = Field(
        default=None,
        description="This engine's URL as the trainer and orchestrator reach it; default "
        "http://<http.host>:<http.port> (127.0.0.1 for 0.0.0.0). Kubernetes: the pod's IP.",
    )
    announce_ttl_s: float = Field(default=15.0, gt=0)
    poll_s: float = Field(
        default=2.0, gt=0, description="A failed pull or announcement is tried again this often."
    )


class InferenceHttpConfig(HttpConfig):
    # Its own class (not HttpConfig(port=...)): a partial override such as
    # SEARCHR1_INFERENCE__HTTP__HOST must keep this default port.
    port: int = Field(default=30000, ge=0, le=65535)


class InferenceConfig(Section):
    http: InferenceHttpConfig = Field(default_factory=InferenceHttpConfig)
    engine: Literal["torch", "sglang"] = "torch"
    model_path: str | None = Field(default=None, description="Local Hugging Face model directory.")
    torch_engine: TorchEngineConfig = Field(default_factory=TorchEngineConfig)
    sglang: SglangConfig = Field(default_factory=SglangConfig)
    join: JoinConfig = Field(default_factory=JoinConfig)


class InferenceSettings(ServiceSettings):
    """What `searchr1 inference ...` loads: the shared sections plus `inference`."""

    inference: InferenceConfig = InferenceConfig()
