"""Configuration of the trainer service (its section of the stack config file).

Each component gets its own sub-section (advantages, loss, TIS, optimizer, batching,
checkpoints, weight push); defaults follow spec section 5 (slime's Search-R1 recipe).
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from searchr1.sections import EnginesConfig, HttpConfig, Section
from searchr1.settings import ServiceSettings, given_value, with_value
from trainer.backends.megatron.config import MegatronConfig
from trainer.backends.registry import BACKENDS

# A user's backend loader named by dotted path (`pkg.module:loader`; the colon is required, so
# a mistyped registry name is not taken for a module). Checked for form only: the config is a
# leaf, the loader is imported (and its signature checked) when the trainer starts.
DOTTED_LOADER = re.compile(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*")


class AdvantageConfig(Section):
    # Dr.GRPO drops the division by the group std.
    normalize_std: bool = True
    eps: float = Field(default=1e-6, gt=0)
    # Groups whose rewards are all equal have zero advantage; optionally drop them entirely.
    filter_degenerate_groups: bool = False


class KLEstimator(StrEnum):
    K1 = "k1"
    K2 = "k2"
    LOW_VAR_KL = "low_var_kl"


class Aggregation(StrEnum):
    TOKEN_MEAN = "token_mean"
    SAMPLE_MEAN = "sample_mean"  # mean over samples of per-sample token means (slime default)


class OldLogprobSource(StrEnum):
    ROLLOUT = "rollout"  # the engine's logprobs are the behaviour policy
    RECOMPUTE = "recompute"  # the trainer recomputes them before the update
    # One optimizer step per rollout batch: the old policy is the current one, so the training
    # forward's own logprobs, detached, are the old ones (ratio 1, the same gradient), and the
    # forward-only pass that recomputed them goes (~1/5 of a step's FLOPs with a reference).
    FORWARD = "forward"


class LossConfig(Section):
    eps_clip_low: float = Field(default=0.2, ge=0)
    eps_clip_high: float = Field(default=0.28, ge=0)
    kl_coef: float = Field(default=0.001, ge=0, description="0 disables the reference model.")
    kl_estimator: KLEstimator = KLEstimator.LOW_VAR_KL
    entropy_coef: float = Field(default=0.0, ge=0)
    aggregation: Aggregation = Aggregation.TOKEN_MEAN
    log_ratio_clamp: float = Field(default=20.0, gt=0, description="|log-ratio| bound before exp.")
    clip_ratio_c: float | None = Field(
        default=None,
        gt=1,
        description="verl's dual-clip: a token with a negative advantage A has loss at most "
        "-A * clip_ratio_c (verl uses 3). None: off.",
    )
    old_logprobs: OldLogprobSource = OldLogprobSource.RECOMPUTE
    train_on_infrastructure_failures: bool = Field(
        default=False,
        description="Train samples whose search failed because the retriever was down (they "
        "would teach the policy that searching does not pay). False: left out of the batch, "
        "counted in samples/infrastructure_failures; their group's advantages use the rest.",
    )


class TISMode(StrEnum):
    OFF = "off"
    TOKEN = "token"  # w = min(exp(old - rollout), C)
    MIS = "mis"  # the richer variant below


class TISLevel(StrEnum):
    TOKEN = "token"
    SEQUENCE = "sequence"  # product of the token ratios of a sequence
    GEOMETRIC = "geometric"  # geometric mean of the token ratios of a sequence


class TISAction(StrEnum):
    TRUNCATE = "truncate"  # w = min(w, upper)
    CLIP = "clip"  # w = clamp(w, lower, upper)
    MASK = "mask"  # w = 0 outside [lower, upper]


class TISConfig(Section):
    mode: TISMode = TISMode.OFF
    cap: float = Field(default=2.0, gt=0, description="C of the token-level TIS.")
    level: TISLevel = TISLevel.TOKEN
    action: TISAction = TISAction.TRUNCATE
    lower: float = Field(default=0.5, ge=0)
    upper: float = Field(default=2.0, gt=0)
    veto_threshold: float | None = Field(
        default=1e-4, ge=0, description="Zero a sequence when any token ratio is below this."
    )
    renormalize: bool = False
    log_ratio_clamp: float = Field(default=20.0, gt=0)


class LRSchedule(StrEnum):
    CONSTANT = "constant"
    WARMUP = "warmup"  # linear warm-up, then constant


class OptimConfig(Section):
    lr: float = Field(default=1e-6, gt=0)
    betas: tuple[float, float] = (0.9, 0.98)
    weight_decay: float = Field(default=0.01, ge=0)
    eps: float = Field(default=1e-8, gt=0)
    grad_clip: float | None = Field(default=1.0, gt=0)
    schedule: LRSchedule = LRSchedule.CONSTANT
    warmup_steps: int = Field(
        default=0,
        ge=0,
        description="Training steps (rollout batches, like run.max_steps) of linear warm-up; every "
        "optimizer step of a training step uses that step's LR.",
    )


class BatchConfig(Section):
    num_minibatches: int = Field(
        default=1, ge=1, description="Optimizer steps per rollout batch (1 = on-policy)."
    )
    max_tokens_per_microbatch: int = Field(
        default=8192, ge=1, description="Token budget of one packed forward/backward."
    )
    max_samples_per_microbatch: int | None = Field(
        default=None, ge=1, description="Also cap the sequences per micro-batch."
    )
    packing: bool = Field(default=True, description="False: the padded path (for comparison).")
    consume_block_s: float = Field(default=1.0, gt=0)
    incomplete_group_timeout_s: float = Field(
        default=600.0,
        gt=0,
        description="A prompt group still missing members this long after its first one arrived "
        "is dead-lettered (reason incomplete_group). Keep it above bus.reclaim_idle_s: a dead "
        "trainer's half of a group is reclaimed only after that.",
    )


class CheckpointConfig(Section):
    dir: str | None = Field(default=None, description="None: no checkpoints (tests only).")
    every_steps: int = Field(default=1, ge=1)
    keep_last: int = Field(default=2, ge=1)
    export_dir: str | None = Field(
        default=None, description="Also export a plain HF directory here at every checkpoint."
    )


class PushMode(StrEnum):
    NONE = "none"
    DISK = "disk"  # export HF dir + POST /update_weights_from_disk to every engine
    DISTRIBUTED = "distributed"  # searchr1.weightsync.sender.WeightSender (gloo/NCCL)
    # searchr1.weightsync.handover.HandoverSender: /update_weights_from_tensor with handles to
    # the trainer's memory (shared memory on CPU, CUDA IPC on GPU): engines on the same host/GPU
    HANDOVER = "handover"


class WeightPushConfig(Section):
    mode: PushMode = PushMode.NONE
    every_steps: int = Field(default=1, ge=1)
    engine_urls: list[str] = Field(
        default_factory=list,
        description="Where the pushes go. Left out: the stack's engines.urls (every engine); "
        "named: these instead (the engines as this trainer reaches them, e.g. through a proxy).",
    )
    master_addr: str = "127.0.0.1"
    master_port: int = Field(
        default=29600,
        ge=0,
        le=65535,
        description="The weight group's rendezvous port on master_addr; 0: a free one, chosen "
        "at the first push and sent to the engines in the join (a fixed port is what a "
        "network policy can allow).",
    )
    backend: str = Field(default="gloo", pattern="^(gloo|nccl)$")
    bucket_bytes: int = Field(default=256 << 20, ge=1)
    dtype: str | None = Field(
        default=None,
        pattern="^(float32|bfloat16|float16)$",
        description="The engines' weight dtype, tensors are cast to it before sending. Needed for "
        "SGLang, whose /get_model_info does not say (our engine does): set it to SGLang's --dtype.",
    )
    disk_dir: str | None = Field(default=None, description="Where disk pushes export weights.")
    handover_format: Literal["searchr1", "sglang"] = Field(
        default="searchr1",
        description="mode=handover: `searchr1` for our engine (described handles, never a "
        "pickle), `sglang` for SGLang (its own pickled handles, which it unpickles).",
    )
    handover_tp_size: int = Field(
        default=1,
        ge=1,
        description="mode=handover: the engines' tensor-parallel size (SGLang takes one "
        "serialized copy of each bucket per TP rank): inference.sglang.tp_size.",
    )
    release_engines_while_training: bool = Field(
        default=False,
        description="Colocated placement: before each training step the engines pause and "
        "release their memory (KV cache and weights: /release_memory_occupation); after it they "
        "resume the weights, take the push, then resume the KV cache and generate again. Sync "
        "rollouts only: the engines are idle while the trainer trains.",
    )
    retry_deadline_s: float = Field(
        default=600.0,
        ge=0,
        description="A failed push is retried (backoff from retry_backoff_s, doubling, at most "
        "30 s) for this long; then the trainer stops with an error (exit 1) instead of training "
        "on while the engines serve old weights (sync rollouts would wait for them forever).",
    )
    retry_backoff_s: float = Field(default=1.0, gt=0)
    timeout_s: float = Field(
        default=120.0,
        gt=0,
        description="mode distributed: each step of a push finishes within this or fails: "
        "every engine call (with its retries) and every collective of the weight group (the "
        "join, each bucket's broadcast: gloo's timeout). A push across a network cut that "
        "heals sooner is only delayed (TCP resends after its backoff: up to about the cut's "
        "length again); one across a cut that lasts fails within a few times this, and is "
        "retried (retry_deadline_s). Well above a GC pause or a bucket's transfer; set the "
        "engines' inference.weight_group_timeout_s alike.",
    )
    release_tags: list[Literal["kv_cache", "weights", "cuda_graph"]] = Field(
        default=["kv_cache", "weights"],
        description="What release_engines_while_training frees (SGLang's tags; cuda_graph too "
        "where the engine captured graphs).",
    )
    resync_check_s: float = Field(
        default=10.0,
        gt=0,
        description="While waiting for rollouts, check this often that every engine serves "
        "the trainer's version; one behind (restarted: version 0) gets the current weights "
        "again. Single-rank trainers only.",
    )
    delta: Literal["auto", "on", "off"] = Field(
        default="auto",
        description="Delta weight updates (searchr1.weightsync.delta): a push carries, per "
        "tensor, what changed since the weights the engines hold (XOR + zstd, or nothing), to "
        "our engines only (SGLang gets full tensors). auto: on for mode distributed over gloo "
        "to engines on other hosts (a network link: 39x fewer bytes and 5.6x less time through "
        "1 Gbit/s at the Qwen2.5-0.5B shape, docs/benchmarks.md), off on loopback, over NCCL, "
        "and for handover and disk (memory and GPU links outrun the CPU encoding, ~0.5 GB/s "
        "on 2 cores; SGLang loads disk pushes as Hugging Face directories). on: every mode "
        "(disk: our engines only). The trainer keeps the last weights sent in the engines' "
        "dtype (twice that in host memory: buffers are reused).",
    )
    store_dir: str | None = Field(
        default=None,
        description="The weight store (searchr1.weightsync.store): every pushed version is "
        "written here first (a full snapshot, then deltas; safetensors + a JSON manifest with "
        "checksums), so an engine that starts, restarts or is added mid-run pulls the current "
        "version (inference.join.store_dir, the same directory) instead of waiting for a push.",
    )
    store_full_every: int = Field(
        default=10, ge=1, description="The store writes a full snapshot every N versions."
    )
    store_keep_full: int = Field(
        default=2, ge=1, description="Full snapshots the store keeps (and the deltas after them)."
    )
    delta_verify_every: int = Field(
        default=10,
        ge=0,
        description="Delta updates: every N-th push carries the trainer's checksum of all the "
        "weights it sent; each engine checks its own after applying: a mismatch undoes the "
        "update (hand-over: marks the weights broken), is counted "
        "(searchr1_weight_delta_resyncs_total{reason=checksum}) and everything is resent in "
        "full at once. 0: never.",
    )

    @model_validator(mode="after")
    def _check_release(self) -> WeightPushConfig:
        if not self.release_engines_while_training:
            return self
        if self.mode != PushMode.HANDOVER:
            raise ValueError(
                "release_engines_while_training needs mode handover (colocated engines take "
                f"the weights from the trainer's memory), not {self.mode.value}"
            )
        if "weights" in self.release_tags and self.every_steps != 1:
            raise ValueError(
                "release_engines_while_training with release_tags weights needs every_steps 1: "
                "released weights come back only with a push"
            )
        return self


class Recompute(StrEnum):
    NONE = "none"
    ATTENTION = "attention"
    FULL = "full"


class DType(StrEnum):
    AUTO = "auto"  # bf16 on CUDA, fp32 on CPU
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"


class ModelConfig(Section):
    path: str | None = Field(default=None, description="Hugging Face directory of the policy.")
    dtype: DType = DType.AUTO
    device: str = Field(default="auto", description="auto | cpu | cuda")
    attn_implementation: str = Field(
        default="varlen",
        description="varlen (per-sequence fused causal attention, see trainer.attention; it "
        "refuses models with sliding windows, logit softcapping or attention sinks), or a "
        "transformers name (sdpa, eager, flash_attention_2).",
    )
    recompute: Recompute = Field(
        default=Recompute.NONE,
        description="Activation recompute in the backward: none (keep every activation: "
        "fastest, most memory), attention (the core attention only: Megatron's selective "
        "`core_attn`; the HF backend needs attn_implementation varlen), or full (every "
        "decoder layer: least memory, one more forward).",
    )
    logprob_chunk_tokens: int = Field(
        default=1024,
        ge=0,
        description="Logprobs and entropies from the LM head this many tokens at a time, "
        "recomputed per chunk in the backward (trainer.logprobs), so fp32 logits over the "
        "whole vocabulary never exist for a whole micro-batch; 0 keeps the full logits. The HF "
        "backend uses the full logits under FSDP and for heads that scale or cap logits.",
    )
    seed: int = 0

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        if isinstance(data, dict) and "gradient_checkpointing" in data:
            raise ValueError(
                "trainer.model.gradient_checkpointing was replaced by trainer.model.recompute "
                "(none | attention | full): `gradient_checkpointing: true` is `recompute: full`"
            )
        return data


class TrainerHttpConfig(HttpConfig):
    # Its own class (not HttpConfig(port=...)): a partial override such as
    # SEARCHR1_TRAINER__HTTP__HOST must keep this default port.
    port: int = Field(default=8200, ge=0, le=65535)


class TrainerConfig(Section):
    http: TrainerHttpConfig = Field(default_factory=TrainerHttpConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    backend: str = Field(
        default="hf",
        description="hf (Hugging Face model, one process or FSDP2) or megatron (Megatron-Core, "
        "TP x PP x DP): a name of trainer.backends.registry; or a user's backend by dotted path "
        "`pkg.module:loader` (a loader takes (TrainerConfig, DistInfo) and returns a "
        "TrainerBackend; loaded and signature-checked at start-up).",
    )
    megatron: MegatronConfig = Field(default_factory=MegatronConfig)
    advantages: AdvantageConfig = Field(default_factory=AdvantageConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    tis: TISConfig = Field(default_factory=TISConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    batch: BatchConfig = Field(default_factory=BatchConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    weight_push: WeightPushConfig = Field(default_factory=WeightPushConfig)
    offload_between_steps: list[Literal["optimizer", "reference"]] = Field(
        default_factory=list,
        description="Colocated placement: what leaves the device after each push, while the "
        "engines generate on it, and comes back before the next step: `optimizer` (Adam's "
        "state), `reference` (the KL reference model). The hf backend; others keep all.",
    )
    lease_ttl_s: float = Field(
        default=15.0,
        gt=0,
        description="One trainer per bus stream: it holds a Redis lease renewed every third of "
        "this; a second trainer is refused, and one that loses its lease stops at once.",
    )
    lease_wait_s: float | None = Field(
        default=None,
        ge=0,
        description="How long a starting trainer waits for the run's lease before it gives up "
        "(exit 1). None: 1.5 x lease_ttl_s, the time a dead predecessor's lease takes to expire. "
        "A hot standby (a second trainer, model loaded, that takes over when the holder dies or "
        "is cut off from Redis) sets a long wait.",
    )
    metrics_jsonl: str | None = Field(default=None, description="Append one JSON line per step.")
    tensorboard_dir: str | None = Field(
        default=None, description="Used when tensorboard is installed."
    )
    wandb_project: str | None = Field(default=None, description="Used when wandb is installed.")

    @field_validator("backend")
    @classmethod
    def _known_backend(cls, name: str) -> str:
        if name not in BACKENDS and not DOTTED_LOADER.fullmatch(name):
            raise ValueError(
                f"unknown backend {name!r}: one of {', '.join(BACKENDS)}, or a dotted path "
                "'pkg.module:loader'"
            )
        return name

    @model_validator(mode="after")
    def _check(self) -> TrainerConfig:
        if self.tis.mode != TISMode.OFF and self.loss.old_logprobs == OldLogprobSource.ROLLOUT:
            raise ValueError(
                "tis.mode needs loss.old_logprobs=recompute (or forward): with rollout logprobs "
                "as the old policy every TIS weight is 1"
            )
        if self.loss.old_logprobs == OldLogprobSource.FORWARD:
            self._check_forward_old_logprobs()
        if self.tis.lower > self.tis.upper:
            raise ValueError("tis.lower must be <= tis.upper")
        return self

    def _check_forward_old_logprobs(self) -> None:
        """What needs the old policy's logprobs of the whole batch before its first update
        cannot take them from that update's forward."""
        if self.batch.num_minibatches != 1:
            raise ValueError(
                "loss.old_logprobs=forward needs batch.num_minibatches=1: after the first "
                "optimizer step the old policy is no longer the current one (use recompute)"
            )
        if self.tis.mode == TISMode.MIS:
            raise ValueError(
                "loss.old_logprobs=forward takes tis.mode off or token: mis weights (sequence "
                "levels, vetoes) are set before the update (use recompute)"
            )
        if self.tis.mode != TISMode.OFF and self.tis.renormalize:
            raise ValueError(
                "loss.old_logprobs=forward cannot tis.renormalize: the mean is over the whole "
                "batch, known only once the update's forward has run (use recompute)"
            )


