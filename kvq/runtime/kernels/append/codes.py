"""Append kernels: quantize new rows and write codes + qparams in place (0x02A, 0x05, 0x09C).

Every representation has three functions with the same arguments:

* `<name>_reference(...)`: pure torch, built from the shared quantizers in
  `kvq.quant` (the same calls the codecs in `kvq.runtime.codecs` /
  `kvq.runtime.codecs.nuq` make), then written into the buffers;
* `<name>_triton(...)`: one Triton launch, one program per (batch, head, row),
  which reads the row, derives its qparams, rounds them to their storage dtype,
  encodes, packs and stores;
* `<name>(..., backend=None)`: dispatch through `resolve_backend`.

Inputs are new rows `x [B, H, T, D]` (fp32, fp16 or bf16, any strides); the
destination buffers are `[B, H, capacity, ...]` (`RowStore` layout) and rows
`[start, start + T)` are written, nothing else. Both paths validate shapes and
dtypes before writing. The reference also validates qparams before writing; the
Triton launcher can only check the qparams it wrote, so when it raises
`KvqError` (non-finite input, scale overflow, offset overflow) the
rows `[start, start + T)` may hold partial output. Those rows lie beyond the
committed frontier of a `RowStore`, so no reader sees them.

Bit exactness of the Triton path against the reference (and so the codecs):

* divisions use `tl.math.div_rn` (IEEE round-to-nearest; a plain `/` is an
  approximate division on NVIDIA GPUs);
* rounding to integers is round-half-to-even through floor:
  f = floor(v), d = v - f (exact), up when d > 0.5 or d == 0.5 and f is odd.
  The shorter floor(v + 0.5) form is wrong for 0.49999997 (v + 0.5 rounds to 1),
  and libdevice `rint` is not available in the interpreter;
* storage rounding: fp16 by the cast (round to nearest even on GPU and in the
  interpreter); bf16 by integer rounding of the fp32 bits (the interpreter's
  bf16 cast truncates); "round up" / "round down" step the stored value one
  ulp through its integer bit pattern, as `qparams.step` does;
* fp8 bit patterns are computed from the fp32 bits with round-to-nearest-even
  (normal and subnormal targets) after the same clamp as `fp8.fp8_encode`, so
  they do not depend on a backend's float8 conversion;
* outlier selection reproduces `sparse.row_outliers` (one stable ascending
  sort): k rounds of "smallest value, lowest coordinate first" for the low
  tail and "largest value, highest coordinate first" for the high tail; the
  slots are filled in ascending coordinate order.

One known, harmless divergence: when a row's minimum (or maximum) is a zero
present with both signs, `torch.amin` does not define which zero it returns,
so a stored offset or center can differ in the sign of zero only (its value,
the codes and the decoded values are the same).

Triton is imported lazily (see `kvq.runtime.kernels`): the kernel bodies
(`_codes_triton.py`) are plain functions over that module's global `tl`, which its
`jit()` binds and decorates on the first Triton call.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvq.errors import KvqError
from kvq.quant import affine, fp8, nuq, packing, sparse
from kvq.quant.qparams import check_finite, defer_check, deferring, dtype_name
from kvq.runtime.kernels.backend import next_pow2, resolve_backend

#: sparse exception values are fp16, as in `kvq.runtime.codecs.nuq.SPARSE_DTYPE`
SPARSE_DTYPE = torch.float16
INPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# storage dtype -> kernel code: 0 fp32, 1 fp16, 2 bf16
_STORAGE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def key_index_dtype(head_dim: int) -> torch.dtype:
    """Dtype of sparse channel indices: uint8 up to 256 channels, else int16 (as the codecs)."""
    return torch.uint8 if head_dim <= 256 else torch.int16


# ======================================================================================
# validation shared by both paths
# ======================================================================================


def _check_x(x: Tensor) -> tuple[int, int, int, int]:
    if x.dim() != 4:
        raise KvqError(f"new rows must be [B, H, T, D], got shape {tuple(x.shape)}")
    if x.dtype not in INPUT_DTYPES:
        raise KvqError(f"new rows must be float32, float16 or bfloat16, got {x.dtype}")
    return tuple(x.shape)  # type: ignore[return-value]


def _check_start(x: Tensor, start: int, capacity: int) -> None:
    t = x.shape[2]
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise KvqError(f"start row must be a non-negative int, got {start!r}")
    if start + t > capacity:
        raise KvqError(f"rows [{start}, {start + t}) do not fit a buffer of {capacity} rows")


def _check_dest(
    name: str, buf: Tensor | None, x: Tensor, start: int, tail: tuple[int, ...], dtypes
) -> None:
    """buf must be [B, H, capacity, *tail] of one of `dtypes` on x's device."""
    if buf is None:
        raise KvqError(f"{name} buffer is required")
    b, h = x.shape[:2]
    if buf.dim() != 3 + len(tail) or tuple(buf.shape[:2]) != (b, h) or tuple(buf.shape[3:]) != tail:
        want = ", ".join(str(v) for v in (b, h, "capacity", *tail))
        raise KvqError(f"{name} buffer must be [{want}], got {tuple(buf.shape)}")
    if buf.dtype not in dtypes:
        raise KvqError(f"{name} buffer must be {' or '.join(map(str, dtypes))}, got {buf.dtype}")
    if buf.device != x.device:
        raise KvqError(f"{name} buffer is on {buf.device}, new rows on {x.device}")
    _check_start(x, start, buf.shape[2])


