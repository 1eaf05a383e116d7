"""Decode attention: the Triton kernel (interpreted on CPU) against the pure-torch reference.

The reference itself is checked against dense softmax attention over the decoded rows, so
the chain is: packed rows -> decode_packed (bit-exact with the codecs) -> reference ==
dense oracle -> kernel == reference within fp32 tolerance (ATOL below).
"""

from __future__ import annotations

import os
from dataclasses import fields

import pytest
import torch

from kvq.quant import affine, fp8, nuq, sparse
from kvq.quant.schemes import QuantScheme
from kvq.runtime.codecs import make_codec
from kvq.runtime.kernels.decode.attention import (
    combine_partials_reference,
    combine_partials_triton,
    decode_attention,
    decode_attention_triton,
    decode_path,
)
from kvq.runtime.kernels.decode.reference import decode_attention_reference
from kvq.runtime.kernels.decode.segments import Segment, rotate
from kvq.runtime.packed import PackedRows, decode_packed
from kvq.runtime.reference import dense_attention

# many interpreted Triton launches or every model family: `make test-quick` skips it
pytestmark = pytest.mark.slow

# On CPU the interpreter computes exact fp32 dots: only accumulation order differs. On CUDA
# (KVQ_TEST_CUDA=1, bench/gpu_check.sh) the dots run in tf32 unless KVQ_TRITON_DOT=ieee.
DEVICE = "cuda" if os.environ.get("KVQ_TEST_CUDA") else "cpu"
EXACT_DOTS = DEVICE == "cpu" or os.environ.get("KVQ_TRITON_DOT") == "ieee"
ATOL = 2e-5 if EXACT_DOTS else 2e-2


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)  # the queries below are drawn from the global generator


def _data(b, hkv, t, d, seed):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(b, hkv, t, d, generator=g)
    v = torch.randn(b, hkv, t, d, generator=g)
    k[..., 3] *= 6.0  # an outlier channel, as real keys have
    v[:, :, 5, 7] = 12.0  # an outlier value
    return k, v


def _nuq_key_state(k, bits, fraction):
    samples = k.permute(0, 2, 1, 3).reshape(-1, k.shape[1], k.shape[3])  # [N, H, D]
    lower, upper = sparse.channel_thresholds(samples, fraction)
    scale, center = nuq.normalizer(lower, upper)
    levels = nuq.uniform_codebook(bits)
    return {"codebook": levels, "scale": scale, "center": center, "lower": lower, "upper": upper}


def _channel_state(k, bits):
    lo = k.amin(dim=(0, 2))
    hi = k.amax(dim=(0, 2))  # [H, D]
    scale, offset = affine.affine_qparams(lo, hi, bits)
    return {"scale": scale, "offset": offset}


def _trellis_state(window, heads, d, seed=0):
    g = torch.Generator().manual_seed(seed)  # any levels will do: the kernel reads them
    return {
        "trellis_table": (torch.rand(1 << window, generator=g) * 2 - 1).half(),
        "trellis_weight": torch.rand(heads, d, generator=g).half(),
    }


