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
from kvq.runtime.packed import (
    ChunkDecoder,
    PackedRows,
    decode_packed,
    entry_pointers,
    layout_perm,
)
from kvq.tensor_memo import Memo, memoised

Rope = tuple[Tensor, Tensor]  # cos, sin tables [P, D/2] float32, indexed by RoPE position


@dataclass(frozen=True)
class Segment:
    key: PackedRows
    value: PackedRows
    positions: Tensor | None = None  # [B, T] RoPE position of each row (pre-RoPE keys)

    @property
    def rows(self) -> int:
        return self.key.rows


def rotate(x: Tensor, positions: Tensor, rope: Rope) -> Tensor:
    """Rotate-half RoPE of x [B, H, T, D] at positions [B, T] with half-width tables."""
    cos, sin = (_rows_at(t, positions)[:, None] for t in rope)  # [B, 1, T, D/2]
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    out = torch.empty_like(x)
    o1, o2 = out[..., :half], out[..., half:]
    torch.mul(x1, cos, out=o1).addcmul_(x2, sin, value=-1)  # no temporaries
    torch.mul(x2, cos, out=o2).addcmul_(x1, sin)
    return out


def _rows_at(table: Tensor, positions: Tensor) -> Tensor:
    """table[positions] ([B, T, ...]); a view when every batch row is one contiguous run."""
    first = _run_start(positions, table.shape[0])
    if first is None:
        return table[positions]
    t = positions.shape[1]
    return table[first : first + t].expand(positions.shape[0], t, *table.shape[1:])


def _run_start(positions: Tensor, limit: int) -> int | None:
    """First position when every batch row of positions [B, T] is the run first, first + 1,
    ... below `limit`; else None."""
    first = int(positions[0, 0])
    t = positions.shape[1]
    run = torch.arange(first, first + t, device=positions.device)
    return first if first + t <= limit and bool((positions == run).all()) else None


def _check(query: Tensor, segments: list[Segment], rope: Rope | None, mask: Tensor | None) -> int:
    if query.dim() != 4:
        raise KvqError(f"query must be [B, H_q, Q, D], got {tuple(query.shape)}")
    if not segments:
        raise KvqError("attention over no segments")
    total = sum(s.rows for s in segments)
    for s in segments:
        if s.key.pre_rope and (rope is None or s.positions is None):
            raise KvqError("pre-RoPE keys need RoPE tables and row positions")
    if mask is not None and mask.shape[-1] != total:
        raise KvqError(f"mask covers {mask.shape[-1]} keys, the segments hold {total}")
    return total


# --- reference ----------------------------------------------------------------------------

CHUNK_ELEMENTS = 1 << 19  # decoded elements per chunk of the reference (2 MB of fp32); of
# 2^17 ... 2^21 the fastest on CPU: smaller chunks pay more per-call overhead than they save


