"""KIVI: per-channel key groups of G tokens, per-token values, an exact residual window."""

from __future__ import annotations

import pytest
import torch

from kvq.errors import KvqError
from kvq.eval.inputs import check_cache_source
from kvq.models.adapters import get_adapter
from kvq.quant import affine
from kvq.quant.schemes import named_policy
from kvq.runtime.cache import build_cache
from kvq.runtime.kernels.decode_attention import decode_attention_reference
from kvq.runtime.kivi import KiviKeyCodec
from kvq.runtime.packed import decode_packed
from kvq.runtime.reference import dense_attention
from tests.conftest import make_tiny_model


def test_policy_names_carry_bits_group_and_window():
    p = named_policy("kivi2", 4, 128)
    lp = p.layers[0]
    assert (lp.key.bits, lp.key.axis, lp.key.group_size, lp.residual_tokens) == (
        2,
        "channel",
        32,
        128,
    )
    assert (lp.value.axis, lp.value.group_size) == ("token", 32)
    lp = named_policy("kivi4-g64-r256", 4, 128).layers[0]
    assert (lp.key.bits, lp.key.group_size, lp.residual_tokens) == (4, 64, 256)
    for bad in ("kivi3", "kivi2-x4", "kivi2-g0", "kivi4-r"):
        with pytest.raises(KvqError):
            check_cache_source(None, bad, None)
    check_cache_source(None, "kivi2-g16", None)


def test_key_codes_use_one_scale_per_channel_per_group():
    scheme = named_policy("kivi2-g4", 1, 16).layers[0].key
    codec = KiviKeyCodec(scheme, head_dim=16)
    x = torch.randn(2, 3, 8, 16) * torch.linspace(0.1, 5.0, 16)  # channels of growing range
    rows, _ = codec.encode(x)
    assert rows["codes"].dtype == torch.uint8 and rows["codes"].shape == (2, 3, 8, 4)
    assert rows["scale"].shape == (2, 3, 8, 4)  # a group's 16 scales over its 4 rows
    got = decode_packed(codec.packed(rows, {}))
    groups = x.reshape(2, 3, 2, 4, 16)
    codes, scale, offset = affine.quantize_affine(groups, 2, -2, torch.float16)
    want = affine.affine_decode(codes, scale, offset).reshape(2, 3, 8, 16)
    assert torch.equal(got, want)
    with pytest.raises(KvqError, match="whole groups"):
        codec.encode(x[:, :, :6])


def _kivi_cache(model, name):
    ad = get_adapter(model)
    return build_cache(model, named_policy(name, ad.info.num_layers, ad.info.head_dim), {}, ad)


@torch.no_grad()
def test_whole_groups_are_encoded_and_the_window_stays_exact():
    from transformers import DynamicCache

    model = make_tiny_model("llama")
    ids = torch.randint(3, 300, (2, 23), generator=torch.Generator().manual_seed(0))
    cache = _kivi_cache(model, "kivi2-g4-r6")
    model(ids, cache=cache)
    ref = DynamicCache(config=model.config)
    model(ids, cache=ref)
    st = cache.layers[0].state
    assert st.main.length == 16 and st.residual.length == 7 and st.visible == 23  # 6 <= 7 < 10
    exact = ref.layers[0].keys[:, :, 16:].to(torch.float16)
    assert torch.equal(st.residual.rows()["k"], exact)
    ledger = cache.nbytes()
    assert ledger.codes > 0 and ledger.residual > 0 and ledger.qparams > 0
    for _ in range(3):  # the window fills to R + G - 1, then a group is encoded
        model(torch.randint(3, 300, (2, 1)), cache=cache)
    assert cache.layers[0].state.main.length == 20 and cache.layers[0].state.residual.length == 6


@torch.no_grad()
def test_a_prefill_gives_every_position_what_token_by_token_decoding_gives():
    for family in ("llama", "gemma3"):  # gemma: past twice its sliding window of 8
        model = make_tiny_model(family)
        ids = torch.randint(3, 300, (1, 22), generator=torch.Generator().manual_seed(1))
        whole = model(ids, cache=_kivi_cache(model, "kivi4-g4-r6")).logits
        cache = _kivi_cache(model, "kivi4-g4-r6")
        steps = torch.cat([model(ids[:, t : t + 1], cache=cache).logits for t in range(22)], 1)
        torch.testing.assert_close(whole, steps, atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_attention_reads_encoded_history_and_exact_window_in_one_softmax():
    model = make_tiny_model("qwen2")
    ad = get_adapter(model)
    cache = _kivi_cache(model, "kivi2-g4-r6")
    model(torch.randint(3, 300, (1, 19)), cache=cache)
    layer = cache.layers[-1]
    k, v = layer.decoded(layer.state)
    assert k.shape[2] == layer.state.visible  # encoded rows, then the window: no row twice
    q = torch.randn(1, ad.info.num_q_heads, 1, ad.info.head_dim)
    want = dense_attention(q, k, v, torch.ones(1, 1, 1, k.shape[2], dtype=torch.bool), 0.25)
    got = decode_attention_reference(q, layer.segments(layer.state), scaling=0.25)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
