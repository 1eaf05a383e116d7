"""vLLM's per-(token, head) K/V cache quantizer: `--kv-cache-dtype int8_per_token_head` and
`fp8_per_token_head`.

Read from vllm-project/vllm `vllm/v1/attention/ops/triton_reshape_and_cache_flash.py`
(`_reshape_cache_per_token_head`): for each (token, KV head) row, in float32,

    scale = max(absmax(row) / QMAX, 1e-6)        stored float32, one per row
    code  = clamp(row * (1 / scale), QMIN, QMAX)  then cast by the store

with (QMIN, QMAX) = (-128, 127) for int8 and (-448, 448) for FP8 E4M3. The cast is
Triton's store into the cache's dtype: float -> int8 truncates toward zero (not round to
nearest, as kvq's own int8 does: every code loses up to one step toward zero), float ->
fp8 rounds to nearest even. Decoding is code * scale (the kernels scale scores and
probabilities instead: the same in exact arithmetic).

kvq does this arithmetic in IEEE float32. vLLM's kernel divides with the GPU's fast
division, within 2 ulp of IEEE's, so on a GPU a scale can differ in its last bits and an
int8 code where row / scale lies that close to an integer.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvq.errors import KvqError
from kvq.quant.qparams import check_finite

SCALE_FLOOR = 1e-6  # the kernel's floor: an all-zero row stores scale 1e-6, codes 0
RANGES = {"int8": (-128.0, 127.0), "fp8_e4m3": (-448.0, 448.0)}  # (QMIN, QMAX)
CODE_DTYPES = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}


def quantize(x: Tensor, fmt: str) -> tuple[Tensor, Tensor]:
    """x [..., D] (one head's row along the last axis) -> (codes [..., D] int8 or
    float8_e4m3fn, scale [..., 1] float32)."""
    if fmt not in RANGES:
        raise KvqError(f"unknown per-token-head format {fmt!r}; known: {', '.join(RANGES)}")
    check_finite(x, "key/value rows")
    lo, hi = RANGES[fmt]
    x = x.float()
    scale = (x.abs().amax(dim=-1, keepdim=True) / hi).clamp_min(SCALE_FLOOR)
    y = (x * (1.0 / scale)).clamp_(lo, hi)
    return y.to(CODE_DTYPES[fmt]), scale  # int8: truncates toward zero, like the store


def dequantize(codes: Tensor, scale: Tensor) -> Tensor:
    """codes [..., D], scale [..., 1] -> [..., D] float32."""
    return codes.float() * scale.float()
