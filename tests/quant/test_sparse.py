"""Dense-and-sparse outliers: exact holes, inlier ranges, thresholds, packing."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvq.errors import KvqError
from kvq.quant import sparse
from kvq.quant.nuq import denormalize, normalize, normalizer, nuq_decode, nuq_encode
from kvq.quant.nuq import uniform_codebook as ucb
from kvq.quant.sparse import (
    channel_thresholds,
    merge_exceptions,
    pack_mask_exceptions,
    row_outliers,
    tail_counts,
    threshold_excess,
    threshold_outliers,
)


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# --- tail_counts ----------------------------------------------------------------------


def test_tail_counts():
    assert tail_counts(128, 0.0) == (0, 0)
    assert tail_counts(128, 0.01) == (1, 1)  # ceil(0.64)
    assert tail_counts(100, 0.02) == (1, 1)
    assert tail_counts(100, 0.14) == (7, 7)  # 0.14 * 100 is 14.000000000000002 in floats
    assert tail_counts(100, 0.15) == (8, 8)  # ceil(7.5)
    for bad in (-0.1, 0.5, 0.7):
        with pytest.raises(KvqError):
            tail_counts(64, bad)
    with pytest.raises(KvqError):
        tail_counts(0, 0.1)


# --- row_outliers ---------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(
    lead=st.lists(st.integers(1, 4), min_size=0, max_size=3),
    d=st.integers(4, 64),
    fraction=st.floats(0.0, 0.3),
    seed=st.integers(0, 2**31 - 1),
)
def test_row_outliers_picks_both_tails(lead, d, fraction, seed):
    x = _randn(*lead, d, seed=seed)
    k_lo, k_hi = tail_counts(d, fraction)
    if d <= k_lo + k_hi:
        with pytest.raises(KvqError):
            row_outliers(x, fraction)
        return
    idx, vals, lo, hi = row_outliers(x, fraction)
    k = k_lo + k_hi
    assert idx.dtype == torch.int16 and idx.shape == (*lead, k)
    assert vals.dtype == x.dtype and lo.shape == hi.shape == tuple(lead)
    assert torch.equal(vals, x.gather(-1, idx.long()))
    assert bool((idx[..., 1:] > idx[..., :-1]).all())  # ascending, no duplicates
    ordered = x.sort(-1).values
    expect = torch.cat([ordered[..., :k_lo], ordered[..., d - k_hi :]], -1).sort(-1).values
    assert torch.equal(vals.sort(-1).values, expect)
    inlier = torch.ones_like(x, dtype=torch.bool).scatter(-1, idx.long(), False)
    assert torch.equal(lo, x.masked_fill(~inlier, float("inf")).amin(-1))
    assert torch.equal(hi, x.masked_fill(~inlier, float("-inf")).amax(-1))


def test_outliers_excluded_from_inlier_range():
    x = torch.tensor([[0.125, -0.25, 1000.0, 0.25, -0.5, 0.375, 0.0, 0.25]])
    idx, vals, lo, hi = row_outliers(x, 0.25)  # one per tail
    assert idx.tolist() == [[2, 4]] and vals.tolist() == [[1000.0, -0.5]]
    # The huge value does not stretch the dense range: it comes from the others.
    assert lo.tolist() == [-0.25] and hi.tolist() == [0.375]


def test_row_outliers_zero_fraction_and_errors():
    x = _randn(3, 16)
    idx, vals, lo, hi = row_outliers(x, 0.0)
    assert idx.shape == (3, 0) and vals.shape == (3, 0)
    assert torch.equal(lo, x.amin(-1)) and torch.equal(hi, x.amax(-1))
    with pytest.raises(KvqError, match="no inliers"):
        row_outliers(torch.zeros(2, 2), 0.4)
    with pytest.raises(KvqError):
        row_outliers(torch.tensor([1.0, float("nan"), 0.0, 2.0]), 0.1)


def test_row_outliers_ties_are_deterministic_and_disjoint():
    x = torch.zeros(2, 8)
    idx, _, _, _ = row_outliers(x, 0.25)
    assert idx.tolist() == [[0, 7], [0, 7]]  # low tail takes the first, high tail the last


# --- merge_exceptions: exact holes ----------------------------------------------------


def test_hole_semantics_restore_exact_values():
    # Full V path: inlier range -> normalise -> 2-bit codes -> decode -> replace the holes.
    x = _randn(2, 3, 5, 64, seed=1)  # [B, H, T, D]
    x[..., 7] *= 40  # a heavy channel to make real outliers
    idx, vals, lo, hi = row_outliers(x, 0.05)
    scale, center = normalizer(lo.unsqueeze(-1), hi.unsqueeze(-1))
    cb = ucb(2)
    dense = denormalize(nuq_decode(nuq_encode(normalize(x, scale, center), cb), cb), scale, center)
    merged = merge_exceptions(dense, idx, vals)
    assert torch.equal(merged.gather(-1, idx.long()), x.gather(-1, idx.long()))
    # Every other coordinate is untouched dense output.
    hole = torch.zeros_like(x, dtype=torch.bool).scatter(-1, idx.long(), True)
    assert torch.equal(merged[~hole], dense[~hole])
    # Adding the full values on top of the decoded dense value would be wrong: the
    # lookup level at a hole is not zero.
    naive = dense.scatter_add(-1, idx.long(), vals)
    assert not torch.equal(naive.gather(-1, idx.long()), x.gather(-1, idx.long()))


def test_merge_sentinel_slots_are_ignored():
    dense = torch.arange(8.0).reshape(2, 4)
    idx = torch.tensor([[1, 4, 4], [4, 4, 4]], dtype=torch.int16)
    vals = torch.tensor([[-5.0, 99.0, 98.0], [7.0, 7.0, 7.0]])
    out = merge_exceptions(dense, idx, vals)
    assert out.tolist() == [[0.0, -5.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0]]
    assert torch.equal(dense, torch.arange(8.0).reshape(2, 4))  # input not modified
    # inplace: a buffer without unused slots is written and returned; with them, copied
    full = torch.tensor([[1, 2, 3], [0, 1, 2]])
    own = dense.clone()
    assert merge_exceptions(own, full, vals, inplace=True) is own
    assert own.tolist() == [[0.0, -5.0, 99.0, 98.0], [7.0, 7.0, 7.0, 7.0]]
    assert torch.equal(merge_exceptions(dense, idx, vals, inplace=True), out)
    assert torch.equal(dense, torch.arange(8.0).reshape(2, 4))


def test_merge_keeps_full_precision_values():
    dense = torch.zeros(1, 4, dtype=torch.float16)
    vals = torch.tensor([[1.0 + 2**-20]])  # not representable in fp16
    out = merge_exceptions(dense, torch.tensor([[2]]), vals)
    assert out.dtype == torch.float32 and out[0, 2] == vals[0, 0]


def test_merge_errors():
    dense = torch.zeros(2, 4)
    with pytest.raises(KvqError, match="duplicate"):
        merge_exceptions(dense, torch.tensor([[1, 1], [0, 4]]), torch.ones(2, 2))
    with pytest.raises(KvqError, match="out of range"):
        merge_exceptions(dense, torch.tensor([[5, 0], [0, 1]]), torch.ones(2, 2))
    with pytest.raises(KvqError, match="out of range"):
        merge_exceptions(dense, torch.tensor([[-1, 0], [0, 1]]), torch.ones(2, 2))
    with pytest.raises(KvqError, match="shapes"):
        merge_exceptions(dense, torch.tensor([[1], [0]]), torch.ones(2, 2))
    assert torch.equal(merge_exceptions(dense, torch.zeros(2, 0).long(), torch.zeros(2, 0)), dense)


# --- static thresholds (K) ------------------------------------------------------------


@pytest.mark.parametrize("fraction", (0.0, 0.01, 0.1))
def test_channel_thresholds_fraction(fraction):
    samples = _randn(2000, 2, 8, seed=3) * torch.linspace(0.5, 4, 8)  # [N, H, D]
    lower, upper = channel_thresholds(samples, fraction)
    assert lower.shape == upper.shape == (2, 8)
    mask = threshold_outliers(samples, lower, upper)
    k, _ = tail_counts(2000, fraction)
    # Exactly k below and k above each channel (random floats have no ties).
    assert torch.equal((samples < lower).sum(0), torch.full((2, 8), k))
    assert torch.equal((samples > upper).sum(0), torch.full((2, 8), k))
    assert abs(float(mask.float().mean()) - fraction) < 1e-3


def test_channel_thresholds_errors():
    with pytest.raises(KvqError):
        channel_thresholds(torch.zeros(10, 4), 0.1)
    with pytest.raises(KvqError, match="too few"):
        channel_thresholds(torch.zeros(2, 1, 4), 0.4)
    with pytest.raises(KvqError):
        threshold_outliers(torch.zeros(3), torch.ones(3), torch.zeros(3))


def test_threshold_excess():
    x = torch.tensor([-3.0, 0.0, 2.5])
    ex = threshold_excess(x, torch.tensor(-1.0), torch.tensor(2.0))
    assert ex.tolist() == [2.0, 0.0, 0.5]


# --- pack_mask_exceptions -------------------------------------------------------------


def test_pack_capacity_overflow_sentinel():
    x = torch.tensor([[5.0, 0.1, -9.0, 0.2, 7.0], [0.0, 0.3, 0.1, 0.2, -0.4]])
    mask = x.abs() > 1
    idx, vals, overflow = pack_mask_exceptions(x, mask, capacity=2)
    assert idx.dtype == torch.int16 and vals.dtype == torch.float32
    assert idx.tolist() == [[2, 4], [5, 5]]  # largest |x| kept, ascending; sentinel D=5
    assert vals.tolist() == [[-9.0, 7.0], [0.0, 0.0]]
    assert overflow.tolist() == [1, 0]
    # The packed slots merge back exactly.
    merged = merge_exceptions(torch.zeros_like(x), idx, vals)
    assert merged.tolist() == [[0.0, 0.0, -9.0, 0.0, 7.0], [0.0] * 5]


def test_pack_capacity_beyond_width_and_zero():
    x = torch.tensor([[3.0, -2.0, 0.5]])
    mask = torch.tensor([[True, True, False]])
    idx, vals, overflow = pack_mask_exceptions(x, mask, capacity=5)
    assert idx.tolist() == [[0, 1, 3, 3, 3]] and vals.tolist() == [[3.0, -2.0, 0, 0, 0]]
    assert overflow.tolist() == [0]
    idx, vals, overflow = pack_mask_exceptions(x, mask, capacity=0)
    assert idx.shape == (1, 0) and overflow.tolist() == [2]


def test_pack_with_custom_score():
    # |x| prefers the big-magnitude channel; distance beyond the thresholds prefers channel 1.
    x = torch.tensor([[10.5, 3.0]])
    lower, upper = torch.tensor([9.0, -1.0]), torch.tensor([10.0, 1.0])
    mask = threshold_outliers(x, lower, upper)
    assert pack_mask_exceptions(x, mask, 1)[0].tolist() == [[0]]
    idx, _, overflow = pack_mask_exceptions(x, mask, 1, score=threshold_excess(x, lower, upper))
    assert idx.tolist() == [[1]] and overflow.tolist() == [1]


@settings(max_examples=25, deadline=None)
@given(
    lead=st.lists(st.integers(1, 4), min_size=1, max_size=3),
    d=st.integers(1, 32),
    capacity=st.integers(0, 40),
    seed=st.integers(0, 2**31 - 1),
)
def test_pack_properties(lead, d, capacity, seed):
    x = _randn(*lead, d, seed=seed)
    mask = x.abs() > 1.0
    idx, vals, overflow = pack_mask_exceptions(x, mask, capacity)
    assert idx.shape == vals.shape == (*lead, capacity)
    count = mask.sum(-1)
    assert torch.equal(overflow, (count - capacity).clamp(min=0))
    used = idx.long() < d
    assert torch.equal(used.sum(-1), count.clamp(max=capacity))
    assert bool((vals[~used] == 0).all())
    merged = merge_exceptions(torch.zeros_like(x), idx, vals)
    kept = merged != 0
    assert bool((mask | ~kept).all())  # only flagged coordinates are stored
    assert torch.equal(merged[kept], x[kept])
    # The kept ones are the largest |x| among the flagged.
    if capacity < d:
        smallest_kept = torch.where(kept, x.abs(), float("inf")).amin(-1)
        largest_dropped = torch.where(mask & ~kept, x.abs(), 0.0).amax(-1)
        assert bool((largest_dropped <= smallest_kept).all())


def test_pack_errors():
    with pytest.raises(KvqError):
        pack_mask_exceptions(torch.zeros(2, 3), torch.zeros(2, 2, dtype=torch.bool), 1)
    with pytest.raises(KvqError):
        pack_mask_exceptions(torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.bool), -1)


def test_range_count():
    assert sparse.range_count(256, 0.01) == 3
    assert sparse.range_count(100, 0.01) == 1
    assert sparse.range_count(10, 0.01) == 1
    assert sparse.range_count(256, 0.0) == 0


def test_row_outliers_range_split_spends_slots_on_the_long_tail():
    x = torch.linspace(-1, 1, 256).repeat(2, 1)
    x[0, [5, 9, 200]] = torch.tensor([40.0, 30.0, 20.0])  # one long upper tail
    x[1, [3, 4]] = torch.tensor([-50.0, -45.0])
    idx, vals, lo, hi = sparse.row_outliers(x, 0.01, "range")
    assert idx.shape == (2, 3)
    assert idx[0].tolist() == [5, 9, 200] and hi[0] < 1.01
    assert {3, 4} <= set(idx[1].tolist()) and lo[1] > -1.01
    assert torch.equal(vals, torch.gather(x, -1, idx.long()))
    # the inlier range is that of what remains
    keep = torch.ones_like(x, dtype=torch.bool).scatter(-1, idx.long(), False)
    assert torch.equal(lo, torch.where(keep, x, float("inf")).amin(-1))
    assert torch.equal(hi, torch.where(keep, x, float("-inf")).amax(-1))


def test_row_outliers_bad_split():
    with pytest.raises(KvqError):
        sparse.row_outliers(torch.randn(4, 16), 0.1, "middle")


def test_allocated_thresholds_follow_the_weights():
    g = torch.Generator().manual_seed(0)
    s = torch.randn(2000, 1, 8, generator=g)
    s[:, 0, 3] *= 10  # a wide channel
    s[:7, 0, 5] = 100.0  # a channel with a few spikes
    w = torch.ones(1, 8)
    w[0, 0] = 0.0  # a dead channel: no outliers, full range
    lo, hi = sparse.allocated_thresholds(s, w, 0.01)
    out = sparse.threshold_outliers(s, lo, hi)
    per = out.sum(0)[0]
    assert int(per[0]) == 0 and lo[0, 0] == s[:, 0, 0].min() and hi[0, 0] == s[:, 0, 0].max()
    assert int(out.sum()) <= 2 * 10 * 8  # the uniform split's budget
    assert int(per[5]) >= 7 and hi[0, 5] < 10  # the spikes are exceptions
    assert int(per[3]) > int(per[1])  # the wide channel gets more of the budget
    lo2, hi2 = sparse.allocated_thresholds(s, w, 0.01)
    assert torch.equal(lo, lo2) and torch.equal(hi, hi2)


@pytest.mark.parametrize("inplace", (False, True))
def test_unchecked_merge_gives_the_checked_result(inplace):
    """checked=False (the decode of a cache's own rows) merges valid slots, used or not,
    exactly as the checked path does."""
    dense = torch.arange(12.0).view(3, 4)
    idx = torch.tensor([[0, 4], [1, 3], [4, 4]])  # 4: an unused slot
    vals = torch.tensor([[-1.0, 9.0], [-2.0, -3.0], [7.0, 7.0]])
    want = merge_exceptions(dense.clone(), idx, vals)
    got = merge_exceptions(dense.clone(), idx, vals, inplace=inplace, checked=False)
    assert torch.equal(got, want)
    full = torch.tensor([[0, 2], [1, 3], [2, 3]])  # every slot used: the in-place scatter
    want = merge_exceptions(dense.clone(), full, vals)
    assert torch.equal(merge_exceptions(dense.clone(), full, vals, inplace, checked=False), want)
