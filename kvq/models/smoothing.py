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


def smooth_lambdas(tensors: dict[str, Tensor], num_layers: int) -> dict[int, Tensor]:
    """layer -> lambda [H_kv, D] from an artifact's `smooth` tensors (names checked)."""
    out: dict[int, Tensor] = {}
    for name, t in tensors.items():
        m = _NAME.match(name)
        if m is None or int(m.group(1)) >= num_layers:
            raise KvqError(f"unexpected smooth tensor {name!r}")
        out[int(m.group(1))] = t
    return out


def fold_smooth(loaded, tensors: dict[str, Tensor]) -> None:
    """Fold the artifact's lambdas into `loaded.model` (the registered "smooth" transform).
    The artifact reader has checked their shapes and values (`runtime.validate`)."""
    adapter = loaded.adapter
    adapter.check_qk_scalable()
    for layer, lam in sorted(smooth_lambdas(tensors, adapter.num_layers).items()):
        adapter.scale_qk(layer, lam.to(torch.float32))
