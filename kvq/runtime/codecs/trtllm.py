"""TensorRT-LLM's INT8 K/V cache as a codec (`trtllm:int8`, with calibrated scales;
`kvq.quant.trtllm_int8` holds the numerics).

It stores what kvq's static per-tensor int8 stores (codes offset to unsigned, +128, read
back as (code - 128) * scale), so it is that codec with TensorRT-LLM's encoder: reciprocal
multiply, round to nearest even, saturation to [-128, 127]. Rows are encoded in torch (kvq's
append kernel rounds kvq's way, clamping at -127).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvq.errors import KvqError
from kvq.quant import packing, trtllm_int8
from kvq.quant.schemes import QuantScheme
from kvq.runtime.codecs.base import NO_FLAT, Codec, Flat, Rows
from kvq.runtime.codecs.integer import IntChannelStaticCodec


class TrtllmInt8Codec(IntChannelStaticCodec):
    """int8 codes of x * (1 / scale), one float32 scale per layer shared by K and V."""

    def encode(self, x: Tensor) -> tuple[Rows, Flat]:
        codes = trtllm_int8.quantize(x, self.static["scale"].to(x.device))  # [B, H, T, D]
        stored = (codes.to(torch.int16) + (1 << (self.bits - 1))).to(torch.uint8)
        return {"codes": packing.pack_bits(stored, self.bits)}, NO_FLAT

    def row_spec(self, x: Tensor):
        return None


def make(
    scheme: QuantScheme, head_dim: int, dtype: torch.dtype, state: dict[str, Tensor], where: str
) -> Codec:
    if "scale" not in state:
        raise KvqError(f"{where}: TensorRT-LLM's INT8 K/V cache needs a calibrated scale")
    return TrtllmInt8Codec(scheme, head_dim, state["scale"], None, where)
