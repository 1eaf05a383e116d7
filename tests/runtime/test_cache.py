"""QuantizedKVCache on tiny random Llama, Qwen2 and Gemma 3 models."""

import pytest
import torch
from transformers import DynamicCache

from kvq.models.adapters import get_adapter
from kvq.quant.schemes import CachePolicy, LayerPolicy, QuantScheme, named_policy
from kvq.runtime.cache import QuantizedKVCache, build_cache
from kvq.runtime.kernels.decode.attention import decode_attention_reference
from kvq.runtime.reference import dense_attention
from tests.conftest import make_tiny_model

FAMILIES = ["llama", "qwen2", "gemma3"]


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
    return make_tiny_model(request.param)


def _cache(model, name="int8", **overrides) -> QuantizedKVCache:
    ad = get_adapter(model)
    policy = named_policy(name, ad.info.num_layers, ad.info.head_dim)
    if overrides:
        lp = LayerPolicy(**{**policy.layers[0].__dict__, **overrides})
        policy = CachePolicy(name="custom", layers=(lp,) * ad.info.num_layers)
    return build_cache(model, policy, {}, ad)


def _ids(n=20, b=1, seed=0):
    return torch.randint(3, 200, (b, n), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_full_precision_policy_matches_dynamic_cache(model):
    ids = _ids(24, b=2)
    want = model(ids, cache=DynamicCache(config=model.config)).logits
    cache = _cache(model, "fp16")
    # the pre-5.24 keyword still reaches the cache (transformers maps it to `cache`)
    got = model(ids, past_key_values=cache).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # and token-by-token decode after the prefill, past the sliding window
    full = torch.cat([ids, _ids(16, b=2, seed=1)], dim=1)
    ref = model(full).logits
    for t in range(24, full.shape[1]):
        step = model(full[:, t : t + 1], cache=cache).logits[:, -1]
        torch.testing.assert_close(step, ref[:, t], atol=1e-4, rtol=1e-4)
    assert cache.get_seq_length() == full.shape[1]


@torch.no_grad()
def test_pre_rope_storage_rotates_at_each_rows_position(model):
    # full-precision pre-RoPE storage is exact up to fp32 rounding of the rotation
    ids = _ids(20)
    ref = model(ids).logits
    cache = _cache(model, "fp16", key_stage="pre-rope")
    got = model(ids, cache=cache).logits
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    nxt = _ids(1, seed=3)
    step = model(nxt, cache=cache).logits[:, -1]
    torch.testing.assert_close(
        step, model(torch.cat([ids, nxt], 1)).logits[:, -1], atol=1e-4, rtol=1e-4
    )


@torch.no_grad()
def test_cache_stores_packed_codes_not_floats(model):
    cache = _cache(model, "int4")
    model(_ids(16), cache=cache)
    layer = cache.layers[0]
    stored = layer.state.main.buffers
    head_dim = get_adapter(model).info.head_dim
    assert stored["k.codes"].dtype == torch.uint8
    assert stored["k.codes"].shape[-1] == head_dim // 2  # two 4-bit codes per byte
    assert not any(t.is_floating_point() and t.shape[-1] == head_dim for t in stored.values())
    ledger = cache.nbytes()
    measured = sum(
        sum(layer.state.main.nbytes().values())
        + (layer.state.sink.nbytes() if layer.state.sink is not None else 0)
        for layer in cache.layers
    )
    assert ledger.total == measured
    assert ledger.ratio < 0.5


@torch.no_grad()
def test_quantized_attention_equals_reference_over_decoded_rows(model):
    """The chunked path over packed codes equals dense attention over the same decoded rows."""
    ad = get_adapter(model)
    cache = _cache(model, "int4")
    ids = _ids(12)
    model(ids, cache=cache)
    layer = cache.layers[-1]
    k, v = layer.decoded(layer.state)
    q = torch.randn(1, ad.info.num_q_heads, 1, ad.info.head_dim)
    mask = torch.ones(1, 1, 1, k.shape[2], dtype=torch.bool)
    want = dense_attention(q, k, v, mask, 0.3)
    segments = layer.segments(layer.state)
    got = decode_attention_reference(q, segments, scaling=0.3, rope=layer.rope(layer.state))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_int8_logits_close_to_unquantized(model):
    ids = _ids(24)
    ref = torch.log_softmax(model(ids).logits, -1)
    got = torch.log_softmax(model(ids, cache=_cache(model, "int8")).logits, -1)
    kl = (ref.exp() * (ref - got)).sum(-1).mean()
    assert kl < 1e-3
    assert (ref.argmax(-1) == got.argmax(-1)).float().mean() > 0.9


@torch.no_grad()
def test_failed_forward_publishes_nothing(model):
    """An append is visible in all layers at once or not at all (article 0x05)."""
    ad = get_adapter(model)
    cache = _cache(model, "int8")
    ids = _ids(10)
    model(ids, cache=cache)
    before = [layer.state for layer in cache.layers]
    seen = cache.get_seq_length()

    def boom(*_):
        raise RuntimeError("injected failure after layer 0 prepared")

    handle = ad.attention(ad.info.num_layers - 1).register_forward_pre_hook(boom)
    try:
        with pytest.raises(RuntimeError, match="injected"):
            model(_ids(3, seed=5), cache=cache)
    finally:
        handle.remove()
    assert cache.get_seq_length() == seen
    assert all(layer.state is st for layer, st in zip(cache.layers, before, strict=True))
    # the next forward discards the stale transaction and matches a clean cache
    nxt = _ids(3, seed=6)
    got = model(nxt, cache=cache).logits
    clean = _cache(model, "int8")
    model(ids, cache=clean)
    want = model(nxt, cache=clean).logits
    torch.testing.assert_close(got, want)
    assert cache.get_seq_length() == seen + 3


@torch.no_grad()
def test_sink_rows_stay_exact():
    model = make_tiny_model("llama")
    cache = _cache(model, "int4", sink_tokens=2)
    ids = _ids(9)
    model(ids, cache=cache)
    layer = cache.layers[0]
    # an unpadded batch's first two tokens are every sequence's sink: not encoded at all
    assert layer.state.lead == 2 and layer.state.main.length == 7 - 0
    assert layer.state.visible == 9 and layer.state.sink.filled.tolist() == [2]
    ref = DynamicCache(config=model.config)
    model(ids, cache=ref)
    # kept exactly as an fp16 cache keeps them (fp32 activations are stored in fp16)
    want = ref.layers[0].keys[:, :, :2].to(layer.sink_dtype)
    assert layer.state.sink.rows["k"].dtype == torch.float16
    assert torch.equal(layer.state.sink.rows["k"], want)
    assert cache.nbytes().sink > 0


@torch.no_grad()
def _decode_against_the_model(model, cache, tokens: int, atol: float) -> None:
    """Prefill 4 tokens into `cache`, then decode the rest of `tokens` one at a time; every
    step's logits match the model's own over the whole sequence."""
    full = _ids(tokens)
    ref = model(full).logits
    model(full[:, :4], cache=cache)
    for t in range(4, full.shape[1]):
        step = model(full[:, t : t + 1], cache=cache).logits[:, -1]
        torch.testing.assert_close(step, ref[:, t], atol=atol, rtol=atol)


@torch.no_grad()
def test_sliding_window_layers_evict_and_stay_correct():
    model = make_tiny_model("gemma3")
    window = get_adapter(model).sliding_window(0)
    cache = _cache(model, "fp16")
    _decode_against_the_model(model, cache, 4 * window + 3, atol=1e-4)
    sliding = [layer for layer in cache.layers if layer.is_sliding]
    assert sliding and all(layer.state.evicted > 0 for layer in sliding)
    assert all(layer.state.visible <= 2 * window for layer in sliding)
    assert not any(layer.state.evicted for layer in cache.layers if not layer.is_sliding)


@torch.no_grad()
def test_a_sliding_layer_past_its_window_reads_no_sink_rows():
    """Sinks a sliding layer evicted are skipped, not decoded and masked: its segments
    lose the sink slot, a global layer keeps it, and the logits stay the model's."""
    model = make_tiny_model("gemma3")
    window = get_adapter(model).sliding_window(0)
    cache = _cache(model, "fp16", key_stage="pre-rope", sink_tokens=1)
    # (the global layers' sink row is stored in float16)
    _decode_against_the_model(model, cache, 2 * window + 3, atol=1e-3)
    for layer in cache.layers:
        rows = [seg.rows for seg in layer.segments(layer.state)]
        if layer.is_sliding:  # the window's rows only: no sink slot left in front
            assert layer.live_sink(layer.state) is None and sum(rows) == layer.state.visible
        else:
            assert layer.live_sink(layer.state) is not None and rows[0] == 1


@torch.no_grad()
def test_generate_with_quantized_cache(model):
    ids = _ids(8)
    want = model.generate(ids, max_new_tokens=6, do_sample=False)
    got = model.generate(ids, cache=_cache(model, "fp16"), max_new_tokens=6, do_sample=False)
    assert torch.equal(got, want)
    out = model.generate(ids, cache=_cache(model, "int4"), max_new_tokens=6, do_sample=False)
    assert out.shape == want.shape


@torch.no_grad()
def test_reorder_and_crop_move_codes_and_positions_together():
    model = make_tiny_model("llama")
    cache = _cache(model, "int4")
    ids = torch.cat([_ids(6, seed=1), _ids(6, seed=2)])
    model(ids, cache=cache)
    before = cache.layers[0].state.main.rows()["k.codes"].clone()
    cache.reorder_cache(torch.tensor([1, 0]))
    after = cache.layers[0].state.main.rows()["k.codes"]
    assert torch.equal(after[0], before[1]) and torch.equal(after[1], before[0])
    cache.crop(-2)  # transformers 5: remove the last two tokens
    assert cache.get_seq_length() == 4
    assert cache.layers[0].state.main.length == 4
    cache.crop(0)  # removes nothing
    assert cache.get_seq_length() == 4
    with pytest.raises(ValueError, match="negative"):
        cache.crop(3)


def test_policy_layer_count_must_match_model():
    model = make_tiny_model("llama")
    ad = get_adapter(model)
    bad = named_policy("int8", ad.info.num_layers + 1)
    with pytest.raises(Exception, match="layers"):
        build_cache(model, bad, {}, ad)


def test_static_per_channel_scheme_needs_its_tensors():
    model = make_tiny_model("llama")
    ad = get_adapter(model)
    scheme = QuantScheme(format="int", bits=4, axis="channel", lifetime="static")
    lp = LayerPolicy(
        key=scheme, value=named_policy("int4", 1, 16).layers[0].value, key_stage="pre-rope"
    )
    policy = CachePolicy(name="x", layers=(lp,) * ad.info.num_layers)
    with pytest.raises(Exception, match=r"layers\.0\.key\.scale"):
        build_cache(model, policy, {}, ad)


@torch.no_grad()
def test_triton_backend_matches_reference_in_the_model(model, triton_decode_diffs):
    """Prefill, then single-token decode steps with the interpreted Triton kernel.

    Each kernel call is compared with the reference on the same inputs. (End-to-end logits
    are not compared at INT4: a 1e-7 difference upstream can flip a rounding decision of a
    later layer's codes, which is quantization, not a kernel error.)
    """
    diffs = triton_decode_diffs
    ids = _ids(14, b=2, seed=3)
    cache = _cache(model, "int4", key_stage="pre-rope", sink_tokens=1)
    cache.backend = "triton"
    model(ids[:, :10], cache=cache)
    for i in range(10, 14):
        model(ids[:, i : i + 1], cache=cache)
    assert len(diffs) >= 4 * len(cache.layers)
    assert max(diffs) < 2e-5


@torch.no_grad()
def test_triton_backend_full_precision_logits_match(model, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    ids = _ids(12, b=2, seed=4)
    logits = {}
    for backend in ("reference", "triton"):
        cache = _cache(model, "fp16")
        cache.backend = backend
        model(ids[:, :9], cache=cache)
        logits[backend] = torch.stack(
            [model(ids[:, i : i + 1], cache=cache).logits[:, -1] for i in range(9, 12)]
        )
    torch.testing.assert_close(logits["triton"], logits["reference"], atol=2e-5, rtol=1e-4)


@torch.no_grad()
def test_triton_backend_appends_the_same_codes(model, monkeypatch):
    """Rows quantized by the Triton append kernels are bit-identical to the torch encode.

    Only layer 0 is compared: its K/V do not depend on any attention output, so both runs
    feed it identical rows.
    """
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    ids = _ids(9, b=2, seed=5)
    stored = {}
    for backend in ("reference", "triton"):
        cache = _cache(model, "int4", key_stage="pre-rope", sink_tokens=1)
        cache.backend = backend
        model(ids[:, :7], cache=cache)
        model(ids[:, 7:8], cache=cache)
        stored[backend] = cache.layers[0].state.main.rows()
    assert stored["triton"].keys() == stored["reference"].keys()
    for name, t in stored["reference"].items():
        assert torch.equal(stored["triton"][name], t), name


@torch.no_grad()
def test_pre_rope_positions_past_the_context_are_refused_and_tables_stay_small():
    from kvq.errors import KvqError

    model = make_tiny_model("llama")  # context 256
    cache = _cache(model, "int4", key_stage="pre-rope")
    model(_ids(2), cache=cache)
    with pytest.raises(KvqError, match="past the model's context of 256"):
        model(_ids(1), position_ids=torch.tensor([[100_000]]), cache=cache)
    assert cache.get_seq_length() == 2  # nothing appended
    model(_ids(1), cache=cache)  # and the cache goes on
    assert cache.layers[0]._rope[0].shape[0] <= 256


@torch.no_grad()
@pytest.mark.parametrize("name", ["int8", "int4"])
def test_keys_and_values_encoded_together_store_the_same_rows(model, monkeypatch, name):
    """One encode of keys and values stacked along the batch (the per-token layouts: half
    a decode step's small ops) stores every layer's rows bit for bit as two encodes do."""
    from kvq.runtime.layers import KvqLayer

    ids = _ids(9, b=2, seed=6)
    stored, logits = {}, {}
    for together in (True, False):
        if not together:
            monkeypatch.setattr(KvqLayer, "_encoded_together", lambda *a: None)
        cache = _cache(model, name)
        model(ids[:, :7], cache=cache)
        logits[together] = model(ids[:, 7:8], cache=cache).logits
        stored[together] = [layer.state.main.rows() for layer in cache.layers]
    for a, b in zip(stored[True], stored[False], strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    assert torch.equal(logits[True], logits[False])