def _check_static(name: str, t: Tensor | None, x: Tensor, shape: tuple[int, ...]) -> Tensor:
    if t is None:
        raise KvqError(f"static {name} is required")
    if tuple(t.shape) != shape:
        raise KvqError(f"static {name} must have shape {list(shape)}, got {tuple(t.shape)}")
    if not t.is_floating_point():
        raise KvqError(f"static {name} must be a float tensor, got {t.dtype}")
    return t.to(x.device)


def _group(d: int, group_size: int | None) -> int:
    g = d if group_size is None else group_size
    if isinstance(g, bool) or not isinstance(g, int) or g <= 0 or d % g:
        raise KvqError(f"group size {group_size} does not divide head_dim {d}")
    return g


def _check_codebook(codebook: Tensor, bits: int, device: torch.device) -> Tensor:
    if codebook.dim() != 1 or codebook.numel() != 2**bits:
        raise KvqError(
            f"codebook has {codebook.numel()} levels but {bits} bits need {2**bits} (1-D)"
        )
    return nuq._check_codebook(codebook).to(device)


def _mids(codebook: Tensor, device: torch.device) -> Tensor:
    """`nuq.nuq_encode`'s decision boundaries [L - 1] on `device` (computed once per codebook)."""
    return nuq.decision_boundaries(codebook).to(device).contiguous()


def _rows(x: Tensor, start: int) -> slice:
    return slice(start, start + x.shape[2])


# ======================================================================================
# pure-torch references
# ======================================================================================


