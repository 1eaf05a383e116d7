"""KVQuant codecs: codebook indices, normalisation qparams and exact sparse exceptions.

Keys (static, per channel): each (head, channel) has a calibrated normaliser
(scale, center) and outlier thresholds. A row's values beyond its channel's
thresholds are stored exactly as variable-length flat entries (channel index +
value) with a per-row count; their dense codes are holes that decode replaces.

Values (dynamic, per token): each appended row gets its own normaliser from
its inliers, and k = round(fraction * D) extreme values (3 of 256 at 1%), each
taken from whichever end of the row shrinks the remaining range more
(`sparse.row_outliers(..., "range")`), are stored exactly in k fixed slots.

Codes are indices into the layer's codebook (2^bits levels in [-1, 1]), packed
with the shared bit packing. Sparse values are stored in fp16, the precision of
an unquantized fp16 cache.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvq.errors import KvqError
from kvq.quant import nuq, packing, sparse
from kvq.quant.qparams import check_finite, storage_dtype
from kvq.quant.schemes import QuantScheme
from kvq.runtime.codecs.base import NO_FLAT, Codec, Flat, Rows, key_or_value, require
from kvq.runtime.packed import PackedRows

SPARSE_DTYPE = torch.float16
# V rows keep round(fraction * D) exceptions, taken from whichever end shrinks the
# row's range more (`sparse.row_outliers`); the calibrator fits with the same split.
VALUE_SPLIT = "range"


def _index_dtype(head_dim: int) -> torch.dtype:
    return torch.uint8 if head_dim <= 256 else torch.int16


class _NuqCodec(Codec):
    def __init__(self, scheme: QuantScheme, head_dim: int, codebook: Tensor, levels: Tensor | None):
        super().__init__(head_dim, torch.float32)
        if codebook.numel() != 2**scheme.bits:
            raise KvqError(
                f"codebook has {codebook.numel()} levels but the scheme declares {scheme.bits} bits"
            )
        self.bits = scheme.bits
        self.codebook = codebook.float()
        # Q-Norm: decode through mean/std-corrected levels, encode with the fitted ones
        self.levels = self.codebook if levels is None else levels.float()
        self.static = {"codebook": codebook} | ({} if levels is None else {"qnorm_levels": levels})
        self.fraction = scheme.outlier_fraction
        self.index_dtype = _index_dtype(head_dim)

    def _codes(self, x_norm: Tensor, holes: Tensor | None = None) -> Tensor:
        """holes: [B, H, T, D] True at exact exceptions (any code will do there; a scalar
        code ignores it, a trellis search leaves those coordinates free)."""
        return packing.pack_bits(nuq.nuq_encode(x_norm, self.codebook), self.bits)


class NuqKeyCodec(_NuqCodec):
    """Static per-channel normaliser and thresholds; variable-length exact exceptions."""

    def __init__(self, scheme: QuantScheme, head_dim: int, state: dict[str, Tensor], where: str):
        bounds = ("lower", "upper") if scheme.outlier_fraction else ()
        require(state, ("codebook", "scale", "center", *bounds), where)
        super().__init__(scheme, head_dim, state["codebook"], state.get("qnorm_levels"))
        self.static |= {n: state[n] for n in ("scale", "center", "lower", "upper") if n in state}
        self._scale = state["scale"][None, :, None, :]  # [1, H, 1, D]
        self._center = state["center"][None, :, None, :]
        self._lower = state["lower"][None, :, None, :] if self.fraction else None
        self._upper = state["upper"][None, :, None, :] if self.fraction else None
        self.fixed_width = not self.fraction  # exceptions: variable-length flat entries

    def encode(self, x: Tensor) -> tuple[Rows, Flat]:
        check_finite(x, "key rows")
        x = x.float()  # [B, H, T, D]
        rows: Rows = {}
        flat: Flat = NO_FLAT
        mask = None
        if self.fraction:
            mask = sparse.threshold_outliers(x, self._lower.float(), self._upper.float())
            count = mask.sum(-1)  # [B, H, T]
            if count.numel() and int(count.max()) > 255:
                raise KvqError(
                    "more than 255 key outliers in one row; raise the calibration fraction"
                )
            rows["sparse_count"] = count.to(torch.uint8)
            # entries in (row, batch, head, channel) order: one contiguous slice per row range
            m = mask.permute(2, 0, 1, 3)
            channel = m.nonzero()[:, 3]
            flat = {
                "sparse_index": channel.to(self.index_dtype),
                "sparse_value": x.permute(2, 0, 1, 3)[m].to(SPARSE_DTYPE),
            }
            # holes: clip so the dense code is simply the nearest end level
            x = torch.minimum(torch.maximum(x, self._lower.float()), self._upper.float())
        rows["codes"] = self._codes(nuq.normalize(x, self._scale, self._center), mask)
        return rows, flat

    def row_spec(self, x: Tensor):
        spec = {"codes": ((packing.packed_len(x.shape[-1], self.bits),), torch.uint8)}
        return spec | ({"sparse_count": ((), torch.uint8)} if self.fraction else {})

    def append_into(self, x: Tensor, buffers: dict[str, Tensor], start: int) -> Flat:
        from kvq.runtime.kernels.append.codes import append_nuq_key

        st = self.static
        index, value = append_nuq_key(
            x, buffers["codes"], buffers.get("sparse_count"), start, self.codebook, self.bits,
            st["scale"], st["center"], st.get("lower"), st.get("upper"), backend="triton",
        )  # fmt: skip
        if not self.fraction:
            return NO_FLAT
        return {"sparse_index": index, "sparse_value": value}

    def packed(self, rows: Rows, flat: Flat) -> PackedRows:
        sparse_rows = {}
        if self.fraction:
            sparse_rows = dict(
                sparse_count=rows["sparse_count"],
                sparse_index=flat.get("sparse_index", rows["sparse_count"].new_zeros(0)),
                sparse_value=flat.get("sparse_value", self.levels.new_zeros(0)),
            )
        return PackedRows(
            "lookup",
            self.head_dim,
            rows["codes"],
            self.bits,
            scale=self.static["scale"],
            offset=self.static["center"],
            table=self.levels,
            **sparse_rows,
        )

    @staticmethod
    def categories() -> dict[str, str]:
        return {
            "codes": "codes",
            "sparse_count": "sparse",
            "sparse_index": "sparse",
            "sparse_value": "sparse",
        }


class NuqValueCodec(_NuqCodec):
    """Per-token normaliser from the row's inliers; a fixed number of exact exceptions per row."""

    def __init__(self, scheme: QuantScheme, head_dim: int, state: dict[str, Tensor], where: str):
        if "codebook" not in state:
            raise KvqError(f"{where}: the artifact has no {where}.codebook")
        super().__init__(scheme, head_dim, state["codebook"], state.get("qnorm_levels"))
        self.scale_dtype = storage_dtype(scheme.scale_dtype)

    def encode(self, x: Tensor) -> tuple[Rows, Flat]:
        check_finite(x, "value rows")
        x = x.float()
        rows: Rows = {}
        holes = None
        if self.fraction:
            idx, vals, lo, hi = sparse.row_outliers(x, self.fraction, VALUE_SPLIT)
            rows["sparse_index"] = idx.to(self.index_dtype)
            rows["sparse_value"] = vals.to(SPARSE_DTYPE)
            holes = torch.zeros(*x.shape[:-1], x.shape[-1] + 1, dtype=torch.bool, device=x.device)
            holes = holes.scatter_(-1, idx.long(), True)[..., :-1]  # slot index D: unused
        else:
            lo, hi = x.amin(-1), x.amax(-1)
        scale, center = nuq.live_normalizer(lo, hi, self.scale_dtype)  # [B, H, T]
        rows["codes"] = self._codes(nuq.normalize(x, scale[..., None], center[..., None]), holes)
        rows["scale"], rows["center"] = scale, center
        return rows, NO_FLAT

    def row_spec(self, x: Tensor):
        d = x.shape[-1]
        spec = {
            "codes": ((packing.packed_len(d, self.bits),), torch.uint8),
            "scale": ((), self.scale_dtype),
            "center": ((), self.scale_dtype),
        }
        if self.fraction:
            slots = sparse.range_count(d, self.fraction)
            if VALUE_SPLIT == "tails":
                slots = sum(sparse.tail_counts(d, self.fraction))
            spec |= {
                "sparse_index": ((slots,), self.index_dtype),
                "sparse_value": ((slots,), SPARSE_DTYPE),
            }
        return spec

    def append_into(self, x: Tensor, buffers: dict[str, Tensor], start: int) -> Flat:
        from kvq.runtime.kernels.append.codes import append_nuq_value

        append_nuq_value(
            x, buffers["codes"], buffers["scale"], buffers["center"],
            buffers.get("sparse_index"), buffers.get("sparse_value"), start, self.codebook,
            self.bits, self.fraction, VALUE_SPLIT, backend="triton",
        )  # fmt: skip
        return NO_FLAT

    def packed(self, rows: Rows, flat: Flat) -> PackedRows:
        slots = {}
        if self.fraction:
            slots = dict(slot_index=rows["sparse_index"], slot_value=rows["sparse_value"])
        return PackedRows(
            "lookup",
            self.head_dim,
            rows["codes"],
            self.bits,
            scale=rows["scale"][..., None],
            offset=rows["center"][..., None],
            table=self.levels,
            **slots,
        )

    @staticmethod
    def categories() -> dict[str, str]:
        return {
            "codes": "codes",
            "scale": "qparams",
            "center": "qparams",
            "sparse_index": "sparse",
            "sparse_value": "sparse",
        }


def make(
    scheme: QuantScheme, head_dim: int, dtype: torch.dtype, state: dict[str, Tensor], where: str
) -> Codec:
    return key_or_value(NuqKeyCodec, NuqValueCodec, scheme, head_dim, state, where, "NUQ")
