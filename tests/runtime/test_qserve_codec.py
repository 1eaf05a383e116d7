"""QServe's KV4 layout: the codec, its append kernel and the `kv4-qserve` policy."""

from __future__ import annotations

import pytest
import torch

from kvq.errors import KvqError
from kvq.models.adapters import get_adapter
from kvq.quant import affine, packing
from kvq.quant.schemes import QSERVE_KV4, QuantScheme, named_policy
from kvq.runtime.cache import build_cache
from kvq.runtime.codecs import make_codec
from kvq.runtime.codecs.integer import QServeTokenCodec
from kvq.runtime.packed import decode_packed
from tests.conftest import make_tiny_model


def _rows(b=2, h=3, t=7, d=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, h, t, d, generator=g) * torch.linspace(0.2, 4.0, d)
    x[0, 1, 2] = torch.linspace(1.0, 2.0, d)  # positive-only: zero-point about -15
    x[1, 0, 3] = 0.5  # a constant row
    return x


def test_scheme_admits_a_floating_zero_point_only_for_qservess_layout():
    assert QSERVE_KV4.describe() == "int4 asym zero-point per-token (dynamic)"
    for bad in (dict(bits=8), dict(group_size=16), dict(symmetric=True), dict(format="nuq")):
        with pytest.raises(KvqError, match="QServe's layout only"):
            QuantScheme(**{"format": "int", "bits": 4, "zero_point": True, **bad})


def test_named_policy_keeps_the_first_token_exact_post_rope():
    policy = named_policy("kv4-qserve", 3, 64)
    assert {(lp.key, lp.value, lp.key_stage, lp.sink_tokens) for lp in policy.layers} == {
        (QSERVE_KV4, QSERVE_KV4, "post-rope", 1)
    }
    assert named_policy("int4", 3, 64).layers[0].sink_tokens == 0  # others unchanged


def test_codec_encodes_and_decodes_with_the_shared_quantizer():
    x = _rows()
    codec = make_codec(QSERVE_KV4, 32, torch.float32, {}, "layers.0.key")
    assert isinstance(codec, QServeTokenCodec)
    rows, flat = codec.encode(x)
    codes, scale, zp = affine.quantize_qserve(x, -1)
    assert not flat and rows["scale"].shape == rows["zero_point"].shape == (2, 3, 7)
    assert rows["scale"].dtype == rows["zero_point"].dtype == torch.float16
    assert torch.equal(packing.unpack_bits(rows["codes"], 4, 32), codes)
    decoded = decode_packed(codec.packed(rows, flat))
    assert torch.equal(decoded, affine.qserve_decode(codes, scale, zp))
    # the positive-only row keeps its range: the zero-point is not clamped to [0, 15]
    assert rows["zero_point"][0, 1, 2] < -14
    torch.testing.assert_close(decoded[0, 1, 2], x[0, 1, 2], atol=0.04, rtol=0)
    torch.testing.assert_close(decoded[1, 0, 3], x[1, 0, 3])  # constant row: exact


def test_append_kernel_writes_the_bytes_encode_makes():
    """The Triton append kernel (interpreted on CPU) into the codec's row layout."""
    x = _rows(seed=1)
    codec = QServeTokenCodec(32)
    rows, _ = codec.encode(x)
    spec = codec.row_spec(x)
    start, cap = 5, 16
    buffers = {n: torch.zeros(2, 3, cap, *shape, dtype=dtype) for n, (shape, dtype) in spec.items()}
    codec.append_into(x, buffers, start)
    for n, r in rows.items():
        assert torch.equal(buffers[n][:, :, start : start + 7], r), n


@torch.no_grad()
def test_cache_reference_and_triton_agree_and_store_four_bit_rows():
    model = make_tiny_model("llama")
    ad = get_adapter(model)
    policy = named_policy("kv4-qserve", ad.info.num_layers, ad.info.head_dim)
    ids = torch.randint(3, 200, (2, 20), generator=torch.Generator().manual_seed(0))
    ref = model(ids).logits
    logits = {}
    for backend in ("reference", "triton"):
        cache = build_cache(model, policy, {}, ad, backend)
        prefill = model(ids[:, :12], cache=cache).logits
        steps = [model(ids[:, t : t + 1], cache=cache).logits for t in range(12, 20)]
        logits[backend] = torch.cat([prefill, *steps], dim=1)
        ledger = cache.nbytes()
        # per stored (layer, batch, head, side): 19 rows of D/2 code bytes + 2 fp16 qparams
        rows = ad.info.num_layers * 2 * ad.info.num_kv_heads * 2 * 19
        assert ledger.codes == rows * ad.info.head_dim // 2 and ledger.qparams == rows * 4
        assert ledger.sink > 0  # the first token, exact
    torch.testing.assert_close(logits["triton"], logits["reference"], atol=1e-5, rtol=1e-5)
    assert (logits["reference"] - ref).abs().max() < 0.05 * ref.abs().max()
