"""A8: symmetric INT8 for the input of a linear layer, static per tensor or dynamic per
token. The number format is `kvq.quant.affine`'s symmetric INT8 (the one the fused
RMSNorm + INT8 producer and the W8A8 GEMM of `kvq.runtime.kernels.activations.a8` use); scales are
stored float32 (`kv_formats.scale_for`), like the static K/V scales engines load.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvq.quant import affine
from kvq.quant.schemes import ACTIVATION_MODES  # noqa: F401 (re-exported)

BITS = 8
SCALE_DTYPE = torch.float32
PREFIX = "act."
SUFFIX = ".input_scale"


def input_scale_name(linear: str) -> str:
    """The artifact tensor of a linear's static input scale: "layers.3.mlp.down_proj" ->
    "act.layers.3.mlp.down_proj.input_scale"."""
    return f"{PREFIX}{linear}{SUFFIX}"


def linear_of(tensor_name: str) -> str:
    """The inverse of `input_scale_name`."""
    return tensor_name[len(PREFIX) : -len(SUFFIX)]


def encode_static(x: Tensor, scale: Tensor) -> Tensor:
    """int8 codes of x [..., K] with one stored scale [1]."""
    return affine.symmetric_encode(x, scale, BITS)


def encode_dynamic(x: Tensor) -> tuple[Tensor, Tensor]:
    """Per-token codes of x [..., K]: (int8 [..., K], scale [..., 1] float32)."""
    return affine.quantize_symmetric(x, BITS, dim=-1, scale_dtype=SCALE_DTYPE)


def decode(codes: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    return affine.symmetric_decode(codes, scale, dtype)


def round_trip(x: Tensor, scale: Tensor | None) -> Tensor:
    """x [..., K] as an A8 linear sees it: static with `scale` [1], dynamic per token
    when scale is None. Same dtype as x."""
    if scale is None:
        codes, scale = encode_dynamic(x)
    else:
        codes = encode_static(x, scale)
    return decode(codes, scale, x.dtype)
