"""Stored-scale policy shared by every quantizer.

A scale is an effective qparam: the value written to the artifact (in its
storage dtype) is the one the encoder must use, so callers re-read the stored
scale with `.float()` before encoding. The policy (see the live-data notes,
0x02A) is:

* round the ideal fp32 scale UP to the storage dtype, so the largest value of
  a range maps to at most the top code and never clips;
* rows with nothing to scale (all zero, constant) store exactly 1;
* refuse a stored scale that is non-finite (overflow);
* never store a scale below the smallest normal number of its dtype (zero or
  subnormal: unsafe under flush-to-zero). What happens to a smaller ideal scale
  depends on where it comes from (`raise_tiny`):
  - a STATIC scale, calibrated once and written to an artifact (a nearly silent
    channel, head or tensor: a dead channel of a real model, a quiet head of a
    tiny random one), is raised to that smallest normal. Rounding a scale up
    never clips, the codes only use less of their range, so calibration floors
    it and records the count in the pass's manifest report (`count_floored`);
  - a scale the cache computes at run time from live rows (per-token and
    per-group values, KIVI's key groups, QServe rows) is raised the same way, on
    both append paths: a quiet head must not stop a generation. Activations
    and weights keep the refusal (KvqError), the quantizers' default;
  - a stored scale read back from an artifact that is zero or subnormal was not
    written by calibration (hand-made or corrupted) and is refused at load
    (`kvq.runtime.validate`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
from torch import Tensor

from kvq.errors import KvqError

STORAGE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def storage_dtype(name: str) -> torch.dtype:
    """The torch dtype for a scheme's `scale_dtype` name."""
    if name not in STORAGE_DTYPES:
        raise KvqError(f"unknown scale dtype {name!r}; known: {', '.join(STORAGE_DTYPES)}")
    return STORAGE_DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """'float16' for torch.float16: the name used in messages and manifests."""
    return str(dtype).removeprefix("torch.")


def check_finite(x: Tensor, what: str) -> None:
    """Raise KvqError if `x` holds a NaN or an infinity (inside `deferred_checks`: record
    where on the device instead, without waiting for it)."""
    if _DEFERRED is not None:
        _DEFERRED.append(torch.isfinite(x).logical_not_())
        return
    if not bool(torch.isfinite(x).all()):
        raise KvqError(f"{what} contains NaN or Inf")


_DEFERRED: list[Tensor] | None = None


def deferring() -> bool:
    """Whether checks of device values are being deferred (`deferred_checks`)."""
    return _DEFERRED is not None


def defer_check(bad: Tensor) -> None:
    """Record device flags (nonzero: a row could not be stored) inside `deferred_checks`."""
    assert _DEFERRED is not None
    _DEFERRED.append(bad)


@contextlib.contextmanager
def deferred_checks() -> Iterator[list[Tensor]]:
    """Within: the checks of device values that would wait for the device (finite rows,
    the append kernels' flags) append their flags (bool or uint8, any shape; nonzero:
    bad) to the yielded list instead of reading them, so a replayable decode step never
    syncs (its caller reduces and reads them later, `KvqLayer`)."""
    global _DEFERRED
    outer, _DEFERRED = _DEFERRED, []
    try:
        yield _DEFERRED
    finally:
        _DEFERRED = outer


def count_floored(t: Tensor) -> int:
    """How many entries of a stored scale tensor sit at its dtype's smallest normal: where
    calibration raised a smaller ideal scale (or, rarely, the ideal rounded up to it)."""
    if not t.dtype.is_floating_point:
        return 0
    return int((t == torch.finfo(t.dtype).tiny).sum())


def step(x: Tensor, up: bool) -> Tensor:
    """The next representable value of x's own dtype, towards +inf or -inf."""
    target = torch.full_like(x, float("inf") if up else float("-inf"))
    return torch.nextafter(x, target)


def rounded_up(ideal: Tensor, dtype: torch.dtype) -> Tensor:
    """fp32 `ideal` [...] in `dtype`, rounded up: casting rounds to nearest, and a value
    that landed below the ideal would make the range maximum encode past the top code,
    so it steps up one ulp. The arithmetic of `store_scale`, without its checks."""
    stored = ideal.to(dtype)
    return torch.where(stored < ideal, step(stored, up=True), stored)  # compared in float32


def floored(stored: Tensor, back: Tensor, nonzero: Tensor) -> Tensor:
    """`stored` with nonzero entries below the dtype's smallest normal raised to it
    (`raise_tiny=False`); back: `stored.float()`."""
    tiny = torch.finfo(stored.dtype).tiny  # a Python scalar: the result keeps stored's dtype
    return torch.where((back < tiny) & nonzero, tiny, stored)


def all_finite(t: Tensor) -> bool:
    """Whether every element of float32 `t` is finite, in one reduction and one device
    read: a NaN or Inf makes the sum non-finite. Finite elements whose sum overflows
    read as not finite too: the callers then take their checked path, slower, not
    wrong."""
    return math.isfinite(t.sum().item())


def store_scale(
    ideal: Tensor, dtype: torch.dtype, nonzero: Tensor, raise_tiny: bool = True
) -> Tensor:
    """Round positive fp32 scales up to `dtype`; entries where `nonzero` is False become 1.

    ideal:   float scales, any shape.
    nonzero: bool, broadcastable to `ideal`; False marks rows with nothing to
             scale (their ideal value is ignored).
    raise_tiny: refuse a scale below the dtype's smallest normal (the default, for
             callers that must not coarsen: activations, weights); False raises it to
             that normal instead: static calibrated scales and the cache's live rows
             (the append kernels floor alike), where a near-silent slice is no error and
             must not stop a generation. Rounding a scale up only coarsens the step,
             here to ~6e-5 in fp16; it never clips.
    Returns the stored scales in `dtype`, shape of the broadcast.
    """
    if dtype not in STORAGE_DTYPES.values():
        raise KvqError(f"scale storage dtype must be one of {list(STORAGE_DTYPES)}, got {dtype}")
    ideal = torch.where(nonzero, ideal.float(), 1.0)
    nonzero = nonzero.expand_as(ideal)
    if bool((ideal < 0).any()):
        raise KvqError("scale must be positive, got a negative ideal scale")
    stored = rounded_up(ideal, dtype)
    name = dtype_name(dtype)
    back = stored.float()
    if bool((~torch.isfinite(back) & nonzero).any()):
        raise KvqError(f"scale overflows {name} (or is NaN); use a wider scale dtype")
    if not raise_tiny:
        return floored(stored, back, nonzero)
    tiny = torch.finfo(dtype).tiny
    under = (back < tiny) & nonzero
    if bool(under.any()):
        smallest = float(ideal[under].min())
        raise KvqError(
            f"scale underflows {name}: ideal scale {smallest:.3g} is below the smallest "
            f"normal {tiny:.3g} (subnormal scales are unsafe under flush-to-zero); "
            "the data range is too small for this scale dtype"
        )
    return stored
