"""The planned decode-attention launch: one kernel launch per layer call, at most one
reduction, no device syncs (`_decode_splits_triton`, `launch_plan`).

It takes the layouts a decode step mostly sees — full-precision segments (sink rows,
the residual window) around at most one packed segment of 4- or 8-bit affine codes,
fp8 codes (E4M3 / E5M2, decoded from their bits, `fp8.fp16_placement`) or 4-bit
codebook codes (KVQuant's NUQ4: 16 levels, `nuq_table`) or vector-codebook codes (the
layouts of `kvq calibrate vq` and `auto --bits 2 | 3`: RoPE-pair key groups stored before
RoPE, neighbouring-channel value groups, 16, 64 or 256 centroids, `vq_table`,
`_vq_unsupported`) or trellis codes (`kvq calibrate trellis`, what `auto` stores: 1- to
4-bit digits read as vq codes in channel order, `trellis_table`, `_trellis_unsupported`)
with static per-channel (or
per-head) or per-row grouped key qparams and per-row grouped or per-head value qparams,
NUQ's exact exceptions (the keys' flat entries, the values' slots), keys stored after RoPE
or before it (rotated in the tile loop at each row's position,
`_decode_splits_triton._rope_scores`, from a unit table in plane order cached per RoPE
table, `rope_planes`; NUQ keys with their exceptions too, KVQuant's stored layout), with or
without a mask over the rows
(sliding windows, padding: read in place, one byte per row and tile) — and
`decode_attention.decode_path` sends everything else to the general kernel. What the
host does per call: checks; the tensors it reads and their layout key, which finds the
site of that layout (`_Site`: every constexpr, the strides the layout fixes — passed as
None where the kernel derives them, about 20 runtime arguments for KV4 — and the compiled
kernels, built by a layer's first call of that layout), whose template the call fills
with its tensors and row counts; a cached plan (splits from the compiled kernel's
occupancy, `launch_plan.plan_splits`), two allocations (partial states and output; one
when a single split writes the output itself) and the launches of the site's compiled
kernel, without Triton's per-call binder (bench/planned_host.py: about 30 us of Python
per call, 125 before the sites). NUQ4 keys with exceptions also need
each row's first flat entry, a prefix sum of the counts (`_flat_starts`), cached per
contents of the count rows: recomputed (3 small ops) only on a call after they changed.

The launch configuration is a fixed heuristic per head_dim and code width (shape
bucket), never tuned on a small parity problem: BLOCK_T rows per tile, num_warps,
and num_stages tiles of raw codes in flight (`kernel_config`).
"""

from __future__ import annotations

import functools
import inspect
import os
from dataclasses import dataclass, field

import torch
from torch import Tensor

from kvq.quant import packing, trellis, vq
from kvq.quant.fp8 import fp16_placement
from kvq.runtime.codecs.fp8 import fp8_format_of
from kvq.runtime.kernels.backend import interpreting, next_pow2
from kvq.runtime.kernels.planning.launch_plan import SplitPlan, plan_splits
from kvq.runtime.packed import entry_pointers
from kvq.tensor_memo import Memo, memoised

MAX_SEGMENTS = 3
# the codes' decode through inline PTX (four bytes per register: 41 instead of 51
# warp-instructions per cached row for Llama-like KV4); KVQ_DECODE_ASM=0 keeps the same
# arithmetic in Triton, per element, as the interpreter runs it
ASM = os.environ.get("KVQ_DECODE_ASM", "1") != "0"
FULL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# under the interpreter: a small GPU, so that the tests' short segments split several
# ways and the split boundaries (tile-aligned, across segments) are exercised
INTERPRETER_SMS, INTERPRETER_PROGRAMS_PER_SM = 3, 1


@dataclass(frozen=True)
class KernelConfig:
    block_t: int
    num_warps: int
    num_stages: int
    # the tile loop prefetches the next tile's rows into L2 (the kernel's PREFETCH)
    prefetch: bool = False
    # flat key exceptions taken from each row per step of the tile's pass over them
    # (`_key_corrections`, the kernel's K_FLAT; `kernel_config`)
    key_entries_per_step: int = 1

    def options(self) -> dict:
        return {"num_warps": self.num_warps, "num_stages": self.num_stages}


