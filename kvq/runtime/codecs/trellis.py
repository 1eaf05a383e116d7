"""Trellis codecs: KVQuant's normalisers and exact exceptions, with the dense codes a
bit-shift trellis code over each row (`kvq.quant.trellis`).

Keys: static per-channel normaliser and thresholds, variable-length exceptions (as
`NuqKeyCodec`); values: per-row normaliser and a fixed number of exact exceptions per row
(as `NuqValueCodec`). Only the dense code differs: one `bits`-bit digit per element, as a
scalar code of that width stores, whose level is the table's entry at the last `window`
bits of the row, so a row's stored bytes equal a NUQ row's of the same width.

Static state (artifact tensors under layers.{i}.{key|value}.):
    trellis_table  [2^window] float16  levels (normalised domain); layers may share one
    trellis_weight [H, D]     float32  channel weights of the Viterbi search
plus the NUQ key normaliser (scale, center, lower, upper) for keys.

`packed` describes the stored rows as "trellis" `PackedRows`: the reference decodes them
(`decode_packed`), the Triton decode kernels too (the planned kernel: each element's
state cut from its unit of codes and the one before it, then its level). Appends run a
Viterbi search per row (`kernels.trellis_encode`: one Triton launch for CUDA tensors, the
torch search `trellis.encode` elsewhere); the normaliser and the exceptions in torch.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvq.quant import packing, trellis
from kvq.quant.schemes import QuantScheme
from kvq.runtime.codecs.base import Codec, key_or_value, require
from kvq.runtime.codecs.nuq import _index_dtype
from kvq.runtime.codecs.vq import VqKeyCodec, VqValueCodec, check_search_weight
from kvq.runtime.kernels.append.trellis import trellis_encode
from kvq.runtime.packed import PackedRows

TRELLIS_STATE = ("trellis_table", "trellis_weight")


class _TrellisMixin:
    """Dense trellis codes; the vq codecs supply normaliser, exceptions and row layout."""

    def _setup(self, scheme: QuantScheme, head_dim: int, state: dict[str, Tensor], where: str):
        require(state, TRELLIS_STATE, where)
        trellis.check_table(state["trellis_table"], scheme.window, where)
        weight = state["trellis_weight"]
        check_search_weight(weight, head_dim, f"{where}.trellis_weight")
        Codec.__init__(self, head_dim, torch.float32)
        self.bits, self.window = scheme.bits, scheme.window
        self.fraction = scheme.outlier_fraction
        self.index_dtype = _index_dtype(head_dim)
        self.table = state["trellis_table"].float()
        self.weight = weight.float()
        self.static = {n: state[n] for n in TRELLIS_STATE}

    def _codes(self, x_norm: Tensor, holes: Tensor | None = None) -> Tensor:
        """x_norm [B, H, T, D] -> packed digits (a Viterbi search per row); holes [B, H, T,
        D]: exact exceptions, weight 0 (the path is free there)."""
        w = self.weight[None, :, None, :]  # [1, H, 1, D]
        if holes is not None:
            w = w * ~holes
        digits = trellis_encode(x_norm.clamp(-1.0, 1.0), w, self.table, self.bits, self.window)
        return packing.pack_bits(digits, self.bits)

    def _rows(self, codes: Tensor, scale: Tensor, center: Tensor, exceptions) -> PackedRows:
        """codes [B, H, T, bytes]: x = table[state] * scale + center, then the exact
        exceptions."""
        return PackedRows(
            "trellis", self.head_dim, codes, self.bits, scale=scale, offset=center,
            table=self.table, window=self.window, **exceptions,
        )  # fmt: skip


class TrellisKeyCodec(_TrellisMixin, VqKeyCodec):
    """Static per-channel normaliser and thresholds; variable-length exact exceptions."""


class TrellisValueCodec(_TrellisMixin, VqValueCodec):
    """Per-token normaliser from the row's inliers; a fixed number of exact exceptions."""


def make(
    scheme: QuantScheme, head_dim: int, dtype: torch.dtype, state: dict[str, Tensor], where: str
) -> Codec:
    return key_or_value(
        TrellisKeyCodec, TrellisValueCodec, scheme, head_dim, state, where, "trellis"
    )
