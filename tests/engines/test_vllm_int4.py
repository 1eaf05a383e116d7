"""vLLM's int4_per_token_head K/V cache (`vllm:int4_per_token_head`): the encoder against a
hand-worked row and a step-by-step float32 transcription of vLLM's kernel, the decode's
cleared scale, the cache through generate, the Triton refusal by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvq.engines.formats import engine_policy
from kvq.errors import KvqError
from kvq.quant import packing, vllm_int4
from kvq.runtime.codecs import make_codec
from tests.engines.helpers import generate_through


def test_a_hand_worked_row():
    """r = (-1, 0.5, 2, 0): scale 3/15, z = rhaz(5) = 5, r / scale + z = (0, 7.5, 15, 5)
    -> codes (0, 8, 15, 5) (7.5 rounds away from zero), bytes 0x80 0x5F (element 2j in
    the low nibble, as vLLM packs), word = bits(0.2f) with z in its low 4 bits."""
    codes, word = vllm_int4.quantize_rotated(torch.tensor([[-1.0, 0.5, 2.0, 0.0]]))
    assert codes.tolist() == [[0, 8, 15, 5]]
    assert packing.pack_bits(codes, 4).tolist() == [[0x80, 0x5F]]
    bits = int(word.view(torch.int32))
    assert bits & 0xF == 5 and bits & ~0xF == int(torch.tensor(0.2).view(torch.int32)) & ~0xF
    scale, z = vllm_int4.unpack_word(word)
    assert z.item() == 5 and scale.item() < 0.2  # the decoder's scale: z's bits cleared


def _butterfly_np(x: np.ndarray) -> np.ndarray:
    """vLLM's float32 fallback Hadamard, element by element: strides 1, 2, 4, ..."""
    y = x.astype(np.float32).copy()
    d, h = y.shape[-1], 1
    while h < d:
        for j in range(0, d, 2 * h):
            a, b = y[..., j : j + h].copy(), y[..., j + h : j + 2 * h].copy()
            y[..., j : j + h], y[..., j + h : j + 2 * h] = a + b, a - b
        h *= 2
    return y


