"""Which layouts the planned decode kernels take (`planned_unsupported`: None, or the
reason a call goes to the general kernel), and the small tables those kernels read:
NUQ levels (`nuq_table`), vector codebooks (`vq_table`), trellis digits
(`trellis_table`), the keys' flat-entry starts. `planned.py` launches them."""

from __future__ import annotations

import torch
from torch import Tensor

from kvq.quant import trellis, vq
from kvq.quant.fp8 import fp16_placement
from kvq.runtime.codecs.fp8 import fp8_format_of
from kvq.runtime.kernels.backend import next_pow2
from kvq.runtime.packed import entry_pointers
from kvq.tensor_memo import Memo, memoised

MAX_SEGMENTS = 3
FULL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def planned_unsupported(query: Tensor, segments, mask: Tensor | None) -> str | None:
    """Why the planned path cannot take this call (None when it can)."""
    b, hq, q_len, d = query.shape
    if mask is not None:
        reason = _mask_unsupported(mask, query, sum(s.rows for s in segments))
        if reason:
            return reason
    if query.stride(-1) != 1:
        return "query channels must be contiguous"
    if d & (d - 1) or not 32 <= d <= 256:
        return f"head_dim {d} is not a power of two in 32 ... 256"
    if len(segments) > MAX_SEGMENTS:
        return f"more than {MAX_SEGMENTS} segments"
    hkv = segments[0].key.data.shape[1]
    if hq % hkv or next_pow2(hq // hkv * q_len) > 64:
        return "query rows per KV head"
    packed = [s for s in segments if s.key.kind != "full" or s.value.kind != "full"]
    if len(packed) > 1:
        return "more than one packed segment"
    for seg in segments:
        if seg.key.pre_rope and (seg.positions is None or seg.positions.dim() != 2):
            return "pre-RoPE keys need positions [B, T]"
        for p in (seg.key, seg.value):
            if p.data.shape[1] != hkv or p.data.stride(-1) != 1:
                return "rows must be contiguous along the channels"
            if p.kind == "full" and p.data.dtype not in FULL_DTYPES:
                return f"full-precision rows of {p.data.dtype}"
    if packed:
        reason = _packed_unsupported(packed[0], d)
        if reason:
            return reason
    planes = key_planes(packed[0].key) if packed else 1
    if any(s.key.pre_rope for s in segments) and d // planes // 2 < 16:
        return "pre-RoPE keys: fewer than 16 channels per plane and half (a dot's K)"
    return None


def _mask_unsupported(mask: Tensor, query: Tensor, total: int) -> str | None:
    """The kernel reads a [B | 1, 1, Q, total] bool mask in place (no copy per call):
    the mask of every head, rows contiguous."""
    b, _, q_len, _ = query.shape
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[0] not in (1, b):
        return "per-head masks use the general kernel"
    if mask.shape[2] != q_len or mask.shape[3] != total:
        return "mask shape"
    if mask.dtype != torch.bool or mask.stride(-1) != 1:
        return "masks other than bool with contiguous columns"
    return None


def _packed_unsupported(seg, d: int) -> str | None:
    k, v = seg.key, seg.value
    for p in (k, v):
        fp8 = p.kind == "lookup" and p.bits == 8 and fp8_format_of(p.table) is not None
        vector, tcq = p.kind == "vector", p.kind == "trellis"
        if (not fp8 and not is_nuq(p) and not vector and not tcq
                and (p.kind != "affine" or p.bits not in (4, 8))):  # fmt: skip
            return ("codes other than 4- or 8-bit affine, fp8, 4-bit NUQ, vector codebooks or "
                    "trellis codes")  # fmt: skip
        reason = _vq_unsupported(p, p is k, d) if vector else None
        reason = _trellis_unsupported(p, p is k, d) if tcq else reason
        if reason:
            return reason
    if (k.kind == "trellis") != (v.kind == "trellis"):
        return "trellis codes on one side only"
    # NUQ exceptions: the keys' flat entries, the values' slots (`_key_exceptions`,
    # `_value_slots`)
    if k.slot_index is not None or (
        k.sparse_count is not None and not is_nuq(k) and not is_coded(k)
    ):
        return "key exceptions other than NUQ's flat entries"
    if v.sparse_count is not None or (
        v.slot_index is not None and not is_nuq(v) and not is_coded(v)
    ):
        return "value exceptions other than NUQ's slots"
    if v.slot_index is not None and v.slot_value.stride() != v.slot_index.stride():
        return "value slots: values must share the channels' layout"
    if is_nuq(k) and k.qaxis not in ("channel", "head"):
        return "NUQ keys with per-row normalisers"
    if k.qaxis not in ("channel", "head"):
        reason = _row_groups_unsupported(k, d)
        if reason:
            return f"keys: {reason}"
    if is_coded(v):  # per-row normaliser, checked by _vq_unsupported, _trellis_unsupported
        return None
    if v.qaxis == "head":  # a static scale per head: read per row with a zero row stride
        return "values: per-head zero points" if v.zero_point is not None else None
    reason = _row_groups_unsupported(v, d)
    return f"values: {reason}" if reason else None


def is_nuq(p) -> bool:
    """Whether `p` holds 4-bit codebook codes (KVQuant's NUQ4): a table of 16 levels that
    the kernel reads as fp16 bytes (`_lut_planes`)."""
    return p.kind == "lookup" and p.bits == 4 and p.table.numel() == 16


def _vq(p) -> bool:
    """Whether `p` holds vector-codebook codes (`kvq.quant.vq`)."""
    return p.kind == "vector"


def is_coded(p) -> bool:
    """Whether the kernel reads `p` as vq codes: vector codebooks or trellis codes (2-D
    groups in channel order, `_trellis_states`)."""
    return p.kind in ("vector", "trellis")


def coded_dim(p) -> int:
    """The kernel's vq group size for `p` (K_VQ, V_VQ): the codebook's, 2 for trellis
    codes, 0 for other codes."""
    return {"vector": p.vector_dim, "trellis": 2}.get(p.kind, 0)


# trellis digits the kernel reads (`_trellis_states`): whole digits per 32-bit word, or 8
# per 3-byte unit
TRELLIS_BITS = (1, 2, 3, 4)
# the largest state the kernel reads: its table passes through registers into shared
# memory once per tile (4096 fp16 levels: 32 per thread at 4 warps, 8 KB)
TRELLIS_MAX_WINDOW = 12


def _trellis_unsupported(p, key: bool, d: int) -> str | None:
    """Trellis codes the planned kernel reads: 1- to 4-bit digits, each RoPE half of the
    keys (and the values' row) whole units (32-bit words on 4-byte boundaries, 3-byte
    units of 3-bit digits); the keys stored before RoPE with a static per-channel
    normaliser, the values with a per-row one (the calibrator's layout)."""
    if p.bits not in TRELLIS_BITS:
        return f"trellis codes of {p.bits}-bit digits (1 to 4 decode planned)"
    if p.window > TRELLIS_MAX_WINDOW:
        return f"trellis states of {p.window} bits (up to {TRELLIS_MAX_WINDOW} decode planned)"
    unit = 8 if p.bits == 3 else 32 // p.bits  # digits per unit
    if (d // 2) % unit or (p.bits != 3 and not _aligned_words(p)):
        return "trellis rows not in whole units (32-bit words, 3-byte units) per RoPE half"
    return _normalisers_unsupported(p, key, "trellis")


def _normalisers_unsupported(p, key: bool, what: str) -> str | None:
    """KVQuant's layout, as the vq and trellis calibrators store it: keys before RoPE with a
    static per-channel normaliser, values with a per-row one (None when `p` is so)."""
    if key:
        if not p.pre_rope:
            return f"{what} keys after RoPE (the calibrator stores them before)"
        if p.qaxis not in ("channel", "head") or p.zero_point is not None:
            return f"{what} keys without a static per-channel normaliser"
        return None
    if p.qaxis != "row" or p.scale.shape[-1] != 1 or p.zero_point is not None:
        return f"{what} values without a per-row normaliser"
    if p.offset is not None and p.offset.stride() != p.scale.stride():
        return "offsets must share the scales' layout"
    return None


def _aligned_words(p) -> bool:
    """Whether `p`'s rows start on 4-byte boundaries (read as 32-bit words)."""
    return p.data.data_ptr() % 4 == 0 and all(s % 4 == 0 for s in p.data.stride()[:3])


# the group index widths the kernel reads (`_vq_triton._vq_index`): a nibble, a
# 6-bit field of a 3-byte unit, a byte (16, 64, 256 centroids: every layout `kvq calibrate
# auto` writes: 1 bit x 4, 2 x 2, 2 x 4, 3 x 2, 4 x 2)
VQ_FIELDS = (4, 6, 8)


def _vq_unsupported(p, key: bool, d: int) -> str | None:
    """Vector codes the planned kernel reads: the calibrator's groups (keys over RoPE pairs
    and stored before RoPE, values over neighbouring channels: `vq.channel_groups`),
    indices of 4, 6 or 8 bits, the keys' static per-channel normaliser, the values' per-row
    one."""
    m = p.vector_dim
    if p.bits * m not in VQ_FIELDS:
        return f"vector codebooks of {2 ** (p.bits * m)} centroids (16, 64 or 256 decode planned)"
    if not _canonical_groups(p.groups, d, key):
        side = "keys over RoPE pairs" if key else "values over neighbouring channels"
        return f"vector groups other than the calibrator's ({side})"
    return _normalisers_unsupported(p, key, "vector")


def _canonical_groups(groups: Tensor, d: int, key: bool) -> bool:
    """Whether groups [D / m, m] are `vq.channel_groups(d, m, pairs=key)`, checked once per
    groups tensor (a codec's static state: no device sync per call)."""

    def build():
        want = vq.channel_groups(d, groups.shape[1], pairs=key)
        return bool(torch.equal(groups.long().cpu(), want))

    return memoised(_GROUPS_KEY if key else _GROUPS_VALUE, groups, build)


_GROUPS_KEY: Memo = {}
_GROUPS_VALUE: Memo = {}


def key_planes(p) -> int:
    """Planes of a packed key tile: 2 for 4-bit codes (even, odd channels) and 4-D vector
    groups (RoPE pairs of neighbouring channels), else 1."""
    if is_coded(p):
        return coded_dim(p) // 2
    return 2 if p.bits == 4 else 1


def value_planes(p) -> int:
    """Planes of a packed value tile: 2 for 4-bit codes and vector groups, else 1."""
    return 2 if p.bits == 4 or is_coded(p) else 1


def vq_table(table: Tensor, half: bool) -> Tensor:
    """[2^(bits m), m] centroids as the kernel reads them, contiguous, cached per table:
    float16 where they are float16 values (what calibration stores: the kernel then
    reads a 2-D centroid as one word, under the interpreter too) or the dots are fp16;
    else float32 (exact, for fp32 dots)."""
    cached = memoised(_VQ_TABLES, table, dict)
    if half not in cached:
        exact = bool(torch.equal(table.half().to(table.dtype), table))  # once per table
        dtype = torch.float16 if half or exact else torch.float32
        cached[half] = table.to(dtype).contiguous()
    return cached[half]


_VQ_TABLES: Memo = {}


def code_table(p, half: bool) -> Tensor | None:
    """The codebook the kernel reads for `p`: NUQ4's (`nuq_table`), a vector one's
    (`vq_table`), else None."""
    if is_nuq(p):
        return nuq_table(p.table)
    if p.kind == "trellis":
        return trellis_table(p.table, p.bits, p.window, half)
    return vq_table(p.table, half) if _vq(p) else None


def trellis_table(table: Tensor, bits: int, window: int, half: bool) -> Tensor:
    """[2^window] levels as the kernel indexes them (`_trellis_states`: a state's digits
    oldest lowest, where `kvq.quant.trellis` puts the newest lowest), in the dots' dtype
    (float16, or float32 where calibration's fp16 levels are not exact), cached per
    table."""
    cached = memoised(_TRELLIS_TABLES, table, dict)
    if half not in cached:
        n = trellis.check_window(bits, window)
        field = torch.arange(1 << window, device=table.device)
        digit = (1 << bits) - 1
        state = sum(((field >> (bits * j)) & digit) << (bits * (n - 1 - j)) for j in range(n))
        exact = bool(torch.equal(table.half().to(table.dtype), table))
        dtype = torch.float16 if half or exact else torch.float32
        cached[half] = table.reshape(-1)[state].to(dtype).contiguous()
    return cached[half]


_TRELLIS_TABLES: Memo = {}


def nuq_table(table: Tensor) -> Tensor:
    """float32 [16 + 32 x 8 + 256] of a 4-bit codebook, cached per table: its 16 levels (the
    kernel's gathers, exact), then the bits of the PRMT table (`_LUT_ASM`: the low bytes of
    the fp16 levels 0-3, 4-7, 8-11, 12-15, then their high bytes, one word each) once per
    lane of a warp, so that each lane reads its own copy into regular registers, then the
    byte-pair table's bits (entry b: the fp16 levels of b's low and high nibble, the value
    slots' entries, `_nuq_triton._slot_entries`)."""

    def build():
        levels = table.float().reshape(16)
        bits = levels.half().view(torch.int16).int() & 0xFFFF  # [16]
        byte = torch.stack([bits & 0xFF, bits >> 8]).view(2, 4, 4)  # [low | high, word, byte]
        words = (byte << torch.tensor([0, 8, 16, 24], device=table.device)).sum(-1)  # [2, 4]
        words = words.reshape(8).to(torch.int64).to(torch.int32)  # wraps to int32 bits
        lanes = words.repeat(32).view(torch.float32)
        b = torch.arange(256, device=table.device)
        pairs = (bits[b & 15] | (bits[b >> 4] << 16)).to(torch.int64).to(torch.int32)
        return torch.cat([levels, lanes, pairs.view(torch.float32)]).contiguous()

    return memoised(_NUQ_TABLES, table, build)


_NUQ_TABLES: Memo = {}


def flat_starts(count: Tensor) -> Tensor:
    """[B, H, T] int32 first flat entry of each (batch, head, row) (`entry_pointers`, a
    prefix sum over the counts in entry order), computed once per count tensor contents:
    the key is the count view's address, shape, strides and version counter (which every
    write into its buffer moves), and the entry holds the view, so that buffer's address
    cannot be reused while the entry lives. A decode call whose count rows are unchanged
    (the main segment between flushes of the residual window) launches nothing for them;
    one after an append recomputes them (3 small torch ops). Counts written under
    `torch.inference_mode` keep no version counter: they are recomputed at every call."""
    if count.is_inference():
        return entry_pointers(count)
    key = (count.data_ptr(), count.device, tuple(count.shape), count.stride(), count._version)
    hit = _STARTS.get(key)
    if hit is None:
        if len(_STARTS) >= _STARTS_KEPT:
            _STARTS.pop(next(iter(_STARTS)))
        hit = _STARTS[key] = (count, entry_pointers(count))
    return hit[1]


_STARTS: dict = {}
_STARTS_KEPT = 256  # a few per layer of a model


def word_rows(p) -> bool:
    """Whether the kernel reads `p`'s codes as 32-bit words (`_word_nibbles`,
    `_word_bytes`): codes with qparams read per row (per-row groups, or one scale per
    head), rows on 4-byte boundaries (11 fewer instructions per cached row of Llama-like
    KV4 at sm_90, bench/kernel_resources.py)."""
    return p.kind != "full" and p.qaxis in ("row", "head") and _aligned_words(p)


def fp8_code(p) -> tuple[int, float]:
    """(mantissa shift, factor) of fp8 lookup rows (`fp8.fp16_placement`); (0, 1.0) for
    integer codes."""
    fmt = fp8_format_of(p.table) if p.kind == "lookup" else None
    return fp16_placement(fmt) if fmt else (0, 1.0)


def row_qparams(p) -> tuple[Tensor, Tensor | None, tuple[int, int, int], int]:
    """(scale, offset, (batch, head, row) strides, groups) of qparams the kernel reads per
    row: per-row groups as stored, a per-head scale as one group with zero row stride."""
    if p.qaxis == "head":
        return p.scale, p.offset, (0, p.scale.stride(0), 0), 1
    return p.scale, p.offset, tuple(p.scale.stride()[:3]), p.scale.shape[-1]


def _row_groups_unsupported(p, d: int) -> str | None:
    """Per-row group qparams the kernel applies to a decoded tile: scale (and offset) of
    one layout, groups contiguous, 16 codes or more per group and plane."""
    if p.qaxis != "row" or p.zero_point is not None or p.scale.stride(-1) != 1:
        return "no per-row group qparams"
    if p.offset is not None and p.offset.stride() != p.scale.stride():
        return "offsets must share the scales' layout"
    groups = p.scale.shape[-1]
    if groups & (groups - 1) or d % groups or (d // groups) * p.bits // 8 < 16:
        return "groups narrower than 16 codes per plane"
    return None


def key_fold(p) -> Tensor:
    """[2, H_kv, D] float32: per channel, the static key scale and bias (offset -
    zero_point x scale), the affine map after subtracting `zero` (fp8 codes: the scale x
    the format's factor); cached per scale."""

    def build():
        hkv = p.data.shape[1]
        scale = p.scale.float() * fp8_code(p)[1]
        scale = scale[:, None] if scale.dim() == 1 else scale
        scale = scale.expand(hkv, p.head_dim)
        bias = torch.zeros_like(scale)
        if p.offset is not None:
            off = p.offset.float()
            bias = bias + (off[:, None] if off.dim() == 1 else off)
        if p.zero_point is not None:
            zp = p.zero_point.float()
            bias = bias - (zp[:, None] if zp.dim() == 1 else zp) * scale
        return torch.stack([scale, bias.expand_as(scale)]).contiguous()

    return memoised(_FOLDS, p.scale, build)


_FOLDS: Memo = {}
