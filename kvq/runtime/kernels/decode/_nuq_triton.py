"""Codebook (NUQ, KVQuant) codes in the planned decode kernels (`_splits_triton`): the
16-level table as a 256-entry table of level pairs or as PRMT byte selection from 8
registers, the exact entries of dense-and-sparse rows (value slots patched in, key
exceptions added to the scores through an MMA), and the key / value tile decoders that
choose between integer, fp8 and table codes.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvq.runtime.kernels.decode._planes_triton import (
    _planes,
    _word_bytes,
    _word_nibbles,
)
from kvq.runtime.kernels.decode._vq_triton import (
    _vq_key_coordinate,
)

# NUQ (KVQuant) codes: a 4-bit code indexes a table of 16 levels. Compiled, the levels are
# fp16 held as 8 registers (`_lut_words`: the low bytes of levels 0-3, 4-7, 8-11, 12-15,
# then the high bytes) and a code's two bytes are picked by PRMT, whose selector nibble
# names one of 8 bytes (bits 0-2; bit 3 would replicate a sign, so it is masked off): one
# PRMT per table pair gives the candidates of 4 codes at once from levels 0-7 and 8-15,
# a fifth picks per code by its bit 3 (selector i + 4 x bit 3, from one shift and one
# LOP3), and two more interleave low and high bytes into the fp16 pairs of the even and
# odd planes: 21 instructions per 8 codes, no conversion, no memory access. $4: 4 code
# bytes (8 nibbles, channel order); $5, $9, ..., $33: the table words (pack 4 gives each
# 32-bit operand 4 registers); out: even-channel pairs $0, $1, odd-channel pairs $2, $3.
_LUT_ASM = tl.constexpr("""{
.reg .b32 s, sel, la, lb, ha, hb, lo, hi;
and.b32 s, $4, 0x77777777;
shr.b32 sel, $4, 1;
lop3.b32 sel, sel, 0x44444444, 0x32103210, 0xea;
prmt.b32 la, $5, $9, s;
prmt.b32 lb, $13, $17, s;
prmt.b32 ha, $21, $25, s;
prmt.b32 hb, $29, $33, s;
prmt.b32 lo, la, lb, sel;
prmt.b32 hi, ha, hb, sel;
prmt.b32 $0, lo, hi, 0x6240;
prmt.b32 $2, lo, hi, 0x7351;
shr.b32 s, s, 16;
shr.b32 sel, sel, 16;
prmt.b32 la, $5, $9, s;
prmt.b32 lb, $13, $17, s;
prmt.b32 ha, $21, $25, s;
prmt.b32 hb, $29, $33, s;
prmt.b32 lo, la, lb, sel;
prmt.b32 hi, ha, hb, sel;
prmt.b32 $1, lo, hi, 0x6240;
prmt.b32 $3, lo, hi, 0x7351;
}""")


# the same per 32-bit word of codes (pack 1; $8 the word, $9 ... $16 the table words), into
# 16-bit registers as `_WORD_NIBBLES_ASM` returns them: levels of channels 8w, 8w + 2, 8w +
# 4, 8w + 6, then of the odd ones
_WORD_LUT_ASM = tl.constexpr("""{
.reg .b32 s, sel, la, lb, ha, hb, lo, hi, a, b, c, d;
and.b32 s, $8, 0x77777777;
shr.b32 sel, $8, 1;
lop3.b32 sel, sel, 0x44444444, 0x32103210, 0xea;
prmt.b32 la, $9, $10, s;
prmt.b32 lb, $11, $12, s;
prmt.b32 ha, $13, $14, s;
prmt.b32 hb, $15, $16, s;
prmt.b32 lo, la, lb, sel;
prmt.b32 hi, ha, hb, sel;
prmt.b32 a, lo, hi, 0x6240;
prmt.b32 c, lo, hi, 0x7351;
shr.b32 s, s, 16;
shr.b32 sel, sel, 16;
prmt.b32 la, $9, $10, s;
prmt.b32 lb, $11, $12, s;
prmt.b32 ha, $13, $14, s;
prmt.b32 hb, $15, $16, s;
prmt.b32 lo, la, lb, sel;
prmt.b32 hi, ha, hb, sel;
prmt.b32 b, lo, hi, 0x6240;
prmt.b32 d, lo, hi, 0x7351;
mov.b32 {$0, $1}, a;
mov.b32 {$2, $3}, b;
mov.b32 {$4, $5}, c;
mov.b32 {$6, $7}, d;
}""")


# word M of the PRMT table, read from this lane's own copy of it (`planned_layouts.nuq_table`:
# 32 copies): a value ptxas must hold in a regular register. Read as one uniform value it
# stays in a uniform register, which PRMT cannot take, and is copied into a regular one
# before every use (~250 copies per loop iteration at head_dim 128, sm_90).
_LANE_WORD_ASM = tl.constexpr("""{
.reg .u32 l;
.reg .u64 a;
mov.u32 l, %laneid;
mad.wide.u32 a, l, 32, $1;
ld.global.nc.b32 $0, [a];
}""")


def _slot_lut_asm(slots: int) -> str:
    """`_WORD_LUT_ASM` with `slots` exact values patched in before the planes are formed:
    $17 4 x the word's first channel, then per slot 4 x its channel and the fp16 value's low
    and high byte, each repeated 4 times. A slot at channel c of the word (k = c - first,
    0 ... 7) sets selector nibble k of one word-wide selector (the base 0x3210 in both
    halves) to 4 + k mod 4, which a PRMT reads from the value's bytes instead of the
    level's: the low half-word's selector as is, the high one's shifted down 16. Shifts of
    32 or more (other words, unused slots) leave the base. 8 instructions per slot and word
    (a selector per half-word, built twice: 10)."""
    base = _WORD_LUT_ASM.value
    head, tail = base.split("prmt.b32 a, lo, hi, 0x6240;")
    mid, end = tail.split("prmt.b32 b, lo, hi, 0x6240;")
    sel = []
    for s in range(slots):
        sel += [f"sub.u32 k, ${18 + 3 * s}, $17;", "shl.b32 k, four, k;",
                f"or.b32 m{s}, k, 0x32103210;", f"shr.b32 n{s}, m{s}, 16;"]  # fmt: skip

    def patch(half: int) -> str:
        lines = []
        for s in range(slots):
            el, eh, m = 19 + 3 * s, 20 + 3 * s, f"{'mn'[half]}{s}"
            lines += [f"prmt.b32 lo, lo, ${el}, {m};", f"prmt.b32 hi, hi, ${eh}, {m};"]
        return "\n".join(lines) + "\n"

    regs = "".join(f"m{s}, n{s}, " for s in range(slots))
    head = head.replace(".reg .b32 s,", f".reg .b32 k, four, {regs}s,")
    head = head.replace("d;\n", "d;\nmov.b32 four, 4;\n" + "\n".join(sel) + "\n", 1)
    return (head + patch(0) + "prmt.b32 a, lo, hi, 0x6240;" + mid + patch(1)
            + "prmt.b32 b, lo, hi, 0x6240;" + end)  # fmt: skip


# per number of value slots handled inside the lookup (`_word_levels_slots`)
_SLOT_LUT_ASM1 = tl.constexpr(_slot_lut_asm(1))


_SLOT_LUT_ASM2 = tl.constexpr(_slot_lut_asm(2))


_SLOT_LUT_ASM3 = tl.constexpr(_slot_lut_asm(3))


_SLOT_LUT_ASM4 = tl.constexpr(_slot_lut_asm(4))


MAX_PATCHED_SLOTS = 4


# an fp16's low (high) byte repeated in the 4 bytes of a word, for `_slot_lut_asm`
_REPEAT_BYTES_ASM = tl.constexpr("""{
prmt.b32 $0, $2, 0, 0x0000;
prmt.b32 $1, $2, 0, 0x1111;
}""")


@triton.jit
def _slot_operands(rows, row_ok, nuq, inv, center, s: tl.constexpr):
    """Slot s of the tile's rows as `_slot_lut_asm` takes it: 4 x its channel (2^20 for rows
    past the segment: no word's) and its value normalised by the row's scale (inv: its
    reciprocal) and centre (the levels are patched before they are scaled), as fp16 low and
    high bytes x 4."""
    si_ptr, sv_ptr, s_t = nuq[11], nuq[12], nuq[13]
    idx = tl.load(si_ptr + rows * s_t + s, mask=row_ok, other=0).to(tl.int32)
    idx = tl.where(row_ok, idx * 4, 1 << 20)
    exact = tl.load(sv_ptr + rows * s_t + s, mask=row_ok, other=0.0).to(tl.float32)
    bits = ((exact - center) * inv).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
    lo, hi = tl.inline_asm_elementwise(_REPEAT_BYTES_ASM, "=r,=r,r", [bits],
                                       dtype=(tl.int32, tl.int32), is_pure=True, pack=1)  # fmt: skip
    return idx[:, None], lo[:, None], hi[:, None]


@triton.jit
def _word_levels_slots(words, lut, rows, row_ok, nuq, vs_ptr, vo_ptr, vq_t,
                       SLOTS: tl.constexpr):  # fmt: skip
    """`_word_levels` (PRMT) with the rows' SLOTS (1 ... 4) value exceptions in place, as
    normalised levels (`_slot_lut_asm`)."""
    BT: tl.constexpr = words.shape[0]
    W: tl.constexpr = words.shape[1]
    first = (tl.arange(0, W) * 32)[None, :]  # 4 x the first channel of each word
    # one approximate reciprocal of the row's scale for its slots (a division each cost 7
    # instructions; the quotient is rounded to fp16 next)
    scale = tl.load(vs_ptr + rows * vq_t, mask=row_ok, other=1.0).to(tl.float32)
    inv = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [scale],
                                    dtype=tl.float32, is_pure=True, pack=1)  # fmt: skip
    center = tl.load(vo_ptr + rows * vq_t, mask=row_ok, other=0.0).to(tl.float32)
    i0, l0_, h0_ = _slot_operands(rows, row_ok, nuq, inv, center, 0)
    args = [words, lut[0], lut[1], lut[2], lut[3], lut[4], lut[5], lut[6], lut[7], first,
            i0, l0_, h0_]  # fmt: skip
    if SLOTS >= 2:
        i1, l1_, h1_ = _slot_operands(rows, row_ok, nuq, inv, center, 1)
        args = args + [i1, l1_, h1_]
    if SLOTS >= 3:
        i2, l2_, h2_ = _slot_operands(rows, row_ok, nuq, inv, center, 2)
        args = args + [i2, l2_, h2_]
    if SLOTS >= 4:
        i3, l3_, h3_ = _slot_operands(rows, row_ok, nuq, inv, center, 3)
        args = args + [i3, l3_, h3_]
    cons: tl.constexpr = "=h,=h,=h,=h,=h,=h,=h,=h," + ",".join(["r"] * (10 + 3 * SLOTS))
    if SLOTS == 1:
        asm: tl.constexpr = _SLOT_LUT_ASM1
    elif SLOTS == 2:
        asm: tl.constexpr = _SLOT_LUT_ASM2
    elif SLOTS == 3:
        asm: tl.constexpr = _SLOT_LUT_ASM3
    else:
        asm: tl.constexpr = _SLOT_LUT_ASM4
    l0, l1, l2, l3, h0, h1, h2, h3 = tl.inline_asm_elementwise(
        asm, cons, args, dtype=(tl.float16,) * 8, is_pure=True, pack=1
    )
    lo = tl.reshape(tl.join(tl.join(l0, l2), tl.join(l1, l3)), (BT, 4 * W))
    hi = tl.reshape(tl.join(tl.join(h0, h2), tl.join(h1, h3)), (BT, 4 * W))
    return lo, hi


@triton.jit
def _pair_table(tab):
    """The byte-pair table of a 4-bit codebook (LUT 3): [256] int32, entry b the fp16 bits of
    level[b & 15] (the byte's even channel) in the low half and of level[b >> 4] (its odd
    channel) in the high half. Read once per program; `_pair_levels` gathers from it."""
    b = tl.arange(0, 256)
    lo = tl.load(tab + (b & 15)).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
    hi = tl.load(tab + (b >> 4)).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
    return (lo & 0xFFFF) | (hi << 16)


@triton.jit
def _lut_table(tab, LUT: tl.constexpr):
    """What the codebook decode of mode LUT reads besides `tab`: the byte-pair table (3),
    the PRMT table's words (2, `_lut_words`), nothing (0, 1)."""
    if LUT == 3:  # noqa: SIM108 (constexpr branches: one table is built)
        out = _pair_table(tab)
    else:
        out = _lut_words(tab, LUT)
    return out


