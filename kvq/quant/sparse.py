"""Dense-and-sparse outliers with exact holes (live-data notes, 0x07D).

A few outliers per vector are kept aside exactly (index + full value) so they
do not stretch the dense range. The semantics are full-value REPLACEMENT:

* the dense range (lo/hi) is computed from the inliers only;
* the dense code at an outlier coordinate is a hole: whatever it decodes to
  is discarded, and `merge_exceptions` writes the stored value there;
* the sparse value is never added to a decoded dense value (a low-bit
  lookup level is generally nonzero, so "dense + sparse" would be wrong).

Two ways to pick outliers:

* V rows (dynamic): `row_outliers` takes the k_hi largest and k_lo smallest
  values of each row, a fixed count per row;
* K channels (static): `channel_thresholds` calibrates per-(head, channel)
  thresholds, `threshold_outliers` flags values strictly outside them (a
  variable count per row) and `pack_mask_exceptions` packs those into a fixed
  capacity, counting what did not fit.

Exception slots are (idx int16, vals) pairs of fixed width k; an unused slot
has idx == D (the row width), the `SENTINEL` convention: it is not a valid
coordinate, it fits int16 and it can be scattered into a scratch column.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from kvq.errors import KvqError
from kvq.quant.qparams import check_finite

INDEX_DTYPE = torch.int16
MAX_WIDTH = torch.iinfo(INDEX_DTYPE).max  # the sentinel D must fit too


def _check_width(d: int) -> None:
    if d > MAX_WIDTH:
        raise KvqError(f"vector width {d} exceeds the int16 index limit {MAX_WIDTH}")


def tail_counts(width: int, fraction: float) -> tuple[int, int]:
    """(k_lo, k_hi): outliers per tail for `fraction` of `width` values split over both tails.

    k_lo = k_hi = ceil(fraction * width / 2) when fraction > 0, else (0, 0).
    The product is rounded to 9 decimals before the ceiling so float noise
    (0.14 * 100 == 14.000000000000002) does not add a spurious outlier.
    """
    if not 0.0 <= fraction < 0.5:
        raise KvqError(f"outlier fraction must be in [0, 0.5), got {fraction!r}")
    if width < 1:
        raise KvqError(f"vector width must be positive, got {width}")
    if fraction == 0.0:
        return 0, 0
    k = math.ceil(round(fraction * width / 2, 9))
    return k, k


def range_count(width: int, fraction: float) -> int:
    """Outliers per row for `fraction` of `width` values as ONE count over both tails.

    round(fraction * width) (half up, after rounding to 9 decimals against float
    noise), at least 1 when fraction > 0; 0 when fraction is 0.
    """
    if not 0.0 <= fraction < 0.5:
        raise KvqError(f"outlier fraction must be in [0, 0.5), got {fraction!r}")
    if width < 1:
        raise KvqError(f"vector width must be positive, got {width}")
    if fraction == 0.0:
        return 0
    return max(1, math.floor(round(fraction * width, 9) + 0.5))


def row_outliers(
    x: Tensor, fraction: float, split: str = "tails"
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per-row dynamic outliers (V): the most extreme values of each row.

    split "tails": the k_hi largest and k_lo smallest (`tail_counts`, the
    same count in each tail). split "range": k = `range_count(D, fraction)`
    values in all, taken one at a time from whichever end of the row's sorted
    values shrinks the remaining (inlier) range more, so a row with one long
    tail spends its slots there (ties take the high end).

    x: [..., D]. Returns
      idx       [..., k] int16, ascending coordinate order;
      vals      [..., k] x's dtype, the exact values x[..., idx];
      inlier_lo [...]    x's dtype, min over the remaining D - k coordinates;
      inlier_hi [...]    x's dtype, max over the remaining coordinates.
    One stable sort per row selects both tails, so the tails never overlap
    and ties break deterministically: among equal values the lower coordinate
    sorts first (into the low tail first, out of the high tail first).
    Rows with D <= k (no inlier left) raise KvqError.
    """
    if x.dim() == 0:
        raise KvqError("row_outliers needs at least one dimension")
    if split not in ("tails", "range"):
        raise KvqError(f"outlier split must be 'tails' or 'range', got {split!r}")
    check_finite(x, "input")
    d = x.shape[-1]
    _check_width(d)
    if split == "tails":
        k_lo, k_hi = tail_counts(d, fraction)
        k = k_lo + k_hi
    else:
        k = range_count(d, fraction)
    if d <= k:
        raise KvqError(f"row width {d} leaves no inliers after {k} outliers (fraction {fraction})")
    ordered, order = torch.sort(x, dim=-1, stable=True)  # [..., D] ascending
    if split == "tails":
        inlier_lo = ordered[..., k_lo]
        inlier_hi = ordered[..., d - 1 - k_hi]
        picked = torch.cat([order[..., :k_lo], order[..., d - k_hi :]], dim=-1)  # [..., k]
    else:
        lead = ordered.shape[:-1]
        flat = ordered.reshape(-1, d)
        gaps = flat[:, 1:] - flat[:, :-1]  # [N, D - 1]: gap i lies between sorted i and i + 1
        n = flat.shape[0]
        a = torch.zeros(n, 1, dtype=torch.long, device=x.device)  # first inlier (sorted)
        b = torch.full((n, 1), d - 1, dtype=torch.long, device=x.device)  # last inlier
        for _ in range(k):  # (k is a few: 3 of 256 at 1 %)
            take_low = gaps.gather(1, a) > gaps.gather(1, b - 1)
            a = a + take_low
            b = b + take_low - 1  # the high end moves when the low one does not
        inlier_lo = flat.gather(1, a).reshape(lead)
        inlier_hi = flat.gather(1, b).reshape(lead)
        pos = torch.arange(d, device=x.device)
        out = ((pos < a) | (pos > b)).reshape(ordered.shape)
        picked = order[out].reshape(*lead, k)
    idx, _ = torch.sort(picked, dim=-1)
    vals = torch.gather(x, -1, idx)
    return idx.to(INDEX_DTYPE), vals, inlier_lo, inlier_hi


