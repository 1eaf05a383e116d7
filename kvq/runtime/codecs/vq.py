"""Vector-codebook codecs: KVQuant's normalisers and exact exceptions, with the dense
codes taken jointly over groups of channels (`kvq.quant.vq`).

Keys: static per-channel normaliser and thresholds, variable-length exceptions (as
`NuqKeyCodec`); values: per-row normaliser and a fixed number of exact exceptions per row
(as `NuqValueCodec`). Only the dense code differs: each group of `vector_dim` channels is
one codebook index, stored as `vector_dim` digits of `bits` bits, so a row's stored bytes
equal a NUQ row's of the same width.

Static state (artifact tensors under layers.{i}.{key|value}.):
    vq_codebook [2^(bits m), m] float16   the layer's centroids (normalised domain)
    vq_groups   [D / m, m]      int16     channels of each group (a permutation of 0..D-1)
    vq_weight   [H, D]          float32   channel weights of the nearest-centroid search
plus the NUQ key normaliser (scale, center, lower, upper) for keys.

`packed` describes the stored rows as "vector" `PackedRows` (codes, codebook, groups,
normaliser, exceptions): the attention decoders read the codes where they lie, the
reference through `kvq.quant.vq.decode`, the Triton decode kernel by a codebook gather in
registers. Appends encode in torch (`vq.encode`): there is no Triton append kernel.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvq.errors import KvqError
from kvq.quant import packing, vq
from kvq.quant.qparams import check_finite, storage_dtype
from kvq.quant.schemes import QuantScheme
from kvq.runtime.codecs.base import Codec, Flat, Rows, key_or_value, require
from kvq.runtime.codecs.nuq import NuqKeyCodec, NuqValueCodec, _index_dtype
from kvq.runtime.packed import PackedRows

VQ_STATE = ("vq_codebook", "vq_groups", "vq_weight")


def _vq_state(scheme: QuantScheme, head_dim: int, state: dict[str, Tensor], where: str):
    require(state, VQ_STATE, where)
    vq.check_codebook(state["vq_codebook"], scheme.bits, scheme.vector_dim, where)
    groups = state["vq_groups"]
    m = scheme.vector_dim
    if tuple(groups.shape) != (head_dim // m, m) or groups.dtype != torch.int16:
        raise KvqError(f"{where}.vq_groups: expected int16 [{head_dim // m}, {m}]")
    if not torch.equal(groups.long().reshape(-1).sort().values, torch.arange(head_dim)):
        raise KvqError(f"{where}.vq_groups: not a permutation of the {head_dim} channels")
    check_search_weight(state["vq_weight"], head_dim, f"{where}.vq_weight")


def check_search_weight(weight: Tensor, head_dim: int, name: str) -> None:
    """A codec's channel weights of its encode search: [H_kv, head_dim], finite, >= 0."""
    if weight.dim() != 2 or weight.shape[-1] != head_dim:
        raise KvqError(f"{name}: expected [H_kv, {head_dim}]")
    check_finite(weight.float(), name)
    if not bool((weight >= 0).all()):
        raise KvqError(f"{name}: weights must be non-negative")


class _VqMixin:
    """Dense codes over channel groups; the NUQ codec supplies normaliser and exceptions."""

    def _setup(self, scheme: QuantScheme, head_dim: int, state: dict[str, Tensor], where: str):
        _vq_state(scheme, head_dim, state, where)
        Codec.__init__(self, head_dim, torch.float32)
        self.bits, self.dim = scheme.bits, scheme.vector_dim
        self.fraction = scheme.outlier_fraction
        self.index_dtype = _index_dtype(head_dim)
        self.codebook = state["vq_codebook"].float()
        self.groups = state["vq_groups"].long()
        self.weight = state["vq_weight"].float()
        self.static = {n: state[n] for n in VQ_STATE}

    def _codes(self, x_norm: Tensor, holes: Tensor | None = None) -> Tensor:
        digits = vq.encode(x_norm, self.codebook, self.weight, self.groups, self.bits)
        return packing.pack_bits(digits, self.bits)

    def _rows(self, codes: Tensor, scale: Tensor, center: Tensor, exceptions) -> PackedRows:
        """codes [B, H, T, bytes]: x = codebook coordinate * scale + center, then the exact
        exceptions (what `nuq.denormalize` computes, in the same order)."""
        return PackedRows(
            "vector", self.head_dim, codes, self.bits, scale=scale, offset=center,
            table=self.codebook, groups=self.groups, **exceptions,
        )  # fmt: skip

    def row_spec(self, x: Tensor):
        return None  # no Triton append kernel: rows are encoded in torch

    def append_into(self, x: Tensor, buffers: dict[str, Tensor], start: int) -> Flat:
        raise NotImplementedError("vq codecs have no append kernel")


class VqKeyCodec(_VqMixin, NuqKeyCodec):
    """Static per-channel normaliser and thresholds; variable-length exact exceptions."""

    def __init__(self, scheme: QuantScheme, head_dim: int, state: dict[str, Tensor], where: str):
        names = ("scale", "center") + (("lower", "upper") if scheme.outlier_fraction else ())
        require(state, names, where)
        self._setup(scheme, head_dim, state, where)
        self.static |= {n: state[n] for n in names}
        self._scale = state["scale"][None, :, None, :]  # [1, H, 1, D]
        self._center = state["center"][None, :, None, :]
        self._lower = state["lower"][None, :, None, :] if self.fraction else None
        self._upper = state["upper"][None, :, None, :] if self.fraction else None

    def packed(self, rows: Rows, flat: Flat) -> PackedRows:
        exceptions = {}
        if self.fraction:
            count = rows["sparse_count"]
            exceptions = dict(
                sparse_count=count,
                sparse_index=flat.get("sparse_index", count.new_zeros(0)),
                sparse_value=flat.get("sparse_value", count.new_zeros(0, dtype=torch.float16)),
            )
        return self._rows(rows["codes"], self.static["scale"], self.static["center"], exceptions)


class VqValueCodec(_VqMixin, NuqValueCodec):
    """Per-token normaliser from the row's inliers; a fixed number of exact exceptions."""

    def __init__(self, scheme: QuantScheme, head_dim: int, state: dict[str, Tensor], where: str):
        self._setup(scheme, head_dim, state, where)
        self.scale_dtype = storage_dtype(scheme.scale_dtype)

    def packed(self, rows: Rows, flat: Flat) -> PackedRows:
        slots = {}
        if self.fraction:
            slots = dict(slot_index=rows["sparse_index"], slot_value=rows["sparse_value"])
        scale, center = rows["scale"][..., None], rows["center"][..., None]  # [B, H, T, 1]
        return self._rows(rows["codes"], scale, center, slots)


def make(
    scheme: QuantScheme, head_dim: int, dtype: torch.dtype, state: dict[str, Tensor], where: str
) -> Codec:
    return key_or_value(VqKeyCodec, VqValueCodec, scheme, head_dim, state, where, "vq")