def _check_int_token(x, codes_out, scale_out, offset_out, start, bits, group_size, symmetric):
    _, _, _, d = _check_x(x)
    affine.qmax_signed(bits)  # validates bits
    g = _group(d, group_size)
    _check_dest("codes", codes_out, x, start, (packing.packed_len(d, bits),), (torch.uint8,))
    _check_dest("scale", scale_out, x, start, (d // g,), tuple(_STORAGE))
    if not symmetric:
        _check_dest("offset", offset_out, x, start, (d // g,), (scale_out.dtype,))
    return g


def append_int_token_reference(
    x: Tensor,
    codes_out: Tensor,
    scale_out: Tensor,
    offset_out: Tensor | None,
    start: int,
    bits: int,
    group_size: int | None = None,
    symmetric: bool = False,
) -> None:
    """Dynamic per-(token, head[, group]) integer codes, exactly `IntTokenCodec.encode`.

    x [B, H, T, D]; codes_out [B, H, cap, packed_len(D, bits)] uint8;
    scale_out [B, H, cap, D // G] (fp16/bf16/fp32: its dtype is the scale
    dtype); offset_out like scale_out, or None when symmetric. group_size None
    means one group of D. Symmetric codes are stored offset by 2^(bits-1).
    """
    g = _check_int_token(x, codes_out, scale_out, offset_out, start, bits, group_size, symmetric)
    grouped = affine.to_groups(x.float(), g)  # [B, H, T, D/G, G]
    rows = _rows(x, start)
    if symmetric:
        codes, scale = affine.quantize_symmetric(
            grouped, bits, -1, scale_out.dtype, raise_tiny=False
        )
        ucodes = (codes.to(torch.int16) + (1 << (bits - 1))).to(torch.uint8)
    else:
        ucodes, scale, offset = affine.quantize_affine(
            grouped, bits, -1, scale_out.dtype, raise_tiny=False
        )
        offset_out[:, :, rows] = offset.squeeze(-1)
    codes_out[:, :, rows] = packing.pack_bits(affine.from_groups(ucodes), bits)
    scale_out[:, :, rows] = scale.squeeze(-1)


def _check_int_qserve(x, codes_out, scale_out, offset_out, start):
    _, _, _, d = _check_x(x)
    bits = affine.QSERVE_BITS
    _check_dest("codes", codes_out, x, start, (packing.packed_len(d, bits),), (torch.uint8,))
    _check_dest("scale", scale_out, x, start, (), (affine.QSERVE_DTYPE,))
    _check_dest("offset", offset_out, x, start, (), (affine.QSERVE_DTYPE,))


def append_int_qserve_reference(
    x: Tensor, codes_out: Tensor, scale_out: Tensor, offset_out: Tensor, start: int
) -> None:
    """QServe floating-offset INT4 per (token, head), `affine.quantize_qserve` (0x09C).

    x [B, H, T, D]; codes_out [B, H, cap, packed_len(D, 4)] uint8;
    scale_out, offset_out [B, H, cap] fp16. See `kvq.quant.affine` for the ABI,
    its rounding policy (scale rounded up, offset from the stored scale) and
    the constant-head policy (scale 1, offset fp16(-value)).
    """
    _check_int_qserve(x, codes_out, scale_out, offset_out, start)
    codes, scale, offset = affine.quantize_qserve(x, -1)
    rows = _rows(x, start)
    codes_out[:, :, rows] = packing.pack_bits(codes, affine.QSERVE_BITS)
    scale_out[:, :, rows] = scale.squeeze(-1)
    offset_out[:, :, rows] = offset.squeeze(-1)


def _check_int_channel(x, codes_out, start, scale, offset, bits, symmetric):
    _, h, _, d = _check_x(x)
    affine.qmax_signed(bits)
    _check_dest("codes", codes_out, x, start, (packing.packed_len(d, bits),), (torch.uint8,))
    scale = _check_static("scale", scale, x, (h, d))
    if not symmetric:
        offset = _check_static("offset", offset, x, (h, d))
    return scale, offset


def append_int_channel_reference(
    x: Tensor,
    codes_out: Tensor,
    start: int,
    scale: Tensor,
    offset: Tensor | None,
    bits: int,
    symmetric: bool = False,
) -> None:
    """Static per-(head, channel) integer codes, exactly `IntChannelStaticCodec.encode`.

    x [B, H, T, D]; codes_out [B, H, cap, packed_len(D, bits)] uint8;
    scale, offset [H, D] calibrated qparams (offset None when symmetric).
    """
    scale, offset = _check_int_channel(x, codes_out, start, scale, offset, bits, symmetric)
    check_finite(x, "key/value rows")
    xf = x.float()
    s = scale[None, :, None, :]
    if symmetric:
        codes = affine.symmetric_encode(xf, s, bits)
        ucodes = (codes.to(torch.int16) + (1 << (bits - 1))).to(torch.uint8)
    else:
        ucodes = affine.affine_encode(xf, s, offset[None, :, None, :], bits)
    codes_out[:, :, _rows(x, start)] = packing.pack_bits(ucodes, bits)


def _check_fp8(x, codes_out, start, scale, fmt):
    _, h, _, d = _check_x(x)
    fp8.fp8_max(fmt)  # validates fmt
    _check_dest("codes", codes_out, x, start, (d,), (torch.uint8,))
    return _check_static("scale", scale, x, (h,))


def append_fp8_reference(
    x: Tensor, codes_out: Tensor, start: int, scale: Tensor, fmt: str = "e4m3"
) -> None:
    """Static per-head fp8 codes stored as their bit patterns: `fp8.fp8_encode(...).view(uint8)`.

    x [B, H, T, D]; codes_out [B, H, cap, D] uint8; scale [H]; fmt "e4m3" or
    "e5m2". Values beyond the format's range saturate to +-max.
    """
    scale = _check_fp8(x, codes_out, start, scale, fmt)
    codes = fp8.fp8_encode(x, scale[None, :, None, None], fmt)
    codes_out[:, :, _rows(x, start)] = codes.view(torch.uint8)


def _check_nuq_value(
    x, codes_out, scale_out, center_out, index_out, value_out, start, codebook, bits, fraction,
    split,
):  # fmt: skip
    """Validates; returns (codebook, k): outliers per tail ("tails") or in all ("range")."""
    _, _, _, d = _check_x(x)
    cb = _check_codebook(codebook, bits, x.device)
    _check_dest("codes", codes_out, x, start, (packing.packed_len(d, bits),), (torch.uint8,))
    _check_dest("scale", scale_out, x, start, (), tuple(_STORAGE))
    _check_dest("center", center_out, x, start, (), (scale_out.dtype,))
    if split not in ("tails", "range"):
        raise KvqError(f"outlier split must be 'tails' or 'range', got {split!r}")
    if split == "tails":
        k = sparse.tail_counts(d, fraction)[0]
        slots = 2 * k
    else:
        k = slots = sparse.range_count(d, fraction)
    if d <= slots:
        raise KvqError(
            f"row width {d} leaves no inliers after {slots} outliers (fraction {fraction})"
        )
    if slots:
        _check_dest(
            "sparse index", index_out, x, start, (slots,), (key_index_dtype(d), torch.int16)
        )
        _check_dest("sparse value", value_out, x, start, (slots,), (SPARSE_DTYPE,))
    return cb, k


def append_nuq_value_reference(
    x: Tensor,
    codes_out: Tensor,
    scale_out: Tensor,
    center_out: Tensor,
    index_out: Tensor | None,
    value_out: Tensor | None,
    start: int,
    codebook: Tensor,
    bits: int,
    fraction: float,
    split: str = "tails",
) -> None:
    """KVQuant value rows, exactly `NuqValueCodec.encode`.

    split: how a row's outliers are chosen (`sparse.row_outliers`): "tails" takes the
    same count from each end, "range" spends one total count greedily on whichever end
    shrinks the inlier range more.

    x [B, H, T, D]; codes_out [B, H, cap, packed_len(D, bits)] uint8;
    scale_out, center_out [B, H, cap] (their dtype is the scale dtype);
    index_out [B, H, cap, S] uint8 (int16 also accepted), value_out
    [B, H, cap, S] fp16, S = k_lo + k_hi of `sparse.tail_counts(D, fraction)`
    (both may be None when fraction is 0); codebook [2^bits].
    """
    cb, _ = _check_nuq_value(
        x, codes_out, scale_out, center_out, index_out, value_out, start, codebook, bits,
        fraction, split,
    )  # fmt: skip
    check_finite(x, "value rows")
    xf = x.float()
    rows = _rows(x, start)
    if fraction:
        idx, vals, lo, hi = sparse.row_outliers(xf, fraction, split)
    else:
        lo, hi = xf.amin(-1), xf.amax(-1)
    scale, center = nuq.live_normalizer(lo, hi, scale_out.dtype)  # [B, H, T]
    codes = nuq.nuq_encode(nuq.normalize(xf, scale[..., None], center[..., None]), cb)
    if fraction:
        index_out[:, :, rows] = idx.to(index_out.dtype)
        value_out[:, :, rows] = vals.to(SPARSE_DTYPE)
    codes_out[:, :, rows] = packing.pack_bits(codes, bits)
    scale_out[:, :, rows] = scale
    center_out[:, :, rows] = center


def _check_nuq_key(x, codes_out, count_out, start, codebook, bits, scale, center, lower, upper):
    _, h, _, d = _check_x(x)
    cb = _check_codebook(codebook, bits, x.device)
    _check_dest("codes", codes_out, x, start, (packing.packed_len(d, bits),), (torch.uint8,))
    statics = [_check_static(n, t, x, (h, d)) for n, t in (("scale", scale), ("center", center))]
    if (lower is None) != (upper is None):
        raise KvqError("outlier thresholds need both lower and upper (or neither)")
    if lower is not None:
        statics += [_check_static(n, t, x, (h, d)) for n, t in (("lower", lower), ("upper", upper))]
        _check_dest("sparse count", count_out, x, start, (), (torch.uint8,))
    else:
        statics += [None, None]
    return cb, *statics


def _key_entries(x: Tensor, mask: Tensor, check: bool = False) -> tuple[Tensor, Tensor]:
    """Flat (channel index, fp16 value) entries in (row, batch, head, channel) order.
    check: also refuse non-finite rows, in the same device sync as the count check."""
    count = mask.sum(-1)
    top = count.amax().float() if count.numel() else count.new_zeros((), dtype=torch.float32)
    bad = ~torch.isfinite(x).all() if check else torch.zeros((), dtype=torch.bool)
    top, bad = torch.stack([top, bad.to(top)]).tolist()  # the one sync before nonzero's
    if bad:
        check_finite(x, "key rows")
    if top > 255:
        raise KvqError("more than 255 key outliers in one row; raise the calibration fraction")
    m = mask.permute(2, 0, 1, 3)
    channel = m.nonzero()[:, 3]
    value = x.float().permute(2, 0, 1, 3)[m].to(SPARSE_DTYPE)
    return channel.to(key_index_dtype(x.shape[-1])), value


def _no_entries(x: Tensor) -> tuple[Tensor, Tensor]:
    return (
        torch.empty(0, dtype=key_index_dtype(x.shape[-1]), device=x.device),
        torch.empty(0, dtype=SPARSE_DTYPE, device=x.device),
    )


def append_nuq_key_reference(
    x: Tensor,
    codes_out: Tensor,
    count_out: Tensor | None,
    start: int,
    codebook: Tensor,
    bits: int,
    scale: Tensor,
    center: Tensor,
    lower: Tensor | None,
    upper: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """KVQuant key rows, exactly `NuqKeyCodec.encode`.

    x [B, H, T, D]; codes_out [B, H, cap, packed_len(D, bits)] uint8;
    count_out [B, H, cap] uint8 (outliers per row); codebook [2^bits];
    scale, center, lower, upper [H, D] calibrated (lower = upper = None: no
    outliers, count_out is then ignored). Values strictly outside
    [lower, upper] are outliers: their dense codes encode the clipped value
    (holes) and they are returned as flat entries (channel index uint8, or
    int16 beyond 256 channels; value fp16) in (row, batch, head, channel) order.
    """
    cb, scale, center, lower, upper = _check_nuq_key(
        x, codes_out, count_out, start, codebook, bits, scale, center, lower, upper
    )
    check_finite(x, "key rows")
    xf = x.float()
    rows = _rows(x, start)
    entries = _no_entries(x)
    if lower is not None:
        lw, up = lower.float()[None, :, None, :], upper.float()[None, :, None, :]
        mask = sparse.threshold_outliers(xf, lw, up)
        entries = _key_entries(xf, mask)
        count_out[:, :, rows] = mask.sum(-1).to(torch.uint8)
        xf = torch.minimum(torch.maximum(xf, lw), up)
    xn = nuq.normalize(xf, scale[None, :, None, :], center[None, :, None, :])
    codes_out[:, :, rows] = packing.pack_bits(nuq.nuq_encode(xn, cb), bits)
    return entries


# ======================================================================================
# Triton launchers
# ======================================================================================

#: elements of one program's tile: R units of a power-of-two width each
TILE_ELEMENTS = 2048


def _per(bits: int) -> int:
    return 8 if bits == 3 else 8 // bits


def _launch(kernel: str, n_units: int, width: int, *args, **meta) -> None:
    """One launch over `n_units` units of `width` (power of two) lanes, R units per program."""
    r = min(next_pow2(n_units), max(1, TILE_ELEMENTS // width))
    elements = r * width
    warps = 1 if elements <= 256 else 2 if elements <= 1024 else 4
    from kvq.runtime.kernels.append import _codes_triton as bodies

    bodies.jit()
    grid = (-(-n_units // r),)
    getattr(bodies, kernel)[grid](*args, R=r, num_warps=warps, **meta)


def _check_stored(what: str, stored: Tensor) -> None:
    """The launcher's half of the stored-scale policy: refuse what the kernel could not store
    (a scale never underflows: `_round_up` floors it at the dtype's smallest normal)."""
    if not bool(torch.isfinite(stored.float()).all()):
        raise KvqError(f"{what} overflows {dtype_name(stored.dtype)}; use a wider scale dtype")


def _flags(n_units: int, device: torch.device) -> Tensor:
    """Per-unit flags a kernel sets where a row cannot be stored (see `_refuse_flagged`)."""
    return torch.empty(n_units, dtype=torch.uint8, device=device)


def _refuse_flagged(
    bad: Tensor, x: Tensor, what: str, stored: tuple[tuple[str, Tensor], ...]
) -> None:
    """After a launch: the kernel flagged every unit whose input was not finite or whose
    stored qparams (name, rows) break `_check_stored`. Reading the flags is one
    op and one device sync on the happy path (an append runs per layer and step; on CUDA
    every sync stalls the launch queue, and every op is a launch). On a flag the separate
    checks run in order and raise their own message. The rows written past the cache's
    length are not visible until the append commits. Inside `qparams.deferred_checks` the
    flags are recorded as a device verdict instead (a replayable decode step)."""
    if deferring():
        defer_check(bad)
        return
    if not bool(bad.any()):
        return
    check_finite(x, what)
    for name, t in stored:
        _check_stored(name, t)
    raise KvqError(f"{what}: the append kernel flagged a row that the checks accept")


def _or(t: Tensor | None, fallback: Tensor) -> Tensor:
    """A stand-in pointer for an absent tensor (the kernel never touches it)."""
    return fallback if t is None else t


def append_int_token_triton(
    x: Tensor,
    codes_out: Tensor,
    scale_out: Tensor,
    offset_out: Tensor | None,
    start: int,
    bits: int,
    group_size: int | None = None,
    symmetric: bool = False,
) -> None:
    """Triton twin of `append_int_token_reference` (same arguments, same bytes)."""
    g = _check_int_token(x, codes_out, scale_out, offset_out, start, bits, group_size, symmetric)
    b, h, t, d = x.shape
    if not x.numel():
        return
    per, ng = _per(bits), d // g
    if ng > 1 and g % per:
        raise KvqError(f"Triton packs {bits}-bit codes per group: G must be a multiple of {per}")
    bl = next_pow2(g, per)
    off = _or(offset_out, scale_out)
    bad = _flags(b * h * t * ng, x.device)
    _launch(
        "_int_token_kernel", b * h * t * ng, bl,
        x, codes_out, scale_out, off, bad, start, h, t, b * h * t * ng,
        *x.stride(), *codes_out.stride(), *scale_out.stride(), *off.stride(),
        NG=ng, G=g, BL=bl, BITS=bits, PER=per, GBYTES=packing.packed_len(g, bits) if ng > 1 else 0,
        SYM=bool(symmetric), DT=_STORAGE[scale_out.dtype],
        TINY=torch.finfo(scale_out.dtype).tiny,
    )  # fmt: skip
    rows = _rows(x, start)
    stored = (("scale", scale_out[:, :, rows]),)
    if not symmetric:
        stored += (("offset", offset_out[:, :, rows]),)
    _refuse_flagged(bad, x, "input", stored)


def append_int_qserve_triton(
    x: Tensor, codes_out: Tensor, scale_out: Tensor, offset_out: Tensor, start: int
) -> None:
    """Triton twin of `append_int_qserve_reference` (same arguments, same bytes)."""
    _check_int_qserve(x, codes_out, scale_out, offset_out, start)
    b, h, t, d = x.shape
    if not x.numel():
        return
    bd = next_pow2(d, 8)
    bad = _flags(b * h * t, x.device)
    _launch(
        "_int_qserve_kernel", b * h * t, bd,
        x, codes_out, scale_out, offset_out, bad, start, h, t, b * h * t,
        *x.stride(), *codes_out.stride(), *scale_out.stride(), *offset_out.stride(),
        D=d, BD=bd, TINY=torch.finfo(torch.float16).tiny,
    )  # fmt: skip
    rows = _rows(x, start)
    stored = (
        ("QServe scale", scale_out[:, :, rows]),
        ("QServe offset -min/scale", offset_out[:, :, rows]),
    )
    _refuse_flagged(bad, x, "input", stored)


def append_int_channel_triton(
    x: Tensor,
    codes_out: Tensor,
    start: int,
    scale: Tensor,
    offset: Tensor | None,
    bits: int,
    symmetric: bool = False,
) -> None:
    """Triton twin of `append_int_channel_reference` (same arguments, same bytes)."""
    scale, offset = _check_int_channel(x, codes_out, start, scale, offset, bits, symmetric)
    b, h, t, d = x.shape
    if not x.numel():
        return
    check_finite(x, "key/value rows")
    per = _per(bits)
    bd = next_pow2(d, per)
    off = _or(offset, scale)
    _launch(
        "_int_channel_kernel", b * h * t, bd,
        x, codes_out, scale, off, start, h, t, b * h * t,
        *x.stride(), *codes_out.stride(), *scale.stride(), *off.stride(),
        D=d, BD=bd, BITS=bits, PER=per, SYM=bool(symmetric),
    )  # fmt: skip


# fmt -> (mantissa bits, exponent bias)
_FP8_LAYOUT = {"e4m3": (3, 7), "e5m2": (2, 15)}


def append_fp8_triton(
    x: Tensor, codes_out: Tensor, start: int, scale: Tensor, fmt: str = "e4m3"
) -> None:
    """Triton twin of `append_fp8_reference` (same arguments, same bytes)."""
    scale = _check_fp8(x, codes_out, start, scale, fmt)
    b, h, t, d = x.shape
    if not x.numel():
        return
    check_finite(x, "input")
    mbits, bias = _FP8_LAYOUT[fmt]
    shift = 23 - mbits
    bd = next_pow2(d)
    _launch(
        "_fp8_kernel", b * h * t, bd,
        x, codes_out, scale, start, h, t, b * h * t,
        *x.stride(), *codes_out.stride(), scale.stride(0),
        D=d, BD=bd, TOP=fp8.fp8_max(fmt), MBITS=mbits, RND=(1 << (shift - 1)) - 1,
        REBIAS=(127 - bias) << mbits, MIN_NORMAL=(128 - bias) << 23,
        SUB=float(2 ** (bias - 1 + mbits)),
    )  # fmt: skip


def append_nuq_value_triton(
    x: Tensor,
    codes_out: Tensor,
    scale_out: Tensor,
    center_out: Tensor,
    index_out: Tensor | None,
    value_out: Tensor | None,
    start: int,
    codebook: Tensor,
    bits: int,
    fraction: float,
    split: str = "tails",
) -> None:
    """Triton twin of `append_nuq_value_reference` (same arguments, same bytes)."""
    _, k = _check_nuq_value(
        x, codes_out, scale_out, center_out, index_out, value_out, start, codebook, bits,
        fraction, split,
    )  # fmt: skip
    b, h, t, d = x.shape
    if not x.numel():
        return
    per = _per(bits)
    bd = next_pow2(d, per)
    idx = _or(index_out if k else None, codes_out)
    val = _or(value_out if k else None, codes_out)
    bad = _flags(b * h * t, x.device)
    _launch(
        "_nuq_value_kernel", b * h * t, bd,
        x, codes_out, scale_out, center_out, idx, val, _mids(codebook, x.device), bad, start,
        h, t, b * h * t,
        *x.stride(), *codes_out.stride(), *scale_out.stride(), *center_out.stride(),
        *idx.stride(), *val.stride(),
        D=d, BD=bd, K=k, BITS=bits, PER=per, DT=_STORAGE[scale_out.dtype],
        RANGE=split == "range", TINY=torch.finfo(scale_out.dtype).tiny,
    )  # fmt: skip
    rows = _rows(x, start)
    stored = (("center", center_out[:, :, rows]), ("scale", scale_out[:, :, rows]))
    _refuse_flagged(bad, x, "value rows", stored)


def append_nuq_key_triton(
    x: Tensor,
    codes_out: Tensor,
    count_out: Tensor | None,
    start: int,
    codebook: Tensor,
    bits: int,
    scale: Tensor,
    center: Tensor,
    lower: Tensor | None,
    upper: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """Triton twin of `append_nuq_key_reference` (same arguments, same bytes).

    The kernel writes codes, counts and a per-element outlier mask; the flat
    entries are compacted from the mask in torch.
    """
    _, scale, center, lower, upper = _check_nuq_key(
        x, codes_out, count_out, start, codebook, bits, scale, center, lower, upper
    )
    b, h, t, d = x.shape
    if not x.numel():
        return _no_entries(x)
    outliers = lower is not None
    if not outliers:
        check_finite(x, "key rows")
    per = _per(bits)
    bd = next_pow2(d, per)
    mask = torch.empty((b, h, t, d) if outliers else (1,), dtype=torch.uint8, device=x.device)
    cnt = count_out if outliers else codes_out[:, :, :, 0]
    lw, up = _or(lower, scale), _or(upper, scale)
    _launch(
        "_nuq_key_kernel", b * h * t, bd,
        x, codes_out, cnt, mask, _mids(codebook, x.device), scale, center, lw, up, start, h, t,
        b * h * t,
        *x.stride(), *codes_out.stride(), *cnt.stride(),
        *scale.stride(), *center.stride(), *lw.stride(), *up.stride(),
        D=d, BD=bd, BITS=bits, PER=per, OUTLIERS=outliers,
    )  # fmt: skip
    if not outliers:
        return _no_entries(x)
    return _key_entries(x, mask.bool(), check=True)  # checks the rows are finite, too


# ======================================================================================
# dispatch
# ======================================================================================


def _pick_backend(name: str, x: Tensor, backend: str | None):
    impl = "triton" if resolve_backend(backend, x.device) == "triton" else "reference"
    return globals()[f"{name}_{impl}"]


def append_int_token(
    x: Tensor,
    codes_out: Tensor,
    scale_out: Tensor,
    offset_out: Tensor | None,
    start: int,
    bits: int,
    group_size: int | None = None,
    symmetric: bool = False,
    backend: str | None = None,
) -> None:
    """`append_int_token_reference` or `_triton`, chosen by `resolve_backend(backend, x.device)`."""
    fn = _pick_backend("append_int_token", x, backend)
    fn(x, codes_out, scale_out, offset_out, start, bits, group_size, symmetric)


def append_int_qserve(
    x: Tensor,
    codes_out: Tensor,
    scale_out: Tensor,
    offset_out: Tensor,
    start: int,
    backend: str | None = None,
) -> None:
    """`append_int_qserve_reference` or `_triton`, chosen by `resolve_backend`."""
    _pick_backend("append_int_qserve", x, backend)(x, codes_out, scale_out, offset_out, start)


def append_int_channel(
    x: Tensor,
    codes_out: Tensor,
    start: int,
    scale: Tensor,
    offset: Tensor | None,
    bits: int,
    symmetric: bool = False,
    backend: str | None = None,
) -> None:
    """`append_int_channel_reference` or `_triton`, chosen by `resolve_backend`."""
    fn = _pick_backend("append_int_channel", x, backend)
    fn(x, codes_out, start, scale, offset, bits, symmetric)


def append_fp8(
    x: Tensor,
    codes_out: Tensor,
    start: int,
    scale: Tensor,
    fmt: str = "e4m3",
    backend: str | None = None,
) -> None:
    """`append_fp8_reference` or `_triton`, chosen by `resolve_backend`."""
    _pick_backend("append_fp8", x, backend)(x, codes_out, start, scale, fmt)


def append_nuq_value(
    x: Tensor,
    codes_out: Tensor,
    scale_out: Tensor,
    center_out: Tensor,
    index_out: Tensor | None,
    value_out: Tensor | None,
    start: int,
    codebook: Tensor,
    bits: int,
    fraction: float,
    split: str = "tails",
    backend: str | None = None,
) -> None:
    """`append_nuq_value_reference` or `_triton`, chosen by `resolve_backend`."""
    fn = _pick_backend("append_nuq_value", x, backend)
    fn(
        x, codes_out, scale_out, center_out, index_out, value_out, start, codebook, bits,
        fraction, split,
    )  # fmt: skip


def append_nuq_key(
    x: Tensor,
    codes_out: Tensor,
    count_out: Tensor | None,
    start: int,
    codebook: Tensor,
    bits: int,
    scale: Tensor,
    center: Tensor,
    lower: Tensor | None,
    upper: Tensor | None,
    backend: str | None = None,
) -> tuple[Tensor, Tensor]:
    """`append_nuq_key_reference` or `_triton`, chosen by `resolve_backend`."""
    fn = _pick_backend("append_nuq_key", x, backend)
    return fn(x, codes_out, count_out, start, codebook, bits, scale, center, lower, upper)
