"""vLLM's 4-bit K/V cache: `--kv-cache-dtype int4_per_token_head`.

Read from vllm-project/vllm `vllm/v1/attention/ops/int4_per_token_head.py`
(`reshape_and_cache_int4`, `_reshape_cache_int4_kernel`, `single_rht`). Each (token, KV
head) row x [D] (D a power of two) is first turned by a randomized Hadamard transform,

    r = H (s * x)     H the unnormalised Sylvester matrix (+-1), s fixed +-1 signs,

in float32 by a butterfly of strides 1, 2, 4, ... and rounded to the model's dtype; then,
in float32,

    scale = max((max r - min r) / 15, 1e-6)
    z     = clamp(rhaz(-min r / scale), 0, 15)        rhaz: round half away from zero
    q     = clamp(rhaz(r * (1 / scale) + z), 0, 15)   4-bit codes, two per byte

and ONE float32 word per row: `scale` with its 4 low mantissa bits replaced by z. Decoding
reads the scale with those bits cleared (not the one the encoder divided by): r' = scale'
(q - z), and x' = s * (H r') / D. vLLM never un-rotates a row: it rotates the query, divides
the softmax scale by D and un-rotates the attention output, the same in exact arithmetic.
The signs are one vector for every layer, head, K and V: torch's CPU `bernoulli(0.5)`
drawn with a generator seeded 0x9E3779B9.

kvq computes the rotation as vLLM does without its CUDA Hadamard kernel (CPU, or head_dim
above 128 on a GPU without it). On sm80+ GPUs vLLM rotates through bfloat16 (`hadacore`),
and the Triton kernel's fast float32 division may differ from IEEE's in the last bits: codes
can differ there where a value lies that close to a rounding boundary.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from kvq.errors import KvqError
from kvq.quant.qparams import check_finite

SEED = 0x9E3779B9  # vLLM's seed for the signs (its round 0)
TOP = 15  # codes 0..15
SCALE_FLOOR = 1e-6
_ZERO_BITS = 0xF  # the scale word's low mantissa bits that hold z


def check_head_dim(d: int) -> None:
    if d < 2 or d & (d - 1):
        raise KvqError(f"vLLM's int4_per_token_head needs a power-of-two head_dim, not {d}")


@functools.cache
def signs(d: int) -> Tensor:
    """[D] float32 +-1: vLLM's signs (the same draw for every layer and head)."""
    check_head_dim(d)
    gen = torch.Generator().manual_seed(SEED)
    return torch.bernoulli(torch.full((d,), 0.5), generator=gen) * 2 - 1


def butterfly(x: Tensor) -> Tensor:
    """H x along the last axis (unnormalised Sylvester Hadamard) in float32: strides 1, 2,
    4, ... pairing (a, b) -> (a + b, a - b), the order vLLM's float32 path adds in."""
    d = x.shape[-1]
    y = x.float()
    h = 1
    while h < d:
        pairs = y.unflatten(-1, (d // (2 * h), 2, h))  # [..., blocks, 2, h]
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2).flatten(-3)
        h *= 2
    return y


def rotate(x: Tensor, dtype: torch.dtype) -> Tensor:
    """x [..., D] -> H (s * x) rounded to the model's `dtype`, as float32."""
    return butterfly(x.float() * signs(x.shape[-1]).to(x.device)).to(dtype).float()


@functools.cache
def unrotation(d: int) -> Tensor:
    """[D, D] float32 M with x = r @ M: s * (H r) / D for rows r (exact: entries +-1/D)."""
    from kvq.calibrators.rotation import hadamard

    return (hadamard(d) * signs(d).double() / d).float()


def _rhaz(t: Tensor) -> Tensor:
    """Round half away from zero (vLLM: t +- 0.5, then truncated to an integer)."""
    return torch.where(t >= 0, torch.trunc(t + 0.5), torch.trunc(t - 0.5))


def quantize(x: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """x [..., D] (one head's rows) -> (codes [..., D] uint8 in 0..15, word [..., 1]
    float32: the scale with z in its 4 low mantissa bits). `dtype`: the model's, which the
    rotated rows are rounded to before quantizing."""
    check_finite(x, "key/value rows")
    return quantize_rotated(rotate(x, dtype))


def quantize_rotated(r: Tensor) -> tuple[Tensor, Tensor]:
    """Rows already rotated, r [..., D] float32 -> (codes, word) as `quantize`."""
    lo = r.amin(dim=-1, keepdim=True)
    hi = r.amax(dim=-1, keepdim=True)
    scale = ((hi - lo) / TOP).clamp_min(SCALE_FLOOR)
    z = _rhaz(-lo / scale).clamp_(0, TOP)
    q = _rhaz(r * (1.0 / scale) + z).clamp_(0, TOP)
    word = (scale.view(torch.int32) & ~_ZERO_BITS) | z.to(torch.int32)
    return q.to(torch.uint8), word.view(torch.float32)


def unpack_word(word: Tensor) -> tuple[Tensor, Tensor]:
    """word [..., 1] float32 -> (scale with z's bits cleared, z) float32, as vLLM decodes."""
    bits = word.contiguous().view(torch.int32)
    return (bits & ~_ZERO_BITS).view(torch.float32), (bits & _ZERO_BITS).float()


def dequantize(codes: Tensor, word: Tensor) -> Tensor:
    """codes [..., D], word [..., 1] -> x' [..., D] float32 (un-rotated)."""
    scale, z = unpack_word(word)
    r = (codes.float() - z) * scale
    return r @ unrotation(codes.shape[-1]).to(codes.device)
