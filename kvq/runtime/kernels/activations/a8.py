"""A8 producers: fused RMSNorm -> per-token INT8, and the W8A8 linear that consumes it.

Why (article 0x02D, 0x09E): a W8A8 / W4A8 GEMM wants INT8 activation rows and their
scales, and quantizing them in a separate pass costs a full extra read and write of the
activations. The producer kernel therefore normalises a row and quantizes it in the same
pass; the GEMM accumulates INT8 x INT8 in INT32 and applies the per-token x per-channel
scales in its epilogue.

Numerics are those of the shared quantizer (`kvq.quant.affine` symmetric, 8 bits, with
the stored-scale policy of `kvq.quant.qparams`), and the Triton kernels are bit-exact
with the references here:

* every fp32 operation is written out in a fixed order. The row sum of squares is a
  pairwise tree (element 2i plus 2i+1, level by level, zero-padded to a power of two),
  which both backends evaluate identically; division and square root are the IEEE
  round-to-nearest ones (`div_rn`, `sqrt_rn`), and multiply-add fusion is switched off
  (`enable_fp_fusion=False`), so no step is contracted into an FMA;
* the scale is rounded UP to its storage dtype inside the kernel (cast to nearest, then
  one ulp up through the integer bits if the cast landed below the ideal); the launcher
  then refuses non-finite or subnormal stored scales as `store_scale` does;
* codes round half to even with a floor-based formula (libdevice `rint` does not run
  under the Triton interpreter, which is how the CPU tests execute the kernels);
* the references avoid two torch shortcuts that are not IEEE: fp32 `sqrt` on CPU, and
  division by a Python number on CUDA (a multiply by the reciprocal); see `rmsnorm_fp32`
  and `rmsnorm_quant_reference`.

The GEMM accumulates exactly with `tl.dot` on int8 tiles into an int32 accumulator (this
also runs exactly under the interpreter); the references get the same exact integers
from a float64 matmul (|acc| <= 128 * 128 * K < 2^31 < 2^53).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch
from torch import Tensor

from kvq.errors import KvqError
from kvq.quant.affine import quantize_symmetric, symmetric_encode, symmetric_qparams
from kvq.quant.qparams import STORAGE_DTYPES, check_finite, dtype_name
from kvq.runtime.kernels.backend import next_pow2, resolve_backend

BITS = 8
QMAX = 2 ** (BITS - 1) - 1
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_K_RMSNORM = 1 << 16  # one program holds a whole row in registers
MAX_K_LINEAR = (2**31 - 1) // (128 * 128)  # int32 accumulator cannot overflow


# --- validation -----------------------------------------------------------------------


def _check_float(t: Tensor, what: str) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise KvqError(f"{what} must be float16, bfloat16 or float32, got {dtype_name(t.dtype)}")


def _check_vector(t: Tensor, n: int, what: str) -> None:
    if t.dim() != 1 or t.shape[0] != n:
        raise KvqError(f"{what} must have shape [{n}], got {list(t.shape)}")


def _check_device(device: torch.device, *tensors: Tensor | None) -> None:
    if any(t is not None and t.device != device for t in tensors):
        raise KvqError(f"all tensors must be on {device}")


def _rmsnorm_inputs(
    x: Tensor, weight: Tensor, eps: float, weight_offset: float, scale_dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """Validated, contiguous (x [M, K], weight [K])."""
    if x.dim() != 2 or x.shape[1] == 0:
        raise KvqError(f"x must have shape [M, K] with K >= 1, got {list(x.shape)}")
    _check_float(x, "x")
    _check_float(weight, "weight")
    _check_vector(weight, x.shape[1], "weight")
    _check_device(x.device, weight)
    if x.shape[1] > MAX_K_RMSNORM:
        raise KvqError(f"rmsnorm_quant supports K <= {MAX_K_RMSNORM}, got {x.shape[1]}")
    if not eps > 0 or eps == float("inf"):
        raise KvqError(f"eps must be positive and finite, got {eps!r}")
    if not abs(weight_offset) < float("inf"):
        raise KvqError(f"weight_offset must be finite, got {weight_offset!r}")
    if scale_dtype not in STORAGE_DTYPES.values():
        raise KvqError(f"scale_dtype must be one of {list(STORAGE_DTYPES)}, got {scale_dtype}")
    return x.contiguous(), weight.contiguous()


def _linear_inputs(
    x_codes: Tensor,
    x_scale: Tensor,
    w_codes: Tensor,
    w_scale: Tensor,
    bias: Tensor | None,
    out_dtype: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None]:
    """Validated, contiguous (x_codes [M, K], x_scale [M], w_codes [N, K], w_scale [N], bias)."""
    for t, what in ((x_codes, "x_codes"), (w_codes, "w_codes")):
        if t.dtype != torch.int8 or t.dim() != 2:
            raise KvqError(f"{what} must be a 2-D int8 tensor, got {t.dtype} {list(t.shape)}")
    (m, k), (n, kw) = x_codes.shape, w_codes.shape
    if k != kw:
        raise KvqError(f"x_codes has K={k} but w_codes has K={kw}")
    if k > MAX_K_LINEAR:
        raise KvqError(f"int8_linear supports K <= {MAX_K_LINEAR} (int32 accumulator), got {k}")
    for t, size, what in ((x_scale, m, "x_scale"), (w_scale, n, "w_scale"), (bias, n, "bias")):
        if t is not None:
            _check_float(t, what)
            _check_vector(t, size, what)
    if out_dtype not in FLOAT_DTYPES:
        raise KvqError(f"out_dtype must be float16, bfloat16 or float32, got {out_dtype}")
    _check_device(x_codes.device, x_scale, w_codes, w_scale, bias)
    contiguous = [t.contiguous() for t in (x_codes, x_scale, w_codes, w_scale)]
    return (*contiguous, None if bias is None else bias.contiguous())


def _check_stored_scales(scale: Tensor) -> None:
    """Refuse non-finite or subnormal stored scales (the checks of `store_scale`).

    scale: [M] as written by the kernel, where an all-zero row holds exactly 1, so every
    entry must be a finite normal number.
    """
    back = scale.float()
    tiny = torch.finfo(scale.dtype).tiny
    if bool((torch.isfinite(back) & (back >= tiny)).all()):  # the one sync of the happy path
        return
    name = dtype_name(scale.dtype)
    if not bool(torch.isfinite(back).all()):
        raise KvqError(
            f"scale overflows {name}, or the input is non-finite (NaN/Inf); "
            "use a wider scale dtype or check the input"
        )
    raise KvqError(
        f"scale underflows {name}: an ideal scale is below the smallest normal {tiny:.3g} "
        "(subnormal scales are unsafe under flush-to-zero); "
        "the data range is too small for this scale dtype"
    )


# --- references -----------------------------------------------------------------------


def pairwise_sum(v: Tensor) -> Tensor:
    """Sum over the last axis as a pairwise tree: v[2i] + v[2i+1], level by level.

    v: [..., K] fp32. Zero-padded to a power of two (adding zeros is exact), so the
    result does not depend on the padding and matches the kernel's reduction bit for bit.
    Returns [...].
    """
    k = v.shape[-1]
    width = 1 << max(k - 1, 0).bit_length()
    s = torch.nn.functional.pad(v, (0, width - k))
    while s.shape[-1] > 1:
        s = s[..., 0::2] + s[..., 1::2]
    return s[..., 0]


def rmsnorm_fp32(x: Tensor, weight: Tensor, eps: float, weight_offset: float = 0.0) -> Tensor:
    """y = x / sqrt(mean(x^2) + eps) * (weight + weight_offset), in fp32, fixed op order.

    x: [M, K]; weight: [K]. Returns y [M, K] fp32.
    """
    xf = x.float()
    sum_sq = pairwise_sum(xf * xf)  # [M]
    check_finite(sum_sq, "RMSNorm input (or its sum of squares)")
    check_finite(weight, "RMSNorm weight")
    eps32 = torch.tensor(eps, dtype=torch.float32, device=x.device)
    offset32 = torch.tensor(weight_offset, dtype=torch.float32, device=x.device)
    # torch's fp32 sqrt on CPU is not correctly rounded (it is off by an ulp on ~1 input in
    # 5). The fp64 one is within an fp64 ulp (2^-52 relative), and the sqrt of an fp32 is
    # never within 2^-50 of a midpoint between fp32 numbers, so rounding it to fp32 gives
    # the IEEE result, the kernel's `sqrt_rn`.
    # A tensor divisor: on CUDA, torch divides by a Python number as a multiply by its
    # reciprocal, which is not the IEEE quotient the kernel computes.
    k32 = torch.tensor(float(x.shape[-1]), dtype=torch.float32, device=x.device)
    rms = torch.sqrt((sum_sq / k32 + eps32).double()).float()  # [M]
    return xf / rms[:, None] * (weight.float() + offset32)


def rmsnorm_quant_reference(
    x: Tensor,
    weight: Tensor,
    eps: float,
    *,
    weight_offset: float = 0.0,
    scale_dtype: torch.dtype = torch.float16,
) -> tuple[Tensor, Tensor]:
    """RMSNorm then per-token symmetric INT8, in pure torch.

    x: [M, K] float; weight: [K] float. weight_offset=1.0 gives Gemma's (1 + w) norm.
    Returns (codes int8 [M, K], scale [M] in `scale_dtype`); x_hat = codes * scale[:, None].
    """
    x, weight = _rmsnorm_inputs(x, weight, eps, weight_offset, scale_dtype)
    y = rmsnorm_fp32(x, weight, eps, weight_offset)  # [M, K]
    # symmetric_qparams divides amax by the Python int 127, which CUDA torch turns into a
    # multiply by fl(1/127) (an fp32 ulp off the quotient); on CPU it is the IEEE
    # quotient, as in the kernel. The [M] row maxima are tiny, so compute there.
    amax = y.abs().amax(dim=1).cpu()  # [M]
    scale = symmetric_qparams(amax, BITS, scale_dtype).to(x.device)  # [M]
    return symmetric_encode(y, scale[:, None], BITS), scale


def int8_linear_reference(
    x_codes: Tensor,
    x_scale: Tensor,
    w_codes: Tensor,
    w_scale: Tensor,
    bias: Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> Tensor:
    """y = (x_codes @ w_codes.T) * x_scale[:, None] * w_scale[None, :] (+ bias), in pure torch.

    x_codes: [M, K] int8, x_scale: [M]; w_codes: [N, K] int8, w_scale: [N]; bias: [N].
    The integer product is exact (float64 holds every int32 accumulator value); the
    epilogue runs in fp32 in the kernel's order. Returns [M, N] in `out_dtype`.
    """
    x_codes, x_scale, w_codes, w_scale, bias = _linear_inputs(
        x_codes, x_scale, w_codes, w_scale, bias, out_dtype
    )
    acc = x_codes.double() @ w_codes.double().T  # [M, N], exact integers
    y = acc.float() * x_scale.float()[:, None] * w_scale.float()[None, :]
    if bias is not None:
        y = y + bias.float()[None, :]
    return y.to(out_dtype)


def quantize_weight_per_channel(
    w: Tensor, scale_dtype: torch.dtype = torch.float16
) -> tuple[Tensor, Tensor]:
    """Per-output-channel symmetric INT8 weights for `int8_linear`.

    w: [N, K] float. Returns (codes int8 [N, K], scale [N] in `scale_dtype`).
    """
    if w.dim() != 2:
        raise KvqError(f"w must have shape [N, K], got {list(w.shape)}")
    codes, scale = quantize_symmetric(w, BITS, dim=1, scale_dtype=scale_dtype)
    return codes, scale[:, 0]


# --- Triton ---------------------------------------------------------------------------


@functools.cache
def _kernels() -> SimpleNamespace:
    """Define the kernels on first use: triton is imported only here (package docstring).

    The kernels and their helpers are bound as module globals, not closures: Triton looks
    up the names a kernel uses in its function's `__globals__`, and its interpreter sees
    nothing else.
    """
    global triton, tl, FP32_MAX, tree_sum, max_nan, round_half_even
    import triton
    import triton.language as tl

    FP32_MAX = tl.constexpr(torch.finfo(torch.float32).max)

    @triton.jit
    def tree_sum(s, LOG2: tl.constexpr):
        # s: [2^LOG2] -> scalar, adding neighbours pairwise like `pairwise_sum`.
        for _ in tl.static_range(LOG2):
            even, odd = tl.split(tl.reshape(s, (s.shape[0] // 2, 2)))
            s = even + odd
        return tl.sum(s, axis=0)

    @triton.jit
    def max_nan(a, b):
        return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)

    @triton.jit
    def round_half_even(v):
        # Exact for any fp32 v: v - floor(v) is representable.
        f = tl.floor(v)
        frac = v - f
        odd = (f - 2.0 * tl.floor(f * 0.5)) == 1.0
        return tl.where((frac > 0.5) | ((frac == 0.5) & odd), f + 1.0, f)

    @triton.jit
    def rmsnorm_quant_kernel(
        x_ptr,  # [M, K] float, row stride stride_x
        w_ptr,  # [K] float
        codes_ptr,  # [M, K] int8, contiguous
        scale_ptr,  # [M] float16 | bfloat16 | float32
        K,
        K_F,  # K as fp32 (an int argument equal to 1 would be specialised to a constant)
        stride_x,
        eps,
        weight_offset,
        BLOCK: tl.constexpr,
        LOG2_BLOCK: tl.constexpr,
        ROUND_UP: tl.constexpr,  # the scale dtype is narrower than fp32
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        inside = cols < K
        x = tl.load(x_ptr + row * stride_x + cols, mask=inside, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32) + weight_offset
        sum_sq = tree_sum(x * x, LOG2_BLOCK)
        rms = tl.math.sqrt_rn(tl.math.div_rn(sum_sq, K_F) + eps)
        y = tl.math.div_rn(x, rms) * w  # [BLOCK]; padding stays 0
        amax = tl.reduce(tl.abs(y), 0, max_nan)
        # A NaN/Inf input or an overflowing sum of squares poisons the scale (inf - inf
        # and NaN - NaN are NaN) so that the launcher refuses it.
        amax = tl.where(sum_sq <= FP32_MAX, amax, sum_sq - sum_sq)
        ideal = tl.math.div_rn(amax, 127.0)
        stored = ideal.to(scale_ptr.dtype.element_ty)
        if ROUND_UP:
            bits = stored.to(tl.int16, bitcast=True)
            above = (bits + 1).to(scale_ptr.dtype.element_ty, bitcast=True)
            stored = tl.where(stored.to(tl.float32) < ideal, above, stored)
        # amax != 0 is also true for NaN, which must reach the launcher's check.
        stored = tl.where(amax != 0.0, stored, 1.0).to(scale_ptr.dtype.element_ty)
        tl.store(scale_ptr + row, stored)
        q = round_half_even(tl.math.div_rn(y, stored.to(tl.float32)))
        q = tl.minimum(tl.maximum(q, -127.0), 127.0)
        tl.store(codes_ptr + row * K + cols, q.to(tl.int8), mask=inside)

    @triton.jit
    def int8_linear_kernel(
        x_ptr,  # [M, K] int8, contiguous
        xs_ptr,  # [M] float
        w_ptr,  # [N, K] int8, contiguous
        ws_ptr,  # [N] float
        b_ptr,  # [N] float (unused without HAS_BIAS)
        out_ptr,  # [M, N] out_dtype, contiguous
        M,
        N,
        K,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
    ):
        # Grouped tile order: GROUP_M row-tiles share each weight column-tile in L2.
        pid = tl.program_id(0)
        tiles_m = tl.cdiv(M, BLOCK_M)
        tiles_n = tl.cdiv(N, BLOCK_N)
        per_group = GROUP_M * tiles_n
        first_m = (pid // per_group) * GROUP_M
        group_m = tl.minimum(tiles_m - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % group_m
        pid_n = (pid % per_group) // group_m

        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        x_tile = x_ptr + rm.to(tl.int64)[:, None] * K + rk[None, :]  # [BLOCK_M, BLOCK_K]
        w_tile = w_ptr + rn.to(tl.int64)[None, :] * K + rk[:, None]  # [BLOCK_K, BLOCK_N]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        for k0 in range(0, K, BLOCK_K):
            k_in = rk < K - k0
            a = tl.load(x_tile, mask=(rm[:, None] < M) & k_in[None, :], other=0)
            b = tl.load(w_tile, mask=k_in[:, None] & (rn[None, :] < N), other=0)
            acc = tl.dot(a, b, acc, out_dtype=tl.int32)
            x_tile += BLOCK_K
            w_tile += BLOCK_K

        xs = tl.load(xs_ptr + rm, mask=rm < M, other=0.0).to(tl.float32)
        ws = tl.load(ws_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
        y = acc.to(tl.float32) * xs[:, None] * ws[None, :]
        if HAS_BIAS:
            y = y + tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        out = out_ptr + rm.to(tl.int64)[:, None] * N + rn[None, :]
        tl.store(out, y.to(out_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))

    return SimpleNamespace(
        triton=triton, rmsnorm_quant=rmsnorm_quant_kernel, int8_linear=int8_linear_kernel
    )


def rmsnorm_quant_triton(
    x: Tensor,
    weight: Tensor,
    eps: float,
    *,
    weight_offset: float = 0.0,
    scale_dtype: torch.dtype = torch.float16,
) -> tuple[Tensor, Tensor]:
    """`rmsnorm_quant_reference` as one fused Triton pass, one program per row.

    x: [M, K] float; weight: [K] float. Returns (codes int8 [M, K], scale [M]).
    """
    x, weight = _rmsnorm_inputs(x, weight, eps, weight_offset, scale_dtype)
    m, k = x.shape
    codes = torch.empty((m, k), dtype=torch.int8, device=x.device)  # [M, K]
    scale = torch.empty((m,), dtype=scale_dtype, device=x.device)  # [M]
    if m == 0:
        return codes, scale
    kern = _kernels()
    block = next_pow2(k, 16)
    kern.rmsnorm_quant[(m,)](
        x,
        weight,
        codes,
        scale,
        k,
        float(k),
        x.stride(0),
        float(eps),
        float(weight_offset),
        BLOCK=block,
        LOG2_BLOCK=block.bit_length() - 1,
        ROUND_UP=scale_dtype != torch.float32,
        num_warps=min(16, max(1, block // 512)),
        enable_fp_fusion=False,
    )
    _check_stored_scales(scale)
    return codes, scale


def _gemm_config(m: int, n: int, k: int) -> dict[str, int]:
    """Tile sizes: small M (decode) gets short row tiles; tl.dot needs every dim >= 16."""

    def fit(size: int, lo: int, hi: int) -> int:
        return min(hi, max(lo, 1 << max(size - 1, 0).bit_length()))

    block_m, block_n, block_k = fit(m, 16, 128), fit(n, 16, 128), fit(k, 32, 128)
    big = block_m * block_n >= 128 * 128
    return dict(
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        GROUP_M=8,
        num_warps=8 if big else 4,
        num_stages=4 if big else 3,
    )


def int8_linear_triton(
    x_codes: Tensor,
    x_scale: Tensor,
    w_codes: Tensor,
    w_scale: Tensor,
    bias: Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> Tensor:
    """`int8_linear_reference` as a tiled Triton GEMM with the scale epilogue fused.

    x_codes: [M, K] int8, x_scale: [M]; w_codes: [N, K] int8, w_scale: [N]; bias: [N].
    Returns [M, N] in `out_dtype`.
    """
    x_codes, x_scale, w_codes, w_scale, bias = _linear_inputs(
        x_codes, x_scale, w_codes, w_scale, bias, out_dtype
    )
    (m, k), n = x_codes.shape, w_codes.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=x_codes.device)  # [M, N]
    if m == 0 or n == 0:
        return out
    if k == 0:
        return int8_linear_reference(x_codes, x_scale, w_codes, w_scale, bias, out_dtype)
    kern = _kernels()
    cfg = _gemm_config(m, n, k)
    grid = (kern.triton.cdiv(m, cfg["BLOCK_M"]) * kern.triton.cdiv(n, cfg["BLOCK_N"]),)
    kern.int8_linear[grid](
        x_codes,
        x_scale,
        w_codes,
        w_scale,
        w_scale if bias is None else bias,
        out,
        m,
        n,
        k,
        HAS_BIAS=bias is not None,
        enable_fp_fusion=False,
        **cfg,
    )
    return out


# --- dispatch -------------------------------------------------------------------------


def rmsnorm_quant(
    x: Tensor,
    weight: Tensor,
    eps: float,
    *,
    weight_offset: float = 0.0,
    scale_dtype: torch.dtype = torch.float16,
    backend: str | None = None,
) -> tuple[Tensor, Tensor]:
    """Fused RMSNorm + per-token INT8 on the backend `resolve_backend(backend, x.device)`."""
    impl = rmsnorm_quant_triton
    if resolve_backend(backend, x.device) == "reference":
        impl = rmsnorm_quant_reference
    return impl(x, weight, eps, weight_offset=weight_offset, scale_dtype=scale_dtype)


def int8_linear(
    x_codes: Tensor,
    x_scale: Tensor,
    w_codes: Tensor,
    w_scale: Tensor,
    bias: Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
    *,
    backend: str | None = None,
) -> Tensor:
    """W8A8 linear on the backend `resolve_backend(backend, x_codes.device)`."""
    impl = int8_linear_triton
    if resolve_backend(backend, x_codes.device) == "reference":
        impl = int8_linear_reference
    return impl(x_codes, x_scale, w_codes, w_scale, bias, out_dtype)
