"""Triton kernels of the planned decode path (`decode_attention.planned_call`; imported
lazily: it imports triton).

One launch covers every segment of a layer call (sink rows, packed main rows, the
full-precision residual window): the grid is (batch x KV head, split), and split s
of a work item reads tiles [s * N // S, (s + 1) * N // S) of the N tiles of all its
segments laid end to end (`launch_plan.split_tiles`), each segment through its own
constexpr-specialised loop. The G query heads of the KV head and the Q query
positions are the R rows of the dots.

The packed segment's loop reads raw code bytes (the pipeliner stages them through shared
memory, `num_stages` deep) and decodes them in plane order: the low nibbles of a row's
bytes are its even channels, the high nibbles its odd ones (8-bit codes: one plane). The
query is loaded in that order and the output stored back in channel order, so no
interleave runs per tile. A code becomes fp16 by the exponent bias: the bits 0x6400 | c
read as fp16 are 1024 + c exactly, so one OR and one subtraction replace an integer-to-
float conversion (compiled, four code bytes per register through inline PTX); fp8 codes
have their bits moved into an fp16 (`_fp8_plane`), a table-free exact decode; 4-bit
codebook codes (NUQ4) become their fp16 levels with fp16 dots by one gather per code byte
from a 256-entry table of level pairs held in shared memory (`_pair_levels`), values with
exact slots by PRMT byte selection from the table held in 8 registers (`_LUT_ASM`), the
slots patched in by the same lookup (`_slot_lut_asm`); the keys' exact entries correct the
scores (`_key_corrections`: query gathers per entry, several entries of each row a step,
added through an MMA, `_key_exceptions`). Codes with
per-row or per-head qparams (values; per-token keys) load as 32-bit words: the value
dot's operand layout pairs rows, and a byte tile carried that layout back to shared
memory as one-byte reads plus PRMTs to regroup them (about 12 of 42 warp-instructions
per row for Llama-like KV4, 20 of 74 for Gemma 3). Static per-channel key qparams are
folded into the query once per program. Per-row group value qparams apply to the decoded
fp16 value tile, one fused multiply-add per two channels (HFMA2): applying the scales to
the probabilities instead, as [groups, R, BT] products over the 16 padded query rows,
then the offsets through a row sum, compiled to 1.3-1.8x the loop instructions of this
form for Llama-like KV4 (sm_90 SASS, bench/kernel_resources.py), the products and the
batched dots' layouts costing more than the 64 channels per row they save. Dots take
fp16 operands (exact fp32 under the interpreter and in parity mode) with fp32
accumulation.

Keys stored before RoPE (ROPE0..2, per segment) are rotated in the loop (`_rope_scores`):
the channels of each plane split into halves whose columns are RoPE partners (c, c +
D/2), decoded (static qparams now applied to the tile, one HFMA2 per two channels:
rotation does not commute with a per-channel scale), rotated, and dotted with the query
in the same halves (NUQ keys from the byte-pair table, and full-precision keys: in
channel order, the halves' columns channels c and c + D/2). A tile whose rows sit at one run of positions p0 + i (a sequence's
rows: nearly every tile) takes R(p0 + i) = R(p0) R(i): R(i) from rows 0 .. BT - 1 of a
unit table, the same every tile (L1 hits, no per-row gather from L2), R(p0) onto the query
(rotated back, once per tile); other tiles gather each row's own table row. The table's
amplitude (attention scaling) goes onto the query once. Angle addition matches tables
whose angles are exact; tables computed with fp32 angles (p x theta rounded, as
transformers computes them) differ from it by their own rounding, |p theta| x 2^-24 rad
(2e-3 rad on the fastest pair at position 32K).

The partial states go to one fp32 buffer [B x H_kv, S, R, D + 2] (numerator, then
the running max in log2 units, then the denominator), merged by
`combine_splits_kernel`; with one split per work item the kernel normalises and
writes the output itself.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOW_NIBBLES, HIGH_NIBBLES = "0x000F000F", "0x00F000F0"


def _nibbles_ptx(*masks: str) -> str:
    """PTX: 4 code bytes in one register -> 4 fp16 per mask (exponent bias, article 0x09D):
    PRMT spreads bytes 0, 1 (then 2, 3) over the two halves of a register, one LOP3 each
    masks a nibble and ORs in 0x6400, giving 1024 + low nibble (1024 + 16 x high nibble)
    as fp16 pairs; outputs $0, $1 per mask in order, the code word last."""
    lines = [".reg .b32 t0, t1;"]
    src = f"${2 * len(masks)}"
    lines += [f"prmt.b32 t0, {src}, 0, 0x4140;", f"prmt.b32 t1, {src}, 0, 0x4342;"]
    for i, mask in enumerate(masks):
        for j in (0, 1):
            lines.append(f"lop3.b32 ${2 * i + j}, t{j}, {mask}, 0x64006400, 0xea;")
    return "{\n" + "\n".join(lines) + "\n}"


# 4 code bytes -> 8 fp16: both planes
_NIBBLES_ASM = tl.constexpr(_nibbles_ptx(LOW_NIBBLES, HIGH_NIBBLES))
# 4 code bytes -> 4 fp16 1024 + byte
_BYTES_ASM = tl.constexpr("""{
.reg .b32 t0, t1;
prmt.b32 t0, $2, 0, 0x4140;
prmt.b32 t1, $2, 0, 0x4342;
or.b32 $0, t0, 0x64006400;
or.b32 $1, t1, 0x64006400;
}""")


# 4 fp8 code bytes -> 4 fp16 whose bits are (c & 0x80) << 8 | (c & 0x7F) << 7: each byte
# to the high byte of a half (PRMT), then the magnitude one bit down under the sign (e4m3;
# `fp8.fp16_placement`)
_E4M3_ASM = tl.constexpr("""{
.reg .b32 t0, t1, m0, m1;
prmt.b32 t0, $2, 0, 0x1404;
prmt.b32 t1, $2, 0, 0x3424;
and.b32 m0, t0, 0x7F007F00;
and.b32 m1, t1, 0x7F007F00;
shr.b32 m0, m0, 1;
shr.b32 m1, m1, 1;
lop3.b32 $0, t0, 0x80008000, m0, 0xea;
lop3.b32 $1, t1, 0x80008000, m1, 0xea;
}""")
# e5m2 is the high byte of an fp16: c << 8
_E5M2_ASM = tl.constexpr("""{
prmt.b32 $0, $2, 0, 0x1404;
prmt.b32 $1, $2, 0, 0x3424;
}""")


@triton.jit
def _fp8_plane(raw, SHIFT: tl.constexpr, ASM: tl.constexpr):
    """uint8 fp8 codes -> fp16 of value / factor (`kvq.quant.fp8.fp16_placement`: the
    code's bits moved into an fp16, SHIFT 7 for e4m3, 8 for e5m2), exact."""
    if ASM:
        if SHIFT == 8:
            x = tl.inline_asm_elementwise(
                _E5M2_ASM, "=r,=r,r", [raw], dtype=tl.float16, is_pure=True, pack=4
            )
        else:
            x = tl.inline_asm_elementwise(
                _E4M3_ASM, "=r,=r,r", [raw], dtype=tl.float16, is_pure=True, pack=4
            )
    else:
        c = raw.to(tl.int32)
        bits = ((c & 0x80) << 8) | ((c & 0x7F) << SHIFT)
        x = bits.to(tl.uint16).to(tl.float16, bitcast=True)
    return x


@triton.jit
def _planes(raw, ZERO: tl.constexpr, PLANES: tl.constexpr, ASM: tl.constexpr,
            FP8: tl.constexpr = 0):  # fmt: skip
    """uint8 code bytes -> fp16 planes (code - ZERO, exact): (low nibbles, high nibbles)
    for PLANES 2, (bytes, bytes) for 1. The exponent bias: the bits 0x6400 | c read as fp16
    are 1024 + c, so no integer-to-float conversion runs. ASM: four bytes per instruction
    pair in one register (the compiled path); else the same arithmetic per element (the
    interpreter). FP8 (a mantissa shift, `_fp8_plane`): fp8 codes, one plane."""
    if FP8:
        lo = _fp8_plane(raw, FP8, ASM)
        hi = lo
    elif ASM:
        if PLANES == 2:
            lo, hi = tl.inline_asm_elementwise(
                _NIBBLES_ASM, "=r,=r,=r,=r,r", [raw], dtype=(tl.float16, tl.float16),
                is_pure=True, pack=4,
            )  # fmt: skip
            lo = lo - (1024.0 + ZERO)
            hi = hi * 0.0625 - (64.0 + ZERO)  # (1024 + 16 c) / 16 - 64 = c
        else:
            lo = tl.inline_asm_elementwise(
                _BYTES_ASM, "=r,=r,r", [raw], dtype=tl.float16, is_pure=True, pack=4
            )
            lo = lo - (1024.0 + ZERO)
            hi = lo
    else:
        c = raw.to(tl.int16)
        if PLANES == 2:
            lo = ((c & 15) | 0x6400).to(tl.float16, bitcast=True) - (1024.0 + ZERO)
            hi = ((c >> 4) | 0x6400).to(tl.float16, bitcast=True) - (1024.0 + ZERO)
        else:
            lo = (c | 0x6400).to(tl.float16, bitcast=True) - (1024.0 + ZERO)
            hi = lo
    return lo, hi


# one 32-bit word of 4-bit codes (bytes b0..b3: channels 8w .. 8w + 7, low nibble first)
# -> 1024 + c of channels 8w, 8w + 2, 8w + 4, 8w + 6 and 1024 + 16 c of the odd ones, as
# fp16 in 16-bit registers (the halves of the _NIBBLES_ASM results)
_WORD_NIBBLES_ASM = tl.constexpr("""{
.reg .b32 t0, t1, a, b, c, d;
prmt.b32 t0, $8, 0, 0x4140;
prmt.b32 t1, $8, 0, 0x4342;
lop3.b32 a, t0, 0x000F000F, 0x64006400, 0xea;
lop3.b32 b, t1, 0x000F000F, 0x64006400, 0xea;
lop3.b32 c, t0, 0x00F000F0, 0x64006400, 0xea;
lop3.b32 d, t1, 0x00F000F0, 0x64006400, 0xea;
mov.b32 {$0, $1}, a;
mov.b32 {$2, $3}, b;
mov.b32 {$4, $5}, c;
mov.b32 {$6, $7}, d;
}""")


@triton.jit
def _word_nibbles(words, ZERO: tl.constexpr, ASM: tl.constexpr):
    """int32 words [BT, W] of 4-bit codes -> planes (even channels, odd channels) [BT, 4 W]
    of fp16 code - ZERO: column c is channel 2c (2c + 1). Loading whole words keeps the
    shared-memory reads of a tile 32 bits wide where the dot's operand layout (rows in
    pairs) would otherwise read bytes; the 8 codes of a word are put back in column order
    by joins, in registers."""
    if ASM:
        l0, l1, l2, l3, h0, h1, h2, h3 = tl.inline_asm_elementwise(
            _WORD_NIBBLES_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r", [words],
            dtype=(tl.float16,) * 8, is_pure=True, pack=1,
        )  # fmt: skip
    else:  # the same bits per element: nibble k of the word is channel 8w + k
        l0 = ((words & 15) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
        h0 = ((words & 0xF0) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
        l1 = (((words >> 8) & 15) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
        h1 = (((words >> 8) & 0xF0) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
        l2 = (((words >> 16) & 15) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
        h2 = (((words >> 16) & 0xF0) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
        l3 = (((words >> 24) & 15) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
        h3 = (((words >> 24) & 0xF0) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
    BT: tl.constexpr = words.shape[0]
    W: tl.constexpr = words.shape[1]
    # join(join(a, c), join(b, d)) flattens to a, b, c, d per word
    lo = tl.reshape(tl.join(tl.join(l0, l2), tl.join(l1, l3)), (BT, 4 * W))
    hi = tl.reshape(tl.join(tl.join(h0, h2), tl.join(h1, h3)), (BT, 4 * W))
    return lo - (1024.0 + ZERO), hi * 0.0625 - (64.0 + ZERO)


# one 32-bit word of 8-bit codes -> 4 fp16 in 16-bit registers: 1024 + c (integer codes),
# or the fp8 bits placed as `_E4M3_ASM` / `_E5M2_ASM` place them
_WORD_BYTES_ASM = tl.constexpr("""{
.reg .b32 t0, t1;
prmt.b32 t0, $4, 0, 0x4140;
prmt.b32 t1, $4, 0, 0x4342;
or.b32 t0, t0, 0x64006400;
or.b32 t1, t1, 0x64006400;
mov.b32 {$0, $1}, t0;
mov.b32 {$2, $3}, t1;
}""")
_WORD_E4M3_ASM = tl.constexpr("""{
.reg .b32 t0, t1, m0, m1;
prmt.b32 t0, $4, 0, 0x1404;
prmt.b32 t1, $4, 0, 0x3424;
and.b32 m0, t0, 0x7F007F00;
and.b32 m1, t1, 0x7F007F00;
shr.b32 m0, m0, 1;
shr.b32 m1, m1, 1;
lop3.b32 t0, t0, 0x80008000, m0, 0xea;
lop3.b32 t1, t1, 0x80008000, m1, 0xea;
mov.b32 {$0, $1}, t0;
mov.b32 {$2, $3}, t1;
}""")
_WORD_E5M2_ASM = tl.constexpr("""{
.reg .b32 t0, t1;
prmt.b32 t0, $4, 0, 0x1404;
prmt.b32 t1, $4, 0, 0x3424;
mov.b32 {$0, $1}, t0;
mov.b32 {$2, $3}, t1;
}""")


@triton.jit
def _byte_of_word(words, k: tl.constexpr, ZERO: tl.constexpr, FP8: tl.constexpr):
    """Byte k of each int32 word as the fp16 the PTX blocks make (interpreter path)."""
    c = (words >> (8 * k)) & 0xFF
    if FP8:
        x = (((c & 0x80) << 8) | ((c & 0x7F) << FP8)).to(tl.uint16).to(tl.float16, bitcast=True)
    else:
        x = (c | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
    return x


@triton.jit
def _word_bytes(words, ZERO: tl.constexpr, FP8: tl.constexpr, ASM: tl.constexpr):
    """int32 words [BT, W] of 8-bit codes -> [BT, 4 W] fp16, column c channel c: code -
    ZERO, or an fp8 code's value / factor (FP8: the mantissa shift, `_fp8_plane`)."""
    if ASM:
        if FP8 == 8:
            e0, e1, e2, e3 = tl.inline_asm_elementwise(
                _WORD_E5M2_ASM, "=h,=h,=h,=h,r", [words], dtype=(tl.float16,) * 4,
                is_pure=True, pack=1,
            )  # fmt: skip
        elif FP8:
            e0, e1, e2, e3 = tl.inline_asm_elementwise(
                _WORD_E4M3_ASM, "=h,=h,=h,=h,r", [words], dtype=(tl.float16,) * 4,
                is_pure=True, pack=1,
            )  # fmt: skip
        else:
            e0, e1, e2, e3 = tl.inline_asm_elementwise(
                _WORD_BYTES_ASM, "=h,=h,=h,=h,r", [words], dtype=(tl.float16,) * 4,
                is_pure=True, pack=1,
            )  # fmt: skip
    else:
        e0 = _byte_of_word(words, 0, ZERO, FP8)
        e1 = _byte_of_word(words, 1, ZERO, FP8)
        e2 = _byte_of_word(words, 2, ZERO, FP8)
        e3 = _byte_of_word(words, 3, ZERO, FP8)
    BT: tl.constexpr = words.shape[0]
    W: tl.constexpr = words.shape[1]
    x = tl.reshape(tl.join(tl.join(e0, e2), tl.join(e1, e3)), (BT, 4 * W))
    if not FP8:
        x = x - (1024.0 + ZERO)
    return x


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


# 4 code bytes -> the 4 low (high) nibbles as fp16 1024 + c (1024 + 16 c): one plane of
# `_NIBBLES_ASM`, for a caller that finishes one plane before it decodes the other
_LOW_NIBBLES_ASM = tl.constexpr(_nibbles_ptx(LOW_NIBBLES))
_HIGH_NIBBLES_ASM = tl.constexpr(_nibbles_ptx(HIGH_NIBBLES))


@triton.jit
def _code_plane(raw, ZERO: tl.constexpr, KP: tl.constexpr, PLANE: tl.constexpr,
                ASM: tl.constexpr, FP8: tl.constexpr):  # fmt: skip
    """Plane PLANE of code bytes raw as fp16 code - ZERO (4-bit codes: 0 the low nibbles,
    1 the high ones; 8-bit and fp8 codes: the bytes, `_planes`). One plane at a time: a
    pre-RoPE tile's planes decoded together keep more registers live."""
    if KP == 2 and not FP8:
        if ASM:
            if PLANE == 0:
                x = tl.inline_asm_elementwise(_LOW_NIBBLES_ASM, "=r,=r,r", [raw],
                                              dtype=tl.float16, is_pure=True, pack=4)  # fmt: skip
                x = x - (1024.0 + ZERO)
            else:
                x = tl.inline_asm_elementwise(_HIGH_NIBBLES_ASM, "=r,=r,r", [raw],
                                              dtype=tl.float16, is_pure=True, pack=4)  # fmt: skip
                x = x * 0.0625 - (64.0 + ZERO)
        else:
            c = (raw.to(tl.int16) >> (4 * PLANE)) & 15
            x = (c | 0x6400).to(tl.float16, bitcast=True) - (1024.0 + ZERO)
    else:
        x, _ = _planes(raw, ZERO, KP, ASM, FP8)
    return x


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


# Vector codebooks (`kvq calibrate vq`, what `kvq calibrate auto --bits 2 | 3` stores): each
# group of M channels is one codebook index, its M digits of BITS bits side by side, so the
# index of group g is the (BITS x M)-bit field at bit g x BITS x M of the row (a nibble, a
# 6-bit field of a 3-byte unit or a byte: 16, 64 or 256 centroids). The planned path takes
# the calibrator's groups (`planned_layouts._vq_unsupported`): keys over RoPE pairs (M 2:
# channels c, c + D/2, one column of each half of the one-plane rotation; M 4: channels 2i,
# 2i + 1 and their partners, column i of each plane and half of the two-plane rotation),
# values over neighbouring channels (column c of the even / odd plane: channel 2c / 2c + 1).
# A group's M coordinates come from one vector load of its centroid (the codebook, at most
# 256 x 4 fp16 = 2 KB, stays in L1), then the static per-channel normaliser (keys, before
# rotation) or the row's (values) as for NUQ.


@triton.jit
def _vq_index(row, g, ok, FIELD: tl.constexpr):
    """int32 codebook index of groups g in rows at `row` (uint8 pointers; broadcast
    against g): the FIELD-bit field at bit g x FIELD (4, 6 or 8 bits; a 6-bit field may
    straddle two bytes)."""
    if FIELD == 8:
        idx = tl.load(row + g, mask=ok, other=0).to(tl.int32)
    elif FIELD == 4:
        byte = tl.load(row + (g >> 1), mask=ok, other=0).to(tl.int32)
        idx = (byte >> ((g & 1) * 4)) & 15
    else:  # 6 bits: 4 fields per 3-byte unit, fields 1 and 2 straddle a byte boundary
        bit = g * FIELD
        shift = bit & 7
        lo = tl.load(row + (bit >> 3), mask=ok, other=0).to(tl.int32)
        hi = tl.load(row + (bit >> 3) + 1, mask=ok & (shift > 8 - FIELD), other=0).to(tl.int32)
        idx = ((lo | (hi << 8)) >> shift) & ((1 << FIELD) - 1)
    return idx


@triton.jit
def _vq_tile_index(row, C0: tl.constexpr, N: tl.constexpr, ok, FIELD: tl.constexpr):
    """[BT, N] int32 codebook indices of groups C0 ... C0 + N - 1 (C0 a multiple of 4) in
    rows at `row` [BT, 1]: each code byte read once. 4-bit fields: a byte's two nibbles are
    groups 2i, 2i + 1; 6-bit fields: a 3-byte unit's bits are groups 4u ... 4u + 3 (the
    second and third straddle a byte); joined back into group order in registers."""
    BT: tl.constexpr = row.shape[0]
    if FIELD == 8:
        idx = tl.load(row + C0 + tl.arange(0, N)[None, :], mask=ok, other=0).to(tl.int32)
    elif FIELD == 4:
        b = tl.load(row + C0 // 2 + tl.arange(0, N // 2)[None, :], mask=ok, other=0)
        b = b.to(tl.int32)
        idx = tl.reshape(tl.join(b & 15, b >> 4), (BT, N))
    else:
        at = row + C0 // 4 * 3 + (tl.arange(0, N // 4) * 3)[None, :]
        b0 = tl.load(at, mask=ok, other=0).to(tl.int32)
        b1 = tl.load(at + 1, mask=ok, other=0).to(tl.int32)
        b2 = tl.load(at + 2, mask=ok, other=0).to(tl.int32)
        g0 = b0 & 63
        g1 = (b0 >> 6) | ((b1 & 15) << 2)
        g2 = (b1 >> 4) | ((b2 & 3) << 4)
        g3 = b2 >> 2
        # join(join(g0, g2), join(g1, g3)) flattens to g0, g1, g2, g3 per unit
        idx = tl.reshape(tl.join(tl.join(g0, g2), tl.join(g1, g3)), (BT, N))
    return idx


@triton.jit
def _trellis_units(row, u, ok, BITS: tl.constexpr):
    """uint64 code units u (any shape, broadcast against `row`) of rows at `row` (uint8
    pointers): the 32-bit word u for 1-, 2- and 4-bit digits, the 3-byte unit u (8
    digits) for 3-bit ones; 0 where not ok."""
    if BITS == 3:
        at = row + u * 3
        b0 = tl.load(at, mask=ok, other=0).to(tl.uint64)
        b1 = tl.load(at + 1, mask=ok, other=0).to(tl.uint64)
        b2 = tl.load(at + 2, mask=ok, other=0).to(tl.uint64)
        unit = b0 | (b1 << 8) | (b2 << 16)
    else:
        words = row.to(tl.pointer_type(tl.int32), bitcast=True)
        unit = tl.load(words + u, mask=ok, other=0).to(tl.uint32, bitcast=True).to(tl.uint64)
    return unit


@triton.jit
def _trellis_cut(row, u, ok, m, BITS: tl.constexpr, TRN: tl.constexpr):
    """int32 state of digit m (broadcast against u) of units u in rows at `row`: the
    BITS x TRN bits that end with the digit, from its unit and the unit before it (zeros
    before the row) as one 64-bit funnel, oldest digit lowest."""
    UB: tl.constexpr = 3 if BITS == 3 else 4  # bytes per unit
    W: tl.constexpr = BITS * TRN  # state bits
    cur = _trellis_units(row, u, ok, BITS)
    prev = _trellis_units(row, u - 1, ok & (u > 0), BITS)
    x = (cur << (8 * UB)) | prev
    shift = (8 * UB + BITS - W + BITS * m).to(tl.uint64)
    return ((x >> shift) & ((1 << W) - 1)).to(tl.int32)


@triton.jit
def _trellis_states(row, C0: tl.constexpr, N: tl.constexpr, ok, BITS: tl.constexpr,
                    TRN: tl.constexpr):  # fmt: skip
    """int32 trellis states [BT, N] of channels C0 ... C0 + N - 1 in rows at `row` [BT, 1]
    (`kvq.quant.trellis`; C0 and N multiples of a unit's digits, `_trellis_units`):
    channel c's state is the BITS x TRN bits of the row's little-endian bit stream that
    end with its digit, read from its unit and the unit before it (zeros before the row)
    as one 64-bit funnel per channel, oldest digit lowest, so the table is indexed that
    way (`planned_layouts.trellis_table`): no digit reversal here."""
    P: tl.constexpr = (24 if BITS == 3 else 32) // BITS  # digits per unit
    BT: tl.constexpr = row.shape[0]
    # units [BT, N / P, 1]: they arrive in the layout their broadcast over the P digits
    # takes (loaded [BT, N / P], each went through shared memory to get there)
    ui = C0 // P + tl.arange(0, N // P)[None, :, None]
    m = tl.arange(0, P)[None, None, :]
    state = _trellis_cut(row[:, :, None], ui, ok[:, :, None], m, BITS, TRN)
    return tl.reshape(state, (BT, N))


@triton.jit
def _trellis_gather(states, cb, W: tl.constexpr):
    """Levels of int32 states (any shape) from the table cb [2^W], one gather through
    shared memory (the table read and stored once per call: per tile)."""
    tab = tl.load(cb + tl.arange(0, 1 << W))
    flat = tl.reshape(states, (states.numel,), can_reorder=False)
    return tl.reshape(tl.gather(tab, flat, 0), states.shape)


@triton.jit
def _trellis_run(row, C0: tl.constexpr, N: tl.constexpr, ok, cb, BITS: tl.constexpr,
                 TRN: tl.constexpr):  # fmt: skip
    """Trellis levels [BT, N] of channels C0 ... C0 + N - 1 (`_trellis_states`)."""
    return _trellis_gather(_trellis_states(row, C0, N, ok, BITS, TRN), cb, BITS * TRN)


@triton.jit
def _trellis_level(row, idx, has, cb, BITS: tl.constexpr, TRN: tl.constexpr):
    """float32 [BT] trellis level of channel idx [BT] in rows at `row` [BT] (as
    `_trellis_states`, one channel per row)."""
    P: tl.constexpr = (24 if BITS == 3 else 32) // BITS  # digits per unit
    state = _trellis_cut(row, idx // P, has, idx % P, BITS, TRN)
    return tl.load(cb + state, mask=has, other=0.0).to(tl.float32)


@triton.jit
def _vq_centroids(row, C0: tl.constexpr, N: tl.constexpr, ok, cb, M: tl.constexpr,
                  BITS: tl.constexpr):  # fmt: skip
    """The M centroid coordinates, [BT, N] each, of groups C0 ... C0 + N - 1 in rows at
    `row` [BT, 1], from the codebook cb [2^(BITS M), M] (rows contiguous). An fp16
    codebook's 2-D centroid is one 32-bit load, split into its halves (one M-wide load
    per group compiled to two 16-bit ones: 118 instead of 139 warp-instructions per row
    for Llama-like 3 x 2 without exceptions, sm_90); else one M-wide load per group."""
    idx = _vq_tile_index(row, C0, N, ok, BITS * M)
    if cb.dtype.element_ty == tl.float16 and M == 2:
        w = tl.load(cb.to(tl.pointer_type(tl.int32), bitcast=True) + idx, mask=ok, other=0)
        c0 = w.to(tl.int16).to(tl.float16, bitcast=True)
        c1 = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True)
        c2 = c0
        c3 = c1
    else:
        coord = tl.arange(0, M)[None, None, :]
        x = tl.load(cb + idx[:, :, None] * M + coord, mask=ok[:, :, None], other=0.0)
        if M == 2:
            c0, c1 = tl.split(x)
            c2 = c0
            c3 = c1
        else:
            BT: tl.constexpr = x.shape[0]
            even, odd = tl.split(tl.reshape(x, (BT, N, 2, 2)))  # coordinates (0, 2), (1, 3)
            c0, c2 = tl.split(even)
            c1, c3 = tl.split(odd)
    return c0, c1, c2, c3


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
def _vq_slot_words(w, rows, row_ok, nuq, vs_ptr, vo_ptr, vq_t, M: tl.constexpr,
                   V_HAS_OFF: tl.constexpr, SLOTS: tl.constexpr):  # fmt: skip
    """Centroid words w [BT, G] (a group's M fp16 coordinates, the first lowest: int32 for
    M 2, int64 for 4) with the rows' SLOTS value exceptions patched in, as the normalised
    value (exact - centre) / scale in fp16 (the scale and centre then applied to the
    tile give it back, within fp16 rounding): per slot and group one compare and one
    select of the word, where a select per channel of both planes cost twice the
    instructions (and a PRMT per fp16 half). Slot channel D (unused) matches no group."""
    si_ptr, sv_ptr, s_t = nuq[11], nuq[12], nuq[13]
    G: tl.constexpr = w.shape[1]
    col = tl.arange(0, G)[None, :]
    scale = tl.load(vs_ptr + rows * vq_t, mask=row_ok, other=1.0).to(tl.float32)
    center = 0.0
    if V_HAS_OFF:
        center = tl.load(vo_ptr + rows * vq_t, mask=row_ok, other=0.0).to(tl.float32)
    for s in tl.static_range(SLOTS):
        idx = tl.load(si_ptr + rows * s_t + s, mask=row_ok, other=0).to(tl.int32)
        idx = tl.where(row_ok, idx, 1 << 20)
        exact = tl.load(sv_ptr + rows * s_t + s, mask=row_ok, other=0.0).to(tl.float32)
        bits = ((exact - center) / scale).to(tl.float16).to(tl.int16, bitcast=True)
        bits = bits.to(tl.int32) & 0xFFFF
        shift = (idx % M) * 16
        if M == 2:
            keep = tl.where(shift == 0, -65536, 0xFFFF)  # the other half's bits
            put = bits << shift
        else:
            keep = ~(tl.full(shift.shape, 0xFFFF, tl.int64) << shift.to(tl.int64))
            put = bits.to(tl.int64) << shift.to(tl.int64)
        hit = col == (idx // M)[:, None]
        w = tl.where(hit, (w & keep[:, None]) | put[:, None], w)
    return w


@triton.jit
def _vq_patched_values(row, G: tl.constexpr, ok, cb, M: tl.constexpr, BITS: tl.constexpr,
                       rows, row_ok, nuq, vs_ptr, vo_ptr, vq_t, V_HAS_OFF: tl.constexpr,
                       SLOTS: tl.constexpr):  # fmt: skip
    """The M coordinates [BT, G] each of a value tile's groups from an fp16 codebook read
    as words (int32 for M 2, int64 for 4), the rows' value slots patched in
    (`_vq_slot_words`)."""
    idx = _vq_tile_index(row, 0, G, ok, BITS * M)
    if M == 2:
        w = tl.load(cb.to(tl.pointer_type(tl.int32), bitcast=True) + idx, mask=ok, other=0)
    else:
        w = tl.load(cb.to(tl.pointer_type(tl.int64), bitcast=True) + idx, mask=ok, other=0)
    w = _vq_slot_words(w, rows, row_ok, nuq, vs_ptr, vo_ptr, vq_t, M, V_HAS_OFF, SLOTS)
    c0 = w.to(tl.int16).to(tl.float16, bitcast=True)
    c1 = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    c2 = c0
    c3 = c1
    if M == 4:
        c2 = (w >> 32).to(tl.int16).to(tl.float16, bitcast=True)
        c3 = (w >> 48).to(tl.int16).to(tl.float16, bitcast=True)
    return c0, c1, c2, c3


@triton.jit
def _vq_value_planes(ptr, rows, row_ok, stride_t, vs_ptr, vo_ptr, vq_t, M: tl.constexpr,
                     BITS: tl.constexpr, D: tl.constexpr, V_HAS_OFF: tl.constexpr,
                     OP: tl.constexpr, cb, PATCH: tl.constexpr = 0, nuq=None,
                     TRN: tl.constexpr = 0):  # fmt: skip
    """A vector-codebook value tile in plane order (even channels, odd channels) [BT, D / 2]
    in OP: groups of M neighbouring channels (M 2: coordinates 0, 1 are the planes' column
    g; M 4: group g's coordinates 0, 2 are the even plane's columns 2g, 2g + 1, 1, 3 the
    odd plane's), then the row's scale and centre. PATCH: that many value slots patched
    into the centroid words (`_vq_slot_words`; an fp16 codebook and fp16 dots). TRN:
    trellis values (M 2: even and odd channels of `_trellis_run`'s row)."""
    BT: tl.constexpr = rows.shape[0]
    G: tl.constexpr = D // M
    ok = row_ok[:, None]
    if TRN:
        levels = _trellis_run(ptr + rows[:, None] * stride_t, 0, D, ok, cb, BITS, TRN)
        c0, c1 = tl.split(tl.reshape(levels, (BT, G, 2)))
        c2 = c0
        c3 = c1
    elif PATCH:
        c0, c1, c2, c3 = _vq_patched_values(ptr + rows[:, None] * stride_t, G, ok, cb, M, BITS,
                                            rows, row_ok, nuq, vs_ptr, vo_ptr, vq_t, V_HAS_OFF,
                                            PATCH)  # fmt: skip
    else:
        c0, c1, c2, c3 = _vq_centroids(ptr + rows[:, None] * stride_t, 0, G, ok, cb, M, BITS)
    if M == 2:
        lo = c0
        hi = c1
    else:  # even plane: coordinates 0, 2 of each group; odd: 1, 3
        lo = tl.reshape(tl.join(c0, c2), (BT, 2 * G))
        hi = tl.reshape(tl.join(c1, c3), (BT, 2 * G))
    s = tl.load(vs_ptr + rows * vq_t, mask=row_ok, other=0.0).to(OP)[:, None]
    if V_HAS_OFF:
        o = tl.load(vo_ptr + rows * vq_t, mask=row_ok, other=0.0).to(OP)[:, None]
        lo = lo.to(OP) * s + o
        hi = hi.to(OP) * s + o
    else:
        lo = lo.to(OP) * s
        hi = hi.to(OP) * s
    return lo, hi


@triton.jit
def _vq_key_coordinate(row, idx, has, cb, D: tl.constexpr, M: tl.constexpr,
                       BITS: tl.constexpr, TRN: tl.constexpr = 0):  # fmt: skip
    """float32 [BT] decoded coordinate (before the normaliser) of channel idx [BT] of
    RoPE-pair vector keys, rows at `row` [BT]: its group's centroid coordinate (TRN:
    the channel's trellis level)."""
    if TRN:
        return _trellis_level(row, idx, has, cb, BITS, TRN)
    H: tl.constexpr = D // 2
    half = idx // H
    c = idx % H
    if M == 2:
        g = c
        coord = half
    else:
        g = c // 2
        coord = (c % 2) + 2 * half
    index = _vq_index(row, g, has, BITS * M)
    return tl.load(cb + index * M + coord, mask=has, other=0.0).to(tl.float32)


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


# an L2 prefetch of the line at $1 (no fault, no register written but the dummy)
_PREFETCH_ASM = tl.constexpr("""{
prefetch.global.L2 [$1];
mov.u32 $0, 0;
}""")


@triton.jit
def _prefetch_tile(k_ptr, v_ptr, k_t, v_t, tile, rows_seg, BT: tl.constexpr):
    """Asks L2 for the packed rows of tile `tile` (clamped to the segment's last row), one
    prefetch per row of keys and of values (a row of codes: 64 B at head_dim 128, 128 B at
    256), so that the next iteration's loads find them there: the tile's code bytes are in
    flight from HBM while this one decodes, where the key entries' loop keeps Triton's
    pipeliner from staging them."""
    t = tl.minimum(tile * BT + tl.arange(0, BT), rows_seg - 1)
    a = tl.inline_asm_elementwise(_PREFETCH_ASM, "=r,l", [k_ptr + t * k_t], dtype=tl.int32,
                                  is_pure=False, pack=1)  # fmt: skip
    b = tl.inline_asm_elementwise(_PREFETCH_ASM, "=r,l", [v_ptr + t * v_t], dtype=tl.int32,
                                  is_pure=False, pack=1)  # fmt: skip
    return a + b


@triton.jit
def _segment_loop(
    state, q_lo, q_hi, k_bias,
    k_ptr, v_ptr, k_t, v_t, vs_ptr, vo_ptr, vq_t, ks_ptr, ko_ptr, kq_t,
    first, last, seg_col, total, qi, r_ok, K_ZERO: tl.constexpr, V_ZERO: tl.constexpr,
    Q: tl.constexpr, R: tl.constexpr, BLOCK_T: tl.constexpr, FULL: tl.constexpr,
    KP: tl.constexpr, KW: tl.constexpr, VP: tl.constexpr, NG: tl.constexpr,
    GW: tl.constexpr, V_HAS_OFF: tl.constexpr, HAS_SOFTCAP: tl.constexpr, softcap,
    CAUSAL: tl.constexpr, OP: tl.constexpr, PRECISION: tl.constexpr, NUM_STAGES: tl.constexpr,
    rows_seg, ASM: tl.constexpr, K_ROWQ: tl.constexpr, K_NG: tl.constexpr,
    K_HAS_OFF: tl.constexpr, m_row, HAS_MASK: tl.constexpr, K_FP8: tl.constexpr,
    V_FP8: tl.constexpr, K_FACTOR: tl.constexpr, V_FACTOR: tl.constexpr,
    K_WORDS: tl.constexpr, V_WORDS: tl.constexpr,
    ROPE: tl.constexpr = False, rope_q=None, pos_ptr=None, pos_t=0, tab=None,
    tab_rows=0, D: tl.constexpr = 0, NC: tl.constexpr = 1,
    K_LUT: tl.constexpr = 0, V_LUT: tl.constexpr = 0, K_FLAT: tl.constexpr = 0,
    V_SLOTS: tl.constexpr = 0, nuq=None, tab1=None, amp1=None, K_VQ: tl.constexpr = 0,
    K_VQB: tl.constexpr = 0, V_VQ: tl.constexpr = 0, V_VQB: tl.constexpr = 0,
    PREFETCH: tl.constexpr = False, VT: tl.constexpr = False, VCH: tl.constexpr = False,
    K_TRN: tl.constexpr = 0, V_TRN: tl.constexpr = 0,
):  # fmt: skip
    """Folds tiles [first, last) of one segment into the online-softmax state (m, l,
    acc_lo, acc_hi: the numerator's planes; VT: transposed, [D / VP, R]). FULL: a full-precision segment (keys
    post-RoPE); otherwise packed codes with the key qparams already in q and k_bias.
    ROPE: keys stored before RoPE, rotated at positions pos_ptr (`_rope_scores`);
    full-precision ones in channel order (tab1, amp1: the unit table and amplitude of one
    plane), whatever the packed codes' planes. K_VQ, V_VQ (M; K_VQB, V_VQB: bits):
    vector-codebook keys (pre-RoPE, `_rope_vq_chunk`) and values (`_vq_value_planes`),
    their codebooks in nuq[0] and nuq[14]."""
    m_i, l_i, acc_lo, acc_hi = state
    LOG2E: tl.constexpr = 1.4426950408889634
    if ROPE:
        # NUQ keys from the byte-pair table (K_LUT 3) rotate in channel order as
        # full-precision keys do: a byte's two levels come out side by side, no split into
        # planes (sm_90, NUQ4 as stored, with the prefetch: Llama-like 77.5 -> 77.1
        # warp-instructions per row, 218 -> 168 registers: 8 -> 12 warps per SM; Gemma 3
        # 160.1 -> 151.6, 172 registers; one gather per tile, `_rope_scores`: 71.8 at 254
        # registers, 8 warps per SM, and 144.4)
        CHO: tl.constexpr = FULL or K_LUT == 3
        KPR: tl.constexpr = 1 if CHO else KP  # `_rope_inputs`
        NCS: tl.constexpr = (2 if D >= 256 else 1) if FULL else NC
        rtab, rope_q = _rope_inputs(CHO, tab, tab1, amp1, rope_q)
        rq, rk = _rope_prepare(rope_q, not FULL and not K_ROWQ, D, KPR, OP, NCS)
    # value slots patched into the levels by the compiled lookup (`_word_levels_slots`):
    # per-row normalisers, codes read as words, at most MAX_PATCHED_SLOTS
    V_PATCH: tl.constexpr = (V_LUT == 2) * V_WORDS * (NG == 1) * (V_SLOTS <= 4)
    # vq values: the slots patched into the centroid words where the dots take fp16 (the
    # codebook is then fp16, `planned_layouts.vq_table`), 4-D groups up to head_dim 128
    # (sm_90, Llama-like 2 x 4: 104 warp-instructions per row against 137 replacing them
    # in the decoded tile; 2-D groups: 152 against 148; Gemma 3's 2 x 4: 183 but a 40 B
    # spill against 269, none); exact replacement in the tile otherwise
    VQ_PATCH: tl.constexpr = V_SLOTS if V_VQ == 4 and tl.float16 == OP and D <= 128 else 0
    # pre-RoPE full-precision rows of head_dim 256 in tiles of BLOCK_T / SUB rows: whole
    # tiles of them spilled (`_rope_inputs`); the packed loop keeps BLOCK_T
    SUB: tl.constexpr = 4 if (FULL and ROPE and D >= 256) else 1
    # VCH: every segment's values (and the numerator) in channel order, one plane
    VPA: tl.constexpr = 1 if VCH else VP
    VNG: tl.constexpr = 1 if VCH and FULL else NG
    VGW: tl.constexpr = D if VCH and FULL else GW
    BT: tl.constexpr = BLOCK_T // SUB
    # no sub-tile past the segment's rows (a pre-RoPE tile reads its first row's position)
    last = tl.minimum(last * SUB, tl.cdiv(rows_seg, BT))
    for tile in tl.range(first * SUB, last, num_stages=NUM_STAGES):
        t = tile * BT + tl.arange(0, BT)
        t_ok = t < rows_seg  # the softmax's mask
        # the tile's loads read row min(t, rows - 1), unmasked: rows past the segment repeat
        # its last one (finite data, weight 0). Masked loads cost a predicate and a fill per
        # load: 86.9 -> 83.8 warp-instructions per row for NUQ4 as stored, Llama-like, KV4
        # 31.1 -> 29.6 (sm_90)
        tr = tl.minimum(t, rows_seg - 1)
        tr_ok = tl.full([BT], 1, tl.int1)
        if PREFETCH and not FULL:  # the next tile's codes on their way to L2
            _prefetch_tile(k_ptr, v_ptr, k_t, v_t, tile + 1, rows_seg, BT)
        if ROPE:
            scores = _rope_scores(rq, rk, k_ptr, k_t, ks_ptr, ko_ptr, kq_t, tr, tr_ok, tile,
                                  pos_ptr, pos_t, rtab, tab_rows, R, K_ZERO, BT, FULL, KPR,
                                  D, OP, PRECISION, ASM, K_ROWQ, K_NG, K_HAS_OFF, K_FP8,
                                  K_FACTOR, K_WORDS, NCS, K_LUT, K_FLAT, nuq,
                                  rope_q[3], K_VQ, K_VQB, t_ok, K_TRN)  # fmt: skip
        else:
            if K_ROWQ and not FULL:
                k_lo, k_hi = _value_planes(k_ptr, tr, tr_ok, k_t, ks_ptr, ko_ptr, kq_t, K_ZERO,
                                           KP, K_NG, KW // K_NG, False, K_HAS_OFF, OP, ASM,
                                           K_FP8, K_FACTOR, K_WORDS)  # fmt: skip
            else:
                k_lo, k_hi = _key_planes(k_ptr, tr, tr_ok, k_t, K_ZERO, KP, KW, FULL, ASM,
                                         K_FP8, K_LUT, nuq[0], nuq[15])  # fmt: skip
            scores = tl.dot(q_lo, tl.trans(k_lo.to(OP)), input_precision=PRECISION)
            if KP == 2:
                scores += tl.dot(q_hi, tl.trans(k_hi.to(OP)), input_precision=PRECISION)
            if not FULL and not K_ROWQ:
                scores += k_bias[:, None]
            if K_FLAT and not FULL:  # NUQ keys' exact exceptions (post-RoPE keys)
                corr = _key_corrections(R, BT, tr, tr_ok, k_ptr, k_t, nuq, OP, KE=K_FLAT)
                scores = _key_exceptions(scores, corr, PRECISION)
        if HAS_SOFTCAP:  # softcap * tanh(s / softcap), tanh(x) = 2 sigmoid(2x) - 1, base 2
            scores = softcap * (2.0 * tl.sigmoid(2.0 * scores / softcap) - 1.0) * LOG2E
        allowed = r_ok[:, None] & t_ok[None, :]
        if HAS_MASK:  # m_row: each query row's mask row over the segments laid end to end
            if Q == 1:  # one mask row for every query row: [BT], broadcast
                seen = tl.load(m_row + seg_col + t, mask=t_ok, other=0)
                allowed = allowed & (seen != 0)[None, :]
            else:  # [R, BT]
                seen = tl.load(m_row[:, None] + (seg_col + t)[None, :], mask=allowed, other=0)
                allowed = allowed & (seen != 0)
        elif CAUSAL:
            allowed = allowed & ((seg_col + t)[None, :] <= (total - Q + qi)[:, None])
        scores = tl.where(allowed, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(scores - m_safe[:, None])  # [R, BT]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if V_VQ and not FULL:
            v_lo, v_hi = _vq_value_planes(v_ptr, tr, tr_ok, v_t, vs_ptr, vo_ptr, vq_t, V_VQ,
                                          V_VQB, D, V_HAS_OFF, OP, nuq[14], VQ_PATCH,
                                          nuq, V_TRN)  # fmt: skip
        elif VCH and not FULL:  # NUQ4 values in channel order, slots in the gather
            v_lo = _pair_values(v_ptr, tr, tr_ok, v_t, vs_ptr, vo_ptr, vq_t, nuq[16], nuq, D,
                                V_HAS_OFF, OP, V_SLOTS, ASM, (tile * BT, rows_seg - 1))  # fmt: skip
            v_hi = v_lo
        else:
            v_lo, v_hi = _value_planes(v_ptr, tr, tr_ok, v_t, vs_ptr, vo_ptr, vq_t, V_ZERO, VPA,
                                       VNG, VGW, FULL, V_HAS_OFF, OP, ASM, V_FP8, V_FACTOR,
                                       V_WORDS and not FULL and V_LUT != 3, V_LUT, nuq[14], nuq[16],
                                       V_SLOTS * V_PATCH, nuq)  # fmt: skip
        if V_SLOTS and not FULL and not V_PATCH and not VQ_PATCH and not VCH:  # exact ones
            v_lo, v_hi = _value_slots(v_lo, v_hi, tr, tr_ok, nuq, VP, V_SLOTS)
        p16 = p.to(OP)
        if VT:  # the numerator transposed, [D / VP, R]: values the dot's A operand
            acc_lo = acc_lo * alpha[None, :] + tl.dot(tl.trans(v_lo), tl.trans(p16),
                                                      input_precision=PRECISION)  # fmt: skip
            if VPA == 2:
                acc_hi = acc_hi * alpha[None, :] + tl.dot(tl.trans(v_hi), tl.trans(p16),
                                                          input_precision=PRECISION)  # fmt: skip
        else:
            acc_lo = acc_lo * alpha[:, None] + tl.dot(p16, v_lo, input_precision=PRECISION)
            if VPA == 2:
                acc_hi = acc_hi * alpha[:, None] + tl.dot(p16, v_hi, input_precision=PRECISION)
        m_i = m_new
    return m_i, l_i, acc_lo, acc_hi


@triton.jit(do_not_specialize=["rows0", "rows1", "rows2"])
def decode_splits_kernel(
    q, sq_b, sq_h, sq_q,
    part, out,
    k0, v0, k0_b, k0_h, k0_t, v0_b, v0_h, v0_t, rows0,
    k1, v1, k1_b, k1_h, k1_t, v1_b, v1_h, v1_t, rows1,
    k2, v2, k2_b, k2_h, k2_t, v2_b, v2_h, v2_t, rows2,
    k_fold, v_scale, v_off, vq_b, vq_h, vq_t, k_off, kq_b, kq_h, kq_t,
    mask, m_b, m_q, HKV: tl.constexpr, splits, scaling, softcap, lengths,
    pos0, pos1, pos2, pos0_b, pos0_t, pos1_b, pos1_t, pos2_b, pos2_t, rope_tab, rope_amp,
    rope_rows,
    Q: tl.constexpr, G: tl.constexpr, R: tl.constexpr, D: tl.constexpr,
    BLOCK_T: tl.constexpr, KIND0: tl.constexpr, KIND1: tl.constexpr, KIND2: tl.constexpr,
    KP: tl.constexpr, VP: tl.constexpr, NG: tl.constexpr, V_HAS_OFF: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, CAUSAL: tl.constexpr, HALF: tl.constexpr,
    DIRECT: tl.constexpr, NUM_STAGES: tl.constexpr, K_ZERO: tl.constexpr = 0.0,
    V_ZERO: tl.constexpr = 0.0, ASM: tl.constexpr = False, K_ROWQ: tl.constexpr = False,
    K_NG: tl.constexpr = 1, K_HAS_OFF: tl.constexpr = False, HAS_MASK: tl.constexpr = False,
    K_FP8: tl.constexpr = 0, V_FP8: tl.constexpr = 0, K_FACTOR: tl.constexpr = 1.0,
    V_FACTOR: tl.constexpr = 1.0, K_WORDS: tl.constexpr = False, V_WORDS: tl.constexpr = False,
    ROPE0: tl.constexpr = False,
    ROPE1: tl.constexpr = False, ROPE2: tl.constexpr = False,
    K_LUT: tl.constexpr = 0, V_LUT: tl.constexpr = 0, K_FLAT: tl.constexpr = 0,
    V_SLOTS: tl.constexpr = 0, k_tab=None, v_tab=None, k_cnt=None, kc_b=0, kc_h=0, kc_t=0,
    k_first=None, kf_b=0, kf_h=0, kf_t=0, k_eidx=None, k_eval=None, v_sidx=None, v_sval=None,
    vs_b=0, vs_h=0, vs_t=0, RQ: tl.constexpr = 16, rope_tab1=None, rope_amp1=None,
    K_VQ: tl.constexpr = 0, K_VQB: tl.constexpr = 0, V_VQ: tl.constexpr = 0,
    V_VQB: tl.constexpr = 0, PREFETCH: tl.constexpr = False, K_TRN: tl.constexpr = 0,
    V_TRN: tl.constexpr = 0,
):  # fmt: skip
    """Segments 0, 1, 2 (KIND 0: absent, 1: full precision, 2: packed; one packed at
    most): key and value data with their batch, head and row strides (elements of the
    data: bytes of codes), and row counts. k_fold [2, H_kv, D] float32: the packed keys'
    static scale and bias (offset - zero_point x scale) per channel; with K_ROWQ instead
    their per-row group scales [B, H_kv, T, K_NG] (offsets k_off, strides kq_*); v_scale, v_off
    [B, H_kv, T, NG] with strides vq_b, vq_h, vq_t (groups contiguous). HAS_MASK: mask
    [B, Q, total] bool or bytes (True: attend; strides m_b, m_q, columns contiguous) over
    the rows of all segments in order; else the last Q rows are causal. K_FP8, V_FP8:
    fp8 codes (the mantissa shift of `fp8.fp16_placement`; 0: integer codes), decoded to
    value / K_FACTOR (V_FACTOR): static key scales come with the factor in k_fold, per-row
    scales are multiplied by it as they are read. K_WORDS, V_WORDS: 4-bit codes with
    per-row qparams read as 32-bit words (`_word_nibbles`). ROPE0, ROPE1, ROPE2: the
    segment's keys are stored before RoPE, rotated at the positions pos0, pos1, pos2
    [B, T] (strides posN_b, posN_t) by the unit table rope_tab [rope_rows, 2, D / 2] (cos,
    sin; columns in plane order) times the amplitude rope_amp [D / 2]
    (`planned_decode.rope_planes`; rope_tab1, rope_amp1: in channel order, for
    full-precision keys). K_LUT, V_LUT: 4-bit codebook (NUQ) codes, levels from
    k_tab, v_tab (fp32 [16]); the key scale and offset fold like affine ones (pre-RoPE:
    applied before rotation). K_FLAT: the keys' flat exact exceptions, count k_cnt [B, H_kv, T] and
    first entry k_first (strides kc_*, kf_*) of each row into k_eidx (channels) and k_eval
    (values), K_FLAT of each row per step (0: none; `_key_corrections`); V_SLOTS: the
    values' exceptions per row, slots v_sidx, v_sval [B, H_kv, T, V_SLOTS] (strides vs_*;
    channel D: unused). K_VQ, V_VQ: vector-codebook codes (`_vq_index`), groups of that
    many channels (0: none), digits of K_VQB, V_VQB bits, centroids from k_tab, v_tab ([2^(bits M), M] in the dots' dtype); keys pre-RoPE
    over RoPE pairs in KP = M / 2 planes, values over neighbouring channels in VP = 2.
    K_TRN, V_TRN: trellis codes (`_trellis_run`) of that many digits per state, read as
    vq codes of 2-D groups (K_VQ, V_VQ 2; K_VQB, V_VQB: digit bits) in channel order (keys:
    the channels of each RoPE half, values: even and odd channels), levels from k_tab,
    v_tab ([2^(bits x digits)], `planned_layouts.trellis_table`).
    PREFETCH: the packed segment's loop asks L2 for the next tile's rows
    (`_prefetch_tile`), where its loads are not staged.

    None for an argument (Triton binds it as a constexpr: no runtime argument) where the
    host's layout fixes its value (`planned_decode._layout_strides`): row strides of
    contiguous rows (D elements, D / KP or D / VP bytes of codes, NG or K_NG groups,
    V_SLOTS slots), batch strides of HKV x the head strides, the values' head stride of
    the keys', the query's strides of a [B, Q, H_q, D] or [B, H_q, 1, D] query; row
    counts of absent segments (0); pointers and strides of absent features (their
    pointers stand in as q: never read). lengths: None, or int32 [3] on the device, the
    segments' row counts (rows0 ... rows2 None), read here: a launch whose rows change
    on the device (CUDA graphs; the grid is fixed by the segments' capacity, and a split
    past the rows reads no tile)."""
    if lengths is not None:
        rows0 = tl.load(lengths) if KIND0 != 0 else None
        rows1 = tl.load(lengths + 1) if KIND1 != 0 else None
        rows2 = tl.load(lengths + 2) if KIND2 != 0 else None
    sq_h = D if sq_h is None else sq_h
    sq_q = HKV * G * D if sq_q is None else sq_q
    sq_b = HKV * G * Q * D if sq_b is None else sq_b
    rows0 = 0 if rows0 is None else rows0
    rows1 = 0 if rows1 is None else rows1
    rows2 = 0 if rows2 is None else rows2
    total = rows0 + rows1 + rows2
    softcap = 0.0 if softcap is None else softcap
    k_fold = q if k_fold is None else k_fold
    k_off = q if k_off is None else k_off
    kq_h = 0 if kq_h is None else kq_h
    kq_b = HKV * kq_h if kq_b is None else kq_b
    kq_t = K_NG if kq_t is None else kq_t
    v_scale = q if v_scale is None else v_scale
    v_off = q if v_off is None else v_off
    vq_h = 0 if vq_h is None else vq_h
    vq_b = HKV * vq_h if vq_b is None else vq_b
    vq_t = NG if vq_t is None else vq_t
    mask = q if mask is None else mask
    m_b = 0 if m_b is None else m_b
    m_q = 0 if m_q is None else m_q
    pos0 = q if pos0 is None else pos0
    pos1 = q if pos1 is None else pos1
    pos2 = q if pos2 is None else pos2
    pos0_b = 0 if pos0_b is None else pos0_b
    pos1_b = 0 if pos1_b is None else pos1_b
    pos2_b = 0 if pos2_b is None else pos2_b
    pos0_t = 1 if pos0_t is None else pos0_t
    pos1_t = 1 if pos1_t is None else pos1_t
    pos2_t = 1 if pos2_t is None else pos2_t
    rope_tab = q if rope_tab is None else rope_tab
    rope_amp = q if rope_amp is None else rope_amp
    rope_tab1 = q if rope_tab1 is None else rope_tab1
    rope_amp1 = q if rope_amp1 is None else rope_amp1
    rope_rows = 0 if rope_rows is None else rope_rows
    k_tab = q if k_tab is None else k_tab
    v_tab = q if v_tab is None else v_tab
    k_cnt = q if k_cnt is None else k_cnt
    kc_h = 0 if kc_h is None else kc_h
    kc_b = HKV * kc_h if kc_b is None else kc_b
    kc_t = 1 if kc_t is None else kc_t
    k_first = q if k_first is None else k_first
    kf_h = 0 if kf_h is None else kf_h
    kf_b = HKV * kf_h if kf_b is None else kf_b
    kf_t = 1 if kf_t is None else kf_t
    k_eidx = q if k_eidx is None else k_eidx
    k_eval = q if k_eval is None else k_eval
    v_sidx = q if v_sidx is None else v_sidx
    v_sval = q if v_sval is None else v_sval
    vs_h = 0 if vs_h is None else vs_h
    vs_b = HKV * vs_h if vs_b is None else vs_b
    vs_t = V_SLOTS if vs_t is None else vs_t

    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = (bh // HKV).to(tl.int64)  # batch offsets of a long cache pass 2^31 bytes
    h = bh % HKV
    KW: tl.constexpr = D // KP
    KRB: tl.constexpr = D // KP if K_VQ == 0 else D * K_VQB // 8  # bytes of a packed row
    VRB: tl.constexpr = D // VP if V_VQ == 0 else D * V_VQB // 8
    GW: tl.constexpr = D // (NG * VP)
    OP: tl.constexpr = tl.float16 if HALF else tl.float32
    PRECISION: tl.constexpr = "tf32" if HALF else "ieee"
    LOG2E: tl.constexpr = 1.4426950408889634

    # query rows r = g * Q + qi -> head h * G + g, position qi; channels in plane order
    r = tl.arange(0, R)
    r_ok = r < G * Q
    qi = r % Q
    q_row = q + b * sq_b + (h * G + r // Q) * sq_h + qi * sq_q
    j = tl.arange(0, KW)
    q_scale = scaling if HAS_SOFTCAP else scaling * LOG2E
    q_lo = tl.load(q_row[:, None] + (j * KP)[None, :], mask=r_ok[:, None], other=0.0)
    q_lo = q_lo.to(tl.float32) * q_scale
    q_hi = q_lo
    if KP == 2:
        q_hi = tl.load(q_row[:, None] + (j * 2 + 1)[None, :], mask=r_ok[:, None], other=0.0)
        q_hi = q_hi.to(tl.float32) * q_scale

    # the packed keys' static qparams folded into the query (a second copy for packed
    # tiles: the full-precision segments dot the plain query)
    ks_ptr = k_fold + b * kq_b + h * kq_h  # K_ROWQ: per-row group key qparams
    ko_ptr = k_off + b * kq_b + h * kq_h
    fk = k_fold + h * D
    if K_ROWQ:  # nothing to fold: packed tiles dot the plain query
        pk_lo = q_lo.to(OP)
        pk_hi = q_hi.to(OP)
        k_bias = tl.zeros([R], tl.float32)
    else:
        s_lo = tl.load(fk + j * KP)
        b_lo = tl.load(fk + HKV * D + j * KP)
        pk_lo = (q_lo * s_lo[None, :]).to(OP)
        k_bias = tl.sum(q_lo * b_lo[None, :], axis=1)
        pk_hi = pk_lo
        if KP == 2:
            s_hi = tl.load(fk + j * 2 + 1)
            b_hi = tl.load(fk + HKV * D + j * 2 + 1)
            pk_hi = (q_hi * s_hi[None, :]).to(OP)
            k_bias += tl.sum(q_hi * b_hi[None, :], axis=1)
    fq_lo = q_lo.to(OP)
    fq_hi = q_hi.to(OP)
    m_row = mask + b * m_b  # the mask row (unused without HAS_MASK)
    if Q > 1:
        m_row = m_row + qi * m_q  # [R]: query row r's

    # pre-RoPE segments: the query and static key qparams per half and plane, prepared in
    # each segment's loop from these (`_rope_prepare`), not held across the other
    # segments' loops
    # (in NC chunks of columns: a chunk's keys are decoded, rotated and dotted before the
    # next one's, which keeps head_dim 256 within the registers of 8 resident warps)
    # (vector keys: one chunk, the groups' centroids gathered once per tile. sm_90, with
    # exceptions: Llama-like 3 x 2 in chunks of 32 groups spilled 64 B at 204 warp-
    # instructions per row, one chunk 148 and no spill; Gemma 3's 3 x 2 in 4 chunks 400
    # and a 160 B spill, one chunk 297, none)
    # (NUQ keys: two chunks from 32 columns per half, the lookup's bytes and the rotation
    # of a 16-column chunk held at once: Llama-like NUQ4 as stored 84 -> 79 warp-
    # instructions per row, where KV4's nibbles take 44 -> 46; Gemma 3's four chunks: 162
    # -> 176)
    CH: tl.constexpr = D // KP // 2  # columns per plane and half
    NC: tl.constexpr = 1 if K_VQ or K_ROWQ else (2 if CH > 32 or (K_LUT and CH == 32) else 1)
    rope_q = (q_row, r_ok, q_scale, rope_amp, fk, HKV)  # what `_rope_prepare` reads

    # codebook values with slots (NUQ's PRMT lookup) and vq values dot as the A operand,
    # the probabilities as the B one (the numerator transposed; sm_90: a warpgroup MMA
    # reading both from shared memory), where P as the A operand was loaded by 128-bit
    # reads spanning four k-steps and regrouped by register moves (about 60 per
    # iteration). sm_90, batch 16 x 32K, warp-instructions per row before -> after: NUQ4
    # as stored, Llama-like 71.8 -> 68.0; post-RoPE 59.7 -> 55.4 (Gemma 3 100.6 -> 93.8);
    # vq3 134.4 -> 127.9, vq2 95.4 -> 92.1 (Gemma 3 267.9 -> 256.2, 234.5 -> 228.8). Not
    # taken: affine and fp8 values (KV4 29.6 -> 30.6, KV8 33.7 -> 33.9, fp8 37.6 -> 38.6
    # with 20 -> 16 warps per SM), NUQ4 values without slots (post-RoPE, Llama-like 34.2 ->
    # 35.2, 16 -> 12 warps per SM), Gemma 3's pre-RoPE NUQ4 (136.8 but an 8 B spill, 16 B
    # in its layer call)
    # VCH: NUQ4 values from the byte-pair table in channel order (`_pair_values`: rows read
    # as words, one normaliser per row), every segment's values and the numerator in
    # channel order; with slots redirected in the gather where the tile's slots fit its
    # extended table. sm_90, warp-instructions per row, before -> after: NUQ4 as stored
    # (value slots), Llama-like 66.2 -> 61.8; without value slots 63.0 -> 54.1
    # (post-RoPE without exceptions 34.2 -> 31.7). Not taken, the PRMT lookup kept:
    # post-RoPE keys with value slots (55.4 -> 58.4). Gemma 3's pre-RoPE NUQ4 with slots
    # takes it, the values the A operand (VT): 140.4 -> 123.6, its whole-layer call 141.1
    # -> 123.8 without spill; the packed call alone keeps one lane index of the
    # epilogue's layout conversion in local memory across the loop (8 B: one store
    # before, one load after, none in the loop; the numerator [R, D]: 125.9 and 16 B;
    # m and l stored as one [R, 2] tile: none there but 16 B in the layer call; 128-row
    # tiles 648 B; 32-row tiles: 185.8)
    VCH: tl.constexpr = (
        V_LUT != 0
        and HALF
        and V_WORDS
        and NG == 1
        and (V_SLOTS == 0 or (V_SLOTS * BLOCK_T <= 256 and (ROPE0 or ROPE1 or ROPE2)))
    )
    VPA: tl.constexpr = 1 if VCH else VP
    VT: tl.constexpr = (V_LUT != 0 and V_SLOTS != 0 or V_VQ != 0) and not (
        K_LUT != 0 and D >= 256 and (ROPE0 or ROPE1 or ROPE2) and not VCH
    )
    m_i = tl.full([R], float("-inf"), tl.float32)
    l_i = tl.zeros([R], tl.float32)
    acc_lo = tl.zeros([D // VPA, R] if VT else [R, D // VPA], tl.float32)
    acc_hi = tl.zeros([D // VPA, R] if VT else [R, D // VPA], tl.float32)
    state = (m_i, l_i, acc_lo, acc_hi)

    # this split's tiles of the segments laid end to end (launch_plan.split_tiles)
    n0 = tl.cdiv(rows0, BLOCK_T)
    n1 = tl.cdiv(rows1, BLOCK_T)
    n2 = tl.cdiv(rows2, BLOCK_T)
    n = n0 + n1 + n2
    lo = split * n // splits
    hi = (split + 1) * n // splits
    vs_ptr = v_scale + b * vq_b + h * vq_h
    vo_ptr = v_off + b * vq_b + h * vq_h
    # the real query rows (G x Q, padded to RQ) for the key exceptions' query gathers
    rq = tl.arange(0, RQ)
    q_real = q + b * sq_b + (h * G + rq // Q) * sq_h + (rq % Q) * sq_q
    q_real = tl.where(rq < G * Q, q_real, q)  # padding rows read row 0 (and are dropped)
    # the packed segment's NUQ tables and exceptions (`_key_exceptions`, `_value_slots`);
    # with fp16 dots, levels from the byte-pair table (3, `_pair_levels`); values with slots
    # by PRMT (2, compiled), the slots patched into the lookup; else by gathers (1). sm_90,
    # NUQ4 as stored (pre-RoPE keys, ~1% exceptions, 2 value slots), warp-instructions per
    # cached row, PRMT keys -> pair-table keys: Llama-like 78.8 -> 76.6 (236 -> 227
    # registers), Gemma 3 162.1 -> 159.2 (255 -> 175); post-RoPE keys 69.1 -> 59.7 and 116.9
    # -> 100.6. Values through the table with their slots selected into the pairs per byte
    # (one compare and select per byte and slot, the slot's pair built per row): 83.5 for
    # Llama-like (66.2 without the slots), so slotted values keep the PRMT patch
    K_MODE: tl.constexpr = K_LUT * 3 if HALF else K_LUT
    V_MODE: tl.constexpr = V_LUT * (
        3 if HALF and (not V_SLOTS or VCH) else (2 if HALF and ASM else 1)
    )
    nuq = (k_tab, k_cnt + b * kc_b + h * kc_h, kc_t, k_first + b * kf_b + h * kf_h, kf_t,
           k_eidx, k_eval, fk, fk + HKV * D, q_real, q_scale, v_sidx + b * vs_b + h * vs_h,
           v_sval + b * vs_b + h * vs_h, vs_t, v_tab, _lut_table(k_tab, K_MODE),
           _lut_table(v_tab, V_MODE))  # fmt: skip
    if KIND0 != 0:
        k0_t = (D if KIND0 == 1 else KRB) if k0_t is None else k0_t
        v0_t = (D if KIND0 == 1 else VRB) if v0_t is None else v0_t
        v0_h = k0_h if v0_h is None else v0_h
        k0_b = HKV * k0_h if k0_b is None else k0_b
        v0_b = HKV * v0_h if v0_b is None else v0_b
        kp = k0 + b * k0_b + h * k0_h
        vp = v0 + b * v0_b + h * v0_h
        state = _segment_loop(
            state, fq_lo if KIND0 == 1 else pk_lo, fq_hi if KIND0 == 1 else pk_hi, k_bias,
            kp, vp, k0_t, v0_t, vs_ptr, vo_ptr, vq_t, ks_ptr, ko_ptr, kq_t,
            tl.maximum(lo, 0), tl.minimum(hi, n0), 0, total, qi, r_ok, K_ZERO, V_ZERO,
            Q, R, BLOCK_T, KIND0 == 1, KP, KW, VP, NG, GW, V_HAS_OFF, HAS_SOFTCAP, softcap,
            CAUSAL, OP, PRECISION, NUM_STAGES, rows0, ASM, K_ROWQ, K_NG, K_HAS_OFF,
            m_row, HAS_MASK, K_FP8, V_FP8, K_FACTOR, V_FACTOR, K_WORDS, V_WORDS,
            ROPE0, rope_q, pos0 + b * pos0_b, pos0_t, rope_tab, rope_rows, D, NC,
            K_MODE, V_MODE, K_FLAT, V_SLOTS, nuq, rope_tab1, rope_amp1,
            K_VQ, K_VQB, V_VQ, V_VQB, PREFETCH, VT, VCH, K_TRN, V_TRN,
        )  # fmt: skip
    if KIND1 != 0:
        k1_t = (D if KIND1 == 1 else KRB) if k1_t is None else k1_t
        v1_t = (D if KIND1 == 1 else VRB) if v1_t is None else v1_t
        v1_h = k1_h if v1_h is None else v1_h
        k1_b = HKV * k1_h if k1_b is None else k1_b
        v1_b = HKV * v1_h if v1_b is None else v1_b
    # a layer's pre-RoPE main rows (segment 1, packed) run after the residual rows (2; the
    # online softmax merges in any order), so that what the residual rows' loop needs is not
    # held across theirs: Gemma 3's layer call spilled 24 B in the packed loop otherwise
    MAIN_LAST: tl.constexpr = KIND1 == 2 and ROPE1 and KIND2 == 1
    if KIND2 != 0:
        k2_t = (D if KIND2 == 1 else KRB) if k2_t is None else k2_t
        v2_t = (D if KIND2 == 1 else VRB) if v2_t is None else v2_t
        v2_h = k2_h if v2_h is None else v2_h
        k2_b = HKV * k2_h if k2_b is None else k2_b
        v2_b = HKV * v2_h if v2_b is None else v2_b
    # one call site per segment: segment 1 before segment 2, or after it (MAIN_LAST)
    for step in tl.static_range(3):
        if KIND1 != 0 and step == (2 if MAIN_LAST else 0):
            kp = k1 + b * k1_b + h * k1_h
            vp = v1 + b * v1_b + h * v1_h
            state = _segment_loop(
                state, fq_lo if KIND1 == 1 else pk_lo, fq_hi if KIND1 == 1 else pk_hi, k_bias,
                kp, vp, k1_t, v1_t, vs_ptr, vo_ptr, vq_t, ks_ptr, ko_ptr, kq_t,
                tl.maximum(lo, n0) - n0, tl.minimum(hi, n0 + n1) - n0, rows0, total, qi, r_ok,
                K_ZERO, V_ZERO, Q, R, BLOCK_T, KIND1 == 1, KP, KW, VP, NG, GW, V_HAS_OFF,
                HAS_SOFTCAP, softcap, CAUSAL, OP, PRECISION, NUM_STAGES, rows1, ASM, K_ROWQ, K_NG,
                K_HAS_OFF, m_row, HAS_MASK, K_FP8, V_FP8, K_FACTOR, V_FACTOR, K_WORDS, V_WORDS,
                ROPE1, rope_q, pos1 + b * pos1_b, pos1_t, rope_tab, rope_rows, D, NC,
                K_MODE, V_MODE, K_FLAT, V_SLOTS, nuq, rope_tab1, rope_amp1,
                K_VQ, K_VQB, V_VQ, V_VQB, PREFETCH, VT, VCH, K_TRN, V_TRN,
            )  # fmt: skip
        if KIND2 != 0 and step == 1:
            kp = k2 + b * k2_b + h * k2_h
            vp = v2 + b * v2_b + h * v2_h
            state = _segment_loop(
                state, fq_lo if KIND2 == 1 else pk_lo, fq_hi if KIND2 == 1 else pk_hi, k_bias,
                kp, vp, k2_t, v2_t, vs_ptr, vo_ptr, vq_t, ks_ptr, ko_ptr, kq_t,
                tl.maximum(lo, n0 + n1) - n0 - n1, tl.minimum(hi, n) - n0 - n1, rows0 + rows1,
                total, qi, r_ok, K_ZERO, V_ZERO, Q, R, BLOCK_T, KIND2 == 1, KP, KW, VP, NG, GW,
                V_HAS_OFF, HAS_SOFTCAP, softcap, CAUSAL, OP, PRECISION, NUM_STAGES, rows2, ASM,
                K_ROWQ, K_NG, K_HAS_OFF, m_row, HAS_MASK, K_FP8, V_FP8, K_FACTOR, V_FACTOR,
                K_WORDS, V_WORDS,
                ROPE2, rope_q, pos2 + b * pos2_b, pos2_t, rope_tab, rope_rows, D, NC,
                K_MODE, V_MODE, K_FLAT, V_SLOTS, nuq, rope_tab1, rope_amp1,
                K_VQ, K_VQB, V_VQ, V_VQB, PREFETCH, VT, VCH, K_TRN, V_TRN,
            )  # fmt: skip
    m_i, l_i, acc_lo, acc_hi = state
    if VT:
        acc_lo = tl.trans(acc_lo)
        acc_hi = tl.trans(acc_hi)

    # channel of plane k, column c: c * VPA + k
    chan = (tl.arange(0, D // VPA) * VPA)[None, :]
    ok = r_ok[:, None]
    if DIRECT:  # one split: the normalised output, [B, H_q, Q, D] float32
        inv = 1.0 / tl.maximum(l_i, 1.1754943508222875e-38)
        row = out + ((b * HKV + h) * G * Q + r[:, None]) * D
        tl.store(row + chan, acc_lo * inv[:, None], mask=ok)
        if VPA == 2:
            tl.store(row + chan + 1, acc_hi * inv[:, None], mask=ok)
    else:
        W: tl.constexpr = D + 2
        row = part + ((bh * splits + split) * R + r) * W
        tl.store(row[:, None] + chan, acc_lo, mask=ok)
        if VPA == 2:
            tl.store(row[:, None] + chan + 1, acc_hi, mask=ok)
        tl.store(row + D, m_i, mask=r_ok)
        tl.store(row + D + 1, l_i, mask=r_ok)


@triton.jit
def combine_splits_kernel(part, out, S, R: tl.constexpr, D: tl.constexpr, GQ: tl.constexpr,
                          BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    """One program per (batch x KV head, query row r < G x Q): merges the S partial states
    of `part` [BH, S, R, D + 2] (numerator, max in log2 units, denominator) into one
    softmax and writes out [BH, G x Q, D] (= [B, H_q, Q, D]) float32."""
    bh = tl.program_id(0)
    r = tl.program_id(1)
    W: tl.constexpr = D + 2
    s = tl.arange(0, BLOCK_S)
    dcol = tl.arange(0, BLOCK_D)
    d_ok = dcol < D
    top = tl.full([BLOCK_S], float("-inf"), tl.float32)
    for s0 in range(0, S, BLOCK_S):
        ok = s0 + s < S
        mv = tl.load(part + ((bh * S + s0 + s) * R + r) * W + D, mask=ok, other=float("-inf"))
        top = tl.maximum(top, mv)
    m_top = tl.max(top, axis=0)
    m_top = tl.where(m_top == float("-inf"), 0.0, m_top)  # no split saw a key: weights 0
    num = tl.zeros([BLOCK_D], tl.float32)
    den = tl.zeros([BLOCK_S], tl.float32)
    for s0 in range(0, S, BLOCK_S):
        ok = s0 + s < S
        row = ((bh * S + s0 + s) * R + r) * W
        w = tl.exp2(tl.load(part + row + D, mask=ok, other=float("-inf")) - m_top)
        den += tl.load(part + row + D + 1, mask=ok, other=0.0) * w
        a = tl.load(part + row[:, None] + dcol[None, :], mask=ok[:, None] & d_ok[None, :],
                    other=0.0)  # fmt: skip
        num += tl.sum(a * w[:, None], axis=0)
    res = num / tl.maximum(tl.sum(den, axis=0), 1.1754943508222875e-38)
    tl.store(out + (bh * GQ + r) * D + dcol, res, mask=d_ok)
