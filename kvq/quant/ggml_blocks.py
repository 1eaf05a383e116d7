"""llama.cpp's block formats for its K/V cache (`-ctk` / `-ctv`): q8_0, q4_0, q4_1, q5_0,
q5_1, iq4_nl, with ggml's own numerics (ggml-quants.c, `quantize_row_*_ref`; iq4_nl: the
CUDA K/V store), so that kvq's cache holds the codes llama.cpp would hold, bit for bit
(tests compare with the `gguf` package's quantizers, and iq4_nl, which it cannot
quantize, with a transcription and its decoder).

Each block is 32 consecutive channels of one row with one fp16 scale d (and, for the
`_1` formats, an fp16 minimum m):

* q8_0: d = amax / 127, q = roundf(x / d) (half away from zero) in [-127, 127], x ~ q d;
* q4_0 / q5_0: d = v / -8 (-16), v the block's value of largest magnitude (its sign
  kept), q = min(15 (31), trunc(x / d + 8.5 (16.5))), x ~ (q - 8 (16)) d;
* q4_1 / q5_1: d = (max - min) / 15 (31), q = min(15 (31), trunc((x - min) / d + 0.5)),
  x ~ q d + m with m = fp16(min);
* iq4_nl: 16 non-uniform levels (`IQ4_NL_LEVELS`), x ~ level[q] d. As the CUDA K/V store
  (ggml-cuda/cpy-utils.cuh, `quantize_f32_iq4_nl_block`) computes it: d0 = v / -127, q the
  nearest level to x / d0 (the upper on a tie), then d = sum(w level x) / sum(w level^2)
  with w = x^2, the least-squares scale of those codes (d0 if the sums are 0). The CPU
  backend's `quantize_row_iq4_nl_ref` also tries 15 scales around d0 and can differ.
  nvcc may contract the sums into FMAs; kvq rounds every step (the fp16 d hides the last
  fp32 bits except at a rounding boundary).

The codes are computed with the fp32 d (through its fp32 reciprocal), the stored d is
fp16: ggml's convention, which this module keeps. Codes come back unsigned, with the
constant `zero` to subtract at decode.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvq.errors import KvqError

BLOCK = 32  # channels per block (QK8_0 = QK4_0 = QK4_1 = QK5_0 = QK5_1 = QK4_NL = 32)
# ggml's kvalues_iq4nl, ascending
IQ4_NL_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


@dataclass(frozen=True)
class BlockFormat:
    name: str
    bits: int  # code bits
    zero: int  # subtracted from the unsigned code at decode (0: the format has a minimum)
    has_min: bool
    levels: tuple[int, ...] | None = None  # non-uniform formats: x ~ levels[q] d

    @property
    def bits_per_element(self) -> float:
        """llama.cpp's storage: codes, the fp16 d (and m) per block of 32."""
        return self.bits + (32 if self.has_min else 16) / BLOCK


FORMATS = {
    "q8_0": BlockFormat("q8_0", 8, 128, False),
    "q4_0": BlockFormat("q4_0", 4, 8, False),
    "q4_1": BlockFormat("q4_1", 4, 0, True),
    "q5_0": BlockFormat("q5_0", 5, 16, False),
    "q5_1": BlockFormat("q5_1", 5, 0, True),
    "iq4_nl": BlockFormat("iq4_nl", 4, 0, False, IQ4_NL_LEVELS),
}


def block_format(name: str) -> BlockFormat:
    if name not in FORMATS:
        raise KvqError(f"unknown llama.cpp block format {name!r}; known: {', '.join(FORMATS)}")
    return FORMATS[name]


def _reciprocal(d: Tensor) -> Tensor:
    return torch.where(d == 0, torch.zeros_like(d), 1.0 / d)


def _roundf(x: Tensor) -> Tensor:
    """C roundf: half away from zero, computed as ggml's reference does for the gguf
    package (floor(|x|) plus one when the fraction is at least a half)."""
    a = x.abs()
    floored = torch.floor(a)
    return torch.sign(x) * (floored + torch.floor(2 * (a - floored)))


