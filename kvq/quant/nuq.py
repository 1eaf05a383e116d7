"""Non-uniform (codebook) quantization, KVQuant style (live-data notes, 0x07C).

A value is first normalised to [-1, 1] by a (scale, center) pair: per channel
for K (calibrated range), per token for V (the row's inlier range, see
`kvq.quant.sparse.row_outliers`). The code is then the index of the nearest
level of a small sorted codebook shared by the whole layer:

    x_norm = (x - center) / scale          # [..., D], within [-1, 1]
    code   = argmin_i |x_norm - codebook[i]|
    x_hat  = codebook[code] * scale + center

A code is a lookup index, not an affine integer: code 0 decodes to
codebook[0], which is generally not zero. `uniform_codebook` gives evenly
spaced levels so the uniform ablation runs through the same code path.

Codes are uint8 and left unpacked here; see `kvq.quant.packing`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvq.errors import KvqError
from kvq.quant.qparams import (
    all_finite,
    check_finite,
    deferring,
    dtype_name,
    floored,
    rounded_up,
    store_scale,
)
from kvq.tensor_memo import Memo, memoised

MAX_BITS = 8  # codes are uint8


def _check_bits(bits: int) -> int:
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= MAX_BITS:
        raise KvqError(f"codebook bits must be an integer in [1, {MAX_BITS}], got {bits!r}")
    return 2**bits


# --- normalisation --------------------------------------------------------------------


def normalizer(
    lo: Tensor, hi: Tensor, scale_dtype=torch.float16, raise_tiny: bool = True
) -> tuple[Tensor, Tensor]:
    """(scale, center) in `scale_dtype` mapping [lo, hi] into [-1, 1].

    lo, hi: broadcastable [...] range minima and maxima (e.g. [H, D] for K
    channels, [B, H, T] for V rows). Returns (scale, center), both shaped like
    the broadcast, in `scale_dtype`; re-read them with `.float()` before use.

    center is (hi + lo) / 2 rounded to nearest in `scale_dtype`. Because that
    rounding can move the center off the true midpoint, the scale is the
    half-width measured from the STORED center, max(hi - c, c - lo), rounded
    up by `store_scale`; it equals (hi - lo) / 2 whenever the center is exact.
    This way every x in [lo, hi] normalises to within [-1, 1] and nothing
    clips (the same reason `affine_qparams` rounds its offset down).
    Constant rows (hi == lo) get scale 1. A range too small for the scale
    dtype raises KvqError, or with raise_tiny=False (static, calibrated
    ranges and the cache's live rows) gets the dtype's smallest normal
    (stored-scale policy, `kvq.quant.qparams`).
    """
    check_finite(lo, "range minimum")
    check_finite(hi, "range maximum")
    lo, hi = torch.broadcast_tensors(lo.float(), hi.float())
    if bool((lo > hi).any()):
        raise KvqError("range minimum exceeds range maximum")
    # Halve before adding so two large fp32 bounds cannot overflow the sum.
    center = (lo * 0.5 + hi * 0.5).to(scale_dtype)
    if not bool(torch.isfinite(center.float()).all()):
        raise KvqError(f"center overflows {dtype_name(scale_dtype)}; use a wider scale dtype")
    c = center.float()
    half = torch.maximum(hi - c, c - lo)
    scale = store_scale(half, scale_dtype, hi > lo, raise_tiny)
    return scale, center


def live_normalizer(lo: Tensor, hi: Tensor, scale_dtype=torch.float16) -> tuple[Tensor, Tensor]:
    """`normalizer(lo, hi, scale_dtype, raise_tiny=False)` for a cache's live rows (each
    row's own bounds, lo <= hi), the same arithmetic with one device read instead of
    five: every refusal there (a NaN or Inf bound, a center or scale past the dtype)
    leaves a non-finite center or scale, so one finiteness test stands for them all, and
    the checked path then says which. Runs on every appended row."""
    if deferring():  # the checks are recorded on the device: no read at all
        return normalizer(lo, hi, scale_dtype, raise_tiny=False)
    lo, hi = lo.float(), hi.float()
    center = (lo * 0.5 + hi * 0.5).to(scale_dtype)
    c = center.float()
    varying = hi > lo
    stored = rounded_up(torch.where(varying, torch.maximum(hi - c, c - lo), 1.0), scale_dtype)
    back = stored.float()
    if not all_finite(back + c):
        return normalizer(lo, hi, scale_dtype, raise_tiny=False)
    return floored(stored, back, varying), center


def normalize(x: Tensor, scale: Tensor, center: Tensor) -> Tensor:
    """x_norm = (x - center) / scale in fp32; scale/center broadcast against x [...]."""
    return (x.float() - center.float()) / scale.float()


def denormalize(x_norm: Tensor, scale: Tensor, center: Tensor, dtype=torch.float32) -> Tensor:
    """x = x_norm * scale + center, returned in `dtype`: the inverse of `normalize`."""
    return (x_norm.float() * scale.float() + center.float()).to(dtype)


# --- codebooks ------------------------------------------------------------------------


def uniform_codebook(bits: int) -> Tensor:
    """The 2**bits evenly spaced levels over [-1, 1] (both ends included), float32 [2**bits]."""
    return torch.linspace(-1.0, 1.0, _check_bits(bits), dtype=torch.float32)


def _strictly_increasing(levels: Tensor) -> Tensor:
    """Nudge sorted float32 levels up by ulps where two landed on the same value.

    Distinct k-means clusters in 1-D have distinct means, but rounding the
    float64 centroids to float32 can merge two that are closer than an ulp;
    a codebook with a repeated level would make the nearest-level code
    ambiguous, so the later copy moves to the next representable value.
    """
    out = levels.clone()
    for i in range(1, out.numel()):  # at most 255 steps
        if out[i] <= out[i - 1]:
            out[i] = torch.nextafter(out[i - 1], torch.tensor(float("inf")))
    return out


def fit_codebook(
    values: Tensor,
    bits: int,
    weights: Tensor | None = None,
    seed: int = 0,
    max_samples: int = 200_000,
) -> Tensor:
    """Sensitivity-weighted 1-D k-means codebook (KVQuant's non-uniform datatype).

    values:  [N] normalised calibration values (nominally within [-1, 1]).
    weights: [N] non-negative sensitivities (diagonal Fisher), or None for
             plain k-means.
    Returns the sorted, strictly increasing centroids, float32 [2**bits].

    Values are clamped to [-1, 1] first: `nuq_encode` clamps anything outside
    to the end levels anyway, so the codebook is fitted to what it will encode.
    Samples with zero weight contribute nothing to the objective and are
    dropped. If more than `max_samples` remain, a subsample drawn by
    `torch.randperm` with a `torch.Generator` seeded by `seed` is used (the
    same rows of values and weights). KMeans then runs single-threaded with
    `random_state=seed` and one k-means++ initialisation, so identical inputs
    and seed give a bit-identical codebook (a multi-threaded Lloyd step sums
    in thread order, which is not reproducible to the bit).

    Degenerate input: fewer distinct values than the 2**bits clusters raises
    KvqError rather than padding the codebook with invented levels, since a
    padded level would be fitted to nothing; collect more calibration data or
    use fewer bits.
    """
    k = _check_bits(bits)
    if values.dim() != 1:
        raise KvqError(
            f"fit_codebook expects a 1-D tensor of values, got shape {tuple(values.shape)}"
        )
    if max_samples < k:
        raise KvqError(f"max_samples ({max_samples}) must be at least the {k} codebook levels")
    check_finite(values, "codebook values")
    x = values.double().clamp(-1.0, 1.0)
    w = None
    if weights is not None:
        if weights.shape != values.shape:
            raise KvqError(
                f"weights shape {tuple(weights.shape)} does not match values {tuple(values.shape)}"
            )
        check_finite(weights, "codebook weights")
        w = weights.double()
        if bool((w < 0).any()):
            raise KvqError("codebook weights must be non-negative")
        keep = w > 0
        x, w = x[keep], w[keep]
    if x.numel() > max_samples:
        gen = torch.Generator().manual_seed(seed)
        pick = torch.randperm(x.numel(), generator=gen)[:max_samples]
        x = x[pick]
        w = None if w is None else w[pick]
    distinct = torch.unique(x).numel()
    if distinct < k:
        raise KvqError(
            f"cannot fit a {bits}-bit codebook ({k} levels) to {distinct} distinct "
            "(positively weighted) values; use more calibration data or fewer bits"
        )
    # Imported here: sklearn takes seconds to import and only calibration needs it,
    # not the runtime that encodes with a finished codebook.
    from sklearn.cluster import KMeans
    from threadpoolctl import threadpool_limits

    km = KMeans(n_clusters=k, init="k-means++", n_init=1, random_state=seed)
    with threadpool_limits(limits=1):
        km.fit(x.numpy().reshape(-1, 1), sample_weight=None if w is None else w.numpy())
    centers = torch.from_numpy(km.cluster_centers_).reshape(-1).sort().values
    levels = centers.float().clamp(-1.0, 1.0)
    return _strictly_increasing(levels)


# --- encode / decode ------------------------------------------------------------------


# a layer's codebook is static, and checking it costs two device syncs, on every append and
# decode step otherwise: checked once per codebook tensor (again after an in-place edit)
_CHECKED: Memo = {}


def _checked(codebook: Tensor) -> tuple[Tensor, Tensor]:
    """(levels float32 [L], decision boundaries float32 [L - 1]) of a codebook checked once:
    1-D, 2..256 finite, strictly increasing levels."""
    return memoised(_CHECKED, codebook, lambda: _check_levels(codebook))


def _check_levels(codebook: Tensor) -> tuple[Tensor, Tensor]:
    if codebook.dim() != 1 or not 2 <= codebook.numel() <= 2**MAX_BITS:
        raise KvqError(
            f"codebook must be 1-D with 2..{2**MAX_BITS} levels, got shape {tuple(codebook.shape)}"
        )
    cb = codebook.float()
    check_finite(cb, "codebook")
    if not bool((cb[1:] > cb[:-1]).all()):
        raise KvqError("codebook levels must be strictly increasing")
    return cb, (cb[:-1] + cb[1:]) * 0.5  # [L - 1] midpoints between neighbouring levels


def _check_codebook(codebook: Tensor) -> Tensor:
    """codebook as float32 [L], checked (see `_checked`)."""
    return _checked(codebook)[0]


def decision_boundaries(codebook: Tensor) -> Tensor:
    """The midpoints between neighbouring levels, float32 [L - 1]: `nuq_encode` maps x to
    the number of boundaries below it (ties to the lower level). Computed once per codebook;
    the Triton encoders search the same tensor."""
    return _checked(codebook)[1]


def nuq_encode(x_norm: Tensor, codebook: Tensor) -> Tensor:
    """uint8 index of the nearest codebook level, same shape as x_norm [...].

    Decision boundaries are the midpoints between neighbouring levels;
    `torch.bucketize(right=False)` maps a value exactly on a midpoint to the
    lower level, deterministically. Values beyond the end levels (including
    outside [-1, 1]) take the end codes.
    """
    mids = decision_boundaries(codebook)
    check_finite(x_norm, "normalised input")
    return torch.bucketize(x_norm.float().contiguous(), mids, right=False).to(torch.uint8)


def nuq_decode(codes: Tensor, codebook: Tensor) -> Tensor:
    """The float32 level of each code: codebook[codes], same shape as codes [...]."""
    cb = _check_codebook(codebook)
    idx = codes.long()
    if idx.numel() and bool(((idx < 0) | (idx >= cb.numel())).any()):
        raise KvqError(f"code out of range for a {cb.numel()}-level codebook")
    return cb[idx]
