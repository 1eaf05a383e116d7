"""FP8 (E4M3 / E5M2) codecs: codes stored as the fp8 bit patterns, decoded by lookup.

A stored byte IS the fp8 value (`fp8.fp8_encode(...).view(uint8)`), so every decoder
reads it as a "lookup" row through the table of the format's 256 values: the pure-torch
reference and the Triton kernel need no fp8 arithmetic of their own.

* `Fp8StaticCodec`: one calibrated scale per tensor ([1]) or per KV head ([H_kv]), the
  layout serving engines store (vLLM `k_scale` / `v_scale`); fixed for the cache's life.
* `Fp8TokenCodec`: a scale per (token, head) computed at append from the row's absmax
  (stored float32: a small row's fp16 scale would underflow).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from kvq.errors import KvqError
from kvq.quant import fp8
from kvq.quant.qparams import check_finite, storage_dtype
from kvq.quant.schemes import QuantScheme
from kvq.runtime.codecs.base import NO_FLAT, Codec, Flat, Rows, static_scale
from kvq.runtime.packed import PackedRows


def fp8_table(fmt: str, device: torch.device | str = "cpu") -> Tensor:
    """[256] float32: the value of every fp8 bit pattern. NaN and Inf patterns (never
    produced: encoding saturates) read as 0 so that no table entry is non-finite. One
    tensor per format and device, so a kernel can tell the format by the table it gets
    (`fp8_format_of`) without reading it."""
    return _table(fmt, torch.device(device))


@functools.cache
def _table(fmt: str, device: torch.device) -> Tensor:
    values = torch.arange(256, dtype=torch.uint8).view(fp8.FP8_DTYPES[fmt]).float()
    return torch.nan_to_num(values, nan=0.0, posinf=0.0, neginf=0.0).to(device)


def fp8_format_of(table: Tensor) -> str | None:
    """ "e4m3" / "e5m2" when `table` is that format's `fp8_table` (the one the codecs hand
    out), else None. An identity check: no device read on the decode path."""
    for fmt in fp8.FP8_DTYPES:
        if table is fp8_table(fmt, table.device):
            return fmt
    return None


class Fp8StaticCodec(Codec):
    """fp8 codes of x / scale with a calibrated scale per tensor or per KV head."""

    def __init__(self, scheme: QuantScheme, head_dim: int, scale: Tensor, where: str):
        super().__init__(head_dim, torch.float32)
        self.fmt = scheme.fp8_format
        # refuses a wrong shape, non-finite or non-positive scales, and scales so large
        # that scale x fp8 max overflows float32
        static_scale(scale, scheme.axis, fp8.fp8_max(self.fmt), where)
        self.static = {"scale": scale}
        self._per_head: dict = {}

    def _heads(self, h: int, device: torch.device) -> Tensor:
        """The stored scale as [H] (a per-tensor scale repeated), what the kernels index;
        built once per device (the kernels fold it per scale tensor)."""
        key = (h, torch.device(device))
        if key not in self._per_head:
            scale = self.static["scale"].float().expand(h).contiguous()
            self._per_head[key] = scale.to(device)
        return self._per_head[key]

    def encode(self, x: Tensor) -> tuple[Rows, Flat]:
        check_finite(x, "key/value rows")
        scale = self._heads(x.shape[1], x.device)[None, :, None, None]  # [1, H, 1, 1]
        return {"codes": fp8.fp8_encode(x, scale, self.fmt).view(torch.uint8)}, NO_FLAT

    def packed(self, rows: Rows, flat: Flat) -> PackedRows:
        codes = rows["codes"]  # [B, H, T, D] uint8
        scale = self._heads(codes.shape[1], codes.device)
        table = fp8_table(self.fmt, codes.device)
        return PackedRows("lookup", self.head_dim, codes, 8, scale=scale, table=table)

    def row_spec(self, x: Tensor):
        return {"codes": ((x.shape[-1],), torch.uint8)}

    def append_into(self, x: Tensor, buffers: dict[str, Tensor], start: int) -> Flat:
        from kvq.runtime.kernels.append.codes import append_fp8

        scale = self._heads(x.shape[1], x.device)
        append_fp8(x, buffers["codes"], start, scale, self.fmt, backend="triton")
        return NO_FLAT

    @staticmethod
    def categories() -> dict[str, str]:
        return {"codes": "codes"}


class Fp8TokenCodec(Codec):
    """fp8 codes with a dynamic scale per (token, head): absmax / fp8 max at append."""

    def __init__(self, scheme: QuantScheme, head_dim: int):
        super().__init__(head_dim, torch.float32)
        if scheme.group_size not in (None, head_dim):
            raise KvqError("per-token fp8 takes one scale per head row (no channel groups)")
        self.fmt = scheme.fp8_format
        self.scale_dtype = storage_dtype(scheme.scale_dtype)

    def encode(self, x: Tensor) -> tuple[Rows, Flat]:
        check_finite(x, "key/value rows")
        amax = x.float().abs().amax(dim=-1, keepdim=True)  # [B, H, T, 1]
        scale = fp8.fp8_scale(amax, self.fmt, self.scale_dtype)
        codes = fp8.fp8_encode(x, scale, self.fmt).view(torch.uint8)
        return {"codes": codes, "scale": scale}, NO_FLAT

    def packed(self, rows: Rows, flat: Flat) -> PackedRows:
        codes = rows["codes"]
        return PackedRows(
            "lookup",
            self.head_dim,
            codes,
            8,
            scale=rows["scale"],
            table=fp8_table(self.fmt, codes.device),
        )

    @staticmethod
    def categories() -> dict[str, str]:
        return {"codes": "codes", "scale": "qparams"}


def make(
    scheme: QuantScheme, head_dim: int, dtype: torch.dtype, state: dict[str, Tensor], where: str
) -> Codec:
    if scheme.lifetime == "static" and scheme.axis in ("tensor", "head"):
        if "scale" not in state:
            raise KvqError(f"{where}: static fp8 scheme but the artifact has no {where}.scale")
        return Fp8StaticCodec(scheme, head_dim, state["scale"], where)
    if scheme.lifetime == "dynamic" and scheme.axis == "token":
        return Fp8TokenCodec(scheme, head_dim)
    raise KvqError(f"{where}: no fp8 codec for {scheme.describe()} (static per tensor or head, "
                   "or dynamic per token)")  # fmt: skip