def _codec_segment(kind, k, v, pre_rope=False):
    d = k.shape[-1]
    if kind == "int4-g16":
        ks, vs, kst = QuantScheme("int", 4, group_size=16), QuantScheme("int", 4), {}
    elif kind == "int8-sym":
        ks, vs, kst = QuantScheme("int", 8, symmetric=True), QuantScheme("int", 8), {}
    elif kind == "int2-int3":
        ks, vs, kst = QuantScheme("int", 2, group_size=32), QuantScheme("int", 3), {}
    elif kind == "int4-channel":
        ks = QuantScheme("int", 4, axis="channel", lifetime="static")
        vs, kst = QuantScheme("int", 4, group_size=32), _channel_state(k, 4)
    elif kind == "int8-channel-sym":
        ks = QuantScheme("int", 8, axis="channel", lifetime="static", symmetric=True)
        amax = k.abs().amax(dim=(0, 2))  # [H, D]
        vs, kst = QuantScheme("int", 8), {"scale": affine.symmetric_qparams(amax, 8)}
    elif kind == "nuq4-dense":  # codebook keys without exceptions
        ks = QuantScheme("nuq", 4, axis="channel", lifetime="static")
        vs, kst = QuantScheme("nuq", 4), _nuq_key_state(k, 4, 0.0)
        kst = {n: kst[n] for n in ("codebook", "scale", "center")}
    elif kind in ("nuq4", "nuq3"):
        bits = int(kind[-1])
        ks = QuantScheme("nuq", bits, axis="channel", lifetime="static", outlier_fraction=0.02)
        vs = QuantScheme("nuq", bits, outlier_fraction=0.02)
        kst = _nuq_key_state(k, bits, 0.02)
    elif kind in ("trellis3", "trellis2"):  # 3-bit digits straddle bytes; 2-bit ones do not
        bits = int(kind[-1])
        window = {3: 12, 2: 8}[bits]
        ks = QuantScheme("trellis", bits, axis="channel", lifetime="static",
                         outlier_fraction=0.02, window=window)  # fmt: skip
        vs = QuantScheme("trellis", bits, outlier_fraction=0.02, window=window)
        kst = _nuq_key_state(k, bits, 0.02)
        del kst["codebook"]
        kst |= _trellis_state(window, k.shape[1], d)
    else:
        raise AssertionError(kind)
    kc = make_codec(ks, d, torch.float32, kst, "layers.0.key")
    vst = {"codebook": nuq.uniform_codebook(vs.bits)} if vs.format == "nuq" else {}
    if vs.format == "trellis":
        vst = _trellis_state(vs.window, v.shape[1], d, seed=1)
    vc = make_codec(vs, d, torch.float32, vst, "layers.0.value")
    kr, kf = kc.encode(k)
    vr, vf = vc.encode(v)
    kp = kc.packed(kr, kf)
    if pre_rope:
        kp = PackedRows(**{**kp.__dict__, "pre_rope": True})
    return kp, vc.packed(vr, vf)


def _rope(d, positions=4096, theta=10000.0):
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    ang = torch.arange(positions).float()[:, None] * inv[None, :]
    return ang.cos(), ang.sin()


def _oracle(query, segments, scaling, rope, mask):
    keys, values = [], []
    for seg in segments:
        k = decode_packed(seg.key)
        if seg.key.pre_rope:
            k = rotate(k, seg.positions, rope)
        keys.append(k)
        values.append(decode_packed(seg.value))
    k, v = torch.cat(keys, 2), torch.cat(values, 2)
    if mask is None:
        total, q_len = k.shape[2], query.shape[2]
        mask = torch.ones(q_len, total, dtype=torch.bool, device=query.device)
        mask = mask.tril(total - q_len)[None, None]
    return dense_attention(query, k, v, mask, scaling)


def _to(x, device):
    """Move a tensor, PackedRows, Segment, tuple or None to `device`."""
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, (PackedRows, Segment)):
        return type(x)(**{f.name: _to(getattr(x, f.name), device) for f in fields(x)})
    if isinstance(x, tuple):
        return tuple(_to(t, device) for t in x)
    if isinstance(x, list):
        return [_to(t, device) for t in x]
    return x


def _check(query, segments, rope=None, mask=None):
    query, segments, rope, mask = _to((query, segments, rope, mask), DEVICE)
    scaling = query.shape[-1] ** -0.5
    ref = decode_attention_reference(
        query, segments, scaling=scaling, rope=rope, mask=mask, chunk_rows=16
    )
    torch.testing.assert_close(ref, _oracle(query, segments, scaling, rope, mask))
    out = decode_attention_triton(query, segments, scaling=scaling, rope=rope, mask=mask)
    assert out.shape == query.shape
    assert (out - ref).abs().max().item() < ATOL
    return out.cpu()