def quantize(x: Tensor, name: str) -> tuple[Tensor, Tensor, Tensor | None]:
    """x [..., D] (D a multiple of 32) -> (codes uint8 [..., D] unsigned, d fp16
    [..., D/32], m fp16 [..., D/32] or None)."""
    fmt = block_format(name)
    d_ch = x.shape[-1]
    if d_ch % BLOCK:
        raise KvqError(f"{name}: {d_ch} channels are not a whole number of blocks of {BLOCK}")
    blocks = x.float().reshape(*x.shape[:-1], d_ch // BLOCK, BLOCK)  # [..., N, 32]
    top = (1 << fmt.bits) - 1
    if fmt.levels is not None:
        codes, d = _quantize_levels(blocks, fmt.levels)
        return codes.reshape(x.shape), d, None
    if fmt.name == "q8_0":
        d = blocks.abs().amax(-1, keepdim=True) / 127
        q = _roundf(blocks * _reciprocal(d)) + 128
        m = None
    elif not fmt.has_min:
        idx = blocks.abs().argmax(-1, keepdim=True)  # the first of equal magnitudes, as ggml
        d = blocks.gather(-1, idx) / -float(1 << (fmt.bits - 1))
        q = torch.trunc(blocks * _reciprocal(d) + (fmt.zero + 0.5)).clamp(0, top)
        m = None
    else:
        lo = blocks.amin(-1, keepdim=True)
        d = (blocks.amax(-1, keepdim=True) - lo) / top
        q = torch.trunc((blocks - lo) * _reciprocal(d) + 0.5).clamp(0, top)
        m = lo.squeeze(-1).to(torch.float16)
    codes = q.to(torch.uint8).reshape(x.shape)
    return codes, d.squeeze(-1).to(torch.float16), m


def _nearest_level(y: Tensor, levels: Tensor) -> Tensor:
    """ggml's best_index_int8: the index of the level nearest y, the upper one on a tie
    (the lower only when strictly nearer); y beyond the ends gives the end."""
    upper = torch.searchsorted(levels, y.contiguous(), right=True).clamp_(1, len(levels) - 1)
    return torch.where(y - levels[upper - 1] < levels[upper] - y, upper - 1, upper)


def _quantize_levels(blocks: Tensor, values: tuple[int, ...]) -> tuple[Tensor, Tensor]:
    """iq4_nl's CUDA store: blocks [..., N, 32] float32 -> (codes uint8 [..., N, 32], d fp16
    [..., N])."""
    levels = torch.tensor(values, dtype=torch.float32, device=blocks.device)
    idx = blocks.abs().argmax(-1, keepdim=True)  # the first of equal magnitudes, as ggml
    d0 = blocks.gather(-1, idx) / levels[0]  # [..., N, 1]
    codes = _nearest_level(blocks * _reciprocal(d0), levels)  # [..., N, 32]
    q, w = levels[codes], blocks * blocks
    # the kernel's sums in its order: j = 0..15, channels j and j + 16 in one term
    half = BLOCK // 2
    sumqx = sumq2 = torch.zeros_like(d0[..., 0])  # [..., N]
    for a, b in zip(range(half), range(half, BLOCK), strict=True):
        qa, qb, xa, xb = q[..., a], q[..., b], blocks[..., a], blocks[..., b]
        sumqx = sumqx + (w[..., a] * qa * xa + w[..., b] * qb * xb)
        sumq2 = sumq2 + (w[..., a] * qa * qa + w[..., b] * qb * qb)
    d = torch.where(sumq2 > 0, sumqx / sumq2, d0[..., 0])
    return codes.to(torch.uint8), d.to(torch.float16)


def dequantize(codes: Tensor, d: Tensor, m: Tensor | None, name: str) -> Tensor:
    """The inverse as llama.cpp decodes: (q - zero) d (+ m), or levels[q] d, fp32 [..., D]."""
    fmt = block_format(name)
    if fmt.levels is not None:
        levels = torch.tensor(fmt.levels, dtype=torch.float32, device=codes.device)
        return (levels[codes.long()].unflatten(-1, (-1, BLOCK)) * d.float()[..., None]).flatten(-2)
    q = codes.float().unflatten(-1, (-1, BLOCK)) - fmt.zero  # [..., N, 32]
    x = q * d.float()[..., None]
    if m is not None:
        x = x + m.float()[..., None]
    return x.flatten(-2)
