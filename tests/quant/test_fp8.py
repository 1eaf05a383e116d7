"""FP8 with an external scale: round-trip precision, saturation, scale policy."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvq.errors import KvqError
from kvq.quant import fp8
from kvq.quant.fp8 import FP8_DTYPES, fp8_decode, fp8_encode, fp8_max, fp8_scale

# format -> (mantissa bits, exponent of the smallest subnormal)
PRECISION = {"e4m3": (3, -9), "e5m2": (2, -16)}


def test_fp8_max():
    assert fp8_max("e4m3") == 448.0
    assert fp8_max("e5m2") == 57344.0
    with pytest.raises(KvqError):
        fp8_max("e3m4")


@pytest.mark.parametrize("fmt", list(FP8_DTYPES))
@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), log_amax=st.floats(-3, 4))
def test_fp8_round_trip_error(fmt, seed, log_amax):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 8, 32, generator=gen) * 10.0**log_amax
    amax = x.abs().amax(dim=-1, keepdim=True)  # [4, 8, 1]
    scale = fp8_scale(amax, fmt)
    codes = fp8_encode(x, scale, fmt)
    assert codes.dtype == FP8_DTYPES[fmt]
    x_hat = fp8_decode(codes, scale)
    mant, sub = PRECISION[fmt]
    # Round to nearest: half an ulp relative in the normal range, half the
    # smallest subnormal (times the scale) near zero; 1e-6 covers fp32 noise.
    bound = (2.0 ** -(mant + 1)) * x.abs() + 2.0 ** (sub - 1) * scale.float()
    assert bool(((x - x_hat).abs() <= bound * (1 + 1e-6)).all())
    # The row maximum maps to at most +-max: nothing clips.
    assert bool((codes.float().abs() <= fp8_max(fmt)).all())


@pytest.mark.parametrize("fmt", list(FP8_DTYPES))
def test_fp8_saturates(fmt):
    top = fp8_max(fmt)
    x = torch.tensor([1e9, -1e9, 3 * top, -top, 0.0])
    codes = fp8_encode(x, torch.tensor(1.0), fmt)
    assert codes.float().tolist() == [top, -top, top, -top, 0.0]


@pytest.mark.parametrize("fmt", list(FP8_DTYPES))
def test_fp8_zero_amax_and_bad_input(fmt):
    scale = fp8_scale(torch.zeros(3), fmt)
    assert scale.tolist() == [1.0, 1.0, 1.0]
    with pytest.raises(KvqError, match="NaN or Inf"):
        fp8_encode(torch.tensor([float("nan")]), torch.tensor(1.0), fmt)
    with pytest.raises(KvqError, match="scale underflows float16"):
        fp8_scale(torch.tensor([1e-5]), fmt, scale_dtype=torch.float16)


def test_fp8_decode_rejects_non_fp8():
    with pytest.raises(KvqError):
        fp8_decode(torch.zeros(2), torch.tensor(1.0))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp16_placement_reads_every_finite_code_exactly(fmt):
    shift, factor = fp8.fp16_placement(fmt)
    codes = torch.arange(256, dtype=torch.int32)
    bits = ((codes & 0x80) << 8) | ((codes & 0x7F) << shift)
    placed = bits.to(torch.int16).view(torch.float16).float() * factor
    want = codes.to(torch.uint8).view(fp8.FP8_DTYPES[fmt]).float()
    finite = want.isfinite()
    assert finite.sum() >= 248  # e4m3: 2 NaN patterns; e5m2: 6 NaN, 2 Inf
    assert torch.equal(placed[finite], want[finite])
