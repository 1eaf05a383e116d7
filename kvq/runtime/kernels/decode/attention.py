"""Decode attention straight from packed K/V (article 0x03, 0x06C, 0x09D).

The cached rows of one layer arrive as `Segment`s — e.g. the full-precision
sink rows, then the quantized rows — and ALL of them share one softmax. Both
backends have the same signature:

* `decode_attention_reference`: pure torch. Decodes a chunk of rows at a time
  (`ChunkDecoder`: the affine map of the shared `decode_packed`, in bit planes;
  pre-RoPE keys, affine or static lookup (NUQ, FP8), with RoPE pairs side by
  side, rotated by one complex multiply)
  and folds it into an online softmax, so the cache is never materialised in
  fp32.
* `decode_attention_triton`: flash-decoding. Programs split each segment's rows
  (grid: batch x KV head x split); each program unpacks codes in registers
  (any of 2/3/4/8 bits), looks up codebooks (scalar levels, or the coordinates of
  vector codebooks over channel groups), applies scale / zero-point /
  offset, replaces exceptions (value slots, variable-length key entries),
  rotates pre-RoPE keys at their own positions, and keeps a running max,
  denominator and accumulator. A reduction then merges the partial states of
  all splits of all segments with the log-sum-exp rule: one softmax, never a
  sum of two.

Queries are post-RoPE `[B, H_q, Q, D]`; the G = H_q / H_kv query heads sharing
a KV head (GQA/MQA) and the Q query positions are processed together, up to
`MAX_QUERY_ROWS` rows G x Q per program; a longer block (prefill) runs through
the kernels in chunks of query positions (`query_chunk`). The mask
columns are the visible rows in segment order (transformers' own mask, so
sliding windows and padding come from one place); without a mask, the Q
queries are the last Q rows (causal, bottom-right aligned).
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch
from torch import Tensor

from kvq.errors import KvqError
from kvq.runtime.kernels.backend import ENV, next_pow2, resolve_backend
from kvq.runtime.kernels.decode.reference import decode_attention_reference
from kvq.runtime.kernels.decode.segments import Rope, Segment, causal_mask, check_inputs
from kvq.runtime.packed import (
    PackedRows,
    entry_pointers,
)
from kvq.tensor_memo import Memo, memoised

# --- triton -------------------------------------------------------------------------------

_KIND = {"full": 0, "affine": 1, "lookup": 2, "vector": 3, "trellis": 4}
_QAXIS = {"none": 0, "row": 1, "channel": 2, "head": 3}
# tensor cores: tf32 products (10-bit mantissa, like fp16) with fp32 accumulation; exact
# fp32 ("ieee") would make a decode kernel compute-bound on CUDA cores. Parity tests on
# CUDA set KVQ_TRITON_DOT=ieee to compare against the fp32 reference tightly. "fp16" casts
# the decoded tiles, queries and probabilities to fp16 before each dot (fp32 accumulation):
# the same mantissa as tf32 at half the registers; bench/gpu_decode.py times both.
DOT_PRECISION = os.environ.get("KVQ_TRITON_DOT", "tf32")
DOT_MODES = ("tf32", "ieee", "fp16")
MAX_QUERY_ROWS = 64  # G * Q rows per program; longer query blocks (prefill) run in chunks
# the planned path (`planned_decode`: one launch, fp16 dots unless KVQ_TRITON_DOT=ieee) for
# the layouts it takes; KVQ_DECODE_PLANNED=0 sends every call to the general kernel
PLANNED = os.environ.get("KVQ_DECODE_PLANNED", "1") != "0"


def triton_unsupported(query: Tensor, segments: list[Segment], mask: Tensor | None) -> str | None:
    """Why the Triton kernel cannot take this call (None when it can)."""
    b, hq, q_len, d = query.shape
    hkv = segments[0].key.data.shape[1]
    if hq % hkv:
        return "query heads are not a multiple of KV heads"
    if hq // hkv > MAX_QUERY_ROWS:  # not even one query position per chunk
        return f"{hq // hkv} query heads per KV head exceed {MAX_QUERY_ROWS}"
    if d % 2 or d > 512:
        return f"head_dim {d} unsupported"
    if mask is not None and (mask.dim() != 4 or mask.shape[1] != 1):
        return "per-head masks are unsupported"
    for seg in segments:
        for p in (seg.key, seg.value):
            if p.kind != "full" and p.data.stride(-1) != 1:
                return "packed rows must be contiguous along the last dimension"
            if p.kind == "lookup" and p.scale.dim() == 4 and p.scale.shape[-1] > 1:
                return (
                    "per-block lookup scales (NVFP4, SGLang fp4_e2m1, llama.cpp iq4_nl) decode on the "
                    "reference only"
                )
            if p.rotation is not None:
                return "rotated rows (vLLM int4_per_token_head) decode on the reference only"
            if p.kind != "full" and p.bits == 5:
                return "5-bit codes (llama.cpp q5_0 / q5_1) decode on the reference only"
    return None


def decode_attention_triton(
    query: Tensor,
    segments: list[Segment],
    *,
    scaling: float,
    rope: Rope | None = None,
    mask: Tensor | None = None,
    softcap: float | None = None,
    chunk_rows: int | None = None,
    path: DecodePath | None = None,
) -> Tensor:
    """Same contract as `decode_attention_reference`; `chunk_rows` is unused here. `path`:
    the Triton kernel `decode_path` chose for this call (its checks are not run again). A
    block of more query rows per KV head than a program holds (prefill) runs in chunks of
    query positions, `path.chunks` kernel calls of `path.chunk` positions."""
    total = check_inputs(query, segments, rope, mask)
    if path is None:
        reason = triton_unsupported(query, segments, mask)
        if reason:
            raise KvqError(f"triton decode attention: {reason}")
        path = triton_path(query, segments, mask)
    args = (segments, path.kernel, scaling, rope, softcap, total)
    if path.chunks == 1:
        return _triton_call(query, mask, *args)
    q_len = query.shape[2]
    rows = _block_mask(mask, q_len, total, query.device)  # [B|1, 1, Q|1, K]
    out = torch.empty(query.shape, device=query.device)  # [B, H_q, Q, D] fp32
    for start in range(0, q_len, path.chunk):
        stop = min(start + path.chunk, q_len)
        out[:, :, start:stop] = _triton_call(
            query[:, :, start:stop], _mask_rows(rows, start, stop), *args
        )
    return out


def _block_mask(mask: Tensor | None, q_len: int, total: int, device) -> Tensor:
    """The mask of a block that runs in chunks: the given one, or else its causal mask. A
    chunk's queries are not the last rows of the cache (what the kernels assume without a
    mask), so each chunk needs its rows of the causal mask: those see the cache up to the
    chunk's own positions, whatever the segments (sink, packed, full-precision rows) hold."""
    return mask if mask is not None else causal_mask(q_len, total, device)