def kernel_config(head_dim: int, bits: int, key_rows: bool = False,
                  rope_lut: bool = False, vector: int = 0,
                  key_entries: bool = False, trellis: bool = False) -> KernelConfig:  # fmt: skip
    """Launch configuration per shape bucket (head_dim, code bits; `key_rows`, whether key
    qparams are per row, no longer changes it): 64-row tiles, 4 warps, 2 tiles of raw codes
    in flight, where that compiles without spilling. Picked from the sm_90 compile
    (bench/kernel_resources.py; no GPU timing, never a small parity problem). KV4 at
    head_dim 128 (values, and per-token keys, read as words): 128 registers, 16 warps per
    SM, 31 warp-instructions per cached row (3 stages: 32; 128-row tiles: 27 but 12
    warps); at head_dim 256: 168 registers, 12 warps, 56 per row (32-row tiles: 16 warps
    but 66; 128-row tiles spill). 8-bit codes (values as words) at head_dim 128: 119
    registers, 16 warps, 37 per row; at head_dim 256, 32-row tiles: 137 registers, 12
    warps, 75 per row (64-row tiles: 66 per row but 174 registers, 8 warps). KV4 with
    pre-RoPE keys, same configuration: 184 registers, 8 warps, 47 per row at head_dim 128
    (32-row tiles: 136 registers, 12 warps, but 63 per row); 255 registers, 8 warps, 85
    per row at head_dim 256 (the columns rotate in two chunks; 8 warps per program: 100
    per row). `rope_lut`: NUQ4 keys before RoPE (KVQuant's layout, levels x per-channel
    scale + centre rotated in the loop): at head_dim 256 the per-channel normaliser held
    per column leaves no room for 4 warps (255 registers and a 304 B spill in four chunks
    of columns, 552 B in two), so 8 warps share the state: 255 registers, no spill, 162
    per row (general kernel: 426), one stage (the key entries' loop leaves the codes
    unstaged; without entries two stages spilled 16 B, one: none, 149 per row); at
    head_dim 128, 4 warps: 236 registers, 8 warps per SM, 79 per row (252). With the keys'
    levels from the byte-pair table (`_pair_levels`, one gather per tile) in channel order:
    254 registers, 8 warps per SM, 72 per row at 128; 255 registers, 144 per row at 256
    (4 warps there still spill). With key entries (their
    loop leaves the codes unstaged) the loop prefetches the next tile into L2
    (`prefetch`): 36 KB in flight per SM at 8 warps, where one tile was 18 (Llama-like
    head_dim 128 without it: 75 per row; Gemma 3: 17 KB).
    `vector`: the group size of vq keys (pre-RoPE, centroids gathered in the loop), with
    or without `key_entries` (flat exceptions): at head_dim 256, 8 warps as for NUQ4 (3 x
    2 codes: 222 registers, no spill, 297 per row; 4 warps spill); at 128, 4 warps (3 x 2:
    199 registers, 8 warps per SM, 148 per row; 2 x 4: 200, 104). One stage for 4-D groups
    at 256 (the key entries' loop leaves the packed codes unstaged anyway; the staged sink
    and residual loops of Gemma 3's layer call spilled 88 B for 2 x 4 codes with 2 stages,
    8 B with 1: 261 per row against 248) and for 2-D groups without key entries (staged
    codes spilled 64 B Llama-like, 248 B Gemma 3; one stage: none, 109 and 223 per row).
    `trellis` (the codes read as 2-D groups, `_trellis_states`): the same, but two stages
    without key entries at head_dim 128 (auto's 2-bit rows: staged codes, 17 KB in flight
    per SM at 70 per row, no spill; at 256 two stages spilled 24 B). Without spills, at
    8 warps per SM: Llama-like 100 per row at 4 bits (1% key entries, 0.5% value slots),
    101 at 3 (1% key entries), 70 at 2; Gemma 3 221, 200, 143."""
    if vector:
        staged = trellis and head_dim < 256  # trellis rows at 128: staged, no spill
        one = (vector == 4 and head_dim >= 256) or (vector == 2 and not key_entries and not staged)
        stages = 1 if one else 2
        warps = 8 if head_dim >= 256 else 4
        return KernelConfig(64, warps, stages, key_entries, _per_step(warps, key_entries))
    if rope_lut and head_dim >= 256:
        return KernelConfig(64, 8, 1, key_entries, _per_step(8, key_entries))
    if rope_lut:
        return KernelConfig(64, 4, 2, key_entries, _per_step(4, key_entries))
    if bits == 8 and head_dim >= 256:
        return KernelConfig(32, 4, 2)
    # key entries here: NUQ keys after RoPE (`_per_step`)
    return KernelConfig(64, 4, 2, key_entries_per_step=2 if key_entries and head_dim >= 256 else 1)


