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
from kvq.quant.qparams import check_finite, dtype_name, step, store_scale
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


def symmetric_qparams(amax: Tensor, bits: int, scale_dtype=torch.float16) -> Tensor:
    """Stored scale amax / qmax (rounded up to `scale_dtype`); 1 where amax == 0.

    amax: [...] non-negative absolute maxima. Returns [...] in `scale_dtype`.
    """
    qmax = qmax_signed(bits)
    check_finite(amax, "amax")
    amax = amax.float()
    if bool((amax < 0).any()):
        raise KvqError("amax must be non-negative")
    return store_scale(amax / qmax, scale_dtype, amax > 0)


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
    x: Tensor, bits: int, dim: Dims, scale_dtype=torch.float16
) -> tuple[Tensor, Tensor]:
    """Dynamic symmetric quantization with one scale per slice reduced over `dim`.

    x: [...]. Returns (codes int8 shaped like x, scale in `scale_dtype` shaped
    like x with the `dim` axes kept as size 1, so it broadcasts back).
    """
    _check_bits(bits)
    check_finite(x, "input")
    amax = x.float().abs().amax(dim=dim, keepdim=True)
    scale = symmetric_qparams(amax, bits, scale_dtype)
    return symmetric_encode(x, scale, bits), scale


# --- asymmetric -----------------------------------------------------------------------


def affine_qparams(
    lo: Tensor, hi: Tensor, bits: int, scale_dtype=torch.float16
) -> tuple[Tensor, Tensor]:
    """(scale, offset) in `scale_dtype` covering [lo, hi] with 2^bits - 1 steps.

    lo, hi: broadcastable [...] range minima and maxima.
    offset is lo rounded DOWN to `scale_dtype` (so lo >= offset and nothing
    below the range clips); scale = (hi - offset) / (2^bits - 1) rounded up.
    Constant rows (hi == lo, all-zero included) get scale 1 and offset = lo
    rounded to nearest, so they decode within the dtype's rounding of the value.
    """
    top = levels(bits)
    check_finite(lo, "range minimum")
    check_finite(hi, "range maximum")
    lo, hi = torch.broadcast_tensors(lo.float(), hi.float())
    if bool((lo > hi).any()):
        raise KvqError("range minimum exceeds range maximum")
    near = lo.to(scale_dtype)
    down = torch.where(near.float() > lo, step(near, up=False), near)
    varying = hi > lo
    offset = torch.where(varying, down, near)
    if not bool(torch.isfinite(offset.float()).all()):
        raise KvqError(f"offset overflows {dtype_name(scale_dtype)}; use a wider scale dtype")
    scale = store_scale((hi - offset.float()) / top, scale_dtype, varying)
    return scale, offset


def affine_encode(x: Tensor, scale: Tensor, offset: Tensor, bits: int) -> Tensor:
    """uint8 codes clamp(round((x - offset) / scale), 0, 2^bits - 1); qparams broadcast."""
    top = levels(bits)
    codes = torch.round((x.float() - offset.float()) / scale.float())
    return codes.clamp_(0, top).to(torch.uint8)


def affine_decode(codes: Tensor, scale: Tensor, offset: Tensor, dtype=torch.float32) -> Tensor:
    """x_hat = codes * scale + offset, returned in `dtype`."""
    return (codes.float() * scale.float() + offset.float()).to(dtype)


def quantize_affine(
    x: Tensor, bits: int, dim: Dims, scale_dtype=torch.float16
) -> tuple[Tensor, Tensor, Tensor]:
    """Dynamic asymmetric quantization with one (scale, offset) per slice over `dim`.

    x: [...]. Returns (codes uint8 shaped like x, scale, offset), the qparams
    shaped like x with the `dim` axes kept as size 1.
    """
    _check_bits(bits)
    check_finite(x, "input")
    xf = x.float()
    lo = xf.amin(dim=dim, keepdim=True)
    hi = xf.amax(dim=dim, keepdim=True)
    scale, offset = affine_qparams(lo, hi, bits, scale_dtype)
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
