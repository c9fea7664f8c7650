"""The offline tiny model: loadable by transformers, ChatML, Search-R1 tags round-trip."""

from __future__ import annotations

from pathlib import Path

import torch

from inference.tiny_model import SEARCH_R1_TAGS


def test_loads_with_auto_classes(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert 1500 <= len(tok) <= 2048
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert model.dtype == torch.float32
    assert model.config.vocab_size == len(tok)
    assert (tiny_model_dir / "model.safetensors").exists()


def test_chat_template_and_tags(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Question: who?"}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<|im_start|>user\nQuestion: who?<|im_end|>\n<|im_start|>assistant\n"
    for tag in SEARCH_R1_TAGS:
        ids = tok.encode(tag, add_special_tokens=False)
        assert len(ids) <= 3, (tag, tok.convert_ids_to_tokens(ids))
        assert tok.decode(ids) == tag
    # Tags are ordinary text, not special tokens: skip_special_tokens keeps them.
    ids = tok.encode("<search> capital of France </search>", add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=True) == "<search> capital of France </search>"


def test_distribution_peaked_but_not_saturated(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        probs = model(torch.tensor([[5, 6, 7, 8]])).logits.softmax(-1)
    top = probs.max(-1).values
    assert bool((top > 5.0 / 2048).all()) and bool((top < 0.99).all())
