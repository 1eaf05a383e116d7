"""Row codecs, one module per number format, found through `FORMATS`.

A codec turns the rows of one cached tensor family (keys or values of a layer) into
stored tensors and back (`base.Codec`). Each format module has a
`make(scheme, head_dim, activation_dtype, state, where) -> Codec`; a new number format is
a new module here plus its entry in `FORMATS`. Modules are imported on first use, so
building an int8 cache does not import the vq or trellis code.
"""

from __future__ import annotations

import importlib

import torch
from torch import Tensor

from kvq.errors import KvqError
from kvq.quant.schemes import QuantScheme
from kvq.runtime.codecs.base import Codec

# QuantScheme.format -> the module (in this package) whose `make` builds its codec
FORMATS: dict[str, str] = {
    "none": "base",
    "int": "integer",  # per-token, QServe KV4, static scales; KIVI keys (kivi.py)
    "fp8": "fp8",
    "nuq": "nuq",
    "vq": "vq",
    "trellis": "trellis",
    "ggml": "ggml",  # llama.cpp's block formats
    "nvfp4": "nvfp4",
    "mxfp4": "mxfp4",  # SGLang's fp4_e2m1
}
# (QuantScheme.engine, format) -> the module of a serving engine's own quantizer where it
# differs from kvq's for that format
ENGINE_NUMERICS = {
    ("vllm", "int"): "token_head",
    ("vllm", "fp8"): "token_head",
    ("trtllm", "int"): "trtllm",
    ("turboquant", "nuq"): "turboquant",
    ("turboquant", "int"): "turboquant",
}


def make_codec(
    scheme: QuantScheme,
    head_dim: int,
    activation_dtype: torch.dtype,
    state: dict[str, Tensor],
    where: str,
) -> Codec:
    """Build the codec for `scheme`; `state` holds its static tensors (may be empty).

    `where` names the policy entry (e.g. "layers.3.key") for error messages.
    """
    module = ENGINE_NUMERICS.get((scheme.engine, scheme.format)) or FORMATS.get(scheme.format)
    if module is None:
        raise KvqError(f"{where}: no runtime codec for {scheme.describe()}")
    make = importlib.import_module(f"{__name__}.{module}").make
    return make(scheme, head_dim, activation_dtype, state, where)
