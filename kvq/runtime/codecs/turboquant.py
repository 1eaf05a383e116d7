"""vLLM's TurboQuant rows as codecs (`--policy vllm:turboquant_*`; numerics in
`kvq.quant.turboquant`). The FP8 keys of turboquant_k8v4 are kvq's FP8 codec with a unit
scale.

Keys store 3- or 4-bit level indices of the rotated unit row and its fp16 norm: they
decode as lookup rows, level x (norm / |levels of the row|), turned back by the rows'
`rotation` (so on the reference decode: Triton refuses rotated rows). Values store
min/max codes with fp16 scale and minimum: affine rows every decoder reads.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvq.quant import packing, turboquant
from kvq.quant.schemes import QuantScheme
from kvq.runtime.codecs.base import NO_FLAT, Codec, Flat, Rows
from kvq.runtime.packed import PackedRows


class TurboKeyCodec(Codec):
    def __init__(self, bits: int, head_dim: int):
        turboquant.turboquant_head_dim(head_dim)
        super().__init__(head_dim, torch.float32)
        self.bits = bits
        self.levels = turboquant.levels(head_dim, bits)  # [2^bits]
        self.rotation = turboquant.rotation(head_dim)  # [D, D], its own inverse

    def encodes_like(self, other: Codec) -> bool:
        return type(other) is type(self) and (other.bits, other.head_dim) == (
            self.bits, self.head_dim
        )  # fmt: skip

    def encode(self, x: Tensor) -> tuple[Rows, Flat]:
        index, norm = turboquant.encode_keys(x, self.bits)  # [B, H, T, D], [B, H, T, 1]
        return {"codes": packing.pack_bits(index, self.bits), "norm": norm}, NO_FLAT

    def packed(self, rows: Rows, flat: Flat) -> PackedRows:
        codes = rows["codes"]
        index = packing.unpack_bits(codes, self.bits, self.head_dim)
        scale = turboquant.key_row_scale(index, rows["norm"], self.bits)  # norm correction
        return PackedRows(
            "lookup", self.head_dim, codes, self.bits, scale=scale,
            table=self.levels.to(codes.device), rotation=self.rotation.to(codes.device),
        )  # fmt: skip

    @staticmethod
    def categories() -> dict[str, str]:
        return {"codes": "codes", "norm": "qparams"}


class TurboValueCodec(Codec):
    def __init__(self, bits: int, head_dim: int):
        super().__init__(head_dim, torch.float32)
        self.bits = bits

    def encodes_like(self, other: Codec) -> bool:
        return type(other) is type(self) and (other.bits, other.head_dim) == (
            self.bits, self.head_dim
        )  # fmt: skip

    def encode(self, x: Tensor) -> tuple[Rows, Flat]:
        codes, scale, lo = turboquant.encode_values(x, self.bits)
        return {"codes": packing.pack_bits(codes, self.bits), "scale": scale, "min": lo}, NO_FLAT

    def packed(self, rows: Rows, flat: Flat) -> PackedRows:
        return PackedRows(
            "affine", self.head_dim, rows["codes"], self.bits, scale=rows["scale"],
            offset=rows["min"],
        )  # fmt: skip

    @staticmethod
    def categories() -> dict[str, str]:
        return {"codes": "codes", "scale": "qparams", "min": "qparams"}


def make(
    scheme: QuantScheme, head_dim: int, dtype: torch.dtype, state: dict[str, Tensor], where: str
) -> Codec:
    # QuantScheme admits engine="turboquant" only for these two
    if scheme.format == "nuq":
        return TurboKeyCodec(scheme.bits, head_dim)
    return TurboValueCodec(scheme.bits, head_dim)
