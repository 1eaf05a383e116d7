"""Declared prefix rows: seeded exactly, positioned before each sequence's first real token,
never re-quantized, counted, and kept through every generation path."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache

from kvq.calibrators.prefix_state import extract_prefix
from kvq.errors import KvqError
from kvq.models.loading import load_model
from kvq.quant.schemes import FULL_PRECISION, CachePolicy, LayerPolicy, named_policy
from kvq.runtime.cache import build_cache, unit_scales

PREFIX = (2, 17, 45)  # BOS and two ordinary tokens


@pytest.fixture(scope="module")
def loaded_for(tiny_model_dir):
    built = {}

    def get(family):
        if family not in built:
            built[family] = load_model(str(tiny_model_dir(family)))
        return built[family]

    return get


def _cache(loaded, layout="fp16", prefix=PREFIX):
    info = loaded.adapter.info
    if layout == "pre-rope-full":
        lp = LayerPolicy(FULL_PRECISION, FULL_PRECISION, key_stage="pre-rope")
        policy = CachePolicy("full-pre-rope", (lp,) * info.num_layers)
    else:
        policy = named_policy(layout, info.num_layers, info.head_dim)
    rows = None if prefix is None else extract_prefix(loaded, prefix, "test")
    if rows is not None:
        policy = policy.with_prefix(rows.spec)
    return build_cache(loaded.model, policy, unit_scales(policy), loaded.adapter, prefix=rows)


def _ids(n, seed=0, b=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 300, (b, n), generator=g)


def _served(ids):
    return torch.cat([torch.tensor([PREFIX]).expand(ids.shape[0], -1), ids], dim=1)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("layout", ["fp16", "pre-rope-full"])
@torch.no_grad()
def test_logits_after_the_prefix_match_a_plain_forward_over_prefix_and_prompt(
    loaded_for, family, layout
):
    loaded = loaded_for(family)
    model = loaded.model
    ids = _ids(20)  # past twice Gemma's window of 8: the prefix leaves the sliding window
    want = model(_served(ids)).logits[:, len(PREFIX) :]
    cache = _cache(loaded, layout)
    got = model(ids, cache=cache).logits
    # the prefix rows are kept as an fp16 cache keeps them: fp16 rounding, nothing more
    torch.testing.assert_close(got, want, atol=5e-4, rtol=1e-3)
    without = model(ids, cache=_cache(loaded, layout, prefix=None)).logits
    assert (without - want).abs().max() > 20 * (got - want).abs().max()  # the prefix matters
    # decode: the same positions one token at a time
    cache = _cache(loaded, layout)
    model(ids[:, :9], cache=cache)
    steps = torch.cat([model(ids[:, t : t + 1], cache=cache).logits for t in range(9, 20)], 1)
    torch.testing.assert_close(steps, want[:, 9:], atol=5e-4, rtol=1e-3)
    assert cache.get_seq_length() == 20  # transformers sees the user's tokens only


@torch.no_grad()
def test_prefix_rows_are_seeded_exactly_and_never_requantized(loaded_for):
    loaded = loaded_for("llama")
    cache = _cache(loaded, "int4")
    rows = extract_prefix(loaded, PREFIX, "test")
    loaded.model(_ids(7), cache=cache)
    layer = cache.layers[1]
    first = {n: r.clone() for n, r in layer.state.prefix.rows.items()}
    pos = torch.arange(-3, 0)[None]  # first real token at position 0
    assert torch.equal(layer.state.prefix.positions, pos)
    want_k = layer.rotate(rows.layers[1].key[None].float(), pos).to(torch.float16)
    assert torch.equal(first["k"], want_k)
    assert torch.equal(first["v"], rows.layers[1].value[None].to(torch.float16))
    for t in range(5):
        loaded.model(_ids(1, seed=t + 1), cache=cache)
    for n, r in layer.state.prefix.rows.items():
        assert torch.equal(r, first[n])  # untouched by later appends (never encoded)


@torch.no_grad()
def test_the_ledger_counts_the_prefix(loaded_for):
    loaded = loaded_for("llama")
    info = loaded.adapter.info
    cache = _cache(loaded, "int4")
    loaded.model(_ids(10, b=2), cache=cache)
    ledger = cache.nbytes()
    per_seq = 2 * info.num_kv_heads * len(PREFIX) * info.head_dim * 2  # K+V fp16
    assert ledger.prefix == 2 * info.num_layers * per_seq
    plain = _cache(loaded, "int4", prefix=None)
    loaded.model(_ids(10, b=2), cache=plain)
    base = plain.nbytes()
    assert ledger.total == base.total + ledger.prefix  # and nothing else changed
    assert ledger.tokens == base.tokens == 20 and ledger.fp16_bytes == base.fp16_bytes


def _left_pad(rows):
    width = max(r.numel() for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - r.numel() :], mask[i, width - r.numel() :] = r, 1
    return ids, mask


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("layout", ["fp16", "int4"])
@torch.no_grad()
def test_left_padded_and_unpadded_batches_give_the_same_results(loaded_for, family, layout):
    loaded = loaded_for(family)
    model = loaded.model
    long, short = _ids(18, seed=2)[0], _ids(7, seed=3)[0]
    ids, mask = _left_pad([long, short])
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, output_logits=True,
              return_dict_in_generate=True)  # fmt: skip
    out = model.generate(ids, attention_mask=mask, cache=_cache(loaded, layout), **kw)
    for i, row in enumerate((long, short)):
        alone = model.generate(row[None], cache=_cache(loaded, layout), **kw)
        assert torch.equal(out.sequences[i, ids.shape[1] :], alone.sequences[0, row.numel() :])
        for step, logits in enumerate(alone.logits):
            torch.testing.assert_close(out.logits[step][i], logits[0], atol=2e-4, rtol=1e-4)
    # each sequence's prefix sits right before its own first real token
    prefix = out.past_key_values.layers[0].state.prefix
    assert prefix.positions[:, -1].tolist() == [-1, -1]
    assert prefix.first_col.tolist() == [0, 11]


@torch.no_grad()
def test_a_chunk_of_padding_only_places_nothing_until_the_first_real_token(loaded_for):
    loaded = loaded_for("llama")
    model = loaded.model
    ids, mask = _left_pad([_ids(12, seed=4)[0], _ids(3, seed=5)[0]])
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    whole = model(ids, attention_mask=mask, position_ids=positions, cache=_cache(loaded)).logits
    cache = _cache(loaded)
    logits = []
    for a in range(0, 12, 4):  # the short sequence is all padding in the first two chunks
        m = mask[:, : a + 4]
        logits.append(
            model(
                ids[:, a : a + 4],
                attention_mask=m,
                position_ids=positions[:, a : a + 4],
                cache=cache,
            ).logits  # fmt: skip
        )
        if a == 0:
            assert cache.layers[0].state.prefix.placed.tolist() == [True, False]
    got = torch.cat(logits, 1)
    torch.testing.assert_close(got[1, -3:], whole[1, -3:], atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(got[0], whole[0], atol=2e-4, rtol=1e-4)


@torch.no_grad()
def test_greedy_and_beam_search_equal_a_full_precision_prefix_run(loaded_for):
    loaded = loaded_for("qwen2")
    model = loaded.model
    ids = _ids(12, seed=6, b=2)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    want = model.generate(_served(ids), cache=DynamicCache(config=model.config), **kw)
    got = model.generate(ids, cache=_cache(loaded), **kw)
    assert torch.equal(got[:, ids.shape[1] :], want[:, _served(ids).shape[1] :])
    kw |= dict(num_beams=3, num_return_sequences=2)
    want = model.generate(_served(ids), cache=DynamicCache(config=model.config), **kw)
    cache = _cache(loaded)
    got = model.generate(ids, cache=cache, **kw)
    assert torch.equal(got[:, ids.shape[1] :], want[:, _served(ids).shape[1] :])


@torch.no_grad()
def test_prefix_survives_crop_reorder_fork_and_save(loaded_for, tmp_path):
    loaded = loaded_for("gemma3")
    model = loaded.model
    cache = _cache(loaded, "int4")
    model(_ids(10, seed=7, b=3), cache=cache)
    step = _ids(2, seed=8, b=3)
    ref = copy.deepcopy(cache)
    want = model(step, cache=copy.deepcopy(ref)).logits
    # crop: a rejected draft goes, the prefix stays
    cache.activate_past_recording()
    model(_ids(3, seed=9, b=3), cache=cache)
    cache.crop(-3)
    torch.testing.assert_close(model(step, cache=cache).logits, want, atol=2e-4, rtol=1e-4)
    # reorder with repeats: each row keeps its own prefix rows
    rows = torch.tensor([2, 2, 0])
    moved = copy.deepcopy(ref)
    moved.reorder_cache(rows)
    got = model(step[rows], cache=moved).logits  # row i continues old row rows[i]
    torch.testing.assert_close(got, want[rows], atol=2e-4, rtol=1e-4)
    # fork and save/load
    twin = ref.fork()
    torch.testing.assert_close(model(step, cache=twin).logits, want, atol=2e-4, rtol=1e-4)
    path = tmp_path / "state.safetensors"
    ref.save(path)
    restored = _cache(loaded, "int4")
    from kvq.runtime.saved import restore_cache

    restore_cache(restored, path)
    assert torch.equal(
        restored.layers[2].state.prefix.rows["k"], ref.layers[2].state.prefix.rows["k"]
    )
    torch.testing.assert_close(model(step, cache=restored).logits, want, atol=2e-4, rtol=1e-4)
    # a state saved with a prefix does not load into a layout without one
    with pytest.raises(KvqError):
        restore_cache(_cache(loaded, "int4", prefix=None), path)


@torch.no_grad()
def test_cropping_away_the_first_token_unplaces_the_prefix(loaded_for):
    loaded = loaded_for("llama")
    model = loaded.model
    ids = _ids(6, seed=10)
    want = model(ids, cache=_cache(loaded)).logits
    cache = _cache(loaded)
    model(_ids(4, seed=11), cache=cache)
    cache.crop(-4)  # back to empty
    assert not bool(cache.layers[0].state.prefix.placed.any())
    torch.testing.assert_close(model(ids, cache=cache).logits, want, atol=1e-5, rtol=1e-5)


def test_rows_without_their_policy_are_refused(loaded_for):
    loaded = loaded_for("llama")
    info = loaded.adapter.info
    policy = named_policy("int8", info.num_layers, info.head_dim)
    rows = extract_prefix(loaded, PREFIX, "test")
    with pytest.raises(KvqError, match="prefix"):
        build_cache(loaded.model, policy, {}, loaded.adapter, prefix=rows)
    with pytest.raises(KvqError, match="prefix"):
        build_cache(loaded.model, policy.with_prefix(rows.spec), {}, loaded.adapter)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@torch.no_grad()
def test_a_dynamic_cache_holding_the_prefix_serves_prefix_and_prompt(loaded_for, family):
    from kvq.runtime.prefix import prefix_dynamic_cache

    loaded = loaded_for(family)
    rows = extract_prefix(loaded, PREFIX, "test")
    ids = _ids(12, seed=12, b=2)
    want = loaded.model(_served(ids)).logits[:, len(PREFIX) :]
    cache = prefix_dynamic_cache(loaded.model, loaded.adapter, rows, batch=2)
    got = loaded.model(ids, cache=cache).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# --- a declared prefix next to sink rows ---------------------------------------------------
# A cache with prefix P and `s` sink rows keeps exactly the rows that a cache without a prefix
# and P + s sink rows keeps when fed P + x, and quantizes the others the same way. Two things
# legitimately tell the two apart, so the comparison holds them equal: (1) the prefix rows must
# be the very rows the other cache stored (an extracted prefix is a separate fp32 forward of
# P alone, the other cache's P rows come out of a forward through its fp16 rows: they differ by
# fp16 rounding, which a quantized cache amplifies whenever a code sits on a rounding edge);
# (2) x must sit at the same RoPE positions (the prefix cache puts x's first token at its own
# position, 0 unpadded, the other at P; post-RoPE keys quantize differently at other angles).


def _with_sink(loaded, layout, stage, sink):
    from dataclasses import replace

    info = loaded.adapter.info
    policy = named_policy(layout, info.num_layers, info.head_dim)
    layers = tuple(replace(lp, key_stage=stage, sink_tokens=sink) for lp in policy.layers)
    return CachePolicy(policy.name, layers, policy.version)


def _stored_prefix(cache, spec):
    """The prefix rows `cache` (no prefix, the prefix tokens first at positions 0..P-1) stored
    as its first sink rows, as a `Prefix` (pre-RoPE keys: unrotated at 0..P-1)."""
    from kvq.runtime.prefix import Prefix, PrefixKV

    p = spec.length
    rows = []
    for layer in cache.layers:
        sink = layer.state.sink
        assert torch.equal(sink.positions[0, :p], torch.arange(p))
        key, value = sink.rows["k"][:1, :, :p].float(), sink.rows["v"][0, :, :p].float()
        if layer.policy.key_stage == "post-rope":
            key = layer.unrotate(key, torch.arange(p)[None])
        rows.append(PrefixKV(key[0], value))
    return Prefix(spec, tuple(rows))


def _rows_seen(cache, layer, b, first):
    """[H, C, D] K and V that layer `layer` of `cache` attends to for sequence b: its prefix
    rows (if any), then its columns from `first` on (its padding skipped), in column order."""
    lay = cache.layers[layer]
    k, v = lay.visible_rows(lay.state)
    k, v = k[b, :, first:], v[b, :, first:]
    rows = lay.prefix_rows(lay.state)
    if rows is not None:
        k, v = torch.cat([rows[0][b], k], 1), torch.cat([rows[1][b], v], 1)
    return k, v


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("layout", ["int8", "int4"])
@pytest.mark.parametrize("stage", ["post-rope", "pre-rope"])
@torch.no_grad()
def test_a_prefix_with_sink_rows_equals_those_rows_kept_as_sink_rows(
    loaded_for, family, layout, stage
):
    """The rows attention sees are the same (every layer's for the first layer, whose input
    no rounding touches; the logits too on Llama). Past the first layer the two caches differ
    by fp32 rounding (the kernel reads the rows in other segments, a padded batch computes
    in other shapes), and a quantized cache turns a rounding that lands a value on the other
    side of a code boundary into a whole code step: on Gemma 3 (tiny here, 270M for real)
    that grows into logit differences as large as the quantization error itself, prefix or
    not (the same no-prefix cache fed the same tokens in chunks differs as much)."""
    loaded = loaded_for(family)
    model, adapter = loaded.model, loaded.adapter
    # a pre-RoPE layout keeps its sink keys pre-RoPE but its prefix keys rotated (both fp16):
    # the rows round the same only where RoPE is the identity, at position 0 (a BOS prefix)
    tokens = PREFIX if stage == "post-rope" else PREFIX[:1]
    p, s = len(tokens), 2
    # (P + 12 columns: within twice Gemma's window of 8, so that no row is evicted yet)
    long, short = _ids(12, seed=20)[0], _ids(6, seed=21)[0]
    alone, plain = {}, {}
    for i, row in enumerate((long, short)):
        plain[i] = build_cache(model, _with_sink(loaded, layout, stage, p + s), {}, adapter)
        served = torch.cat([torch.tensor(tokens), row])[None]
        alone[i] = model(served, cache=plain[i]).logits[0, p:]
    spec = extract_prefix(loaded, tokens, "test").spec
    rows = _stored_prefix(plain[0], spec)

    def prefixed():
        policy = _with_sink(loaded, layout, stage, s).with_prefix(spec)
        return build_cache(model, policy, {}, adapter, prefix=rows)

    def same_rows(cache, b, first, i):
        for layer in range(len(cache.layers) if family == "llama" else 1):
            got, want = _rows_seen(cache, layer, b, first), _rows_seen(plain[i], layer, 0, 0)
            for x, y in zip(got, want, strict=True):
                torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-6)

    # each sequence alone, x at the positions it has after P
    for i, row in enumerate((long, short)):
        pos = torch.arange(p, p + row.numel())[None]
        cache = prefixed()
        got = model(row[None], cache=cache, position_ids=pos).logits[0]
        same_rows(cache, 0, 0, i)
        if family == "llama":
            torch.testing.assert_close(got, alone[i], atol=2e-5, rtol=1e-5)
    # a left-padded batch: each sequence's prefix and sinks sit after its own padding
    ids, mask = _left_pad([long, short])
    pad = ids.shape[1] - short.numel()
    pos = (mask.cumsum(1) - 1).clamp(min=0) + p
    cache = prefixed()
    got = model(ids, attention_mask=mask, position_ids=pos, cache=cache).logits
    same_rows(cache, 0, 0, 0)
    same_rows(cache, 1, pad, 1)
    if family == "llama":
        torch.testing.assert_close(got[0], alone[0], atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(got[1, pad:], alone[1], atol=2e-5, rtol=1e-5)
    sink = cache.layers[0].state.sink
    assert sink.positions.tolist() == [[p, p + 1], [p, p + 1]]  # x's first s tokens
    assert sink.cols.tolist() == [[0, 1], [pad, pad + 1]]
    assert cache.layers[0].state.prefix.positions.tolist() == [list(range(p))] * 2