def _per_step(warps: int, key_entries: bool) -> int:
    """Key entries of each row per step of a 64-row tile's pass over them, pre-RoPE keys:
    one per thread. The pass takes as many steps as the tile's longest row needs, and a
    step costs about the same for 1 to threads / 64 entries a row; real counts vary (Gemma
    3 270M, NUQ4 at 1%, wikitext: 2.9 per row, 9.8 in a tile's longest), so one a step paid
    for the longest row. sm_90, with those rows' tile maxima (bench/kernel_resources.py
    --entry-counts; Llama-like: the counts thinned to 128 channels), warp-instructions per
    row, one a step -> this: Gemma 3 at 8 warps NUQ4 210 -> 156 (2 a step: 173, 8: 167),
    TR4 312 -> 257 (271, 269); Llama-like at 4 warps NUQ4 86 -> 79 (4 a step: 88), TR4
    125 -> 118 (126). Post-RoPE NUQ keys (4 warps, `kernel_config`) take two at head_dim
    256, Gemma 3 121.8 -> 114.6 at the same 212 registers, and one at 128, where two took
    132 registers: 12 warps per SM where one leaves 16 (70.0 -> 67.2)."""
    return warps * 32 // 64 if key_entries else 1


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
    planes = _key_planes(packed[0].key) if packed else 1
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
        if (not fp8 and not _nuq(p) and not vector and not tcq
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
    if k.slot_index is not None or (k.sparse_count is not None and not _nuq(k) and not _coded(k)):
        return "key exceptions other than NUQ's flat entries"
    if v.sparse_count is not None or (v.slot_index is not None and not _nuq(v) and not _coded(v)):
        return "value exceptions other than NUQ's slots"
    if v.slot_index is not None and v.slot_value.stride() != v.slot_index.stride():
        return "value slots: values must share the channels' layout"
    if _nuq(k) and k.qaxis not in ("channel", "head"):
        return "NUQ keys with per-row normalisers"
    if k.qaxis not in ("channel", "head"):
        reason = _row_groups_unsupported(k, d)
        if reason:
            return f"keys: {reason}"
    if _coded(v):  # per-row normaliser, checked by _vq_unsupported, _trellis_unsupported
        return None
    if v.qaxis == "head":  # a static scale per head: read per row with a zero row stride
        return "values: per-head zero points" if v.zero_point is not None else None
    reason = _row_groups_unsupported(v, d)
    return f"values: {reason}" if reason else None


def _nuq(p) -> bool:
    """Whether `p` holds 4-bit codebook codes (KVQuant's NUQ4): a table of 16 levels that
    the kernel reads as fp16 bytes (`_lut_planes`)."""
    return p.kind == "lookup" and p.bits == 4 and p.table.numel() == 16


def _vq(p) -> bool:
    """Whether `p` holds vector-codebook codes (`kvq.quant.vq`)."""
    return p.kind == "vector"


def _coded(p) -> bool:
    """Whether the kernel reads `p` as vq codes: vector codebooks or trellis codes (2-D
    groups in channel order, `_trellis_states`)."""
    return p.kind in ("vector", "trellis")


def _coded_dim(p) -> int:
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


# the group index widths the kernel reads (`_decode_splits_triton._vq_index`): a nibble, a
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


def _key_planes(p) -> int:
    """Planes of a packed key tile: 2 for 4-bit codes (even, odd channels) and 4-D vector
    groups (RoPE pairs of neighbouring channels), else 1."""
    if _coded(p):
        return _coded_dim(p) // 2
    return 2 if p.bits == 4 else 1


def _value_planes_of(p) -> int:
    """Planes of a packed value tile: 2 for 4-bit codes and vector groups, else 1."""
    return 2 if p.bits == 4 or _coded(p) else 1


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


def _table(p, half: bool) -> Tensor | None:
    """The codebook the kernel reads for `p`: NUQ4's (`nuq_table`), a vector one's
    (`vq_table`), else None."""
    if _nuq(p):
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
    slots' entries, `_decode_splits_triton._slot_entries`)."""

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


def _flat_starts(count: Tensor) -> Tensor:
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


def _words(p) -> bool:
    """Whether the kernel reads `p`'s codes as 32-bit words (`_word_nibbles`,
    `_word_bytes`): codes with qparams read per row (per-row groups, or one scale per
    head), rows on 4-byte boundaries (11 fewer instructions per cached row of Llama-like
    KV4 at sm_90, bench/kernel_resources.py)."""
    return p.kind != "full" and p.qaxis in ("row", "head") and _aligned_words(p)


def _fp8(p) -> tuple[int, float]:
    """(mantissa shift, factor) of fp8 lookup rows (`fp8.fp16_placement`); (0, 1.0) for
    integer codes."""
    fmt = fp8_format_of(p.table) if p.kind == "lookup" else None
    return fp16_placement(fmt) if fmt else (0, 1.0)


def _row_qparams(p) -> tuple[Tensor, Tensor | None, tuple[int, int, int], int]:
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


def _key_fold(p) -> Tensor:
    """[2, H_kv, D] float32: per channel, the static key scale and bias (offset -
    zero_point x scale), the affine map after subtracting `zero` (fp8 codes: the scale x
    the format's factor); cached per scale."""

    def build():
        hkv = p.data.shape[1]
        scale = p.scale.float() * _fp8(p)[1]
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


@dataclass(frozen=True)
class PlannedCall:
    """One call's launch, built without launching (the offline compile reads it too): the
    layer's `_Site` and this call's values of the kernel parameters."""

    site: _Site
    values: list  # every kernel parameter's value, in the signature's order
    rows: int  # tile-padded rows per work item over all segments

    @property
    def args(self) -> dict:
        """Every kernel parameter by name, constexprs included."""
        return dict(zip(self.site.names, self.values, strict=True))

    @property
    def config(self) -> KernelConfig:
        return self.site.config

    @property
    def work(self) -> int:  # batch x KV heads
        return self.site.work

    @property
    def out_shape(self) -> tuple:  # [B, H_q, Q, D]
        return self.site.out_shape

    @property
    def r_rows(self) -> int:  # G x Q real query rows per work item
        return self.site.r_rows

    def with_splits(self, plan: SplitPlan, part: Tensor | None, out: Tensor) -> dict:
        """The arguments by name with the plan's splits (`launch_values`)."""
        return dict(zip(self.site.names, self.launch_values(plan, part, out), strict=True))

    def launch_values(self, plan: SplitPlan, part: Tensor | None, out: Tensor) -> list:
        """The values with the plan's splits: one split writes `out` itself (no partial
        states: `part` None), more write `part` (`out`: the reduction's)."""
        values = list(self.values)
        direct = plan.splits == 1
        i = self.site.launch_slots
        values[i[0]], values[i[1]] = (None, out) if direct else (part, None)
        values[i[2]], values[i[3]] = plan.splits, direct
        return values

    def kernel_key(self, splits: int) -> tuple:
        """What Triton specialises this launch on beyond the site's layout: DIRECT, the
        split count and the strides read per call (== 1, divisibility by 16)."""
        v = self.values
        per_call = tuple(
            (v[i] == 1, v[i] & 15 == 0, v[i] >> 31 == 0) for i, _, _ in self.site.strides
        )
        return (splits == 1, splits & 15 == 0, per_call)


# the tensors a call reads, in a fixed order (`_sources`); the sources whose strides may
# change from one call to the next (a mask over a longer context, positions of a fresh
# tensor) are read per call (`_Site.strides`), the others' are part of the layout
SRC_Q, SRC_MASK, SRC_SEG, SRC_PACKED, SRC_ROPE, SRC_LENGTHS, SRC_ROPE1 = 0, 1, 2, 11, 23, 25, 26
PER_CALL_STRIDES = (SRC_MASK, SRC_SEG + 2, SRC_SEG + 5, SRC_SEG + 8)


@dataclass(frozen=True)
class _Src:
    """Marker in a site's template: the call's source tensor `index`."""

    index: int


@dataclass(frozen=True)
class _Stride:
    """Marker: the stride along `dim` of the call's source tensor `index`."""

    index: int
    dim: int


@dataclass(frozen=True)
class _Rows:
    """Marker: the row count of the call's segment `segment`."""

    segment: int


@dataclass
class _Site:
    """What a layer's decode calls share while its layout stays (cached per
    `_layout_key`): every constexpr, the strides its layout fixes, the configuration, and
    where each call's values go — its tensors, row counts and per-call strides — so a
    call fills a list instead of building the arguments; plus the compiled kernels of
    its specialisations (`_Launcher`)."""

    names: tuple  # the kernel's parameters, in signature order
    template: tuple  # their values; None where a call fills them in
    tensors: tuple  # (parameter index, source index)
    strides: tuple  # (parameter index, source index, dim)
    rows_at: tuple  # (parameter index, segment index)
    launch_slots: tuple  # parameter index of part, out, splits, DIRECT
    config: KernelConfig
    work: int
    out_shape: tuple
    r_rows: int
    r_pad: int  # R: query rows per program
    kernels: dict = field(default_factory=dict)  # kernel_key -> compiled kernel (CUDA)
    per_sm: int | None = None  # resident programs per SM of the compiled kernel

    def values(self, src: list, rows: list) -> list:
        """A call's values: the template with its tensors `src`, their per-call strides and
        the segments' row counts `rows` filled in."""
        out = list(self.template)
        for i, j in self.tensors:
            out[i] = src[j]
        for i, j, dim in self.strides:
            out[i] = src[j].stride(dim)
        for i, j in self.rows_at:
            out[i] = rows[j]
        return out


_SITES: dict = {}
_SITES_KEPT = 512  # a few layouts per layer of a model (the layout changes as the cache grows)


def planned_call(query: Tensor, segments, *, scaling: float, softcap: float | None,
                 half: bool, mask: Tensor | None = None,
                 rope: tuple[Tensor, Tensor] | None = None,
                 lengths: Tensor | None = None) -> PlannedCall:  # fmt: skip
    """The kernel arguments for this call (`planned_unsupported` returned None); `rope`:
    the (cos, sin) tables [P, D/2] of pre-RoPE keys; `lengths`: None, or the segments'
    row counts on the device (int32 [MAX_SEGMENTS], `run_planned`). Per call: the
    tensors it reads (`_sources`, derived ones from their caches) and its layout key; the
    rest comes from the site of that layout (`_site`, built by the first call of a
    layout)."""
    rows = [s.key.data.shape[2] for s in segments]
    src = _sources(query, segments, rows, mask, rope, half, lengths)
    key = _layout_key(query, segments, rows, src, scaling, softcap, half)
    site = _SITES.get(key)
    if site is None:
        if len(_SITES) >= _SITES_KEPT:
            _SITES.pop(next(iter(_SITES)))
        site = _SITES[key] = _site(query, segments, src, scaling=scaling, softcap=softcap,
                                   half=half)  # fmt: skip
    block_t = site.config.block_t
    padded = sum(-(-n // block_t) for n in rows) * block_t
    return PlannedCall(site, site.values(src, rows), padded)


def _sources(query: Tensor, segments, rows: list, mask: Tensor | None, rope, half: bool,
             lengths: Tensor | None) -> list:  # fmt: skip
    """Every tensor the call reads, None where absent: query, mask; per segment slot (3)
    its keys, values and positions (pre-RoPE keys); the packed segment's key qparams
    (`_key_fold` of static ones, else per-row scales and offsets), value scales and
    offsets, NUQ tables (`nuq_table`), the keys' flat exceptions (counts, first entries
    `_flat_starts`, channels, values), the values' slots; the RoPE unit table and
    amplitudes (`rope_planes`); the device row counts `lengths`; the RoPE unit table and
    amplitudes in channel order (full-precision pre-RoPE keys)."""
    src = [query, mask]
    packed, pre = None, False
    for i in range(MAX_SEGMENTS):
        if i >= len(segments) or not rows[i]:
            src += (None, None, None)
            continue
        seg = segments[i]
        if seg.key.kind != "full":
            packed = seg
        pre = pre or seg.key.pre_rope
        src += (seg.key.data, seg.value.data, seg.positions if seg.key.pre_rope else None)
    if packed is None:
        src += (None,) * 12
    else:
        k, v = packed.key, packed.value
        if k.qaxis == "row":
            src += (k.scale, k.offset)
        else:
            src += (_key_fold(k), None)
        src += (v.scale, v.offset, _table(k, half), _table(v, half))
        if k.sparse_count is not None and k.sparse_index.numel():
            src += (k.sparse_count, _flat_starts(k.sparse_count), k.sparse_index,
                    k.sparse_value)  # fmt: skip
        else:
            src += (None,) * 4
        if v.slot_index is not None and v.slot_index.shape[-1]:
            src += (v.slot_index, v.slot_value)
        else:
            src += (None, None)
    dtype = torch.float16 if half else torch.float32
    if pre:
        planes = _key_planes(packed.key) if packed is not None else 1
        src += rope_planes(rope, planes, dtype)
    else:
        src += (None, None)
    src.append(lengths)
    src += rope_planes(rope, 1, dtype) if pre else (None, None)
    return src


def _layout_key(query: Tensor, segments, rows: list, src: list, scaling: float, softcap,
                half: bool) -> tuple:  # fmt: skip
    """What the site of a call depends on: the call's scalars; each segment's codes (kind,
    width, zero, key stage; the packed one's qparams axes and groups, fp8 formats, NUQ,
    value slots); each source tensor's dtype, 16-byte alignment and strides (but those read
    per call, `PER_CALL_STRIDES`); the RoPE table's positions. (The other extents follow
    from the query's shape and the codes: `planned_unsupported` checked them.)"""
    key = [query.shape, query.device, scaling, softcap, half, len(segments)]
    for seg, n in zip(segments, rows, strict=True):
        k, v = seg.key, seg.value
        key.append((n > 0, k.kind, k.bits, k.zero, k.pre_rope, v.kind, v.bits, v.zero))
        if k.kind != "full":
            slots = None if v.slot_index is None else v.slot_index.shape[-1]
            key.append((k.scale.shape[-1], v.scale.shape[-1], k.scale.dim(), v.scale.dim(),
                        _fp8(k), _fp8(v), _nuq(k), _nuq(v), slots, k.vector_dim,
                        v.vector_dim, k.window, v.window))  # fmt: skip
    if src[SRC_MASK] is not None:
        key.append(src[SRC_MASK].shape[0])
    if src[SRC_ROPE] is not None:
        key.append(src[SRC_ROPE].shape[0])
    for i, t in enumerate(src):
        if t is None:
            key.append(None)
        elif i in PER_CALL_STRIDES:
            key.append((t.dtype, t.data_ptr() & 15))
        else:
            key.append((t.dtype, t.data_ptr() & 15, t.stride()))
    return tuple(key)


def _site(query: Tensor, segments, src: list, *, scaling: float, softcap: float | None,
          half: bool) -> _Site:  # fmt: skip
    """The site of this call's layout: every kernel parameter, None for what the kernel
    derives from the layout or does not read (`_layout_strides`, absent segments and
    features: no runtime argument), markers for what each call fills in."""
    from kvq.runtime.kernels.decode import _splits_triton as kern

    b, hq, q_len, d = query.shape
    hkv = segments[0].key.data.shape[1]
    group = hq // hkv
    mask = src[SRC_MASK]
    packed = next((s for s in segments if s.key.kind != "full"), None)
    k_rowq, k_ng, kq, k_off = False, 1, (None, None, None), None
    if packed is not None:
        kp, vp = _key_planes(packed.key), _value_planes_of(packed.value)
        bits = packed.key.bits
        k_fp8, v_fp8 = _fp8(packed.key), _fp8(packed.value)
        k_rowq = packed.key.qaxis == "row"
        k_fold = _Src(SRC_PACKED)
        if k_rowq:  # per-row group key qparams, applied to the decoded key tile
            _, off, kq, k_ng = _row_qparams(packed.key)
            kq = _layout_strides(kq, hkv, k_ng)
            k_off = None if off is None else _Src(SRC_PACKED + 1)
        _, off, vq, ng = _row_qparams(packed.value)
        vq = _layout_strides(vq, hkv, ng)
        v_scale, v_off = _Src(SRC_PACKED + 2), None if off is None else _Src(SRC_PACKED + 3)
        k_zero, v_zero = float(packed.key.zero), float(packed.value.zero)
    else:
        kp, vp, bits, ng = 1, 1, 16, 1
        k_fold = v_scale = v_off = None
        vq, k_zero, v_zero = (None, None, None), 0.0, 0.0
        k_fp8 = v_fp8 = (0, 1.0)
    cfg = kernel_config(d, bits, k_rowq, packed is not None and packed.key.pre_rope
                        and _nuq(packed.key),
                        _coded_dim(packed.key) if packed is not None else 0,
                        src[SRC_PACKED + 6] is not None,
                        packed is not None and packed.key.kind == "trellis")  # fmt: skip
    sq_b, sq_h, sq_q = query.stride()[:3]
    args = dict(q=_Src(SRC_Q), sq_b=None if sq_b == hq * q_len * d else sq_b,
                sq_h=None if sq_h == d else sq_h,
                sq_q=None if q_len == 1 or sq_q == hq * d else sq_q, part=None, out=None)  # fmt: skip
    kinds = []
    for i in range(MAX_SEGMENTS):
        seg = segments[i] if i < len(segments) else None
        if seg is None or not seg.rows:
            kinds.append(0)
            args.update({f"k{i}": None, f"v{i}": None, f"rows{i}": None})
            args.update({f"{n}{i}_{s}": None for n in "kv" for s in "bht"})
            continue
        full = seg.key.kind == "full"
        kinds.append(1 if full else 2)
        on_device = src[SRC_LENGTHS] is not None  # the kernel reads the rows from `lengths`
        k_row = d if full else packing.packed_len(d, seg.key.bits)  # the kernel's default
        v_row = d if full else packing.packed_len(d, seg.value.bits)
        k_b, k_h, k_t = _layout_strides(seg.key.data.stride()[:3], hkv, k_row)
        v_b, v_h, v_t = _layout_strides(seg.value.data.stride()[:3], hkv, v_row)
        if v_h == k_h:  # the values' head stride is the keys'
            v_h = None
        args.update({f"k{i}": _Src(SRC_SEG + 3 * i), f"v{i}": _Src(SRC_SEG + 3 * i + 1),
                     f"k{i}_b": k_b, f"k{i}_h": k_h, f"k{i}_t": k_t, f"v{i}_b": v_b,
                     f"v{i}_h": v_h, f"v{i}_t": v_t,
                     f"rows{i}": None if on_device else _Rows(i)})  # fmt: skip
    if mask is not None:  # [B | 1, 1, Q, total] bool, read in place
        args.update(mask=_Src(SRC_MASK), m_b=_Stride(SRC_MASK, 0) if mask.shape[0] > 1 else None,
                    m_q=_Stride(SRC_MASK, 2) if q_len > 1 else None)  # fmt: skip
    else:
        args.update(mask=None, m_b=None, m_q=None)
    args.update(
        k_fold=k_fold, v_scale=v_scale, v_off=v_off, vq_b=vq[0], vq_h=vq[1], vq_t=vq[2],
        k_off=k_off, kq_b=kq[0], kq_h=kq[1], kq_t=kq[2], K_ROWQ=k_rowq, K_NG=k_ng,
        K_HAS_OFF=k_off is not None,
        HKV=hkv, splits=1, lengths=None if src[SRC_LENGTHS] is None else _Src(SRC_LENGTHS),
        K_ZERO=k_zero, V_ZERO=v_zero, scaling=float(scaling),
        softcap=float(softcap) if softcap else None, Q=q_len, G=group,
        R=max(16, next_pow2(group * q_len)),
        D=d, BLOCK_T=cfg.block_t, KIND0=kinds[0], KIND1=kinds[1], KIND2=kinds[2], KP=kp,
        VP=vp, NG=ng, V_HAS_OFF=v_off is not None, K_FP8=k_fp8[0], V_FP8=v_fp8[0],
        K_FACTOR=k_fp8[1] if k_rowq else 1.0, V_FACTOR=v_fp8[1],
        K_WORDS=k_rowq and _words(packed.key),
        V_WORDS=packed is not None and _words(packed.value) and not _coded(packed.value),
        HAS_SOFTCAP=bool(softcap), CAUSAL=q_len > 1, HALF=half, DIRECT=False,
        HAS_MASK=mask is not None,
        NUM_STAGES=cfg.num_stages, PREFETCH=cfg.prefetch and not interpreting(),
        ASM=ASM and not interpreting() and query.device.type == "cuda",
    )  # fmt: skip
    args.update(_rope_args(segments, src))
    args.update(_nuq_args(packed, src, hkv, cfg), RQ=next_pow2(group * q_len))
    args.update(_vq_args(packed))
    # every parameter: the ones left out here take the kernel's defaults
    params = inspect.signature(kern.decode_splits_kernel.fn).parameters
    names = tuple(params)
    template = tuple(args[n] if n in args else params[n].default for n in names)
    marked = list(enumerate(template))
    return _Site(
        names=names,
        template=tuple(None if isinstance(v, _Src | _Stride | _Rows) else v for v in template),
        tensors=tuple((i, v.index) for i, v in marked if isinstance(v, _Src)),
        strides=tuple((i, v.index, v.dim) for i, v in marked if isinstance(v, _Stride)),
        rows_at=tuple((i, v.segment) for i, v in marked if isinstance(v, _Rows)),
        launch_slots=tuple(names.index(n) for n in ("part", "out", "splits", "DIRECT")),
        config=cfg,
        work=b * hkv,
        out_shape=(b, hq, q_len, d),
        r_rows=group * q_len,
        r_pad=args["R"],
    )


def _layout_strides(strides, hkv: int, row: int) -> tuple:
    """(batch, head, row) strides of a [B, H_kv, T, ...] tensor as the kernel takes them:
    None where the layout fixes the value (the kernel derives it, no runtime argument):
    a row stride of `row` (contiguous rows), a batch stride of H_kv x the head stride
    (under 2^31: the kernel multiplies in 32 bits)."""
    sb, sh, st = strides
    batch = None if sb == hkv * sh and sb < 2**31 else sb
    return batch, sh, None if st == row else st


def _rope_args(segments, src: list) -> dict:
    """Positions per segment (read per call: their batch stride) and the unit table of
    pre-RoPE keys (`rope_planes`, in `src`); None and ROPE* False where no segment holds
    any."""
    args = {}
    for i in range(MAX_SEGMENTS):
        pos = src[SRC_SEG + 3 * i + 2]
        pre = pos is not None
        args.update({f"pos{i}": _Src(SRC_SEG + 3 * i + 2) if pre else None,
                     f"pos{i}_b": _Stride(SRC_SEG + 3 * i + 2, 0) if pre else None,
                     f"pos{i}_t": _Stride(SRC_SEG + 3 * i + 2, 1) if pre else None,
                     f"ROPE{i}": pre})  # fmt: skip
    tab = src[SRC_ROPE]
    if tab is not None:
        args.update(rope_tab=_Src(SRC_ROPE), rope_amp=_Src(SRC_ROPE + 1), rope_rows=tab.shape[0],
                    rope_tab1=_Src(SRC_ROPE1), rope_amp1=_Src(SRC_ROPE1 + 1))  # fmt: skip
    else:
        args.update(rope_tab=None, rope_amp=None, rope_rows=None, rope_tab1=None, rope_amp1=None)
    return args


def rope_planes(
    rope: tuple[Tensor, Tensor], planes: int, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """(unit table [P, 2, D/2] of `dtype`: cos, then sin, per position; amplitude [D/2]
    float32) of RoPE tables whose rows are a_f (cos, sin)(p theta_f): the columns in the
    kernel's plane order (4-bit planes: the even channels' frequencies 0, 2, 4, ..., then
    the odd ones'), each divided by its amplitude a_f (|row 0|; rope scaling such as YaRN's
    attention factor), so that R(p0 + i) = R(p0) R(i) holds for the unit rotations and
    a_f goes onto the query once. Cached per table: a layer reuses its tables across
    decode steps."""
    cached = memoised(_ROPE_PLANES, rope[0], dict)  # (planes, dtype) -> tables

    def build():
        cos, sin = (t.float() for t in rope)
        n = cos.shape[-1]
        order = torch.arange(n, device=cos.device).view(n // planes, planes).t().reshape(-1)
        cos, sin = cos[:, order], sin[:, order]
        amp = torch.hypot(cos[0], sin[0])  # [D/2]
        tab = torch.stack([cos / amp, sin / amp], dim=1).to(dtype).contiguous()
        return tab, amp.contiguous()

    key = (planes, dtype)
    if key not in cached:
        cached[key] = build()
    return cached[key]


_ROPE_PLANES: Memo = {}


def _nuq_args(packed, src: list, hkv: int, cfg: KernelConfig) -> dict:
    """The kernel's NUQ arguments (K_LUT ... vs_t): codebook tables, the keys' flat
    exceptions (counts, first entries, channels, values; K_FLAT: entries of each row per
    step of their pass, `KernelConfig.key_entries_per_step`) and the values' slots, from
    `src`; None where absent (and for strides the layout fixes, `_layout_strides`)."""
    names = ("k_tab", "v_tab", "k_cnt", "kc_b", "kc_h", "kc_t", "k_first", "kf_b", "kf_h",
             "kf_t", "k_eidx", "k_eval", "v_sidx", "v_sval", "vs_b", "vs_h", "vs_t")  # fmt: skip
    out = dict(K_LUT=0, V_LUT=0, K_FLAT=0, V_SLOTS=0, **dict.fromkeys(names))
    if packed is None:
        return out
    at = SRC_PACKED + 4  # k_tab, v_tab, k_cnt, k_first, k_eidx, k_eval, v_sidx, v_sval
    k_tab, v_tab, count, first, _, _, slot_index, _ = src[at : at + 8]
    out.update(K_LUT=_nuq(packed.key), V_LUT=_nuq(packed.value))
    out.update(
        k_tab=None if k_tab is None else _Src(at), v_tab=None if v_tab is None else _Src(at + 1)
    )
    if count is not None:
        out.update(K_FLAT=cfg.key_entries_per_step, k_cnt=_Src(at + 2), k_first=_Src(at + 3),
                   k_eidx=_Src(at + 4), k_eval=_Src(at + 5))  # fmt: skip
        out.update(zip(("kc_b", "kc_h", "kc_t"), _layout_strides(count.stride(), hkv, 1),
                       strict=True))  # fmt: skip
        out.update(zip(("kf_b", "kf_h", "kf_t"), _layout_strides(first.stride(), hkv, 1),
                       strict=True))  # fmt: skip
    if slot_index is not None:
        slots = slot_index.shape[-1]
        out.update(V_SLOTS=slots, v_sidx=_Src(at + 6), v_sval=_Src(at + 7))
        out.update(zip(("vs_b", "vs_h", "vs_t"),
                       _layout_strides(slot_index.stride()[:3], hkv, slots), strict=True))  # fmt: skip
    return out


def _vq_args(packed) -> dict:
    """The kernel's vector-codebook constexprs: group size and digit bits per side (0:
    other codes; the codebooks travel as k_tab, v_tab, `_nuq_args`)."""
    out = dict(K_VQ=0, K_VQB=0, V_VQ=0, V_VQB=0, K_TRN=0, V_TRN=0)
    if packed is None:
        return out
    k, v = packed.key, packed.value
    if _coded(k):
        out.update(K_VQ=_coded_dim(k), K_VQB=k.bits, K_TRN=k.window // k.bits)
    if _coded(v):
        out.update(V_VQ=_coded_dim(v), V_VQB=v.bits, V_TRN=v.window // v.bits)
    return out


def run_planned(query: Tensor, segments, *, scaling: float, softcap: float | None,
                half: bool, mask: Tensor | None = None,
                rope: tuple[Tensor, Tensor] | None = None,
                lengths: Tensor | None = None) -> Tensor:  # fmt: skip
    """[B, H_q, Q, D] float32: one decode launch (and one reduction when it splits).

    lengths: None, or int32 [MAX_SEGMENTS] on the device, the row counts of the segments
    (each at most its rows here, which are then its capacity: the buffer a cache writes
    into): the kernel reads them, and the plan (grid, splits) follows the capacities, so
    a call captured in a CUDA graph replays over rows written since (a split past the
    rows reads nothing). A mask's columns are the counted rows end to end (its width:
    the capacities' sum); positions span the capacities."""
    from kvq.runtime.kernels.decode import _splits_triton as kern

    call = planned_call(query, segments, scaling=scaling, softcap=softcap, half=half, mask=mask,
                        rope=rope, lengths=lengths)  # fmt: skip
    launcher = _launcher(query.device)
    plan = launcher.plan(call)
    out = torch.empty(call.out_shape, device=query.device)
    site, options = call.site, call.config.options()
    if plan.splits == 1:
        launcher.launch(kern.decode_splits_kernel, (call.work, 1),
                        call.launch_values(plan, None, out), options, site.kernels,
                        call.kernel_key(1))  # fmt: skip
        return out
    r_pad, d = site.r_pad, query.shape[-1]
    part = torch.empty((call.work, plan.splits, r_pad, d + 2), device=query.device)
    launcher.launch(kern.decode_splits_kernel, (call.work, plan.splits),
                    call.launch_values(plan, part, out), options, site.kernels,
                    call.kernel_key(plan.splits))  # fmt: skip
    combine = [part, out, plan.splits, r_pad, d, call.r_rows, 16, next_pow2(d)]
    key = ("combine", plan.splits & 15 == 0, r_pad, d, call.r_rows)
    launcher.launch(kern.combine_splits_kernel, (call.work, call.r_rows), combine, {},
                    launcher.compiled, key)  # fmt: skip
    return out


class _Launcher:
    """Launches with every parameter's value in signature order: under the interpreter
    through `kernel[grid]`; on CUDA through the compiled kernel of the launch's
    specialisation, cached under a key the caller computes (the decode kernel's: its
    site's, `PlannedCall.kernel_key`), so a call binds no arguments in Python."""

    def __init__(self, device: torch.device):
        self.device = device
        self.compiled: dict = {}
        # the kernels run through the interpreter (the process's setting, read once)
        self.interpreted = device.type != "cuda" or interpreting()
        if device.type == "cuda":
            props = torch.cuda.get_device_properties(device)
            self.sms = props.multi_processor_count
        else:
            self.sms = INTERPRETER_SMS

    def plan(self, call: PlannedCall) -> SplitPlan:
        from kvq.runtime.kernels.decode import _splits_triton as kern

        per_sm = INTERPRETER_PROGRAMS_PER_SM
        min_rows = call.config.block_t
        if self.device.type == "cuda":
            site = call.site
            if site.per_sm is None:  # the occupancy of the launch that splits (2 here)
                split = SplitPlan(call.work, call.rows, call.config.block_t, 2, 1, 1)
                query = call.values[0]  # the first parameter
                part = torch.empty(1, device=query.device)  # float32, like the launches'
                values = call.launch_values(split, part, None)
                kernel = self._compiled(kern.decode_splits_kernel, values, call.config.options(),
                                        site.kernels, call.kernel_key(2))  # fmt: skip
                site.per_sm = resident_programs(kernel)
            per_sm, min_rows = site.per_sm, None
        kw = {} if min_rows is None else {"min_rows": min_rows}
        return plan_splits(call.work, call.rows, sms=self.sms, programs_per_sm=per_sm,
                           block_t=call.config.block_t, **kw)  # fmt: skip

    def launch(self, fn, grid, values: list, options: dict, cache: dict, key) -> None:
        """fn[grid](*values) with `options`; `key` (with the options) names its compiled
        kernel in `cache`."""
        if self.interpreted:
            fn[grid](*values, **options)
            return
        self._compiled(fn, values, options, cache, key)[(*grid, 1)](*values)

    def _compiled(self, fn, values: list, options: dict, cache: dict, key):
        key = (key, *options.values())
        hit = cache.get(key)
        if hit is None:
            args = dict(zip(fn.arg_names, values, strict=True))
            hit = cache[key] = fn.warmup(**args, **options, grid=(1,))
        return hit


def resident_programs(compiled) -> int:
    """Programs of a compiled kernel resident per SM (registers, shared memory, warps)."""
    from kvq.runtime.kernels.offline.cubin import KernelResources

    res = KernelResources(compiled.metadata.num_warps, compiled.n_regs, 0,
                          compiled.metadata.shared, None)  # fmt: skip
    return max(1, res.programs_per_sm)


@functools.cache
def _launcher(device: torch.device) -> _Launcher:
    return _Launcher(device)