def _encode_np(x: np.ndarray, signs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's float32 steps on rotated rows, then the scale word."""
    f = np.float32
    r = _butterfly_np(x * signs)
    lo, hi = r.min(-1, keepdims=True), r.max(-1, keepdims=True)
    scale = np.maximum((hi - lo) / f(15), f(1e-6)).astype(f)

    def rhaz(t):
        return np.where(t >= 0, np.trunc(t + f(0.5)), np.trunc(t - f(0.5))).astype(f)

    z = np.clip(rhaz(-lo / scale), 0, 15)
    q = np.clip(rhaz(r * (f(1) / scale) + z), 0, 15).astype(np.uint8)
    word = (scale.view(np.int32) & ~np.int32(0xF)) | z.astype(np.int32)
    return q, word


def test_the_encoder_matches_a_float32_transcription():
    g = torch.Generator().manual_seed(0)
    rows = [
        torch.randn(64, 64, generator=g),
        torch.randn(64, 64, generator=g) * 30 + 5,  # every rotated value far from zero
        torch.randint(-4, 5, (64, 64), generator=g).float() / 4,  # ties at .5 steps
        torch.zeros(2, 64),  # the scale floor: codes z, z = 0
    ]
    x = torch.cat(rows)
    codes, word = vllm_int4.quantize(x, torch.float32)
    q, ref = _encode_np(x.numpy(), vllm_int4.signs(64).numpy())
    assert np.array_equal(codes.numpy(), q)
    assert np.array_equal(word.view(torch.int32).numpy(), ref)
    assert set(np.unique(ref[-2:] & 0xF)) == {0}


def test_rotation_and_decode():
    d = 128
    s = vllm_int4.signs(d)
    assert set(s.tolist()) == {-1.0, 1.0} and torch.equal(s, vllm_int4.signs(d))
    x = torch.randn(8, d, generator=torch.Generator().manual_seed(1))
    r = vllm_int4.rotate(x, torch.float32)
    torch.testing.assert_close(r @ vllm_int4.unrotation(d), x, rtol=0, atol=1e-5)
    codes, word = vllm_int4.quantize(x, torch.float32)
    scale, z = vllm_int4.unpack_word(word)
    expected = ((codes.float() - z) * scale) @ vllm_int4.unrotation(d)
    assert torch.equal(vllm_int4.dequantize(codes, word), expected)
    err = (vllm_int4.dequantize(codes, word) - x).norm() / x.norm()
    assert 0.02 < err < 0.2  # 4-bit min/max of near-Gaussian rotated rows
    # rounding to the model's dtype first: bf16 rows give other codes than float32
    assert not torch.equal(vllm_int4.quantize(x, torch.bfloat16)[0], codes)


def test_the_cache_runs_through_generate_and_stores_4_bits_and_a_word(tiny_model_dir):
    model, cache = generate_through(tiny_model_dir("gemma3"), "vllm:int4_per_token_head")
    ledger, head_dim = cache.nbytes(), model.config.head_dim
    assert ledger.total / ledger.fp16_bytes == pytest.approx((4 + 32 / head_dim) / 16)


def test_rotated_rows_decode_on_the_reference_and_triton_refuses_them_by_name():
    from kvq.runtime.kernels.decode.attention import decode_attention, decode_path
    from kvq.runtime.kernels.decode.segments import Segment

    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(1, 2, 40, 64, generator=g) for _ in range(2))  # [B, H_kv, T, D]
    q = torch.randn(1, 4, 1, 64, generator=g)  # [B, H_q, Q, D]
    scheme = engine_policy("vllm:int4_per_token_head", 1, 64).layers[0].key
    codec = make_codec(scheme, 64, torch.float32, {}, "k")
    seg = Segment(*(codec.packed(*codec.encode(x)) for x in (k, v)))
    path = decode_path(q, [seg], None, backend="auto", device="cuda")
    assert path.kernel == "reference" and "rotated rows" in path.reason
    with pytest.raises(KvqError, match="rotated rows"):
        decode_attention(q, [seg], scaling=0.125, backend="triton")
    # the reference attends to the un-rotated rows
    k2, v2 = (codec.decode(*codec.encode(x)) for x in (k, v))
    expected = torch.softmax(q @ k2.repeat_interleave(2, 1).transpose(-1, -2) * 0.125, -1)
    expected = expected @ v2.repeat_interleave(2, 1)
    got = decode_attention(q, [seg], scaling=0.125, backend="reference")
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk_rows", [None, 16])  # one SDPA call; the online softmax
@pytest.mark.parametrize("sink", [False, True])  # a full-precision segment before them
def test_rotated_rows_attend_with_the_query_and_output_turned(chunk_rows, sink):
    """The reference turns the query and the output once instead of every row: the same
    attention as over the decoded (un-rotated) rows, alone or beside unrotated rows."""
    from kvq.runtime.kernels.decode.reference import decode_attention_reference
    from kvq.runtime.kernels.decode.segments import Segment
    from kvq.runtime.packed import PackedRows

    g = torch.Generator().manual_seed(2)
    k, v = (torch.randn(2, 2, 40, 64, generator=g) for _ in range(2))  # [B, H_kv, T, D]
    q = torch.randn(2, 4, 3, 64, generator=g)  # [B, H_q, Q, D]: three query positions
    scheme = engine_policy("vllm:int4_per_token_head", 1, 64).layers[0].key
    codec = make_codec(scheme, 64, torch.float32, {}, "k")
    segments = [Segment(*(codec.packed(*codec.encode(x)) for x in (k, v)))]
    keys, values = [codec.decode(*codec.encode(x)) for x in (k, v)]
    if sink:
        s_k, s_v = (torch.randn(2, 2, 4, 64, generator=g) for _ in range(2))
        segments.insert(0, Segment(PackedRows("full", 64, s_k), PackedRows("full", 64, s_v)))
        keys, values = torch.cat([s_k, keys], 2), torch.cat([s_v, values], 2)
    mask = torch.rand(2, 1, 3, keys.shape[2], generator=g) > 0.3  # [B, 1, Q, K]
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, keys, values, attn_mask=mask, scale=0.125, enable_gqa=True
    )
    got = decode_attention_reference(q, segments, scaling=0.125, mask=mask, chunk_rows=chunk_rows)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk_rows", [None, 16])
def test_rotated_rows_turned_by_rope_afterwards_decode_turned(chunk_rows):
    """A rotation followed by RoPE at each row's position does not commute with the query:
    such rows decode turned, then rotated to their positions."""
    from dataclasses import replace

    from kvq.runtime.kernels.decode.reference import decode_attention_reference
    from kvq.runtime.kernels.decode.segments import Segment, rotate
    from kvq.runtime.packed import decode_packed

    g = torch.Generator().manual_seed(3)
    k, v = (torch.randn(1, 1, 24, 64, generator=g) for _ in range(2))  # [B, H_kv, T, D]
    q = torch.randn(1, 2, 1, 64, generator=g)  # [B, H_q, Q, D]
    scheme = engine_policy("vllm:int4_per_token_head", 1, 64).layers[0].key
    codec = make_codec(scheme, 64, torch.float32, {}, "k")
    key, value = (codec.packed(*codec.encode(x)) for x in (k, v))
    key = replace(key, pre_rope=True)
    angle = torch.arange(32)[:, None] * 0.3 ** torch.arange(32.0)  # [P, D/2]
    rope, positions = (angle.cos(), angle.sin()), torch.arange(24)[None]  # positions [B, T]
    keys = rotate(decode_packed(key), positions, rope)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, keys, decode_packed(value), scale=0.125, enable_gqa=True
    )
    seg = Segment(key, value, positions)
    got = decode_attention_reference(q, [seg], scaling=0.125, rope=rope, chunk_rows=chunk_rows)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_a_head_dim_that_is_not_a_power_of_two_is_refused():
    with pytest.raises(KvqError, match="power-of-two head_dim, not 96"):
        engine_policy("vllm:int4_per_token_head", 2, 96)
