"""The `rotate` model transform: an orthogonal rotation of each KV head's values folded
into the model's weights.

An artifact holds `layers.{i}.rotate.value` [H_kv, D, D] (float32, orthogonal). Folding
maps each value v to R v (the v_proj rows and bias of the head) and each attention output
o back by R^T (the o_proj columns of every query head that reads the KV head), so the
model computes the same function while the cache stores rotated values: after a
randomized Hadamard no channel carries an outlier, so a per-token range fits every
channel. Where the rotation goes is the adapter's business (`rotate_values`).
"""

from __future__ import annotations

import re

import torch
from torch import Tensor

from kvq.models.smoothing import layer_tensors

_NAME = re.compile(r"^layers\.(\d+)\.rotate\.value$")


def value_rotations(tensors: dict[str, Tensor], num_layers: int) -> dict[int, Tensor]:
    """layer -> R [H_kv, D, D] from an artifact's `rotate` tensors (names checked)."""
    return layer_tensors(tensors, _NAME, num_layers, "rotate")


def fold_rotation(loaded, tensors: dict[str, Tensor]) -> None:
    """Fold the artifact's value rotations into `loaded.model` (the registered "rotate"
    transform). The artifact reader has checked their shapes and orthogonality."""
    adapter = loaded.adapter
    adapter.check_values_rotatable()
    for layer, rot in sorted(value_rotations(tensors, adapter.num_layers).items()):
        adapter.rotate_values(layer, rot.to(torch.float32))