def _mask_rows(mask: Tensor, start: int, stop: int) -> Tensor:
    """The rows of query positions [start, stop) of a [B|1, 1, Q|1, K] mask (views)."""
    return mask if mask.shape[2] == 1 else mask[:, :, start:stop]


def _triton_call(query, mask, segments, kernel, scaling, rope, softcap, total) -> Tensor:
    """One call of the planned or general kernel over a block that fits it."""
    if kernel == "planned":
        from kvq.runtime.kernels.decode import planned as planned_decode

        half = _dot_mode(query.device) != "ieee"
        return planned_decode.run_planned(
            query, segments, scaling=scaling, softcap=softcap, half=half, mask=mask, rope=rope
        )
    b, hq, q_len, d = query.shape
    hkv = segments[0].key.data.shape[1]
    group = hq // hkv
    kernel, launch = _launcher(query.device, d)
    calls, (m, den, acc) = kernel_calls(
        query, segments, scaling=scaling, rope=rope, mask=mask, softcap=softcap,
        dots=_dot_mode(query.device), total=total,
    )  # fmt: skip
    for grid, args, consts in calls:
        kernel[grid](*args, **consts, **launch)
    out = combine_partials_triton(m, den, acc)  # [B, H_kv, R, D]
    out = out[:, :, : group * q_len].reshape(b, hkv, group, q_len, d)
    return out.reshape(b, hq, q_len, d)