@pytest.mark.parametrize(
    "kind", ["int4-g16", "int8-sym", "int2-int3", "int4-channel", "nuq4", "trellis3", "trellis2"]
)
def test_kernel_matches_reference_per_representation(kind):
    k, v = _data(2, 2, 45, 64, seed=1)
    kp, vp = _codec_segment(kind, k, v)
    q = torch.randn(2, 4, 1, 64)  # GQA: 2 query heads per KV head
    _check(q, [Segment(kp, vp)])


def test_nuq_sparse_exceptions_are_exercised():
    k, v = _data(1, 1, 40, 64, seed=2)
    kp, vp = _codec_segment("nuq3", k, v)
    assert kp.sparse_index.numel() > 0 and vp.slot_index is not None
    _check(torch.randn(1, 2, 1, 64), [Segment(kp, vp)])


def test_pre_rope_keys_with_fp_sink_segment_share_one_softmax():
    """MQA, head_dim 256 (Gemma 3): sink rows exact, pre-RoPE keys rotated at their positions."""
    b, d = 1, 256
    k, v = _data(b, 1, 37, d, seed=3)
    rope = _rope(d)
    positions = torch.arange(37)[None]
    sink = Segment(
        PackedRows("full", d, k[:, :, :1].clone(), pre_rope=True),
        PackedRows("full", d, v[:, :, :1].clone()),
        positions[:, :1],
    )
    kp, vp = _codec_segment("int4-channel", k[:, :, 1:], v[:, :, 1:], pre_rope=True)
    main = Segment(kp, vp, positions[:, 1:])
    q = torch.randn(b, 4, 1, d, generator=torch.Generator().manual_seed(3)) * 3  # sharp attention
    out = _check(q, [sink, main], rope=rope)
    # the sink matters: dropping it changes the result
    alone = decode_attention_reference(q, [main], scaling=d**-0.5, rope=rope)
    assert (out - alone).abs().max() > 1e-3


@pytest.mark.parametrize("d", [64, 96])
@pytest.mark.parametrize(
    "kind", ["int4-g16", "int8-sym", "int2-int3", "int4-channel", "nuq4", "trellis3"]
)
def test_pre_rope_keys_rotate_in_pair_order(kind, d):
    """Pre-RoPE keys decode in pair order and rotate as complex numbers in the reference;
    batch rows at different positions read the tables through a gather. head_dim 96 pads
    the kernel's channel blocks (48 of 64 per half, 96 of 128 values): its byte loads mask."""
    b = 2
    k, v = _data(b, 2, 45, d, seed=8)
    kp, vp = _codec_segment(kind, k, v, pre_rope=True)
    positions = torch.arange(45)[None] + torch.tensor([[0], [7]])  # left padding in batch 0
    q = torch.randn(b, 4, 1, d) * 2
    _check(q, [Segment(kp, vp, positions)], rope=_rope(d))


def _launch_with(monkeypatch, **options):
    """Make the interpreter launch the kernel with these options (BLOCK_T, PREFETCH, ...)."""
    from kvq.runtime.kernels.decode import _attention_triton as kern
    from kvq.runtime.kernels.decode import attention as da

    launch = {"num_stages": 1, **options}
    monkeypatch.setattr(da, "PLANNED", False)  # these layouts would take the planned path
    monkeypatch.setattr(
        da, "_launcher", lambda device, head_dim: (kern.decode_attention_kernel, launch)
    )


def _word_flags(q, seg, rope):
    from kvq.runtime.kernels.decode.attention import kernel_calls

    ((_, _, consts),) = kernel_calls(q, [seg], scaling=1.0, rope=rope, dots="ieee")[0]
    return consts["K_WORDS"], consts["V_WORDS"]


def _misaligned(p: PackedRows) -> PackedRows:
    """The same rows with their codes one byte off a 4-byte boundary (a view into a wider
    buffer): the kernel must fall back from word loads to byte loads."""
    wide = torch.zeros(*p.data.shape[:-1], p.data.shape[-1] + 1, dtype=torch.uint8)
    wide[..., 1:] = p.data
    return PackedRows(**{**p.__dict__, "data": wide[..., 1:]})


