"""Integer codes: symmetric per-token (int8/int4/int2), QServe's KV4 zero-point layout and
static per-tensor/head/channel scales from an artifact. KIVI's per-channel dynamic keys
are `kvq.runtime.codecs.kivi`."""

from __future__ import annotations

import torch
from torch import Tensor

from kvq.errors import KvqError
from kvq.quant import affine, packing
from kvq.quant.qparams import check_finite, storage_dtype
from kvq.quant.schemes import QuantScheme
from kvq.runtime.codecs.base import NO_FLAT, Codec, Flat, Rows, static_scale
from kvq.runtime.packed import PackedRows


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
        return type(other) is type(self) and mine == (
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
        from kvq.runtime.kernels.append.codes import append_int_token

        append_int_token(
            x, buffers["codes"], buffers["scale"], buffers.get("offset"), start, self.bits,
            self.group, self.symmetric, backend="triton",
        )  # fmt: skip
        return NO_FLAT

    @staticmethod
    def categories() -> dict[str, str]:
        return {"codes": "codes", "scale": "qparams", "offset": "qparams"}


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
        from kvq.runtime.kernels.append.codes import append_int_qserve

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
        from kvq.runtime.kernels.append.codes import append_int_channel

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


def make(
    scheme: QuantScheme, head_dim: int, dtype: torch.dtype, state: dict[str, Tensor], where: str
) -> Codec:
    if scheme.zero_point:  # the scheme admits only QServe's KV4 layout with it
        return QServeTokenCodec(head_dim)
    if scheme.axis == "token":
        return IntTokenCodec(scheme, head_dim)
    if scheme.axis == "channel" and scheme.lifetime == "dynamic":
        from kvq.runtime.codecs.kivi import KiviKeyCodec

        return KiviKeyCodec(scheme, head_dim)
    if scheme.lifetime == "static":
        if "scale" not in state:
            raise KvqError(
                f"{where}: static per-{scheme.axis} scheme but the artifact has no {where}.scale"
            )
        return IntChannelStaticCodec(scheme, head_dim, state["scale"], state.get("offset"), where)
    raise KvqError(f"{where}: no runtime codec for {scheme.describe()}")