class TrainerSettings(ServiceSettings):
    """What `searchr1 trainer ...` loads: the shared sections plus `trainer`."""

    trainer: TrainerConfig = TrainerConfig()
    engines: EnginesConfig = Field(
        default_factory=EnginesConfig, description="The engines it pushes to (EnginesConfig)."
    )

    @model_validator(mode="before")
    @classmethod
    def _push_to_the_engines(cls, data: Any) -> Any:
        """trainer.weight_push.engine_urls follows from engines.urls unless named."""
        push_urls = ("trainer", "weight_push", "engine_urls")
        if not isinstance(data, dict) or given_value(data, push_urls)[0]:
            return data
        named, urls = given_value(data, ("engines", "urls"))
        return with_value(data, push_urls, urls if named else EnginesConfig().urls)

    @model_validator(mode="after")
    def _backlog_holds_the_unacked_window(self) -> TrainerSettings:
        # The trainer acknowledges trajectories only once a checkpoint holds them, so up to
        # `checkpoint.every_steps` trained steps stay unacked while it gathers the next one. The
        # bus blocks publishing at `max_backlog` unacked entries: a smaller bound starves the
        # trainer of its next step and both wait forever.
        ckpt = self.trainer.checkpoint
        held = ckpt.every_steps if ckpt.dir else 0
        per_step = self.run.groups_per_step * self.run.group_size
        need = (held + 1) * per_step
        if self.bus.max_backlog < need:
            raise ValueError(
                f"bus.max_backlog ({self.bus.max_backlog}) must be at least {need}: "
                f"(trainer.checkpoint.every_steps {held} + 1) x run.groups_per_step "
                f"{self.run.groups_per_step} x run.group_size {self.run.group_size}, the "
                "trajectories the trainer holds unacknowledged until its next checkpoint plus "
                "one step"
            )
        return self
