"""The colocated cycle through one client and one sender, against our engine and (under
`-m sglang`, `python3 dev.py sglang -k test_handover`) a real SGLang 0.5.21 on CPU: release
memory with SGLang's tags, resume it, hand the weights over in memory
(`/update_weights_from_tensor`, each engine in the format it accepts), generate with them.

Where SGLang's CPU build differs, the test records what it does (asserted, so a new SGLang that
changes it shows up here).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from engine_client.client import InferenceBadRequest, InferenceClient, InferenceUnavailable
from searchr1.weightsync.handover import LOAD_FORMAT, HandoverSender, Packed, sglang_serialized
from tests.support.engines import ENGINES, Target, engine_server

PROMPT = [1, 60, 61, 62]
TOKEN = "handover-admin-token"


@pytest.fixture(scope="module", params=ENGINES)
def server(request: pytest.FixtureRequest, tiny_model_dir: Path) -> Iterator[Target]:
    with engine_server(request.param, tiny_model_dir, admin_token=TOKEN) as t:
        yield t


@pytest.fixture
async def client(server: Target) -> AsyncIterator[InferenceClient]:
    c = InferenceClient(server.url, timeout_s=120, token=TOKEN, max_retries=0)
    yield c
    await c.aclose()


def teacher_forced(model_dir: Path, out_ids: list[int]) -> list[float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([PROMPT + out_ids])).logits[0].float(), -1)
    return [float(lp[len(PROMPT) - 1 + i, t]) for i, t in enumerate(out_ids)]


def sender_for(server: Target, client: InferenceClient) -> HandoverSender:
    return HandoverSender([client], format="sglang" if server.is_sglang else "searchr1")


async def test_release_resume_then_handover_generates_with_new_weights(
    client: InferenceClient, server: Target, tiny_model_dir: Path, seed1_dir: Path
) -> None:
    before = await client.generate(PROMPT, max_new_tokens=12, temperature=0)
    v0 = (await client.get_model_info())["weight_version"]

    await client.release_memory_occupation(["kv_cache", "weights"])
    if server.is_sglang:
        # SGLang's CPU build runs without torch_memory_saver (CUDA only): release and resume
        # are accepted and free nothing, so it keeps generating with the old weights.
        out = await client.generate(PROMPT, max_new_tokens=12, temperature=0)
        assert out.output_ids == before.output_ids
    else:
        with pytest.raises(InferenceUnavailable, match="503"):
            await client.generate(PROMPT, max_new_tokens=4)
    await client.resume_memory_occupation(["kv_cache", "weights"])

    stats = await sender_for(server, client).push(
        load_file(str(seed1_dir / "model.safetensors")).items()
    )
    assert stats.weight_version == v0 + 1
    after = await client.generate(PROMPT, max_new_tokens=12, temperature=0)
    assert after.weight_version == v0 + 1 and after.output_ids != before.output_ids
    ref = teacher_forced(seed1_dir, after.output_ids)
    assert max(abs(a - b) for a, b in zip(ref, after.logprobs, strict=True)) < 1e-4

    # Back to the original weights (no release): the original outputs again.
    stats = await sender_for(server, client).push(
        load_file(str(tiny_model_dir / "model.safetensors")).items()
    )
    restored = await client.generate(PROMPT, max_new_tokens=12, temperature=0)
    assert restored.output_ids == before.output_ids and restored.weight_version == v0 + 2


async def test_each_engine_refuses_the_others_format(
    client: InferenceClient, server: Target, tiny_model_dir: Path
) -> None:
    tensors = load_file(str(tiny_model_dir / "model.safetensors"))
    name = next(iter(tensors))
    packed = Packed([(name, tensors[name])], torch.device("cpu"))
    try:
        if server.is_sglang:
            body = {"serialized_named_tensors": [packed.describe()], "load_format": LOAD_FORMAT}
        else:
            body = {"serialized_named_tensors": sglang_serialized([(name, tensors[name])])}
        assert await client.begin_weight_update()
        try:
            async with httpx.AsyncClient(base_url=server.url, timeout=120) as h:
                r = await h.post(
                    "/update_weights_from_tensor", json=body,
                    headers={"Authorization": f"Bearer {TOKEN}"},
                )  # fmt: skip
        finally:
            # Ours answers 400 here: the session saw a refusal and applies nothing.
            with contextlib.suppress(InferenceBadRequest):
                await client.end_weight_update()
    finally:
        packed.close()
    assert r.status_code == 400, r.text
    message = json.loads(r.text)["message"]
    if server.is_sglang:
        # SGLang reads every entry as a base64 pickle: our JSON description fails its schema.
        assert "serialized_named_tensors" in message, message
        assert "Expected base64-encoded bytes" in message, message
    else:
        assert "load_format" in message and "never unpickles" in message
    # Either way the engine still serves.
    assert (await client.generate(PROMPT, max_new_tokens=2, temperature=0)).output_ids


class StateDictBackend:
    """What WeightPusher reads of a trainer backend: the main rank's named tensors."""

    is_main = True

    def __init__(self, model_dir: Path) -> None:
        self.state = load_file(str(model_dir / "model.safetensors"))

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.state.items()


async def test_trainer_colocated_cycle_release_train_hand_over_resume(
    client: InferenceClient, server: Target, tiny_model_dir: Path, seed1_dir: Path
) -> None:
    """The trainer's side of colocation (trainer.weight_push: handover, release while training):
    release before a step, then the push resumes the weights, hands them over, resumes the KV
    cache and lets generation continue. Our engine: a restarted trainer (a new pusher) resumes
    what its predecessor released. A push with nothing released never resumes on SGLang, which
    drops the connection and dies on a needless resume (seen with 0.5.21 on CPU)."""
    from trainer.config import WeightPushConfig
    from trainer.weights import WeightPusher

    cfg = WeightPushConfig(
        mode="handover",
        engine_urls=[server.url],
        handover_format="sglang" if server.is_sglang else "searchr1",
        release_engines_while_training=True,
    )
    pusher = WeightPusher(cfg, token=TOKEN)
    before = await client.generate(PROMPT, max_new_tokens=12, temperature=0)
    v0 = (await client.get_model_info())["weight_version"]

    assert await pusher.release_engines() >= 0
    if not server.is_sglang:  # SGLang's CPU build frees nothing (see the test above)
        with pytest.raises(InferenceUnavailable, match="503"):
            await client.generate(PROMPT, max_new_tokens=4)
        pusher = WeightPusher(cfg, token=TOKEN)  # the trainer crashed and restarted
    result = await pusher.push(StateDictBackend(seed1_dir), v0 + 1)
    assert result is not None and result.weight_version == v0 + 1
    after = await client.generate(PROMPT, max_new_tokens=12, temperature=0)
    assert after.weight_version == v0 + 1 and after.output_ids != before.output_ids

    # Nothing released now: the next push goes on (our engine: "not released" is fine).
    result = await WeightPusher(cfg, token=TOKEN).push(StateDictBackend(tiny_model_dir), v0 + 2)
    assert result is not None and result.weight_version == v0 + 2
    restored = await client.generate(PROMPT, max_new_tokens=12, temperature=0)
    assert restored.output_ids == before.output_ids
