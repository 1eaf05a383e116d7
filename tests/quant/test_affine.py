"""Uniform integer quantizers: error bounds, code ranges, degenerate rows, errors."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvq.errors import KvqError
from kvq.quant.affine import (
    affine_decode,
    affine_encode,
    affine_qparams,
    from_groups,
    quantize_affine,
    quantize_symmetric,
    symmetric_decode,
    symmetric_encode,
    symmetric_qparams,
    to_groups,
)

BITS = (2, 3, 4, 8)
SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
EPS32 = torch.finfo(torch.float32).eps

# Stated tolerances. The stored scale is the ideal one rounded UP by at most one
# ulp of its dtype, so a step may be (1 + eps_dtype) times the ideal step; the
# fp32 arithmetic of encode/decode adds a few ulps of the magnitudes involved.


def _data(seed: int, log_mag: float, shift: float, shape=(3, 4, 16)) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen) * 10.0**log_mag + shift


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES)
@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), log_mag=st.floats(-1, 3), shift=st.floats(-50, 50))
def test_symmetric_error_within_half_step(bits, scale_dtype, seed, log_mag, shift):
    x = _data(seed, log_mag, shift)
    codes, scale = quantize_symmetric(x, bits, dim=-1, scale_dtype=scale_dtype)
    qmax = 2 ** (bits - 1) - 1
    assert codes.dtype == torch.int8 and scale.dtype == scale_dtype
    assert bool((codes.abs() <= qmax).all())
    ideal = x.abs().amax(dim=-1, keepdim=True) / qmax
    step = scale.float()
    assert bool((step >= ideal).all())
    assert bool((step <= ideal * (1 + torch.finfo(scale_dtype).eps)).all())
    err = (x - symmetric_decode(codes, scale)).abs()
    assert bool((err <= step / 2 + 4 * EPS32 * x.abs().amax()).all())


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES)
@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), log_mag=st.floats(-1, 3), shift=st.floats(-50, 50))
def test_affine_error_within_half_step(bits, scale_dtype, seed, log_mag, shift):
    x = _data(seed, log_mag, shift)
    codes, scale, offset = quantize_affine(x, bits, dim=-1, scale_dtype=scale_dtype)
    assert codes.dtype == torch.uint8
    assert scale.dtype == scale_dtype and offset.dtype == scale_dtype
    assert bool((codes <= 2**bits - 1).all())
    lo = x.amin(dim=-1, keepdim=True)
    assert bool((offset.float() <= lo).all())  # offset rounded down: nothing below clips
    step = scale.float()
    err = (x - affine_decode(codes, scale, offset)).abs()
    noise = 4 * EPS32 * (x.abs() + offset.float().abs())
    assert bool((err <= step / 2 + noise).all())


@pytest.mark.parametrize("bits", BITS)
def test_all_zero_rows(bits):
    x = torch.zeros(2, 3, 8)
    x[0, 0] = torch.linspace(-1, 1, 8)  # one live row next to the zero rows
    codes, scale = quantize_symmetric(x, bits, dim=-1)
    assert scale[1:].float().eq(1).all() and codes[1:].eq(0).all()
    codes, scale, offset = quantize_affine(x, bits, dim=-1)
    assert scale[1:].float().eq(1).all() and codes[1:].eq(0).all()
    assert offset[1:].float().eq(0).all()
    assert torch.equal(affine_decode(codes, scale, offset)[1:], x[1:])


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("value", [3.14159, -0.1, 1234.567, 60000.3, 0.01])
def test_constant_row_decodes_within_fp16_rounding(bits, value):
    x = torch.full((1, 8), value)
    fp16_err = (x.half().float() - x).abs()  # rounding of the fp32 value to fp16
    codes, scale, offset = quantize_affine(x, bits, dim=-1)
    assert scale.item() == 1.0
    assert bool(((affine_decode(codes, scale, offset) - x).abs() <= fp16_err).all())
    codes, scale = quantize_symmetric(x, bits, dim=-1)
    # The scale is rounded up by at most one fp16 ulp (2^-10 relative).
    rel = 2.0**-10 * (1 + 1e-5)
    assert bool(((symmetric_decode(codes, scale) - x).abs() <= abs(value) * rel).all())


@pytest.mark.parametrize("quantize", [quantize_symmetric, quantize_affine])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_rejected(quantize, bad):
    x = torch.ones(2, 4)
    x[1, 2] = bad
    with pytest.raises(KvqError, match="NaN or Inf"):
        quantize(x, 8, dim=-1)


def test_scale_underflow_in_float16():
    with pytest.raises(KvqError, match="scale underflows float16"):
        symmetric_qparams(torch.tensor([1e-9]), 8)
    with pytest.raises(KvqError, match="scale underflows float16"):
        quantize_symmetric(torch.full((2, 4), 1e-9), 8, dim=-1)
    with pytest.raises(KvqError, match="scale underflows float16"):
        quantize_affine(torch.tensor([[0.0, 1e-9]]), 8, dim=-1)
    # float32 storage has room for it.
    assert symmetric_qparams(torch.tensor([1e-9]), 8, torch.float32).item() > 0


def test_affine_qparams_validation():
    with pytest.raises(KvqError, match="exceeds"):
        affine_qparams(torch.tensor([1.0]), torch.tensor([0.0]), 4)
    with pytest.raises(KvqError, match="NaN or Inf"):
        affine_qparams(torch.tensor([0.0]), torch.tensor([float("inf")]), 4)
    with pytest.raises(KvqError, match="overflows"):
        affine_qparams(torch.tensor([-7e4]), torch.tensor([0.0]), 4)


@pytest.mark.parametrize("bits", [0, 1, 5, 16])
def test_bad_bits_rejected(bits):
    x = torch.ones(2, 4)
    for call in (
        lambda: quantize_symmetric(x, bits, dim=-1),
        lambda: quantize_affine(x, bits, dim=-1),
        lambda: symmetric_qparams(torch.ones(1), bits),
        lambda: symmetric_encode(x, torch.ones(1), bits),
        lambda: affine_encode(x, torch.ones(1), torch.zeros(1), bits),
        lambda: affine_qparams(torch.zeros(1), torch.ones(1), bits),
    ):
        with pytest.raises(KvqError, match="bits"):
            call()


def test_round_half_to_even():
    codes = symmetric_encode(torch.tensor([0.5, 1.5, 2.5, -0.5, 300.0]), torch.tensor(1.0), 8)
    assert codes.tolist() == [0, 2, 2, 0, 127]


@pytest.mark.parametrize("dim", [-1, 2, (1, 3), (0, 2, 3)])
def test_per_axis_qparams_broadcast(dim):
    x = _data(0, 0.0, 0.5, shape=(2, 3, 5, 8))  # [B, H, T, D]
    dims = (dim,) if isinstance(dim, int) else dim
    expected_shape = tuple(1 if i in {d % 4 for d in dims} else s for i, s in enumerate(x.shape))
    codes, scale = quantize_symmetric(x, 4, dim=dim)
    assert codes.shape == x.shape and scale.shape == expected_shape
    assert torch.equal(scale, symmetric_qparams(x.abs().amax(dim=dim, keepdim=True), 4))
    codes_a, scale_a, offset_a = quantize_affine(x, 4, dim=dim)
    assert scale_a.shape == offset_a.shape == expected_shape
    # Each slice gets the qparams it would get alone: check the first slice.
    first = x[tuple(slice(None) if i in {d % 4 for d in dims} else 0 for i in range(4))]
    _, s1, o1 = quantize_affine(first, 4, dim=tuple(range(first.dim())))
    assert s1.flatten().item() == scale_a.flatten()[0].item()
    assert o1.flatten().item() == offset_a.flatten()[0].item()


@pytest.mark.parametrize("group", [None, 1, 4, 16])
def test_groups_round_trip(group):
    x = torch.arange(2 * 3 * 16, dtype=torch.float32).reshape(2, 3, 16)
    g = to_groups(x, group)
    assert g.shape == (2, 3, 16 // (group or 16), group or 16)
    assert torch.equal(from_groups(g), x)
    # Per-group qparams broadcast back through the grouped view.
    codes, scale = quantize_symmetric(g, 8, dim=-1)
    assert scale.shape == (*g.shape[:-1], 1)
    assert from_groups(codes).shape == x.shape


@pytest.mark.parametrize("group", [0, -4, 5, 32])
def test_bad_group_size(group):
    with pytest.raises(KvqError, match="group size"):
        to_groups(torch.zeros(2, 16), group)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES)
@pytest.mark.parametrize("log_mag", [-40.0, -6.0, 0.0, 3.0, 30.0])
def test_live_rows_match_the_checked_qparams(bits, scale_dtype, log_mag):
    """The cache's one-read path (raise_tiny=False) gives the checked path's qparams,
    down to tiny, zero, constant and overflowing rows."""
    x = _data(1, 0.0, 0.0, shape=(6, 16)) * 10.0**log_mag
    x[0] = 0.0
    x[1] = 2.5
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    try:
        scale, offset = affine_qparams(lo, hi, bits, scale_dtype, raise_tiny=False)
    except KvqError as e:
        with pytest.raises(KvqError, match=str(e)[:20]):
            quantize_affine(x, bits, -1, scale_dtype, raise_tiny=False)
    else:
        codes, s, o = quantize_affine(x, bits, -1, scale_dtype, raise_tiny=False)
        assert torch.equal(s, scale) and torch.equal(o, offset)
        assert torch.equal(codes, affine_encode(x, scale, offset, bits))
    amax = x.abs().amax(-1, keepdim=True)
    try:
        scale = symmetric_qparams(amax, bits, scale_dtype, raise_tiny=False)
    except KvqError as e:
        with pytest.raises(KvqError, match=str(e)[:20]):
            quantize_symmetric(x, bits, -1, scale_dtype, raise_tiny=False)
    else:
        codes, s = quantize_symmetric(x, bits, -1, scale_dtype, raise_tiny=False)
        assert torch.equal(s, scale) and torch.equal(codes, symmetric_encode(x, scale, bits))
