"""Vector-codebook and trellis codes in the planned decode kernels (`_splits_triton`):
group indices read from a row's bit fields, centroids gathered from the codebook (it stays
in L1), trellis states walked back to their levels, and the value tiles they make.
"""

from __future__ import annotations

import triton
import triton.language as tl

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
