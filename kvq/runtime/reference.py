"""The attention oracle: plain softmax attention over whole decoded tensors.

Tests compare the chunked reference (`kvq.runtime.kernels.decode.reference`)
and the Triton kernel against it.
"""

from __future__ import annotations

import torch
from torch import Tensor


def dense_attention(
    query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, scaling: float
) -> Tensor:
    """Plain softmax attention over whole tensors: the test oracle for the chunked path.

    query [B, H_q, Q, D], key/value [B, H_kv, K, D], mask [B, 1, Q, K] bool or None.
    returns [B, H_q, Q, D] float32.
    """
    group = query.shape[1] // key.shape[1]
    k = key.float().repeat_interleave(group, dim=1)
    v = value.float().repeat_interleave(group, dim=1)
    s = query.float() @ k.transpose(-1, -2) * scaling
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, dim=-1) @ v
