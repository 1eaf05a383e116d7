"""FP8 (e4m3 / e5m2) storage with an external scale.

x_hat = fp8(x / scale) * scale. The scale maps the range maximum to the
format's largest finite value; anything beyond saturates to +-max rather than
becoming inf or NaN (e4m3fn has no inf at all).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvq.errors import KvqError
from kvq.quant.qparams import check_finite, store_scale

FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def _dtype(fmt: str) -> torch.dtype:
    if fmt not in FP8_DTYPES:
        raise KvqError(f"unknown fp8 format {fmt!r}; known: {', '.join(FP8_DTYPES)}")
    return FP8_DTYPES[fmt]


def fp8_max(fmt: str) -> float:
    """Largest finite value: 448 for e4m3, 57344 for e5m2."""
    return float(torch.finfo(_dtype(fmt)).max)


# (exponent bits, mantissa bits, exponent bias) of each format
FP8_FIELDS = {"e4m3": (4, 3, 7), "e5m2": (5, 2, 15)}


def fp16_placement(fmt: str) -> tuple[int, float]:
    """(shift, factor): an fp8 code c's bits rearranged as the fp16 bit pattern
    (c & 0x80) << 8 | (c & 0x7F) << shift (sign on the sign, exponent and mantissa on the
    fp16's lowest exponent and highest mantissa bits) read as fp16 are exactly c's value /
    factor, subnormals included: how a kernel decodes fp8 without a table (the 2^(15 -
    bias) factor goes into a scale). Not for the NaN / Inf patterns, which encoding never
    produces."""
    _dtype(fmt)
    _, mantissa, bias = FP8_FIELDS[fmt]
    return 10 - mantissa, float(2 ** (15 - bias))


def fp8_scale(amax: Tensor, fmt: str, scale_dtype=torch.float32, raise_tiny: bool = True) -> Tensor:
    """Stored scale amax / fp8_max (rounded up to `scale_dtype`); 1 where amax == 0.

    amax: [...] non-negative absolute maxima. Returns [...] in `scale_dtype`.
    raise_tiny: see `store_scale` (False for a static, calibrated scale).
    """
    top = fp8_max(fmt)
    check_finite(amax, "amax")
    amax = amax.float()
    if bool((amax < 0).any()):
        raise KvqError("amax must be non-negative")
    return store_scale(amax / top, scale_dtype, amax > 0, raise_tiny)


def fp8_encode(x: Tensor, scale: Tensor, fmt: str) -> Tensor:
    """fp8 codes of x / scale, saturated to +-max; shaped like x, scale broadcasts."""
    dtype, top = _dtype(fmt), fp8_max(fmt)
    check_finite(x, "input")
    # The cast rounds to nearest even; clamp first so out-of-range values
    # saturate instead of turning into inf (e5m2) or NaN (e4m3fn).
    return (x.float() / scale.float()).clamp_(-top, top).to(dtype)


def fp8_decode(codes: Tensor, scale: Tensor, dtype=torch.float32) -> Tensor:
    """x_hat = codes * scale, returned in `dtype`."""
    if codes.dtype not in FP8_DTYPES.values():
        raise KvqError(f"fp8 codes must be a float8 tensor, got {codes.dtype}")
    return (codes.float() * scale.float()).to(dtype)
