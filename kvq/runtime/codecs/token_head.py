"""vLLM's per-(token, head) formats as codecs: `--policy vllm:int8_per_token_head`,
`vllm:fp8_per_token_head` (`kvq.quant.token_head` holds the numerics) and
`vllm:int4_per_token_head` (`kvq.quant.vllm_int4`).

They store what kvq's own per-token int8 and FP8 codecs store (codes and one float32 scale
per row), so each is that codec with vLLM's encoder: the shared decoders, reference and
Triton, read the rows unchanged. Rows are encoded in torch (no append kernel: its
rounding is kvq's, not vLLM's truncation). The int4 rows are stored as vLLM stores them,
D/2 code bytes and one float32 word per row, rotated: they decode on the reference
(`PackedRows.rotation`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvq.quant import packing, token_head, vllm_int4
from kvq.quant.schemes import QuantScheme
from kvq.runtime.codecs.base import NO_FLAT, Codec, Flat, Rows
from kvq.runtime.codecs.fp8 import Fp8TokenCodec
from kvq.runtime.codecs.integer import IntTokenCodec
from kvq.runtime.packed import PackedRows


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


class VllmInt4Codec(Codec):
    """4-bit codes of Hadamard-rotated rows, min/max per row, vLLM's scale word."""

    def __init__(self, head_dim: int, model_dtype: torch.dtype):
        vllm_int4.check_head_dim(head_dim)
        super().__init__(head_dim, torch.float32)
        self.model_dtype = model_dtype  # the rotated rows are rounded to it, as in vLLM
        self.unrotation = vllm_int4.unrotation(head_dim)  # [D, D]

    def encodes_like(self, other: Codec) -> bool:
        return type(other) is VllmInt4Codec and (other.head_dim, other.model_dtype) == (
            self.head_dim, self.model_dtype
        )  # fmt: skip

    def encode(self, x: Tensor) -> tuple[Rows, Flat]:
        codes, word = vllm_int4.quantize(x, self.model_dtype)  # [B, H, T, D], [B, H, T, 1]
        return {"codes": packing.pack_bits(codes, 4), "word": word}, NO_FLAT

    def packed(self, rows: Rows, flat: Flat) -> PackedRows:
        codes = rows["codes"]
        scale, z = vllm_int4.unpack_word(rows["word"])  # [B, H, T, 1] each
        rotation = self.unrotation.to(codes.device)
        return PackedRows(
            "affine", self.head_dim, codes, 4, scale=scale, zero_point=z, rotation=rotation
        )

    @staticmethod
    def categories() -> dict[str, str]:
        return {"codes": "codes", "word": "qparams"}


def make(
    scheme: QuantScheme, head_dim: int, dtype: torch.dtype, state: dict[str, Tensor], where: str
) -> Codec:
    # QuantScheme admits engine="vllm" only for these three layouts
    if scheme.format == "fp8":
        return VllmFp8Codec(scheme, head_dim)
    if scheme.bits == 4:
        return VllmInt4Codec(head_dim, dtype)
    return VllmInt8Codec(scheme, head_dim)
