"""The planned decode-attention launch: one kernel launch per layer call, at most one
reduction, no device syncs (`_decode_splits_triton`, `launch_plan`).

It takes the layouts a decode step mostly sees — full-precision segments (sink rows,
the residual window) around at most one packed segment of 4- or 8-bit affine codes,
fp8 codes (E4M3 / E5M2, decoded from their bits, `fp8.fp16_placement`) or 4-bit
codebook codes (KVQuant's NUQ4: 16 levels, `nuq_table`) with static per-channel (or
per-head) or per-row grouped key qparams and per-row grouped or per-head value qparams,
NUQ's exact exceptions (the keys' flat entries, the values' slots), keys stored after RoPE
or before it (rotated in the tile loop at each row's position,
`_decode_splits_triton._rope_scores`, from a unit table in plane order cached per RoPE
table, `rope_planes`; NUQ keys with their exceptions too, KVQuant's stored layout), with or
without a mask over the rows
(sliding windows, padding: read in place, one byte per row and tile) — and
`decode_attention.decode_path` sends everything else to the general kernel. What the
host does per call: checks, a cached plan
(splits from the compiled kernel's occupancy, `launch_plan.plan_splits`), two
allocations (partial states and output; one when a single split writes the output
itself) and the launches through a launcher cached per specialisation, which binds
the arguments without Triton's per-call binder. NUQ4 keys with exceptions also need
each row's first flat entry, a prefix sum of the counts (`_flat_starts`), cached per
contents of the count rows: recomputed (3 small ops) only on a call after they changed.

The launch configuration is a fixed heuristic per head_dim and code width (shape
bucket), never tuned on a small parity problem: BLOCK_T rows per tile, num_warps,
and num_stages tiles of raw codes in flight (`kernel_config`).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
from torch import Tensor

from kvq.quant.fp8 import fp16_placement
from kvq.runtime.fp8_codecs import fp8_format_of
from kvq.runtime.kernels.backend import interpreting, next_pow2
from kvq.runtime.kernels.launch_plan import SplitPlan, plan_splits
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

    def options(self) -> dict:
        return {"num_warps": self.num_warps, "num_stages": self.num_stages}


def kernel_config(head_dim: int, bits: int, key_rows: bool = False,
                  rope_lut: bool = False) -> KernelConfig:  # fmt: skip
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
    per column leaves no room for 4 warps (255 registers and a 552 B spill, 151 per row),
    so 8 warps share the state: 255 registers, no spill, 171 per row (general kernel:
    426); at head_dim 128, 4 warps: 245 registers, 8 warps per SM, 87 per row (252)."""
    if rope_lut and head_dim >= 256:
        return KernelConfig(64, 8, 2)
    if bits == 8 and head_dim >= 256:
        return KernelConfig(32, 4, 2)
    return KernelConfig(64, 4, 2)


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
    planes = 2 if packed and packed[0].key.bits == 4 else 1
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
        if not fp8 and not _nuq(p) and (p.kind != "affine" or p.bits not in (4, 8)):
            return "codes other than 4- or 8-bit affine, fp8 or 4-bit NUQ"
    # NUQ exceptions: the keys' flat entries, the values' slots (`_key_exceptions`,
    # `_value_slots`)
    if k.slot_index is not None or (k.sparse_count is not None and not _nuq(k)):
        return "key exceptions other than NUQ's flat entries"
    if v.sparse_count is not None or (v.slot_index is not None and not _nuq(v)):
        return "value exceptions other than NUQ's slots"
    if v.slot_index is not None and v.slot_value.stride() != v.slot_index.stride():
        return "value slots: values must share the channels' layout"
    if _nuq(k) and k.qaxis not in ("channel", "head"):
        return "NUQ keys with per-row normalisers"
    if k.qaxis not in ("channel", "head"):
        reason = _row_groups_unsupported(k, d)
        if reason:
            return f"keys: {reason}"
    if v.qaxis == "head":  # a static scale per head: read per row with a zero row stride
        return "values: per-head zero points" if v.zero_point is not None else None
    reason = _row_groups_unsupported(v, d)
    return f"values: {reason}" if reason else None