@triton.jit
def _pair_levels(raw, pairs):
    """uint8 bytes of 4-bit codebook codes (any shape) -> int32 of the same shape, each the
    fp16 bits of its even channel's level (low half) and odd channel's (high half), one
    gather per byte from the byte-pair table (`_pair_table`, held in shared memory by the
    gather). sm_90, NUQ4 as stored, Llama-like: ~3 instructions per byte (byte extract,
    address, LDS) where the PRMT lookup (`_LUT_ASM`) took 21 per 4 bytes."""
    idx = tl.reshape(raw.to(tl.int32), (raw.numel,), can_reorder=False)
    return tl.reshape(tl.gather(pairs, idx, 0), raw.shape)


@triton.jit
def _split_pairs(x):
    """int32 level pairs (`_pair_levels`) -> fp16 (even channels, odd channels)."""
    lo = (x & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)
    hi = (x >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    return lo, hi


@triton.jit
def _lut_words(tab, LUT: tl.constexpr):
    """The PRMT table (`_LUT_ASM`) of a 4-bit codebook, read once per program (LUT 2);
    zeros otherwise. tab: `planned_layouts.nuq_table` (the levels, then the words' bits)."""
    if LUT == 2:
        w = tab.to(tl.pointer_type(tl.int32), bitcast=True) + 16
        words = (
            _lane_word(w, 0),
            _lane_word(w, 1),
            _lane_word(w, 2),
            _lane_word(w, 3),
            _lane_word(w, 4),
            _lane_word(w, 5),
            _lane_word(w, 6),
            _lane_word(w, 7),
        )
    else:
        words = (0, 0, 0, 0, 0, 0, 0, 0)
    return words


@triton.jit
def _lane_word(w, M: tl.constexpr):
    return tl.inline_asm_elementwise(_LANE_WORD_ASM, "=r,l", [w + M], dtype=tl.int32,
                                     is_pure=True, pack=1)  # fmt: skip


@triton.jit
def _lut_planes(raw, tab, lut, LUT: tl.constexpr):
    """uint8 bytes of 4-bit codebook codes [..., n] -> levels (low nibbles, high nibbles)
    [..., n]: fp16 from the byte-pair table (LUT 3, fp16 dots: `_pair_levels`), fp16
    through PRMT (LUT 2, compiled), or fp32 gathers from the table (LUT 1: parity mode)."""
    if LUT == 3:
        lo, hi = _split_pairs(_pair_levels(raw, lut))
    elif LUT == 2:
        lo, hi = tl.inline_asm_elementwise(
            _LUT_ASM, "=r,=r,=r,=r," + ",".join(["r"] * 33),
            [raw, lut[0], lut[1], lut[2], lut[3], lut[4], lut[5], lut[6], lut[7]],
            dtype=(tl.float16, tl.float16), is_pure=True, pack=4,
        )  # fmt: skip
    else:
        c = raw.to(tl.int32)
        lo = tl.load(tab + (c & 15))
        hi = tl.load(tab + (c >> 4))
    return lo, hi


@triton.jit
def _word_levels(words, tab, lut, LUT: tl.constexpr):
    """int32 words [BT, W] of 4-bit codebook codes -> levels (even channels, odd channels)
    [BT, 4 W], column order as `_word_nibbles` returns it."""
    if LUT == 2:
        l0, l1, l2, l3, h0, h1, h2, h3 = tl.inline_asm_elementwise(
            _WORD_LUT_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r,r,r,r,r,r,r",
            [words, lut[0], lut[1], lut[2], lut[3], lut[4], lut[5], lut[6], lut[7]],
            dtype=(tl.float16,) * 8, is_pure=True, pack=1,
        )  # fmt: skip
    else:  # nibble k of the word is channel 8w + k
        l0 = tl.load(tab + (words & 15))
        h0 = tl.load(tab + ((words >> 4) & 15))
        l1 = tl.load(tab + ((words >> 8) & 15))
        h1 = tl.load(tab + ((words >> 12) & 15))
        l2 = tl.load(tab + ((words >> 16) & 15))
        h2 = tl.load(tab + ((words >> 20) & 15))
        l3 = tl.load(tab + ((words >> 24) & 15))
        h3 = tl.load(tab + ((words >> 28) & 15))
    BT: tl.constexpr = words.shape[0]
    W: tl.constexpr = words.shape[1]
    lo = tl.reshape(tl.join(tl.join(l0, l2), tl.join(l1, l3)), (BT, 4 * W))
    hi = tl.reshape(tl.join(tl.join(h0, h2), tl.join(h1, h3)), (BT, 4 * W))
    return lo, hi


@triton.jit
def _key_exceptions(scores, corr, PRECISION: tl.constexpr):
    """Scores [R, BT] plus the key exceptions' corrections (`_key_corrections`), added
    through the tensor cores (identity x corrections): the scores keep the dot's register
    layout, where an elementwise add would move the softmax to the loads' one."""
    R: tl.constexpr = scores.shape[0]
    eye = (tl.arange(0, R)[:, None] == tl.arange(0, R)[None, :]).to(corr.dtype)
    return tl.dot(eye, corr, acc=scores, input_precision=PRECISION)


@triton.jit
def _key_corrections(R: tl.constexpr, BT: tl.constexpr, rows, row_ok, k_ptr, k_t, nuq,
                     OP: tl.constexpr, ROPE: tl.constexpr = False, rope=None,
                     D: tl.constexpr = 0, KP: tl.constexpr = 1, VQ: tl.constexpr = 0,
                     VQB: tl.constexpr = 0, TRN: tl.constexpr = 0,
                     KE: tl.constexpr = 1):  # fmt: skip
    """[R, BT] in OP: how far the flat key exceptions of the tile's rows (KVQuant's ~1%
    exact keys) move its scores: entry e of row t replaces channel idx, so its score moves
    by q[idx] x (exact - decoded), decoded = level[code] x scale[idx] + offset[idx] as the
    dense dot saw it (the clipped code at idx, read back from the row's codes). A small
    pass per tile, KE entries of every row a step ([BT, KE]: loads of the entries and the
    codes, one [RQ, BT, KE] gather of the real query rows; RQ: G x Q padded) until the
    tile's longest row is done: real rows' counts vary (Gemma 3 270M, NUQ4 at 1%,
    wikitext: 2.9 per row, 9.8 in a 64-row tile's longest), and a step costs about the
    same whatever share of the program's threads KE fills (`planned_decode._per_step`).
    nuq: the kernel's NUQ pointers (`decode_splits_kernel`).

    ROPE: keys stored before RoPE (KVQuant's layout), rope = (positions [BT], unit table,
    amplitude; `planned_decode.rope_planes`): the correction delta at channel c rotates
    with its partner channel c -/+ D/2, so it moves the score by delta x a_f (cos q[c] +/-
    sin q[partner]) at the row's position (f = c mod D/2, + below D/2): a second query
    gather and two table gathers per entry. VQ (M), VQB (bits): vector-codebook keys over
    RoPE pairs, tab their codebook (`_vq_key_coordinate`)."""
    tab, cnt_ptr, cnt_t, first_ptr, first_t, e_idx, e_val = nuq[:7]
    fk, fkb, q_row, q_scale = nuq[7], nuq[8], nuq[9], nuq[10]
    cnt = tl.load(cnt_ptr + rows * cnt_t, mask=row_ok, other=0).to(tl.int32)  # [BT]
    first = tl.load(first_ptr + rows * first_t, mask=row_ok, other=0)[:, None]  # [BT, 1]
    RQ: tl.constexpr = q_row.shape[0]
    corr = tl.zeros([RQ, BT], tl.float32)
    row = k_ptr + rows[:, None] * k_t  # [BT, 1]
    if ROPE:
        pos, rope_tab, amp = rope
        trow = rope_tab + pos[:, None] * D  # [BT, 1]: each row's table row (cos, then sin)
    k = tl.arange(0, KE)[None, :]
    for e0 in range(0, tl.max(cnt, axis=0), KE):
        e = e0 + k  # [BT, KE]
        has = e < cnt[:, None]
        idx = tl.load(e_idx + first + e, mask=has, other=0).to(tl.int32)
        exact = tl.load(e_val + first + e, mask=has, other=0).to(tl.float32)
        if VQ:  # vector codebook keys: the coordinate of the channel's group
            level = _vq_key_coordinate(row, idx, has, tab, D, VQ, VQB, TRN)
        else:
            byte = tl.load(row + (idx >> 1), mask=has, other=0).to(tl.int32)
            level = tl.load(tab + ((byte >> ((idx & 1) * 4)) & 15), mask=has, other=0.0)
        s = tl.load(fk + idx, mask=has, other=0.0)
        o = tl.load(fkb + idx, mask=has, other=0.0)
        delta = tl.where(has, exact - (level * s + o), 0.0)  # [BT, KE]
        qv = tl.load(q_row[:, None, None] + idx[None, :, :], mask=has[None, :, :], other=0.0)
        if ROPE:
            qv = _rotated_query(qv, idx, has, q_row, trow, amp, D, KP)
        corr += tl.sum(qv.to(tl.float32) * delta[None, :, :], axis=2)
    return _pad_rows(corr * q_scale, R).to(OP)


@triton.jit
def _rotated_query(qv, idx, has, q_row, trow, amp, D: tl.constexpr, KP: tl.constexpr):
    """[RQ, BT, KE] the query's weight on a pre-RoPE key's channel idx [BT, KE] once the
    key is rotated: a_f (cos q[idx] + sin q[idx + D/2]) below D/2, a_f (cos q[idx] - sin
    q[idx - D/2]) above, at table rows trow [BT, 1] (f = idx mod D/2, its table column in
    plane order: (f mod KP) x D / (2 KP) + f / KP). qv: q[idx]."""
    H: tl.constexpr = D // 2
    f = idx % H
    upper = idx >= H
    col = (f % KP) * (H // KP) + f // KP
    a = tl.load(amp + col, mask=has, other=0.0)
    c = tl.load(trow + col, mask=has, other=0.0).to(tl.float32) * a
    s = tl.load(trow + H + col, mask=has, other=0.0).to(tl.float32) * a
    s = tl.where(upper, -s, s)
    partner = tl.where(upper, idx - H, idx + H)
    qp = tl.load(q_row[:, None, None] + partner[None, :, :], mask=has[None, :, :], other=0.0)
    return qv.to(tl.float32) * c[None, :, :] + qp.to(tl.float32) * s[None, :, :]


@triton.jit
def _pad_rows(x, R: tl.constexpr):
    """[RQ, N] -> [R, N], rows RQ ... R - 1 zero (R / RQ a power of two)."""
    for _ in tl.static_range(6):  # up to 64 rows
        if x.shape[0] < R:
            x = tl.reshape(tl.permute(tl.join(x, tl.zeros_like(x)), (2, 0, 1)),
                           (2 * x.shape[0], x.shape[1]))  # fmt: skip
    return x


# one word of 4 code bytes ($4) -> their indices into an extended byte-pair table: index k
# is byte k of $4 | byte k of $5 << 8 (bytes 2 and 3 zero: $5's byte k, below 0x80,
# sign-replicated), so that a byte with $5's byte k set reads an entry past the 256 pairs
_PAIR_INDEX_ASM = tl.constexpr("""{
prmt.b32 $0, $4, $5, 0xCC40;
prmt.b32 $1, $4, $5, 0xDD51;
prmt.b32 $2, $4, $5, 0xEE62;
prmt.b32 $3, $4, $5, 0xFF73;
}""")


@triton.jit
def _pair_index(words, hi, ASM: tl.constexpr):
    """int32 words [BT, W] of code bytes (hi: the high index bytes, `_PAIR_INDEX_ASM`) ->
    [BT x W x 4] int32 indices into the extended pair table, bytes in row order."""
    if ASM:
        i0, i1, i2, i3 = tl.inline_asm_elementwise(
            _PAIR_INDEX_ASM, "=r,=r,=r,=r,r,r", [words, hi], dtype=(tl.int32,) * 4,
            is_pure=True, pack=1,
        )  # fmt: skip
    else:
        i0 = (words & 255) | ((hi & 255) << 8)
        i1 = ((words >> 8) & 255) | (((hi >> 8) & 255) << 8)
        i2 = ((words >> 16) & 255) | (((hi >> 16) & 255) << 8)
        i3 = ((words >> 24) & 255) | (((hi >> 24) & 255) << 8)
    # join(join(a, c), join(b, d)) flattens to a, b, c, d per word
    idx = tl.join(tl.join(i0, i2), tl.join(i1, i3))
    return tl.reshape(idx, (idx.numel,), can_reorder=False)


@triton.jit
def _slot_word(row, rows, nuq, s: tl.constexpr, D: tl.constexpr):
    """Slot s of the tile's rows, [BT, 1] each (row: their codes as int32 words, rows: their
    indices, in the layout of the tile's words): (channel, the word of codes holding it)."""
    c = tl.load(nuq[11] + rows * nuq[13] + s).to(tl.int32)
    # an unused slot (channel D) reads the last word, unmasked: it matches no word's index
    return c, tl.load(row + tl.minimum(c >> 3, D // 8 - 1))


@triton.jit
def _slot_redirect(alt, alt_hi, c, co, e, OWN: tl.constexpr):
    """Slot co's byte (e: its entry's index - 256) redirected in slot c's word `alt` and its
    high index bits `alt_hi`, where it is the same word; OWN: co is slot c itself."""
    at = ((co >> 1) & 3) * 8
    if OWN:
        alt = (alt & ~(255 << at)) | (e << at)
        alt_hi = alt_hi | (1 << at)
    else:
        same = (co >> 3) == (c >> 3)
        alt = tl.where(same, (alt & ~(255 << at)) | (e << at), alt)
        alt_hi = tl.where(same, alt_hi | (1 << at), alt_hi)
    return alt, alt_hi


@triton.jit
def _slot_entries(ptr, span, stride_t, vs_ptr, vo_ptr, vq_t, nuq, ptab, BT: tl.constexpr,
                  D: tl.constexpr, V_HAS_OFF: tl.constexpr, SLOTS: tl.constexpr,
                  SP: tl.constexpr, ASM: tl.constexpr):  # fmt: skip
    """[SP x BT] int32, entry t SP + s: slot s of the tile's row t (span: its first row and
    the segment's last, the tile's rows clamped to it, computed in this layout) as its
    byte's pair of levels from the global pair table `ptab` with the halves of every slot
    of that byte replaced by their exact values normalised by the row's scale and centre
    (fp16 bits). One entry per thread, in a 1-D layout of their own: built from the
    words' per-row layout they were computed for every slot in each of two layouts
    (Triton rematerialised the loads) and converted through shared memory into the
    table's."""
    si_ptr, sv_ptr, s_t = nuq[11], nuq[12], nuq[13]
    j = tl.arange(0, SP * BT)
    er = tl.minimum(span[0] + j // SP, span[1])  # rows as `_segment_loop` clamps them
    s = j % SP
    scale = tl.load(vs_ptr + er * vq_t).to(tl.float32)
    center = tl.zeros_like(scale)
    if V_HAS_OFF:
        center = tl.load(vo_ptr + er * vq_t).to(tl.float32)
    inv = 1.0 / scale
    if ASM:  # one approximate reciprocal (the quotient is rounded to fp16 next)
        inv = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [scale],
                                        dtype=tl.float32, is_pure=True, pack=1)  # fmt: skip
    c = tl.load(si_ptr + er * s_t + s, mask=s < SLOTS, other=D).to(tl.int32)
    # unused slots read the row's last word, unmasked: no byte is redirected to them
    word = tl.load(ptr.to(tl.pointer_type(tl.int32)) + er * (stride_t // 4)
                   + tl.minimum(c >> 3, D // 8 - 1))  # fmt: skip
    entry = tl.load(ptab + ((word >> ((c >> 1) & 3) * 8) & 255))
    for o in tl.static_range(SLOTS):  # every slot of this byte (s itself included)
        co = tl.load(si_ptr + er * s_t + o).to(tl.int32)
        exact = tl.load(sv_ptr + er * s_t + o).to(tl.float32)
        bits = ((exact - center) * inv).to(tl.float16).to(tl.int16, bitcast=True)
        bits = bits.to(tl.int32) & 0xFFFF
        half = 0xFFFF << ((co & 1) * 16)
        entry = tl.where((co >> 1) == (c >> 1), (entry & ~half) | ((bits | (bits << 16)) & half),
                         entry)  # fmt: skip
    return entry


@triton.jit
def _slot_table(pairs, ent):
    """[512] int32: the 256 level pairs, then the slots' entries (`_slot_entries`), then
    zeros."""
    for _ in tl.static_range(8):
        if ent.shape[0] < 256:
            ent = tl.reshape(tl.permute(tl.join(ent, tl.zeros_like(ent)), (1, 0)),
                             (2 * ent.shape[0],))  # fmt: skip
    return tl.reshape(tl.permute(tl.join(pairs, ent), (1, 0)), (512,))


@triton.jit
def _pair_values(ptr, rows, row_ok, stride_t, vs_ptr, vo_ptr, vq_t, pairs, nuq,
                 D: tl.constexpr, V_HAS_OFF: tl.constexpr, OP: tl.constexpr,
                 SLOTS: tl.constexpr, ASM: tl.constexpr, span=None):  # fmt: skip
    """A NUQ4 value tile [BT, D] in channel order, in OP: the codes read as int32 words, each
    byte's two levels from the byte-pair table (`_pair_levels`, one gather per byte: a
    pair is two neighbouring channels, no split into planes), then the row's scale and
    centre. SLOTS (S x BT <= 256): the rows' exact values, by redirecting the gather: the
    byte of a slot's channel reads entry 256 + t SP + s of an extended table, its pair of
    levels with the slot's half replaced by the exact value normalised (every slot of that
    byte in it), one entry per thread (`_slot_entries`; span: the tile's first row and the
    segment's last); the word holding it is swapped per row for one whose byte is
    t SP + s and whose high index byte 1 (`_pair_index`): one compare and two selects per
    word and slot, where the PRMT lookup patched 8 instructions per word and slot. sm_90,
    Llama-like NUQ4 as stored: 61.8 warp-instructions per row, 54.1 without the slots
    (the PRMT lookup: 66.2, 63.0; the entries built per row in the words' layout and
    again in the table's, 63.1)."""
    BT: tl.constexpr = rows.shape[0]
    W: tl.constexpr = D // 8
    rows = rows[:, None]  # [BT, 1]: every per-row value in the words' layout
    row = ptr.to(tl.pointer_type(tl.int32)) + rows * (stride_t // 4)
    words = tl.load(row + tl.arange(0, W)[None, :])  # [BT, W] (rows clamped: no mask)
    scale = tl.load(vs_ptr + rows * vq_t)
    center = tl.zeros_like(scale)
    if V_HAS_OFF:
        center = tl.load(vo_ptr + rows * vq_t)
    hi = tl.zeros_like(words)
    table = pairs
    if SLOTS:
        ptab = nuq[14].to(tl.pointer_type(tl.int32), bitcast=True) + 16 + 256
        SP: tl.constexpr = 1 if SLOTS == 1 else (2 if SLOTS == 2 else 4)  # entries per row
        fields = ()
        for s in tl.static_range(SLOTS):
            fields = fields + (_slot_word(row, rows, nuq, s, D),)
        local = tl.arange(0, BT)[:, None]
        wi = tl.arange(0, W)[None, :]
        for s in tl.static_range(SLOTS):
            c, alt = fields[s]
            alt_hi = tl.zeros_like(alt)
            for o in tl.static_range(SLOTS):  # every slot of this word
                alt, alt_hi = _slot_redirect(alt, alt_hi, c, fields[o][0], local * SP + o,
                                             o == s)  # fmt: skip
            m = wi == (c >> 3)
            words = tl.where(m, alt, words)
            hi = tl.where(m, alt_hi, hi)
        ent = _slot_entries(ptr, span, stride_t, vs_ptr, vo_ptr, vq_t, nuq, ptab, BT, D,
                            V_HAS_OFF, SLOTS, SP, ASM)  # fmt: skip
        table = _slot_table(pairs, ent)
    x = tl.reshape(tl.gather(table, _pair_index(words, hi, ASM), 0), (BT, D // 2))
    if ASM:  # the row's scale and centre by one fma.rn.f16x2 per pair (in Triton, the
        # pairs' halves were swapped around the HFMA2: 4 PRMTs per 8 codes)
        s2 = scale.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        o2 = center.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        y = tl.inline_asm_elementwise("fma.rn.f16x2 $0, $1, $2, $3;", "=r,r,r,r",
                                      [x, s2 | (s2 << 16), o2 | (o2 << 16)], dtype=tl.int32,
                                      is_pure=True, pack=1)  # fmt: skip
        lo, odd = tl.inline_asm_elementwise("mov.b32 {$0, $1}, $2;", "=h,=h,r", [y],
                                            dtype=(tl.float16, tl.float16), is_pure=True,
                                            pack=1)  # fmt: skip
        v = tl.reshape(tl.join(lo, odd), (BT, D)).to(OP)
    else:
        lo, odd = _split_pairs(x)
        v = tl.reshape(tl.join(lo, odd), (BT, D)).to(OP) * scale.to(OP)
        if V_HAS_OFF:
            v = v + center.to(OP)
    return v


@triton.jit
def _value_slots(v_lo, v_hi, rows, row_ok, nuq, VP: tl.constexpr, SLOTS: tl.constexpr):
    """A decoded value tile (planes [BT, D / VP] in the dots' dtype) with its rows' SLOTS
    exact exceptions put in place (slot channel D: unused, matches no column)."""
    si_ptr, sv_ptr, s_t = nuq[11], nuq[12], nuq[13]
    col = tl.arange(0, v_lo.shape[1])[None, :] * VP
    for s in tl.static_range(SLOTS):
        idx = tl.load(si_ptr + rows * s_t + s, mask=row_ok, other=0).to(tl.int32)[:, None]
        val = tl.load(sv_ptr + rows * s_t + s, mask=row_ok, other=0.0).to(v_lo.dtype)[:, None]
        v_lo = tl.where(col == idx, val, v_lo)
        if VP == 2:
            v_hi = tl.where(col + 1 == idx, val, v_hi)
    return v_lo, v_hi


@triton.jit
def _key_planes(ptr, rows, row_ok, stride_t, ZERO: tl.constexpr, KP: tl.constexpr,
                KW: tl.constexpr, FULL: tl.constexpr, ASM: tl.constexpr,
                FP8: tl.constexpr, LUT: tl.constexpr = 0, tab=None, lut=None):  # fmt: skip
    """A key tile in plane order: (even channels, odd channels) [BT, KW] for 4-bit codes
    (KP 2) or a full-precision segment loaded the same way; (all channels, unused) for
    8-bit codes (KP 1). Codes come back as fp16 code - zero; LUT: as 4-bit codebook levels
    (`_lut_planes`, tab and lut the table)."""
    j = tl.arange(0, KW)
    ok = row_ok[:, None]
    base = ptr + rows[:, None] * stride_t
    if FULL:
        lo = tl.load(base + (j * KP)[None, :], mask=ok, other=0.0)
        hi = lo
        if KP == 2:
            hi = tl.load(base + (j * 2 + 1)[None, :], mask=ok, other=0.0)
    else:
        raw = tl.load(base + j[None, :], mask=ok, other=0)  # [BT, KW] bytes
        if LUT:  # 4-bit codebook levels (`_lut_planes`)
            lo, hi = _lut_planes(raw, tab, lut, LUT)
        else:
            lo, hi = _planes(raw, ZERO, KP, ASM, FP8)
    return lo, hi


@triton.jit
def _value_planes(ptr, rows, row_ok, stride_t, vs_ptr, vo_ptr, vq_t, ZERO: tl.constexpr,
                  VP: tl.constexpr, NG: tl.constexpr, GW: tl.constexpr, FULL: tl.constexpr,
                  V_HAS_OFF: tl.constexpr, OP: tl.constexpr, ASM: tl.constexpr,
                  FP8: tl.constexpr, FACTOR: tl.constexpr,
                  WORDS: tl.constexpr = False, LUT: tl.constexpr = 0, tab=None,
                  lut=None, PATCH: tl.constexpr = 0, nuq=None):  # fmt: skip
    """A value tile in plane order, [BT, D / VP] per plane in the dots' dtype OP: plane k,
    column c is channel c * VP + k. Packed rows decode per group of GW columns with their
    row's group scale and offset (code - zero) * scale + offset, in OP; fp8 codes (FP8,
    decoded to value / FACTOR) with scale x FACTOR. WORDS: codes read as 32-bit words
    (rows on 4-byte boundaries), `_word_nibbles`, `_word_bytes`. LUT: 4-bit codebook levels
    (`_lut_planes`, `_word_levels`) instead of code - zero; PATCH: that many value slots put
    in by the word lookup (`_word_levels_slots`, `nuq` the kernel's NUQ pointers)."""
    if FULL:
        c = tl.arange(0, NG * GW)
        base = ptr + rows[:, None] * stride_t
        lo = tl.load(base + (c * VP)[None, :], mask=row_ok[:, None], other=0.0).to(OP)
        hi = lo
        if VP == 2:
            hi = tl.load(base + (c * 2 + 1)[None, :], mask=row_ok[:, None], other=0.0).to(OP)
    else:
        g = tl.arange(0, NG)
        j = tl.arange(0, GW)
        ok = row_ok[:, None, None]
        byte = (g[:, None] * GW + j[None, :])[None, :, :]  # [1, NG, GW]: one byte per code
        BT: tl.constexpr = rows.shape[0]
        if WORDS:  # [BT, NG x GW / 4] words (a byte per column of a plane) -> [BT, NG, GW]
            w = tl.arange(0, NG * GW // 4)
            wptr = ptr.to(tl.pointer_type(tl.int32)) + rows[:, None] * (stride_t // 4)
            words = tl.load(wptr + w[None, :], mask=row_ok[:, None], other=0)
            if PATCH:  # the rows' value slots put in by the lookup itself
                lo, hi = _word_levels_slots(words, lut, rows, row_ok, nuq, vs_ptr, vo_ptr, vq_t,
                                            PATCH)  # fmt: skip
            elif LUT:
                lo, hi = _word_levels(words, tab, lut, LUT)
            elif VP == 2:
                lo, hi = _word_nibbles(words, ZERO, ASM)
            else:
                lo = _word_bytes(words, ZERO, FP8, ASM)
                hi = lo
            lo = tl.reshape(lo, (BT, NG, GW))
            hi = tl.reshape(hi, (BT, NG, GW))
        else:
            raw = tl.load(ptr + rows[:, None, None] * stride_t + byte, mask=ok, other=0)
            if LUT:
                lo, hi = _lut_planes(raw, tab, lut, LUT)
            else:
                lo, hi = _planes(raw, ZERO, VP, ASM, FP8)  # [BT, NG, GW]
        q_off = rows[:, None] * vq_t + g[None, :]  # [BT, NG]
        s = tl.load(vs_ptr + q_off, mask=row_ok[:, None], other=0.0)
        if FACTOR != 1.0:
            s = s.to(tl.float32) * FACTOR
        s = s.to(OP)[:, :, None]
        if V_HAS_OFF:
            o = tl.load(vo_ptr + q_off, mask=row_ok[:, None], other=0.0).to(OP)[:, :, None]
            lo = lo.to(OP) * s + o
            hi = hi.to(OP) * s + o
        else:
            lo = lo.to(OP) * s
            hi = hi.to(OP) * s
        lo = tl.reshape(lo, (BT, NG * GW))
        hi = tl.reshape(hi, (BT, NG * GW))
    return lo, hi
