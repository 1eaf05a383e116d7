"""Triton kernel for `decode_attention_triton` (imported lazily: it imports triton).

One program = one (batch, KV head) pair and one split of a segment's rows. It
walks its rows in tiles of BLOCK_T (with PREFETCH, loading each tile's code words
one tile ahead), decodes K (in two halves, so a pre-RoPE key can be rotated with
its partner channel in registers) and V, and keeps the online-softmax state for
its R padded query rows (the G query heads of the KV head times the Q query
positions). Scores are in base 2 (the launcher folds
log2(e) into the softmax scale). Post-RoPE keys with static per-channel qparams
(asymmetric codes, codebook levels, vector-codebook coordinates) fold them into the
query once per program, so the loop dots bare codes. Partial (max, denominator, numerator) go to memory,
every segment's splits into one set of buffers, for the reduction pass
(`combine_partials_kernel`, one launch for the whole call).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _codes(ptr, rows, chans, ok, stride_t, BITS: tl.constexpr):
    """int32 codes [BT, BC] of `chans` in packed rows (code c sits at bit c * BITS)."""
    bit = chans * BITS
    addr = ptr + rows[:, None] * stride_t + (bit // 8)[None, :]
    word = tl.load(addr, mask=ok, other=0).to(tl.int32)
    if BITS != 8:
        shift = (bit % 8)[None, :]
        if 8 % BITS != 0:  # a code of 3, 6 or 12 bits may straddle two bytes
            spill = ok & (shift > 8 - BITS)
            word = word | (tl.load(addr + 1, mask=spill, other=0).to(tl.int32) << 8)
        word = (word >> shift) & ((1 << BITS) - 1)
    return word


@triton.jit
def _vector_levels(ptr, lanes, table, rows, chans, chan_ok, ok, stride_t, BITS: tl.constexpr,
                   VDIM: tl.constexpr, index=None, HAS_INDEX: tl.constexpr = False):  # fmt: skip
    """Codebook coordinates float32 [BT, BC] of `chans` in vector-coded rows: channel c is
    coordinate lanes[c] % VDIM of group lanes[c] // VDIM. A group's VDIM digits of BITS
    bits sit side by side, lowest first, so its codebook index is simply the group's
    (BITS * VDIM)-bit field of the row: one gather per channel (two where a field may
    straddle bytes), then one of the centroids, stored row after row ([2^(BITS VDIM),
    VDIM]). Channels of one group may sit in different tiles (a pre-RoPE key's halves),
    so each channel reads its group's field itself (L1 hits after the first), unless the
    caller read the fields already (HAS_INDEX: `index`, [BT, BC])."""
    FIELD: tl.constexpr = BITS * VDIM
    lane = tl.load(lanes + chans, mask=chan_ok, other=0)  # [BC] int32
    if not HAS_INDEX:
        index = _codes(ptr, rows, lane // VDIM, ok, stride_t, FIELD)
    return tl.load(table + index * VDIM + (lane % VDIM)[None, :], mask=ok, other=0.0)


@triton.jit
def _trellis_levels(ptr, table, rows, chans, ok, stride_t, BITS: tl.constexpr,
                    DIGITS: tl.constexpr):  # fmt: skip
    """Trellis levels float32 [BT, BC] of `chans` (`kvq.quant.trellis`): channel c's state
    is its digit and the DIGITS - 1 digits before it in the row (zeros before channel 0),
    the newest lowest: one gather per digit (neighbouring channels share bytes: L1 hits),
    then one of the table of 2^(BITS DIGITS) levels."""
    state = _codes(ptr, rows, chans, ok, stride_t, BITS)
    for j in tl.static_range(1, DIGITS):
        before = chans - j
        has = ok & (before >= 0)[None, :]
        older = _codes(ptr, rows, tl.maximum(before, 0), has, stride_t, BITS)
        state = state | (older << (BITS * j))
    return tl.load(table + state, mask=ok, other=0.0)


@triton.jit
def _code_words(ptr, rows, row_ok, stride_t, C0: tl.constexpr, NVALID: tl.constexpr,
                BLOCK_C: tl.constexpr, BITS: tl.constexpr):  # fmt: skip
    """int32 [BT, BLOCK_C * BITS / 32] little-endian words holding the codes of channels
    C0 ... C0 + BLOCK_C - 1 (4 or 8 bits; C0, NVALID, the row stride and the base address
    on 4-byte boundaries): one contiguous load per row, four bytes per element instead of
    one. Held across an iteration (PREFETCH), words take fewer registers than bytes (KV4,
    Llama-like heads, 32-row tiles, 4 warps, codes alone: 136 per thread against 147);
    loaded in the iteration that uses them, bytes unpack with fewer live registers, so
    that path keeps them (`_codes_vec`)."""
    PER: tl.constexpr = 32 // BITS  # codes per word
    word = tl.arange(0, BLOCK_C // PER)
    ok = row_ok[:, None] & (word * PER < NVALID)[None, :]
    addr = ptr + rows[:, None] * stride_t + (C0 * BITS // 8 + 4 * word)[None, :]
    return tl.load(addr.to(tl.pointer_type(tl.int32), bitcast=True), mask=ok, other=0)


@triton.jit
def _unpack_words(w, BITS: tl.constexpr):
    """Words [BT, n] from `_code_words` -> int32 codes [BT, n * 32 / BITS] in channel order.
    Code i of a word sits at bit i * BITS; interleaving the even codes with the odd ones,
    each half built the same way one level down, puts them back in order."""
    M: tl.constexpr = (1 << BITS) - 1
    if BITS == 8:
        even = tl.interleave(w & M, (w >> 16) & M)
        odd = tl.interleave((w >> 8) & M, (w >> 24) & M)
    else:  # 4 bits: even codes 0, 2, 4, 6 and odd codes 1, 3, 5, 7
        even = tl.interleave(
            tl.interleave(w & M, (w >> 16) & M), tl.interleave((w >> 8) & M, (w >> 24) & M)
        )
        odd = tl.interleave(
            tl.interleave((w >> 4) & M, (w >> 20) & M), tl.interleave((w >> 12) & M, (w >> 28) & M)
        )
    return tl.interleave(even, odd)


@triton.jit
def _codes_vec(ptr, rows, row_ok, stride_t, C0: tl.constexpr, NVALID: tl.constexpr,
               BLOCK_C: tl.constexpr, BITS: tl.constexpr):  # fmt: skip
    """int32 codes [BT, BLOCK_C] of channels C0 ... C0 + BLOCK_C - 1 (2/4/8 bits, C0 on a
    byte boundary): one contiguous [BT, bytes] load, then the code slots of each byte
    interleaved back into channel order. Each byte is loaded once, as a vector, instead of
    once per code through a per-element gather."""
    PER: tl.constexpr = 8 // BITS
    byte = tl.arange(0, BLOCK_C // PER)
    ok = row_ok[:, None] & (byte * PER < NVALID)[None, :]
    addr = ptr + rows[:, None] * stride_t + (C0 // PER + byte)[None, :]
    raw = tl.load(addr, mask=ok, other=0).to(tl.int32)  # [BT, BLOCK_C / PER]
    M: tl.constexpr = (1 << BITS) - 1
    if BITS == 4:
        raw = tl.interleave(raw & M, raw >> 4)
    elif BITS == 2:  # slots 0..3 = bits 0, 2, 4, 6: interleave (0, 2) with (1, 3)
        raw = tl.interleave(
            tl.interleave(raw & M, (raw >> 4) & M), tl.interleave((raw >> 2) & M, raw >> 6)
        )
    return raw


@triton.jit
def _group_qparams(ptr, rows, row_ok, q_t, other, GROUP: tl.constexpr, C0: tl.constexpr,
                   NVALID: tl.constexpr, BC: tl.constexpr):  # fmt: skip
    """Per-row qparams [BT, BC // GROUP] (stored dtype) of the groups of GROUP channels that
    tile channels C0 ... C0 + BC - 1."""
    gi = tl.arange(0, BC // GROUP)
    g_ok = row_ok[:, None] & (gi * GROUP < NVALID)[None, :]
    return tl.load(ptr + rows[:, None] * q_t + (C0 // GROUP + gi)[None, :], mask=g_ok, other=other)


@triton.jit
def _spread_groups(v, GROUP: tl.constexpr):
    """[BT, n] per-group qparams -> float32 [BT, n * GROUP], each over its group's channels."""
    BT: tl.constexpr = v.shape[0]
    N: tl.constexpr = v.shape[1]
    v = tl.broadcast_to(v.to(tl.float32)[:, :, None], (BT, N, GROUP))
    return tl.reshape(v, (BT, N * GROUP))


@triton.jit
def _qparam(ptr, rows, row_ok, chans, ok, chan_ok, q_t, other, QAXIS: tl.constexpr,
            GROUP: tl.constexpr, C0: tl.constexpr, NVALID: tl.constexpr, pre=None,
            PRE: tl.constexpr = False):  # fmt: skip
    """One qparam family as float32, broadcastable to [BT, BC]. Per-row groups: one
    [BT, groups] load broadcast over each group's channels (a per-element gather where
    groups do not tile the block; PRE: `pre` holds the load, made by the caller). Static
    per-channel qparams: a [BT, BC] read of one [BC] row (see below); per head: a scalar."""
    BC: tl.constexpr = chans.shape[0]
    if QAXIS == 1:  # per row, groups of GROUP channels
        if PRE:
            v = _spread_groups(pre, GROUP)
        elif C0 % GROUP == 0 and BC % GROUP == 0:
            v = _spread_groups(_group_qparams(ptr, rows, row_ok, q_t, other, GROUP, C0, NVALID,
                                              BC), GROUP)  # fmt: skip
        else:
            q_off = rows[:, None] * q_t + (chans // GROUP)[None, :]
            v = tl.load(ptr + q_off, mask=ok, other=other).to(tl.float32)
    elif QAXIS == 2:  # per channel (static): q_t is 0, a stride the compiler cannot see
        # through, so this [BT, BC] read (L1 hits) stays in the loop; a [BC] vector it could
        # hoist would be held in registers across the loop instead, which at head_dim 128
        # costs about 35 registers per thread and half the resident warps
        # (bench/kernel_resources.py)
        v = tl.load(ptr + rows[:, None] * q_t + chans[None, :], mask=ok, other=other)
        v = v.to(tl.float32)
    else:  # one per head (static)
        v = tl.load(ptr).to(tl.float32)
    return v


@triton.jit
def _dequantize(x, scale, offset, zp, zero, rows, row_ok, chans, ok, chan_ok, q_t,
                KIND: tl.constexpr, QAXIS: tl.constexpr, GROUP: tl.constexpr,
                HAS_OFF: tl.constexpr, HAS_ZP: tl.constexpr, C0: tl.constexpr,
                NVALID: tl.constexpr, pre_s=None, pre_o=None, pre_z=None,
                PRE_Q: tl.constexpr = False):  # fmt: skip
    """Codes or levels x [BT, BC] -> (x - zero - zero_point) * scale + offset (affine) or
    x * scale + offset (lookup). PRE_Q: per-row group qparams preloaded by the caller."""
    if KIND == 1:
        x = x - zero
    if HAS_ZP:
        x = x - _qparam(
            zp, rows, row_ok, chans, ok, chan_ok, q_t, 0.0, QAXIS, GROUP, C0, NVALID, pre_z, PRE_Q
        )
    x = x * _qparam(
        scale, rows, row_ok, chans, ok, chan_ok, q_t, 1.0, QAXIS, GROUP, C0, NVALID, pre_s, PRE_Q
    )
    if HAS_OFF:
        x = x + _qparam(
            offset, rows, row_ok, chans, ok, chan_ok, q_t, 0.0, QAXIS, GROUP, C0, NVALID, pre_o,
            PRE_Q,
        )  # fmt: skip
    return x


@triton.jit
def _fold_static(q, scale, offset, zp, zero, chans, chan_ok, KIND: tl.constexpr,
                 HAS_OFF: tl.constexpr, HAS_ZP: tl.constexpr):  # fmt: skip
    """Static per-channel key qparams folded into the query rows q [R, BC]:
    q . ((x - zero - zp) * s + o) = (q * s) . x + q . (o - (zero + zp) * s), so the loop can
    dot bare codes (or levels) x. Returns (q * s, the second term per row [R])."""
    s = tl.load(scale + chans, mask=chan_ok, other=1.0).to(tl.float32)[None, :]
    shift = s * 0.0
    if KIND == 1:
        shift = shift + zero
    if HAS_ZP:
        shift = shift + tl.load(zp + chans, mask=chan_ok, other=0.0).to(tl.float32)[None, :]
    bias = -shift * s
    if HAS_OFF:
        bias = bias + tl.load(offset + chans, mask=chan_ok, other=0.0).to(tl.float32)[None, :]
    return q * s, tl.sum(q * bias, axis=1)


@triton.jit
def _decode_tile(
    data,
    scale,
    offset,
    zp,
    table,
    slot_i,
    slot_v,
    count,
    eptr,
    e_idx,
    e_val,
    d_t,
    q_t,
    s_t,
    c_t,
    p_t,
    zero,
    rows,
    row_ok,
    chans,
    chan_ok,
    KIND: tl.constexpr,
    BITS: tl.constexpr,
    QAXIS: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_OFF: tl.constexpr,
    HAS_ZP: tl.constexpr,
    SLOTS: tl.constexpr,
    FLAT: tl.constexpr,
    C0: tl.constexpr,
    NVALID: tl.constexpr,
    RAW: tl.constexpr = False,
    raw=None,
    PRELOADED: tl.constexpr = False,
    pre_s=None,
    pre_o=None,
    pre_z=None,
    PRE_Q: tl.constexpr = False,
    lanes=None,
    VDIM: tl.constexpr = 1,
):
    """Decoded float32 [BT, BC] for rows x chans (chans = C0 + arange(BC), the first NVALID
    of them real); pointers already point at (batch, head). RAW: the bare codes (affine) or
    levels (lookup), for a caller that applies zero, scale and offset elsewhere. PRELOADED:
    `raw` holds the tile's code words (`_code_words`), loaded by the caller; PRE_Q: so do
    pre_s, pre_o, pre_z its per-row group qparams (`_group_qparams`). KIND 3 (vector
    codebooks): `lanes` and VDIM locate each channel's group (`_vector_levels`); PRELOADED:
    `raw` holds the tile's group indices. KIND 4 (trellis codes): VDIM is a state's digits
    (`_trellis_levels`)."""
    ok = row_ok[:, None] & chan_ok[None, :]
    if KIND == 0:
        x = tl.load(data + rows[:, None] * d_t + chans[None, :], mask=ok, other=0.0)
        x = x.to(tl.float32)
    elif KIND >= 3:
        if KIND == 3:
            x = _vector_levels(data, lanes, table, rows, chans, chan_ok, ok, d_t, BITS, VDIM,
                               raw, PRELOADED)  # fmt: skip
        else:
            x = _trellis_levels(data, table, rows, chans, ok, d_t, BITS, VDIM)
        if not RAW:
            x = _dequantize(x, scale, offset, zp, zero, rows, row_ok, chans, ok, chan_ok, q_t,
                            KIND, QAXIS, GROUP, HAS_OFF, HAS_ZP, C0, NVALID, pre_s, pre_o,
                            pre_z, PRE_Q)  # fmt: skip
    else:
        if BITS == 3:  # codes straddle bytes: per-element gather
            c = _codes(data, rows, chans, ok, d_t, BITS)
        elif PRELOADED:  # the caller loaded this tile's code words one tile ahead
            c = _unpack_words(raw, BITS)
        elif C0 % (8 // BITS) == 0 and NVALID % (8 // BITS) == 0:
            c = _codes_vec(data, rows, row_ok, d_t, C0, NVALID, chans.shape[0], BITS)
        else:
            c = _codes(data, rows, chans, ok, d_t, BITS)
        if KIND == 1:  # noqa: SIM108 (constexpr branches, not a runtime choice)
            x = c.to(tl.float32)
        else:
            x = tl.load(table + c, mask=ok, other=0.0)
        if not RAW:
            x = _dequantize(x, scale, offset, zp, zero, rows, row_ok, chans, ok, chan_ok, q_t,
                            KIND, QAXIS, GROUP, HAS_OFF, HAS_ZP, C0, NVALID, pre_s, pre_o,
                            pre_z, PRE_Q)  # fmt: skip
    for s in tl.static_range(SLOTS):
        idx = tl.load(slot_i + rows * s_t + s, mask=row_ok, other=-1).to(tl.int32)
        val = tl.load(slot_v + rows * s_t + s, mask=row_ok, other=0.0).to(tl.float32)
        x = tl.where(chans[None, :] == idx[:, None], val[:, None], x)
    if FLAT:
        cnt = tl.load(count + rows * c_t, mask=row_ok, other=0).to(tl.int32)
        first = tl.load(eptr + rows * p_t, mask=row_ok, other=0)
        for j in range(0, tl.max(cnt, axis=0)):
            has = j < cnt
            idx = tl.load(e_idx + first + j, mask=has, other=-1).to(tl.int32)
            val = tl.load(e_val + first + j, mask=has, other=0.0).to(tl.float32)
            hit = (chans[None, :] == idx[:, None]) & has[:, None]
            x = tl.where(hit, val[:, None], x)
    return x


@triton.jit
def _tile_ahead(rows, row_ok, kd, kd_t, vd, vd_t, vsc, vof, vzp, vq_t, HALF: tl.constexpr,
                BLOCK_HALF: tl.constexpr, K_BITS: tl.constexpr, D: tl.constexpr,
                BLOCK_D: tl.constexpr, V_BITS: tl.constexpr, V_GROUP: tl.constexpr,
                V_HAS_OFF: tl.constexpr, V_HAS_ZP: tl.constexpr, PF_K: tl.constexpr,
                PF_V: tl.constexpr, PF_VQ: tl.constexpr):  # fmt: skip
    """What PREFETCH loads for the tile of `rows`, one iteration before it is decoded: (key
    words of each half, value words, value scale, offset, zero-point group qparams); 0 for
    what is not prefetched (PF_K: key codes, PF_V: value codes, PF_VQ: value qparams)."""
    k1 = 0
    k2 = 0
    v = 0
    vs = 0
    vo = 0
    vz = 0
    if PF_K:
        k1 = _code_words(kd, rows, row_ok, kd_t, 0, HALF, BLOCK_HALF, K_BITS)
        k2 = _code_words(kd, rows, row_ok, kd_t, HALF, HALF, BLOCK_HALF, K_BITS)
    if PF_V:
        v = _code_words(vd, rows, row_ok, vd_t, 0, D, BLOCK_D, V_BITS)
    if PF_VQ:
        vs = _group_qparams(vsc, rows, row_ok, vq_t, 1.0, V_GROUP, 0, D, BLOCK_D)
        if V_HAS_OFF:
            vo = _group_qparams(vof, rows, row_ok, vq_t, 0.0, V_GROUP, 0, D, BLOCK_D)
        if V_HAS_ZP:
            vz = _group_qparams(vzp, rows, row_ok, vq_t, 0.0, V_GROUP, 0, D, BLOCK_D)
    return k1, k2, v, vs, vo, vz


@triton.jit(do_not_specialize=["tune_bucket"])
def decode_attention_kernel(
    q,
    sq_b,
    sq_h,
    sq_q,
    # key family: tensors, then strides
    k_data,
    k_scale,
    k_off,
    k_zp,
    k_table,
    k_lanes,
    k_slot_i,
    k_slot_v,
    k_count,
    k_eptr,
    k_eidx,
    k_eval,
    kd_b,
    kd_h,
    kd_t,
    kq_b,
    kq_h,
    kq_t,
    ks_b,
    ks_h,
    ks_t,
    kc_b,
    kc_h,
    kc_t,
    kp_b,
    kp_h,
    kp_t,
    # value family
    v_data,
    v_scale,
    v_off,
    v_zp,
    v_table,
    v_lanes,
    v_slot_i,
    v_slot_v,
    v_count,
    v_eptr,
    v_eidx,
    v_eval,
    vd_b,
    vd_h,
    vd_t,
    vq_b,
    vq_h,
    vq_t,
    vs_b,
    vs_h,
    vs_t,
    vc_b,
    vc_h,
    vc_t,
    vp_b,
    vp_h,
    vp_t,
    # rope, mask, outputs, sizes
    pos,
    pos_b,
    cos,
    sin,
    mask,
    m_b,
    m_q,
    m_out,
    l_out,
    acc_out,
    T,
    HKV,
    col_base,
    total,
    rows_per_split,
    split_base,
    split_total,
    k_zero,
    v_zero,
    scaling,
    softcap,
    tune_bucket,  # unused by the kernel: the autotuner's shape bucket (AUTOTUNE_KEY)
    Q: tl.constexpr,
    G: tl.constexpr,
    R: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_T: tl.constexpr,
    PRE_ROPE: tl.constexpr,
    HAS_MASK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HALF_DOTS: tl.constexpr,
    K_KIND: tl.constexpr,
    K_BITS: tl.constexpr,
    K_QAXIS: tl.constexpr,
    K_GROUP: tl.constexpr,
    K_HAS_OFF: tl.constexpr,
    K_HAS_ZP: tl.constexpr,
    K_SLOTS: tl.constexpr,
    K_FLAT: tl.constexpr,
    V_KIND: tl.constexpr,
    V_BITS: tl.constexpr,
    V_QAXIS: tl.constexpr,
    V_GROUP: tl.constexpr,
    V_HAS_OFF: tl.constexpr,
    V_HAS_ZP: tl.constexpr,
    V_SLOTS: tl.constexpr,
    V_FLAT: tl.constexpr,
    K_WORDS: tl.constexpr = False,
    V_WORDS: tl.constexpr = False,
    PREFETCH: tl.constexpr = False,
    K_VDIM: tl.constexpr = 1,
    V_VDIM: tl.constexpr = 1,
    K_SHARED: tl.constexpr = False,
):
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // HKV
    h = bh % HKV
    HALF: tl.constexpr = D // 2

    # query rows r = g * Q + qi  ->  head h * G + g, position qi
    r = tl.arange(0, R)
    r_ok = r < G * Q
    g = r // Q
    qi = r % Q
    j = tl.arange(0, BLOCK_HALF)
    j_ok = j < HALF
    q_base = q + b * sq_b + (h * G + g) * sq_h + qi * sq_q
    q_ok = r_ok[:, None] & j_ok[None, :]
    LOG2E: tl.constexpr = 1.4426950408889634  # scores are kept in base 2 (exp2)
    if softcap > 0:  # noqa: SIM108 (cap natural-unit logits first, convert to base 2 after)
        q_scale = scaling
    else:
        q_scale = scaling * LOG2E
    q1 = tl.load(q_base[:, None] + j[None, :], mask=q_ok, other=0.0) * q_scale
    q2 = tl.load(q_base[:, None] + HALF + j[None, :], mask=q_ok, other=0.0) * q_scale

    # each family's pointers at this (batch, head)
    kd = k_data + b * kd_b + h * kd_h
    ksc = k_scale + b * kq_b + h * kq_h
    kof = k_off + b * kq_b + h * kq_h
    kzp = k_zp + b * kq_b + h * kq_h
    ksi = k_slot_i + b * ks_b + h * ks_h
    ksv = k_slot_v + b * ks_b + h * ks_h
    kcn = k_count + b * kc_b + h * kc_h
    kep = k_eptr + b * kp_b + h * kp_h
    vd = v_data + b * vd_b + h * vd_h
    vsc = v_scale + b * vq_b + h * vq_h
    vof = v_off + b * vq_b + h * vq_h
    vzp = v_zp + b * vq_b + h * vq_h
    vsi = v_slot_i + b * vs_b + h * vs_h
    vsv = v_slot_v + b * vs_b + h * vs_h
    vcn = v_count + b * vc_b + h * vc_h
    vep = v_eptr + b * vp_b + h * vp_h

    # post-RoPE keys with static per-channel qparams and no exceptions: the scale goes into
    # the query and the offset into one bias per query row, once per program
    # (`_fold_static`), so the loop decodes bare key codes and holds no key qparams: about
    # 40 registers per thread fewer, twice the resident warps (bench/kernel_resources.py).
    # Pre-RoPE keys cannot fold: RoPE mixes channel pairs with different scales. Nor do
    # symmetric codes (no offset): bare, they sit around their zero (128 for INT8), and a
    # tf32 or fp16 dot would round the query against operands several times the key
    FOLD_K: tl.constexpr = (
        (K_KIND >= 2 or K_HAS_OFF) and K_QAXIS == 2 and not PRE_ROPE and K_SLOTS == 0 and not K_FLAT
    )
    k_bias = tl.zeros([R], tl.float32)
    if FOLD_K:
        q1, b1 = _fold_static(q1, ksc, kof, kzp, k_zero, j, j_ok, K_KIND, K_HAS_OFF, K_HAS_ZP)
        q2, b2 = _fold_static(q2, ksc, kof, kzp, k_zero, HALF + j, j_ok,
                              K_KIND, K_HAS_OFF, K_HAS_ZP)  # fmt: skip
        k_bias = b1 + b2

    dcol = tl.arange(0, BLOCK_D)
    d_ok = dcol < D
    m_i = tl.full([R], float("-inf"), tl.float32)
    l_i = tl.zeros([R], tl.float32)
    acc = tl.zeros([R, BLOCK_D], tl.float32)

    start = split * rows_per_split
    stop = tl.minimum(start + rows_per_split, T)
    # PREFETCH (a tuning choice): each tile's code words are loaded one iteration ahead, so
    # their memory latency overlaps the tile before instead of stalling the loop. Triton's
    # pipeliner (num_stages) leaves these loads alone when they reach the dots only through
    # an unpack (4-bit keys). Word-loaded codes only (K_WORDS, V_WORDS), with the values'
    # per-row qparams; what else a tile reads (static qparams, exceptions, tables, RoPE
    # rows) is loaded as before.
    PF_K: tl.constexpr = PREFETCH and K_WORDS
    PF_V: tl.constexpr = PREFETCH and V_WORDS
    # and the values' per-row group qparams, where groups tile the value block
    PF_VQ: tl.constexpr = PF_V and V_QAXIS == 1 and BLOCK_D % V_GROUP == 0
    t = start + tl.arange(0, BLOCK_T)
    next_k1, next_k2, next_v, next_vs, next_vo, next_vz = _tile_ahead(
        t, t < stop, kd, kd_t, vd, vd_t, vsc, vof, vzp, vq_t, HALF, BLOCK_HALF, K_BITS,
        D, BLOCK_D, V_BITS, V_GROUP, V_HAS_OFF, V_HAS_ZP, PF_K, PF_V, PF_VQ,
    )  # fmt: skip
    for t0 in range(start, stop, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        t_ok = t < stop
        raw_k1, raw_k2, raw_v = next_k1, next_k2, next_v
        raw_vs, raw_vo, raw_vz = next_vs, next_vo, next_vz
        if K_SHARED:  # vector keys: channels j and HALF + j share a group (RoPE pairs)
            k_group = tl.load(k_lanes + j, mask=j_ok, other=0) // K_VDIM
            k_ok = t_ok[:, None] & j_ok[None, :]
            raw_k1 = _codes(kd, t, k_group, k_ok, kd_t, K_BITS * K_VDIM)  # read once for both
            raw_k2 = raw_k1
        ahead = t + BLOCK_T
        next_k1, next_k2, next_v, next_vs, next_vo, next_vz = _tile_ahead(
            ahead, ahead < stop, kd, kd_t, vd, vd_t, vsc, vof, vzp, vq_t, HALF, BLOCK_HALF,
            K_BITS, D, BLOCK_D, V_BITS, V_GROUP, V_HAS_OFF, V_HAS_ZP, PF_K, PF_V, PF_VQ,
        )  # fmt: skip
        k1 = _decode_tile(
            kd, ksc, kof, kzp, k_table, ksi, ksv, kcn, kep, k_eidx, k_eval,
            kd_t, kq_t, ks_t, kc_t, kp_t, k_zero, t, t_ok, j, j_ok,
            K_KIND, K_BITS, K_QAXIS, K_GROUP, K_HAS_OFF, K_HAS_ZP, K_SLOTS, K_FLAT, 0, HALF, FOLD_K,
            raw_k1, PF_K or K_SHARED, lanes=k_lanes, VDIM=K_VDIM,
        )  # fmt: skip
        k2 = _decode_tile(
            kd, ksc, kof, kzp, k_table, ksi, ksv, kcn, kep, k_eidx, k_eval,
            kd_t, kq_t, ks_t, kc_t, kp_t, k_zero, t, t_ok, HALF + j, j_ok,
            K_KIND, K_BITS, K_QAXIS, K_GROUP, K_HAS_OFF, K_HAS_ZP, K_SLOTS, K_FLAT, HALF, HALF,
            FOLD_K, raw_k2, PF_K or K_SHARED, lanes=k_lanes, VDIM=K_VDIM,
        )  # fmt: skip
        if PRE_ROPE:
            p_t = tl.load(pos + b * pos_b + t, mask=t_ok, other=0)
            rope_off = p_t[:, None] * HALF + j[None, :]
            rope_ok = t_ok[:, None] & j_ok[None, :]
            c = tl.load(cos + rope_off, mask=rope_ok, other=1.0)
            s = tl.load(sin + rope_off, mask=rope_ok, other=0.0)
            k1, k2 = k1 * c - k2 * s, k2 * c + k1 * s
        if HALF_DOTS:  # fp16 operands, fp32 accumulation: half the registers, fp16 MMA
            scores = tl.dot(q1.to(tl.float16), tl.trans(k1.to(tl.float16)))
            scores += tl.dot(q2.to(tl.float16), tl.trans(k2.to(tl.float16)))
        else:
            scores = tl.dot(q1, tl.trans(k1), input_precision=DOT_PRECISION)
            scores += tl.dot(q2, tl.trans(k2), input_precision=DOT_PRECISION)  # [R, BLOCK_T]
        if FOLD_K:
            scores += k_bias[:, None]
        if softcap > 0:  # softcap * tanh(s / softcap), tanh(x) = 2 * sigmoid(2x) - 1
            scores = softcap * (2.0 * tl.sigmoid(2.0 * scores / softcap) - 1.0) * LOG2E

        col = col_base + t
        allowed = r_ok[:, None] & t_ok[None, :]
        if HAS_MASK:
            mv = tl.load(mask + b * m_b + qi[:, None] * m_q + col[None, :], mask=allowed, other=0)
            allowed = allowed & (mv != 0)
        else:
            allowed = allowed & (col[None, :] <= (total - Q + qi)[:, None])
        scores = tl.where(allowed, scores, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = _decode_tile(
            vd, vsc, vof, vzp, v_table, vsi, vsv, vcn, vep, v_eidx, v_eval,
            vd_t, vq_t, vs_t, vc_t, vp_t, v_zero, t, t_ok, dcol, d_ok,
            V_KIND, V_BITS, V_QAXIS, V_GROUP, V_HAS_OFF, V_HAS_ZP, V_SLOTS, V_FLAT, 0, D,
            False, raw_v, PF_V, raw_vs, raw_vo, raw_vz, PF_VQ, lanes=v_lanes, VDIM=V_VDIM,
        )  # fmt: skip
        if HALF_DOTS:
            pv = tl.dot(p.to(tl.float16), v.to(tl.float16))
        else:
            pv = tl.dot(p, v, input_precision=DOT_PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    # this segment's splits sit at split_base ... in partials shared by all segments
    out = (bh * split_total + split_base + split) * R + r
    tl.store(m_out + out, m_i)
    tl.store(l_out + out, l_i)
    tl.store(acc_out + out[:, None] * D + dcol[None, :], acc, mask=d_ok[None, :])


@triton.jit
def combine_partials_kernel(m, den, acc, out, S, R: tl.constexpr, D: tl.constexpr,
                            BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr,
                            BLOCK_D: tl.constexpr):  # fmt: skip
    """The reduction pass: one program per (batch x KV head, block of query rows) merges
    the S splits' (max, denominator, numerator), max in log2 units, into one softmax.
    m, den [BH, S, R]; acc [BH, S, R, D]; out [BH, R, D] (all contiguous float32)."""
    bh = tl.program_id(0)
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < R
    dcol = tl.arange(0, BLOCK_D)
    d_ok = dcol < D
    top = tl.full([BLOCK_R], float("-inf"), tl.float32)
    for s0 in range(0, S, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        ok = (s < S)[:, None] & r_ok[None, :]
        mv = tl.load(m + (bh * S + s)[:, None] * R + r[None, :], mask=ok, other=float("-inf"))
        top = tl.maximum(top, tl.max(mv, axis=0))
    top = tl.where(top == float("-inf"), 0.0, top)  # no split saw a key: weights are 0
    num = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    total = tl.zeros([BLOCK_R], tl.float32)
    for s in range(0, S):
        row = (bh * S + s) * R + r
        w = tl.exp2(tl.load(m + row, mask=r_ok, other=float("-inf")) - top)
        total += tl.load(den + row, mask=r_ok, other=0.0) * w
        ok = r_ok[:, None] & d_ok[None, :]
        num += tl.load(acc + row[:, None] * D + dcol[None, :], mask=ok, other=0.0) * w[:, None]
    res = num / tl.maximum(total, 1.1754943508222875e-38)[:, None]  # fp32 tiny
    o = out + (bh * R + r)[:, None] * D + dcol[None, :]
    tl.store(o, res, mask=r_ok[:, None] & d_ok[None, :])
