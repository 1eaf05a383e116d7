"""Decode attention in pure torch: the reference every Triton kernel is checked against
(`attention.py` dispatches). Chunks of packed rows are decoded and folded into an online
softmax, so the cache is never materialised in fp32; when the decoded rows are small
enough (`DENSE_ELEMENTS`) they are decoded once and attended in one SDPA call."""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import torch
from torch import Tensor

from kvq.errors import KvqError
from kvq.runtime.kernels.decode.segments import (
    Rope,
    Segment,
    causal_mask,
    check_inputs,
    rotate,
    run_start,
)
from kvq.runtime.packed import (
    ChunkDecoder,
    PackedRows,
    decode_packed,
    layout_perm,
)
from kvq.tensor_memo import Memo, memoised

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
    total = check_inputs(query, segments, rope, mask)
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
        # rows stored rotated decode unturned: the query turns instead, and each chunk's
        # share of the output (see `_dense_attention`)
        key_turn, value_turn = _turn(seg.key), _turn(seg.value)
        keys = ChunkDecoder(_unturned(seg.key, key_turn), pairs=seg.key.pre_rope)
        values = ChunkDecoder(_unturned(seg.value, value_turn))
        # query rows r = g * Q + qi per KV head, pre-scaled (the scores come out scaled), in
        # the keys' planes; the numerator accumulates in the values' planes
        qk = q.reshape(b, hkv, group * q_len, d) * scaling
        qk = keys.to_planes(qk if key_turn is None else qk @ key_turn.T)
        if state is not None:
            state = (*state[:2], values.to_planes(state[2]))
        turn_out = None if value_turn is None else partial(_turn_planes, values, value_turn)
        turn = _PairRotation(rope, keys.planes, seg.positions) if keys.pairs else None
        # one decode query sees every cached row: no mask to apply
        seg_mask = None
        if mask is not None or q_len > 1:
            full = mask if mask is not None else causal_mask(q_len, total, query.device)
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
            state = _online_update(state, scores, value, values.row_bias(a, stop), turn_out)
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
    softmax within fp32 rounding; a query that may see no row reads zeros, as there.

    Rows stored under one rotation R (vLLM's int4 and TurboQuant rows decode as x R) are
    attended unturned: q . (x R) = (q R^T) . x and sum_t p_t (v_t R) = (sum_t p_t v_t) R, so
    the query and the output turn once a step instead of every cached row."""
    key_turn = _one_rotation([seg.key for seg in segments])
    value_turn = _one_rotation([seg.value for seg in segments])
    key, value = _decoded_rows(segments, key_turn, value_turn, rope, total)
    q = query.float()
    if key_turn is not None:
        q = q @ key_turn.T
    q_len = q.shape[2]
    if mask is None and q_len > 1:
        mask = causal_mask(q_len, total, query.device)
    out = torch.nn.functional.scaled_dot_product_attention(
        q, key, value, attn_mask=mask, scale=scaling, enable_gqa=key.shape[1] != q.shape[1]
    )
    if value_turn is not None:
        out = out @ value_turn
    if mask is not None:
        out = torch.where(mask.any(-1, keepdim=True), out, 0.0)
    return out


def _decoded_rows(segments: list[Segment], key_turn, value_turn, rope, total: int):
    """Every segment's rows decoded (keys rotated at their positions) -> key, value
    [B, H_kv, total, D] float32. Several segments decode into their rows of one buffer (no
    concatenation afterwards); one alone is returned as decoded: full float32 rows then
    cost no copy at all."""
    if len(segments) == 1:
        seg = segments[0]
        key = decode_packed(_unturned(seg.key, key_turn))
        if seg.key.pre_rope:
            key = rotate(key, seg.positions, rope)
        return key, decode_packed(_unturned(seg.value, value_turn))
    first = segments[0]
    b, hkv = first.key.data.shape[:2]
    d = first.key.head_dim
    key = torch.empty(b, hkv, total, d, dtype=torch.float32, device=first.key.data.device)
    value = torch.empty_like(key)
    col = 0
    for seg in segments:
        rows = slice(col, col + seg.rows)
        if seg.key.pre_rope:
            stored = decode_packed(_unturned(seg.key, key_turn))
            rotate(stored, seg.positions, rope, out=key[:, :, rows])
        else:
            decode_packed(_unturned(seg.key, key_turn), out=key[:, :, rows])
        decode_packed(_unturned(seg.value, value_turn), out=value[:, :, rows])
        col += seg.rows
    return key, value


def _turn_planes(values: ChunkDecoder, rotation: Tensor, num: Tensor) -> Tensor:
    """A numerator [planes, B, H, R, W] of unturned values -> that of the values turned."""
    return values.to_planes(values.to_channels(num) @ rotation)


def _turn(p: PackedRows) -> Tensor | None:
    """The rotation that attention may apply to the query or output instead of p's rows:
    p's own, unless its rows are also turned by RoPE afterwards (which does not commute)."""
    return None if p.pre_rope else p.rotation


def _one_rotation(rows: list[PackedRows]) -> Tensor | None:
    """The rotation all of `rows` were stored under when they share one (see `_turn`), else
    None (none rotated, or a mix: each decodes turned)."""
    first = _turn(rows[0])
    return first if first is not None and all(_turn(r) is first for r in rows) else None


def _unturned(p: PackedRows, turn: Tensor | None) -> PackedRows:
    """p decoding as stored, before its rotation, when attention applies `turn` instead."""
    return p if turn is None else replace(p, rotation=None)


def _planes_matmul(x: Tensor, y: Tensor) -> Tensor:
    """[P|1, B, H, M, K] @ [P, B, H, K, N] -> [P, B, H, M, N] as one bmm (cheaper per call
    than a broadcasting matmul, and called for every chunk)."""
    p, b, h, k, n = y.shape
    x = x.expand(p, b, h, *x.shape[-2:]).reshape(p * b * h, -1, k)
    return torch.bmm(x, y.reshape(p * b * h, k, n)).view(p, b, h, -1, n)


def _online_update(state, scores: Tensor, value: Tensor, bias: Tensor | None, turn=None):
    """Fold one chunk into (max, denominator, numerator): one softmax over all chunks.

    scores [B, H, R, C] (consumed); value [planes, B, H, C, W] codes * scale; bias [B, H, C, G]
    per-row value biases left out of `value` (sum_t p_t bias_tg covers a group's positions,
    D/G/per per plane), or None; numerator [planes, B, H, R, W]. turn: maps the chunk's
    numerator from the values' stored rotation to theirs decoded, or None.
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
    if turn is not None:
        num = turn(num)
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
        self.first = run_start(positions, self.table.shape[1])  # checked once per segment

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
