"""KIVI keys (article 0x06): per channel, over groups of G tokens, fixed once a group fills.

Keys of one channel vary little from token to token but a lot from channel to channel, so
KIVI gives each channel its own (scale, offset) over a group of G consecutive tokens. A
group is quantized only once it is full; until then its rows wait, exact, in the layer's
residual window (`LayerPolicy.residual_tokens`), so quantized history always holds whole
groups and no qparam is ever rewritten.

A group's D scales and offsets are spread over its G rows (`slots` = ceil(D / G) per row),
so they live in the row store and move, reorder and evict with their rows.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvq.errors import KvqError
from kvq.quant import affine, packing
from kvq.quant.qparams import storage_dtype
from kvq.quant.schemes import QuantScheme
from kvq.runtime.codecs.base import NO_FLAT, Codec, Flat, Rows
from kvq.runtime.packed import PackedRows


class KiviKeyCodec(Codec):
    """Asymmetric integer keys with one (scale, offset) per channel per group of G tokens."""

    def __init__(self, scheme: QuantScheme, head_dim: int):
        super().__init__(head_dim, torch.float32)
        self.bits, self.group_rows = scheme.bits, scheme.group_size
        self.slots = -(-head_dim // self.group_rows)  # qparam slots per row
        self.scale_dtype = storage_dtype(scheme.scale_dtype)

    def encode(self, x: Tensor) -> tuple[Rows, Flat]:
        """x [B, H, T, D], T a multiple of G -> codes and the groups' qparams, per row."""
        b, h, t, d = x.shape
        g = self.group_rows
        if t % g:
            raise KvqError(f"KIVI keys arrive in whole groups of {g} tokens, got {t}")
        groups = x.float().reshape(b, h, t // g, g, d)
        # live tokens: a channel nearly constant over a group is no error (see store_scale)
        codes, scale, offset = affine.quantize_affine(
            groups, self.bits, -2, self.scale_dtype, raise_tiny=False
        )
        packed = packing.pack_bits(codes.reshape(b, h, t, d), self.bits)
        return {
            "codes": packed,
            "scale": self._spread(scale),
            "offset": self._spread(offset),
        }, NO_FLAT

    def _spread(self, q: Tensor) -> Tensor:
        """[B, H, n, 1, D] per group -> [B, H, n G, slots]: the group's rows carry its D values."""
        b, h, n, _, d = q.shape
        flat = q.new_zeros(b, h, n, self.group_rows * self.slots)
        flat[..., :d] = q[:, :, :, 0]
        return flat.view(b, h, n * self.group_rows, self.slots)

    def _per_row(self, q: Tensor) -> Tensor:
        """[B, H, T, slots] spread qparams -> [B, H, T, D]: each row's group's values."""
        b, h, t, s = q.shape
        g = self.group_rows
        per_group = q.reshape(b, h, t // g, g * s)[..., : self.head_dim]
        return per_group.repeat_interleave(g, dim=2)

    def packed(self, rows: Rows, flat: Flat) -> PackedRows:
        # per-row qparams with D groups of one channel: the decoders' ordinary layout
        return PackedRows(
            "affine",
            self.head_dim,
            rows["codes"],
            self.bits,
            scale=self._per_row(rows["scale"]),
            offset=self._per_row(rows["offset"]),
        )

    @staticmethod
    def categories() -> dict[str, str]:
        return {"codes": "codes", "scale": "qparams", "offset": "qparams"}
