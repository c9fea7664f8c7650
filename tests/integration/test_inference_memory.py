"""Release/resume of our engine's memory and weights handed over in memory, against a served
engine process over real HTTP (loopback): the colocated placement's cycle, step by step.

The SGLang twin of these calls is `test_handover_sglang.py` (`python3 dev.py sglang`).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import psutil
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import load_file

from engine_client.client import InferenceBadRequest, InferenceClient, InferenceUnavailable
from harness.inference_server import InferenceServerProcess
from inference.tiny_model import make_tiny_model
from searchr1.weightsync.handover import LOAD_FORMAT, Handover, HandoverSender, Packed

PROMPT = [1, 60, 61, 62]
TOKEN = "memory-admin-token"
SIZE = {"hidden_size": 384, "num_layers": 4}  # ~40 MB of float32 weights: an RSS drop shows


@pytest.fixture(scope="module")
def model0(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("m0"), seed=0, **SIZE)


@pytest.fixture(scope="module")
def model1(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("m1"), seed=1, **SIZE)


@pytest.fixture(scope="module")
def server(model0: Path) -> Iterator[InferenceServerProcess]:
    with InferenceServerProcess(model0, admin_token=TOKEN) as s:
        yield s


@pytest.fixture
async def client(server: InferenceServerProcess) -> AsyncIterator[InferenceClient]:
    # No retries: a 503 is the answer under test, not a reason to try again.
    c = InferenceClient(server.url, timeout_s=60, token=TOKEN, max_retries=0)
    yield c
    await c.aclose()


def metric(url: str, name: str, labels: str = "") -> float:
    """The sample `name{labels}` of the engine's /metrics (`labels`: 'a="x",b="y"')."""
    want = dict(kv.split("=", 1) for kv in labels.split(",")) if labels else {}
    want = {k: v.strip('"') for k, v in want.items()}
    text = httpx.get(f"{url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in want.items()):
                return float(sample.value)
    raise AssertionError(f"{name}{{{labels}}} not exported")


def teacher_forced(model_dir: Path, out_ids: list[int]) -> list[float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([PROMPT + out_ids])).logits[0].float(), -1)
    return [float(lp[len(PROMPT) - 1 + i, t]) for i, t in enumerate(out_ids)]


async def test_release_refuse_resume_handover_generate(
    client: InferenceClient, server: InferenceServerProcess, model0: Path, model1: Path
) -> None:
    assert server.proc is not None
    proc = psutil.Process(server.proc.pid)
    before = await client.generate(PROMPT, max_new_tokens=12, temperature=0)
    v0 = (await client.get_model_info())["weight_version"]
    weight_bytes = metric(server.url, "searchr1_inference_parameter_bytes")
    assert weight_bytes > 30e6

    rss_before = proc.memory_info().rss
    await client.release_memory_occupation()  # no tags: all of them, as in SGLang
    rss_released = proc.memory_info().rss
    assert metric(server.url, "searchr1_inference_parameter_bytes") == 0
    for tag in ("weights", "kv_cache", "cuda_graph"):
        assert metric(server.url, "searchr1_inference_memory_released", f'tag="{tag}"') == 1
    # Measured, not assumed: the process gave most of the weights' bytes back to the OS.
    assert rss_before - rss_released > 0.7 * weight_bytes, (rss_before, rss_released)

    ready = httpx.get(f"{server.url}/ready", timeout=10).json()
    assert ready["ready"] and "released" in ready["checks"]["model"]["detail"]
    with pytest.raises(InferenceUnavailable, match=r"503.*resume_memory_occupation"):
        await client.generate(PROMPT, max_new_tokens=4)
    health = httpx.get(f"{server.url}/health_generate", timeout=10)
    assert health.status_code == 503

    # Weights back without content (SGLang's behaviour): generation waits for an update.
    await client.resume_memory_occupation(["weights"])
    await client.resume_memory_occupation(["kv_cache", "cuda_graph"])
    assert metric(server.url, "searchr1_inference_awaiting_weights") == 1
    with pytest.raises(InferenceUnavailable, match=r"503.*weight update"):
        await client.generate(PROMPT, max_new_tokens=4)

    sender = HandoverSender([client], bucket_bytes=8 << 20)  # several buckets
    stats = await sender.push(load_file(str(model1 / "model.safetensors")).items())
    assert stats.weight_version == v0 + 1 and stats.bytes == weight_bytes

    after = await client.generate(PROMPT, max_new_tokens=12, temperature=0)
    assert after.weight_version == v0 + 1
    assert after.output_ids != before.output_ids
    ref = teacher_forced(model1, after.output_ids)  # exactly the seed-1 model now
    assert max(abs(a - b) for a, b in zip(ref, after.logprobs, strict=True)) < 1e-4
    assert metric(server.url, "searchr1_inference_awaiting_weights") == 0
    assert metric(server.url, "searchr1_inference_parameter_bytes") == weight_bytes

    # Handing the original back (no release this time) restores the original outputs.
    stats = await sender.push(load_file(str(model0 / "model.safetensors")).items())
    restored = await client.generate(PROMPT, max_new_tokens=12, temperature=0)
    assert restored.output_ids == before.output_ids and restored.weight_version == v0 + 2


