"""Write a plain Hugging Face directory (config, safetensors, tokenizer) from full tensors."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch


def write_hf_dir(
    tensors: dict[str, torch.Tensor],
    hf_config: Any,
    out_dir: Path,
    source: str | None,
    generation_config: Any = None,
) -> Path:
    """Atomic: written next to `out_dir`, then renamed. Files of `source` other than weights
    (tokenizer, chat template, generation config) are copied along."""
    from safetensors.torch import save_file

    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    hf_config.save_pretrained(tmp)
    if generation_config is not None:
        generation_config.save_pretrained(tmp)
    # Clones: a tied lm_head shares storage with the embedding, which safetensors refuses.
    out = {k: v.detach().to("cpu", torch.float32).contiguous().clone() for k, v in tensors.items()}
    if getattr(hf_config, "tie_word_embeddings", False):
        out.pop("lm_head.weight", None)
    save_file(out, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    if source:
        for f in Path(source).iterdir():
            if (
                f.is_file()
                and f.suffix not in (".safetensors", ".bin")
                and not (tmp / f.name).exists()
            ):
                shutil.copy2(f, tmp / f.name)
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir
