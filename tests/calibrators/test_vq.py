"""`kvq calibrate vq` on tiny models: codebooks, mixed bits within the budget, the cache."""

import pytest
import torch

from kvq.calibrators.options import VQOptions
from kvq.calibrators.vq import allocate_bits, calibrate_vq, key_groups
from kvq.models.adapters import get_adapter
from kvq.progress import Progress
from kvq.runtime.cache import build_cache
from tests.conftest import make_tiny_model


def _windows(n=4, t=40, seed=0):
    return torch.randint(3, 200, (n, t), generator=torch.Generator().manual_seed(seed))


def _fisher(ad, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (ad.info.num_layers, ad.info.num_kv_heads, ad.info.head_dim)
    return torch.rand(shape, generator=g) ** 4, torch.rand(shape, generator=g) ** 4


def test_allocation_moves_bits_to_the_sensitive_sides_and_keeps_the_total():
    errors = [100.0, 1.0, 1.0, 50.0, 0.5]
    bits = allocate_bits(errors, 2)
    assert sum(bits) == 2 * len(errors)
    assert bits[0] == 3 and bits[3] == 3 and min(bits) >= 1
    assert allocate_bits([1.0, 1.0, 1.0], 3) == [3, 3, 3]  # nothing pays: uniform


def test_allocation_spends_spare_bits_and_gives_up_missing_ones_where_cheapest():
    errors = [100.0, 1.0, 1.0, 50.0, 0.5]
    up = allocate_bits(errors, 3, spare=2)  # two bits beyond the uniform budget
    assert sum(up) == 3 * len(errors) + 2 and up[0] == up[3] == 4
    down = allocate_bits(errors, 3, spare=-2)  # two bits short of it
    assert sum(down) == 3 * len(errors) - 2 and down[4] == 2 and down[0] >= 3


def test_key_groups_are_rope_pairs():
    ad = get_adapter(make_tiny_model("gemma3"))
    d = ad.info.head_dim
    pairs = key_groups(ad, 0, 2)
    assert (pairs[:, 1] - pairs[:, 0] == d // 2).all()  # rotate-half: (c, c + D/2)
    quads = key_groups(ad, 0, 4)
    assert quads[0].tolist() == [0, 1, d // 2, d // 2 + 1]


def test_calibration_is_deterministic_and_mixed_bits_keep_the_budget():
    model = make_tiny_model("gemma3")
    ad = get_adapter(model)
    fisher = _fisher(ad)
    pol, a = calibrate_vq(model, ad, _windows(), VQOptions(bits=2), Progress(), fisher)
    _, b = calibrate_vq(model, ad, _windows(), VQOptions(bits=2), Progress(), fisher)
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert {lp.key.vector_dim for lp in pol.layers} == {4}  # 2 bits: 4-D codebooks
    assert a["layers.0.key.vq_codebook"].shape == (256, 4)
    # one very sensitive layer: mixed precision gives it bits, others pay
    fk, fv = fisher
    fk[1] *= 1e4
    mixed, t = calibrate_vq(
        model, ad, _windows(), VQOptions(bits=2, mixed=True), Progress(), (fk, fv)
    )
    keys = [lp.key.bits for lp in mixed.layers]
    values = [lp.value.bits for lp in mixed.layers]
    assert mixed.layers[1].key.bits == 3
    # bits move between layers within a side, never between keys and values
    assert sum(keys) == 2 * len(keys) and sum(values) == 2 * len(values)
    assert mixed.layers[1].key.vector_dim == 2  # 3 bits: 2-D codebook (64 centroids)
    cache = build_cache(model, mixed, t, ad)
    ids = _windows(2, 24, seed=5)
    with torch.no_grad():
        out = model(ids, cache=cache, use_cache=True).logits
        base = model(ids).logits
    assert torch.isfinite(out).all() and out.shape == base.shape


def test_generate_runs_through_the_vq_cache():
    model = make_tiny_model("llama")
    ad = get_adapter(model)
    pol, t = calibrate_vq(model, ad, _windows(), VQOptions(bits=3), Progress(), _fisher(ad))
    ids = _windows(1, 8, seed=3)
    cache = build_cache(model, pol, t, ad)
    out = model.generate(ids, cache=cache, max_new_tokens=6, do_sample=False)
    assert out.shape == (1, 14)
    ledger = cache.nbytes()
    assert ledger.codes > 0 and ledger.sparse > 0 and ledger.sink > 0


def test_loss_allocation_gives_bits_where_the_measured_loss_is(monkeypatch):
    """`--mixed loss`: every side measured at widths 1..3; the side whose loss is made huge
    gets the widest width, the others pay, and the total stays within the uniform bits."""
    from kvq.calibrators import side_loss

    model = make_tiny_model("gemma3")
    ad = get_adapter(model)
    real, measured = side_loss.measure_losses, {}

    def boosted(model, adapter, windows, candidates, template, progress):
        kld = real(model, adapter, windows, candidates, template, progress)
        measured["kld"] = kld
        hot = [(c.layer, c.part) == (2, "value") for c in candidates]
        return [x * 1e4 if h else x for x, h in zip(kld, hot, strict=True)]

    monkeypatch.setattr(side_loss, "measure_losses", boosted)
    opts = VQOptions(bits=2, dim=2, mixed="loss")
    pol, t = calibrate_vq(model, ad, _windows(), opts, Progress(), _fisher(ad))
    n = ad.info.num_layers
    assert pol.layers[2].value.bits == 3 and pol.name == "vq2-d2-mixed-loss"
    widths = [lp.key.bits for lp in pol.layers] + [lp.value.bits for lp in pol.layers]
    assert sum(widths) <= 2 * 2 * n and min(widths) >= 1
    assert t["mixed.widths"].tolist() == [1, 2, 3]
    table = torch.tensor(measured["kld"]).view(n, 2, 3)  # [L, K|V, widths 1..3]
    assert torch.allclose(t["mixed.kld"][2, 1], table[2, 1] * 1e4)  # what the allocator saw
    assert (table[..., 0] > table[..., 2]).all()  # one bit per element costs more than three
    for layer, lp in enumerate(pol.layers):  # each side carries the state of its width
        assert t[f"layers.{layer}.value.vq_codebook"].shape[0] == 2 ** (2 * lp.value.bits)
    cache = build_cache(model, pol, t, ad)
    with torch.no_grad():
        out = model(_windows(1, 24, seed=5), cache=cache, use_cache=True).logits
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("part", ["value", "key"])
def test_sides_without_exceptions_spend_their_bytes_on_wider_layers(part):
    """--v-outliers 0 / --k-outliers 0: that side's rows keep no exceptions, and with
    --mixed the bits they would take widen its layers; the other side keeps its budget and
    its exceptions; the stored cache is no larger than the one with exceptions."""
    from kvq.calibrators.vq import spare_layer_bits

    model = make_tiny_model("gemma3")
    ad = get_adapter(model)
    n = ad.info.num_layers
    opts = VQOptions(bits=2, mixed="fisher", **{f"{part[0]}_outliers": 0.0})
    spare = spare_layer_bits(ad, opts)
    other = "key" if part == "value" else "value"
    assert spare[part] >= 1 and spare[other] == 0  # tiny head_dim: one entry frees > 1/n bit
    with_exc, t0 = calibrate_vq(model, ad, _windows(), VQOptions(bits=2, mixed="fisher"),
                                Progress(), _fisher(ad))  # fmt: skip
    pol, t = calibrate_vq(model, ad, _windows(), opts, Progress(), _fisher(ad))
    schemes = {side: [getattr(lp, side) for lp in pol.layers] for side in ("key", "value")}
    assert sum(s.bits for s in schemes[part]) == 2 * n + spare[part]
    assert sum(s.bits for s in schemes[other]) == 2 * n  # the other side keeps its budget
    assert {s.outlier_fraction for s in schemes[part]} == {0.0}
    assert {s.outlier_fraction for s in schemes[other]} == {0.01}
    ids = _windows(2, 64, seed=7)
    ledgers = []
    for policy, tensors in ((with_exc, t0), (pol, t)):
        cache = build_cache(model, policy, tensors, ad)
        with torch.no_grad():
            model(ids, cache=cache, use_cache=True)
        ledgers.append(cache.nbytes())
    streamed = [led.codes + led.sparse + led.qparams for led in ledgers]
    assert streamed[1] <= streamed[0]
