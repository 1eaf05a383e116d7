"""The `smooth` model transform: SmoothAttention's scales folded into a model's weights.

An artifact holds `layers.{i}.smooth.lambda` [H_kv, D] (float32, positive, equal within
each RoPE pair). Folding multiplies each query channel by its KV head's lambda and divides
each key channel by it, so q.k, and every attention output, is unchanged before
quantization while the cached keys lose the range that moved into the queries. Where the
scales go (projection rows and biases, or q/k norm weights) is the adapter's business.
"""

from __future__ import annotations

import re

import torch
from torch import Tensor

from kvq.errors import KvqError

_NAME = re.compile(r"^layers\.(\d+)\.smooth\.lambda$")


def layer_tensors(
    tensors: dict[str, Tensor], name: re.Pattern, num_layers: int, kind: str
) -> dict[int, Tensor]:
    """layer -> tensor from one transform kind's tensors, each named by `name` (whose
    group 1 is the layer index, below num_layers), else KvqError."""
    out: dict[int, Tensor] = {}
    for full, t in tensors.items():
        m = name.match(full)
        if m is None or int(m.group(1)) >= num_layers:
            raise KvqError(f"unexpected {kind} tensor {full!r}")
        out[int(m.group(1))] = t
    return out


def smooth_lambdas(tensors: dict[str, Tensor], num_layers: int) -> dict[int, Tensor]:
    """layer -> lambda [H_kv, D] from an artifact's `smooth` tensors (names checked)."""
    return layer_tensors(tensors, _NAME, num_layers, "smooth")


def fold_smooth(loaded, tensors: dict[str, Tensor]) -> None:
    """Fold the artifact's lambdas into `loaded.model` (the registered "smooth" transform).
    The artifact reader has checked their shapes and values (`runtime.validate`)."""
    adapter = loaded.adapter
    adapter.check_qk_scalable()
    for layer, lam in sorted(smooth_lambdas(tensors, adapter.num_layers).items()):
        adapter.scale_qk(layer, lam.to(torch.float32))
