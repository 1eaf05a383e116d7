"""Uniform integer quantizers (2, 3, 4 or 8 bits).

Two conventions, both computed in fp32 whatever the input dtype:

* symmetric: signed int8 codes in [-qmax, qmax], qmax = 2^(b-1) - 1,
  x_hat = code * scale;
* asymmetric: unsigned uint8 codes in [0, 2^b - 1],
  x_hat = code * scale + offset, where offset is the range minimum stored in
  the scale dtype (a floating offset, not an integer zero-point).

Scales follow the stored-scale policy of `kvq.quant.qparams`: the encoder uses
the re-read stored value, so decode(encode(x)) uses exactly the artifact's
qparams. Codes are left unpacked here; see `kvq.quant.packing`.
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
    step,
    store_scale,
)
from kvq.quant.schemes import INT_BITS

Dims = int | tuple[int, ...]


def _check_bits(bits: int) -> None:
    if bits not in INT_BITS:
        raise KvqError(f"bits must be one of {INT_BITS}, got {bits!r}")


def qmax_signed(bits: int) -> int:
    """Largest symmetric code magnitude: 127 for 8 bits, 1 for 2 bits."""
    _check_bits(bits)
    return 2 ** (bits - 1) - 1


def levels(bits: int) -> int:
    """Largest asymmetric code: 2^bits - 1."""
    _check_bits(bits)
    return 2**bits - 1


# --- symmetric ------------------------------------------------------------------------


def symmetric_qparams(
    amax: Tensor, bits: int, scale_dtype=torch.float16, raise_tiny: bool = True
) -> Tensor:
    """Stored scale amax / qmax (rounded up to `scale_dtype`); 1 where amax == 0.

    amax: [...] non-negative absolute maxima. Returns [...] in `scale_dtype`.
    raise_tiny: see `store_scale` (False for a static, calibrated scale).
    """
    qmax = qmax_signed(bits)
    check_finite(amax, "amax")
    amax = amax.float()
    if bool((amax < 0).any()):
        raise KvqError("amax must be non-negative")
    return store_scale(amax / qmax, scale_dtype, amax > 0, raise_tiny)


def symmetric_encode(x: Tensor, scale: Tensor, bits: int) -> Tensor:
    """int8 codes round(x / scale) clamped to [-qmax, qmax] (ties to even).

    x: [...]; scale: broadcastable to x (the stored scale, any float dtype).
    """
    qmax = qmax_signed(bits)
    return torch.round(x.float() / scale.float()).clamp_(-qmax, qmax).to(torch.int8)


def symmetric_decode(codes: Tensor, scale: Tensor, dtype=torch.float32) -> Tensor:
    """x_hat = codes * scale, returned in `dtype`; scale broadcasts against codes."""
    return (codes.float() * scale.float()).to(dtype)


def quantize_symmetric(
    x: Tensor, bits: int, dim: Dims, scale_dtype=torch.float16, raise_tiny: bool = True
) -> tuple[Tensor, Tensor]:
    """Dynamic symmetric quantization with one scale per slice reduced over `dim`.

    x: [...]. Returns (codes int8 shaped like x, scale in `scale_dtype` shaped
    like x with the `dim` axes kept as size 1, so it broadcasts back).
    raise_tiny: see `store_scale` (False for the cache's live rows).
    """
    _check_bits(bits)
    amax = x.float().abs().amax(dim=dim, keepdim=True)
    scale = None
    if not raise_tiny and not deferring():  # the cache's rows: one device read, not four
        nonzero = amax > 0
        stored = rounded_up(torch.where(nonzero, amax / qmax_signed(bits), 1.0), scale_dtype)
        back = stored.float()
        if all_finite(back):  # a NaN/Inf row or an overflow fails here
            scale = floored(stored, back, nonzero)
    if scale is None:
        check_finite(x, "input")
        scale = symmetric_qparams(amax, bits, scale_dtype, raise_tiny)
    return symmetric_encode(x, scale, bits), scale


# --- asymmetric -----------------------------------------------------------------------


def affine_qparams(
    lo: Tensor, hi: Tensor, bits: int, scale_dtype=torch.float16, raise_tiny: bool = True
) -> tuple[Tensor, Tensor]:
    """(scale, offset) in `scale_dtype` covering [lo, hi] with 2^bits - 1 steps.

    lo, hi: broadcastable [...] range minima and maxima.
    offset is lo rounded DOWN to `scale_dtype` (so lo >= offset and nothing
    below the range clips); scale = (hi - offset) / (2^bits - 1) rounded up.
    Constant rows (hi == lo, all-zero included) get scale 1 and offset = lo
    rounded to nearest, so they decode within the dtype's rounding of the value.
    raise_tiny: see `store_scale` (False for static, calibrated ranges and live cache rows).
    """
    top = levels(bits)
    check_finite(lo, "range minimum")
    check_finite(hi, "range maximum")
    lo, hi = torch.broadcast_tensors(lo.float(), hi.float())
    if bool((lo > hi).any()):
        raise KvqError("range minimum exceeds range maximum")
    offset, varying = _offset(lo, hi, scale_dtype)
    if not bool(torch.isfinite(offset.float()).all()):
        raise KvqError(f"offset overflows {dtype_name(scale_dtype)}; use a wider scale dtype")
    scale = store_scale((hi - offset.float()) / top, scale_dtype, varying, raise_tiny)
    return scale, offset


def _offset(lo: Tensor, hi: Tensor, scale_dtype) -> tuple[Tensor, Tensor]:
    """(offset, varying): lo rounded down to `scale_dtype` where hi > lo, else to nearest."""
    near = lo.to(scale_dtype)
    down = torch.where(near > lo, step(near, up=False), near)  # compared in float32
    varying = hi > lo
    return torch.where(varying, down, near), varying


def _live_qparams(lo: Tensor, hi: Tensor, bits: int, scale_dtype) -> tuple[Tensor, Tensor] | None:
    """`affine_qparams(lo, hi, bits, scale_dtype, raise_tiny=False)` for the minima and
    maxima of one tensor's slices, checked with a single read of the device: every
    refusal there (a NaN or Inf row, an offset or scale past the dtype) leaves a
    non-finite offset or scale, so one finiteness test stands for them all. None when
    it fails (the caller explains why through the checked path)."""
    offset, varying = _offset(lo, hi, scale_dtype)
    ideal = torch.where(varying, (hi - offset) / levels(bits), 1.0)  # float32 (promoted)
    stored = rounded_up(ideal, scale_dtype)
    back = stored.float()
    if not all_finite(back + offset):
        return None
    return floored(stored, back, varying), offset


def affine_encode(x: Tensor, scale: Tensor, offset: Tensor, bits: int) -> Tensor:
    """uint8 codes clamp(round((x - offset) / scale), 0, 2^bits - 1); qparams broadcast."""
    top = levels(bits)
    # float32 x with qparams of any float dtype computes in float32, as .float() copies
    # of them would (exactly); no copies (this runs on every appended row)
    codes = torch.round((x.float() - offset) / scale)
    return codes.clamp_(0, top).to(torch.uint8)


def affine_decode(codes: Tensor, scale: Tensor, offset: Tensor, dtype=torch.float32) -> Tensor:
    """x_hat = codes * scale + offset, returned in `dtype`."""
    return (codes.float() * scale.float() + offset.float()).to(dtype)


def quantize_affine(
    x: Tensor, bits: int, dim: Dims, scale_dtype=torch.float16, raise_tiny: bool = True
) -> tuple[Tensor, Tensor, Tensor]:
    """Dynamic asymmetric quantization with one (scale, offset) per slice over `dim`.

    x: [...]. Returns (codes uint8 shaped like x, scale, offset), the qparams
    shaped like x with the `dim` axes kept as size 1. raise_tiny: see `store_scale`.
    """
    _check_bits(bits)
    xf = x.float()
    lo = xf.amin(dim=dim, keepdim=True)
    hi = xf.amax(dim=dim, keepdim=True)
    live = None
    if not raise_tiny and not deferring():  # the cache's rows: one device read, not seven
        live = _live_qparams(lo, hi, bits, scale_dtype)
    if live is None:
        check_finite(x, "input")
        live = affine_qparams(lo, hi, bits, scale_dtype, raise_tiny)
    scale, offset = live
    return affine_encode(xf, scale, offset, bits), scale, offset


# --- grouping -------------------------------------------------------------------------


def to_groups(x: Tensor, group_size: int | None) -> Tensor:
    """[..., D] -> [..., D // G, G]; `None` means one group of D ([..., 1, D])."""
    if x.dim() == 0:
        raise KvqError("cannot group a scalar")
    d = x.shape[-1]
    g = d if group_size is None else group_size
    if g <= 0 or d % g != 0:
        raise KvqError(f"group size {group_size} does not divide the last dimension {d}")
    return x.reshape(*x.shape[:-1], d // g, g)


def from_groups(x: Tensor) -> Tensor:
    """[..., D // G, G] -> [..., D]: the inverse of `to_groups`."""
    if x.dim() < 2:
        raise KvqError("from_groups needs at least two dimensions")
    return x.flatten(-2)


# --- QServe per-(token, head) INT4 with a floating offset (live-data notes, 0x09C) ----
#
# The pinned QServe cache ABI is NOT the asymmetric convention above: the offset
# is added BEFORE rounding and is expressed in code units, and it is neither
# rounded to an integer nor clamped to the code range (a positive-only range
# [1, 2] has offset about -15):
#
#     scale  = (max - min) / 15           stored fp16, rounded UP (stored-scale policy)
#     offset = fp16(-min / scale)         the STORED scale; rounded to nearest
#     code   = clip(round(x / scale + offset), 0, 15)    (ties to even)
#     x_hat  = (code - offset) * scale
#
# Constant heads (max == min, all-zero included) are our own extension, not
# QServe's: scale 1 and offset fp16(-min), i.e. the same formulas with the
# stored-scale sentinel, so such a head decodes to within fp16 rounding of its
# value (exactly when |value| < 2048). An offset that overflows fp16 (a range
# far from zero relative to its width) and a scale that underflows are refused.

QSERVE_BITS = 4
QSERVE_DTYPE = torch.float16


def qserve_qparams(lo: Tensor, hi: Tensor) -> tuple[Tensor, Tensor]:
    """(scale, offset), both fp16, of the QServe floating-offset INT4 ABI for [lo, hi].

    lo, hi: broadcastable [...] range minima and maxima (one per token and head).
    The scale is (hi - lo) / 15 rounded up to fp16 (1 for a constant range);
    the offset is -lo / stored_scale rounded to nearest fp16, not clamped.
    """
    top = levels(QSERVE_BITS)
    check_finite(lo, "range minimum")
    check_finite(hi, "range maximum")
    lo, hi = torch.broadcast_tensors(lo.float(), hi.float())
    if bool((lo > hi).any()):
        raise KvqError("range minimum exceeds range maximum")
    # only ever live rows (the cache's): a near-constant row floors, see `store_scale`
    scale = store_scale((hi - lo) / top, QSERVE_DTYPE, hi > lo, raise_tiny=False)
    offset = ((0.0 - lo) / scale.float()).to(QSERVE_DTYPE)  # 0 - lo: +0, not -0, for lo = 0
    if not bool(torch.isfinite(offset.float()).all()):
        raise KvqError(
            "QServe offset -min/scale overflows float16: the range is too far from zero "
            "for its width"
        )
    return scale, offset


def qserve_encode(x: Tensor, scale: Tensor, offset: Tensor) -> Tensor:
    """uint8 codes clip(round(x / scale + offset), 0, 15) (ties to even); qparams broadcast."""
    codes = torch.round(x.float() / scale.float() + offset.float())
    return codes.clamp_(0, levels(QSERVE_BITS)).to(torch.uint8)


def qserve_decode(codes: Tensor, scale: Tensor, offset: Tensor, dtype=torch.float32) -> Tensor:
    """x_hat = (codes - offset) * scale, returned in `dtype`."""
    return ((codes.float() - offset.float()) * scale.float()).to(dtype)


def quantize_qserve(x: Tensor, dim: Dims = -1) -> tuple[Tensor, Tensor, Tensor]:
    """QServe INT4 with one (scale, offset) per slice reduced over `dim` (the head dim).

    x: [...]. Returns (codes uint8 shaped like x, scale fp16, offset fp16), the
    qparams shaped like x with the `dim` axes kept as size 1.
    """
    check_finite(x, "input")
    xf = x.float()
    scale, offset = qserve_qparams(xf.amin(dim=dim, keepdim=True), xf.amax(dim=dim, keepdim=True))
    return qserve_encode(xf, scale, offset), scale, offset