async def raw(url: str, path: str, body: object, token: str | None = TOKEN) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with httpx.AsyncClient(base_url=url, timeout=30) as h:
        return await h.post(path, json=body, headers=headers)


async def test_bad_input_is_4xx_and_nothing_changes(
    client: InferenceClient, server: InferenceServerProcess, model1: Path
) -> None:
    url = server.url
    before = await client.generate(PROMPT, max_new_tokens=8, temperature=0)
    for path in ("/release_memory_occupation", "/resume_memory_occupation"):
        assert (await raw(url, path, {}, token=None)).status_code == 401
    assert (await raw(url, "/update_weights_from_tensor", {}, token=None)).status_code == 401

    r = await raw(url, "/release_memory_occupation", {"tags": ["gpu"]})
    assert r.status_code == 400 and "tags" in r.json()["message"]
    r = await raw(url, "/resume_memory_occupation", {"tags": ["weights"]})
    assert r.status_code == 400 and "not released" in r.json()["message"]

    # SGLang's own format (a pickle) is refused, naming load_format, before anything is read.
    for fmt in (None, "direct", "flattened_bucket"):
        body = {"serialized_named_tensors": ["gASVAAAAAAAAAAA="], "load_format": fmt}
        r = await raw(url, "/update_weights_from_tensor", body)
        assert r.status_code == 400 and "load_format" in r.json()["message"], r.text
        assert "never unpickles" in r.json()["message"]

    tensors = load_file(str(model1 / "model.safetensors"))
    name = next(iter(tensors))
    good = Packed([(name, tensors[name])], torch.device("cpu"))
    try:
        body = {"serialized_named_tensors": [good.describe()], "load_format": LOAD_FORMAT}
        r = await raw(url, "/update_weights_from_tensor", body)  # outside a session
        assert r.status_code == 400 and "begin_weight_update" in r.json()["message"]

        spec = json.loads(good.describe())
        missing = "searchr1_ho_" + "0" * 16
        cases = {
            "not json": "{",
            "unknown segment": {**spec, "buffer": {**spec["buffer"], "name": missing}},
            "foreign name": {**spec, "buffer": {**spec["buffer"], "name": "../etc/passwd"}},
            "out of bounds": {**spec, "tensors": [{**spec["tensors"][0], "offset": 1 << 40}]},
            "unknown param": {**spec, "tensors": [{**spec["tensors"][0], "name": "nope"}]},
            "wrong shape": {**spec, "tensors": [{**spec["tensors"][0], "shape": [3]}]},
        }  # fmt: skip
        assert await client.begin_weight_update()
        for case, desc in cases.items():
            text = desc if isinstance(desc, str) else json.dumps(desc)
            body = {"serialized_named_tensors": [text], "load_format": LOAD_FORMAT}
            r = await raw(url, "/update_weights_from_tensor", body)
            assert r.status_code == 400, (case, r.text)
        with pytest.raises(InferenceBadRequest, match="rejected"):
            await client.end_weight_update()  # the session's refusals apply nothing
        Handover.model_validate_json(good.describe())  # the good one was valid all along
    finally:
        good.close()

    # Weight updates into released weights are refused, not written into freed storage.
    await client.release_memory_occupation(["weights"])
    try:
        r = await raw(url, "/release_memory_occupation", {"tags": ["weights"]})
        assert r.status_code == 400 and "already released" in r.json()["message"]
        r = await raw(url, "/update_weights_from_disk", {"model_path": str(model1)})
        assert r.status_code == 400 and "released" in r.json()["message"]
    finally:
        await client.resume_memory_occupation(["weights"])
    await client.update_weights_from_disk(str(server.model_dir))  # content back
    after = await client.generate(PROMPT, max_new_tokens=8, temperature=0)
    assert after.output_ids == before.output_ids


