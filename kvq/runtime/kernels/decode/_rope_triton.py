"""Keys stored before RoPE, rotated in the planned decode kernels' loop (`_splits_triton`
explains the scheme): per-tile angle addition from a unit table, or a per-row gather;
integer, table, vector-codebook and full-precision keys each in their own chunk.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvq.runtime.kernels.decode._nuq_triton import (
    _key_corrections,
    _key_exceptions,
    _lut_planes,
    _pair_levels,
    _split_pairs,
    _value_planes,
)
from kvq.runtime.kernels.decode._planes_triton import (
    _code_plane,
)
from kvq.runtime.kernels.decode._vq_triton import (
    _trellis_gather,
    _trellis_states,
    _vq_centroids,
)


@triton.jit
def _rope_setup(q_row, r_ok, q_scale, amp, fk, HKV, C0: tl.constexpr, CW: tl.constexpr,
                D: tl.constexpr, KP: tl.constexpr, OP: tl.constexpr,
                STATIC: tl.constexpr):  # fmt: skip
    """Once per segment loop, for pre-RoPE keys: the query and the static key qparams at
    columns [C0, C0 + CW) of the planes' halves. In plane order the channels split into
    halves whose column j are RoPE partners (c, c + D/2): (query rows [R, CW] of the
    even plane in half 0, in half 1, the odd plane in half 0, in half 1), float32, scaled
    by q_scale and by the table's amplitude of each column's frequency (amp [D / 2] in the
    table's column order). STATIC: the packed keys' per-channel (scale, bias) [CW] of the
    same four (fk: this KV head's k_fold), in OP; else zeros."""
    HW: tl.constexpr = D // KP // 2
    j = C0 + tl.arange(0, CW)
    ch = j * KP  # channels of the even plane in half 0
    ok = r_ok[:, None]
    a_lo = tl.load(amp + j)[None, :] * q_scale
    qa_lo1 = tl.load(q_row[:, None] + ch[None, :], mask=ok, other=0.0).to(tl.float32) * a_lo
    qa_lo2 = tl.load(q_row[:, None] + (ch + D // 2)[None, :], mask=ok, other=0.0)
    qa_lo2 = qa_lo2.to(tl.float32) * a_lo
    qa_hi1 = qa_lo1
    qa_hi2 = qa_lo2
    if KP == 2:
        a_hi = tl.load(amp + HW + j)[None, :] * q_scale
        qa_hi1 = tl.load(q_row[:, None] + (ch + 1)[None, :], mask=ok, other=0.0)
        qa_hi1 = qa_hi1.to(tl.float32) * a_hi
        qa_hi2 = tl.load(q_row[:, None] + (ch + D // 2 + 1)[None, :], mask=ok, other=0.0)
        qa_hi2 = qa_hi2.to(tl.float32) * a_hi
    rk = (0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    if STATIC:
        s_lo1 = tl.load(fk + ch).to(OP)
        b_lo1 = tl.load(fk + HKV * D + ch).to(OP)
        s_lo2 = tl.load(fk + D // 2 + ch).to(OP)
        b_lo2 = tl.load(fk + HKV * D + D // 2 + ch).to(OP)
        s_hi1 = s_lo1
        b_hi1 = b_lo1
        s_hi2 = s_lo2
        b_hi2 = b_lo2
        if KP == 2:
            s_hi1 = tl.load(fk + ch + 1).to(OP)
            b_hi1 = tl.load(fk + HKV * D + ch + 1).to(OP)
            s_hi2 = tl.load(fk + D // 2 + ch + 1).to(OP)
            b_hi2 = tl.load(fk + HKV * D + D // 2 + ch + 1).to(OP)
        rk = (s_lo1, b_lo1, s_lo2, b_lo2, s_hi1, b_hi1, s_hi2, b_hi2)
    return (qa_lo1.to(OP), qa_lo2.to(OP), qa_hi1.to(OP), qa_hi2.to(OP)), rk


@triton.jit
def _rope_dot(scores, qa1, qa2, k1, k2, tab, trow, p0, run, col0: tl.constexpr,
              D: tl.constexpr, OP: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """scores [R, BT] plus the share of keys k1, k2 [BT, CW] (RoPE partners: the same
    plane's columns in the two halves, table columns col0 ...) rotated by the unit table's
    rows trow, against the query's columns qa1, qa2 [R, CW] rotated back by the row at p0
    when `run` (else not at all). The table [P, 2, D / 2]: cos, then sin, per position."""
    CW: tl.constexpr = k1.shape[1]
    col = col0 + tl.arange(0, CW)
    at = tab + trow[:, None] * D + col[None, :]
    c = tl.load(at)
    s = tl.load(at + D // 2)
    r1 = k1 * c - k2 * s
    r2 = k2 * c + k1 * s
    # the query's rotation: table row p0, or row 0 (position 0: cos 1, sin 0, the identity)
    # where the rows take their own table rows; one select of the row where a select per
    # element and its fp16 packing cost 34 instructions per iteration (Llama-like NUQ4 as
    # stored, sm_90: 68.0 -> 66.2 warp-instructions per row, Gemma 3 144.4 -> 140.4)
    qrow = tab + tl.where(run, p0, 0) * D
    qc = tl.load(qrow + col).to(OP)
    qs = tl.load(qrow + D // 2 + col).to(OP)
    q1 = (qa1 * qc[None, :] + qa2 * qs[None, :]).to(OP)
    q2 = (qa2 * qc[None, :] - qa1 * qs[None, :]).to(OP)
    scores = tl.dot(q1, tl.trans(r1), scores, input_precision=PRECISION)
    return tl.dot(q2, tl.trans(r2), scores, input_precision=PRECISION)


@triton.jit
def _rope_chunk(scores, rq, rk, k_ptr, k_t, t, t_ok, tab, trow, p0, run, C0: tl.constexpr,
                CW: tl.constexpr, K_ZERO: tl.constexpr, FULL: tl.constexpr, KP: tl.constexpr,
                D: tl.constexpr, OP: tl.constexpr, PRECISION: tl.constexpr, ASM: tl.constexpr,
                K_FP8: tl.constexpr, LUT: tl.constexpr = 0, ltab=None,
                lut=None):  # fmt: skip
    """`_rope_dot` over columns [C0, C0 + CW) of each plane of full-precision keys or codes
    with static qparams (rq, rk: that chunk's, `_rope_setup`), one plane at a time. LUT:
    4-bit codebook codes (`_rope_lut_chunk`; ltab, lut the table)."""
    HW: tl.constexpr = D // KP // 2
    qa_lo1, qa_lo2, qa_hi1, qa_hi2 = rq
    s_lo1, b_lo1, s_lo2, b_lo2, s_hi1, b_hi1, s_hi2, b_hi2 = rk
    j = C0 + tl.arange(0, CW)
    ok = t_ok[:, None]
    row = k_ptr + t[:, None] * k_t
    if FULL:  # channels [C0 KP, (C0 + CW) KP) of each half, loaded whole, then split
        c = C0 * KP + tl.arange(0, CW * KP)  # into planes in registers: strided loads of
        at = row + c[None, :]  # every other channel were 4x the loop's instructions
        x1 = tl.load(at, mask=ok, other=0.0).to(OP)
        x2 = tl.load(at + D // 2, mask=ok, other=0.0).to(OP)
        if KP == 2:
            BT: tl.constexpr = t.shape[0]
            k1, o1 = tl.split(tl.reshape(x1, (BT, CW, 2)))
            k2, o2 = tl.split(tl.reshape(x2, (BT, CW, 2)))
        else:
            k1, k2 = x1, x2
        scores = _rope_dot(scores, qa_lo1, qa_lo2, k1, k2, tab, trow, p0, run, C0, D, OP,
                           PRECISION)  # fmt: skip
        if KP == 2:
            scores = _rope_dot(scores, qa_hi1, qa_hi2, o1, o2, tab, trow, p0, run, HW + C0, D,
                               OP, PRECISION)  # fmt: skip
    elif LUT:  # codebook levels x scale + centre
        scores = _rope_lut_chunk(scores, rq, rk, row, ok, j, tab, trow, p0, run, C0, KP, D,
                                 OP, PRECISION, LUT, ltab, lut)  # fmt: skip
    else:  # bytes j of each half: (code - zero) x scale + bias
        raw1 = tl.load(row + j[None, :], mask=ok, other=0)
        raw2 = tl.load(row + (HW + j)[None, :], mask=ok, other=0)
        k1 = _code_plane(raw1, K_ZERO, KP, 0, ASM, K_FP8).to(OP) * s_lo1[None, :] + b_lo1[None, :]
        k2 = _code_plane(raw2, K_ZERO, KP, 0, ASM, K_FP8).to(OP) * s_lo2[None, :] + b_lo2[None, :]
        scores = _rope_dot(scores, qa_lo1, qa_lo2, k1, k2, tab, trow, p0, run, C0, D, OP,
                           PRECISION)  # fmt: skip
        if KP == 2:
            k1 = _code_plane(raw1, K_ZERO, KP, 1, ASM, K_FP8).to(OP) * s_hi1[None, :]
            k1 += b_hi1[None, :]
            k2 = _code_plane(raw2, K_ZERO, KP, 1, ASM, K_FP8).to(OP) * s_hi2[None, :]
            k2 += b_hi2[None, :]
            scores = _rope_dot(scores, qa_hi1, qa_hi2, k1, k2, tab, trow, p0, run, HW + C0, D,
                               OP, PRECISION)  # fmt: skip
    return scores


@triton.jit
def _rope_pair_chunk(scores, rq, rk, x, tab, trow, p0, run, C0: tl.constexpr, D: tl.constexpr,
                     OP: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """`_rope_dot` of NUQ keys' channels C0 ... of each half in channel order, from their
    level pairs x [BT, CB, 2] (`_pair_levels`: bytes C0 / 2 ... of half 1, then of half 2),
    the static per-channel normaliser applied before they rotate."""
    qa_lo1, qa_lo2, qa_hi1, qa_hi2 = rq
    s_lo1, b_lo1, s_lo2, b_lo2, s_hi1, b_hi1, s_hi2, b_hi2 = rk
    x1, x2 = tl.split(x)
    BT: tl.constexpr = x.shape[0]
    CW: tl.constexpr = 2 * x.shape[1]
    lo, hi = _split_pairs(x1)
    k1 = tl.reshape(tl.join(lo, hi), (BT, CW)).to(OP) * s_lo1[None, :] + b_lo1[None, :]
    lo, hi = _split_pairs(x2)
    k2 = tl.reshape(tl.join(lo, hi), (BT, CW)).to(OP) * s_lo2[None, :] + b_lo2[None, :]
    return _rope_dot(scores, qa_lo1, qa_lo2, k1, k2, tab, trow, p0, run, C0, D, OP, PRECISION)


@triton.jit
def _rope_lut_chunk(scores, rq, rk, row, ok, j, tab, trow, p0, run, C0: tl.constexpr,
                    KP: tl.constexpr, D: tl.constexpr, OP: tl.constexpr,
                    PRECISION: tl.constexpr, LUT: tl.constexpr, ltab, lut):  # fmt: skip
    """`_rope_chunk` of 4-bit codebook (NUQ) keys: the levels of bytes j of each half
    (`_lut_planes`: both planes of a byte at once) with the static per-channel normaliser
    applied (level x scale + centre, KVQuant's pre-RoPE key) before they rotate (levels from
    the byte-pair table: `_rope_pair_chunk`)."""
    HW: tl.constexpr = D // KP // 2
    qa_lo1, qa_lo2, qa_hi1, qa_hi2 = rq
    s_lo1, b_lo1, s_lo2, b_lo2, s_hi1, b_hi1, s_hi2, b_hi2 = rk
    raw1 = tl.load(row + j[None, :], mask=ok, other=0)
    raw2 = tl.load(row + (HW + j)[None, :], mask=ok, other=0)
    lo1, hi1 = _lut_planes(raw1, ltab, lut, LUT)
    lo2, hi2 = _lut_planes(raw2, ltab, lut, LUT)
    k1 = lo1.to(OP) * s_lo1[None, :] + b_lo1[None, :]
    k2 = lo2.to(OP) * s_lo2[None, :] + b_lo2[None, :]
    scores = _rope_dot(scores, qa_lo1, qa_lo2, k1, k2, tab, trow, p0, run, C0, D, OP,
                       PRECISION)  # fmt: skip
    k1 = hi1.to(OP) * s_hi1[None, :] + b_hi1[None, :]
    k2 = hi2.to(OP) * s_hi2[None, :] + b_hi2[None, :]
    return _rope_dot(scores, qa_hi1, qa_hi2, k1, k2, tab, trow, p0, run, HW + C0, D, OP,
                     PRECISION)  # fmt: skip


@triton.jit
def _rope_vq_chunk(scores, rq, rk, row, ok, j, tab, trow, p0, run, C0: tl.constexpr,
                   KP: tl.constexpr, D: tl.constexpr, OP: tl.constexpr,
                   PRECISION: tl.constexpr, M: tl.constexpr, BITS: tl.constexpr,
                   cb, TRN: tl.constexpr = 0):  # fmt: skip
    """`_rope_chunk` of vector-codebook keys over RoPE-pair groups j (C0 ...; see
    `_vq_index`): the groups' centroids with the static per-channel normaliser applied
    (coordinate x scale + centre) before they rotate. M 2 (KP 1): coordinates 0 and 1 are
    the pair's two halves; M 4 (KP 2): 0, 1 the even and odd plane of half 0, 2, 3 of
    half 1. TRN: trellis keys (M 2; `_trellis_run`), the channels C0 ... of each half."""
    HW: tl.constexpr = D // KP // 2
    qa_lo1, qa_lo2, qa_hi1, qa_hi2 = rq
    s_lo1, b_lo1, s_lo2, b_lo2, s_hi1, b_hi1, s_hi2, b_hi2 = rk
    if TRN:  # both halves in one gather (two: the same instructions and registers)
        s0 = _trellis_states(row, C0, j.shape[0], ok, BITS, TRN)
        s1 = _trellis_states(row, HW + C0, j.shape[0], ok, BITS, TRN)
        c0, c1 = tl.split(_trellis_gather(tl.join(s0, s1), cb, BITS * TRN))
        c2 = c0
        c3 = c1
    else:
        c0, c1, c2, c3 = _vq_centroids(row, C0, j.shape[0], ok, cb, M, BITS)
    if M == 2:  # (c0, c1): the pair's halves
        k1 = c0.to(OP) * s_lo1[None, :] + b_lo1[None, :]
        k2 = c1.to(OP) * s_lo2[None, :] + b_lo2[None, :]
        scores = _rope_dot(scores, qa_lo1, qa_lo2, k1, k2, tab, trow, p0, run, C0, D, OP,
                           PRECISION)  # fmt: skip
    else:
        k1 = c0.to(OP) * s_lo1[None, :] + b_lo1[None, :]
        k2 = c2.to(OP) * s_lo2[None, :] + b_lo2[None, :]
        scores = _rope_dot(scores, qa_lo1, qa_lo2, k1, k2, tab, trow, p0, run, C0, D, OP,
                           PRECISION)  # fmt: skip
        k1 = c1.to(OP) * s_hi1[None, :] + b_hi1[None, :]
        k2 = c3.to(OP) * s_hi2[None, :] + b_hi2[None, :]
        scores = _rope_dot(scores, qa_hi1, qa_hi2, k1, k2, tab, trow, p0, run, HW + C0, D, OP,
                           PRECISION)  # fmt: skip
    return scores


@triton.jit
def _rope_row_groups(scores, rq, k_ptr, k_t, ks_ptr, ko_ptr, kq_t, t, t_ok, tab, trow, p0,
                     run, K_ZERO: tl.constexpr, KP: tl.constexpr, D: tl.constexpr,
                     OP: tl.constexpr, PRECISION: tl.constexpr, ASM: tl.constexpr,
                     K_FP8: tl.constexpr, K_NG: tl.constexpr, K_HAS_OFF: tl.constexpr,
                     K_FACTOR: tl.constexpr, K_WORDS: tl.constexpr):  # fmt: skip
    """`_rope_dot` for codes with per-row group qparams (`_value_planes` per half: the
    groups of a half cover it, K_NG even or one group per row)."""
    HW: tl.constexpr = D // KP // 2
    NGH: tl.constexpr = K_NG // 2 if K_NG > 1 else 1
    G1: tl.constexpr = K_NG // 2  # the first group of half 1
    qa_lo1, qa_lo2, qa_hi1, qa_hi2 = rq
    lo1, hi1 = _value_planes(k_ptr, t, t_ok, k_t, ks_ptr, ko_ptr, kq_t, K_ZERO, KP, NGH,
                             HW // NGH, False, K_HAS_OFF, OP, ASM, K_FP8, K_FACTOR,
                             K_WORDS)  # fmt: skip
    lo2, hi2 = _value_planes(k_ptr + HW, t, t_ok, k_t, ks_ptr + G1, ko_ptr + G1, kq_t, K_ZERO,
                             KP, NGH, HW // NGH, False, K_HAS_OFF, OP, ASM, K_FP8, K_FACTOR,
                             K_WORDS)  # fmt: skip
    scores = _rope_dot(scores, qa_lo1, qa_lo2, lo1, lo2, tab, trow, p0, run, 0, D, OP,
                       PRECISION)  # fmt: skip
    if KP == 2:
        scores = _rope_dot(scores, qa_hi1, qa_hi2, hi1, hi2, tab, trow, p0, run, HW, D, OP,
                           PRECISION)  # fmt: skip
    return scores


@triton.jit
def _rope_scores(rq, rk, k_ptr, k_t, ks_ptr, ko_ptr, kq_t, t, t_ok, tile, pos_ptr, pos_t,
                 tab, tab_rows, R: tl.constexpr, K_ZERO: tl.constexpr, BLOCK_T: tl.constexpr,
                 FULL: tl.constexpr, KP: tl.constexpr, D: tl.constexpr, OP: tl.constexpr,
                 PRECISION: tl.constexpr, ASM: tl.constexpr, K_ROWQ: tl.constexpr,
                 K_NG: tl.constexpr, K_HAS_OFF: tl.constexpr, K_FP8: tl.constexpr,
                 K_FACTOR: tl.constexpr, K_WORDS: tl.constexpr,
                 NC: tl.constexpr, K_LUT: tl.constexpr = 0, K_FLAT: tl.constexpr = 0,
                 nuq=None, amp=None, K_VQ: tl.constexpr = 0,
                 K_VQB: tl.constexpr = 0, live=None, K_TRN: tl.constexpr = 0):  # fmt: skip
    """Scores [R, BT] of a tile of pre-RoPE keys, each rotated at its row's position. A
    tile whose rows sit at one run of positions p0, p0 + 1, ... (a sequence's rows, the
    usual case) is rotated by angle addition: R(p0 + i) = R(p0) R(i), R(p0) taken onto the
    query (rotated back, [R, D] once per tile) and R(i) onto the keys from table rows
    0 ... BT - 1, the same for every tile (L1 hits); any other tile (left padding, sink
    rows) reads each key's own table row. rq, rk: per chunk of NC (columns of the planes'
    halves), the query scaled by the table's amplitude per frequency (attention scaling:
    the unit table holds plain rotations) and the static key qparams (`_rope_setup`).
    K_LUT: 4-bit codebook (NUQ) codes; K_FLAT: with their flat exact exceptions, corrected
    rotated (`_key_corrections`; nuq: the kernel's NUQ pointers, amp: the table's
    amplitude). K_VQ (M), K_VQB (bits): vector-codebook keys over RoPE pairs
    (`_rope_vq_chunk`, the codebook in nuq[0])."""
    pos = tl.load(pos_ptr + t * pos_t, mask=t_ok, other=0).to(tl.int32)
    p0 = tl.load(pos_ptr + tile * BLOCK_T * pos_t).to(tl.int32)
    local = tl.arange(0, BLOCK_T)
    live = t_ok if live is None else live  # the rows in the segment (t: the rows read)
    drift = tl.where(live, pos - local - p0, 0)
    run = (tl.max(tl.abs(drift), axis=0) == 0) & (tab_rows >= BLOCK_T)
    trow = tl.where(run, local, pos)
    scores = tl.zeros([R, BLOCK_T], tl.float32)
    if K_ROWQ and not FULL:
        scores = _rope_row_groups(scores, rq[0], k_ptr, k_t, ks_ptr, ko_ptr, kq_t, t, t_ok, tab,
                                  trow, p0, run, K_ZERO, KP, D, OP, PRECISION, ASM, K_FP8, K_NG,
                                  K_HAS_OFF, K_FACTOR, K_WORDS)  # fmt: skip
    elif K_VQ and not FULL:
        VW: tl.constexpr = D // KP // 2 // NC
        vrow = k_ptr + t[:, None] * k_t
        vok = t_ok[:, None]
        for c in tl.static_range(NC):
            scores = _rope_vq_chunk(scores, rq[c], rk[c], vrow, vok, c * VW + tl.arange(0, VW),
                                    tab, trow, p0, run, c * VW, KP, D, OP, PRECISION, K_VQ,
                                    K_VQB, nuq[0], K_TRN)  # fmt: skip
    elif K_LUT == 3 and not FULL:  # NUQ keys in channel order: one gather for the tile
        # (the gather stores its table to shared memory each call: one per tile, where one
        # per chunk and half cost 77.1 warp-instructions per row against 71.8, Llama-like;
        # one per chunk: 72.1)
        CB: tl.constexpr = D // 4 // NC  # code bytes per chunk and half
        row = k_ptr + t[:, None] * k_t
        b = tl.arange(0, CB)[None, :]
        raw = tl.join(tl.load(row + b), tl.load(row + D // 4 + b))  # [BT, CB, half]
        if NC == 2:
            raw = tl.join(raw, tl.join(tl.load(row + CB + b), tl.load(row + D // 4 + CB + b)))
        x = _pair_levels(raw, nuq[15])
        if NC == 2:
            x0, x1 = tl.split(x)
            scores = _rope_pair_chunk(scores, rq[0], rk[0], x0, tab, trow, p0, run, 0, D, OP,
                                      PRECISION)  # fmt: skip
            scores = _rope_pair_chunk(scores, rq[1], rk[1], x1, tab, trow, p0, run, 2 * CB, D,
                                      OP, PRECISION)  # fmt: skip
        else:
            scores = _rope_pair_chunk(scores, rq[0], rk[0], x, tab, trow, p0, run, 0, D, OP,
                                      PRECISION)  # fmt: skip
    else:
        CW: tl.constexpr = D // KP // 2 // NC
        LUT: tl.constexpr = 0 if FULL else K_LUT
        ltab = nuq[0] if LUT else None
        lut = nuq[15] if LUT else None
        scores = _rope_chunk(scores, rq[0], rk[0], k_ptr, k_t, t, t_ok, tab, trow, p0, run, 0,
                             CW, K_ZERO, FULL, KP, D, OP, PRECISION, ASM, K_FP8, LUT, ltab,
                             lut)  # fmt: skip
        for c in tl.static_range(1, NC):
            scores = _rope_chunk(scores, rq[c], rk[c], k_ptr, k_t, t, t_ok, tab, trow, p0, run,
                                 c * CW, CW, K_ZERO, FULL, KP, D, OP, PRECISION, ASM,
                                 K_FP8, LUT, ltab, lut)  # fmt: skip
    if K_FLAT and not FULL:  # NUQ keys' exact exceptions, rotated at each row's position
        # (taken before the dense codes instead: the same loop, spills moved between calls)
        corr = _key_corrections(R, BLOCK_T, t, t_ok, k_ptr, k_t, nuq, OP, True,
                                (pos, tab, amp), D, KP, K_VQ, K_VQB, K_TRN, K_FLAT)  # fmt: skip
        scores = _key_exceptions(scores, corr, PRECISION)
    return scores


@triton.jit
def _rope_prepare(rope_q, STATIC: tl.constexpr, D: tl.constexpr, KP: tl.constexpr,
                  OP: tl.constexpr, NC: tl.constexpr):  # fmt: skip
    """(query, static key qparams) of `_rope_setup` per chunk of NC, as tuples of NC."""
    q_row, r_ok, q_scale, amp, fk, HKV = rope_q
    CW: tl.constexpr = D // KP // 2 // NC
    rq0, rk0 = _rope_setup(q_row, r_ok, q_scale, amp, fk, HKV, 0, CW, D, KP, OP, STATIC)
    rq = (rq0, rq0)
    rk = (rk0, rk0)
    if NC == 2:
        rq1, rk1 = _rope_setup(q_row, r_ok, q_scale, amp, fk, HKV, CW, CW, D, KP, OP, STATIC)
        rq = (rq0, rq1)
        rk = (rk0, rk1)
    if NC == 4:
        rq1, rk1 = _rope_setup(q_row, r_ok, q_scale, amp, fk, HKV, CW, CW, D, KP, OP, STATIC)
        rq2, rk2 = _rope_setup(q_row, r_ok, q_scale, amp, fk, HKV, 2 * CW, CW, D, KP, OP,
                               STATIC)  # fmt: skip
        rq3, rk3 = _rope_setup(q_row, r_ok, q_scale, amp, fk, HKV, 3 * CW, CW, D, KP, OP,
                               STATIC)  # fmt: skip
        rq = (rq0, rq1, rq2, rq3)
        rk = (rk0, rk1, rk2, rk3)
    return rq, rk


@triton.jit
def _rope_inputs(FULL: tl.constexpr, tab, tab1, amp1, rope_q):
    """(unit table, `_rope_prepare`'s inputs) of a pre-RoPE segment's rotation.
    Full-precision keys rotate in channel order (one plane, `tab1` / `amp1`): in the
    packed codes' two planes each tile's rows were split into planes in registers
    (PRMTs), 134 warp-instructions per row and a 432 B spill for Gemma 3's whole-layer
    call (sink + KV4 + residual, head_dim 256; sm_90, bench/kernel_resources.py). With
    their tiles in quarters (`_segment_loop`: SUB) and two chunks of columns, and the
    packed segment's loop run last (`decode_splits_kernel`), nothing spills."""
    if FULL:
        q_row, r_ok, q_scale, amp, fk, HKV = rope_q
        out = (tab1, (q_row, r_ok, q_scale, amp1, fk, HKV))
    else:
        out = (tab, rope_q)
    return out
