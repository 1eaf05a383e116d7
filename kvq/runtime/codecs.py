"""Row codecs: how one cached tensor family turns rows into stored tensors and back.

A codec is built from a `QuantScheme` plus, for static schemes, the calibrated
state read from the artifact. `encode` takes new rows `[B, H, T, D]` and returns
a dict of tensors whose third dimension is T (the row axis), ready to be written
into a `RowStore`; `decode` inverts it for any slice of rows. Static qparams
live in the codec itself (one copy per layer, counted once in the ledger).

The quantizers are the shared ones in `kvq.quant`: calibration measures error
with the same functions the runtime encodes with.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvq.errors import KvqError
from kvq.quant import affine, packing
from kvq.quant.qparams import check_finite, storage_dtype
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


class IntTokenCodec(Codec):
    """Uniform integer codes with qparams per (token, head[, channel group]), computed at append."""

    def __init__(self, scheme: QuantScheme, head_dim: int):
        super().__init__(head_dim, torch.float32)
        self.bits = scheme.bits
        self.symmetric = scheme.symmetric
        self.group = scheme.group_size or head_dim
        if head_dim % self.group:
            raise KvqError(f"group size {self.group} does not divide head_dim {head_dim}")
        self.scale_dtype = storage_dtype(scheme.scale_dtype)

    def encodes_like(self, other: Codec) -> bool:
        # qparams per (token, head, group): no row depends on another
        mine = (self.head_dim, self.bits, self.symmetric, self.group, self.scale_dtype)
        return type(other) is IntTokenCodec and mine == (
            other.head_dim, other.bits, other.symmetric, other.group, other.scale_dtype
        )  # fmt: skip

    def encode(self, x: Tensor) -> tuple[Rows, Flat]:
        g = affine.to_groups(x.float(), self.group)  # [B, H, T, D/G, G]
        if self.symmetric:
            codes, scale = affine.quantize_symmetric(
                g, self.bits, -1, self.scale_dtype, raise_tiny=False
            )
            # signed -> unsigned so that every width packs the same way
            ucodes = (codes.to(torch.int16) + (1 << (self.bits - 1))).to(torch.uint8)
            packed = packing.pack_bits(affine.from_groups(ucodes), self.bits)
            return {"codes": packed, "scale": scale.squeeze(-1)}, NO_FLAT
        codes, scale, offset = affine.quantize_affine(
            g, self.bits, -1, self.scale_dtype, raise_tiny=False
        )
        packed = packing.pack_bits(affine.from_groups(codes), self.bits)
        rows = {"codes": packed, "scale": scale.squeeze(-1), "offset": offset.squeeze(-1)}
        return rows, NO_FLAT

    def packed(self, rows: Rows, flat: Flat) -> PackedRows:
        if self.symmetric:
            zero = float(1 << (self.bits - 1))  # codes were offset to unsigned at encode
            return PackedRows(
                "affine", self.head_dim, rows["codes"], self.bits, zero, rows["scale"]
            )
        return PackedRows(
            "affine",
            self.head_dim,
            rows["codes"],
            self.bits,
            scale=rows["scale"],
            offset=rows["offset"],
        )

    def row_spec(self, x: Tensor):
        d = x.shape[-1]
        qparams = ((d // self.group,), self.scale_dtype)
        spec = {"codes": ((packing.packed_len(d, self.bits),), torch.uint8), "scale": qparams}
        return spec if self.symmetric else spec | {"offset": qparams}

    def append_into(self, x: Tensor, buffers: dict[str, Tensor], start: int) -> Flat:
        from kvq.runtime.kernels.append import append_int_token

        append_int_token(
            x, buffers["codes"], buffers["scale"], buffers.get("offset"), start, self.bits,
            self.group, self.symmetric, backend="triton",
        )  # fmt: skip
        return NO_FLAT

    @staticmethod
    def categories() -> dict[str, str]:
        return {"codes": "codes", "scale": "qparams", "offset": "qparams"}


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


class QServeTokenCodec(Codec):
    """QServe's KV4: INT4 codes with an fp16 (scale, floating zero-point) pair per (token,
    head), x ~ (code - zero_point) * scale (`affine.quantize_qserve`). The zero-point is
    in code units and neither rounded nor clamped, so a positive-only head keeps its range.
    Stored qparams are [B, H, T] (one per row), as the append kernel writes them.
    """

    def __init__(self, head_dim: int):
        super().__init__(head_dim, torch.float32)

    def encode(self, x: Tensor) -> tuple[Rows, Flat]:
        codes, scale, zero_point = affine.quantize_qserve(x, -1)  # qparams [B, H, T, 1]
        rows = {
            "codes": packing.pack_bits(codes, affine.QSERVE_BITS),
            "scale": scale.squeeze(-1),
            "zero_point": zero_point.squeeze(-1),
        }
        return rows, NO_FLAT

    def packed(self, rows: Rows, flat: Flat) -> PackedRows:
        # [B, H, T] -> [B, H, T, 1]: one group per row, the shared per-row layout
        return PackedRows(
            "affine",
            self.head_dim,
            rows["codes"],
            affine.QSERVE_BITS,
            scale=rows["scale"][..., None],
            zero_point=rows["zero_point"][..., None],
        )

    def row_spec(self, x: Tensor):
        qparam = ((), affine.QSERVE_DTYPE)
        codes = ((packing.packed_len(x.shape[-1], affine.QSERVE_BITS),), torch.uint8)
        return {"codes": codes, "scale": qparam, "zero_point": qparam}

    def append_into(self, x: Tensor, buffers: dict[str, Tensor], start: int) -> Flat:
        from kvq.runtime.kernels.append import append_int_qserve

        append_int_qserve(
            x, buffers["codes"], buffers["scale"], buffers["zero_point"], start, backend="triton"
        )
        return NO_FLAT

    @staticmethod
    def categories() -> dict[str, str]:
        return {"codes": "codes", "scale": "qparams", "zero_point": "qparams"}


class IntChannelStaticCodec(Codec):
    """Uniform integer codes with calibrated, fixed qparams per (head, channel), or
    symmetric ones per KV head or per tensor (the layouts serving engines store).

    Static state means appending a row never reinterprets history (article 0x05A,
    design 2): scale and offset are read from the artifact once.
    """

    def __init__(
        self,
        scheme: QuantScheme,
        head_dim: int,
        scale: Tensor,
        offset: Tensor | None,
        where: str = "codec",
    ):
        super().__init__(head_dim, torch.float32)
        self.bits = scheme.bits
        self.symmetric = scheme.symmetric
        self.axis = scheme.axis
        if scheme.axis == "channel" and (scale.ndim != 2 or scale.shape[-1] != head_dim):
            raise KvqError(
                f"per-channel scale must be [H_kv, {head_dim}], got {tuple(scale.shape)}"
            )
        if scheme.axis != "channel" and not self.symmetric:
            raise KvqError(f"{where}: static per-{scheme.axis} INT must be symmetric")
        static_scale(scale, scheme.axis, float(1 << self.bits), where)
        if not self.symmetric and (offset is None or offset.shape != scale.shape):
            raise KvqError("asymmetric per-channel scheme needs an offset shaped like its scale")
        self.static = {"scale": scale} if self.symmetric else {"scale": scale, "offset": offset}
        self._offset = None if offset is None else offset[None, :, None, :]
        self._per_head: dict[int, Tensor] = {}  # see `_packed_scale`

    def _channel_scale(self, h: int) -> Tensor:
        """[H, D]: the stored scale broadcast to every channel (the encoders' layout)."""
        s = self.static["scale"]
        if self.axis == "channel":
            return s
        return s.float().view(-1, 1).expand(h, self.head_dim).contiguous()

    def _packed_scale(self, h: int) -> Tensor:
        """The stored scale as the decoders index it: [H, D] or [H] (a tensor's repeated,
        built once per head count: the kernels' folds are cached per scale tensor, and a
        replayable decode step passes the same tensors step after step)."""
        s = self.static["scale"]
        if self.axis != "tensor":
            return s
        if h not in self._per_head:
            self._per_head[h] = s.float().expand(h).contiguous()
        return self._per_head[h]

    def encode(self, x: Tensor) -> tuple[Rows, Flat]:
        check_finite(x, "key/value rows")
        x = x.float()
        scale = self._channel_scale(x.shape[1]).to(x.device)[None, :, None, :]  # [1, H, 1, D]
        if self.symmetric:
            codes = affine.symmetric_encode(x, scale, self.bits)
            ucodes = (codes.to(torch.int16) + (1 << (self.bits - 1))).to(torch.uint8)
        else:
            ucodes = affine.affine_encode(x, scale, self._offset, self.bits)
        return {"codes": packing.pack_bits(ucodes, self.bits)}, NO_FLAT

    def packed(self, rows: Rows, flat: Flat) -> PackedRows:
        codes = rows["codes"]
        scale, offset = self._packed_scale(codes.shape[1]), self.static.get("offset")
        zero = float(1 << (self.bits - 1)) if self.symmetric else 0.0
        return PackedRows("affine", self.head_dim, codes, self.bits, zero, scale, offset)

    def row_spec(self, x: Tensor):
        return {"codes": ((packing.packed_len(x.shape[-1], self.bits),), torch.uint8)}

    def append_into(self, x: Tensor, buffers: dict[str, Tensor], start: int) -> Flat:
        from kvq.runtime.kernels.append import append_int_channel

        offset = self.static.get("offset")
        scale = self._channel_scale(x.shape[1]).to(x.device)
        append_int_channel(
            x, buffers["codes"], start, scale, offset, self.bits, self.symmetric,
            backend="triton",
        )  # fmt: skip
        return NO_FLAT

    @staticmethod
    def categories() -> dict[str, str]:
        return {"codes": "codes"}


def make_codec(
    scheme: QuantScheme,
    head_dim: int,
    activation_dtype: torch.dtype,
    state: dict[str, Tensor],
    where: str,
) -> Codec:
    """Build the codec for `scheme`; `state` holds its static tensors (may be empty).

    `where` names the policy entry (e.g. "layers.3.key") for error messages.
    """
    if scheme.format == "none":
        return Codec(head_dim, activation_dtype)
    if scheme.zero_point:  # the scheme admits only QServe's KV4 layout with it
        return QServeTokenCodec(head_dim)
    if scheme.format == "int" and scheme.axis == "token":
        return IntTokenCodec(scheme, head_dim)
    if scheme.format == "int" and scheme.axis == "channel" and scheme.lifetime == "dynamic":
        from kvq.runtime.kivi import KiviKeyCodec

        return KiviKeyCodec(scheme, head_dim)
    if scheme.format == "int" and scheme.lifetime == "static":
        if "scale" not in state:
            raise KvqError(
                f"{where}: static per-{scheme.axis} scheme but the artifact has no {where}.scale"
            )
        return IntChannelStaticCodec(scheme, head_dim, state["scale"], state.get("offset"), where)
    if scheme.format == "fp8":
        from kvq.runtime.fp8_codecs import make_fp8_codec

        return make_fp8_codec(scheme, head_dim, state, where)
    if scheme.format == "nuq":
        from kvq.runtime.nuq_codecs import make_nuq_codec

        return make_nuq_codec(scheme, head_dim, state, where)
    if scheme.format == "vq":
        from kvq.runtime.vq_codecs import make_vq_codec

        return make_vq_codec(scheme, head_dim, state, where)
    if scheme.format == "trellis":
        from kvq.runtime.trellis_codecs import make_trellis_codec

        return make_trellis_codec(scheme, head_dim, state, where)
    raise KvqError(f"{where}: no runtime codec for {scheme.describe()}")
