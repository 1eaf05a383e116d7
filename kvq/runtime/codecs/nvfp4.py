"""NVFP4 K/V rows (`kvq.quant.nvfp4`): 4-bit E2M1 codes, one FP8 E4M3 scale per block of 16
channels computed at append, and a float32 global scale per layer side, calibrated
(`kvq calibrate kv-scales --format nvfp4`) or 1.0 (what an engine assumes without one).
The rows decode through the E2M1 table times each block's scale / global."""

from __future__ import annotations

import torch
from torch import Tensor

from kvq.quant import nvfp4, packing
from kvq.quant.schemes import QuantScheme
from kvq.runtime.codecs.base import NO_FLAT, Codec, Flat, Rows, static_scale
from kvq.runtime.packed import PackedRows


class Nvfp4Codec(Codec):
    def __init__(self, head_dim: int, global_scale: Tensor | None, where: str):
        super().__init__(head_dim, torch.float32)
        if global_scale is not None:
            static_scale(global_scale, "tensor", nvfp4.FP8_MAX, f"{where}.global")
            self.static = {"global_scale": global_scale}
        self.g = torch.ones(()) if global_scale is None else global_scale.float().reshape(())
        self.levels = torch.tensor(nvfp4.LEVELS)

    def encodes_like(self, other: Codec) -> bool:
        return (type(other) is Nvfp4Codec and other.head_dim == self.head_dim
                and torch.equal(other.g, self.g))  # fmt: skip

    def encode(self, x: Tensor) -> tuple[Rows, Flat]:
        codes, s = nvfp4.quantize(x, self.g.to(x.device))  # [B, H, T, D], [B, H, T, D/16]
        return {"codes": packing.pack_bits(codes, 4), "scale": s}, NO_FLAT

    def packed(self, rows: Rows, flat: Flat) -> PackedRows:
        codes = rows["codes"]
        step = rows["scale"].float() / self.g.to(codes.device)  # [B, H, T, D/16]
        return PackedRows(
            "lookup", self.head_dim, codes, 4, scale=step, table=self.levels.to(codes.device)
        )

    @staticmethod
    def categories() -> dict[str, str]:
        return {"codes": "codes", "scale": "qparams"}


def make(
    scheme: QuantScheme, head_dim: int, dtype: torch.dtype, state: dict[str, Tensor], where: str
) -> Codec:
    return Nvfp4Codec(head_dim, state.get("global_scale"), where)
