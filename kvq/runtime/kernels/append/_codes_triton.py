"""The append kernels' Triton bodies (`codes.py` holds their references, checks and
launchers; its docstring says how the two paths stay bit-exact). Plain functions over the
module global `tl`, bound and decorated by `jit()` on the first Triton call, so importing
kvq never imports Triton."""

from __future__ import annotations

import functools
from typing import Any

tl: Any = None  # triton.language, bound by jit()


def _rint(v):
    # round half to even, exact for every fp32 (v - floor(v) is exact)
    f = tl.floor(v)
    d = v - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0
    return tl.where((d > 0.5) | ((d == 0.5) & odd), f + 1.0, f)


def _near(v, DT: tl.constexpr):
    # fp32 -> storage dtype, round to nearest even
    if DT == 1:
        out = v.to(tl.float16)
    elif DT == 2:
        b = v.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        out = b.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        out = v
    return out


def _step(s, UP: tl.constexpr, DT: tl.constexpr):
    # next representable value of s's own dtype towards +inf (UP) or -inf
    if DT == 0:
        bits = s.to(tl.int32, bitcast=True)
        if UP:
            nb = tl.where(s > 0, bits + 1, tl.where(s < 0, bits - 1, 1))
        else:
            nb = tl.where(s > 0, bits - 1, tl.where(s < 0, bits + 1, -2147483647))
        out = nb.to(tl.int32).to(tl.float32, bitcast=True)
    else:
        bits = s.to(tl.int16, bitcast=True).to(tl.int32)
        if UP:
            nb = tl.where(s > 0, bits + 1, tl.where(s < 0, bits - 1, 1))
        else:
            nb = tl.where(s > 0, bits - 1, tl.where(s < 0, bits + 1, -32767))
        out = nb.to(tl.int16).to(s.dtype, bitcast=True)
    return out


def _round_up(v, DT: tl.constexpr, TINY: tl.constexpr):
    # the stored-scale policy for a positive fp32 scale of live rows (qparams.store_scale,
    # raise_tiny=False): rounded up to the storage dtype, and at least its smallest normal
    s = _near(v, DT)
    s = tl.where(s.to(tl.float32) < v, _step(s, True, DT), s)
    f = s.to(tl.float32)  # exact: s is already in its dtype, and so is TINY
    return tl.where(f < TINY, TINY, f).to(s.dtype)


def _units(R: tl.constexpr, n_units):
    # the R units (rows, or row groups) of this program and which of them exist
    u = tl.program_id(0) * R + tl.arange(0, R)
    return u, u < n_units


def _finite(v):
    # NaN fails the comparison, so this is False for NaN and +-inf alike
    return tl.abs(v.to(tl.float32)) < float("inf")


def _flag_rows(bad_ptr, u, valid, x, m, s, other):
    # 1 where a unit cannot be stored as the reference would: a non-finite input, a
    # non-finite stored scale (it is never below the smallest normal: `_round_up`), or a
    # non-finite `other` stored qparam (offset or center); the launcher reads these with
    # one sync
    rows_ok = tl.min(tl.where(m, _finite(x), True).to(tl.int32), axis=1) != 0
    ok = rows_ok & _finite(s) & _finite(other)
    tl.store(bad_ptr + u, (~ok).to(tl.uint8), mask=valid)


