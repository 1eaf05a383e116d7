"""SGLang's FP4 K/V cache (`--kv-cache-dtype fp4_e2m1`): FP4 E2M1 codes in blocks of 16
channels, one power-of-two scale per block stored as its biased exponent (UE8M0, one
byte). MXFP4's idea with MXFP4's block halved and its own exponent rule.

Read from sgl-project/sglang python/sglang/srt/layers/quantization/kvfp4_tensor.py
(`FP4MXBlock16KVQuantizeUtil.batched_quantize` / `batched_dequantize`):

    exponent  e = ceil(log2(max(amax(block) / 6, 1e-10)))   stored as e + 127 (uint8)
    code      q = e2m1(x / 2^e)      magnitude: how many of 0.25, 0.75, 1.25, 1.75, 2.5,
                                     3.5, 5 it reaches (a tie rounds up, not to even),
                                     sign bit for x < 0 (so -0.1 x 2^e stores -0)
    value     x ~ E2M1[q] * 2^e

x / 2^e never exceeds 6 (e rounds up), so nothing clamps. SGLang runs this in the
model's dtype under torch.compile; kvq computes it in float32.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvq.errors import KvqError
from kvq.quant.nvfp4 import FP4_MAX, LEVELS

BLOCK = 16
EXPONENT_BIAS = 127
AMAX_FLOOR = 1e-10  # SGLang's clamp before log2: a zero block gets exponent -33
# |y| thresholds of the magnitudes 0.5 .. 6; reaching one (>=) moves up a level
_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def _blocks(x: Tensor) -> Tensor:
    d = x.shape[-1]
    if d % BLOCK:
        raise KvqError(f"fp4_e2m1: {d} channels are not a whole number of blocks of {BLOCK}")
    return x.float().unflatten(-1, (d // BLOCK, BLOCK))  # [..., N, 16]


def quantize(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [..., D] -> (codes uint8 [..., D] in 0..15, biased exponents uint8 [..., D/16])."""
    blocks = _blocks(x)
    amax = blocks.abs().amax(-1, keepdim=True)  # [..., N, 1]
    e = torch.ceil(torch.log2(torch.clamp(amax / FP4_MAX, min=AMAX_FLOOR)))
    y = blocks / torch.exp2(e)
    magnitude = torch.zeros_like(y, dtype=torch.uint8)
    a = y.abs()
    for bound in _BOUNDS:
        magnitude += (a >= bound).to(torch.uint8)
    codes = magnitude | ((y < 0).to(torch.uint8) << 3)
    return codes.flatten(-2), (e.squeeze(-1) + EXPONENT_BIAS).to(torch.uint8)


def step(exponents: Tensor) -> Tensor:
    """Biased exponents uint8 [...] -> the blocks' scales 2^(e - 127), float32 [...]."""
    return torch.exp2(exponents.float() - EXPONENT_BIAS)


def dequantize(codes: Tensor, exponents: Tensor) -> Tensor:
    """The inverse: E2M1[code] * 2^(e - 127), float32 [..., D]."""
    levels = torch.tensor(LEVELS, device=codes.device)[codes.long()]
    return (levels.unflatten(-1, (-1, BLOCK)) * step(exponents)[..., None]).flatten(-2)
