"""TensorRT-LLM's INT8 K/V cache quantizer (`kv_cache_quant_algo: INT8`).

Read from NVIDIA/TensorRT-LLM and NVIDIA/TensorRT-Model-Optimizer (public code):
- one float32 `kv_cache_scaling_factor` per attention layer, shape (1,), shared by K and
  V (the attention layer has one parameter, not a k_scale and a v_scale);
- ModelOpt's export sets it to the larger of the K and V scales, amax / 127 each
  (`get_kv_cache_scaling_factor`: `max` over the layer's K and V quantizers);
- the engine keeps its reciprocal `kv_orig_quant_scale = 1 / scale` (float32) and the
  fused QKV kernel stores `cvt.rni.sat.s8.f32(x * kv_orig_quant_scale)`: float32 multiply,
  round to nearest even, saturate to [-128, 127] (so -128 is a code, unlike kvq's
  symmetric int8, which clamps at -127);
- reading back is code * scale.

There is no default: TensorRT-LLM builds an INT8 K/V engine only from a calibrated
checkpoint, so kvq runs this format only with calibrated scales (`kvq advise
--calibration`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvq.quant.qparams import check_finite

QMIN, QMAX = -128.0, 127.0


def shared_scale(key_scale: Tensor, value_scale: Tensor) -> Tensor:
    """The layer's one scale from calibrated per-tensor K and V scales ([1] each): the
    larger, as ModelOpt exports it, so neither side clips past its calibrated range."""
    return torch.maximum(key_scale.float(), value_scale.float()).reshape(1)


def quantize(x: Tensor, scale: Tensor) -> Tensor:
    """x [...] -> int8 codes [...]; scale: the layer's float32 scale ([1] or a scalar)."""
    check_finite(x, "key/value rows")
    reciprocal = 1.0 / scale.float()  # float32, as the engine stores kv_orig_quant_scale
    return torch.round(x.float() * reciprocal).clamp_(QMIN, QMAX).to(torch.int8)


def dequantize(codes: Tensor, scale: Tensor) -> Tensor:
    """codes [...] int8 -> [...] float32."""
    return codes.float() * scale.float()
