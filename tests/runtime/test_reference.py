"""The chunked online-softmax reference equals plain softmax attention (the oracle)."""

import pytest
import torch

from kvq.runtime.kernels.decode.attention import Segment, decode_attention_reference
from kvq.runtime.packed import PackedRows
from kvq.runtime.reference import dense_attention


def _full(key, value):
    d = key.shape[-1]
    return [Segment(PackedRows("full", d, key), PackedRows("full", d, value))]


@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("chunk", [1, 3, 16, 64])
def test_chunked_equals_dense(hq, hkv, chunk):
    g = torch.Generator().manual_seed(hq * 10 + hkv + chunk)
    b, q, kv, d = 2, 5, 37, 16
    query = torch.randn(b, hq, q, d, generator=g)
    key = torch.randn(b, hkv, kv, d, generator=g) * 3
    value = torch.randn(b, hkv, kv, d, generator=g)
    mask = torch.rand(b, 1, q, kv, generator=g) > 0.3
    mask[..., 0] = True  # every query sees at least one key
    want = dense_attention(query, key, value, mask, 0.25)
    got = decode_attention_reference(
        query, _full(key, value), scaling=0.25, mask=mask, chunk_rows=chunk
    )
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_fully_masked_chunk_then_visible_keys():
    # a query whose first chunks are all masked must not produce NaN
    query = torch.randn(1, 2, 1, 8)
    key, value = torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8)
    mask = torch.zeros(1, 1, 1, 10, dtype=torch.bool)
    mask[..., 7:] = True
    got = decode_attention_reference(query, _full(key, value), scaling=1.0, mask=mask, chunk_rows=4)
    want = dense_attention(query, key, value, mask, 1.0)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_per_head_mask_broadcasts_over_gqa_groups():
    query = torch.randn(1, 4, 3, 8)
    key, value = torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    mask = torch.rand(1, 4, 3, 6) > 0.4
    mask[..., 0] = True
    got = decode_attention_reference(query, _full(key, value), scaling=0.5, mask=mask, chunk_rows=2)
    want = dense_attention(query, key, value, mask, 0.5)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