def _nuq(p) -> bool:
    """Whether `p` holds 4-bit codebook codes (KVQuant's NUQ4): a table of 16 levels that
    the kernel reads as fp16 bytes (`_lut_planes`)."""
    return p.kind == "lookup" and p.bits == 4 and p.table.numel() == 16


def nuq_table(table: Tensor) -> Tensor:
    """float32 [16 + 32 x 8] of a 4-bit codebook, cached per table: its 16 levels (the
    kernel's gathers, exact), then the bits of the PRMT table (`_LUT_ASM`: the low bytes of
    the fp16 levels 0-3, 4-7, 8-11, 12-15, then their high bytes, one word each) once per
    lane of a warp, so that each lane reads its own copy into regular registers."""

    def build():
        levels = table.float().reshape(16)
        bits = levels.half().view(torch.int16).int() & 0xFFFF  # [16]
        byte = torch.stack([bits & 0xFF, bits >> 8]).view(2, 4, 4)  # [low | high, word, byte]
        words = (byte << torch.tensor([0, 8, 16, 24], device=table.device)).sum(-1)  # [2, 4]
        words = words.reshape(8).to(torch.int64).to(torch.int32)  # wraps to int32 bits
        lanes = words.repeat(32).view(torch.float32)
        return torch.cat([levels, lanes]).contiguous()

    return memoised(_NUQ_TABLES, table, build)


_NUQ_TABLES: Memo = {}


def _flat_starts(count: Tensor) -> Tensor:
    """[B, H, T] int32 first flat entry of each (batch, head, row) (`entry_pointers`, a
    prefix sum over the counts in entry order), computed once per count tensor contents:
    the key is the count view's address, shape, strides and version counter (which every
    write into its buffer moves), and the entry holds the view, so that buffer's address
    cannot be reused while the entry lives. A decode call whose count rows are unchanged
    (the main segment between flushes of the residual window) launches nothing for them;
    one after an append recomputes them (3 small torch ops)."""
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
    if p.kind == "full" or p.qaxis not in ("row", "head"):
        return False
    return p.data.data_ptr() % 4 == 0 and all(s % 4 == 0 for s in p.data.stride()[:3])


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


@functools.cache
def _dummy(device: torch.device) -> Tensor:
    return torch.zeros(1, device=device)


@dataclass(frozen=True)
class PlannedCall:
    """One call's launch, built without launching (the offline compile reads it too)."""

    args: dict  # every kernel parameter by name, constexprs included
    config: KernelConfig
    work: int  # batch x KV heads
    rows: int  # tile-padded rows per work item over all segments
    out_shape: tuple  # [B, H_q, Q, D]
    r_rows: int  # G x Q real query rows per work item

    def with_splits(self, plan: SplitPlan, part: Tensor, out: Tensor) -> dict:
        return {**self.args, "part": part, "out": out, "splits": plan.splits,
                "DIRECT": plan.splits == 1}  # fmt: skip


