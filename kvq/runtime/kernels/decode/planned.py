"""The planned decode-attention launch: one kernel launch per layer call, at most one
reduction, no device syncs (`_splits_triton`, `launch_plan`).

It takes the layouts a decode step mostly sees — full-precision segments (sink rows,
the residual window) around at most one packed segment of 4- or 8-bit affine codes,
fp8 codes (E4M3 / E5M2, decoded from their bits, `fp8.fp16_placement`) or 4-bit
codebook codes (KVQuant's NUQ4: 16 levels) or vector-codebook codes (the
layouts of `kvq calibrate vq` and `auto --bits 2 | 3`: RoPE-pair key groups stored before
RoPE, neighbouring-channel value groups, 16, 64 or 256 centroids) or trellis codes
(`kvq calibrate trellis`, what `auto` stores: 1- to 4-bit digits read as vq codes in
channel order); `planned_layouts.py` says which layouts exactly and builds their tables,
with static per-channel (or
per-head) or per-row grouped key qparams and per-row grouped or per-head value qparams,
NUQ's exact exceptions (the keys' flat entries, the values' slots), keys stored after RoPE
or before it (rotated in the tile loop at each row's position,
`_rope_triton._rope_scores`, from a unit table in plane order cached per RoPE
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
each row's first flat entry, a prefix sum of the counts (`flat_starts`), cached per
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

from kvq.quant import packing
from kvq.runtime.kernels.backend import interpreting, next_pow2
from kvq.runtime.kernels.decode.planned_layouts import (
    MAX_SEGMENTS,
    code_table,
    coded_dim,
    flat_starts,
    fp8_code,
    is_coded,
    is_nuq,
    key_fold,
    key_planes,
    row_qparams,
    value_planes,
    word_rows,
)
from kvq.runtime.kernels.planning.launch_plan import SplitPlan, plan_splits
from kvq.tensor_memo import Memo, memoised

# the codes' decode through inline PTX (four bytes per register: 41 instead of 51
# warp-instructions per cached row for Llama-like KV4); KVQ_DECODE_ASM=0 keeps the same
# arithmetic in Triton, per element, as the interpreter runs it
ASM = os.environ.get("KVQ_DECODE_ASM", "1") != "0"
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
    (`key_fold` of static ones, else per-row scales and offsets), value scales and
    offsets, NUQ tables (`nuq_table`), the keys' flat exceptions (counts, first entries
    `flat_starts`, channels, values), the values' slots; the RoPE unit table and
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
            src += (key_fold(k), None)
        src += (v.scale, v.offset, code_table(k, half), code_table(v, half))
        if k.sparse_count is not None and k.sparse_index.numel():
            src += (k.sparse_count, flat_starts(k.sparse_count), k.sparse_index,
                    k.sparse_value)  # fmt: skip
        else:
            src += (None,) * 4
        if v.slot_index is not None and v.slot_index.shape[-1]:
            src += (v.slot_index, v.slot_value)
        else:
            src += (None, None)
    dtype = torch.float16 if half else torch.float32
    if pre:
        planes = key_planes(packed.key) if packed is not None else 1
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
                        fp8_code(k), fp8_code(v), is_nuq(k), is_nuq(v), slots, k.vector_dim,
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
        kp, vp = key_planes(packed.key), value_planes(packed.value)
        bits = packed.key.bits
        k_fp8, v_fp8 = fp8_code(packed.key), fp8_code(packed.value)
        k_rowq = packed.key.qaxis == "row"
        k_fold = _Src(SRC_PACKED)
        if k_rowq:  # per-row group key qparams, applied to the decoded key tile
            _, off, kq, k_ng = row_qparams(packed.key)
            kq = _layout_strides(kq, hkv, k_ng)
            k_off = None if off is None else _Src(SRC_PACKED + 1)
        _, off, vq, ng = row_qparams(packed.value)
        vq = _layout_strides(vq, hkv, ng)
        v_scale, v_off = _Src(SRC_PACKED + 2), None if off is None else _Src(SRC_PACKED + 3)
        k_zero, v_zero = float(packed.key.zero), float(packed.value.zero)
    else:
        kp, vp, bits, ng = 1, 1, 16, 1
        k_fold = v_scale = v_off = None
        vq, k_zero, v_zero = (None, None, None), 0.0, 0.0
        k_fp8 = v_fp8 = (0, 1.0)
    cfg = kernel_config(d, bits, k_rowq, packed is not None and packed.key.pre_rope
                        and is_nuq(packed.key),
                        coded_dim(packed.key) if packed is not None else 0,
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
        K_WORDS=k_rowq and word_rows(packed.key),
        V_WORDS=packed is not None and word_rows(packed.value) and not is_coded(packed.value),
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
    out.update(K_LUT=is_nuq(packed.key), V_LUT=is_nuq(packed.value))
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
    if is_coded(k):
        out.update(K_VQ=coded_dim(k), K_VQB=k.bits, K_TRN=k.window // k.bits)
    if is_coded(v):
        out.update(V_VQ=coded_dim(v), V_VQB=v.bits, V_TRN=v.window // v.bits)
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
