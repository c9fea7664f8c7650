"""`MegatronBackend`: the trainer's model mechanics on Megatron-Core (TP x PP x DP).

The GRPO core hands micro-batches and a loss function; this runs them through Megatron's
pipeline schedule (`get_forward_backward_func`) on a `GPTModel` wrapped in Megatron's
`DistributedDataParallel`, with its (distributed) optimizer. Gradient contract: the core's
loss weights already sum to 1 over all DP ranks, so gradients must be SUMMED over DP: the
model config sets `calculate_per_token_loss` (DDP then sums instead of averaging) and the
grad-finalize hook is called without a token count (no per-token rescaling).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from trainer.backend import LossFn, OptimizerStep, Policy, TrainerBackend
from trainer.backends.megatron import checkpoint, convert, cpu, sharded
from trainer.backends.megatron.config import check_layout
from trainer.backends.megatron.logprobs import (
    head_weight,
    return_hidden_states,
    tp_group,
    vocab_parallel_logprobs,
)
from trainer.backends.megatron.model import ModelShape, build_gpt, padded_vocab, shape_from_hf
from trainer.backends.megatron.model import transformer_config as make_config
from trainer.backends.megatron.parallel import Layout, init_parallel, kept_rows, segment_lengths
from trainer.backends.megatron.weights import gather_hf, load_full
from trainer.batching import MicroBatch
from trainer.config import DType, LRSchedule, Recompute, TrainerConfig
from trainer.dist import DistInfo
from trainer.export import write_hf_dir
from trainer.logprobs import head_token_stats, to_host

T = TypeVar("T")


def lr_factor(schedule: LRSchedule, warmup_steps: int, step: int) -> float:
    """The LR multiplier of training step `step` (as the HF backend's schedule)."""
    if schedule == LRSchedule.WARMUP and warmup_steps > 0:
        return min(1.0, (step + 1) / warmup_steps)
    return 1.0


class MegatronBackend(TrainerBackend):
    def __init__(
        self, hf_state: dict[str, torch.Tensor], hf_config: Any, cfg: TrainerConfig, info: DistInfo
    ) -> None:
        from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
        from megatron.core.distributed import DistributedDataParallelConfig as DDPConfig

        self.cfg, self.info, self.hf_config = cfg, info, hf_config
        self.rank, self.world_size = info.rank, info.world_size
        self.device = info.device
        self.on_cpu = self.device.type == "cpu"
        if self.on_cpu:
            cpu.install()
        mcfg = cfg.megatron
        self.shape: ModelShape = shape_from_hf(hf_config)
        s = self.shape
        check_layout(
            mcfg, info.world_size, heads=s.num_heads, kv_heads=s.num_kv_heads, layers=s.num_layers
        )
        self.layout: Layout = init_parallel(mcfg, info, cfg.model.seed)
        self.dp_rank, self.dp_size = self.layout.dp_rank, self.layout.dp
        self.vocab_size = s.vocab_size
        self.padded_vocab = padded_vocab(s.vocab_size, mcfg.tp, mcfg.vocab_multiple)
        # `auto` is fp32 on CPU, bf16 on CUDA (as the HF backend).
        bf16 = cfg.model.dtype == DType.BFLOAT16 or (
            cfg.model.dtype == DType.AUTO and not self.on_cpu
        )
        if bf16 and not mcfg.distributed_optimizer:
            # Its fp32 main parameters are what checkpoints read (checkpoint.py).
            raise ValueError(
                "trainer.model.dtype bfloat16 needs trainer.megatron.distributed_optimizer: true"
            )
        self.compute_dtype = torch.bfloat16 if bf16 else torch.float32
        self.tconfig = make_config(
            s, tp=mcfg.tp, pp=mcfg.pp, dtype=self.compute_dtype, cpu=self.on_cpu
        )
        # Sum over DP (see the module docstring).
        self.tconfig.calculate_per_token_loss = True
        if cfg.model.recompute == Recompute.FULL:  # Megatron's own: recompute every layer
            self.tconfig.recompute_granularity = "full"
            self.tconfig.recompute_method = "uniform"
            self.tconfig.recompute_num_layers = 1
        elif cfg.model.recompute == Recompute.ATTENTION:
            self.tconfig.recompute_granularity = "selective"
            self.tconfig.recompute_modules = ["core_attn"]
        # The last stage returns hidden states and the head runs in chunks (trainer.logprobs).
        self.logprob_chunk = cfg.model.logprob_chunk_tokens
        full = convert.hf_to_full(hf_state, s, self.padded_vocab)
        model = self._build(full)
        self.ref_model: nn.Module | None = None
        if cfg.loss.kl_coef > 0:
            self.ref_model = self._build(full).eval()
            self.ref_model.requires_grad_(False)
        del full
        self.ddp = DistributedDataParallel(
            config=self.tconfig,
            ddp_config=DDPConfig(
                grad_reduce_in_fp32=True, use_distributed_optimizer=mcfg.distributed_optimizer
            ),
            module=model,
        )
        self.tconfig.no_sync_func = self.ddp.no_sync
        self.tconfig.finalize_model_grads_func = functools.partial(
            _finalize_without_token_scaling, finalize_model_grads
        )
        self.optimizer = self._make_optimizer()
        self._train_steps = 0  # scheduler steps (training steps)
        self._steps = 0  # optimizer steps

    # -- set-up ---------------------------------------------------------------------------

    def _build(self, full: dict[str, torch.Tensor]) -> nn.Module:
        with self._device_ctx():  # a tied embedding on the last stage is moved with `.cuda()`
            model = build_gpt(
                self.shape,
                self.tconfig,
                vocab=self.padded_vocab,
                pre=self.layout.first_stage,
                post=self.layout.last_stage,
            )
        model = model.to(self.device)
        if self.compute_dtype != torch.float32:
            # Every parameter in the compute dtype (the torch norms are built fp32): Megatron's
            # distributed optimizer indexes its main params assuming one dtype per group.
            # Parameters only: the RoPE frequencies (a buffer) stay fp32.
            for p in model.parameters():
                p.data = p.data.to(self.compute_dtype)
        load_full(model, full, self.shape, self.layout)
        if self.logprob_chunk and self.layout.last_stage:
            return_hidden_states(model)
        return model

    def _make_optimizer(self) -> Any:
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        o = self.cfg.optim
        ocfg = OptimizerConfig(
            optimizer="adam",
            lr=o.lr,
            weight_decay=o.weight_decay,
            adam_beta1=o.betas[0],
            adam_beta2=o.betas[1],
            adam_eps=o.eps,
            clip_grad=o.grad_clip or 0.0,
            bf16=self.compute_dtype == torch.bfloat16,
            params_dtype=self.compute_dtype,
            use_distributed_optimizer=self.cfg.megatron.distributed_optimizer,
        )
        with self._device_ctx():
            # {}: weight decay on every parameter, as the HF backend's AdamW.
            return get_megatron_optimizer(ocfg, [self.ddp], config_overrides={})

    def _device_ctx(self) -> contextlib.AbstractContextManager[Any]:
        return cpu.cuda_to_cpu() if self.on_cpu else contextlib.nullcontext()

    @property
    def optimizer_steps(self) -> int:
        return self._steps

    # -- forward ---------------------------------------------------------------------------

    def _inputs(self, mb: MicroBatch) -> tuple[torch.Tensor, ...]:
        d = self.device
        # the attention mask of `SegmentAttention`: sequence lengths, kept on the CPU
        return (mb.input_ids.to(d), mb.position_ids.to(d), segment_lengths(mb))

    def _token_stats(
        self,
        model: nn.Module,
        out: torch.Tensor,
        mb: MicroBatch,
        *,
        entropy: bool,
        entropy_grad: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logprobs (and entropies) of `mb`'s response tokens from the last stage's output:
        hidden states with `logprob_chunk`, else this TP rank's vocabulary slice of the logits."""
        rows = kept_rows(out, mb)
        if self.logprob_chunk:
            weight = head_weight(model)
            logp, ent = head_token_stats(
                rows,
                weight,
                mb.targets,
                mb.temperatures,
                chunk=self.logprob_chunk,
                compute_dtype=self.compute_dtype,
                vocab_start=self.layout.tp_rank * weight.shape[0],
                vocab_size=self.vocab_size,
                group=tp_group(),
            )
            if not entropy:
                return logp, None
            return logp, ent if entropy_grad else ent.detach()
        start = self.layout.tp_rank * rows.shape[-1]
        return vocab_parallel_logprobs(
            rows,
            mb.targets,
            mb.temperatures,
            vocab_start=start,
            vocab_size=self.vocab_size,
            entropy=entropy,
            entropy_grad=entropy_grad,
        )

    def _run(
        self,
        model: nn.Module,
        microbatches: Sequence[MicroBatch],
        loss_func: Any,
        *,
        forward_only: bool,
    ) -> None:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def step(data: Iterator[MicroBatch], module: nn.Module) -> tuple[torch.Tensor, Any]:
            mb = next(data)
            out = module(*self._inputs(mb))
            return out, functools.partial(loss_func, mb)

        with self._device_ctx():
            get_forward_backward_func()(
                forward_step_func=step,
                data_iterator=iter(microbatches),
                model=[model],
                num_microbatches=len(microbatches),
                seq_length=max(mb.input_ids.shape[1] for mb in microbatches),
                micro_batch_size=max(mb.input_ids.shape[0] for mb in microbatches),
                forward_only=forward_only,
            )

    @torch.no_grad()
    def logprobs(self, microbatches: Sequence[MicroBatch], policy: Policy) -> list[torch.Tensor]:
        model = self.ddp if policy == Policy.CURRENT else self.ref_model
        if model is None:
            raise ValueError("reference logprobs need loss.kl_coef > 0 (no reference model)")
        model.eval()
        out: list[torch.Tensor] = []

        def collect(mb: MicroBatch, logits: torch.Tensor) -> tuple[torch.Tensor, dict]:
            lp, _ = self._token_stats(model, logits, mb, entropy=False, entropy_grad=False)
            out.append(lp.float())
            return logits.new_zeros(()), {}

        self._run(model, microbatches, collect, forward_only=True)
        return self._from_last_stage(to_host(out))

    def _from_last_stage(self, values: list[T]) -> list[T]:
        from megatron.core import parallel_state as ps

        if self.layout.pp == 1:
            return values
        box = [values]
        dist.broadcast_object_list(
            box,
            src=ps.get_pipeline_model_parallel_last_rank(),
            group=ps.get_pipeline_model_parallel_group(),
        )
        return box[0]

    def forward_backward(
        self, microbatches: Sequence[MicroBatch], loss_fn: LossFn, *, entropy_grad: bool
    ) -> None:
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        self.ddp.train()
        seen: list[tuple[torch.Tensor, torch.Tensor | None]] = []

        def loss(mb: MicroBatch, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
            lp, ent = self._token_stats(
                self.ddp, logits, mb, entropy=True, entropy_grad=entropy_grad
            )
            seen.append((lp.detach().cpu(), None if ent is None else ent.detach().cpu()))
            terms = loss_fn(mb, lp, ent)
            # Three values + calculate_per_token_loss: the schedule neither averages over
            # micro-batches nor divides by this count (the finalize hook ignores it).
            return terms.loss, torch.ones((), dtype=torch.int, device=lp.device), {}

        self._run(self.ddp, microbatches, loss, forward_only=False)
        if self.layout.pp > 1:
            # Only the last stage ran `loss_fn`; the core reads its metrics (side effects of
            # `loss_fn`) on every rank, so the other stages replay it on the last stage's
            # values, without gradient.
            seen = self._from_last_stage(seen)
            if not self.layout.last_stage:
                with torch.no_grad():
                    for mb, (lp, ent) in zip(microbatches, seen, strict=True):
                        loss_fn(mb, lp, ent)

    # -- optimizer --------------------------------------------------------------------------

    def current_lr(self) -> float:
        o = self.cfg.optim
        return o.lr * lr_factor(o.schedule, o.warmup_steps, self._train_steps)

    def optimizer_step(self) -> OptimizerStep:
        lr = self.current_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        with self._device_ctx():
            _ok, grad_norm, _zeros = self.optimizer.step()
        self._steps += 1
        return OptimizerStep(grad_norm=float(grad_norm or 0.0), lr=lr)

    def scheduler_step(self) -> None:
        self._train_steps += 1

    # -- collectives --------------------------------------------------------------------------

    def all_reduce_dp(self, values: dict[str, float]) -> dict[str, float]:
        from megatron.core import parallel_state as ps

        if self.dp_size == 1 or not values:
            return values
        keys = sorted(values)
        t = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, group=ps.get_data_parallel_group())
        return dict(zip(keys, t.cpu().tolist(), strict=True))

    def all_gather_dp(self, obj: T) -> list[T]:
        from megatron.core import parallel_state as ps

        if self.dp_size == 1:
            return [obj]
        out: list[Any] = [None] * self.dp_size
        dist.all_gather_object(out, obj, group=ps.get_data_parallel_group())
        return out

    # -- weights and state ----------------------------------------------------------------------

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from gather_hf(self.ddp.module, self.shape, self.layout)

    def export_hf(self, out_dir: Path) -> Path | None:
        tensors = dict(self.named_tensors())
        if not self.is_main:
            return None
        return write_hf_dir(tensors, self.hf_config, Path(out_dir), self.cfg.model.path)

    def full_state(self) -> dict[str, Any]:
        return checkpoint.full_state(self)

    def load_full_state(self, state: dict[str, Any] | None) -> None:
        checkpoint.load_full_state(self, state)

    # Checkpoints: every rank writes its own shards (trainer/backends/megatron/sharded.py).
    sharded_checkpoints = True

    def save_shards(self, directory: Path) -> dict[str, Any]:
        return sharded.save_shards(self, directory)

    def load_shards(
        self, directory: Path | None, state: dict[str, Any] | None, *, weights_only: bool = False
    ) -> None:
        sharded.load_shards(self, directory, state, weights_only=weights_only)


def _finalize_without_token_scaling(
    finalize: Any, model: Any, num_tokens: Any = None, **kwargs: Any
) -> None:
    finalize(model, None, **kwargs)


def load_megatron_backend(cfg: TrainerConfig, info: DistInfo) -> MegatronBackend:
    """Read the Hugging Face directory `trainer.model.path` and build the backend."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    if not cfg.model.path:
        raise ValueError("trainer.model.path is not set")
    path = Path(cfg.model.path)
    hf_config = AutoConfig.from_pretrained(path)
    state: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        state.update(load_file(f))
    if not state:
        raise ValueError(f"{path}: no *.safetensors weights")
    state = {k: v.float() for k, v in state.items()}
    if hf_config.tie_word_embeddings:
        state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])
    return MegatronBackend(state, hf_config, cfg, info)
