"""KVQuant calibration on a tiny model, and the cache built from it."""

import pytest
import torch

from kvq.calibrators.kvquant import KVQuantOptions, calibrate_kvquant, capture_kv, fit_key_layer
from kvq.models.adapters import get_adapter
from kvq.progress import Progress
from kvq.runtime.cache import build_cache
from tests.conftest import make_tiny_model


def _windows(n=3, t=24, seed=0):
    return torch.randint(3, 200, (n, t), generator=torch.Generator().manual_seed(seed))


def test_codebooks_are_deterministic_and_fisher_changes_them():
    model = make_tiny_model("gemma3")
    ad = get_adapter(model)
    opts = KVQuantOptions(bits=2, outliers=0.02, sink=1)
    fisher = (torch.rand(4, 1, 32) ** 4, torch.rand(4, 1, 32) ** 4)
    _, a = calibrate_kvquant(model, ad, _windows(), opts, Progress(), fisher)
    _, b = calibrate_kvquant(model, ad, _windows(), opts, Progress(), fisher)
    _, plain = calibrate_kvquant(model, ad, _windows(), opts, Progress(), None)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not torch.equal(a["layers.0.key.codebook"], plain["layers.0.key.codebook"])
    # Q-Norm is on by default: both sides carry corrected levels beside the codebook
    assert {"layers.0.key.qnorm_levels", "layers.0.value.qnorm_levels"} <= a.keys()
    _, off = calibrate_kvquant(
        model,
        ad,
        _windows(),
        KVQuantOptions(bits=2, outliers=0.02, qnorm=False),
        Progress(),
        fisher,
    )
    assert not any(n.endswith("qnorm_levels") for n in off)


def test_sink_rows_are_excluded_from_statistics():
    model = make_tiny_model("llama")
    ad = get_adapter(model)
    module, _ = ad.key_pre_rope_site(0)

    def spike(_m, _i, out):
        out = out.clone()
        out[:, 0] = 1e4  # position 0 is an extreme outlier in layer 0
        return out

    handle = module.register_forward_hook(spike)
    try:
        keys, _ = capture_kv(model, ad, _windows(2, 10), 1, "pre-rope", Progress())
        keys0, _ = capture_kv(model, ad, _windows(2, 10), 0, "pre-rope", Progress())
    finally:
        handle.remove()
    assert keys[0].shape[0] == 2 * 9 and keys[0].abs().max() < 100
    assert keys0[0].abs().max() >= 1e4


def test_outliers_are_excluded_from_the_dense_range():
    samples = torch.randn(1000, 1, 8)
    samples[5, 0, 2] = 1e3
    opts = KVQuantOptions(bits=3, outliers=0.01, fisher=False)
    state = fit_key_layer(samples, None, opts)
    assert state["upper"][0, 2] < 10  # the spike is beyond the threshold, not inside the range
    assert state["scale"].float().max() < 10
    assert state["codebook"].min() >= -1 and state["codebook"].max() <= 1


def test_calibrated_cache_runs_and_tracks_the_model():
    model = make_tiny_model("gemma3")
    ad = get_adapter(model)
    opts = KVQuantOptions(bits=4, outliers=0.02, sink=1, qnorm=True)
    policy, tensors = calibrate_kvquant(model, ad, _windows(4, 32), opts, Progress(), None)
    ids = _windows(1, 20, seed=9)
    with torch.no_grad():
        ref = torch.log_softmax(model(ids).logits, -1)
        cache = build_cache(model, policy, tensors, ad)
        got = torch.log_softmax(model(ids, cache=cache).logits, -1)
        step = model(_windows(1, 1, seed=10), cache=cache).logits
    kl = (ref.exp() * (ref - got)).sum(-1).mean()
    assert kl < 0.05 and torch.isfinite(step).all()
    ledger = cache.nbytes()
    assert ledger.sparse > 0 and ledger.sink > 0 and ledger.codes > 0
    # reorder moves the variable-length key exceptions with their batch row
    cache2 = build_cache(model, policy, tensors, ad)
    with torch.no_grad():
        model(torch.cat([_windows(1, 12, seed=1), _windows(1, 12, seed=2)]), cache=cache2)
    layer = cache2.layers[0]
    before = [layer.decoded(layer.state)[0]]
    cache2.reorder_cache(torch.tensor([1, 0]))
    after = layer.decoded(layer.state)[0]
    assert torch.equal(after[0], before[0][1]) and torch.equal(after[1], before[0][0])


