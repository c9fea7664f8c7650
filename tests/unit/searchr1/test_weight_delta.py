"""The delta codec (searchr1/weightsync/delta.py): every encoding restores the new tensor bit for
bit, the choice follows the encoded size, and corrupt payloads are refused."""

from __future__ import annotations

import pytest
import torch
import zstandard

from searchr1.weightsync.delta import (
    EncodedTensor,
    Encoding,
    apply_in_place,
    bits,
    decode,
    encode,
    state_checksum,
)


def identical(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def nudged(t: torch.Tensor, share: float, seed: int = 0) -> torch.Tensor:
    """`t` with `share` of its elements moved by one unit in the last place."""
    g = torch.Generator().manual_seed(seed)
    out = t.clone()
    flat = bits(out)
    mask = torch.rand(flat.numel(), generator=g) < share
    flat[mask] += 1
    return out


@pytest.fixture(params=[torch.bfloat16, torch.float32, torch.float16])
def dtype(request: pytest.FixtureRequest) -> torch.dtype:
    return request.param


def weights(dtype: torch.dtype, shape: tuple[int, ...] = (256, 64), seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 0.02).to(dtype)


def roundtrip(prev: torch.Tensor | None, new: torch.Tensor) -> EncodedTensor:
    enc = encode(prev, new)
    assert identical(decode(prev, enc), new)
    if prev is not None and enc.encoding != Encoding.FULL:
        target = prev.clone()
        apply_in_place(target, enc)
        assert identical(target, new)
    return enc


def test_unchanged_tensor_is_same_and_empty(dtype: torch.dtype) -> None:
    w = weights(dtype)
    enc = roundtrip(w, w.clone())
    assert enc.encoding == Encoding.SAME and enc.nbytes == 0


def test_very_few_changes_go_sparse_and_tiny(dtype: torch.dtype) -> None:
    w = weights(dtype, (1024, 1024))
    enc = roundtrip(w, nudged(w, 1e-5))
    assert enc.encoding == Encoding.SPARSE_ZSTD
    assert enc.nbytes < 400


def test_some_changes_go_xor(dtype: torch.dtype) -> None:
    w = weights(dtype, (512, 128))
    enc = roundtrip(w, nudged(w, 0.2))
    assert enc.encoding == Encoding.XOR_ZSTD
    assert enc.nbytes < w.numel() * w.element_size() / 2


def test_every_element_changed_goes_full(dtype: torch.dtype) -> None:
    w = weights(dtype)
    noise = torch.randint(0, 256, (w.numel() * w.element_size(),), dtype=torch.uint8)
    enc = roundtrip(w, noise.view(dtype).reshape(w.shape))  # random bits: nothing to gain
    assert enc.encoding == Encoding.FULL
    assert enc.nbytes == w.numel() * w.element_size()


@pytest.mark.parametrize(
    "prev",
    [None, weights(torch.bfloat16, (255, 64)), weights(torch.float32)],
    ids=["no-prev", "shape-change", "dtype-change"],
)
def test_no_comparable_prev_goes_full(prev: torch.Tensor | None) -> None:
    new = weights(torch.bfloat16)
    assert roundtrip(prev, new).encoding == Encoding.FULL


def test_adamw_step_at_lr_1e6_shrinks_bf16_by_far_more_than_4x() -> None:
    """What the whole feature rests on: fp32 master weights, one real AdamW step at slime's
    learning rate, compared after rounding to the engines' bf16."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(512, 512)
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-6)
    for _ in range(2):
        before = layer.weight.detach().to(torch.bfloat16)
        layer(torch.randn(32, 512)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        after = layer.weight.detach().to(torch.bfloat16)
        changed = int(torch.count_nonzero(bits(before) ^ bits(after))) / after.numel()
        assert 0 < changed < 0.2
        enc = roundtrip(before, after)
        assert enc.nbytes * 4 < after.numel() * 2


def test_special_values_and_other_dtypes_roundtrip() -> None:
    w = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40, 3.0])
    new = w.clone()
    new[1], new[4] = 0.0, float("-nan")  # differ in bits only
    enc = roundtrip(w, new)
    assert enc.encoding != Encoding.SAME
    for t in (torch.arange(100, dtype=torch.int64), torch.arange(100) % 3 == 0):
        changed = t.clone()
        changed[7] = changed[8]
        roundtrip(t, changed)
    roundtrip(None, torch.zeros(0, 4))
    roundtrip(torch.zeros(()), torch.ones(()))


@pytest.mark.parametrize(
    "encoding",
    [Encoding.FULL, Encoding.XOR_ZSTD, Encoding.SPARSE_ZSTD, Encoding.SAME],
)
def test_corrupt_payloads_are_refused_and_change_nothing(encoding: Encoding) -> None:
    w = weights(torch.bfloat16, (1024, 1024))
    target = w.clone()
    good = encode(w, nudged(w, 1e-5 if encoding == Encoding.SPARSE_ZSTD else 0.2))
    if encoding in (Encoding.FULL, Encoding.SAME):
        good = EncodedTensor(encoding, torch.zeros(27, dtype=torch.uint8), w.dtype, tuple(w.shape))
    else:
        assert good.encoding == encoding
    bad = [
        EncodedTensor(encoding, good.payload[:-16], good.dtype, good.shape),
        EncodedTensor(encoding, good.payload, good.dtype, (3, 3)),
    ]
    for enc in bad:
        with pytest.raises(ValueError):
            apply_in_place(target, enc)
    assert identical(target, w)


def test_a_frame_claiming_more_than_the_tensor_is_refused_before_decompressing() -> None:
    w = weights(torch.bfloat16, (4, 4))
    bomb = zstandard.ZstdCompressor().compress(bytes(1 << 20))
    enc = EncodedTensor(
        Encoding.XOR_ZSTD, torch.frombuffer(bytearray(bomb), dtype=torch.uint8), w.dtype, (4, 4)
    )
    with pytest.raises(ValueError, match="declares"):
        apply_in_place(w.clone(), enc)


def test_sparse_indices_out_of_range_are_refused() -> None:
    w = weights(torch.bfloat16, (4, 4))
    body = torch.cat(
        [torch.tensor([17], dtype=torch.int32).view(torch.uint8), bits(w)[:1].view(torch.uint8)]
    )
    enc = EncodedTensor(
        Encoding.SPARSE_ZSTD,
        torch.frombuffer(
            bytearray(zstandard.ZstdCompressor().compress(body.numpy())), dtype=torch.uint8
        ),
        w.dtype,
        (4, 4),
    )
    with pytest.raises(ValueError, match="out of"):
        apply_in_place(w.clone(), enc)


def test_payload_at_an_odd_offset_decodes() -> None:
    """A payload cut out of a bucket's one buffer may start anywhere."""
    w = weights(torch.float32, (8, 8))
    new = weights(torch.float32, (8, 8), seed=3)
    enc = encode(w, new)
    blob = torch.cat([torch.zeros(3, dtype=torch.uint8), enc.payload])
    moved = EncodedTensor(enc.encoding, blob[3:], enc.dtype, enc.shape)
    assert identical(decode(w, moved), new)


def test_state_checksum_is_exact_and_order_free() -> None:
    a, b = weights(torch.bfloat16), weights(torch.bfloat16, seed=1)
    base = state_checksum([("a", a), ("b", b)])
    assert base == state_checksum([("b", b.clone()), ("a", a.clone())])
    assert base != state_checksum([("a", nudged(a, 1e-4, seed=5)), ("b", b)])
    assert base != state_checksum([("a", b), ("b", a)])  # names bound to their tensors
    assert base != state_checksum([("a", a.float()), ("b", b)])
    assert base != state_checksum([("a", a.reshape(64, 256)), ("b", b)])


@pytest.mark.parametrize("share", [0.0, 1e-5, 0.2, 1.0])
def test_apply_in_place_returns_its_undo(share: float) -> None:
    w = weights(torch.bfloat16, (1024, 1024))
    new = nudged(w, share) if share < 1 else weights(torch.bfloat16, (1024, 1024), seed=9)
    target = w.clone()
    undo = apply_in_place(target, encode(w, new))
    assert identical(target, new)
    undo()
    assert identical(target, w)


def test_corruption_found_after_chunks_were_applied_is_undone() -> None:
    """A flipped byte mid-payload surfaces at the frame's checksum, after several chunks of
    the XOR went into the target: all of them are taken back."""
    w = weights(torch.float32, (2048, 1024))  # 8 MB: two chunks and more
    enc = encode(w, nudged(w, 0.05))
    assert enc.encoding == Encoding.XOR_ZSTD
    payload = enc.payload.clone()
    payload[payload.numel() // 2] ^= 0x10
    target = w.clone()
    with pytest.raises(ValueError, match="corrupt"):
        apply_in_place(target, EncodedTensor(enc.encoding, payload, enc.dtype, enc.shape))
    assert identical(target, w)


def test_encode_can_reuse_the_previous_buffer() -> None:
    w = weights(torch.bfloat16, (512, 512))
    new = nudged(w, 0.05)
    expected = encode(w, new)
    scratch = w.clone()
    got = encode(scratch, new, consume_prev=True)
    assert got.encoding == expected.encoding and torch.equal(got.payload, expected.payload)
    assert identical(decode(w, got), new)


def test_a_full_payload_swapped_in_is_undone_by_swapping_back() -> None:
    w = weights(torch.float32, (1500, 1024))  # 6 MB: more than one chunk
    new = weights(torch.float32, (1500, 1024), seed=2)
    enc = encode(None, new.clone())
    target = w.clone()
    undo = apply_in_place(target, enc, swap=True)
    assert identical(target, new)
    assert torch.equal(enc.payload, w.reshape(-1).view(torch.uint8))  # it holds the old bytes
    undo()
    assert identical(target, w)
