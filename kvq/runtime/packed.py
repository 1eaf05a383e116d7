"""`PackedRows`: stored K or V rows described in the terms every decoder shares.

A codec stores rows as named tensors; `Codec.packed` describes them as one of
three kinds whose decode is a single formula, so the pure-torch reference and
the Triton kernels read the same structure:

    full:    x = data                                  (sink rows, unquantized layers)
    affine:  x = (code - zero - zero_point) * scale + offset
    lookup:  x = table[code] * scale + offset           (NUQ codebook, or the 256 fp8 values)

followed by exact exceptions that REPLACE decoded coordinates (article 0x07C):
fixed per-row slots (values) or variable-length flat entries (keys).

Qparams come in three layouts, told apart by rank: `[B, H, T, G]` per row
(G groups of D // G channels), `[H, D]` per channel (static) and `[H]` per head
(static). `decode_packed` is the one pure-torch decoder; it uses the shared
quantizers of `kvq.quant`, so it is bit-exact with what calibration measures.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import torch
from torch import Tensor

from kvq.errors import KvqError
from kvq.quant import packing, sparse

Kind = Literal["full", "affine", "lookup"]


@dataclass(frozen=True)
class PackedRows:
    kind: Kind
    head_dim: int
    data: Tensor  # [B, H, T, packed_len(D, bits)] uint8 codes, or [B, H, T, D] float ("full")
    bits: int = 16
    zero: float = 0.0  # affine: constant subtracted from codes (2^(bits-1) for symmetric)
    scale: Tensor | None = None  # [B, H, T, G] | [H, D] | [H]
    offset: Tensor | None = None  # same layout as scale; added after scaling
    zero_point: Tensor | None = None  # affine: floating zero-point (QServe), scale layout
    table: Tensor | None = None  # lookup: [2^bits] float32 reconstruction levels
    slot_index: Tensor | None = None  # [B, H, T, S] channel of each exception; D = unused slot
    slot_value: Tensor | None = None  # [B, H, T, S]
    sparse_count: Tensor | None = None  # [B, H, T] flat entries per (batch, head, row)
    sparse_index: Tensor | None = None  # [E] channel, entries ordered by (row, batch, head)
    sparse_value: Tensor | None = None  # [E]
    pre_rope: bool = False  # keys stored before rotation: rotate at each row's position

    def __post_init__(self) -> None:
        if self.kind not in ("full", "affine", "lookup"):
            raise KvqError(f"unknown packed kind {self.kind!r}")
        if self.kind != "full" and self.scale is None:
            raise KvqError(f"{self.kind} rows need a scale")
        if self.kind == "lookup" and (self.table is None or self.table.numel() != 2**self.bits):
            raise KvqError(f"lookup rows need a table of {2**self.bits} levels")

    @property
    def rows(self) -> int:
        return self.data.shape[2]

    @property
    def qaxis(self) -> Literal["none", "row", "channel", "head"]:
        if self.scale is None:
            return "none"
        return {4: "row", 2: "channel", 1: "head"}[self.scale.dim()]

    def narrow(self, start: int, stop: int) -> PackedRows:
        """Rows [start, stop) (views; flat entries sliced by the prefix sum of counts)."""

        def cut(t: Tensor | None) -> Tensor | None:
            return None if t is None else t[:, :, start:stop]

        per_row = self.qaxis == "row"
        out = replace(
            self,
            data=cut(self.data),
            scale=cut(self.scale) if per_row else self.scale,
            offset=cut(self.offset) if per_row else self.offset,
            zero_point=cut(self.zero_point) if per_row else self.zero_point,
            slot_index=cut(self.slot_index),
            slot_value=cut(self.slot_value),
            sparse_count=cut(self.sparse_count),
        )
        if self.sparse_count is None:
            return out
        ptr = row_pointers(self.sparse_count)
        a, b = int(ptr[start]), int(ptr[stop])
        return replace(
            out, sparse_index=self.sparse_index[a:b], sparse_value=self.sparse_value[a:b]
        )


def row_pointers(count: Tensor) -> Tensor:
    """[T + 1] first flat entry of each row (all batches and heads), from counts [B, H, T]."""
    per_row = count.long().sum(dim=(0, 1))
    return torch.cat([per_row.new_zeros(1), per_row.cumsum(0)])


def entry_pointers(count: Tensor) -> Tensor:
    """[B, H, T] int32 first flat entry of each (batch, head, row): entries go row, batch, head."""
    c = count.long().permute(2, 0, 1).reshape(-1)  # (row, batch, head) order
    start = (c.cumsum(0) - c).view(count.shape[2], count.shape[0], count.shape[1])
    return start.permute(1, 2, 0).to(torch.int32).contiguous()


def _apply(x: Tensor, t: Tensor, op: str) -> None:
    """x [B, H, T, D] op= qparam t in place (op: "sub_", "mul_", "add_"), any qparam layout."""
    if t.dim() == 4:  # [B, H, T, G]: each group covers D // G consecutive channels
        g = t.shape[-1]
        getattr(x.view(*x.shape[:-1], g, x.shape[-1] // g), op)(t.float()[..., None])
    elif t.dim() == 2:  # [H, D] per channel
        getattr(x, op)(t.float()[None, :, None, :])
    else:  # [H] per head
        getattr(x, op)(t.float()[None, :, None, None])


def decode_packed(p: PackedRows) -> Tensor:
    """Packed rows -> [B, H, T, D] float32 (exceptions merged, keys NOT rotated).

    In-place arithmetic on one fresh fp32 buffer: the same operations, in the same
    order, as the shared quantizers' decode functions, so results are bit-identical.
    """
    if p.kind == "full":
        return p.data.float()
    codes = packing.unpack_bits(p.data, p.bits, p.head_dim)  # [B, H, T, D] uint8
    if p.kind == "affine":
        x = codes.float()
        if p.zero:
            x.sub_(p.zero)
        if p.zero_point is not None:
            _apply(x, p.zero_point, "sub_")
    else:
        x = p.table.float()[codes.long()]
    _apply(x, p.scale, "mul_")
    if p.offset is not None:
        _apply(x, p.offset, "add_")
    if p.slot_index is not None:
        x = sparse.merge_exceptions(x, p.slot_index.long(), p.slot_value.float())
    if p.sparse_count is not None and p.sparse_index.numel():
        x = _merge_flat(x, p.sparse_count, p.sparse_index, p.sparse_value)
    return x


def _merge_flat(x: Tensor, count: Tensor, index: Tensor, value: Tensor) -> Tensor:
    """Replace the coordinates named by flat entries (row, batch, head order) with their values."""
    b, h, t, d = x.shape
    owner = torch.repeat_interleave(
        torch.arange(t * b * h, device=x.device), count.permute(2, 0, 1).reshape(-1).long()
    )
    out = x.permute(2, 0, 1, 3).reshape(t * b * h, d).clone()
    out[owner, index.long()] = value.float()  # replace, not add
    return out.view(t, b, h, d).permute(1, 2, 0, 3)


# --- plane order: the reference's fast CPU decode ---------------------------------------------
#
# A packed byte holds `per` = 8 / bits consecutive channels. Interleaving them back into
# channel order costs more than all the arithmetic, so the reference decodes into PLANE
# order instead: plane k holds channels k, k + per, k + 2 per, ... Attention is invariant
# under a channel permutation applied to both query and key, and RoPE partners (c, c + D/2)
# stay in one plane, so the reference computes in plane order and permutes only the small
# query and output tensors.


def plane_perm(head_dim: int, bits: int, device=None) -> Tensor:
    """[D] channel held at each plane-order position: perm[k * D/per + i] = i * per + k."""
    per = 8 // bits
    i = torch.arange(head_dim // per, device=device)
    return (i[None, :] * per + torch.arange(per, device=device)[:, None]).reshape(-1)


def plane_decodable(p: PackedRows) -> bool:
    """Whether `ChunkDecoder` decodes `p` in planes (else it falls back to channel order)."""
    if p.kind != "affine" or p.bits not in (2, 4, 8):
        return False
    per = 8 // p.bits
    if p.head_dim % (2 * per):
        return False
    return p.qaxis != "row" or (p.head_dim // p.scale.shape[-1]) % per == 0


class ChunkDecoder:
    """Decodes row ranges of one PackedRows for attention, hoisting per-segment work.

    Affine 2/4/8-bit rows without exceptions decode in plane order (no interleave) as
    code * scale + (offset - (zero + zero_point) * scale): the same affine map as
    `decode_packed`, reassociated, so equal to it within fp32 rounding (a few ulp) rather
    than bit-identical, in about half the passes. The permutation and static qparams are
    prepared once per segment. Anything else decodes through `decode_packed`.
    """

    def __init__(self, p: PackedRows):
        self.p = p
        no_exceptions = p.slot_index is None and p.sparse_count is None
        self.planes = plane_decodable(p) and no_exceptions
        self.perm = plane_perm(p.head_dim, p.bits, p.data.device) if self.planes else None
        self.planes_count = 8 // p.bits if self.planes else 1
        self.static = None
        if self.planes and p.qaxis in ("channel", "head"):
            self.static = self._plane_qparams(*self._scale_bias(p.scale, p.offset, p.zero_point))

    def decode(self, start: int, stop: int) -> list[Tensor]:
        """Rows [start, stop) -> one [B, H, C, D] float32 tensor in channel order, or (when
        `perm` is set) one contiguous [B, H, C, D/per] tensor per plane: plane k holds
        channels k, k + per, ... (`perm` concatenates the planes' channels)."""
        p = self.p
        if not self.planes:
            return [decode_packed(p.narrow(start, stop))]
        if self.static is not None:
            qparams = self.static
        else:  # per-row groups [B, H, C, G]: every plane sees the same group layout
            rows = (
                t if t is None else t[:, :, start:stop] for t in (p.scale, p.offset, p.zero_point)
            )
            scale, bias = self._scale_bias(*rows)
            qparams = [(scale[..., None], bias[..., None])] * (8 // p.bits)
        packed = p.data[:, :, start:stop]  # [B, H, C, D/per] uint8
        per, mask = 8 // p.bits, (1 << p.bits) - 1
        planes = []
        for k, (s, b) in enumerate(qparams):
            code = packed >> (p.bits * k) if k else packed
            x = (code & mask if k < per - 1 else code).float()  # shifts stay in uint8: cheap
            if s.dim() == 5:  # groups: [B, H, C, G, 1]
                x.unflatten(-1, (s.shape[-2], -1)).mul_(s).add_(b)
            else:
                x.mul_(s).add_(b)
            planes.append(x)
        return planes

    def _scale_bias(self, scale, offset, zero_point) -> tuple[Tensor, Tensor]:
        scale = scale.float()
        shift = torch.full_like(scale, self.p.zero)
        if zero_point is not None:
            shift = shift + zero_point.float()
        bias = -shift * scale if offset is None else offset.float() - shift * scale
        return scale, bias

    def _plane_qparams(self, scale: Tensor, bias: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Static qparams per plane, shaped [1, H, 1, D/per] to broadcast against codes."""
        per = 8 // self.p.bits
        if scale.dim() == 1:  # per head
            return [(scale.view(1, -1, 1, 1), bias.view(1, -1, 1, 1))] * per
        width = self.p.head_dim // per
        out = []
        for k in range(per):
            pick = self.perm[k * width : (k + 1) * width]
            out.append((scale[:, pick][None, :, None], bias[:, pick][None, :, None]))
        return out
