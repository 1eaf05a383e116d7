"""llama.cpp's K/V block formats (q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl): codes computed with
ggml's numerics (`kvq.quant.ggml_blocks`), stored as affine rows the shared decoders read
(iq4_nl: lookup rows, its 16 levels), one fp16 scale (and minimum) per block of 32
channels: x ~ (code - zero) d (+ m), or levels[code] d.

5-bit codes pack 8 to 5 bytes, so the ledger counts what llama.cpp stores (its qs/qh
split is a layout, not a size); they decode on the torch reference only."""

from __future__ import annotations

import torch
from torch import Tensor

from kvq.quant import ggml_blocks, packing
from kvq.quant.schemes import QuantScheme
from kvq.runtime.codecs.base import NO_FLAT, Codec, Flat, Rows
from kvq.runtime.packed import PackedRows


class GgmlBlockCodec(Codec):
    def __init__(self, scheme: QuantScheme, head_dim: int):
        super().__init__(head_dim, torch.float32)
        self.format = ggml_blocks.block_format(scheme.ggml_type)
        self.container = self.format.bits

    def encodes_like(self, other: Codec) -> bool:
        # one block of one row at a time: no row depends on another
        return type(other) is GgmlBlockCodec and (self.head_dim, self.format) == (
            other.head_dim, other.format
        )  # fmt: skip

    def encode(self, x: Tensor) -> tuple[Rows, Flat]:
        codes, d, m = ggml_blocks.quantize(x, self.format.name)  # [B, H, T, D], [B, H, T, D/32]
        rows = {"codes": packing.pack_bits(codes, self.container), "scale": d}
        if m is not None:
            rows["offset"] = m
        return rows, NO_FLAT

    def packed(self, rows: Rows, flat: Flat) -> PackedRows:
        if self.format.levels is not None:  # iq4_nl: levels[code] d
            table = torch.tensor(
                self.format.levels, dtype=torch.float32, device=rows["codes"].device
            )
            return PackedRows("lookup", self.head_dim, rows["codes"], self.container,
                              scale=rows["scale"], table=table)  # fmt: skip
        return PackedRows(
            "affine", self.head_dim, rows["codes"], self.container, float(self.format.zero),
            rows["scale"], rows.get("offset"),
        )  # fmt: skip

    @staticmethod
    def categories() -> dict[str, str]:
        return {"codes": "codes", "scale": "qparams", "offset": "qparams"}


def make(
    scheme: QuantScheme, head_dim: int, dtype: torch.dtype, state: dict[str, Tensor], where: str
) -> Codec:
    return GgmlBlockCodec(scheme, head_dim)
