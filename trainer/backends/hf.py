"""Hugging Face causal LMs under PyTorch: one process, or FSDP2 (`fully_shard`) over ranks.

Parameters stay fp32 (the optimizer's master copy); bf16 compute on CUDA comes from autocast
(one process) or FSDP2's mixed-precision policy. Model mechanics only: the GRPO core
(`trainer.step`) plans the micro-batches and gives the loss.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from trainer.attention import PackedBounds, use_varlen
from trainer.backend import LossFn, OptimizerStep, Policy, TrainerBackend
from trainer.batching import MicroBatch
from trainer.config import DType, LRSchedule, Recompute, TrainerConfig
from trainer.dist import DistInfo, all_gather_objects, all_reduce_sum
from trainer.export import write_hf_dir
from trainer.logprobs import head_token_stats, to_host
from trainer.losses import entropy_from_logits
from trainer.offload import move_module, move_optimizer_state

T = TypeVar("T")


def _lr_lambda(schedule: LRSchedule, warmup_steps: int):  # type: ignore[no-untyped-def]
    # `step` counts training steps (the scheduler steps once per rollout batch, see train_step).
    def f(step: int) -> float:
        if schedule == LRSchedule.WARMUP and warmup_steps > 0:
            return min(1.0, (step + 1) / warmup_steps)
        return 1.0

    return f


def plain_head(model: nn.Module) -> bool:
    """Whether the logits are exactly `lm_head(hidden)`: a bias-free linear head and no logit
    scaling or capping in the config (Gemma2's softcap, Cohere's and Granite's scales)."""
    head = model.get_output_embeddings()  # type: ignore[operator]
    if type(head) is not nn.Linear or head.bias is not None:
        return False
    cfg = getattr(model, "config", None)
    scaled = ("final_logit_softcapping", "logit_scale", "logits_scaling")
    return all(getattr(cfg, name, None) in (None, 1, 1.0) for name in scaled)


def _decoder_layers(model: nn.Module) -> Sequence[nn.Module]:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no `.model.layers` to shard with FSDP2")
    return list(layers)


class HFBackend(TrainerBackend):
    def __init__(self, model: nn.Module, cfg: TrainerConfig, info: DistInfo) -> None:
        self.cfg = cfg
        self.info = info
        self.rank, self.world_size = info.rank, info.world_size
        self.dp_rank, self.dp_size = info.rank, info.world_size  # FSDP: every rank is DP
        self.device = info.device
        dtype = cfg.model.dtype
        if dtype == DType.AUTO:
            dtype = DType.BFLOAT16 if self.device.type == "cuda" else DType.FLOAT32
        self.compute_dtype = torch.bfloat16 if dtype == DType.BFLOAT16 else torch.float32
        model = model.to(torch.float32)
        self.vocab_size = int(model.get_input_embeddings().num_embeddings)
        self.varlen = cfg.model.attn_implementation == "varlen"
        recompute = cfg.model.recompute
        if recompute == Recompute.ATTENTION and not self.varlen:
            raise ValueError(
                "trainer.model.recompute=attention needs trainer.model.attn_implementation=varlen "
                f"on the hf backend (got {cfg.model.attn_implementation})"
            )
        if self.varlen:
            use_varlen(model, recompute=recompute == Recompute.ATTENTION)
        if recompute == Recompute.FULL:
            # transformers renamed it (the old name warns from 5.2x on, goes in v6).
            enable = getattr(model, "activation_checkpointing_enable", None)
            (enable or model.gradient_checkpointing_enable)()
        # Logprobs from the hidden states in chunks (trainer.logprobs): one process only (FSDP
        # shards the head) and a plain linear head.
        self.logprob_chunk = cfg.model.logprob_chunk_tokens if plain_head(model) else 0
        if info.distributed:
            self.logprob_chunk = 0
        # The reference policy is a frozen copy of the initial weights.
        self.ref_model: nn.Module | None = None
        if cfg.loss.kl_coef > 0:
            self.ref_model = copy.deepcopy(model).eval()
            self.ref_model.requires_grad_(False)
        self.model = self._place(model)
        if self.ref_model is not None:
            self.ref_model = self._place(self.ref_model)
        o = cfg.optim
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=o.lr,
            betas=o.betas,
            eps=o.eps,
            weight_decay=o.weight_decay,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, _lr_lambda(o.schedule, o.warmup_steps)
        )
        self._steps = 0

    # -- set-up ---------------------------------------------------------------------------

    def _place(self, model: nn.Module) -> nn.Module:
        model = model.to(self.device)
        if not self.info.distributed:
            return model
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(self.device.type, (self.world_size,))
        mp = MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=torch.float32)
        for layer in _decoder_layers(model):
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        return model

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.compute_dtype == torch.float32 or self.info.distributed:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    @property
    def optimizer_steps(self) -> int:
        return self._steps

    # -- forward --------------------------------------------------------------------------

    def _forward(
        self, model: nn.Module, mb: MicroBatch, *, with_entropy: bool, entropy_grad: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logprobs of the response tokens (fp32) under each sample's sampling distribution,
        `log_softmax(logits / T)`, and their entropies if asked."""
        dev = self.device
        extra: dict[str, Any] = {}
        if self.varlen and mb.cu_seqlens is not None:
            # Moved to the device once for all layers (the CPU copy serves the fallback).
            extra["cu_seq_lens_q"] = PackedBounds.of(mb.cu_seqlens, dev)
        if self.logprob_chunk:
            return self._chunked_stats(model, mb, extra, with_entropy, entropy_grad)
        with self._autocast():
            out = model(
                input_ids=mb.input_ids.to(dev),
                position_ids=mb.position_ids.to(dev),
                attention_mask=None if mb.attention_mask is None else mb.attention_mask.to(dev),
                use_cache=False,  # a cache disables the packed-sequence (block-diagonal) mask
                logits_to_keep=mb.keep_positions.to(dev),
                **extra,
            )
        rows = out.logits[mb.row_batch.to(dev), mb.row_keep.to(dev)].float()
        if bool((mb.temperatures != 1.0).any()):
            # The engine sampled (and scored) with logits / T, per sample (slime and verl do the
            # same); T == 1 skips the division, so those logprobs stay bit-identical.
            rows = rows / mb.temperatures.to(dev)[:, None]
        logp = rows.gather(-1, mb.targets.to(dev)[:, None]).squeeze(-1) - torch.logsumexp(
            rows, dim=-1
        )
        ent = None
        if with_entropy:
            if entropy_grad:
                ent = entropy_from_logits(rows)
            else:
                with torch.no_grad():
                    ent = entropy_from_logits(rows.detach())
        return logp, ent

    def _chunked_stats(
        self,
        model: nn.Module,
        mb: MicroBatch,
        extra: dict[str, Any],
        with_entropy: bool,
        entropy_grad: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`_forward` through the decoder's hidden states and `head_token_stats`: the LM head
        runs a chunk of tokens at a time (no `[T, V]` fp32 logits kept for the backward)."""
        dev = self.device
        with self._autocast():
            out = model.base_model(
                input_ids=mb.input_ids.to(dev),
                position_ids=mb.position_ids.to(dev),
                attention_mask=None if mb.attention_mask is None else mb.attention_mask.to(dev),
                use_cache=False,
                **extra,
            )
        pos = mb.keep_positions[mb.row_keep].to(dev)
        hidden = out.last_hidden_state[mb.row_batch.to(dev), pos]
        logp, ent = head_token_stats(
            hidden,
            model.get_output_embeddings().weight,
            mb.targets,
            mb.temperatures,
            chunk=self.logprob_chunk,
            compute_dtype=self.compute_dtype,
        )
        if not with_entropy:
            return logp, None
        return logp, ent if entropy_grad else ent.detach()

    @torch.no_grad()
    def logprobs(self, microbatches: Sequence[MicroBatch], policy: Policy) -> list[torch.Tensor]:
        model = self.model if policy == Policy.CURRENT else self.ref_model
        if model is None:
            raise ValueError("reference logprobs need loss.kl_coef > 0 (no reference model)")
        # eval(): dropout would make old/ref logprobs random; training goes back to train().
        was_training = model.training
        model.eval()
        try:
            return to_host([self._forward(model, mb, with_entropy=False)[0] for mb in microbatches])
        finally:
            model.train(was_training)

    # -- training -------------------------------------------------------------------------

    def forward_backward(
        self, microbatches: Sequence[MicroBatch], loss_fn: LossFn, *, entropy_grad: bool
    ) -> None:
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        for mb in microbatches:
            logp, ent = self._forward(self.model, mb, with_entropy=True, entropy_grad=entropy_grad)
            terms = loss_fn(mb, logp, ent)
            # FSDP averages gradients over ranks; the loss weights already sum over ranks.
            (terms.loss * self.world_size).backward()

    def optimizer_step(self) -> OptimizerStep:
        grad_norm = self._clip_grad()
        lr = self.optimizer.param_groups[0]["lr"]  # the LR this update uses
        self.optimizer.step()
        self._steps += 1
        return OptimizerStep(grad_norm=grad_norm, lr=lr)

    def scheduler_step(self) -> None:
        self.scheduler.step()

    def all_reduce_dp(self, values: dict[str, float]) -> dict[str, float]:
        return all_reduce_sum(values, self.info)

    def all_gather_dp(self, obj: T) -> list[T]:
        return all_gather_objects(obj, self.info)

    def _clip_grad(self) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.cfg.optim.grad_clip or float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if hasattr(norm, "full_tensor"):  # a DTensor under FSDP2
            norm = norm.full_tensor()
        return float(norm)

    # -- state ----------------------------------------------------------------------------

    def _sd_options(self, *, loading: bool = False) -> StateDictOptions:
        return StateDictOptions(
            full_state_dict=True,
            cpu_offload=self.info.distributed and not loading,
            broadcast_from_rank0=self.info.distributed and loading,
        )

    def full_state(self) -> dict[str, Any]:
        model_sd = get_model_state_dict(self.model, options=self._sd_options())
        optim_sd = get_optimizer_state_dict(self.model, self.optimizer, options=self._sd_options())
        if not self.info.distributed:
            # Detach from the live tensors: the optimizer keeps mutating them in place.
            model_sd = {k: v.detach().cpu().clone() for k, v in model_sd.items()}
            optim_sd = copy.deepcopy(optim_sd)
        return {
            "model": model_sd,
            "optimizer": optim_sd,
            "scheduler": self.scheduler.state_dict(),
            "optimizer_steps": self._steps,
        }

    def load_full_state(self, state: dict[str, Any] | None) -> None:
        opts = self._sd_options(loading=True)
        empty: dict[str, Any] = {}
        set_model_state_dict(self.model, state["model"] if state else empty, options=opts)
        set_optimizer_state_dict(
            self.model, self.optimizer, state["optimizer"] if state else empty, options=opts
        )
        meta = [state["scheduler"], state["optimizer_steps"]] if state else [None, None]
        if self.info.distributed:
            dist.broadcast_object_list(meta, src=0)
        self.scheduler.load_state_dict(meta[0])
        self._steps = int(meta[1])

    def offload(self, parts: Sequence[str]) -> int:
        return self._move(parts, torch.device("cpu"))

    def reload(self, parts: Sequence[str]) -> int:
        return self._move(parts, self.device)

    def _move(self, parts: Sequence[str], device: torch.device) -> int:
        moved = 0
        if "optimizer" in parts:
            moved += move_optimizer_state(self.optimizer, device)
        if "reference" in parts:
            moved += move_module(self.ref_model, device)
        return moved

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        sd = get_model_state_dict(self.model, options=self._sd_options())
        if self.is_main:
            yield from sd.items()

    def export_hf(self, out_dir: Path) -> Path | None:

        sd = dict(self.named_tensors())
        if not self.is_main:
            return None
        inner = getattr(self.model, "module", self.model)
        return write_hf_dir(
            sd,
            inner.config,
            Path(out_dir),
            self.cfg.model.path,
            generation_config=getattr(inner, "generation_config", None),
        )


def load_hf_model(cfg: TrainerConfig) -> nn.Module:
    from transformers import AutoModelForCausalLM

    if not cfg.model.path:
        raise ValueError("trainer.model.path is not set")
    impl = cfg.model.attn_implementation
    return AutoModelForCausalLM.from_pretrained(
        cfg.model.path,
        dtype=torch.float32,
        # varlen is switched on by the backend (it registers the function first, and refuses
        # what varlen would ignore). Eager meanwhile: every model has it (Gemma2 has no sdpa).
        attn_implementation="eager" if impl == "varlen" else impl,
    )


def load_hf_backend(cfg: TrainerConfig, info: DistInfo) -> HFBackend:
    """Read the Hugging Face directory `trainer.model.path` and build the backend."""
    return HFBackend(load_hf_model(cfg), cfg, info)
