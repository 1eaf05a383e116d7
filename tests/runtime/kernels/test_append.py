"""Append kernels: Triton (interpreted on CPU) == pure-torch reference == the codecs, bit for bit.

Every case writes rows [START, START + T) of buffers filled with garbage and checks
that both paths leave identical bytes everywhere (so the rows outside the window
are untouched by both), and that the reference equals the existing codec's encode.
With KVQ_TEST_CUDA set the Triton side runs on the GPU instead.
"""

from __future__ import annotations

import os

import pytest
import torch

from kvq.errors import KvqError
from kvq.quant import affine, fp8, nuq, packing, sparse
from kvq.quant.schemes import QuantScheme
from kvq.runtime.codecs import make_codec
from kvq.runtime.codecs import nuq as nuq_codecs
from kvq.runtime.codecs.integer import IntChannelStaticCodec, IntTokenCodec
from kvq.runtime.codecs.nuq import VALUE_SPLIT
from kvq.runtime.kernels.append import codes as A
from tests.conftest import nuq_key_state

DEVICE = "cuda" if os.environ.get("KVQ_TEST_CUDA") else "cpu"
B, H, T = 2, 2, 3
START, CAP = 2, 8
DS = (64, 96, 256)
ROWS = slice(START, START + T)


def _x(d, dtype=torch.float32, seed=0, zero_row=True):
    """Random rows with one strong outlier, one all-zero row and one row full of ties."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, H, T, d, generator=g) * 2
    x[0, 0, 1, 5] = 40.0
    x[0, 0, 1, 7] = -25.0
    x[0, 1, 0] = torch.round(x[0, 1, 0])  # repeated values: tie-breaking
    if zero_row:
        x[1, 1, 2] = 0.0
    return x.to(dtype)


def _garbage(shape, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 100).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -128), min(info.max, 255) + 1, shape, generator=g).to(dtype)


def _call(fn, *args):
    """Call fn; a Triton twin runs on DEVICE and its buffers are copied back in place."""
    if DEVICE == "cpu" or fn.__name__.endswith("_reference"):
        return fn(*args)
    moved = [a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args]
    out = fn(*moved)
    for a, m in zip(args, moved, strict=True):
        if isinstance(a, torch.Tensor):
            a.copy_(m.cpu())
    return None if out is None else tuple(o.cpu() for o in out)


def _both(name, x, bufs, call):
    """Run the reference (CPU) and Triton (DEVICE) twins; compare every buffer byte.

    call(fn, x, bufs) invokes fn with x and the buffers (moved to x's device).
    Returns (reference buffers, reference result, Triton result on CPU).
    """
    ref = {k: v.clone() for k, v in bufs.items()}
    tri = {k: v.clone().to(DEVICE) for k, v in bufs.items()}
    r_out = call(getattr(A, f"{name}_reference"), x, ref)
    t_out = call(getattr(A, f"{name}_triton"), x.to(DEVICE), tri)
    for k, garbage in bufs.items():
        assert torch.equal(ref[k], tri[k].cpu()), f"{name}: {k} differs"
        assert torch.equal(ref[k][:, :, :START], garbage[:, :, :START]), f"{k} before start"
        assert torch.equal(ref[k][:, :, START + T :], garbage[:, :, START + T :]), f"{k} after"
    if t_out is not None:
        t_out = tuple(v.cpu() for v in t_out)
    return ref, r_out, t_out


# --- integer, per token ---------------------------------------------------------------

TOKEN_CASES = [
    (bits, d, sym, None, torch.float16, torch.float32)
    for bits in (2, 3, 4, 8)
    for d in DS
    for sym in (False, True)
] + [
    (3, 256, False, 32, torch.float16, torch.float32),
    (4, 96, True, 32, torch.float16, torch.float16),
    (2, 64, False, 16, torch.bfloat16, torch.bfloat16),
    (8, 96, True, 48, torch.float32, torch.float32),
    (4, 64, False, 8, torch.float32, torch.bfloat16),
    (3, 96, True, 24, torch.bfloat16, torch.float16),
]


@pytest.mark.parametrize("bits,d,sym,group,scale_dtype,x_dtype", TOKEN_CASES)
def test_int_token(bits, d, sym, group, scale_dtype, x_dtype):
    x = _x(d, x_dtype, seed=bits + d)
    ng = d // (group or d)
    bufs = {
        "codes": _garbage((B, H, CAP, packing.packed_len(d, bits)), torch.uint8),
        "scale": _garbage((B, H, CAP, ng), scale_dtype),
    }
    if not sym:
        bufs["offset"] = _garbage((B, H, CAP, ng), scale_dtype, seed=2)

    def call(fn, x, b):
        fn(x, b["codes"], b["scale"], b.get("offset"), START, bits, group, sym)

    ref, _, _ = _both("append_int_token", x, bufs, call)
    scheme = QuantScheme(
        format="int",
        bits=bits,
        symmetric=sym,
        group_size=group,
        scale_dtype=str(scale_dtype).removeprefix("torch."),
    )
    rows, _ = IntTokenCodec(scheme, d).encode(x)
    assert set(rows) == set(ref)
    for k, v in rows.items():
        assert torch.equal(ref[k][:, :, ROWS], v), k


def test_int_token_strided_rows_and_a_single_row():
    # x as the attention projection produces it: [B, T, H, D] viewed as [B, H, T, D]
    x = _x(96).permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
    assert not x.is_contiguous()
    bufs = {
        "codes": _garbage((B, H, CAP, packing.packed_len(96, 4)), torch.uint8),
        "scale": _garbage((B, H, CAP, 1), torch.float16),
        "offset": _garbage((B, H, CAP, 1), torch.float16),
    }
    _both("append_int_token", x, bufs, lambda f, x, b: f(x, *b.values(), START, 4))
    one = x[:, :, :1]
    out = {k: v.clone() for k, v in bufs.items()}
    _call(A.append_int_token_triton, one, *out.values(), CAP - 1, 4)
    A.append_int_token_reference(one, *bufs.values(), CAP - 1, 4)
    for k in bufs:
        assert torch.equal(out[k], bufs[k]), k


def _nearly_silent(d: int) -> torch.Tensor:
    """[B, H, T, D] live rows whose ideal scales lie far below fp16's smallest normal (a
    quiet group of a real model, a silent head): row 0 zero, the others tiny ramps."""
    x = torch.linspace(-1e-7, 3e-7, B * H * T * d).reshape(B, H, T, d)
    x[:, :, 0] = 0.0
    return x


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("scale_dtype", [torch.float16])  # bf16: fp32's range
def test_int_token_floors_tiny_live_scales_on_both_paths(sym, scale_dtype):
    # a live row is never refused for being quiet: its scale stops at the dtype's smallest
    # normal (coarser steps than it needs, no clip), the same bits on both paths
    x, d = _nearly_silent(64), 64
    bufs = {
        "codes": _garbage((B, H, CAP, 32), torch.uint8),
        "scale": _garbage((B, H, CAP, 2), scale_dtype),
        "offset": _garbage((B, H, CAP, 2), scale_dtype, seed=2),
    }
    if sym:
        del bufs["offset"]
    ref, _, _ = _both(
        "append_int_token",
        x,
        bufs,
        lambda f, x, b: f(x, b["codes"], b["scale"], b.get("offset"), START, 4, 32, sym),
    )
    tiny = torch.finfo(scale_dtype).tiny
    scale = ref["scale"][:, :, ROWS].float()
    assert torch.equal(scale[:, :, 1:], torch.full_like(scale[:, :, 1:], tiny))
    assert torch.equal(scale[:, :, 0], torch.ones_like(scale[:, :, 0]))  # zero rows: 1
    scheme = QuantScheme(format="int", bits=4, symmetric=sym, group_size=32,
                         scale_dtype=str(scale_dtype).removeprefix("torch."))  # fmt: skip
    codec = IntTokenCodec(scheme, d)
    rows, _ = codec.encode(x)
    assert torch.equal(rows["scale"], ref["scale"][:, :, ROWS])
    assert (codec.decode(rows, {}) - x).abs().max() <= tiny  # within a step: no clip


def test_int_token_refuses_nan_on_both_paths():
    x = torch.zeros(1, 1, 2, 64)
    for fn in (A.append_int_token_reference, A.append_int_token_triton):
        codes = torch.zeros(1, 1, 4, 32, dtype=torch.uint8)
        scale, offset = torch.zeros(1, 1, 4, 1, dtype=torch.float16), torch.zeros(1, 1, 4, 1)
        x_bad = x.clone()
        x_bad[0, 0, 0, 3] = float("nan")
        with pytest.raises(KvqError, match="NaN"):
            _call(fn, x_bad, codes, scale, offset.half(), 0, 4)


def test_int_token_checks_buffers():
    x = _x(64)
    codes = torch.zeros(B, H, CAP, 32, dtype=torch.uint8)
    scale = torch.zeros(B, H, CAP, 1, dtype=torch.float16)
    for fn in (A.append_int_token_reference, A.append_int_token_triton):
        with pytest.raises(KvqError, match="do not fit"):
            fn(x, codes, scale, scale.clone(), CAP - 1, 4)
        with pytest.raises(KvqError, match="codes buffer must be"):
            fn(x, codes[..., :16], scale, scale.clone(), 0, 4)
        with pytest.raises(KvqError, match="offset buffer is required"):
            fn(x, codes, scale, None, 0, 4)


# --- QServe floating-offset INT4 ------------------------------------------------------


@pytest.mark.parametrize("d", DS)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_int_qserve(d, x_dtype):
    x = _x(d, x_dtype, seed=d)
    x[1, 0, 0] = x[1, 0, 0].abs() + 3.0  # positive-only head: offset far below zero
    x[1, 0, 1] = 2.5  # constant head
    bufs = {
        "codes": _garbage((B, H, CAP, packing.packed_len(d, 4)), torch.uint8),
        "scale": _garbage((B, H, CAP), torch.float16),
        "offset": _garbage((B, H, CAP), torch.float16, seed=3),
    }
    ref, _, _ = _both(
        "append_int_qserve",
        x,
        bufs,
        lambda f, x, b: f(x, b["codes"], b["scale"], b["offset"], START),
    )
    codes, scale, offset = affine.quantize_qserve(x, -1)
    assert torch.equal(ref["codes"][:, :, ROWS], packing.pack_bits(codes, 4))
    assert torch.equal(ref["scale"][:, :, ROWS], scale.squeeze(-1))
    assert torch.equal(ref["offset"][:, :, ROWS], offset.squeeze(-1))
    assert float(offset[1, 0, 0]) < 0  # outside the code range, not clamped


def test_qserve_positive_range_example():
    # article 0x09C: [1, 2] has ideal offset -15, outside the code range; it is kept
    a = torch.linspace(1.0, 2.0, 64)
    codes, scale, offset = affine.quantize_qserve(a, -1)
    assert scale.dtype == offset.dtype == torch.float16
    assert float(scale) >= 1 / 15  # rounded up
    assert abs(float(offset) + 15) < 0.02 and float(offset) != round(float(offset))
    assert int(codes[0]) == 0 and int(codes[-1]) == 15
    decoded = affine.qserve_decode(codes, scale, offset)
    step = float(scale)
    assert abs(float(decoded[0]) - 1.0) <= step / 2 and abs(float(decoded[-1]) - 2.0) <= step / 2
    assert float((decoded - a).abs().max()) <= step / 2 + 1e-6
    # clamping the offset to 0 (the integer zero-point habit) would lose the range
    zero = torch.zeros(())
    clamped = affine.qserve_decode(affine.qserve_encode(a, scale, zero), scale, zero)
    assert float(clamped.min()) == float(clamped.max())
    # the Triton twin writes the same bytes
    x = a.reshape(1, 1, 1, 64)
    out = [
        (
            torch.zeros(1, 1, 1, 32, dtype=torch.uint8),
            torch.zeros(1, 1, 1).half(),
            torch.zeros(1, 1, 1).half(),
        )
        for _ in range(2)
    ]
    A.append_int_qserve_reference(x, *out[0], 0)
    _call(A.append_int_qserve_triton, x, *out[1], 0)
    assert all(torch.equal(p, q) for p, q in zip(*out, strict=True))
    assert torch.equal(out[0][0][0, 0, 0], packing.pack_bits(codes, 4))


def test_qserve_constant_heads_decode_to_their_value():
    x = torch.tensor([[3.0] * 8, [0.0] * 8, [-1234.5] * 8, [3000.7] * 8])
    codes, scale, offset = affine.quantize_qserve(x, -1)
    assert torch.equal(scale, torch.ones_like(scale))
    assert torch.equal(offset.squeeze(-1), (-x[:, 0]).half())
    assert not bool(torch.signbit(offset[1]).any())  # +0 for a zero head
    decoded = affine.qserve_decode(codes, scale, offset)
    assert torch.equal(decoded[:2], x[:2])
    assert torch.allclose(decoded, x.half().float(), atol=2.0)  # within fp16 rounding


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy overflows
def test_qserve_refuses_unrepresentable_offsets_and_floors_tiny_scales():
    far = torch.linspace(1000.0, 1000.001, 16).reshape(1, 1, 1, 16)  # -min/scale overflows
    tiny = torch.linspace(0.0, 1e-8, 16).reshape(1, 1, 1, 16)  # scale floors
    for fn in (A.append_int_qserve_reference, A.append_int_qserve_triton):
        bufs = (
            torch.zeros(1, 1, 1, 8, dtype=torch.uint8),
            torch.zeros(1, 1, 1).half(),
            torch.zeros(1, 1, 1).half(),
        )
        with pytest.raises(KvqError, match="offset"):
            _call(fn, far, *bufs, 0)
        _call(fn, tiny, *bufs, 0)
        assert float(bufs[1]) == torch.finfo(torch.float16).tiny


# --- integer, static per channel ------------------------------------------------------


def _channel_qparams(bits, d, sym, seed=5):
    g = torch.Generator().manual_seed(seed)
    samples = torch.randn(200, H, d, generator=g) * torch.linspace(0.5, 3, d)
    if sym:
        return affine.symmetric_qparams(samples.abs().amax(0), bits), None
    return affine.affine_qparams(samples.amin(0), samples.amax(0), bits)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("d", DS)
@pytest.mark.parametrize("sym", [False, True])
def test_int_channel(bits, d, sym):
    x = _x(d, seed=bits * d)
    scale, offset = _channel_qparams(bits, d, sym)
    bufs = {"codes": _garbage((B, H, CAP, packing.packed_len(d, bits)), torch.uint8)}

    def call(fn, x, b):
        off = None if offset is None else offset.to(x.device)
        fn(x, b["codes"], START, scale.to(x.device), off, bits, sym)

    ref, _, _ = _both("append_int_channel", x, bufs, call)
    scheme = QuantScheme(format="int", bits=bits, axis="channel", lifetime="static", symmetric=sym)
    rows, _ = IntChannelStaticCodec(scheme, d, scale, offset).encode(x)
    assert torch.equal(ref["codes"][:, :, ROWS], rows["codes"])


# --- fp8 ------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("d", DS)
def test_fp8(fmt, d):
    x = _x(d, seed=d)
    x[1, 0, 0, :4] = torch.tensor([-0.0, 1e-30, -3e-6, 6e-5])  # signed zero, subnormal targets
    amax = _x(d, seed=d + 1)[:, :, :, :].abs().amax(dim=(0, 2, 3)) / 4  # the outlier saturates
    scale = fp8.fp8_scale(amax, fmt)
    bufs = {"codes": _garbage((B, H, CAP, d), torch.uint8)}
    ref, _, _ = _both(
        "append_fp8", x, bufs, lambda f, x, b: f(x, b["codes"], START, scale.to(x.device), fmt)
    )
    want = fp8.fp8_encode(x, scale[None, :, None, None], fmt).view(torch.uint8)
    assert torch.equal(ref["codes"][:, :, ROWS], want)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_rounding_of_every_tie_and_neighbour(fmt):
    # every finite fp8 value, every midpoint between neighbours (ties to even), and the
    # fp32 neighbours of each midpoint, both signs, plus values beyond the range
    dtype = fp8.FP8_DTYPES[fmt]
    allv = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    levels = allv[torch.isfinite(allv) & (allv >= 0)].unique()
    mids = (levels[:-1] + levels[1:]) / 2
    up = torch.nextafter(mids, torch.full_like(mids, float("inf")))
    down = torch.nextafter(mids, torch.zeros_like(mids))
    top = fp8.fp8_max(fmt)
    pos = torch.cat([levels, mids, up, down, torch.tensor([top * 1.01, top * 4, 1e38])])
    vals = torch.cat([pos, -pos])
    d = 128
    n = -(-vals.numel() // d) * d
    x = torch.cat([vals, torch.zeros(n - vals.numel())]).reshape(1, 1, -1, d)
    scale = torch.ones(1)
    out = torch.zeros(1, 1, x.shape[2], d, dtype=torch.uint8)
    A.append_fp8_triton(x.to(DEVICE), out_dev := out.to(DEVICE), 0, scale.to(DEVICE), fmt)
    want = fp8.fp8_encode(x, scale, fmt).view(torch.uint8)
    assert torch.equal(out_dev.cpu(), want)


# --- KVQuant values -------------------------------------------------------------------


def _value_codec(bits, d, fraction, scale_dtype="float16"):
    scheme = QuantScheme(
        format="nuq", bits=bits, axis="token", outlier_fraction=fraction, scale_dtype=scale_dtype
    )
    g = torch.Generator().manual_seed(bits)
    cb = nuq.fit_codebook(torch.rand(4000, generator=g) * 2 - 1, bits)
    return make_codec(scheme, d, torch.float32, {"codebook": cb}, "layers.0.value"), cb


VALUE_CASES = [(bits, d, 0.05, torch.float16, torch.float32) for bits in (2, 3, 4) for d in DS] + [
    (8, 64, 0.05, torch.float16, torch.float32),
    (4, 96, 0.0, torch.float16, torch.float32),
    (3, 64, 0.0, torch.bfloat16, torch.bfloat16),
    (4, 256, 0.02, torch.float32, torch.float16),
    (2, 96, 0.1, torch.bfloat16, torch.float32),
]


@pytest.mark.parametrize("split", ["tails", "range"])
@pytest.mark.parametrize("bits,d,fraction,scale_dtype,x_dtype", VALUE_CASES)
def test_nuq_value(bits, d, fraction, scale_dtype, x_dtype, split):
    x = _x(d, x_dtype, seed=7 * d + bits)
    codec, cb = _value_codec(bits, d, fraction, str(scale_dtype).removeprefix("torch."))
    k = (
        sum(sparse.tail_counts(d, fraction))
        if split == "tails"
        else sparse.range_count(d, fraction)
    )
    bufs = {
        "codes": _garbage((B, H, CAP, packing.packed_len(d, bits)), torch.uint8),
        "scale": _garbage((B, H, CAP), scale_dtype),
        "center": _garbage((B, H, CAP), scale_dtype, seed=4),
    }
    if k:
        bufs["sparse_index"] = _garbage((B, H, CAP, k), A.key_index_dtype(d))
        bufs["sparse_value"] = _garbage((B, H, CAP, k), torch.float16, seed=6)

    def call(fn, x, b):
        fn(
            x, b["codes"], b["scale"], b["center"], b.get("sparse_index"), b.get("sparse_value"),
            START, cb.to(x.device), bits, fraction, split,
        )  # fmt: skip

    ref, _, _ = _both("append_nuq_value", x, bufs, call)
    if split != VALUE_SPLIT:
        return  # the codec encodes with the runtime's split only
    rows, flat = codec.encode(x)
    assert not flat and set(rows) == set(ref)
    for name, v in rows.items():
        assert torch.equal(ref[name][:, :, ROWS], v), name


@pytest.mark.parametrize("scale_dtype", [torch.float16])
def test_nuq_value_floors_tiny_live_scales_on_both_paths(scale_dtype):
    x, d = _nearly_silent(96), 96
    codec, cb = _value_codec(4, d, 0.0, str(scale_dtype).removeprefix("torch."))
    bufs = {
        "codes": _garbage((B, H, CAP, packing.packed_len(d, 4)), torch.uint8),
        "scale": _garbage((B, H, CAP), scale_dtype),
        "center": _garbage((B, H, CAP), scale_dtype, seed=4),
    }

    def call(fn, x, b):
        fn(x, b["codes"], b["scale"], b["center"], None, None, START, cb.to(x.device), 4, 0.0,
           VALUE_SPLIT)  # fmt: skip

    ref, _, _ = _both("append_nuq_value", x, bufs, call)
    tiny = torch.finfo(scale_dtype).tiny
    assert torch.equal(ref["scale"][:, :, START + 1 : START + T].float(),
                       torch.full((B, H, T - 1), tiny))  # fmt: skip
    rows, _ = codec.encode(x)
    assert torch.equal(rows["scale"], ref["scale"][:, :, ROWS])


def test_nuq_value_tail_ties_follow_the_stable_sort():
    # many equal extremes: the low tail takes the lowest coordinates, the high tail the highest
    d, fraction = 64, 0.05  # 2 per tail
    x = torch.zeros(1, 1, 1, d)
    x[..., [3, 9, 20, 40]] = -5.0
    x[..., [1, 30, 50, 60]] = 5.0
    out = []
    for fn in (A.append_nuq_value_reference, A.append_nuq_value_triton):
        bufs = [
            torch.zeros(1, 1, 1, packing.packed_len(d, 3), dtype=torch.uint8),
            torch.zeros(1, 1, 1).half(),
            torch.zeros(1, 1, 1).half(),
            torch.zeros(1, 1, 1, 4, dtype=torch.uint8),
            torch.zeros(1, 1, 1, 4).half(),
        ]
        _call(fn, x, *bufs, 0, nuq.uniform_codebook(3)[:8], 3, fraction)
        out.append(bufs)
    assert out[0][3].flatten().tolist() == [3, 9, 50, 60]
    assert all(torch.equal(p, q) for p, q in zip(*out, strict=True))


# --- KVQuant keys ---------------------------------------------------------------------


def _key_state(bits, d, fraction, seed=0):
    return nuq_key_state(bits, H, d, fraction, seed)


KEY_CASES = [(bits, d, 0.05) for bits in (2, 3, 4) for d in DS] + [(8, 96, 0.05), (4, 64, 0.0)]


@pytest.mark.parametrize("bits,d,fraction", KEY_CASES)
def test_nuq_key(bits, d, fraction):
    x = _x(d, seed=11 * d + bits) * 1.5
    state = _key_state(bits, d, fraction)
    scheme = QuantScheme(
        format="nuq", bits=bits, axis="channel", lifetime="static", outlier_fraction=fraction
    )
    codec = make_codec(scheme, d, torch.float32, state, "layers.0.key")
    bufs = {"codes": _garbage((B, H, CAP, packing.packed_len(d, bits)), torch.uint8)}
    if fraction:
        bufs["sparse_count"] = _garbage((B, H, CAP), torch.uint8)

    def call(fn, x, b):
        on = {k: v.to(x.device) for k, v in state.items()}
        return fn(
            x, b["codes"], b.get("sparse_count"), START, on["codebook"], bits, on["scale"],
            on["center"], on.get("lower"), on.get("upper"),
        )  # fmt: skip

    ref, r_entries, t_entries = _both("append_nuq_key", x, bufs, call)
    for p, q in zip(r_entries, t_entries, strict=True):
        assert p.dtype == q.dtype and torch.equal(p, q)
    rows, flat = codec.encode(x)
    for name, v in rows.items():
        assert torch.equal(ref[name][:, :, ROWS], v), name
    if fraction:
        assert r_entries[0].numel() > 0, "the test needs outliers"
        assert torch.equal(r_entries[0], flat["sparse_index"])
        assert torch.equal(r_entries[1], flat["sparse_value"])
        assert r_entries[1].dtype == nuq_codecs.SPARSE_DTYPE == A.SPARSE_DTYPE
    else:
        assert not flat and r_entries[0].numel() == 0


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy on NaN
@pytest.mark.parametrize("fraction", [0.05, 0.0])
def test_nuq_rows_refuse_nan_on_both_paths(fraction):
    """The Triton launchers check finiteness after the launch, in the same device sync as
    their other checks: a NaN row is still refused with the reference's message."""
    d, bits = 64, 3
    x = _x(d, seed=2)
    x[0, 1, 2, 5] = float("nan")
    state = _key_state(bits, d, fraction)
    for fn in (A.append_nuq_key_reference, A.append_nuq_key_triton):
        codes = torch.zeros(B, H, CAP, packing.packed_len(d, bits), dtype=torch.uint8)
        count = torch.zeros(B, H, CAP, dtype=torch.uint8)
        with pytest.raises(KvqError, match="key rows contains NaN"):
            _call(fn, x, codes, count, START, state["codebook"], bits, state["scale"],
                  state["center"], state.get("lower"), state.get("upper"))  # fmt: skip
    for fn in (A.append_nuq_value_reference, A.append_nuq_value_triton):
        bufs = [
            torch.zeros(B, H, CAP, packing.packed_len(d, bits), dtype=torch.uint8),
            torch.zeros(B, H, CAP).half(),
            torch.zeros(B, H, CAP).half(),
            torch.zeros(B, H, CAP, 4, dtype=torch.uint8),
            torch.zeros(B, H, CAP, 4).half(),
        ]
        with pytest.raises(KvqError, match="value rows contains NaN"):
            _call(fn, x, *bufs, START, nuq.uniform_codebook(bits), bits, fraction)


# --- dispatch -------------------------------------------------------------------------


def test_dispatch_picks_a_backend(monkeypatch):
    monkeypatch.delenv("KVQ_BACKEND", raising=False)
    x = _x(64).to(DEVICE)
    outs = []
    for backend in ("reference", "triton", None):
        bufs = [torch.zeros(B, H, CAP, 64, dtype=torch.uint8, device=DEVICE)]
        A.append_fp8(x, *bufs, START, torch.ones(H, device=DEVICE), "e4m3", backend=backend)
        outs.append(bufs[0])
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    with pytest.raises(KvqError, match="unknown backend"):
        A.append_fp8(x, outs[0], START, torch.ones(H, device=DEVICE), "e4m3", backend="cuda")