@pytest.mark.parametrize(  # each kind pre- and post-RoPE, each at both head dims
    "kind, pre_rope, d",
    [
        (kind, pre_rope, d)
        for kind in ("int4-g16", "int8-sym", "int4-channel", "nuq4")
        for pre_rope, d in ((False, 64), (True, 96))
    ]
    + [("int4-g16", False, 96), ("nuq4", True, 64)],
)
def test_prefetched_code_words_match_reference(kind, pre_rope, d, monkeypatch):
    """PREFETCH loads each 16-row tile's code words (and the values' per-row group qparams)
    one iteration ahead: 70 rows make five tiles (the last partial) in one program, so
    every tile decodes what the tile before it loaded. head_dim 96 masks the words of the
    padded channel blocks; there a whole-row value group does not tile the value block,
    so those qparams load in the loop as before."""
    _launch_with(monkeypatch, BLOCK_T=16, PREFETCH=True)
    k, v = _data(2, 2, 70, d, seed=11)
    kp, vp = _codec_segment(kind, k, v, pre_rope=pre_rope)
    seg = Segment(kp, vp, torch.arange(70)[None] + torch.tensor([[0], [5]]))
    q = torch.randn(2, 4, 1, d) * 2
    rope = _rope(d)
    assert _word_flags(q, seg, rope) == (True, True)
    _check(q, [seg], rope=rope)


def test_misaligned_codes_fall_back_to_byte_loads(monkeypatch):
    _launch_with(monkeypatch, BLOCK_T=16, PREFETCH=True)
    k, v = _data(1, 2, 40, 64, seed=12)
    kp, vp = _codec_segment("int4-g16", k, v)
    seg = Segment(_misaligned(kp), _misaligned(vp))
    assert seg.key.data.data_ptr() % 4 == 1
    q = torch.randn(1, 4, 1, 64)
    assert _word_flags(q, seg, None) == (False, False)
    torch.testing.assert_close(_check(q, [seg]), _check(q, [Segment(kp, vp)]))


@pytest.mark.parametrize("kind", ["int4-channel", "int8-channel-sym", "nuq4-dense"])
def test_folded_static_keys_share_one_softmax_with_a_full_precision_segment(kind):
    """Post-RoPE static per-channel keys without exceptions: the kernel folds their scale
    into the query and their offset into one bias per query row (asymmetric codes and
    codebook levels; symmetric INT8 keeps the unfolded path). Within one segment a lost
    bias would cancel in the softmax; beside full-precision sink rows it shifts the two
    segments' weights, so this case checks the fold exactly."""
    k, v = _data(2, 2, 41, 64, seed=12)
    k = k + 3.0  # a large common offset: the bias term carries real weight
    sink = Segment(
        PackedRows("full", 64, k[:, :, :2].clone()), PackedRows("full", 64, v[:, :, :2].clone())
    )
    kp, vp = _codec_segment(kind, k[:, :, 2:], v[:, :, 2:])
    q = torch.randn(2, 4, 1, 64)
    _check(q, [sink, Segment(kp, vp)])


def test_two_queries_causal_and_explicit_sliding_mask_with_padding():
    k, v = _data(2, 1, 50, 64, seed=4)
    kp, vp = _codec_segment("int4-g16", k, v)
    q = torch.randn(2, 3, 2, 64)  # MQA, Q = 2 (speculative decode)
    seg = [Segment(kp, vp)]
    _check(q, seg)  # implicit causal
    mask = torch.ones(2, 1, 2, 50, dtype=torch.bool)
    mask[..., :20] = False  # sliding window
    mask[1, :, :, 20:25] = False  # left padding in batch 1
    mask[:, :, 0, -1] = False  # causal between the two queries
    _check(q, seg, mask=mask)