def channel_thresholds(samples: Tensor, fraction: float) -> tuple[Tensor, Tensor]:
    """Static per-(head, channel) outlier thresholds (K) from calibration samples.

    samples: [N, H, D] (sink tokens already excluded by the caller, 0x07E).
    Returns (lower, upper), each [H, D] in the samples' dtype. With
    k = tail_counts(N, fraction)[0], lower is the (k+1)-th smallest and upper
    the (k+1)-th largest sample of each channel, so (without ties) exactly k
    samples lie strictly below lower and k strictly above upper: about
    `fraction` of the samples are outliers. fraction 0 gives the min and max.
    Uses `kthvalue` (torch.quantile refuses large inputs).
    """
    if samples.dim() != 3:
        raise KvqError(f"channel_thresholds expects [N, H, D] samples, got {tuple(samples.shape)}")
    check_finite(samples, "calibration samples")
    n = samples.shape[0]
    k, _ = tail_counts(max(n, 1), fraction)
    if n <= 2 * k:
        raise KvqError(f"{n} calibration samples are too few for outlier fraction {fraction}")
    lower = torch.kthvalue(samples, k + 1, dim=0).values
    upper = torch.kthvalue(samples, n - k, dim=0).values
    return lower, upper


def allocated_thresholds(
    samples: Tensor, weights: Tensor, fraction: float, max_tail: float | None = None
) -> tuple[Tensor, Tensor]:
    """Static per-(head, channel) thresholds (K) with the outlier budget spent where it matters.

    samples: [N, H, D] (sinks excluded); weights: [H, D] non-negative
    sensitivities (the Fisher sums). The budget is the same as
    `channel_thresholds`' (2 * k per channel, k = tail_counts(N, fraction)[0],
    so about `fraction` of all samples), but instead of the same count in every
    tail it is handed out greedily, in multiples of ceil(k / 4) samples, to the
    (channel, tail) whose next outliers shrink the channel's weighted squared
    half-range, weight * ((upper - lower) / 2) ** 2, the most per outlier
    (looking ahead over every count up to the cap, so a cluster of spikes that
    only pays once all are out is still found): the dense
    quantization error of a channel scales with its normaliser squared, and the
    codebook is shared, so this is the budget's best use under the diagonal
    Fisher. A tail takes at most `max_tail` (default 5 * fraction) of the
    samples. Zero-weight channels (e.g. keys no query ever reads) get no
    outliers and keep their full calibration range. Deterministic: ties go to
    the lower (tail, head, channel) index. Returns (lower, upper), [H, D] each,
    in the samples' dtype; a channel with t_lo / t_hi outliers gets the
    (t_lo + 1)-th smallest / (t_hi + 1)-th largest sample.
    """
    import heapq

    if samples.dim() != 3:
        raise KvqError(
            f"allocated_thresholds expects [N, H, D] samples, got {tuple(samples.shape)}"
        )
    check_finite(samples, "calibration samples")
    n, h, d = samples.shape
    if weights.shape != (h, d):
        raise KvqError(f"weights shape {tuple(weights.shape)} does not match channels {(h, d)}")
    check_finite(weights, "weights")
    if bool((weights < 0).any()):
        raise KvqError("threshold weights must be non-negative")
    k, _ = tail_counts(max(n, 1), fraction)
    if n <= 2 * k:
        raise KvqError(f"{n} calibration samples are too few for outlier fraction {fraction}")
    cap = math.floor((5 * fraction if max_tail is None else max_tail) * n)
    cap = max(0, min(cap, (n - 1) // 2))
    srt = samples.reshape(n, h * d).double().sort(dim=0).values  # [N, C] ascending
    w = weights.reshape(-1).double().tolist()
    step = max(1, math.ceil(k / 4))
    cnt = [[0] * (h * d), [0] * (h * d)]  # low / high tail counts per channel

    def push(heap, c: int) -> None:
        # Best gain per outlier over any number of further steps in each tail, so a
        # cluster of equal spikes (no gain until all are out) is not skipped.
        lo, hi = cnt[0][c], cnt[1][c]
        if w[c] <= 0:
            return
        col = srt[:, c]
        now = (0.5 * float(col[n - 1 - hi] - col[lo])) ** 2
        for tail in (0, 1):
            t = (lo, hi)[tail]
            if t + step > cap:
                continue
            steps = torch.arange(t + step, cap + 1, step)
            if tail == 0:
                half = 0.5 * (col[n - 1 - hi] - col[steps])
            else:
                half = 0.5 * (col[n - 1 - steps] - col[lo])
            rate = w[c] * (now - half.square()) / (steps - t).double()
            j = int(torch.argmax(rate))  # first of equal rates: the fewest outliers
            heapq.heappush(heap, (-float(rate[j]), tail, c, int(steps[j]) - t, lo, hi))

    heap: list = []
    for c in range(h * d):
        push(heap, c)
    budget = 2 * k * h * d
    used = 0
    while heap:
        rate, tail, c, m, lo, hi = heapq.heappop(heap)
        if (lo, hi) != (cnt[0][c], cnt[1][c]):
            continue  # stale: the channel moved since this entry was pushed
        if rate >= 0:
            break  # nothing left that shrinks a weighted range
        if used + m > budget:
            m = (budget - used) // step * step
            if m == 0:
                break
        cnt[tail][c] += m
        used += m
        push(heap, c)
    lo_idx = torch.tensor(cnt[0])
    hi_idx = n - 1 - torch.tensor(cnt[1])
    cols = torch.arange(h * d)
    lower = srt[lo_idx, cols].reshape(h, d).to(samples.dtype)
    upper = srt[hi_idx, cols].reshape(h, d).to(samples.dtype)
    return lower, upper


def threshold_outliers(x: Tensor, lower: Tensor, upper: Tensor) -> Tensor:
    """bool mask, True where x is strictly outside [lower, upper]; thresholds broadcast against x.

    x: [..., H, D] with lower/upper [H, D], or any broadcastable shapes.
    """
    if bool((lower > upper).any()):
        raise KvqError("outlier lower threshold exceeds the upper threshold")
    return (x < lower) | (x > upper)


def threshold_excess(x: Tensor, lower: Tensor, upper: Tensor) -> Tensor:
    """How far x lies beyond [lower, upper] (0 inside), fp32, broadcast shape.

    A priority for `pack_mask_exceptions` that ranks outliers by how much they
    would clip, independent of each channel's typical magnitude.
    """
    xf = x.float()
    return torch.clamp(lower.float() - xf, min=0) + torch.clamp(xf - upper.float(), min=0)


def check_slots(idx: Tensor, d: int) -> None:
    """Refuse exception slot indices [..., k] outside [0, d] (d marks an unused slot) or
    repeated within a row (a scatter with duplicates would pick a value in no defined
    order)."""
    i = idx.long()
    if bool(((i < 0) | (i > d)).any()):
        raise KvqError(f"exception index out of range [0, {d}] ({d} marks an unused slot)")
    srt, _ = torch.sort(i, dim=-1)
    if bool(((srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] < d)).any()):
        raise KvqError("duplicate exception index within one row")


def merge_exceptions(
    dense: Tensor, idx: Tensor, vals: Tensor, inplace: bool = False, checked: bool = True
) -> Tensor:
    """Dense decoded values with the exception coordinates REPLACED by the sparse values.

    dense: [..., D] decoded dense path; idx: [..., k] int coordinates (D marks
    an unused slot); vals: [..., k] the full values. Returns [..., D] in the
    promotion of dense's and vals' dtypes, so a stored value comes back
    bit-exactly. Invalid or duplicate coordinates raise KvqError (`check_slots`).

    inplace: dense is the caller's own scratch buffer; when no slot is unused and
    the dtypes agree, the values are scattered straight into it (no copy) and it is
    returned. checked=False: the caller vouches for idx (the cache's rows, checked
    where they enter it), saving a sort and two device reads per decode.
    """
    d = dense.shape[-1]
    if idx.shape != vals.shape or idx.shape[:-1] != dense.shape[:-1]:
        raise KvqError(
            f"exception shapes idx {tuple(idx.shape)}, vals {tuple(vals.shape)} do not "
            f"match dense {tuple(dense.shape)}"
        )
    if idx.shape[-1] == 0:
        return dense.to(torch.promote_types(dense.dtype, vals.dtype))
    i = idx.long()
    if checked:
        check_slots(i, d)
    out_dtype = torch.promote_types(dense.dtype, vals.dtype)
    if inplace and dense.dtype == out_dtype and int(i.max()) < d:  # no unused slot
        return dense.scatter_(-1, i, vals.to(out_dtype))
    # One scratch column at position D soaks up every unused slot.
    scratch = dense.new_zeros((*dense.shape[:-1], 1), dtype=out_dtype)
    wide = torch.cat([dense.to(out_dtype), scratch], dim=-1)  # [..., D + 1]
    wide.scatter_(-1, i, vals.to(out_dtype))
    return wide[..., :d]


def pack_mask_exceptions(
    x: Tensor, mask: Tensor, capacity: int, score: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Pack a variable number of flagged outliers per row into `capacity` fixed slots.

    x: [..., D]; mask: [..., D] bool (e.g. `threshold_outliers`); score:
    optional [..., D] priority, higher kept first (default |x|; pass
    `threshold_excess` to rank by distance beyond the thresholds). Returns
      idx      [..., capacity] int16, ascending, D in unused slots;
      vals     [..., capacity] float32 (exact for fp32/fp16/bf16 x; 0 in unused slots);
      overflow [...] int64, flagged outliers that did not fit (they stay in
               the dense path and clip to its end levels).
    One stable descending sort of the score per row: equal scores keep the
    lower coordinate, so the choice is deterministic.
    """
    if x.dim() == 0 or mask.shape != x.shape:
        raise KvqError(f"mask shape {tuple(mask.shape)} must equal x shape {tuple(x.shape)}")
    if capacity < 0:
        raise KvqError(f"exception capacity must be non-negative, got {capacity}")
    check_finite(x, "input")
    d = x.shape[-1]
    _check_width(d)
    mask = mask.bool()
    prio = x.float().abs() if score is None else score.float().expand_as(x)
    # Unflagged coordinates sort after every flagged one, whatever their priority.
    prio = torch.where(mask, prio, float("-inf"))
    take = min(capacity, d)
    order = torch.sort(prio, dim=-1, descending=True, stable=True).indices[..., :take]
    used = torch.gather(mask, -1, order)  # [..., take]
    idx = torch.where(used, order, d)
    if take < capacity:  # more slots than coordinates: pad with unused slots
        pad = idx.new_full((*idx.shape[:-1], capacity - take), d)
        idx = torch.cat([idx, pad], dim=-1)
    idx, _ = torch.sort(idx, dim=-1)  # sentinels (== D) go last
    vals = torch.gather(torch.cat([x.float(), x.new_zeros(*x.shape[:-1], 1).float()], -1), -1, idx)
    overflow = mask.sum(-1) - (idx < d).sum(-1)
    return idx.to(INDEX_DTYPE), vals, overflow
