"""Build a tiny Qwen2 causal LM and a byte-level BPE tokenizer offline (no hub access).

Tests, benchmarks and the local demo need a real Hugging Face model directory that
`AutoModelForCausalLM` / `AutoTokenizer.from_pretrained(dir)` load, but nothing may be downloaded.
The weights are random (seeded), fp32; the tokenizer is trained with `tokenizers` on a small
built-in text that contains the Search-R1 tags, so they tokenize into few tokens (they stay
ordinary text, not special tokens, exactly as with the real Qwen tokenizers).

Product code, not a test fixture: shipped commands build it (`searchr1 inference
make-tiny-model`, and the offline demo, `searchr1 demo` and the task demo, in the CPU images
too), and product code may not import `harness/`. The engine itself does not import it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
SEARCH_R1_TAGS = [
    "<think>",
    "</think>",
    "<search>",
    "</search>",
    "<information>",
    "</information>",
    "<answer>",
    "</answer>",
]

# The ChatML template of the Qwen2.5 family, without the tool-calling branches.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Qwen2's pre-tokenizer split pattern. transformers 5 rebuilds the pre-tokenizer of a `qwen2`
# model's tokenizer with exactly this pattern on load, so training with it keeps the saved
# tokenizer.json and the loaded tokenizer identical. Tags split as with the real Qwen
# tokenizers (`<think` `>`, `</` `think` `>`): ordinary text, few tokens.
_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_BASE_TEXT = [
    "Answer the given question. You must conduct reasoning inside <think> and </think> first "
    "every time you get new information. After reasoning, if you find you lack some knowledge, "
    "you can call a search engine by <search> query </search> and it will return the top "
    "searched results between <information> and </information>. You can search as many times "
    "as your want. If you find no further external knowledge needed, you can directly provide "
    "the answer inside <answer> and </answer>, without detailed illustrations. For example, "
    "<answer> Beijing </answer>. Question: who wrote the declaration of independence?\n",
    "<think> I need to find who wrote it. </think>\n<search> declaration of independence "
    'author </search>\n\n<information>Doc 1(Title: "Declaration") Thomas Jefferson wrote the '
    "draft.\n</information>\n\n<think> It was Thomas Jefferson. </think>\n<answer> Thomas "
    "Jefferson </answer>",
    "My previous action is invalid. If I want to search, I should put the query between "
    "<search> and </search>. If I want to give the final answer, I should put the answer "
    "between <answer> and </answer>. Let me try again.",
    "The quick brown fox jumps over the lazy dog. What is the capital of France? Paris is the "
    "capital and most populous city of France. The Eiffel Tower is in Paris. Who is the "
    "president? When was it founded? Where is the river? How many people live there? "
    "0 1 2 3 4 5 6 7 8 9 10 100 1000 2018 1999 January February March April May June July",
]


_SYLLABLES = [
    "ka",
    "ri",
    "mo",
    "ten",
    "sa",
    "lo",
    "ve",
    "du",
    "pin",
    "gar",
    "el",
    "or",
    "an",
    "is",
    "bro",
    "ne",
    "mi",
    "tur",
    "qua",
    "zo",
    "hal",
    "wen",
    "ster",
    "fi",
    "ly",
    "ton",
    "berg",
]


def default_corpus(seed: int = 0) -> list[str]:
    """The built-in training text: instructions, tags, plain English, and made-up names.

    The made-up words (deterministic) give BPE enough distinct merges for a ~2k vocabulary.
    """
    import random

    rng = random.Random(seed)
    words = ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(6000)]
    names = [" ".join(words[i : i + 12]).capitalize() + "." for i in range(0, len(words), 12)]
    return _BASE_TEXT * 4 + [" ".join(SEARCH_R1_TAGS)] * 20 + names


def _train_tokenizer(texts: Iterable[str], vocab_size: int):  # type: ignore[no-untyped-def]
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    split = pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated")
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer)
    return tok


def qwen2_config(
    *,
    vocab_size: int,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 4096,
    tie_word_embeddings: bool = False,
    **extra: Any,
) -> Any:
    """A small Qwen2 configuration (MLP 4x wide unless given): the demo's model, test and
    benchmark models."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or hidden_size * 4,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        **extra,
    )


def make_tiny_model(
    out_dir: Path,
    *,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    vocab_corpus: Iterable[str] | None = None,
    vocab_size: int = 2048,
    max_position_embeddings: int = 4096,
    lm_head_std: float = 0.3,
    tie_word_embeddings: bool = False,
) -> Path:
    """Write a tiny Qwen2 model + tokenizer to `out_dir` (created) and return it."""
    import torch
    from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    texts = list(vocab_corpus) if vocab_corpus is not None else default_corpus()
    raw = _train_tokenizer(texts, vocab_size)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        model_max_length=max_position_embeddings,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out_dir)

    heads = max(1, hidden_size // 16)
    config = qwen2_config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=max(1, heads // 2),
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.float32)
    # The default init (std 0.02) gives near-uniform next-token distributions. A larger output
    # projection (untied) gives logits of std ~2-3: peaked but not saturated, so sampling,
    # logprobs and greedy outputs all depend visibly on the weights (tests need that).
    # Models that will be trained (the demo) tie the embeddings and keep the default init:
    # tied, copying a token from the context is one attention step for any token.
    if not tie_word_embeddings:
        with torch.no_grad():
            model.model.embed_tokens.weight.normal_(0.0, 1.0)
            model.lm_head.weight.normal_(0.0, lm_head_std)
    model.save_pretrained(out_dir, safe_serialization=True)
    # Like Qwen2.5's instruct models: both <|im_end|> and <|endoftext|> end a generation.
    _write_generation_config(
        out_dir, [config.eos_token_id, config.pad_token_id], config.pad_token_id
    )
    return out_dir


def _write_generation_config(out_dir: Path, eos: list[int], pad: int) -> None:
    # Our engines read stop tokens from here; keep it explicit and minimal.
    path = out_dir / "generation_config.json"
    cfg = json.loads(path.read_text()) if path.exists() else {}
    cfg.update({"eos_token_id": eos, "pad_token_id": pad})
    path.write_text(json.dumps(cfg, indent=2) + "\n")
