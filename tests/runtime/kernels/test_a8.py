"""A8 producer kernels: the Triton paths (through the interpreter) against the references.

The references are checked once against an independent float64 formula; after that the
Triton kernels must reproduce them bit for bit (codes, scales and the int32 accumulator).
"""

from __future__ import annotations

import pytest
import torch

from kvq.errors import KvqError
from kvq.runtime.kernels.activations import a8

EPS = 1e-6


def activations(m: int, k: int, seed: int = 0) -> torch.Tensor:
    """[M, K] fp32 rows of different magnitudes, an all-zero row and a big outlier."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-2, 2, m)[:, None]
    if m >= 3:
        x[1] = 0.0
        x[-1, k // 3] = 1e3 * x[-1].abs().max()
    return x


def norm_weight(k: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(k, generator=g) * 0.5


def rmsnorm64(x, weight, eps, weight_offset=0.0):
    """The textbook formula in float64, sharing no code with the module."""
    x = x.double()
    rms = torch.sqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    return x / rms * (weight.double() + weight_offset)


# --- rmsnorm_quant --------------------------------------------------------------------


@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("k", [64, 100, 256])
@pytest.mark.parametrize("weight_offset", [0.0, 1.0])
def test_rmsnorm_quant_triton_is_bit_exact(m, k, weight_offset):
    x, w = activations(m, k, seed=m * k), norm_weight(k)
    want = a8.rmsnorm_quant_reference(x, w, EPS, weight_offset=weight_offset)
    got = a8.rmsnorm_quant_triton(x, w, EPS, weight_offset=weight_offset)
    assert got[0].dtype == torch.int8 and got[1].dtype == torch.float16
    assert torch.equal(got[0], want[0])
    assert torch.equal(got[1], want[1])


@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rmsnorm_quant_dtypes_are_bit_exact(scale_dtype, x_dtype):
    x = activations(5, 96, seed=7)
    x = (x / x.abs().max() * 6e4).to(x_dtype)  # the outlier at fp16's range
    w = norm_weight(96).to(torch.bfloat16)
    want = a8.rmsnorm_quant_reference(x, w, EPS, scale_dtype=scale_dtype)
    got = a8.rmsnorm_quant_triton(x, w, EPS, scale_dtype=scale_dtype)
    assert got[1].dtype == scale_dtype
    assert torch.equal(got[0], want[0])
    assert torch.equal(got[1], want[1])


@pytest.mark.parametrize("weight_offset", [0.0, 1.0])
def test_reference_matches_float64_formula(weight_offset):
    x, w = activations(17, 256, seed=3), norm_weight(256)
    codes, scale = a8.rmsnorm_quant_reference(x, w, EPS, weight_offset=weight_offset)
    y = rmsnorm64(x, w, EPS, weight_offset)  # [M, K]
    ideal = y.abs().amax(dim=1) / 127  # [M]
    s = scale.double()
    live = ideal > 0
    # Rounded up to fp16: never below the ideal (up to fp32 noise), at most one fp16 ulp above.
    assert bool((s[live] >= ideal[live] * (1 - 1e-6)).all())
    assert bool((s[live] <= ideal[live] * (1 + 2**-10 + 1e-6)).all())
    assert torch.equal(s[~live], torch.ones_like(s[~live]))
    # Codes: nearest level of the float64 value, except (rarely) at a rounding tie.
    exact = torch.round(y / s[:, None]).clamp(-127, 127)
    assert (codes.double() - exact).abs().max() <= 1
    assert (codes.double() != exact).double().mean() < 1e-3
    assert bool(((codes.double() * s[:, None] - y).abs() <= 0.5 * s[:, None] * 1.0001).all())
    assert codes.abs().max() == 127


def test_zero_row_stores_scale_one_and_zero_codes():
    x, w = torch.zeros(2, 64), norm_weight(64)
    for fn in (a8.rmsnorm_quant_reference, a8.rmsnorm_quant_triton):
        codes, scale = fn(x, w, EPS)
        assert torch.equal(scale, torch.ones(2, dtype=torch.float16))
        assert not codes.any()


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # numpy
@pytest.mark.parametrize("fn", [a8.rmsnorm_quant_reference, a8.rmsnorm_quant_triton])
def test_unrepresentable_scales_raise(fn):
    x = activations(3, 64)
    with pytest.raises(KvqError, match="underflows float16"):
        fn(x, torch.full((64,), 1e-9), EPS)
    with pytest.raises(KvqError, match="overflows float16"):
        fn(x, torch.full((64,), 1e9), EPS)
    bad = x.clone()
    bad[0, 5] = float("nan")
    with pytest.raises(KvqError):
        fn(bad, norm_weight(64), EPS)
    # float32 scales have the range for what float16 cannot hold.
    fn(x, torch.full((64,), 1e9), EPS, scale_dtype=torch.float32)


@pytest.mark.parametrize("fn", [a8.rmsnorm_quant_reference, a8.rmsnorm_quant_triton])
def test_rmsnorm_quant_validates_inputs(fn):
    x, w = activations(3, 64), norm_weight(64)
    with pytest.raises(KvqError, match="shape"):
        fn(x[0], w, EPS)
    with pytest.raises(KvqError, match="weight must have shape"):
        fn(x, w[:32], EPS)
    with pytest.raises(KvqError, match="x must be float"):
        fn(x.to(torch.int32), w, EPS)
    with pytest.raises(KvqError, match="eps"):
        fn(x, w, 0.0)
    with pytest.raises(KvqError, match="scale_dtype"):
        fn(x, w, EPS, scale_dtype=torch.int8)


def test_rmsnorm_quant_edge_shapes_and_strides():
    w = norm_weight(64)
    x = activations(64, 5).T  # [5, 64], not contiguous
    want = a8.rmsnorm_quant_reference(x, w, EPS)
    got = a8.rmsnorm_quant_triton(x, w, EPS)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    empty = a8.rmsnorm_quant_triton(torch.zeros(0, 64), w, EPS)
    assert empty[0].shape == (0, 64) and empty[1].shape == (0,)
    one = torch.tensor([[-3.0], [0.0]])  # K = 1: y = +-w
    got = a8.rmsnorm_quant_triton(one, torch.ones(1), EPS)
    assert torch.equal(got[0], a8.rmsnorm_quant_reference(one, torch.ones(1), EPS)[0])


def test_rmsnorm_quant_dispatch(monkeypatch):
    monkeypatch.delenv("KVQ_BACKEND", raising=False)
    x, w = activations(3, 64), norm_weight(64)
    want = a8.rmsnorm_quant_reference(x, w, EPS, weight_offset=1.0)
    for backend in ("reference", "triton", None):
        got = a8.rmsnorm_quant(x, w, EPS, weight_offset=1.0, backend=backend)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# --- int8_linear ----------------------------------------------------------------------


def int8_operands(m: int, n: int, k: int, seed: int = 0):
    """Full-range int8 codes (-128 included) and positive fp16 scales."""
    g = torch.Generator().manual_seed(seed)
    x_codes = torch.randint(-128, 128, (m, k), generator=g, dtype=torch.int8)
    w_codes = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    x_scale = (torch.rand(m, generator=g) * 0.1 + 1e-3).half()
    w_scale = (torch.rand(n, generator=g) * 0.01 + 1e-4).half()
    bias = torch.randn(n, generator=g)
    return x_codes, x_scale, w_codes, w_scale, bias


@pytest.mark.parametrize("m", [1, 5, 33])
@pytest.mark.parametrize("n", [16, 48])
@pytest.mark.parametrize("k", [64, 96])
@pytest.mark.parametrize("with_bias", [False, True])
def test_int8_linear_triton_matches_reference(m, n, k, with_bias):
    x_codes, x_scale, w_codes, w_scale, bias = int8_operands(m, n, k, seed=m + n + k)
    bias = bias if with_bias else None
    # Unit scales expose the int32 accumulator itself (|acc| < 2^24, exact in fp32).
    exact = x_codes.long() @ w_codes.long().T  # [M, N]
    ones_m, ones_n = torch.ones(m), torch.ones(n)
    acc = a8.int8_linear_triton(x_codes, ones_m, w_codes, ones_n)
    assert torch.equal(acc.long(), exact)
    assert torch.equal(a8.int8_linear_reference(x_codes, ones_m, w_codes, ones_n).long(), exact)

    want = a8.int8_linear_reference(x_codes, x_scale, w_codes, w_scale, bias)
    got = a8.int8_linear_triton(x_codes, x_scale, w_codes, w_scale, bias)
    assert got.shape == (m, n) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0.0)


def test_int8_linear_out_dtype_and_dispatch(monkeypatch):
    monkeypatch.delenv("KVQ_BACKEND", raising=False)
    x_codes, x_scale, w_codes, w_scale, bias = int8_operands(4, 16, 64)
    want = a8.int8_linear_reference(x_codes, x_scale, w_codes, w_scale, bias, torch.bfloat16)
    for backend in ("reference", "triton", None):
        got = a8.int8_linear(
            x_codes, x_scale, w_codes, w_scale, bias, torch.bfloat16, backend=backend
        )
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got, want, rtol=1e-2, atol=0.0)


def test_int8_linear_extreme_codes_accumulate_exactly():
    k = 4096  # 128 * 128 * 4096 = 2^26: past fp32's exact integers, well inside int32
    x_codes = torch.full((1, k), -128, dtype=torch.int8)
    w_codes = torch.full((16, k), -128, dtype=torch.int8)
    w_codes[1] = 127
    got = a8.int8_linear_triton(x_codes, torch.ones(1), w_codes, torch.ones(16))
    assert got[0, 0] == 2**26 and got[0, 1] == -128 * 127 * k


@pytest.mark.parametrize("fn", [a8.int8_linear_reference, a8.int8_linear_triton])
def test_int8_linear_validates_inputs(fn):
    x_codes, x_scale, w_codes, w_scale, bias = int8_operands(4, 16, 64)
    with pytest.raises(KvqError, match="int8"):
        fn(x_codes.float(), x_scale, w_codes, w_scale)
    with pytest.raises(KvqError, match="K=64 but w_codes has K=32"):
        fn(x_codes, x_scale, w_codes[:, :32], w_scale)
    with pytest.raises(KvqError, match="x_scale must have shape"):
        fn(x_codes, x_scale[:2], w_codes, w_scale)
    with pytest.raises(KvqError, match="bias must have shape"):
        fn(x_codes, x_scale, w_codes, w_scale, bias[:3])
    with pytest.raises(KvqError, match="out_dtype"):
        fn(x_codes, x_scale, w_codes, w_scale, None, torch.int32)


# --- end to end -----------------------------------------------------------------------


@pytest.mark.parametrize("weight_offset", [0.0, 1.0])
def test_rmsnorm_quant_then_int8_linear_approximates_fp32(weight_offset):
    """W8A8 through both kernels lands within 2% (relative Frobenius) of fp32."""
    x, gamma = activations(9, 256, seed=11), norm_weight(256)
    g = torch.Generator().manual_seed(5)
    weight = torch.randn(48, 256, generator=g) / 16  # [N, K]
    bias = torch.randn(48, generator=g)
    y = a8.rmsnorm_fp32(x, gamma, EPS, weight_offset)
    want = y @ weight.T + bias  # [M, N]

    x_codes, x_scale = a8.rmsnorm_quant_triton(x, gamma, EPS, weight_offset=weight_offset)
    w_codes, w_scale = a8.quantize_weight_per_channel(weight)
    assert w_codes.shape == (48, 256) and w_scale.shape == (48,)
    got = a8.int8_linear_triton(x_codes, x_scale, w_codes, w_scale, bias)
    rel = torch.linalg.norm(got - want) / torch.linalg.norm(want)
    assert rel < 2e-2, f"relative Frobenius error {rel:.3g}"
    assert torch.allclose(rmsnorm64(x, gamma, EPS, weight_offset).float(), y, rtol=1e-5, atol=1e-5)
