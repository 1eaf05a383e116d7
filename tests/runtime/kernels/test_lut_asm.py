"""The PRMT codebook lookup of the planned decode kernel (`_LUT_ASM`, `_WORD_LUT_ASM`), run
on this CPU-only machine by a small emulator of the PTX instructions it uses (and, or,
sub, shl, shr, lop3, prmt, mov): for every code byte and random words, the fp16 levels it builds are the
table's, in the even / odd plane order the kernel's dots expect. The interpreter cannot
run inline PTX, so this is what checks the compiled path's arithmetic here."""

from __future__ import annotations

import re

import pytest
import torch

from kvq.runtime.kernels.decode import _nuq_triton as kern
from kvq.runtime.kernels.decode.planned_layouts import nuq_table

M32 = 0xFFFFFFFF


def _prmt(a: int, b: int, c: int) -> int:
    """prmt.b32 default mode: byte i of the result is byte c.nibble_i & 7 of {b, a}, or that
    byte's sign replicated when the nibble's bit 3 is set."""
    pool = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = 0
    for i in range(4):
        sel = (c >> (4 * i)) & 0xF
        byte = pool[sel & 7]
        if sel & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def _lop3(a: int, b: int, c: int, lut: int) -> int:
    out = 0
    for bit in range(32):
        i = ((a >> bit) & 1) << 2 | ((b >> bit) & 1) << 1 | ((c >> bit) & 1)
        out |= ((lut >> i) & 1) << bit
    return out


def run_ptx(asm: str, operands: dict[str, int]) -> dict[str, int]:
    """Runs the instructions of an inline-asm block over 32-bit values; operands by name
    ("$4", ...); returns every register and operand written."""
    regs = dict(operands)

    def val(tok: str) -> int:
        tok = tok.strip()
        if tok in regs:
            return regs[tok]
        return int(tok, 0) & M32

    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        if op == "mov.b32" and rest.startswith("{"):  # split a register into 16-bit halves
            halves, src = re.match(r"\{(.*)\},\s*(\S+)", rest).groups()
            lo, hi = (h.strip() for h in halves.split(","))
            regs[lo], regs[hi] = val(src) & 0xFFFF, val(src) >> 16
            continue
        dst, *src = (t.strip() for t in rest.split(","))
        x = [val(t) for t in src]
        if op == "and.b32":
            regs[dst] = x[0] & x[1]
        elif op == "shr.b32":
            regs[dst] = x[0] >> min(x[1], 32)
        elif op == "shl.b32":  # shifts of 32 or more give 0
            regs[dst] = (x[0] << min(x[1], 32)) & M32
        elif op == "sub.u32":
            regs[dst] = (x[0] - x[1]) & M32
        elif op == "or.b32":
            regs[dst] = x[0] | x[1]
        elif op == "mov.b32":
            regs[dst] = x[0]
        elif op == "lop3.b32":
            regs[dst] = _lop3(*x)
        elif op == "prmt.b32":
            regs[dst] = _prmt(*x)
        else:
            raise AssertionError(f"unemulated instruction {op}")
    return regs


def _levels(table: torch.Tensor) -> list[int]:
    return (table.half().view(torch.int16).int() & 0xFFFF).tolist()


def _words(table: torch.Tensor) -> list[int]:
    """The 8 PRMT table words of lane 0 (`nuq_table`)."""
    return [w & M32 for w in nuq_table(table)[16:24].view(torch.int32).tolist()]


def _nibbles(word: int) -> list[int]:
    return [(word >> (4 * k)) & 15 for k in range(8)]


@pytest.fixture
def table():
    g = torch.Generator().manual_seed(0)
    return torch.sort(torch.randn(16, generator=g)).values  # a codebook: distinct levels


def _code_words(n=256):
    g = torch.Generator().manual_seed(1)
    rand = torch.randint(0, 2**32, (n,), generator=g, dtype=torch.int64).tolist()
    every_byte = [b * 0x01010101 for b in range(256)]  # each byte value in every position
    return every_byte + rand


def test_byte_lookup_gives_each_codes_level_in_plane_order(table):
    """`_LUT_ASM` (4 code bytes per instance, pack 4: each table operand takes 4 registers):
    even-channel levels in $0, $1, odd-channel ones in $2, $3, low half first."""
    lv, words = _levels(table), _words(table)
    for w in _code_words():
        ops = {"$4": w} | {f"${5 + 4 * i}": words[i] for i in range(8)}
        out = run_ptx(kern._LUT_ASM.value, ops)
        n = _nibbles(w)
        assert out["$0"] == lv[n[0]] | lv[n[2]] << 16
        assert out["$1"] == lv[n[4]] | lv[n[6]] << 16
        assert out["$2"] == lv[n[1]] | lv[n[3]] << 16
        assert out["$3"] == lv[n[5]] | lv[n[7]] << 16


