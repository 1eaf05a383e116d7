"""vLLM's per-(token, head) formats as a codec: `--policy vllm:int8_per_token_head` and
`vllm:fp8_per_token_head` (`kvq.quant.token_head` holds the numerics).

The stored rows are the ones kvq's shared decoders already read: int8 codes offset to
unsigned (+128) with the row's scale, decoded as (code - 128) * scale ("affine"), and fp8
bit patterns read through the format's table ("lookup"), so the reference and the Triton
decode paths serve them unchanged. Rows are encoded in torch (no append kernel): the
truncation is vLLM's, not kvq's int8 rounding.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvq.quant import token_head
from kvq.quant.schemes import QuantScheme
from kvq.runtime.codecs.base import NO_FLAT, Codec, Flat, Rows
from kvq.runtime.codecs.fp8 import fp8_table
from kvq.runtime.packed import PackedRows

INT8_ZERO = 128  # signed codes stored unsigned


class TokenHeadCodec(Codec):
    """One float32 scale per (token, head), computed at append as vLLM's kernel does."""

    def __init__(self, scheme: QuantScheme, head_dim: int):
        super().__init__(head_dim, torch.float32)
        self.fmt = "int8" if scheme.format == "int" else "fp8_e4m3"

    def encodes_like(self, other: Codec) -> bool:
        # every (batch, head, token) row on its own
        return type(other) is TokenHeadCodec and (self.head_dim, self.fmt) == (
            other.head_dim, other.fmt
        )  # fmt: skip

    def encode(self, x: Tensor) -> tuple[Rows, Flat]:
        codes, scale = token_head.quantize(x, self.fmt)  # [B, H, T, D], [B, H, T, 1]
        if self.fmt == "int8":
            stored = (codes.to(torch.int16) + INT8_ZERO).to(torch.uint8)
        else:
            stored = codes.view(torch.uint8)
        return {"codes": stored, "scale": scale}, NO_FLAT

    def packed(self, rows: Rows, flat: Flat) -> PackedRows:
        codes, scale = rows["codes"], rows["scale"]
        if self.fmt == "int8":
            return PackedRows("affine", self.head_dim, codes, 8, float(INT8_ZERO), scale)
        table = fp8_table("e4m3", codes.device)
        return PackedRows("lookup", self.head_dim, codes, 8, scale=scale, table=table)

    @staticmethod
    def categories() -> dict[str, str]:
        return {"codes": "codes", "scale": "qparams"}


def make(
    scheme: QuantScheme, head_dim: int, dtype: torch.dtype, state: dict[str, Tensor], where: str
) -> Codec:
    # QuantScheme admits engine="vllm" only for these two layouts
    return TokenHeadCodec(scheme, head_dim)