def kernel_calls(
    query: Tensor,
    segments: list[Segment],
    *,
    scaling: float,
    rope: Rope | None = None,
    mask: Tensor | None = None,
    softcap: float | None = None,
    dots: str = "tf32",
    total: int | None = None,
) -> tuple[list[tuple[tuple[int, int], tuple, dict]], tuple[Tensor, Tensor, Tensor]]:
    """The decode kernel's launches for this call, without launching: ([(grid, positional
    args, constexprs) per non-empty segment], the partials (max, denominator, numerator)
    they write). `decode_attention_triton` launches them; `kernels.offline` compiles them
    for a GPU that this machine does not have. dots: a `DOT_MODES` entry."""
    if dots not in DOT_MODES:
        raise KvqError(f"dots must be one of {', '.join(DOT_MODES)}, got {dots!r}")
    if total is None:
        total = check_inputs(query, segments, rope, mask)
    b, hq, q_len, d = query.shape
    hkv = segments[0].key.data.shape[1]
    group = hq // hkv
    rows_pad = max(16, next_pow2(group * q_len))
    q = query.float().contiguous()
    mask_u8 = None
    if mask is not None:
        mask_u8 = mask.expand(b, 1, q_len, total)[:, 0].to(torch.uint8).contiguous()  # [B, Q, K]
    plans, col = [], 0  # (segment, its first mask column, splits, rows per split)
    for seg in segments:
        if seg.rows:
            plans.append((seg, col, *_split_plan(seg.rows, b * hkv, q.device)))
        col += seg.rows
    # every segment's splits write into one set of partials: one reduction, no concatenation
    splits = sum(p[2] for p in plans)
    m = torch.empty((b, hkv, splits, rows_pad), device=q.device)
    den = torch.empty_like(m)
    acc = torch.empty((b, hkv, splits, rows_pad, d), device=q.device)
    calls, first = [], 0
    for seg, col, n, rows_per_split in plans:
        partials = (m, den, acc, first, n, rows_per_split)
        calls.append(
            _segment_call(
                q, seg, rope, mask_u8, col, total, scaling, softcap, partials, group, dots
            )
        )
        first += n
    return calls, (m, den, acc)


