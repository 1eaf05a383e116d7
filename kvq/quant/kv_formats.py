"""The static K/V formats serving engines run: FP8 E4M3 / E5M2 and symmetric INT8, with
one float32 scale per tensor or per KV head; NVFP4, whose calibrated float32 scale is the
per-tensor global one (its block scales are computed at append).

Names as on the command line ("fp8-e4m3", "fp8-e5m2", "int8"). The scale maps a range's
absolute maximum to the format's largest code; `round_trip` is exactly what the cache
stores and reads back (the codecs call the same `fp8` / `affine` functions), so a scale
search that minimises its error optimises what the runtime will do.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvq.errors import KvqError
from kvq.quant import affine, fp8, nvfp4
from kvq.quant.schemes import NVFP4_BLOCK, QuantScheme

KV_FORMATS = ("fp8-e4m3", "fp8-e5m2", "int8", "nvfp4")
SCALE_DTYPE = "float32"  # what vLLM, SGLang and TensorRT-LLM load k_scale / v_scale as


def _check(fmt: str) -> None:
    if fmt not in KV_FORMATS:
        raise KvqError(f"unknown K/V format {fmt!r}; known: {', '.join(KV_FORMATS)}")


def scheme_for(fmt: str, axis: str) -> QuantScheme:
    """The static scheme of `fmt` with one scale per `axis` ("tensor" or "head")."""
    _check(fmt)
    if fmt == "nvfp4":
        if axis != "tensor":
            raise KvqError("nvfp4: the global scale is one per tensor (--granularity tensor)")
        return QuantScheme("nvfp4", 4, axis="token", symmetric=True, group_size=NVFP4_BLOCK,
                           scale_dtype="float32")  # fmt: skip
    if fmt == "int8":
        return QuantScheme("int", 8, axis=axis, symmetric=True, lifetime="static",
                           scale_dtype=SCALE_DTYPE)  # fmt: skip
    return QuantScheme("fp8", 8, axis=axis, symmetric=True, lifetime="static",
                       scale_dtype=SCALE_DTYPE, fp8_format=fmt.removeprefix("fp8-"))  # fmt: skip


def scale_for(amax: Tensor, fmt: str) -> Tensor:
    """Stored float32 scales amax / top code (1 where amax == 0); amax [...] >= 0.

    These are static, calibrated scales: one below float32's smallest normal is raised to
    it (stored-scale policy, `kvq.quant.qparams`: rounding up never clips)."""
    _check(fmt)
    if fmt == "nvfp4":  # the global scale, 448 * 6 / amax (the engines' convention)
        return nvfp4.global_scale(amax)
    if fmt == "int8":
        return affine.symmetric_qparams(amax, 8, torch.float32, raise_tiny=False)
    return fp8.fp8_scale(amax, fmt.removeprefix("fp8-"), torch.float32, raise_tiny=False)


def round_trip(x: Tensor, scale: Tensor, fmt: str) -> Tensor:
    """x as the cache returns it after storing with `scale` (broadcast against x), fp32."""
    _check(fmt)
    if fmt == "nvfp4":
        raise KvqError("nvfp4 takes the engines' amax convention: --method absmax")
    if fmt == "int8":
        return affine.symmetric_decode(affine.symmetric_encode(x, scale, 8), scale)
    return fp8.fp8_decode(fp8.fp8_encode(x, scale, fmt.removeprefix("fp8-")), scale)
