"""SGLang's `fp4_e2m1` K/V rows (`kvq.quant.mxfp4`): 4-bit E2M1 codes and one power-of-two
scale per block of 16 channels, computed at append; no calibration. The rows decode
through the E2M1 table times each block's 2^e (the reference decoder; the Triton decode
takes one scale per row group, not per block, and refuses them by name)."""

from __future__ import annotations

import torch
from torch import Tensor

from kvq.quant import mxfp4, nvfp4, packing
from kvq.quant.schemes import QuantScheme
from kvq.runtime.codecs.base import NO_FLAT, Codec, Flat, Rows
from kvq.runtime.packed import PackedRows


class Mxfp4Codec(Codec):
    def __init__(self, head_dim: int):
        super().__init__(head_dim, torch.float32)
        self.levels = torch.tensor(nvfp4.LEVELS)

    def encodes_like(self, other: Codec) -> bool:
        return type(other) is Mxfp4Codec and other.head_dim == self.head_dim

    def encode(self, x: Tensor) -> tuple[Rows, Flat]:
        codes, e = mxfp4.quantize(x)  # [B, H, T, D], [B, H, T, D/16]
        return {"codes": packing.pack_bits(codes, 4), "exponent": e}, NO_FLAT

    def packed(self, rows: Rows, flat: Flat) -> PackedRows:
        codes = rows["codes"]
        step = mxfp4.step(rows["exponent"])  # [B, H, T, D/16]
        table = self.levels.to(codes.device)
        return PackedRows("lookup", self.head_dim, codes, 4, scale=step, table=table)

    @staticmethod
    def categories() -> dict[str, str]:
        return {"codes": "codes", "exponent": "qparams"}


def make(
    scheme: QuantScheme, head_dim: int, dtype: torch.dtype, state: dict[str, Tensor], where: str
) -> Codec:
    # QuantScheme admits format="mxfp4" only as SGLang's block-16 variant
    return Mxfp4Codec(head_dim)