def test_fp8_per_head_and_qserve_floating_offset():
    b, h, t, d = 1, 2, 33, 64
    k, v = _data(b, h, t, d, seed=5)
    table = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    table = torch.nan_to_num(table, nan=0.0)
    scale = fp8.fp8_scale(k.abs().amax(dim=(0, 2, 3)), "e4m3")  # [H]
    codes = fp8.fp8_encode(k, scale[None, :, None, None], "e4m3").view(torch.uint8)
    kp = PackedRows("lookup", d, codes, 8, scale=scale, table=table)
    assert torch.equal(
        decode_packed(kp),
        fp8.fp8_decode(codes.view(torch.float8_e4m3fn), scale[None, :, None, None]),
    )
    lo, hi = v.amin(-1, keepdim=True), v.amax(-1, keepdim=True)
    s = ((hi - lo) / 15).half()
    zp = (-lo / s.float()).half()  # floating offset, not rounded, not clamped
    vcodes = torch.round(v / s.float() + zp.float()).clamp(0, 15).to(torch.uint8)
    from kvq.quant import packing

    vp = PackedRows("affine", d, packing.pack_bits(vcodes, 4), 4, scale=s, zero_point=zp)
    _check(torch.randn(b, 4, 1, d), [Segment(kp, vp)])
    # pre-RoPE fp8 keys: the reference decodes them in natural pair order (8-bit lookup)
    pre = PackedRows(**{**kp.__dict__, "pre_rope": True})
    _check(torch.randn(b, 4, 1, d), [Segment(pre, vp, torch.arange(t)[None] + 5)], rope=_rope(d))


@pytest.mark.parametrize("splits, rows, d", [(1, 16, 64), (19, 32, 96)])
def test_combine_kernel_matches_reference(splits, rows, d):
    """The reduction pass: over one tile of splits and over two (19 > 16), two query-row
    blocks, a head_dim that is not a power of two, splits that saw no keys (m = -inf) and
    a row that saw none at all (output 0)."""
    g = torch.Generator().manual_seed(3)
    b, h = 2, 3
    m = torch.randn(b, h, splits, rows, generator=g) * 8  # log2 units
    den = torch.rand(b, h, splits, rows, generator=g) * 30 + 1
    acc = torch.randn(b, h, splits, rows, d, generator=g) * den[..., None]
    m[0, 1, : max(1, splits - 2), 5] = float("-inf")  # splits without keys for this row
    m[1, 2, :, 3] = float("-inf")  # no key anywhere for this row
    den[1, 2, :, 3] = 0.0
    acc[1, 2, :, 3] = 0.0
    m, den, acc = _to((m, den, acc), DEVICE)
    ref = combine_partials_reference(m, den, acc)
    out = combine_partials_triton(m, den, acc)
    assert out.shape == ref.shape == (b, h, rows, d)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    assert torch.equal(out[1, 2, 3], torch.zeros_like(out[1, 2, 3]))


@pytest.mark.parametrize(
    "kind,pre_rope", [("int4-channel", True), ("nuq4", True), ("int4-channel", False)]
)
def test_fp16_dots_stay_within_fp16_rounding(kind, pre_rope, monkeypatch):
    """KVQ_TRITON_DOT=fp16 (fp16 operands, fp32 accumulation) on pre-RoPE keys and on folded
    post-RoPE ones, forced on under the interpreter: within the tf32 tolerance of the
    reference, and not identical to the exact-dot kernel (so the fp16 branch really ran)."""
    from kvq.runtime.kernels.decode import attention as da

    k, v = _data(1, 2, 70, 128, seed=9)
    kp, vp = _codec_segment(kind, k, v, pre_rope=pre_rope)
    q = torch.randn(1, 4, 1, 128)
    args = (q, [Segment(kp, vp, torch.arange(70)[None])])
    exact = decode_attention_triton(*args, scaling=128**-0.5, rope=_rope(128))
    monkeypatch.setattr(da, "_dot_mode", lambda device: "fp16")
    half = decode_attention_triton(*args, scaling=128**-0.5, rope=_rope(128))
    ref = decode_attention_reference(*args, scaling=128**-0.5, rope=_rope(128))
    assert (half - ref).abs().max().item() < 2e-2
    assert not torch.equal(half, exact)