def test_triton_append_stores_the_same_nuq_rows_and_exceptions(monkeypatch):
    """NUQ keys (threshold exceptions) and values (slots) through the interpreted append
    kernels: layer 0's stored rows and flat entries equal the torch encode's, bit for bit."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model = make_tiny_model("llama")
    ad = get_adapter(model)
    opts = KVQuantOptions(bits=3, outliers=0.05, sink=1)
    policy, tensors = calibrate_kvquant(model, ad, _windows(4, 32), opts, Progress(), None)
    ids = torch.cat([_windows(1, 10, seed=3), _windows(1, 10, seed=4)])
    stored = {}
    for backend in ("reference", "triton"):
        cache = build_cache(model, policy, tensors, ad, backend=backend)
        with torch.no_grad():
            model(ids[:, :8], cache=cache)
            model(ids[:, 8:9], cache=cache)
        st = cache.layers[0].state
        stored[backend] = {
            **st.main.rows(),
            **{f"flat.{n}": t for n, t in st.flat["k"].entries(0, st.flat["k"].length).items()},
        }
    assert stored["reference"]["flat.sparse_index"].numel() > 0
    assert stored["triton"].keys() == stored["reference"].keys()
    for name, t in stored["reference"].items():
        assert torch.equal(stored["triton"][name], t), name


def test_key_thresholds_follow_fisher_and_held_out_rate():
    from kvq.calibrators.kvquant import key_fraction

    g = torch.Generator().manual_seed(0)
    samples = torch.randn(4000, 1, 16, generator=g)
    samples[2000:] *= 1.5  # the second half is wider: unseen text flags more outliers
    fisher = torch.ones(1, 16)
    fisher[0, 0] = 0.0
    opts = KVQuantOptions(bits=3, outliers=0.01)
    frac = key_fraction(samples, fisher, opts)
    assert 0.0025 <= frac < 0.01
    state = fit_key_layer(samples, fisher, opts)
    assert state["lower"].dtype == torch.float16
    # the zero-sensitivity channel keeps its full range: no exceptions spent on it
    assert state["lower"][0, 0] <= samples[:, 0, 0].min()
    assert state["upper"][0, 0] >= samples[:, 0, 0].max()
    uniform = fit_key_layer(samples, fisher, KVQuantOptions(bits=3, key_outliers="uniform"))
    assert not torch.equal(state["lower"], uniform["lower"])


def test_mixed_loss_at_4_bits_measures_3_4_and_8_bits_and_keeps_the_budget(monkeypatch):
    """Scalar NUQ `--mixed loss`: every side fitted at 3, 4 and 8 bits and measured; a side
    whose loss is made huge gets 8 bits, paid for by four sides at 3 (NUQ has no 5-7)."""
    from kvq.calibrators import side_loss
    from kvq.errors import KvqError

    model = make_tiny_model("gemma3")
    ad = get_adapter(model)
    real = side_loss.measure_losses

    def boosted(model, adapter, windows, candidates, template, progress):
        kld = real(model, adapter, windows, candidates, template, progress)
        hot = [(c.layer, c.part) == (0, "key") for c in candidates]
        return [x * 1e4 if h else x for x, h in zip(kld, hot, strict=True)]

    monkeypatch.setattr(side_loss, "measure_losses", boosted)
    opts = KVQuantOptions(bits=4, mixed="loss")
    pol, t = calibrate_kvquant(model, ad, _windows(), opts, Progress(), None)
    widths = [w for lp in pol.layers for w in (lp.key.bits, lp.value.bits)]
    assert pol.layers[0].key.bits == 8 and pol.name == "kvquant-nuq4-mixed-loss"
    assert sum(widths) <= 4 * len(widths) and set(widths) <= {3, 4, 8}
    assert t["mixed.widths"].tolist() == [3, 4, 8] and t["mixed.kld"].shape == (4, 2, 3)
    assert t["layers.0.key.codebook"].numel() == 256
    cache = build_cache(model, pol, t, ad)
    with torch.no_grad():
        out = model(_windows(1, 16, seed=4), cache=cache, use_cache=True).logits
    assert torch.isfinite(out).all()
    with pytest.raises(KvqError, match="NUQ has no 1-bit width"):
        KVQuantOptions(bits=2, mixed="loss")


@pytest.mark.parametrize("part", ["value", "key"])
def test_sides_without_exceptions_store_no_exceptions(part):
    """--v-outliers 0 / --k-outliers 0: that side's schemes keep no exceptions (the other
    keeps its own); the cache stores fewer exception bytes than with them, and its codes
    are the same size."""
    model = make_tiny_model("llama")
    ad = get_adapter(model)
    ids = _windows(2, 48, seed=9)
    ledgers = []
    for fraction in (None, 0.0):
        opts = KVQuantOptions(bits=3, **{f"{part[0]}_outliers": fraction})
        pol, t = calibrate_kvquant(model, ad, _windows(), opts, Progress(), None)
        other = "key" if part == "value" else "value"
        expected = 0.01 if fraction is None else 0.0
        assert {getattr(lp, part).outlier_fraction for lp in pol.layers} == {expected}
        assert {getattr(lp, other).outlier_fraction for lp in pol.layers} == {0.01}
        assert ("layers.0.key.lower" in t) == (part == "value" or fraction is None)
        cache = build_cache(model, pol, t, ad)
        with torch.no_grad():
            out = model(ids, cache=cache, use_cache=True).logits
        assert torch.isfinite(out).all()
        ledgers.append(cache.nbytes())
    assert ledgers[1].sparse < ledgers[0].sparse and ledgers[1].codes == ledgers[0].codes
