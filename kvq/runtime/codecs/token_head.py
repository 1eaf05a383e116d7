"""vLLM's per-(token, head) formats as codecs: `--policy vllm:int8_per_token_head` and
`vllm:fp8_per_token_head` (`kvq.quant.token_head` holds the numerics).

They store what kvq's own per-token int8 and FP8 codecs store (codes and one float32 scale
per row), so each is that codec with vLLM's encoder: the shared decoders, reference and
Triton, read the rows unchanged. Rows are encoded in torch (no append kernel: its
rounding is kvq's, not vLLM's truncation).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvq.quant import token_head
from kvq.quant.schemes import QuantScheme
from kvq.runtime.codecs.base import NO_FLAT, Codec, Flat, Rows
from kvq.runtime.codecs.fp8 import Fp8TokenCodec
from kvq.runtime.codecs.integer import IntTokenCodec


class VllmInt8Codec(IntTokenCodec):
    """int8 codes truncated toward zero, stored unsigned (+128) as kvq's symmetric int8."""

    def encode(self, x: Tensor) -> tuple[Rows, Flat]:
        codes, scale = token_head.quantize(x, "int8")  # [B, H, T, D], [B, H, T, 1]
        zero = 1 << (self.bits - 1)
        return {"codes": (codes.to(torch.int16) + zero).to(torch.uint8), "scale": scale}, NO_FLAT

    def row_spec(self, x: Tensor):
        return None


class VllmFp8Codec(Fp8TokenCodec):
    """FP8 E4M3 codes with vLLM's scale floor and reciprocal."""

    def encode(self, x: Tensor) -> tuple[Rows, Flat]:
        codes, scale = token_head.quantize(x, "fp8_e4m3")
        return {"codes": codes.view(torch.uint8), "scale": scale}, NO_FLAT


def make(
    scheme: QuantScheme, head_dim: int, dtype: torch.dtype, state: dict[str, Tensor], where: str
) -> Codec:
    # QuantScheme admits engine="vllm" only for these two layouts
    return (
        VllmInt8Codec(scheme, head_dim)
        if scheme.format == "int"
        else VllmFp8Codec(scheme, head_dim)
    )