def _prefill_segments(kind, b, d, pre_rope):
    """A layer's rows at prefill, MQA: 2 full-precision sink rows, 30 packed main rows, 5
    full-precision recent rows; pre-RoPE keys at positions that start 3 rows later in
    sequence 1 (left padding)."""
    k, v = _data(b, 1, 37, d, seed=13)
    positions = torch.arange(37).repeat(b, 1)
    positions[1] += 3
    kp, vp = _codec_segment(kind, k[:, :, 2:32], v[:, :, 2:32], pre_rope=pre_rope)
    segs = [Segment(kp, vp, positions[:, 2:32] if pre_rope else None)]
    for rows in (slice(0, 2), slice(32, 37)):  # the sink before, the recent rows after
        key = PackedRows("full", d, k[:, :, rows].clone(), pre_rope=pre_rope)
        full = Segment(key, PackedRows("full", d, v[:, :, rows].clone()), positions[:, rows])
        segs.insert(0 if rows.start == 0 else len(segs), full)
    return segs


def _window_and_padding(b, q_len, total, window, pad):
    """[B, 1, Q, total] bool: the last Q rows causal within a sliding window of `window`
    rows; sequence 1 left-padded by `pad` rows."""
    col = torch.arange(total)
    q_pos = torch.arange(total - q_len, total)[:, None]
    mask = ((col <= q_pos) & (col > q_pos - window))[None, None].repeat(b, 1, 1, 1)
    mask[1, :, :, :pad] = False
    return mask


@pytest.mark.parametrize("kind, pre_rope", [("int4-g16", False), ("nuq4", True)])
@pytest.mark.parametrize("masked", [False, True])
def test_long_query_blocks_run_in_chunks_on_triton(kind, pre_rope, masked):
    """A prefill-sized block (4 query heads per KV head x 20 positions: 80 rows, more than
    a program's 64) runs through the kernel in chunks of 16 and 4 positions, each attending
    to the rows up to its own positions: the reference's result without a mask (causal
    rows) and with a sliding-window and padding mask (its rows sliced per chunk), over sink,
    packed main and full-precision recent rows. The auto backend keeps the reference."""
    b, d, q_len = 2, 32, 20
    segs = _prefill_segments(kind, b, d, pre_rope)
    total = sum(s.rows for s in segs)
    mask = _window_and_padding(b, q_len, total, window=16, pad=4) if masked else None
    q = torch.randn(b, 4, q_len, d) * 2
    rope = _rope(d) if pre_rope else None
    path = decode_path(q, segs, mask, backend="triton", device="cuda")
    assert (path.chunks, path.chunk) == (2, 16)
    assert "2 chunks of 16 query positions" in path.describe()
    out = _check(q, segs, rope=rope, mask=mask)
    if DEVICE == "cpu":  # the public dispatch: triton in chunks, auto on the reference
        call = dict(scaling=d**-0.5, rope=rope, mask=mask)
        assert torch.equal(decode_attention(q, segs, backend="triton", **call), out)
        ref = decode_attention_reference(q, segs, **call)
        assert torch.equal(decode_attention(q, segs, backend="auto", **call), ref)


def test_softcap_matches_reference():
    k, v = _data(1, 1, 30, 64, seed=7)
    kp, vp = _codec_segment("int8-sym", k, v)
    q, seg = _to((torch.randn(1, 2, 1, 64) * 4, [Segment(kp, vp)]), DEVICE)
    ref = decode_attention_reference(q, seg, scaling=0.125, softcap=5.0)
    out = decode_attention_triton(q, seg, scaling=0.125, softcap=5.0)
    assert (out - ref).abs().max().item() < ATOL
    plain = decode_attention_reference(q, seg, scaling=0.125)
    assert (plain - ref).abs().max().item() > 1e-3


