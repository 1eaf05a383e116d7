"""The codec base: how one cached tensor family turns rows into stored tensors and back.

A codec is built from a `QuantScheme` plus, for static schemes, the calibrated
state read from the artifact. `encode` takes new rows `[B, H, T, D]` and returns
a dict of tensors whose third dimension is T (the row axis), ready to be written
into a `RowStore`; `decode` inverts it for any slice of rows. Static qparams
live in the codec itself (one copy per layer, counted once in the ledger).

The quantizers are the shared ones in `kvq.quant`: calibration measures error
with the same functions the runtime encodes with. `Codec` itself keeps rows in full
precision (the "none" format); each number format is a module beside this one.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvq.errors import KvqError
from kvq.quant.qparams import check_finite
from kvq.quant.schemes import QuantScheme
from kvq.runtime.packed import PackedRows, decode_packed

Rows = dict[str, Tensor]  # each tensor [B, H, T, ...]
Flat = dict[str, Tensor]  # variable-length entries, each [E, ...], ordered by (row, batch, head)
NO_FLAT: Flat = {}


class Codec:
    """Base: full precision. Stores rows unchanged in the activation dtype."""

    group_rows = 1  # rows encoded together (KIVI keys: a group of tokens shares qparams)
    # every row is stored in fixed-width row tensors, never as variable-length entries
    # (`Flat`): its rows can be written at an offset the device holds (a replayable step)
    fixed_width = True

    #: tensors of the codec's own (static) state, for the ledger
    static: dict[str, Tensor]

    def __init__(self, head_dim: int, dtype: torch.dtype):
        self.head_dim = head_dim
        self.dtype = dtype
        self.static = {}

    def encode(self, x: Tensor) -> tuple[Rows, Flat]:
        """x: [B, H, T, D] -> (stored rows, variable-length entries)."""
        return {"data": x.to(self.dtype)}, NO_FLAT

    def decode(self, rows: Rows, flat: Flat) -> Tensor:
        """stored rows (each [B, H, C, ...]) and their entries -> [B, H, C, D] float32."""
        return decode_packed(self.packed(rows, flat))

    def packed(self, rows: Rows, flat: Flat) -> PackedRows:
        """The stored rows described for the shared decoders (reference and kernels)."""
        return PackedRows("full", self.head_dim, rows["data"])

    def row_spec(self, x: Tensor) -> dict[str, tuple[tuple[int, ...], torch.dtype]] | None:
        """Per-row shapes and dtypes of the stored tensors when this codec has a Triton
        append kernel (`append_into`), else None (rows come from `encode`)."""
        return None

    def append_into(self, x: Tensor, buffers: dict[str, Tensor], start: int) -> Flat:
        """Quantize x [B, H, T, D] with the Triton append kernel straight into rows
        [start, start + T) of `buffers` ([B, H, capacity, ...], named as `encode`'s rows);
        returns the variable-length entries. Bit-identical to `encode`."""
        raise NotImplementedError(f"{type(self).__name__} has no append kernel")

    def encodes_like(self, other: Codec) -> bool:
        """Whether `other` encodes rows exactly as this codec does, each (batch, head, token)
        row on its own: then keys and values can be encoded in one call (rows stacked
        along the batch), half the small ops of a decode step's append."""
        return False

    @staticmethod
    def categories() -> dict[str, str]:
        """Stored tensor (row or flat entry) name -> ledger category."""
        return {"data": "full_precision"}


STATIC_SCALE_SHAPES = {"tensor": "[1]", "head": "[H_kv]", "channel": "[H_kv, D]"}


def static_scale(scale: Tensor, axis: str, top: float, where: str) -> None:
    """Refuse a static scale the codec would misuse: wrong rank for `axis` ("tensor" [1],
    "head" [H], "channel" [H, D]), non-finite, not positive, or so large that scale x `top`
    (the largest code's magnitude) overflows float32 and decodes to Inf."""
    rank = {"tensor": 1, "head": 1, "channel": 2}.get(axis)
    if rank is None or scale.dim() != rank or (axis == "tensor" and scale.numel() != 1):
        raise KvqError(
            f"{where}.scale: a per-{axis} scale must be {STATIC_SCALE_SHAPES.get(axis, '?')}, "
            f"got {list(scale.shape)}"
        )
    x = scale.float()
    check_finite(x, f"{where}.scale")
    if not bool((x > 0).all()):
        raise KvqError(f"{where}.scale: scales must be positive")
    if not bool(torch.isfinite(x * top).all()):
        raise KvqError(f"{where}.scale: scale x {top:g} overflows float32")


def require(state: dict[str, Tensor], names, where: str) -> None:
    """Refuse an artifact whose static state lacks one of `names` (under `where`)."""
    for name in names:
        if name not in state:
            raise KvqError(f"{where}: the artifact has no {where}.{name}")


def key_or_value(key_codec, value_codec, scheme: QuantScheme, head_dim, state, where, what):
    """The codebook formats' pair: static per-channel keys, per-token values."""
    if scheme.axis == "channel" and scheme.lifetime == "static":
        return key_codec(scheme, head_dim, state, where)
    if scheme.axis == "token":
        return value_codec(scheme, head_dim, state, where)
    raise KvqError(f"{where}: no {what} codec for {scheme.describe()}")


def make(
    scheme: QuantScheme, head_dim: int, dtype: torch.dtype, state: dict[str, Tensor], where: str
) -> Codec:
    """The "none" format: rows kept in the activation dtype."""
    return Codec(head_dim, dtype)
