"""Code bytes to fp16 planes for the planned decode kernels (`_splits_triton`): 4-bit
codes as even/odd channel planes by the exponent bias (0x6400 | c read as fp16 is 1024 + c),
8-bit codes as one plane, fp8 codes moved bit for bit into an fp16 (`_fp8_plane`); compiled,
four code bytes per register through inline PTX, interpreted, the same integer arithmetic.
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