def test_autotuned_launch_matches_reference(monkeypatch):
    """The CUDA launch path (autotuner over row tiles x warps) under the interpreter: every
    config that survives pruning runs through a stub timer and the winner is used."""
    from kvq.runtime.kernels.decode import attention as da

    timed = []

    def stub_bench(kernel_call, quantiles):
        kernel_call()
        timed.append(len(timed))
        return [float(len(timed))] * len(quantiles)  # the first config tried wins

    tuned = da.tuned_kernel(do_bench=stub_bench)
    monkeypatch.setattr(da, "_launcher", lambda device, head_dim: (tuned, {}))
    monkeypatch.setattr(da, "PLANNED", False)  # pre-RoPE KV4 is planned; tune the general
    k, v = _data(1, 1, 70, 256, seed=5)
    kp, vp = _codec_segment("int4-channel", k, v, pre_rope=True)
    positions = torch.arange(70)[None]
    q = torch.randn(1, 4, 1, 256)
    _check(q, [Segment(kp, vp, positions)], rope=_rope(256))
    # head_dim 256: 16- and 32-row tiles fit, with 4, 8 or 16 warps, with and without
    # PREFETCH (the codes load as words, so PREFETCH stands in for 2 stages)
    assert len(timed) == 12
    assert tuned.best_config.kwargs["BLOCK_T"] == 16


def test_general_kernel_tunes_per_shape_bucket():
    """The general kernel's autotuner keys on the launch's shape bucket: a configuration
    timed on a parity-sized problem is not reused at batch 16 x 32K (issue 18, item 4)."""
    from kvq.runtime.kernels.decode import attention as da

    assert "tune_bucket" in da.AUTOTUNE_KEY
    parity = da.tune_bucket(2 * 8 * 4, 256)  # batch 2, 8 KV heads, 4 splits of 256 rows
    served = da.tune_bucket(16 * 8 * 5, 6656)
    assert parity != served
    assert da.tune_bucket(16 * 8 * 5, 6656) == da.tune_bucket(16 * 8 * 5, 6600)


@pytest.mark.parametrize("kind", ["int4-g16", "int8-sym", "nuq3", "int4-channel", "trellis3"])
@pytest.mark.parametrize("pre_rope", [False, True])
def test_dense_reference_equals_the_chunked_online_softmax(kind, pre_rope):
    """The reference dequantizes small key sets whole and makes one SDPA call; it agrees
    with its chunked online softmax (and the oracle) for every representation, pre-RoPE
    keys, an exact sink segment, a mask, and a query that may see no row (zeros)."""
    b, d, t = 2, 64, 41
    k, v = _data(b, 2, t, d, seed=7)
    rope, positions = _rope(d), torch.arange(t)[None].expand(b, t)
    sink = Segment(
        PackedRows("full", d, k[:, :, :2].clone(), pre_rope=pre_rope),
        PackedRows("full", d, v[:, :, :2].clone()),
        positions[:, :2],
    )
    kp, vp = _codec_segment(kind, k[:, :, 2:], v[:, :, 2:], pre_rope=pre_rope)
    segments = [sink, Segment(kp, vp, positions[:, 2:])]
    q = torch.randn(b, 4, 3, d, generator=torch.Generator().manual_seed(7))
    mask = torch.rand(b, 1, 3, t, generator=torch.Generator().manual_seed(8)) > 0.3
    mask[1, 0, 2] = False  # this query sees nothing
    kw = dict(scaling=d**-0.5, rope=rope, mask=mask)
    dense = decode_attention_reference(q, segments, **kw)
    chunked = decode_attention_reference(q, segments, chunk_rows=16, **kw)
    torch.testing.assert_close(dense, chunked, atol=2e-5, rtol=1e-5)
    assert torch.equal(dense[1, :, 2], torch.zeros_like(dense[1, :, 2]))
    seen = mask.any(-1)[:, 0]  # [B, Q]: the oracle's softmax over no row is NaN
    oracle = _oracle(q, segments, d**-0.5, rope, mask)
    torch.testing.assert_close(dense.permute(0, 2, 1, 3)[seen], oracle.permute(0, 2, 1, 3)[seen])