def _pack_store(codes, row_ptr, so, valid, L: tl.constexpr, BL: tl.constexpr,
                BITS: tl.constexpr, PER: tl.constexpr):  # fmt: skip
    # codes: int32 [R, BL], codes of L channels per unit (0 beyond L); row_ptr: [R] the
    # first output byte of each unit. Units of PER codes pack little-endian (code i of a
    # unit at bit i * BITS); 3-bit units are 24-bit words written as 3 bytes.
    R: tl.constexpr = codes.shape[0]
    units = tl.reshape(codes, [R, BL // PER, PER])
    shifts = tl.arange(0, PER) * BITS
    word = tl.sum(units << shifts[None, None, :], axis=2)  # [R, BL // PER]
    q = tl.arange(0, BL // PER)[None, :]
    ok = valid[:, None] & (q * PER < L)
    if BITS == 3:
        base = row_ptr[:, None] + q * 3 * so
        tl.store(base, (word & 0xFF).to(tl.uint8), mask=ok)
        tl.store(base + so, ((word >> 8) & 0xFF).to(tl.uint8), mask=ok)
        tl.store(base + 2 * so, ((word >> 16) & 0xFF).to(tl.uint8), mask=ok)
    else:
        tl.store(row_ptr[:, None] + q * so, word.to(tl.uint8), mask=ok)


def _int_token_kernel(x_ptr, codes_ptr, scale_ptr, offset_ptr, bad_ptr, start, H, T, n_units,
                      sxb, sxh, sxt, sxd, scb, sch, sct, scd,
                      ssb, ssh, sst, ssd, sob, soh, sot, sod,
                      NG: tl.constexpr, G: tl.constexpr, BL: tl.constexpr, R: tl.constexpr,
                      BITS: tl.constexpr, PER: tl.constexpr, GBYTES: tl.constexpr,
                      SYM: tl.constexpr, DT: tl.constexpr, TINY: tl.constexpr):  # fmt: skip
    # one unit = one group of G channels of one (batch, head, row)
    u, valid = _units(R, n_units)
    g = u % NG
    t = (u // NG) % T
    h = (u // (NG * T)) % H
    b = u // (NG * T * H)
    j = tl.arange(0, BL)[None, :]
    m = valid[:, None] & (j < G)
    src = x_ptr + b * sxb + h * sxh + t * sxt + g * G * sxd
    x = tl.load(src[:, None] + j * sxd, mask=m, other=0.0).to(tl.float32)
    if SYM:
        amax = tl.max(tl.where(m, tl.abs(x), 0.0), axis=1)
        ideal = tl.math.div_rn(amax, tl.full([R], (1 << (BITS - 1)) - 1, tl.float32))
        s = _round_up(tl.where(amax > 0, ideal, 1.0), DT, TINY)
        q = _rint(tl.math.div_rn(x, s.to(tl.float32)[:, None]))
        top = (1 << (BITS - 1)) - 1
        q = tl.minimum(tl.maximum(q, -top), top) + (1 << (BITS - 1))
        off = s  # no offset: the scale stands in for the flag's second qparam
    else:
        lo = tl.where(valid, tl.min(tl.where(m, x, float("inf")), axis=1), 0.0)
        hi = tl.where(valid, tl.max(tl.where(m, x, float("-inf")), axis=1), 0.0)
        # affine.affine_qparams: offset = lo rounded down (nearest for constant groups)
        near = _near(lo, DT)
        down = tl.where(near.to(tl.float32) > lo, _step(near, False, DT), near)
        varying = hi > lo
        off = tl.where(varying, down, near)
        of = off.to(tl.float32)
        ideal = tl.math.div_rn(hi - of, tl.full([R], (1 << BITS) - 1, tl.float32))
        s = _round_up(tl.where(varying, ideal, 1.0), DT, TINY)
        tl.store(offset_ptr + b * sob + h * soh + (start + t) * sot + g * sod, off, mask=valid)
        q = _rint(tl.math.div_rn(x - of[:, None], s.to(tl.float32)[:, None]))
        q = tl.minimum(tl.maximum(q, 0.0), (1 << BITS) - 1)
    tl.store(scale_ptr + b * ssb + h * ssh + (start + t) * sst + g * ssd, s, mask=valid)
    _flag_rows(bad_ptr, u, valid, x, m, s, off)
    codes = tl.where(m, q.to(tl.int32), 0)
    crow = codes_ptr + b * scb + h * sch + (start + t) * sct + g * GBYTES * scd
    _pack_store(codes, crow, scd, valid, G, BL, BITS, PER)


def _row_units(R: tl.constexpr, n_units, H, T):
    # one unit = one (batch, head, row)
    u, valid = _units(R, n_units)
    return u, valid, u // (T * H), (u // T) % H, u % T


def _int_qserve_kernel(x_ptr, codes_ptr, scale_ptr, offset_ptr, bad_ptr, start, H, T,
                       n_units, sxb, sxh, sxt, sxd, scb, sch, sct, scd, ssb, ssh, sst, sob,
                       soh, sot, D: tl.constexpr, BD: tl.constexpr, R: tl.constexpr,
                       TINY: tl.constexpr):  # fmt: skip
    u, valid, b, h, t = _row_units(R, n_units, H, T)
    d = tl.arange(0, BD)[None, :]
    m = valid[:, None] & (d < D)
    src = x_ptr + b * sxb + h * sxh + t * sxt
    x = tl.load(src[:, None] + d * sxd, mask=m, other=0.0).to(tl.float32)
    lo = tl.where(valid, tl.min(tl.where(m, x, float("inf")), axis=1), 0.0)
    hi = tl.where(valid, tl.max(tl.where(m, x, float("-inf")), axis=1), 0.0)
    # affine.qserve_qparams
    ideal = tl.math.div_rn(hi - lo, tl.full([R], 15.0, tl.float32))
    s = _round_up(tl.where(hi > lo, ideal, 1.0), 1, TINY)
    sf = s.to(tl.float32)
    off = tl.math.div_rn(0.0 - lo, sf).to(tl.float16)
    tl.store(scale_ptr + b * ssb + h * ssh + (start + t) * sst, s, mask=valid)
    tl.store(offset_ptr + b * sob + h * soh + (start + t) * sot, off, mask=valid)
    _flag_rows(bad_ptr, u, valid, x, m, s, off)
    q = _rint(tl.math.div_rn(x, sf[:, None]) + off.to(tl.float32)[:, None])
    q = tl.minimum(tl.maximum(q, 0.0), 15.0)
    codes = tl.where(m, q.to(tl.int32), 0)
    crow = codes_ptr + b * scb + h * sch + (start + t) * sct
    _pack_store(codes, crow, scd, valid, D, BD, 4, 2)


def _int_channel_kernel(x_ptr, codes_ptr, scale_ptr, offset_ptr, start, H, T, n_units,
                        sxb, sxh, sxt, sxd, scb, sch, sct, scd, ssh, ssd, soh, sod,
                        D: tl.constexpr, BD: tl.constexpr, R: tl.constexpr, BITS: tl.constexpr,
                        PER: tl.constexpr, SYM: tl.constexpr):  # fmt: skip
    u, valid, b, h, t = _row_units(R, n_units, H, T)
    d = tl.arange(0, BD)[None, :]
    m = valid[:, None] & (d < D)
    src = x_ptr + b * sxb + h * sxh + t * sxt
    x = tl.load(src[:, None] + d * sxd, mask=m, other=0.0).to(tl.float32)
    s = tl.load(scale_ptr + h[:, None] * ssh + d * ssd, mask=m, other=1.0).to(tl.float32)
    if SYM:
        top = (1 << (BITS - 1)) - 1
        q = _rint(tl.math.div_rn(x, s))
        q = tl.minimum(tl.maximum(q, -top), top) + (1 << (BITS - 1))
    else:
        o = tl.load(offset_ptr + h[:, None] * soh + d * sod, mask=m, other=0.0)
        q = _rint(tl.math.div_rn(x - o.to(tl.float32), s))
        q = tl.minimum(tl.maximum(q, 0.0), (1 << BITS) - 1)
    codes = tl.where(m, q.to(tl.int32), 0)
    crow = codes_ptr + b * scb + h * sch + (start + t) * sct
    _pack_store(codes, crow, scd, valid, D, BD, BITS, PER)


def _fp8_kernel(x_ptr, codes_ptr, scale_ptr, start, H, T, n_units,
                sxb, sxh, sxt, sxd, scb, sch, sct, scd, ssh,
                D: tl.constexpr, BD: tl.constexpr, R: tl.constexpr, TOP: tl.constexpr,
                MBITS: tl.constexpr, RND: tl.constexpr, REBIAS: tl.constexpr,
                MIN_NORMAL: tl.constexpr, SUB: tl.constexpr):  # fmt: skip
    u, valid, b, h, t = _row_units(R, n_units, H, T)
    d = tl.arange(0, BD)[None, :]
    m = valid[:, None] & (d < D)
    src = x_ptr + b * sxb + h * sxh + t * sxt
    x = tl.load(src[:, None] + d * sxd, mask=m, other=0.0).to(tl.float32)
    s = tl.load(scale_ptr + h * ssh, mask=valid, other=1.0).to(tl.float32)
    v = tl.math.div_rn(x, s[:, None])
    v = tl.minimum(tl.maximum(v, -TOP), TOP)  # saturate, as fp8.fp8_encode
    bits = v.to(tl.int32, bitcast=True)
    a = bits & 0x7FFFFFFF
    # normal target: round the fp32 mantissa to MBITS bits (ties to even), carry into
    # the exponent, then rebias the exponent
    shift: tl.constexpr = 23 - MBITS
    normal = ((a + RND + ((a >> shift) & 1)) >> shift) - REBIAS
    # subnormal target (and the round-up into the smallest normal): an integer multiple
    # of the subnormal step; scaling by a power of two is exact (the minimum only keeps
    # lanes that take the normal branch from overflowing the int conversion)
    sub = _rint(tl.minimum(a.to(tl.float32, bitcast=True), 1.0) * SUB).to(tl.int32)
    mag = tl.where(a >= MIN_NORMAL, normal, sub)
    code = tl.where(bits < 0, mag | 0x80, mag)
    crow = codes_ptr + b * scb + h * sch + (start + t) * sct
    tl.store(crow[:, None] + d * scd, code.to(tl.uint8), mask=m)


def _nuq_codes(xn, mids_ptr, m, BITS: tl.constexpr):
    # count of midpoints strictly below xn = torch.bucketize(right=False) on the sorted
    # midpoints of nuq.nuq_encode; binary lifting over the 2^BITS - 1 midpoints
    pos = tl.zeros(xn.shape, tl.int32)
    for k in tl.static_range(BITS):
        cand = pos + (1 << (BITS - 1 - k))
        mid = tl.load(mids_ptr + cand - 1, mask=m, other=0.0)
        pos = tl.where(mid < xn, cand, pos)
    return tl.where(m, pos, 0)


def _pick(x, avail, offs, LOW: tl.constexpr):
    # the next tail element of a stable ascending sort of each row: smallest value,
    # lowest coordinate first (LOW), or largest value, highest coordinate first
    if LOW:
        v = tl.min(tl.where(avail, x, float("inf")), axis=1)
        i = tl.min(tl.where(avail & (x == v[:, None]), offs, 1 << 30), axis=1)
    else:
        v = tl.max(tl.where(avail, x, float("-inf")), axis=1)
        i = tl.max(tl.where(avail & (x == v[:, None]), offs, -1), axis=1)
    return avail & (offs == i[:, None])


def _nuq_value_kernel(x_ptr, codes_ptr, scale_ptr, center_ptr, index_ptr, value_ptr, mids_ptr,
                      bad_ptr, start, H, T, n_units, sxb, sxh, sxt, sxd, scb, sch, sct, scd,
                      ssb, ssh, sst, seb, seh, sec, sib, sih, sit, sis, svb, svh, svt, svs,
                      D: tl.constexpr, BD: tl.constexpr, R: tl.constexpr, K: tl.constexpr,
                      BITS: tl.constexpr, PER: tl.constexpr, DT: tl.constexpr,
                      RANGE: tl.constexpr, TINY: tl.constexpr):  # fmt: skip
    u, valid, b, h, t = _row_units(R, n_units, H, T)
    d = tl.arange(0, BD)[None, :]
    m = valid[:, None] & (d < D)
    src = x_ptr + b * sxb + h * sxh + t * sxt
    x = tl.load(src[:, None] + d * sxd, mask=m, other=0.0).to(tl.float32)
    if K > 0:
        avail = m
        if RANGE:
            # sparse.row_outliers split "range": K rounds, each removing the end of the
            # remaining sorted values whose gap to its neighbour is larger (ties: high end)
            for _ in tl.static_range(K):
                low = _pick(x, avail, d, True)
                high = _pick(x, avail, d, False)
                v1 = tl.min(tl.where(low, x, float("inf")), axis=1)
                v2 = tl.min(tl.where(avail & ~low, x, float("inf")), axis=1)
                w1 = tl.max(tl.where(high, x, float("-inf")), axis=1)
                w2 = tl.max(tl.where(avail & ~high, x, float("-inf")), axis=1)
                take_low = (v2 - v1) > (w1 - w2)
                avail = avail & ~tl.where(take_low[:, None], low, high)
            lo = tl.min(tl.where(avail, x, float("inf")), axis=1)
            hi = tl.max(tl.where(avail, x, float("-inf")), axis=1)
        else:
            # sparse.row_outliers split "tails": the K smallest and K largest, ties by
            # coordinate
            for _ in tl.static_range(K):
                avail = avail & ~_pick(x, avail, d, True)
            # inlier bounds: the elements at sorted positions K and D - 1 - K
            lo = tl.min(tl.where(_pick(x, avail, d, True), x, float("inf")), axis=1)
            for _ in tl.static_range(K):
                avail = avail & ~_pick(x, avail, d, False)
            hi = tl.max(tl.where(_pick(x, avail, d, False), x, float("-inf")), axis=1)
        picked = m & ~avail
        slot = tl.cumsum(picked.to(tl.int32), axis=1) - 1  # ascending coordinate order
        irow = index_ptr + b * sib + h * sih + (start + t) * sit
        vrow = value_ptr + b * svb + h * svh + (start + t) * svt
        tl.store(irow[:, None] + slot * sis, d.to(index_ptr.dtype.element_ty), mask=picked)
        tl.store(vrow[:, None] + slot * svs, x.to(tl.float16), mask=picked)
    else:
        lo = tl.min(tl.where(m, x, float("inf")), axis=1)
        hi = tl.max(tl.where(m, x, float("-inf")), axis=1)
    lo = tl.where(valid, lo, 0.0)
    hi = tl.where(valid, hi, 0.0)
    # nuq.normalizer
    center = _near(lo * 0.5 + hi * 0.5, DT)
    c = center.to(tl.float32)
    half = tl.maximum(hi - c, c - lo)
    s = _round_up(tl.where(hi > lo, half, 1.0), DT, TINY)
    tl.store(scale_ptr + b * ssb + h * ssh + (start + t) * sst, s, mask=valid)
    tl.store(center_ptr + b * seb + h * seh + (start + t) * sec, center, mask=valid)
    _flag_rows(bad_ptr, u, valid, x, m, s, center)
    xn = tl.math.div_rn(x - c[:, None], s.to(tl.float32)[:, None])
    codes = _nuq_codes(xn, mids_ptr, m, BITS)
    crow = codes_ptr + b * scb + h * sch + (start + t) * sct
    _pack_store(codes, crow, scd, valid, D, BD, BITS, PER)


def _nuq_key_kernel(x_ptr, codes_ptr, count_ptr, mask_ptr, mids_ptr, scale_ptr, center_ptr,
                    lower_ptr, upper_ptr, start, H, T, n_units,
                    sxb, sxh, sxt, sxd, scb, sch, sct, scd, snb, snh, snt,
                    ssh, ssd, seh, sed, slh, sld, suh, sud,
                    D: tl.constexpr, BD: tl.constexpr, R: tl.constexpr, BITS: tl.constexpr,
                    PER: tl.constexpr, OUTLIERS: tl.constexpr):  # fmt: skip
    u, valid, b, h, t = _row_units(R, n_units, H, T)
    d = tl.arange(0, BD)[None, :]
    m = valid[:, None] & (d < D)
    hh = h[:, None]
    src = x_ptr + b * sxb + h * sxh + t * sxt
    x = tl.load(src[:, None] + d * sxd, mask=m, other=0.0).to(tl.float32)
    if OUTLIERS:
        # sparse.threshold_outliers, then clip so the hole's code is the nearest end level
        lw = tl.load(lower_ptr + hh * slh + d * sld, mask=m, other=0.0).to(tl.float32)
        up = tl.load(upper_ptr + hh * suh + d * sud, mask=m, other=0.0).to(tl.float32)
        out = ((x < lw) | (x > up)) & m
        tl.store(mask_ptr + u[:, None] * D + d, out.to(tl.uint8), mask=m)
        count = tl.sum(out.to(tl.int32), axis=1)
        tl.store(count_ptr + b * snb + h * snh + (start + t) * snt, count.to(tl.uint8), mask=valid)
        x = tl.minimum(tl.maximum(x, lw), up)
    s = tl.load(scale_ptr + hh * ssh + d * ssd, mask=m, other=1.0).to(tl.float32)
    c = tl.load(center_ptr + hh * seh + d * sed, mask=m, other=0.0).to(tl.float32)
    codes = _nuq_codes(tl.math.div_rn(x - c, s), mids_ptr, m, BITS)
    crow = codes_ptr + b * scb + h * sch + (start + t) * sct
    _pack_store(codes, crow, scd, valid, D, BD, BITS, PER)


_JIT = (
    "_rint",
    "_near",
    "_step",
    "_round_up",
    "_units",
    "_row_units",
    "_pack_store",
    "_int_token_kernel",
    "_int_qserve_kernel",
    "_int_channel_kernel",
    "_fp8_kernel",
    "_nuq_codes",
    "_pick",
    "_finite",
    "_flag_rows",
    "_nuq_value_kernel",
    "_nuq_key_kernel",
)


@functools.cache
def jit() -> None:
    """Import triton, bind `tl` and decorate the kernel bodies above (once)."""
    global tl
    import triton
    import triton.language

    tl = triton.language
    g = globals()
    for name in _JIT:
        g[name] = triton.jit(g[name])
