"""A value derived from a tensor, computed once per tensor object.

Static tensors (a layer's codebook, its RoPE tables) are read on every append and decode
step; what is derived from them (checks that sync a GPU, permuted tables) should not be
redone each time. Entries are keyed by the tensor's id, dropped when the tensor is
garbage collected, and recomputed when it is edited in place (its version counter moves).
Tensors made under `torch.inference_mode` have no version counter: their entries hold
until the tensor is collected (kvq never edits its static tables in place).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TypeVar

from torch import Tensor

V = TypeVar("V")

Memo = dict[int, tuple[weakref.ref, int, object]]  # id -> (weak ref, version, value)


def tensor_version(tensor: Tensor) -> int:
    """The tensor's in-place edit counter; 0 for an inference tensor, which keeps none."""
    return 0 if tensor.is_inference() else tensor._version


def memoised(memo: Memo, tensor: Tensor, build: Callable[[], V]) -> V:
    """build()'s value for this tensor object and version, from `memo` or computed now."""
    key = id(tensor)
    hit = memo.get(key)
    if hit is not None and hit[0]() is tensor and hit[1] == tensor_version(tensor):
        return hit[2]  # type: ignore[return-value]
    value = build()
    # the dict is bound as a default: the callback may fire during interpreter teardown
    ref = weakref.ref(tensor, lambda _, k=key, m=memo: m.pop(k, None))
    memo[key] = (ref, tensor_version(tensor), value)
    return value