def test_cpu_backup_restores_weights_without_an_update(model0: Path) -> None:
    env = {"SEARCHR1_INFERENCE__TORCH_ENGINE__WEIGHTS_CPU_BACKUP": "true"}
    with InferenceServerProcess(model0, admin_token=TOKEN, env=env) as s:
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
        h = {"Authorization": f"Bearer {TOKEN}"}
        before = httpx.post(f"{s.url}/generate", json=body, timeout=60).json()["output_ids"]
        for path in ("/release_memory_occupation", "/resume_memory_occupation"):
            assert httpx.post(f"{s.url}{path}", json={}, headers=h, timeout=60).status_code == 200
        after = httpx.post(f"{s.url}/generate", json=body, timeout=60).json()["output_ids"]
        assert after == before


async def test_handover_sends_in_the_engine_dtype(model0: Path, model1: Path) -> None:
    env = {"SEARCHR1_INFERENCE__TORCH_ENGINE__DTYPE": "bfloat16"}
    with InferenceServerProcess(model0, admin_token=TOKEN, env=env) as s:
        async with InferenceClient(s.url, token=TOKEN, max_retries=0) as c:
            tensors = load_file(str(model1 / "model.safetensors"))
            fp32_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
            stats = await HandoverSender([c]).push(tensors.items())
            assert stats.bytes * 2 == fp32_bytes  # cast to bfloat16 before the copy
            out = await c.generate(PROMPT, max_new_tokens=4, temperature=0)
            assert out.weight_version == stats.weight_version == 1


async def test_refusals_are_counted(
    client: InferenceClient, server: InferenceServerProcess
) -> None:
    counters = {
        "tensor": ("searchr1_inference_weight_updates_total", 'source="tensor",outcome="rejected"'),
        "release": ("searchr1_inference_memory_calls_total", 'call="release",outcome="rejected"'),
        "generate": ("searchr1_inference_rejected_total", 'reason="memory_released"'),
    }
    before = {k: metric(server.url, *v) for k, v in counters.items()}
    body = {"serialized_named_tensors": ["gASVAAAAAAAAAAA="]}
    assert (await raw(server.url, "/update_weights_from_tensor", body)).status_code == 400
    r = await raw(server.url, "/release_memory_occupation", {"tags": ["gpu"]})
    assert r.status_code == 400
    await client.release_memory_occupation(["kv_cache"])
    try:
        with pytest.raises(InferenceUnavailable):
            await client.generate(PROMPT, max_new_tokens=2)
    finally:
        await client.resume_memory_occupation(["kv_cache"])
    after = {k: metric(server.url, *v) for k, v in counters.items()}
    assert {k: after[k] - before[k] for k in counters} == {k: 1 for k in counters}