def combine_partials_reference(m: Tensor, denom: Tensor, acc: Tensor) -> Tensor:
    """The reduction pass: merge per-split (max, denominator, numerator) into one softmax.

    m, denom: [B, H, S, R] (max in log2 units); acc: [B, H, S, R, D] -> [B, H, R, D].
    """
    top = m.amax(dim=2, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    w = torch.exp2(m - top)  # a split that saw no keys has m = -inf -> weight 0
    num = (acc * w[..., None]).sum(dim=2)
    den = (denom * w).sum(dim=2)
    return num / den.clamp_min(torch.finfo(torch.float32).tiny)[..., None]


def combine_partials_triton(m: Tensor, denom: Tensor, acc: Tensor) -> Tensor:
    """Same contract as `combine_partials_reference`, in one launch (about a dozen torch
    calls otherwise, each a kernel launch on CUDA: at short contexts the launches cost
    more than the attention itself)."""
    from kvq.runtime.kernels.decode import _attention_triton as kern

    b, h, s, r = m.shape
    d = acc.shape[-1]
    m, denom, acc = (t.float().contiguous() for t in (m, denom, acc))
    out = torch.empty((b, h, r, d), device=m.device)
    block_r = min(16, next_pow2(r))
    grid = (b * h, -(-r // block_r))
    kern.combine_partials_kernel[grid](
        m, denom, acc, out, s, R=r, D=d, BLOCK_S=16, BLOCK_R=block_r,
        BLOCK_D=next_pow2(d),
    )  # fmt: skip
    return out


# split boundaries fall on multiples of the largest row tile the autotuner may pick
ROW_ALIGN = 128
# CUDA programs to aim for per SM: a decode step is latency-bound (dependent loads of
# codes, qparams and tables), so several resident programs per SM hide that latency
WAVES = 4


def _splits(rows: int, programs: int, device: torch.device) -> int:
    """How many programs share one segment's rows: enough to fill the GPU, >= 1 tile each."""
    tiles = max(1, math.ceil(rows / ROW_ALIGN))
    if device.type != "cuda":
        return min(tiles, 4)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(tiles, math.ceil(WAVES * sms / max(1, programs))))


def _split_plan(rows: int, programs: int, device: torch.device) -> tuple[int, int]:
    """(splits, rows per split) of one segment; splits start on ROW_ALIGN boundaries."""
    splits = _splits(rows, programs, device)
    rows_per_split = math.ceil(math.ceil(rows / splits) / ROW_ALIGN) * ROW_ALIGN
    return math.ceil(rows / rows_per_split), rows_per_split


def _dot_mode(device: torch.device) -> str:
    """`DOT_PRECISION` on CUDA (read at each call, so a benchmark can switch it); exact fp32
    dots under the CPU interpreter, where the parity tests compare against the reference."""
    if DOT_PRECISION not in DOT_MODES:
        raise KvqError(
            f"KVQ_TRITON_DOT must be one of {', '.join(DOT_MODES)}, got {DOT_PRECISION!r}"
        )
    return DOT_PRECISION if device.type == "cuda" else "ieee"


@functools.cache
def _dummy(device: torch.device) -> Tensor:
    """A one-element tensor standing in for absent optional inputs (never read)."""
    return torch.zeros(1, device=device)


def autotune_configs():
    """Launch configurations the tuner times: row tile x warps x (stages, prefetch)
    (`_fits` then drops row tiles too large for the head_dim at hand, and prefetching
    where no codes are word-loaded)."""
    import triton

    # num_stages 2 lets Triton's pipeliner load the next tile while this one is decoded and
    # multiplied, where it recognises the loads (not 4-bit codes, which reach the dots
    # through an unpack); PREFETCH does that by hand for word-loaded codes, for registers
    # that depend on the layout (0 to 60 more per thread). Row tiles of 16 hold the fewest
    # registers per thread, and so do 16 warps at head_dim 256: the configurations that
    # keep 16 or more warps resident per SM without spilling for codebook (NUQ) and
    # pre-RoPE layouts (bench/kernel_resources.py, bench/results/static)
    return [
        triton.Config({"BLOCK_T": t, "PREFETCH": prefetch}, num_warps=w, num_stages=stages)
        for t in (16, 32, 64, 128)
        for w in (4, 8, 16)
        for stages, prefetch in ((1, False), (2, False), (1, True))
    ]


# what changes the best launch: shapes, formats, and what decides whether the key qparams
# fold into the query (axis, offset) or stay in the loop, which moves registers by ~40
AUTOTUNE_KEY = ["D", "R", "PRE_ROPE", "K_KIND", "K_BITS", "K_FLAT", "K_QAXIS", "K_HAS_OFF"]
AUTOTUNE_KEY += ["V_KIND", "V_BITS", "V_SLOTS", "V_QAXIS", "HALF_DOTS", "K_WORDS", "V_WORDS"]
AUTOTUNE_KEY += ["K_VDIM", "V_VDIM", "K_SHARED"]
# and the shape bucket of the launch (`tune_bucket`): the best row tile and warps for a
# few programs over long rows differ from those of many short ones, so a configuration
# timed on a small problem (a parity check, batch 1) is not reused at batch 16 x 32K
AUTOTUNE_KEY += ["tune_bucket"]


def tune_bucket(programs: int, rows_per_program: int) -> int:
    """Power-of-two buckets of (programs, rows per program) as one integer."""
    return programs.bit_length() * 64 + rows_per_program.bit_length()


def tuned_kernel(do_bench=None):
    """The kernel under `triton.autotune` over `autotune_configs`, per head_dim, query rows
    and formats (the best launch differs between a 4-bit lookup and an 8-bit affine family).
    `do_bench` replaces Triton's CUDA-event timer (tests run it under the interpreter)."""
    import triton

    from kvq.runtime.kernels.decode import _attention_triton as kern

    return triton.autotune(
        autotune_configs(),
        key=AUTOTUNE_KEY,
        prune_configs_by={"early_config_prune": _fits},
        do_bench=do_bench,
    )(kern.decode_attention_kernel)


def _fits(configs, named_args, **kwargs):
    """Drop row tiles whose [BLOCK_T, BLOCK_D] fp32 value tile exceeds 64 x 128: those
    spill registers or leave too few warps resident to be worth timing; 16 warps only
    for head_dim 256, where a thread's share of a tile is otherwise largest; PREFETCH only
    where some codes are word-loaded (what each kept configuration costs:
    bench/kernel_resources.py)."""
    d = kwargs["BLOCK_D"]
    # where codes load as words, PREFETCH takes the place of num_stages 2 (both aim at the
    # same load latency; the tuner's time, a compile per configuration, stays the same)
    words = bool(kwargs.get("K_WORDS") or kwargs.get("V_WORDS"))
    # vector codebooks on both sides: every code is a gather, which the pipeliner leaves
    # alone, so num_stages 2 compiles to the same binary as 1 (bench/kernel_resources.py)
    gathers = kwargs.get("K_KIND") == kwargs.get("V_KIND") == _KIND["vector"]
    kept = [
        c
        for c in configs
        if c.kwargs["BLOCK_T"] * d <= 64 * 128
        and (c.num_warps < 16 or d >= 256)
        and (c.num_stages == 1 if words or gathers else not c.kwargs["PREFETCH"])
        and not (gathers and c.kwargs["PREFETCH"])
    ]
    return kept or configs[:1]


@functools.cache
def cuda_kernel():
    """The autotuned kernel CUDA launches use, built once (it keeps the tuner's choices)."""
    return tuned_kernel()


def _launcher(device: torch.device, head_dim: int):
    """(kernel, launch options): autotuned on CUDA (the tuner picks BLOCK_T and warps); one
    fixed config elsewhere (the interpreter, where timing means nothing)."""
    if device.type == "cuda":
        return cuda_kernel(), {}
    from kvq.runtime.kernels.decode import _attention_triton as kern

    return kern.decode_attention_kernel, {"BLOCK_T": 32 if head_dim > 128 else 64, "num_stages": 1}


def _family_args(p: PackedRows, dummy: Tensor, chunk: int):
    """Pointers, strides and constexprs describing one PackedRows for the kernel, which
    decodes `chunk` channels of a row at a time (half a key, for rotation; a whole value)."""
    qaxis = p.qaxis
    scale = p.scale if p.scale is not None else dummy
    if qaxis == "row":
        q_strides = scale.stride()[:3]
        group = p.head_dim // scale.shape[-1]
    elif qaxis == "channel":
        q_strides = (0, scale.stride(0), 0)
        group = 1
    else:
        q_strides = (0, scale.stride(0) if scale.dim() else 0, 0)
        group = 1
    for name in ("offset", "zero_point"):
        t = getattr(p, name)
        if t is not None and t.stride() != scale.stride():
            raise KvqError(f"{name} must share the scale's layout")
    slots = p.slot_index
    if p.sparse_count is not None:
        count = p.sparse_count
        ptr = entry_pointers(count)
        c_strides = count.stride()
        p_strides = ptr.stride()
        e_idx, e_val = p.sparse_index, p.sparse_value
        if e_idx.numel() == 0:
            e_idx, e_val = dummy, dummy
    else:
        count = ptr = e_idx = e_val = dummy
        c_strides = p_strides = (0, 0, 0)
    tensors = (
        p.data,
        scale,
        p.offset if p.offset is not None else dummy,
        p.zero_point if p.zero_point is not None else dummy,
        p.table.float().contiguous() if p.table is not None else dummy,
        vector_layout(p.groups)[0] if p.groups is not None else dummy,
        slots if slots is not None else dummy,
        p.slot_value if slots is not None else dummy,
        count,
        ptr,
        e_idx,
        e_val,
    )
    strides = (
        *p.data.stride()[:3],
        *q_strides,
        *(slots.stride()[:3] if slots is not None else (0, 0, 0)),
        *c_strides[:3],
        *p_strides[:3],
    )
    consts = dict(
        KIND=_KIND[p.kind],
        BITS=p.bits if p.kind != "full" else 16,
        QAXIS=_QAXIS[qaxis],
        GROUP=group,
        HAS_OFF=p.offset is not None,
        HAS_ZP=p.zero_point is not None,
        SLOTS=0 if slots is None else slots.shape[-1],
        FLAT=p.sparse_count is not None and p.sparse_index.numel() > 0,
        WORDS=_word_loadable(p, chunk),
        # channels per codebook vector, or a trellis state's digits
        VDIM=p.window // p.bits if p.kind == "trellis" else p.vector_dim,
    )
    return tensors, strides, consts


# vector groups -> (lanes, shared halves), kept while the groups tensor lives (a codec's
# static state)
_VECTOR_LAYOUTS: Memo = {}


def vector_layout(groups: Tensor) -> tuple[Tensor, bool]:
    """groups [D / m, m] -> ([D] int32 lanes: channel groups[g, i] -> g * m + i, the inverse
    of the flattened groups, for `_vector_levels`; whether channels c and c + D/2 always
    share a group, as RoPE-pair groups do: then a key tile reads each group index once
    for both of its halves)."""

    def build():
        lanes = torch.argsort(groups.reshape(-1)).to(torch.int32)
        half, m = lanes.numel() // 2, groups.shape[1]
        shared = lanes.numel() % 2 == 0 and bool(torch.equal(lanes[:half] // m, lanes[half:] // m))
        return lanes, shared

    return memoised(_VECTOR_LAYOUTS, groups, build)


def _word_loadable(p: PackedRows, chunk: int) -> bool:
    """Whether the kernel can load `p`'s codes as 32-bit words (`_code_words`): 4- or
    8-bit codes, whole words per chunk of channels, rows on 4-byte boundaries."""
    if p.kind in ("full", "vector", "trellis") or p.bits not in (4, 8) or chunk % (32 // p.bits):
        return False
    data = p.data
    return (
        data.stride(-1) == 1
        and data.data_ptr() % 4 == 0
        and all(s % 4 == 0 for s in data.stride()[:3])
    )


def _segment_call(q, seg, rope, mask_u8, col, total, scaling, softcap, partials, group, dots):
    """(grid, args, constexprs) of the kernel over one segment; it writes its splits'
    partial states at split `first` ... of partials = (m, den, acc, first, splits, rows
    per split)."""
    b, hq, q_len, d = q.shape
    hkv = seg.key.data.shape[1]
    m, den, acc, first, splits, rows_per_split = partials
    dummy = _dummy(q.device)
    k_t, k_s, k_c = _family_args(seg.key, dummy, d // 2)
    v_t, v_s, v_c = _family_args(seg.value, dummy, d)
    pre_rope = seg.key.pre_rope
    if pre_rope:
        cos, sin = (t.float().contiguous() for t in rope)
        pos = seg.positions.to(torch.int64)
        pos_stride = pos.stride(0)
    else:
        cos = sin = pos = dummy
        pos_stride = 0
    msk = mask_u8 if mask_u8 is not None else dummy
    m_strides = mask_u8.stride()[:2] if mask_u8 is not None else (0, 0)
    args = (
        q,
        *q.stride()[:3],
        *k_t,
        *k_s,
        *v_t,
        *v_s,
        pos,
        pos_stride,
        cos,
        sin,
        msk,
        *m_strides,
        m,
        den,
        acc,
        seg.rows,
        hkv,
        col,
        total,
        rows_per_split,
        first,
        m.shape[2],
        float(seg.key.zero),
        float(seg.value.zero),
        float(scaling),
        float(softcap or 0.0),
        tune_bucket(b * hkv * splits, rows_per_split),
    )
    consts = dict(
        Q=q_len,
        G=group,
        R=m.shape[3],
        D=d,
        BLOCK_D=next_pow2(d),
        BLOCK_HALF=next_pow2(d // 2),
        PRE_ROPE=pre_rope,
        HAS_MASK=mask_u8 is not None,
        DOT_PRECISION="ieee" if dots == "fp16" else dots,
        HALF_DOTS=dots == "fp16",
        **{f"K_{k}": v for k, v in k_c.items()},
        **{f"V_{k}": v for k, v in v_c.items()},
        K_SHARED=seg.key.kind == "vector" and vector_layout(seg.key.groups)[1],
    )
    return (b * hkv, splits), args, consts


# --- dispatch -----------------------------------------------------------------------------


def decode_attention(
    query: Tensor,
    segments: list[Segment],
    *,
    scaling: float,
    rope: Rope | None = None,
    mask: Tensor | None = None,
    softcap: float | None = None,
    backend: str | None = None,
    lengths: tuple[Tensor, tuple[int, ...]] | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """Attention of `query` over packed segments on the chosen backend (see module doc).
    sinks: learned sink logits [H_q] (GPT-OSS); only the reference takes them so far.

    With backend auto, calls the kernel cannot take (per-head masks) and long query blocks
    (prefill, see `decode_path`) run on the reference; an explicit "triton" refuses the
    former and runs the latter through the kernels in chunks of query positions.
    lengths: for segments that are a cache's buffers (their rows: its capacity), the
    segments' row counts on the device (int32 [3]) and on the host. The planned kernel
    reads the device counts (`planned_decode.run_planned`), so that the call replays in a
    CUDA graph; any other path runs on the segments cut to the host counts.
    """
    check_inputs(query, segments, rope, mask)
    if sinks is not None:
        if backend == "triton":
            raise KvqError("triton decode attention: learned attention sinks (reference only)")
        if lengths is not None:
            segments = [_cut(s, n) for s, n in zip(segments, lengths[1], strict=True)]
        return decode_attention_reference(
            query, segments, scaling=scaling, rope=rope, mask=mask, softcap=softcap, sinks=sinks
        )
    if lengths is not None:
        out = _counted_attention(query, segments, scaling, rope, mask, softcap, backend, lengths)
        if out is not None:
            return out
        segments = [_cut(s, n) for s, n in zip(segments, lengths[1], strict=True)]
    path = decode_path(query, segments, mask, backend=backend)
    if path.kernel != "reference":  # routing checks once per call: passed on
        return decode_attention_triton(
            query, segments, scaling=scaling, rope=rope, mask=mask, softcap=softcap, path=path
        )
    return decode_attention_reference(
        query, segments, scaling=scaling, rope=rope, mask=mask, softcap=softcap
    )


def _counted_attention(query, segments, scaling, rope, mask, softcap, backend, lengths):
    """The planned kernel over buffers with device row counts (`decode_attention`'s
    `lengths`), or None where that path does not take the call."""
    path = decode_path(query, segments, mask, backend=backend)
    if path.kernel != "planned" or path.chunks > 1:  # chunks: on the host counts (`_cut`)
        return None
    from kvq.runtime.kernels.decode import planned as planned_decode

    half = _dot_mode(query.device) != "ieee"
    return planned_decode.run_planned(
        query, segments, scaling=scaling, softcap=softcap, half=half, mask=mask, rope=rope,
        lengths=lengths[0],
    )  # fmt: skip


def _cut(seg: Segment, rows: int) -> Segment:
    """`seg`'s first `rows` rows (views)."""
    positions = None if seg.positions is None else seg.positions[:, :rows]
    return Segment(seg.key.narrow(0, rows), seg.value.narrow(0, rows), positions)


@dataclass(frozen=True)
class DecodePath:
    """Which implementation takes a decode call, and why not a faster one."""

    kernel: str  # "planned" (one launch, `planned_decode`), "general" (Triton) or "reference"
    reason: str | None = None  # why not the planned kernel; None when it takes the call
    chunks: int = 1  # kernel calls over consecutive query positions (a long block: prefill)
    chunk: int | None = None  # query positions per call when chunks > 1

    def describe(self) -> str:
        """What runs, in words: e.g. "triton planned kernel, 3 chunks of 16 query positions"."""
        what = "reference" if self.kernel == "reference" else f"triton {self.kernel} kernel"
        if self.chunks > 1:
            what += f", {self.chunks} chunks of {self.chunk} query positions"
        return what + (f" ({self.reason})" if self.reason else "")


def decode_path(
    query: Tensor,
    segments: list[Segment],
    mask: Tensor | None = None,
    *,
    backend: str | None = None,
    device: torch.device | str | None = None,
) -> DecodePath:
    """The path `decode_attention` sends this call down: the backend (`resolve_backend`)
    on `device` (default the query's; a CPU test may ask what CUDA would do), then the
    planned kernel where it takes the layout, else the general kernel, else (auto backend,
    calls no kernel takes: per-head masks) the reference. An explicit "triton" refuses
    what no kernel takes, and runs a long query block (prefill) in chunks of query
    positions (`triton_path`); the auto backend keeps such blocks on the reference."""
    device = query.device if device is None else torch.device(device)
    requested = backend or os.environ.get(ENV) or "auto"
    if resolve_backend(requested, device) == "reference":
        return DecodePath("reference", f"backend {requested} on {device.type}")
    reason = triton_unsupported(query, segments, mask)
    if reason:
        if requested == "triton":
            raise KvqError(f"triton decode attention: {reason}")
        return DecodePath("reference", reason)
    if requested != "triton" and query_chunk(query, segments) < query.shape[2]:
        # Why auto keeps prefill on the reference: it decodes each cached row once for all
        # query rows and multiplies with batched GEMMs, while the chunks decode every row
        # again per chunk (no tile is skipped as masked): Q x G / 64 passes over the cache,
        # 32 for a 512-token Gemma 3 prompt. Not measured on a GPU yet, so auto keeps the
        # route that every prefill figure so far was measured on.
        rows = query.shape[1] // segments[0].key.data.shape[1] * query.shape[2]
        why = f"{rows} query rows per KV head exceed {MAX_QUERY_ROWS}; triton runs them in chunks"
        return DecodePath("reference", why)
    return triton_path(query, segments, mask)


def query_chunk(query: Tensor, segments: list[Segment]) -> int:
    """Query positions per kernel call: all Q when the G x Q rows per KV head fit one
    program (`MAX_QUERY_ROWS`), else the most that do."""
    group = query.shape[1] // segments[0].key.data.shape[1]
    return max(1, min(query.shape[2], MAX_QUERY_ROWS // group))


def triton_path(query: Tensor, segments: list[Segment], mask: Tensor | None) -> DecodePath:
    """Planned or general kernel, for a call the Triton backend takes. A block longer than
    one program's query rows runs in chunks (`query_chunk`), routed as its first chunk with
    that chunk's mask rows: the others differ only in holding fewer positions, which
    neither kernel refuses."""
    q_len = query.shape[2]
    chunk = query_chunk(query, segments)
    chunks = {}
    if chunk < q_len:
        chunks = {"chunks": math.ceil(q_len / chunk), "chunk": chunk}
        total = sum(s.rows for s in segments)
        mask = _mask_rows(_block_mask(mask, q_len, total, query.device), 0, chunk)
        query = query[:, :, :chunk]
    if not PLANNED:
        return DecodePath("general", "KVQ_DECODE_PLANNED=0", **chunks)
    from kvq.runtime.kernels.decode.planned_layouts import planned_unsupported

    reason = planned_unsupported(query, segments, mask)
    return DecodePath("general", reason, **chunks) if reason else DecodePath("planned", **chunks)