def planned_call(query: Tensor, segments, *, scaling: float, softcap: float | None,
                 half: bool, mask: Tensor | None = None,
                 rope: tuple[Tensor, Tensor] | None = None) -> PlannedCall:  # fmt: skip
    """The kernel arguments for this call (`planned_unsupported` returned None); `rope`:
    the (cos, sin) tables [P, D/2] of pre-RoPE keys."""
    b, hq, q_len, d = query.shape
    hkv = segments[0].key.data.shape[1]
    group = hq // hkv
    dummy = _dummy(query.device)
    packed = next((s for s in segments if s.key.kind != "full"), None)
    k_rowq, k_ng, k_off, kq = False, 1, dummy, (0, 0, 0)
    if packed is not None:
        kp = 2 if packed.key.bits == 4 else 1
        vp = 2 if packed.value.bits == 4 else 1
        bits = packed.key.bits
        k_fp8, v_fp8 = _fp8(packed.key), _fp8(packed.value)
        k_rowq = packed.key.qaxis == "row"
        if k_rowq:  # per-row group key qparams, applied to the decoded key tile
            k_fold, k_off, kq, k_ng = _row_qparams(packed.key)
            k_off = k_off if k_off is not None else dummy
        else:
            k_fold = _key_fold(packed.key)
        v_scale, v_off, vq, ng = _row_qparams(packed.value)
        v_has_off = v_off is not None
        v_off = v_off if v_has_off else dummy
        k_zero, v_zero = float(packed.key.zero), float(packed.value.zero)
    else:
        kp, vp, bits, ng, v_has_off = 1, 1, 16, 1, False
        k_fold = v_scale = v_off = dummy
        vq, k_zero, v_zero = (0, 0, 0), 0.0, 0.0
        k_fp8 = v_fp8 = (0, 1.0)
    cfg = kernel_config(d, bits, k_rowq, packed is not None and packed.key.pre_rope
                        and _nuq(packed.key))  # fmt: skip
    args = dict(q=query, sq_b=query.stride(0), sq_h=query.stride(1), sq_q=query.stride(2),
                part=dummy, out=dummy)  # fmt: skip
    kinds, padded = [], 0
    for i in range(MAX_SEGMENTS):
        seg = segments[i] if i < len(segments) else None
        if seg is None or not seg.rows:
            kinds.append(0)
            args.update({f"k{i}": dummy, f"v{i}": dummy, f"rows{i}": 0})
            args.update({f"{n}{i}_{s}": 0 for n in "kv" for s in "bht"})
            continue
        kinds.append(1 if seg.key.kind == "full" else 2)
        for n, p in (("k", seg.key), ("v", seg.value)):
            args[f"{n}{i}"] = p.data
            for s, st in zip("bht", p.data.stride()[:3], strict=True):
                args[f"{n}{i}_{s}"] = st
        args[f"rows{i}"] = seg.rows
        padded += -(-seg.rows // cfg.block_t) * cfg.block_t
    total = sum(s.rows for s in segments)
    if mask is not None:  # [B | 1, 1, Q, total] bool, read in place
        args.update(mask=mask, m_b=mask.stride(0) if mask.shape[0] > 1 else 0,
                    m_q=mask.stride(2) if q_len > 1 else 0)  # fmt: skip
    else:
        args.update(mask=dummy, m_b=0, m_q=0)
    args.update(
        k_fold=k_fold, v_scale=v_scale, v_off=v_off, vq_b=vq[0], vq_h=vq[1], vq_t=vq[2],
        k_off=k_off, kq_b=kq[0], kq_h=kq[1], kq_t=kq[2], K_ROWQ=k_rowq, K_NG=k_ng,
        K_HAS_OFF=k_rowq and packed.key.offset is not None,
        HKV=hkv, total=total, splits=1, K_ZERO=k_zero, V_ZERO=v_zero, scaling=float(scaling),
        softcap=float(softcap or 0.0), Q=q_len, G=group, R=max(16, next_pow2(group * q_len)),
        D=d, BLOCK_T=cfg.block_t, KIND0=kinds[0], KIND1=kinds[1], KIND2=kinds[2], KP=kp,
        VP=vp, NG=ng, V_HAS_OFF=v_has_off, K_FP8=k_fp8[0], V_FP8=v_fp8[0],
        K_FACTOR=k_fp8[1] if k_rowq else 1.0, V_FACTOR=v_fp8[1],
        K_WORDS=k_rowq and _words(packed.key), V_WORDS=packed is not None and _words(packed.value),
        HAS_SOFTCAP=bool(softcap), CAUSAL=q_len > 1, HALF=half, DIRECT=False,
        HAS_MASK=mask is not None,
        NUM_STAGES=cfg.num_stages, ASM=ASM and not interpreting() and query.device.type == "cuda",
    )  # fmt: skip
    args.update(_rope_args(segments, rope, kp, half, dummy))
    args.update(_nuq_args(packed, dummy), RQ=next_pow2(group * q_len))
    return PlannedCall(args, cfg, b * hkv, padded, (b, hq, q_len, d), group * q_len)


def _rope_args(segments, rope, planes: int, half: bool, dummy: Tensor) -> dict:
    """Positions per segment and the unit table of pre-RoPE keys (`rope_planes`); dummies
    and ROPE* False where no segment holds any."""
    args = {}
    for i in range(MAX_SEGMENTS):
        seg = segments[i] if i < len(segments) else None
        pre = seg is not None and seg.rows > 0 and seg.key.pre_rope
        pos = seg.positions if pre else dummy
        args.update({f"pos{i}": pos, f"pos{i}_b": pos.stride(0) if pre else 0,
                     f"pos{i}_t": pos.stride(1) if pre else 0, f"ROPE{i}": pre})  # fmt: skip
    if any(args[f"ROPE{i}"] for i in range(MAX_SEGMENTS)):
        dtype = torch.float16 if half else torch.float32
        tab, amp = rope_planes(rope, planes, dtype)
        tab1, amp1 = rope_planes(rope, 1, dtype)  # full-precision keys: channel order
        args.update(rope_tab=tab, rope_amp=amp, rope_rows=tab.shape[0], rope_tab1=tab1,
                    rope_amp1=amp1)  # fmt: skip
    else:
        args.update(rope_tab=dummy, rope_amp=dummy, rope_rows=0, rope_tab1=dummy,
                    rope_amp1=dummy)  # fmt: skip
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


def _nuq_args(packed, dummy: Tensor) -> dict:
    """The kernel's NUQ arguments (K_LUT ... vs_t): codebook tables, the keys' flat
    exceptions (counts, first entries `_flat_starts`, channels, values) and the values'
    slots; dummies where absent."""
    out = dict(K_LUT=0, V_LUT=0, K_FLAT=False, V_SLOTS=0, k_tab=dummy, v_tab=dummy,
               k_cnt=dummy, kc_b=0, kc_h=0, kc_t=0, k_first=dummy, kf_b=0, kf_h=0, kf_t=0,
               k_eidx=dummy, k_eval=dummy, v_sidx=dummy, v_sval=dummy, vs_b=0, vs_h=0,
               vs_t=0)  # fmt: skip
    if packed is None:
        return out
    k, v = packed.key, packed.value
    out.update(K_LUT=_nuq(k), V_LUT=_nuq(v))
    if _nuq(k):
        out["k_tab"] = nuq_table(k.table)
    if _nuq(v):
        out["v_tab"] = nuq_table(v.table)
    if k.sparse_count is not None and k.sparse_index.numel():
        first = _flat_starts(k.sparse_count)
        out.update(K_FLAT=True, k_cnt=k.sparse_count, k_first=first, k_eidx=k.sparse_index,
                   k_eval=k.sparse_value)  # fmt: skip
        out.update(zip(("kc_b", "kc_h", "kc_t"), k.sparse_count.stride(), strict=True))
        out.update(zip(("kf_b", "kf_h", "kf_t"), first.stride(), strict=True))
    if v.slot_index is not None and v.slot_index.shape[-1]:
        out.update(V_SLOTS=v.slot_index.shape[-1], v_sidx=v.slot_index, v_sval=v.slot_value)
        out.update(zip(("vs_b", "vs_h", "vs_t"), v.slot_index.stride()[:3], strict=True))
    return out


def run_planned(query: Tensor, segments, *, scaling: float, softcap: float | None,
                half: bool, mask: Tensor | None = None,
                rope: tuple[Tensor, Tensor] | None = None) -> Tensor:  # fmt: skip
    """[B, H_q, Q, D] float32: one decode launch (and one reduction when it splits)."""
    from kvq.runtime.kernels import _decode_splits_triton as kern

    call = planned_call(query, segments, scaling=scaling, softcap=softcap, half=half, mask=mask,
                        rope=rope)  # fmt: skip
    launcher = _launcher(query.device)
    plan = launcher.plan(call)
    out = torch.empty(call.out_shape, device=query.device)
    if plan.splits == 1:
        launcher.launch(kern.decode_splits_kernel, (call.work, 1), call.with_splits(plan, out, out),
                        call.config.options())  # fmt: skip
        return out
    r_pad, d = call.args["R"], call.args["D"]
    part = torch.empty((call.work, plan.splits, r_pad, d + 2), device=query.device)
    launcher.launch(kern.decode_splits_kernel, (call.work, plan.splits),
                    call.with_splits(plan, part, out), call.config.options())  # fmt: skip
    combine = dict(part=part, out=out, S=plan.splits, R=r_pad, D=d, GQ=call.r_rows,
                   BLOCK_S=16, BLOCK_D=next_pow2(d))  # fmt: skip
    launcher.launch(kern.combine_splits_kernel, (call.work, call.r_rows), combine, {})
    return out


class _Launcher:
    """Launches by keyword (a dict of every parameter): under the interpreter through
    `kernel[grid]`; on CUDA through the compiled kernel of the arguments'
    specialisation, cached, so a call binds no arguments in Python beyond its key."""

    def __init__(self, device: torch.device):
        self.device = device
        self.compiled: dict = {}
        if device.type == "cuda":
            props = torch.cuda.get_device_properties(device)
            self.sms = props.multi_processor_count
        else:
            self.sms = INTERPRETER_SMS

    def plan(self, call: PlannedCall) -> SplitPlan:
        from kvq.runtime.kernels import _decode_splits_triton as kern

        per_sm = INTERPRETER_PROGRAMS_PER_SM
        min_rows = call.config.block_t
        if self.device.type == "cuda":
            compiled = self._compiled(kern.decode_splits_kernel, call.args, call.config.options())
            per_sm = resident_programs(compiled)
            min_rows = None
        kw = {} if min_rows is None else {"min_rows": min_rows}
        return plan_splits(call.work, call.rows, sms=self.sms, programs_per_sm=per_sm,
                           block_t=call.config.block_t, **kw)  # fmt: skip

    def launch(self, fn, grid, args: dict, options: dict) -> None:
        if self.device.type != "cuda" or interpreting():
            fn[grid](**args, **options)
            return
        compiled = self._compiled(fn, args, options)
        compiled[(*grid, 1)](*[args[p.name] for p in fn.params])

    def _compiled(self, fn, args: dict, options: dict):
        key = (_spec_key(fn, args), *options.values())
        hit = self.compiled.get(key)
        if hit is None:
            hit = fn.warmup(**args, **options, grid=(1,))
            self.compiled[key] = hit
        return hit


@functools.cache
def _params(fn) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(constexpr names, names Triton specialises at run time) of a kernel: the row counts
    (`do_not_specialize`) change every step and are left out."""
    consts = tuple(p.name for p in fn.params if p.is_constexpr)
    runtime = tuple(p.name for p in fn.params if not p.is_constexpr and not p.do_not_specialize)
    return consts, runtime


def _spec_key(fn, args: dict) -> tuple:
    """What Triton specialises a launch on: the constexpr values; per tensor its dtype and
    16-byte alignment; per integer == 1, divisibility by 16 and width (finer is harmless).
    One pass over plain values: this runs on every launch."""
    consts, runtime = _params(fn)
    spec = []
    for name in runtime:
        v = args[name]
        if isinstance(v, Tensor):
            spec.append((v.dtype, v.data_ptr() & 15 == 0))
        elif type(v) is int:
            spec.append((v == 1, v & 15 == 0, v >> 31))
        else:
            spec.append(type(v))
    return (fn, tuple(args[n] for n in consts), tuple(spec))


def resident_programs(compiled) -> int:
    """Programs of a compiled kernel resident per SM (registers, shared memory, warps)."""
    from kvq.runtime.kernels.offline import KernelResources

    res = KernelResources(compiled.metadata.num_warps, compiled.n_regs, 0,
                          compiled.metadata.shared, None)  # fmt: skip
    return max(1, res.programs_per_sm)


@functools.cache
def _launcher(device: torch.device) -> _Launcher:
    return _Launcher(device)
