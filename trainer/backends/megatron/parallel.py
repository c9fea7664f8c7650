"""Process groups (TP x PP x DP) and the model inputs of one packed micro-batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainer.backends.megatron.config import MegatronConfig
from trainer.batching import MicroBatch
from trainer.dist import DistInfo


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1


def init_parallel(cfg: MegatronConfig, info: DistInfo, seed: int) -> Layout:
    """Megatron's process groups over the already joined default group (one process: a
    one-rank gloo group, Megatron needs one)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    if not dist.is_initialized():
        import os

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        backend = "nccl" if info.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, rank=info.rank, world_size=info.world_size)
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(
            tensor_model_parallel_size=cfg.tp, pipeline_model_parallel_size=cfg.pp
        )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return Layout(
        tp=cfg.tp,
        pp=cfg.pp,
        dp=ps.get_data_parallel_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
    )


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def segment_lengths(mb: MicroBatch) -> torch.Tensor:
    """`[B, S]` int64 on the CPU: the lengths of each row's sequences, zero-padded. A packed row
    has its sequences (`cu_seqlens`); a right-padded row is one causal sequence (a real token
    never sees the padding after it; the padding's own outputs are never read)."""
    b, n = mb.input_ids.shape
    if mb.cu_seqlens is None:
        return torch.full((b, 1), n, dtype=torch.int64)
    lengths = (mb.cu_seqlens[1:] - mb.cu_seqlens[:-1]).to("cpu", torch.int64)
    rest = n - int(lengths.sum())
    if rest:  # tokens after the last sequence: their own segment, never attended to
        lengths = torch.cat([lengths, torch.tensor([rest])])
    return lengths[None].expand(b, -1)


def kept_rows(logits: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
    """`[B, L, V_local]` -> `[T, V_local]`: the row predicting each response token."""
    pos = mb.keep_positions[mb.row_keep].to(logits.device)
    return logits[mb.row_batch.to(logits.device), pos]
