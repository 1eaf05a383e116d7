"""Non-uniform codebooks: determinism, weighting, nearest-level codes, error bounds."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvq.errors import KvqError
from kvq.quant.affine import affine_encode
from kvq.quant.nuq import (
    denormalize,
    fit_codebook,
    live_normalizer,
    normalize,
    normalizer,
    nuq_decode,
    nuq_encode,
    uniform_codebook,
)

EPS32 = torch.finfo(torch.float32).eps


def _uniform(n: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(n, generator=gen) * 2 - 1  # [N] in [-1, 1)


def _half_gap(codebook: torch.Tensor) -> float:
    return float((codebook[1:] - codebook[:-1]).max()) / 2


# --- fit_codebook ---------------------------------------------------------------------


def test_codebook_is_deterministic_per_seed():
    vals = _uniform(4000)
    a = fit_codebook(vals, 3, seed=7)
    b = fit_codebook(vals, 3, seed=7)
    assert torch.equal(a, b)
    assert a.dtype == torch.float32 and a.shape == (8,)


def test_codebook_subsample_is_deterministic():
    vals = torch.randn(5000, generator=torch.Generator().manual_seed(1)).clamp(-1, 1)
    w = torch.rand(5000, generator=torch.Generator().manual_seed(2))
    a = fit_codebook(vals, 2, weights=w, seed=3, max_samples=500)
    b = fit_codebook(vals, 2, weights=w, seed=3, max_samples=500)
    assert torch.equal(a, b)
    # A different seed draws a different subsample; the result is still a valid codebook.
    c = fit_codebook(vals, 2, weights=w, seed=4, max_samples=500)
    assert bool((c[1:] > c[:-1]).all())


@pytest.mark.parametrize("bits", (1, 2, 3, 4))
def test_codebook_sorted_within_range(bits):
    cb = fit_codebook(_uniform(3000, bits), bits)
    assert cb.shape == (2**bits,)
    assert bool((cb[1:] > cb[:-1]).all())
    assert bool((cb >= -1).all() & (cb <= 1).all())


def test_weights_pull_a_level_towards_heavy_values():
    vals = _uniform(4000)
    near = (vals - 0.9).abs() < 0.02
    w = torch.where(near, 1000.0, 1.0)
    plain = fit_codebook(vals, 2)
    weighted = fit_codebook(vals, 2, weights=w)
    assert not torch.equal(plain, weighted)
    dist = lambda cb: float((cb - 0.9).abs().min())  # noqa: E731
    assert dist(weighted) < 0.02 < dist(plain)


def test_codebook_clamps_out_of_range_values():
    vals = torch.cat([_uniform(1000), torch.tensor([5.0, -7.0])])
    cb = fit_codebook(vals, 2)
    assert bool((cb >= -1).all() & (cb <= 1).all())


def test_codebook_degenerate_inputs():
    with pytest.raises(KvqError, match="distinct"):
        fit_codebook(torch.tensor([0.1, 0.1, 0.2, 0.2, 0.3]), 2)
    # Zero-weight samples do not count as data.
    vals = torch.tensor([-0.5, 0.0, 0.5, 0.9])
    with pytest.raises(KvqError, match="distinct"):
        fit_codebook(vals, 2, weights=torch.tensor([1.0, 1.0, 1.0, 0.0]))
    with pytest.raises(KvqError):
        fit_codebook(vals, 2, weights=torch.tensor([1.0, -1.0, 1.0, 1.0]))
    with pytest.raises(KvqError):
        fit_codebook(vals, 2, weights=torch.ones(3))
    with pytest.raises(KvqError):
        fit_codebook(vals.reshape(2, 2), 1)
    with pytest.raises(KvqError):
        fit_codebook(torch.tensor([0.0, float("nan")]), 1)
    with pytest.raises(KvqError):
        fit_codebook(vals, 9)


def test_exactly_enough_distinct_values():
    vals = torch.tensor([-0.75, -0.25, 0.25, 0.75]).repeat(5)
    assert torch.equal(fit_codebook(vals, 2), torch.tensor([-0.75, -0.25, 0.25, 0.75]))


# --- encode / decode ------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(
    levels=st.lists(
        st.floats(-1, 1, allow_nan=False, width=32), min_size=2, max_size=16, unique=True
    ),
    seed=st.integers(0, 2**31 - 1),
    shape=st.lists(st.integers(1, 5), min_size=1, max_size=3),
)
def test_encode_picks_nearest_level(levels, seed, shape):
    cb = torch.tensor(sorted(levels), dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(*shape, generator=gen) * 2.4 - 1.2  # some values beyond [-1, 1]
    codes = nuq_encode(x, cb)
    assert codes.dtype == torch.uint8 and codes.shape == x.shape
    dist = (x.unsqueeze(-1) - cb).abs()  # [..., L] brute force
    chosen = dist.gather(-1, codes.long().unsqueeze(-1)).squeeze(-1)
    # Equal to the brute-force minimum up to the rounding of the fp32 midpoint.
    assert bool((chosen <= dist.min(-1).values + 4 * EPS32).all())


def test_encode_ties_and_clamping():
    cb = torch.tensor([-1.0, 0.0, 0.5, 1.0])
    x = torch.tensor([-0.5, 0.25, 0.75, -3.0, 3.0, -1.0, 1.0])
    assert nuq_encode(x, cb).tolist() == [0, 1, 2, 0, 3, 0, 3]  # midpoints go to the lower level


def test_encode_decode_error_within_half_gap():
    cb = fit_codebook(_uniform(3000, 5), 3)
    x = _uniform(2000, 6).reshape(4, 5, 100)
    xh = nuq_decode(nuq_encode(x, cb), cb)
    assert xh.dtype == torch.float32 and xh.shape == x.shape
    # Inside [cb[0], cb[-1]] the error is at most half the largest gap; beyond the end levels
    # it is the distance to the end level.
    inside = (x >= cb[0]) & (x <= cb[-1])
    assert bool(((xh - x).abs()[inside] <= _half_gap(cb) + 4 * EPS32).all())
    assert bool((xh[x < cb[0]] == cb[0]).all() & (xh[x > cb[-1]] == cb[-1]).all())


def test_codebook_validation():
    with pytest.raises(KvqError, match="strictly increasing"):
        nuq_encode(torch.zeros(3), torch.tensor([0.0, 0.0, 1.0]))
    with pytest.raises(KvqError):
        nuq_encode(torch.zeros(3), torch.tensor([0.0]))
    with pytest.raises(KvqError):
        nuq_encode(torch.tensor([float("nan")]), uniform_codebook(2))
    with pytest.raises(KvqError, match="out of range"):
        nuq_decode(torch.tensor([4], dtype=torch.uint8), uniform_codebook(2))


@pytest.mark.parametrize("bits", (1, 2, 3, 4, 8))
def test_uniform_codebook_matches_uniform_quantizer(bits):
    cb = uniform_codebook(bits)
    n = 2**bits
    assert cb.shape == (n,) and cb[0] == -1 and cb[-1] == 1
    x = _uniform(4000, bits)
    codes = nuq_encode(x, cb)
    step = 2.0 / (n - 1)
    assert float((nuq_decode(codes, cb) - x).abs().max()) <= step / 2 + 4 * EPS32
    if bits >= 2:  # the affine quantizer supports 2, 3, 4, 8 bits
        ref = affine_encode(x, torch.tensor(step), torch.tensor(-1.0), bits)
        # Same grid; codes may only differ on exact midpoints, never hit by random floats.
        assert float((codes.int() - ref.int()).abs().max()) == 0


# --- normalizer -----------------------------------------------------------------------


@pytest.mark.parametrize("scale_dtype", (torch.float16, torch.bfloat16, torch.float32))
def test_normalizer_round_trip(scale_dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8, 64, generator=gen) * 3 + torch.randn(8, 1, generator=gen) * 50
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    scale, center = normalizer(lo, hi, scale_dtype)
    assert scale.dtype == scale_dtype and center.dtype == scale_dtype
    xn = normalize(x, scale, center)
    assert bool((xn.abs() <= 1).all())  # nothing clips even with a rounded center
    back = denormalize(xn, scale, center)
    assert torch.allclose(back, x, rtol=0, atol=1e-4 * float(x.abs().max()))


def test_normalizer_exact_center_gives_half_range():
    scale, center = normalizer(torch.tensor([-2.0, 1.0]), torch.tensor([2.0, 3.0]))
    assert scale.tolist() == [2.0, 1.0] and center.tolist() == [0.0, 2.0]


def test_normalizer_constant_rows_and_errors():
    scale, center = normalizer(torch.tensor([0.0, 3.0]), torch.tensor([0.0, 3.0]))
    assert scale.tolist() == [1.0, 1.0] and center.tolist() == [0.0, 3.0]
    with pytest.raises(KvqError):
        normalizer(torch.tensor([1.0]), torch.tensor([0.0]))
    with pytest.raises(KvqError):
        normalizer(torch.tensor([0.0]), torch.tensor([float("inf")]))
    with pytest.raises(KvqError, match="underflows"):
        normalizer(torch.tensor([0.0]), torch.tensor([1e-6]))
    with pytest.raises(KvqError, match="overflows"):
        normalizer(torch.tensor([1e5]), torch.tensor([1e5 + 8]))


def test_normalize_encode_decode_pipeline():
    # End to end: per-row range -> normalise -> codebook -> back, within half a gap * scale.
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(9))
    scale, center = normalizer(x.amin(-1, keepdim=True), x.amax(-1, keepdim=True))
    cb = fit_codebook(normalize(x, scale, center).flatten(), 3)
    xh = denormalize(nuq_decode(nuq_encode(normalize(x, scale, center), cb), cb), scale, center)
    bound = (_half_gap(cb) + 1e-5) * scale.float() + 1e-5
    assert bool(((xh - x).abs() <= bound).all())


def test_codebook_check_is_cached_but_sees_in_place_edits():
    """A static codebook is checked once (the check syncs a GPU on every append otherwise),
    yet an in-place edit after that first check is still caught."""
    cb = uniform_codebook(2)
    x = torch.linspace(-1, 1, 9)
    first = nuq_encode(x, cb)
    assert torch.equal(nuq_encode(x, cb), first)
    cb[2] = cb[1]  # no longer strictly increasing
    with pytest.raises(KvqError, match="strictly increasing"):
        nuq_encode(x, cb)
    cb[2] = float("nan")
    with pytest.raises(KvqError, match="codebook"):
        nuq_decode(torch.zeros(3, dtype=torch.uint8), cb)


@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_live_normalizer_is_the_checked_one(scale_dtype):
    """The appended rows' one-read normaliser: bit-identical to the checked path on
    ordinary, constant, near-silent and huge rows; a NaN row still refused by it."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 40, 16, generator=g) * torch.logspace(-9, 4, 40)[:, None]
    x[0, 0, 0] = 2.5  # constant row
    x[1, 2, 5] = 0.0  # all zero
    lo, hi = x.amin(-1), x.amax(-1)
    want = normalizer(lo, hi, scale_dtype, raise_tiny=False)
    got = live_normalizer(lo, hi, scale_dtype)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    hi[0, 1, 3] = float("nan")
    with pytest.raises(KvqError, match="NaN"):
        live_normalizer(lo, hi, scale_dtype)
