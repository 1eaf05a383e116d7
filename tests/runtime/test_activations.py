"""run-time A8: decoder linear inputs quantized per token or with static scales, the
reference fake-quant and the W8A8 GEMM path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvq.errors import IncompatibleArtifact, KvqError
from kvq.models.adapters import get_adapter
from kvq.quant import activations as a8
from kvq.runtime.activations import quantized_linear_inputs, static_scales
from kvq.runtime.kernels.activations.a8 import int8_linear_reference, quantize_weight_per_channel
from tests.conftest import make_tiny_model


@pytest.fixture(scope="module")
def adapter():
    return get_adapter(make_tiny_model("qwen2"))  # q/k/v carry biases


def _input(module, t=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, t, module.in_features, generator=g)
    x[0, 3, 1] = 40.0  # an outlier token
    return x


def test_round_trip_is_the_shared_symmetric_int8():
    x = torch.tensor([[0.5, -1.0, 0.25], [3.0, 0.0, -0.1]])
    dyn = a8.round_trip(x, None)
    step = x.abs().amax(-1, keepdim=True) / 127
    assert torch.allclose(dyn, torch.round(x / step) * step)
    assert torch.equal(dyn[:, :2].abs().amax(-1), x.abs().amax(-1))  # each row's max is exact
    scale = torch.tensor([0.01])
    static = a8.round_trip(x, scale)
    assert torch.equal(static, torch.round(x / 0.01).clamp(-127, 127) * scale)  # 3.0 saturates
    assert static.dtype == x.dtype


@pytest.mark.parametrize("mode", ["a8-dynamic", "a8-static"])
def test_reference_fake_quantizes_every_linear_input(adapter, mode):
    linears = adapter.decoder_linears()
    scales = {n: torch.tensor([0.05]) for n in linears} if mode == "a8-static" else None
    module = linears["layers.1.self_attn.q_proj"]
    x = _input(module)
    scale = None if scales is None else scales["layers.1.self_attn.q_proj"]
    with quantized_linear_inputs(adapter, mode, scales, backend="reference"):
        got = module(x)
    want = F.linear(a8.round_trip(x, scale), module.weight, module.bias)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert torch.equal(module(x), F.linear(x, module.weight, module.bias))  # hooks removed


@pytest.mark.parametrize("mode", ["a8-dynamic", "a8-static"])
def test_triton_path_is_the_w8a8_gemm(adapter, mode):
    linears = adapter.decoder_linears()
    scales = {n: torch.tensor([0.05]) for n in linears} if mode == "a8-static" else None
    module = linears["layers.0.self_attn.k_proj"]
    x = _input(module, t=5)
    with quantized_linear_inputs(adapter, mode, scales, backend="triton"):
        got = module(x)
    rows = x.reshape(-1, module.in_features)
    if mode == "a8-static":
        codes, xs = (
            a8.encode_static(rows, scales["layers.0.self_attn.k_proj"]),
            torch.full((rows.shape[0],), 0.05),
        )
    else:
        codes, xs = a8.encode_dynamic(rows)
        xs = xs[:, 0]
    wq, ws = quantize_weight_per_channel(module.weight)
    want = int8_linear_reference(codes, xs, wq, ws, module.bias).view(2, 5, -1)
    assert torch.equal(got, want)
    assert "forward" not in module.__dict__  # the class's forward is back


def test_model_output_changes_only_inside(adapter):
    model = adapter.model
    ids = torch.arange(3, 19)[None]
    with torch.no_grad():
        before = model(ids).logits
        with quantized_linear_inputs(adapter, "a8-dynamic"):
            inside = model(ids).logits
        after = model(ids).logits
    assert torch.equal(before, after)
    assert not torch.equal(before, inside)
    assert (inside - before).abs().max() < 0.1 * before.abs().max()


def test_static_scales_must_cover_every_linear(adapter):
    names = {a8.input_scale_name(n): torch.ones(1) for n in adapter.decoder_linears()}
    assert set(static_scales(names, adapter)) == set(adapter.decoder_linears())
    with pytest.raises(KvqError, match="kvq calibrate act-scales"):
        static_scales({}, adapter)
    partial = dict(list(names.items())[1:])
    with pytest.raises(IncompatibleArtifact, match="absent"):
        static_scales(partial, adapter)
    extra = names | {a8.input_scale_name("layers.0.mlp.nothing"): torch.ones(1)}
    with pytest.raises(IncompatibleArtifact, match="a linear of the model"):
        static_scales(extra, adapter)


def test_unknown_mode_is_refused(adapter):
    with pytest.raises(KvqError, match="--activations"), quantized_linear_inputs(adapter, "a4"):
        pass


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_triton_dynamic_fuses_the_norm_into_the_gemm(family, monkeypatch):
    """q/k/v and gate/up take the fused RMSNorm + INT8 codes of their norm's input (the
    reference producer's, bit for bit); o/down quantize their own input."""
    from kvq.runtime.kernels.activations import a8 as kernels

    adapter = get_adapter(make_tiny_model(family))
    seen = {}
    real = kernels.int8_linear

    def spy(codes, scale, w_codes, *args, **kw):
        seen[w_codes.data_ptr()] = (w_codes, codes, scale)
        return real(codes, scale, w_codes, *args, **kw)

    monkeypatch.setattr(kernels, "int8_linear", spy)
    norm_inputs = {}
    layer0 = adapter.decoder_layers()[0]
    norm = adapter.norm_feeds()[0][0]
    assert norm is layer0.input_layernorm
    norm.register_forward_hook(lambda _m, args, _o: norm_inputs.update(x=args[0]))
    ids = torch.arange(3, 15)[None]
    with torch.no_grad():
        base = adapter.model(ids).logits
        with quantized_linear_inputs(adapter, "a8-dynamic", backend="triton"):
            got = adapter.model(ids).logits
    q_proj = adapter.decoder_linears()["layers.0.self_attn.q_proj"]
    # the codes q_proj's GEMM got are the reference producer's on the norm's input
    eps, offset = adapter.norm_feeds()[0][1:3]
    x = norm_inputs["x"][0]  # [T, K]
    want_codes, want_scale = kernels.rmsnorm_quant_reference(
        x, norm.weight, eps, weight_offset=offset, scale_dtype=torch.float32
    )
    assert norm_inputs["x"].shape[1] == ids.shape[1]
    assert len(seen) == len(adapter.decoder_linears())  # every linear ran the GEMM
    q_weight = quantize_weight_per_channel(q_proj.weight)[0]
    [(codes, scale)] = [(c, s) for w, c, s in seen.values() if torch.equal(w, q_weight)]
    assert torch.equal(codes, want_codes) and torch.equal(scale, want_scale)
    assert not torch.equal(got, base)
    # = the reference fake-quant path on the same model with W8 weights (per channel), to
    # fp32 rounding (the fused producer's norm rounds in its own order)
    with torch.no_grad():
        for module in adapter.decoder_linears().values():
            codes, scale = quantize_weight_per_channel(module.weight)
            module.weight.copy_(codes.float() * scale.float()[:, None])
        with quantized_linear_inputs(adapter, "a8-dynamic", backend="reference"):
            want = adapter.model(ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4 * float(base.abs().max()))
