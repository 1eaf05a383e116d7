"""NVFP4: FP4 E2M1 codes in blocks of 16 channels, one FP8 E4M3 scale per block, one float32
global scale per tensor, with the engines' amax convention (compressed-tensors'
`generate_gparam` / `calculate_qparams` / `quantize`, what vLLM and ModelOpt checkpoints
carry):

    global  g = 448 * 6 / amax(tensor)            (calibrated; 1.0 when none is given)
    block   s = fp8(g * amax(block) / 6)           (saturated; a zero block gets 0.125)
    code    q = e2m1(clamp(x / (s / g), -6, 6))    (nearest, ties to even)
    value   x ~ q * (s / g)

E2M1 magnitudes are 0, 0.5, 1, 1.5, 2, 3, 4, 6; a code is sign << 3 | magnitude index.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvq.errors import KvqError

BLOCK = 16
FP4_MAX, FP8_MAX = 6.0, 448.0
ZERO_BLOCK_SCALE = 0.125  # compressed-tensors' eps for an FP8 scale: a block of zeros
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# code -> value, codes 8..15 the negatives (code 8: -0)
LEVELS = E2M1 + tuple(-v for v in E2M1)
# |y| thresholds between consecutive magnitudes and whether the boundary itself rounds up:
# ties go to the even mantissa (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2,
# 3.5 -> 4, 5 -> 4)
_EDGES = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False),
          (3.5, True), (5.0, False))  # fmt: skip


def global_scale(amax: Tensor) -> Tensor:
    """float32 [...]: 448 * 6 / amax; 1.0 where that is not finite (an all-zero tensor)."""
    amax = amax.float().clamp_min(torch.finfo(torch.float32).tiny)
    g = FP8_MAX * FP4_MAX / amax
    return torch.where(torch.isfinite(g), g, torch.ones_like(g))


def _blocks(x: Tensor) -> Tensor:
    d = x.shape[-1]
    if d % BLOCK:
        raise KvqError(f"nvfp4: {d} channels are not a whole number of blocks of {BLOCK}")
    return x.float().unflatten(-1, (d // BLOCK, BLOCK))  # [..., N, 16]


def block_scales(x: Tensor, g: Tensor) -> Tensor:
    """x [..., D], g broadcastable to x[..., 0] -> FP8 E4M3 scales [..., D/16]."""
    amax = _blocks(x).abs().amax(-1)  # [..., N]
    s = (g.float()[..., None] * (amax / FP4_MAX)).clamp(-FP8_MAX, FP8_MAX)
    s = s.to(torch.float8_e4m3fn).float()
    return torch.where(s == 0, torch.full_like(s, ZERO_BLOCK_SCALE), s).to(torch.float8_e4m3fn)


def quantize(x: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
    """x [..., D] -> (codes uint8 [..., D] in 0..15, block scales float8_e4m3fn [..., D/16])."""
    s = block_scales(x, g)
    step = s.float() / g.float()[..., None]  # [..., N]: compressed-tensors' scale / global
    y = (_blocks(x) / step[..., None]).clamp(-FP4_MAX, FP4_MAX)
    a = y.abs()
    index = torch.zeros_like(a, dtype=torch.uint8)
    for edge, inclusive in _EDGES:
        index += (a >= edge if inclusive else a > edge).to(torch.uint8)
    codes = index | ((y < 0).to(torch.uint8) << 3)
    return codes.flatten(-2), s


def dequantize(codes: Tensor, s: Tensor, g: Tensor) -> Tensor:
    """The inverse: LEVELS[code] * (s / g), fp32 [..., D]."""
    levels = torch.tensor(LEVELS, device=codes.device)
    step = s.float() / g.float()[..., None]
    return (levels[codes.long()].unflatten(-1, (-1, BLOCK)) * step[..., None]).flatten(-2)
