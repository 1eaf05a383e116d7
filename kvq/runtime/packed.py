"""`PackedRows`: stored K or V rows described in the terms every decoder shares.

A codec stores rows as named tensors; `Codec.packed` describes them as one of
five kinds whose decode is a single formula, so the pure-torch reference and
the Triton kernels read the same structure:

    full:    x = data                                  (sink rows, unquantized layers)
    affine:  x = (code - zero - zero_point) * scale + offset
    lookup:  x = table[code] * scale + offset           (NUQ codebook, or the 256 fp8 values)
    vector:  x[c] = table[index of c's group, c's coordinate] * scale + offset
             (vector codebooks, `kvq.quant.vq`: a group's index is m digits of `bits` bits)
    trellis: x[c] = table[state of c] * scale + offset
             (bit-shift trellis codes, `kvq.quant.trellis`: c's state is the last `window`
             bits of the row's digits up to c's)

followed by exact exceptions that REPLACE decoded coordinates (article 0x07C):
fixed per-row slots (values) or variable-length flat entries (keys); rows stored
rotated are then un-rotated (x @ rotation).

Qparams come in three layouts, told apart by rank: `[B, H, T, G]` per row
(G groups of D // G channels), `[H, D]` per channel (static) and `[H]` per head
(static). `decode_packed` is the one pure-torch decoder; it uses the shared
quantizers of `kvq.quant`, so it is bit-exact with what calibration measures.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass, replace
from typing import Literal

import torch
from torch import Tensor

from kvq.errors import KvqError
from kvq.quant import packing, sparse, trellis, vq

Kind = Literal["full", "affine", "lookup", "vector", "trellis"]
KINDS = ("full", "affine", "lookup", "vector", "trellis")


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
    table: Tensor | None = None  # lookup: [2^bits] levels; vector: [2^(bits m), m] centroids;
    # trellis: [2^window] levels
    groups: Tensor | None = None  # vector: [D / m, m] int64 channels of each group
    slot_index: Tensor | None = None  # [B, H, T, S] channel of each exception; D = unused slot
    slot_value: Tensor | None = None  # [B, H, T, S]
    sparse_count: Tensor | None = None  # [B, H, T] flat entries per (batch, head, row)
    sparse_index: Tensor | None = None  # [E] channel, entries ordered by (row, batch, head)
    sparse_value: Tensor | None = None  # [E]
    pre_rope: bool = False  # keys stored before rotation: rotate at each row's position
    window: int = 0  # trellis: state bits
    # [D, D] float32: rows were stored rotated; decoded rows are x @ rotation (vLLM's
    # int4_per_token_head un-rotated, `kvq.quant.vllm_int4`); the reference decodes them
    rotation: Tensor | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise KvqError(f"unknown packed kind {self.kind!r}")
        if self.kind != "full" and self.scale is None:
            raise KvqError(f"{self.kind} rows need a scale")
        if self.kind == "lookup" and (self.table is None or self.table.numel() != 2**self.bits):
            raise KvqError(f"lookup rows need a table of {2**self.bits} levels")
        if self.kind == "vector":
            m = 0 if self.groups is None or self.groups.dim() != 2 else self.groups.shape[1]
            if not m or self.groups.numel() != self.head_dim:
                raise KvqError(f"vector rows need groups [D / m, m] covering {self.head_dim}")
            if self.table is None or tuple(self.table.shape) != (2 ** (self.bits * m), m):
                raise KvqError(f"vector rows need a table of {2 ** (self.bits * m)} x {m}")
        if self.kind == "trellis":
            trellis.check_window(self.bits, self.window)
            if self.table is None or self.table.numel() != 2**self.window:
                raise KvqError(f"trellis rows need a table of {2**self.window} levels")

    @property
    def vector_dim(self) -> int:
        """Channels coded jointly by one codebook index (1 unless kind is vector)."""
        return 1 if self.groups is None else self.groups.shape[1]

    @property
    def rows(self) -> int:
        return self.data.shape[2]

    @property
    def qaxis(self) -> Literal["none", "row", "channel", "head"]:
        if self.scale is None:
            return "none"
        return {4: "row", 2: "channel", 1: "head"}[self.scale.dim()]

    def narrow(self, start: int, stop: int, pointers: Tensor | None = None) -> PackedRows:
        """Rows [start, stop) (views; flat entries sliced by the prefix sum of counts).
        pointers: `row_pointers(sparse_count)`, for a caller narrowing many times."""

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
        ptr = row_pointers(self.sparse_count) if pointers is None else pointers
        a, b = int(ptr[start]), int(ptr[stop])
        return replace(
            out, sparse_index=self.sparse_index[a:b], sparse_value=self.sparse_value[a:b]
        )


def row_pointers(count: Tensor) -> Tensor:
    """[T + 1] first flat entry of each row (all batches and heads), from counts [B, H, T]."""
    per_row = count.long().sum(dim=(0, 1))
    return torch.cat([per_row.new_zeros(1), per_row.cumsum(0)])


def entry_pointers(count: Tensor) -> Tensor:
    """[B, H, T] int32 first flat entry of each (batch, head, row): entries go row, batch, head.

    A strided view of a [T, B, H] buffer (three ops: it is rebuilt on every Triton decode
    call, where each op is a kernel launch on CUDA)."""
    c = count.permute(2, 0, 1)  # [T, B, H]: (row, batch, head) order
    end = torch.cumsum(c.reshape(-1), 0, dtype=torch.int32).view(c.shape)
    return (end - c).permute(1, 2, 0)


def _apply(x: Tensor, t: Tensor, op: str) -> None:
    """x [B, H, T, D] op= qparam t in place (op: "sub_", "mul_", "add_"), any qparam layout.
    t in any float dtype: the in-place op computes in x's float32, as t.float() would
    (exactly), without a converted copy (a decode step runs this per layer and side)."""
    if t.dim() == 4 and t.shape[-1] == 1:  # [B, H, T, 1]: one group, broadcast as is
        getattr(x, op)(t)
    elif t.dim() == 4:  # [B, H, T, G]: each group covers D // G consecutive channels
        g = t.shape[-1]
        getattr(x.view(*x.shape[:-1], g, x.shape[-1] // g), op)(t[..., None])
    elif t.dim() == 2:  # [H, D] per channel
        getattr(x, op)(t[None, :, None, :])
    else:  # [H] per head
        getattr(x, op)(t[None, :, None, None])


def decode_packed(p: PackedRows, out: Tensor | None = None) -> Tensor:
    """Packed rows -> [B, H, T, D] float32 (exceptions merged, keys NOT rotated).

    In-place arithmetic on one fp32 buffer: the same operations, in the same order, as
    the shared quantizers' decode functions, so results are bit-identical. out: a float32
    [B, H, T, D] view to decode into (e.g. a segment's rows of a whole layer's buffer, so
    attention needs no concatenation); returned filled.
    """
    if out is not None and (p.kind not in ("full", "affine") or p.rotation is not None):
        return out.copy_(decode_packed(p))
    if p.kind == "full":
        return p.data.float() if out is None else out.copy_(p.data)
    if p.kind == "affine":  # 8-bit codes are their own bytes: no unpacked copy
        if p.bits == 8:
            x = p.data.float() if out is None else out.copy_(p.data)  # [B, H, T, D]
        else:
            x = packing.unpack_float(p.data, p.bits, p.head_dim, out)
        if p.zero:
            x.sub_(p.zero)
        if p.zero_point is not None:
            _apply(x, p.zero_point, "sub_")
    elif p.kind == "vector":  # m digits per group index, one gather of m coordinates
        digits = packing.unpack_bits(p.data, p.bits, p.head_dim)
        x = vq.decode(digits, p.table, p.groups, p.bits)
    elif p.kind == "trellis":  # the state of each element: the row's last `window` bits
        digits = packing.unpack_bits(p.data, p.bits, p.head_dim)
        x = trellis.decode(digits, p.table, p.bits, p.window)
    else:  # one gather per packed byte
        x = packing.unpack_lookup(p.data, p.table.float(), p.bits, p.head_dim)
    _apply(x, p.scale, "mul_")
    if p.offset is not None:
        _apply(x, p.offset, "add_")
    if p.slot_index is not None:
        # slot indices are checked where rows enter a cache: kvq's encoders make them
        # valid, `load_cache` checks a saved file's (not every decode step)
        index, value = p.slot_index.long(), p.slot_value.float()
        x = sparse.merge_exceptions(x, index, value, inplace=True, checked=False)
    if p.sparse_count is not None and p.sparse_index.numel():
        x = _merge_flat(x, p.sparse_count, p.sparse_index, p.sparse_value)
    if p.rotation is not None:
        x = x @ p.rotation
    return x if out is None or x is out else out.copy_(x)


def _merge_flat(x: Tensor, count: Tensor, index: Tensor, value: Tensor) -> Tensor:
    """Replace the coordinates named by flat entries (row, batch, head order) with their
    values, in place (x is decode's own fresh buffer)."""
    b, h, t, _ = x.shape
    owner = torch.repeat_interleave(
        torch.arange(t * b * h, device=x.device), count.permute(2, 0, 1).reshape(-1).long()
    )  # entry -> its row, numbered in (row, batch, head) order
    x[(owner // h) % b, owner % h, owner // (b * h), index.long()] = value.float()
    return x


# --- plane and pair order: the reference's fast CPU decode -----------------------------------
#
# A packed byte holds `per` = 8 / bits consecutive channels. Interleaving them back into
# channel order costs more than all the arithmetic, so the reference decodes into PLANES
# instead: plane k holds code slot k of every byte (one shift and mask of whole bytes), and
# attention is invariant under a channel permutation applied to both query and key, so the
# reference computes in that order and permutes only the small query and output tensors.
#
# * plane order: plane k holds channels k, k + per, k + 2 per, ...
# * pair order, for pre-RoPE keys: plane k holds each of its RoPE pairs (c, c + D/2) side
#   by side as (real, imaginary), so the rotation is one complex multiply. Byte i of the
#   first half of a row holds channels i * per + k, byte i of the second half their
#   partners: a little-endian int16 made of the two bytes puts each pair side by side.


def layout_perm(head_dim: int, bits: int, pairs: bool = False, device=None) -> Tensor:
    """[D] channel held at each position of the planes, flattened: plane order
    perm[k * D/per + i] = i * per + k; pair order perm[k * D/per + 2 i + r] = i * per + k
    + r * D/2."""
    per, halves = 8 // bits, 2 if pairs else 1
    k = torch.arange(per, device=device)[:, None, None]
    i = torch.arange(head_dim // (halves * per), device=device)[None, :, None]
    r = torch.arange(halves, device=device)[None, None, :]
    return (i * per + k + r * (head_dim // halves)).reshape(-1)


@functools.cache
def _layout(head_dim: int, bits: int, pairs: bool, device: torch.device) -> tuple[Tensor, Tensor]:
    """(`layout_perm`, its inverse), built once per layout and device: two decoders are made
    per segment on every decode call, and rebuilding these cost them about 260 us together
    on CPU. Shared: read-only."""
    perm = layout_perm(head_dim, bits, pairs, device)
    return perm, torch.argsort(perm)


def plane_decodable(p: PackedRows, pairs: bool = False) -> bool:
    """Whether `ChunkDecoder` decodes `p` in planes (else it falls back to channel order)."""
    if p.kind != "affine" or p.bits not in (2, 4, 8) or p.rotation is not None:
        return False
    if pairs and sys.byteorder != "little":  # the int16 trick reads its bytes low first
        return False
    per = 8 // p.bits
    if p.head_dim % (2 * per):
        return False
    if p.qaxis != "row":
        return True
    groups = p.scale.shape[-1]  # per-row groups must cover whole runs of a plane
    return (p.head_dim // groups) % per == 0 and (not pairs or groups % 2 == 0 or groups == 1)


def lookup_pairs_decodable(p: PackedRows) -> bool:
    """Whether `ChunkDecoder(pairs=True)` decodes lookup rows `p` (static NUQ keys, flat
    exceptions allowed) in natural pair order; else it falls back to channel order."""
    return (
        p.kind == "lookup"
        and p.bits in (4, 8)
        and p.qaxis in ("channel", "head")
        and p.slot_index is None
        and p.rotation is None
        and p.head_dim % (16 // p.bits) == 0  # whole bytes in each half
        and sys.byteorder == "little"
    )


def _interleave(a: Tensor, b: Tensor, word: Tensor) -> Tensor:
    """uint8 [..., m] and [..., m] -> [..., 2m] bytes a_0, b_0, a_1, b_1, ... through the
    int16 buffer `word` [..., m]: a little-endian int16 holds its low byte first."""
    word.copy_(b).bitwise_left_shift_(8)
    return word.bitwise_or_(a).view(torch.uint8)


def _pair_bytes(packed: Tensor, bits: int, word: Tensor) -> Tensor:
    """Packed rows [..., n] (4 or 8 bits) -> bytes [..., n] whose codes, in order, are the
    channels in natural pair order: byte j of the first half (channels j*per ...) and byte
    j of the second half (their partners) are shuffled so that each output byte holds
    (channel, partner) code pairs, then interleaved."""
    half = packed.shape[-1] // 2
    a, b = packed[..., :half], packed[..., half:]
    if bits == 4:  # (a.lo, b.lo) then (a.hi, b.hi)
        low = torch.bitwise_left_shift(b, 4).bitwise_or_(a & 0x0F)
        high = torch.bitwise_right_shift(a, 4).bitwise_or_(b & 0xF0)
        a, b = low, high
    return _interleave(a, b, word)


class ChunkDecoder:
    """Decodes row ranges of one PackedRows for attention, hoisting per-segment work.

    Affine 2/4/8-bit rows without exceptions decode into planes, in plane order or, with
    pairs=True, pair order (see `layout_perm`), as code * scale + (offset - (zero +
    zero_point) * scale): the same affine map as `decode_packed`, reassociated, so equal to
    it within fp32 rounding (a few ulp) rather than bit-identical, in a few passes over
    buffers reused from chunk to chunk. The permutation and qparams are prepared once per
    segment. Static 4/8-bit lookup keys (NUQ, FP8) with pairs=True decode in natural pair
    order (channel i, then i + D/2, ...: the one-plane pair layout): one gather per byte
    through a table of each byte's levels, the exact exceptions merged at their pair
    positions. Anything else decodes through `decode_packed`, in channel order (one plane).
    """

    def __init__(self, p: PackedRows, pairs: bool = False):
        self.p = p
        no_exceptions = p.slot_index is None and p.sparse_count is None
        fast = plane_decodable(p, pairs) and no_exceptions
        self.lookup = pairs and not fast and lookup_pairs_decodable(p)
        self.pairs = pairs and (fast or self.lookup)
        self.perm = self.inverse = None
        if fast:
            self.perm, self.inverse = _layout(p.head_dim, p.bits, pairs, p.data.device)
        if self.lookup:  # natural pair order: the one-plane (8-bit) pair layout
            self.perm, self.inverse = _layout(p.head_dim, 8, True, p.data.device)
        self.planes = 8 // p.bits if fast else 1
        self.static = self.rows = self.row_biases = None
        # flat entries of each row, for narrowing chunk after chunk
        self.pointers = None if p.sparse_count is None else row_pointers(p.sparse_count)
        if self.lookup:
            self.per_byte = packing.byte_table(p.table.float(), p.bits)  # [256, codes/byte]
        if fast or self.lookup:
            scale, bias = self._scale_bias(p.scale, p.offset, p.zero_point)
        if fast and p.qaxis == "row":
            # [B, H, T, G] -> [B, H, T, G/halves, 1, halves]: a plane viewed as [..., C,
            # G/halves, D/G/per, halves] holds group i // (D/G/per) + r G/halves at position
            # i (pair i, half r in pair order)
            halves = 2 if pairs and scale.shape[-1] > 1 else 1
            self.rows = tuple(
                t.unflatten(-1, (halves, -1)).transpose(-1, -2)[..., None, :] for t in (scale, bias)
            )
            if not pairs:  # [B, H, T, G]: whole groups of plane positions, see row_bias
                self.row_biases = bias
        elif (fast or self.lookup) and scale.dim() == 1:  # per head: [1, 1, H, 1, 1]
            self.static = tuple(t.view(1, 1, -1, 1, 1) for t in (scale, bias))
        elif fast or self.lookup:  # per channel [H, D] -> [planes, 1, H, 1, D/planes]
            self.static = tuple(self.to_planes(t[None, :, None]) for t in (scale, bias))
        self._buffers = None  # reused from chunk to chunk; the first chunk is the largest

    def to_planes(self, x: Tensor) -> Tensor:
        """x [..., D] in channel order -> [planes, ..., D/planes] (contiguous) in plane order."""
        if self.perm is None:
            return x[None]
        return x[..., self.perm].unflatten(-1, (self.planes, -1)).movedim(-2, 0).contiguous()

    def to_channels(self, x: Tensor) -> Tensor:
        """The inverse of `to_planes`: [planes, ..., D/planes] -> [..., D] in channel order."""
        if self.perm is None:
            return x[0]
        return x.movedim(0, -2).flatten(-2)[..., self.inverse]

    def decode(self, start: int, stop: int, bias: bool = True) -> Tensor:
        """Rows [start, stop) -> [planes, B, H, C, D/planes] float32 (see `to_planes`). The
        planes are a buffer that the next call reuses. bias=False leaves out per-row biases,
        for a caller that folds `row_bias` into its sums instead."""
        p = self.p
        if self.perm is None:
            return decode_packed(p.narrow(start, stop, self.pointers))[None]
        if self.lookup:
            return self._decode_lookup(start, stop)
        per, mask = self.planes, (1 << p.bits) - 1
        packed = p.data[:, :, start:stop]  # [B, H, C, D/per] uint8
        b, h, c, n = packed.shape
        if self._buffers is None or self._buffers[1].shape[3] < c:
            new = packed.new_empty
            self._buffers = (
                new((per, b, h, c, n)),  # codes
                new((per, b, h, c, n), dtype=torch.float32),
                new((b, h, c, n // 2), dtype=torch.int16) if self.pairs else None,
            )
        codes, x, word = self._buffers
        if c != x.shape[3]:  # the last, shorter chunk
            codes, x, word = (None if t is None else t[..., :c, :] for t in self._buffers)
        if self.pairs:  # byte i of the first half next to byte i of the second half
            packed = _interleave(packed[..., : n // 2], packed[..., n // 2 :], word)
        for k in range(per):  # slot k of every byte: cheap uint8 shifts and masks
            if k == 0:
                torch.bitwise_and(packed, mask, out=codes[0])
            else:
                torch.bitwise_right_shift(packed, p.bits * k, out=codes[k])
                if k < per - 1:
                    codes[k].bitwise_and_(mask)
        x.copy_(codes)
        if self.static is not None:
            return torch.addcmul(self.static[1], x, self.static[0], out=x)
        scale, shift = (t[:, :, start:stop] for t in self.rows)
        grouped = x.unflatten(-1, (scale.shape[-3], -1, scale.shape[-1]))
        grouped.mul_(scale)
        if bias or self.row_biases is None:
            grouped.add_(shift)
        return x

    def _decode_lookup(self, start: int, stop: int) -> Tensor:
        """Static lookup rows [start, stop) -> [1, B, H, C, D] in natural pair order:
        level * scale + offset (fused, so within an ulp of `decode_packed`), exceptions
        replacing their coordinates."""
        p = self.p
        packed = p.data[:, :, start:stop]  # [B, H, C, D/per] uint8
        b, h, c, n = packed.shape
        if self._buffers is None or self._buffers[0].shape[2] < c:  # the first chunk
            self._buffers = (packed.new_empty((b, h, c, n // 2), dtype=torch.int16),)
        word = self._buffers[0][:, :, :c]  # reused from chunk to chunk
        index = _pair_bytes(packed, p.bits, word).reshape(-1).int()
        x = packing.gather_rows(self.per_byte, index).view(1, b, h, c, p.head_dim)
        x = torch.addcmul(self.static[1], x, self.static[0], out=x)
        if p.sparse_count is not None:
            rows = p.narrow(start, stop, self.pointers)
            if rows.sparse_index.numel():
                pos = self.inverse[rows.sparse_index.long()]  # channel -> pair position
                _merge_flat(x[0], rows.sparse_count, pos, rows.sparse_value)
        return x

    def row_bias(self, start: int, stop: int) -> Tensor | None:
        """Per-row biases [B, H, C, G] of rows [start, stop) that decode(bias=False) leaves
        out (plane order: group g covers positions g * D/G/per ... (g + 1) * D/G/per - 1 of
        every plane), or None when decode applies them all."""
        return None if self.row_biases is None else self.row_biases[:, :, start:stop]

    def _scale_bias(self, scale, offset, zero_point) -> tuple[Tensor, Tensor]:
        scale = scale.float()
        shift = self.p.zero if zero_point is None else zero_point.float() + self.p.zero
        bias = -shift * scale if offset is None else offset.float() - shift * scale
        return scale, bias