def decode_attention_reference(
    query: Tensor,
    segments: list[Segment],
    *,
    scaling: float,
    rope: Rope | None = None,
    mask: Tensor | None = None,
    softcap: float | None = None,
    chunk_rows: int | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """query [B, H_q, Q, D]; mask [B, 1, Q, K] bool (True = attend) or None -> [B, H_q, Q, D] fp32.

    softcap: logits become softcap * tanh(logits / softcap) before the softmax (Gemma 2).
    sinks: [H_q] learned sink logits (GPT-OSS): one more softmax column per head whose
    value is zero, so it takes probability mass without adding to the output.
    chunk_rows: rows decoded at a time; by default about 2 MB of fp32 per decoded chunk,
    which stays in cache while keeping the number of torch calls low.
    """
    total = _check(query, segments, rope, mask)
    if softcap is None and sinks is None and _dense_fits(query, segments, total, chunk_rows):
        rows = [s for s in segments if s.rows]
        return _dense_attention(query, rows, scaling, rope, mask, total)
    b, hq, q_len, d = query.shape
    q = query.float()
    state = None  # (running max, denominator, numerator) over everything seen so far
    col = 0
    for seg in segments:
        if not seg.rows:
            continue
        hkv = seg.key.data.shape[1]
        group = hq // hkv
        step = chunk_rows or max(64, CHUNK_ELEMENTS // (b * hkv * d))
        keys, values = ChunkDecoder(seg.key, pairs=seg.key.pre_rope), ChunkDecoder(seg.value)
        # query rows r = g * Q + qi per KV head, pre-scaled (the scores come out scaled), in
        # the keys' planes; the numerator accumulates in the values' planes
        qk = keys.to_planes(q.reshape(b, hkv, group * q_len, d) * scaling)
        if state is not None:
            state = (*state[:2], values.to_planes(state[2]))
        turn = _PairRotation(rope, keys.planes, seg.positions) if keys.pairs else None
        # one decode query sees every cached row: no mask to apply
        seg_mask = None
        if mask is not None or q_len > 1:
            full = mask if mask is not None else _causal(q_len, total, query.device)
            seg_mask = _rows_mask(full[..., col : col + seg.rows], hkv, group)
        for a in range(0, seg.rows, step):
            stop = min(a + step, seg.rows)
            key = keys.decode(a, stop)  # [planes, B, H_kv, C, D/planes]
            if turn is not None:
                turn(key, a, stop)
            elif seg.key.pre_rope:  # channel order
                key = rotate(key[0], seg.positions[:, a:stop], rope)[None]
            scores = _planes_matmul(qk, key.transpose(-1, -2)).sum(0)  # [B, H_kv, R, C]
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            if seg_mask is not None:
                scores = scores.masked_fill(~seg_mask[..., a:stop], float("-inf"))
            value = values.decode(a, stop, bias=False)  # [planes, B, H_kv, C, D/planes]
            state = _online_update(state, scores, value, values.row_bias(a, stop))
        state = (*state[:2], values.to_channels(state[2]))  # [B, H_kv, R, D]
        col += seg.rows
    if state is None:
        raise KvqError("attention over an empty key set")
    top, denom, acc = state
    if sinks is not None:  # the sink column: exp(sink - running max) more in the denominator
        rows = sinks.float().view(hkv, group, 1).expand(hkv, group, q_len).reshape(hkv, -1)
        denom = denom + (rows - top.clamp_min(torch.finfo(top.dtype).min)).exp()
    out = acc / denom.clamp_min(torch.finfo(torch.float32).tiny)[..., None]
    return out.reshape(b, hq, q_len, d)


DENSE_ELEMENTS = 1 << 23  # decoded K or V elements (32 MB of fp32) below which attention
# dequantizes every row once and makes one SDPA call: on CPU, a step's cost is its number
# of small ops, and one fused call replaces the chunked online softmax's dozens per segment


def _dense_fits(query: Tensor, segments: list[Segment], total: int, chunk_rows) -> bool:
    """Whether the rows decode whole within DENSE_ELEMENTS (and no chunking was asked)."""
    if chunk_rows is not None or not total:
        return False
    hkv = next(s.key.data.shape[1] for s in segments if s.rows)
    return query.shape[0] * hkv * total * query.shape[-1] <= DENSE_ELEMENTS


def _dense_attention(query, segments: list[Segment], scaling: float, rope, mask, total: int):
    """`decode_attention_reference` for rows that decode whole: every segment dequantized
    once (`decode_packed`: the quantizers' own arithmetic; pre-RoPE keys rotated at their
    positions), then one SDPA call, as a DynamicCache's layer runs. Equal to the online
    softmax within fp32 rounding; a query that may see no row reads zeros, as there."""
    keys, values = [], []
    for seg in segments:
        key = decode_packed(seg.key)  # [B, H_kv, T, D] fp32
        if seg.key.pre_rope:
            key = rotate(key, seg.positions, rope)
        keys.append(key)
        values.append(decode_packed(seg.value))
    key = keys[0] if len(keys) == 1 else torch.cat(keys, dim=2)
    value = values[0] if len(values) == 1 else torch.cat(values, dim=2)
    q = query.float()
    q_len = q.shape[2]
    if mask is None and q_len > 1:
        mask = _causal(q_len, total, query.device)
    out = torch.nn.functional.scaled_dot_product_attention(
        q, key, value, attn_mask=mask, scale=scaling, enable_gqa=key.shape[1] != q.shape[1]
    )
    if mask is not None:
        out = torch.where(mask.any(-1, keepdim=True), out, 0.0)
    return out


def _planes_matmul(x: Tensor, y: Tensor) -> Tensor:
    """[P|1, B, H, M, K] @ [P, B, H, K, N] -> [P, B, H, M, N] as one bmm (cheaper per call
    than a broadcasting matmul, and called for every chunk)."""
    p, b, h, k, n = y.shape
    x = x.expand(p, b, h, *x.shape[-2:]).reshape(p * b * h, -1, k)
    return torch.bmm(x, y.reshape(p * b * h, k, n)).view(p, b, h, -1, n)


def _online_update(state, scores: Tensor, value: Tensor, bias: Tensor | None):
    """Fold one chunk into (max, denominator, numerator): one softmax over all chunks.

    scores [B, H, R, C] (consumed); value [planes, B, H, C, W] codes * scale; bias [B, H, C, G]
    per-row value biases left out of `value` (sum_t p_t bias_tg covers a group's positions,
    D/G/per per plane), or None; numerator [planes, B, H, R, W].
    """
    top = scores.amax(dim=-1)
    if state is not None:
        top = torch.maximum(state[0], top)
    # a row that has seen only masked keys keeps a finite reference point
    safe = top.clamp_min(torch.finfo(top.dtype).min)
    p = scores.sub_(safe[..., None]).exp_()
    num = _planes_matmul(p[None], value)
    if bias is not None:
        num.unflatten(-1, (bias.shape[-1], -1)).add_((p @ bias)[..., None])
    if state is None:
        return top, p.sum(-1), num
    alpha = (state[0] - safe).exp_()  # rescales what earlier chunks accumulated
    return top, torch.addcmul(p.sum(-1), state[1], alpha), num.addcmul_(state[2], alpha[..., None])


def _rows_mask(mask: Tensor, hkv: int, group: int) -> Tensor:
    """[B|1, 1|H_q, Q, C] -> [B|1, 1|H_kv, G*Q, C] matching the query rows r = g * Q + qi."""
    bm, hm, q_len, c = mask.shape
    if hm == 1:
        return mask[:, :, None].expand(bm, 1, group, q_len, c).reshape(bm, 1, group * q_len, c)
    return mask.reshape(bm, hkv, group * q_len, c)


class _PairRotation:
    """Rotates keys decoded in pair order (`ChunkDecoder(pairs=True)`) in place: RoPE
    partners sit side by side as (real, imaginary), so rotate-half RoPE is one complex
    multiply by cos + i sin instead of four half-width passes with temporaries."""

    def __init__(self, rope: Rope, planes: int, positions: Tensor):
        self.table = _pair_table(rope, planes)  # [planes, P, D/(2 planes)] complex64
        self.positions = positions  # [B, T]
        self.first = _run_start(positions, self.table.shape[1])  # checked once per segment

    def __call__(self, key: Tensor, start: int, stop: int) -> None:
        """Rotates key planes [planes, B, H, C, D/planes] (rows [start, stop)) in place."""
        if self.first is None:
            turn = self.table[:, self.positions[:, start:stop]]  # [planes, B, C, D/(2 planes)]
        else:  # a view
            turn = self.table[:, None, self.first + start : self.first + stop]
        _complex(key).mul_(turn[:, :, None])


def _complex(x: Tensor) -> Tensor:
    """[..., D] float32 with (real, imaginary) pairs -> [..., D/2] complex64 view."""
    return torch.view_as_complex(x.unflatten(-1, (-1, 2)))


# cos table -> {planes: pair table}, kept while the table lives
_PAIR_TABLES: Memo = {}


def _pair_table(rope: Rope, planes: int) -> Tensor:
    """cos + i sin as [planes, P, D/(2 planes)] complex64: plane k, pair i rotates the pair
    (real, imaginary) that the pair layout of that many planes, `layout_perm(D, 8 // planes,
    pairs=True)`, puts at plane k, positions 2i and 2i + 1 (natural pair order is the
    one-plane layout). Cached per table: a layer reuses its tables across decode steps."""
    cached = memoised(_PAIR_TABLES, rope[0], dict)  # planes -> table
    if planes not in cached:
        cos, sin = rope
        freq = layout_perm(2 * cos.shape[-1], 8 // planes, True, cos.device)[0::2]  # [D/2]
        table = torch.complex(cos.float(), sin.float())[:, freq]
        cached[planes] = table.unflatten(-1, (planes, -1)).transpose(0, 1).contiguous()
    return cached[planes]


def _causal(q_len: int, total: int, device) -> Tensor:
    q_pos = torch.arange(total - q_len, total, device=device)
    return (torch.arange(total, device=device)[None, :] <= q_pos[:, None])[None, None]


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
                return "per-block lookup scales (NVFP4) decode on the reference only"
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
    total = _check(query, segments, rope, mask)
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
    return mask if mask is not None else _causal(q_len, total, device)


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
        total = _check(query, segments, rope, mask)
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
    _check(query, segments, rope, mask)
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
    from kvq.runtime.kernels.decode.planned import planned_unsupported

    reason = planned_unsupported(query, segments, mask)
    return DecodePath("general", reason, **chunks) if reason else DecodePath("planned", **chunks)
