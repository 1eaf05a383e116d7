"""`kvq calibrate vq` on tiny models: codebooks, mixed bits within the budget, the cache."""

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
