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
from kvq.runtime.codecs.kivi import KiviKeyCodec
from kvq.runtime.kernels.decode.attention import decode_attention_reference
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


def _padded(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(r.numel() for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - r.numel() :], mask[i, width - r.numel() :] = r, 1
    return ids, mask


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def kivi_model(request, tiny_model_dir):
    import kvq

    model, _ = kvq.load_model(str(tiny_model_dir(request.param)))
    return model


@torch.no_grad()
@pytest.mark.parametrize("policy", ["kivi4-g4-r6", "kivi4-g8-r8"])
def test_each_sequence_of_a_padded_batch_decodes_as_it_would_alone(kivi_model, policy):
    """Padding of 0..G-1 tokens (every group phase) and a sequence shorter than a group:
    each sequence's groups start at its own first token, so its logits are its own."""
    import kvq

    gen = torch.Generator().manual_seed(5)
    rows = [torch.randint(3, 300, (n,), generator=gen) for n in (17, 16, 14, 11, 3)]
    ids, mask = _padded(rows)
    kw = dict(max_new_tokens=14, do_sample=False, pad_token_id=0, output_logits=True)
    kw |= dict(return_dict_in_generate=True)
    cache = kvq.make_cache(kivi_model, policy=policy)
    out = kivi_model.generate(ids, attention_mask=mask, cache=cache, **kw)
    assert cache.layers[0].state.phase is not None  # the pads do shift the groups
    for i, r in enumerate(rows):
        alone = kivi_model.generate(r[None], cache=kvq.make_cache(kivi_model, policy=policy), **kw)
        for step, logits in enumerate(alone.logits):
            torch.testing.assert_close(out.logits[step][i], logits[0], atol=2e-3, rtol=1e-5)


@torch.no_grad()
def test_a_padded_batch_survives_reorder_save_load_and_rollback(kivi_model, tmp_path):
    import kvq

    policy = "kivi4-g4-r6"
    gen = torch.Generator().manual_seed(6)
    ids, mask = _padded([torch.randint(3, 300, (n,), generator=gen) for n in (15, 13, 10)])
    steps = torch.randint(3, 300, (3, 12), generator=gen)

    def run(cache, start, stop, m):
        logits = []
        for t in range(start, stop):
            m = torch.cat([m, torch.ones(3, 1, dtype=m.dtype)], 1)
            logits.append(kivi_model(steps[:, t : t + 1], attention_mask=m, cache=cache).logits)
        return torch.cat(logits, 1), m

    ref = kvq.make_cache(kivi_model, policy=policy)
    kivi_model(ids, attention_mask=mask, cache=ref)
    want, _ = run(ref, 0, 12, mask)

    cache = kvq.make_cache(kivi_model, policy=policy)
    kivi_model(ids, attention_mask=mask, cache=cache)
    first, m = run(cache, 0, 5, mask)
    order = torch.tensor([2, 0, 1])
    cache.reorder_cache(order)
    cache.reorder_cache(torch.argsort(order))  # and back: phases moved with their rows
    cache.save(tmp_path / "state.safetensors")
    loaded = kvq.load_cache(tmp_path / "state.safetensors", kivi_model, policy=policy)
    for layer in loaded.layers:
        layer.activate_past_recording()
    run(loaded, 5, 9, m)  # drafted, then rolled back: as if never appended
    loaded.crop(-4)
    rest, _ = run(loaded, 5, 12, m)
    # fp32 rounding apart (the rolled-back rows sit in other segments: 3.2e-5 on a Xeon)
    torch.testing.assert_close(torch.cat([first, rest], 1), want, atol=5e-5, rtol=1e-5)


def test_a_channel_nearly_constant_over_a_group_is_stored_not_refused():
    scheme = named_policy("kivi4-g4", 1, 16).layers[0].key
    codec = KiviKeyCodec(scheme, 16)
    x = torch.randn(1, 1, 4, 16)
    x[..., 3] = 0.5 + torch.tensor([0.0, 1e-4, 2e-4, 3e-4])[None, None]  # range 3e-4
    rows, _ = codec.encode(x)
    back = decode_packed(codec.packed(rows, {}))
    assert (back[..., 3] - x[..., 3]).abs().max() <= 6.2e-5  # half the smallest fp16 step
