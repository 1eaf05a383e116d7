"""llama.cpp's iq4_nl K/V cache (`llamacpp:iq4_nl`): the CUDA store's encoder against a
float32 transcription of its source, the gguf package's decoder on the same bytes, the
runtime codec on the reference decode (Triton refuses per-block lookup scales)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvq.engines.formats import engine_policy, parse
from kvq.errors import KvqError
from kvq.quant import ggml_blocks
from kvq.runtime.codecs import make_codec

LEVELS = ggml_blocks.IQ4_NL_LEVELS


def _best_index(x: np.float32) -> int:
    """best_index_int8(16, kvalues_iq4nl, x), as written in ggml-cuda/cpy-utils.cuh."""
    if x <= LEVELS[0]:
        return 0
    if x >= LEVELS[-1]:
        return len(LEVELS) - 1
    lo, hi = 0, len(LEVELS) - 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if x < LEVELS[mid]:
            hi = mid
        else:
            lo = mid
    return hi - 1 if x - np.float32(LEVELS[hi - 1]) < np.float32(LEVELS[hi]) - x else hi


def _block(x: np.ndarray) -> tuple[list[int], np.float16]:
    """quantize_f32_iq4_nl_block on one block of 32 float32 values, step by step."""
    f = np.float32
    amax, vmax = f(0), f(0)
    for v in x:
        if amax < abs(v):
            amax, vmax = abs(v), v
    d = f(vmax / f(LEVELS[0]))
    inv = f(f(1) / d) if d else f(0)
    q = [_best_index(f(v * inv)) for v in x]
    sumqx, sumq2 = f(0), f(0)
    for j in range(16):
        x0, x1 = x[j], x[16 + j]
        v0, v1 = f(LEVELS[q[j]]), f(LEVELS[q[16 + j]])
        w0, w1 = f(x0 * x0), f(x1 * x1)
        sumqx = f(sumqx + f(f(f(w0 * v0) * x0) + f(f(w1 * v1) * x1)))
        sumq2 = f(sumq2 + f(f(f(w0 * v0) * v0) + f(f(w1 * v1) * v1)))
    return q, np.float16(f(sumqx / sumq2) if sumq2 > 0 else d)


def _rows() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 128, generator=g) * torch.rand(96, 1, generator=g) * 4
    x[0, :32] = 0.0  # an all-zero block: d = 0, every code the level nearest 0
    x[1, :32] = torch.tensor([-127.0, -115.5, -93.5, 101.0] * 8)  # d0 = 1: ties between levels
    x[2, :32] = torch.tensor([3.0, -3.0] * 16)  # equal magnitudes, the first one's sign
    return x


def test_iq4_nl_codes_match_the_cuda_store_transcription():
    x = _rows()
    codes, d, m = ggml_blocks.quantize(x, "iq4_nl")
    assert m is None
    blocks = x.numpy().reshape(-1, 32)
    for i, block in enumerate(blocks):  # 384 blocks, 12,288 codes
        q, scale = _block(block)
        assert codes.reshape(-1, 32)[i].tolist() == q, i
        assert d.reshape(-1)[i].numpy().view(np.uint16) == scale.view(np.uint16), i
    assert codes[1, :4].tolist() == [0, 1, 2, 15]  # ties go to the upper level


def test_iq4_nl_decodes_as_the_gguf_package():
    gguf = pytest.importorskip("gguf")
    from tests.engines.test_formats import _ggml_bytes

    x = _rows()
    codes, d, m = ggml_blocks.quantize(x, "iq4_nl")
    stored = _ggml_bytes(codes, d, m, "iq4_nl").reshape(x.shape[0], -1)  # [rows, 18 x 4]
    theirs = gguf.quants.dequantize(stored, gguf.GGMLQuantizationType.IQ4_NL)
    assert np.array_equal(ggml_blocks.dequantize(codes, d, m, "iq4_nl").numpy(), theirs)


def test_iq4_nl_runs_in_the_cache():
    from kvq.runtime.kernels.decode.attention import decode_attention
    from kvq.runtime.kernels.decode.segments import Segment

    fmt = parse("llamacpp:q8_0/iq4_nl")
    assert fmt.flags() == "-ctk q8_0 -ctv iq4_nl -fa on" and fmt.value.bits == 4.5
    scheme = engine_policy("llamacpp:iq4_nl", 1, 64).layers[0].value
    codec = make_codec(scheme, 64, torch.float32, {}, "layers.0.value")
    g = torch.Generator().manual_seed(1)
    k, v = (torch.randn(2, 2, 40, 64, generator=g) for _ in range(2))  # [B, H_kv, T, D]
    rows, flat = codec.encode(v)
    assert torch.equal(codec.decode(rows, flat), ggml_blocks.dequantize(
        *ggml_blocks.quantize(v, "iq4_nl"), "iq4_nl"))  # fmt: skip
    q = torch.randn(2, 4, 3, 64, generator=g)  # [B, H_q, Q, D]
    seg = Segment(codec.packed(*codec.encode(k)), codec.packed(rows, flat))
    out = decode_attention(q, [seg], scaling=0.125, backend="reference")
    assert out.shape == (2, 4, 3, 64) and torch.isfinite(out).all()
    # per-block lookup scales have no Triton decode yet: refused by name, not misread
    with pytest.raises(KvqError, match="iq4_nl\\) decode on the reference only"):
        decode_attention(q, [seg], scaling=0.125, backend="triton")