def test_word_lookup_gives_each_codes_level_in_plane_order(table):
    """`_WORD_LUT_ASM` (one word per instance): 16-bit levels of channels 8w, 8w + 2, ...,
    then of the odd ones, as `_word_nibbles` orders them."""
    lv, words = _levels(table), _words(table)
    for w in _code_words():
        ops = {"$8": w} | {f"${9 + i}": words[i] for i in range(8)}
        out = run_ptx(kern._WORD_LUT_ASM.value, ops)
        n = _nibbles(w)
        assert [out[f"${i}"] for i in range(8)] == [lv[n[k]] for k in (0, 2, 4, 6, 1, 3, 5, 7)]


def test_every_lane_holds_the_same_table(table):
    """`nuq_table`: the levels, then 32 identical copies of the 8 words, then the byte-pair
    table: entry b holds the fp16 levels of b's low nibble (low half) and high nibble."""
    t = nuq_table(table)
    assert torch.equal(t[:16], table.float())
    lanes = t[16 : 16 + 256].view(torch.int32).view(32, 8)
    assert torch.equal(lanes, lanes[:1].expand(32, 8))
    lv = _levels(table)
    pairs = [int(x) & M32 for x in t[16 + 256 :].view(torch.int32)]
    assert pairs == [lv[b & 15] | lv[b >> 4] << 16 for b in range(256)]


def test_pair_index_builds_extended_table_indices():
    """`_PAIR_INDEX_ASM` == `_pair_index`'s Triton fallback: index k = byte k of the code
    word | byte k of the high word << 8 (high bytes below 0x80)."""
    g = torch.Generator().manual_seed(3)
    words = torch.randint(0, 2**32, (64,), generator=g, dtype=torch.int64).tolist()
    his = torch.randint(0, 2, (64, 4), generator=g).tolist()
    for w, hb in zip(words, his, strict=True):
        hi = sum(b << (8 * k) for k, b in enumerate(hb))
        out = run_ptx(kern._PAIR_INDEX_ASM.value, {"$4": w, "$5": hi})
        want = [((w >> (8 * k)) & 255) | (((hi >> (8 * k)) & 255) << 8) for k in range(4)]
        assert [out[f"${k}"] for k in range(4)] == want


def _repeated_bytes(bits: int) -> tuple[int, int]:
    """`_REPEAT_BYTES_ASM` on an fp16's bits: its low and high byte, each in 4 bytes."""
    out = run_ptx(kern._REPEAT_BYTES_ASM.value, {"$2": bits})
    return out["$0"], out["$1"]


def test_repeated_bytes():
    for bits in (0, 0x3C00, 0xBC01, 0xFFFF, 0x1234):
        assert _repeated_bytes(bits) == ((bits & 0xFF) * 0x01010101, (bits >> 8) * 0x01010101)


@pytest.mark.parametrize("slots", [1, 2, 3, 4])
def test_value_slots_patched_into_the_word_lookup(table, slots):
    """`_slot_lut_asm`: a slot whose channel falls in the word replaces that channel's level
    by its value; slots of other words, unused slots (channel D) and rows past the segment
    (channel 2^20) change nothing."""
    lv, words = _levels(table), _words(table)
    g = torch.Generator().manual_seed(slots)
    asm = getattr(kern, f"_SLOT_LUT_ASM{slots}").value
    for trial in range(300):
        w = int(torch.randint(0, 2**32, (1,), generator=g))
        first = 8 * int(torch.randint(0, 16, (1,), generator=g))  # this word's channel 0
        # distinct channels: in this word, in others, unused (D = 128), past the segment
        pool = [first + k for k in range(8)] + [first + 8, max(first - 1, 200), 128, 1 << 18]
        pick = torch.randperm(len(pool), generator=g)[:slots].tolist()
        chans = [pool[i] for i in pick]
        vals = [int(v) for v in torch.randint(0, 2**16, (slots,), generator=g)]
        ops = {"$8": w, "$17": 4 * first}
        ops |= {f"${9 + i}": words[i] for i in range(8)}
        for s, (c, v) in enumerate(zip(chans, vals, strict=True)):
            low, high = _repeated_bytes(v)
            ops |= {f"${18 + 3 * s}": 4 * c, f"${19 + 3 * s}": low, f"${20 + 3 * s}": high}
        out = run_ptx(asm, ops)
        want = [lv[n] for n in _nibbles(w)]  # channel order
        for c, v in zip(chans, vals, strict=True):
            if first <= c < first + 8:
                want[c - first] = v
        got = [out[f"${i}"] for i in range(8)]
        assert got == [want[k] for k in (0, 2, 4, 6, 1, 3, 5, 7)], (trial, chans)
