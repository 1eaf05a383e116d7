"""Triton kernels of the planned decode path (`decode_attention.planned_call`; imported
lazily: it imports triton).

One launch covers every segment of a layer call (sink rows, packed main rows, the
full-precision residual window): the grid is (batch x KV head, split), and split s
of a work item reads tiles [s * N // S, (s + 1) * N // S) of the N tiles of all its
segments laid end to end (`launch_plan.split_tiles`), each segment through its own
constexpr-specialised loop. The G query heads of the KV head and the Q query
positions are the R rows of the dots.

The loop's pieces live beside this file, one role each: `_planes_triton` (integer and fp8
code bytes to fp16 planes), `_nuq_triton` (codebook tables, exact entries, the key / value
tile decoders), `_vq_triton` (vector-codebook and trellis codes) and `_rope_triton` (keys
stored before RoPE).

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

from kvq.runtime.kernels.decode._nuq_triton import (
    _key_corrections,
    _key_exceptions,
    _key_planes,
    _lut_table,
    _pair_values,
    _value_planes,
    _value_slots,
)
from kvq.runtime.kernels.decode._rope_triton import (
    _rope_inputs,
    _rope_prepare,
    _rope_scores,
)
from kvq.runtime.kernels.decode._vq_triton import (
    _vq_value_planes,
)

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
