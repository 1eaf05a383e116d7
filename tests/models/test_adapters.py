"""Adapters against the real HF modeling code: what the hook sites capture, rotated by the
adapter, must equal what the model itself puts in its cache and feeds to attention."""

from __future__ import annotations

import math

import pytest
import torch

from kvq.errors import KvqError
from kvq.models.adapters import ArchitectureAdapter, get_adapter
from tests.conftest import _tiny_config, make_tiny_model

T = 12  # > gemma3/mistral tiny sliding window (8), so the window and cache trimming are exercised
CASES = {
    "llama": ("llama", {}),
    "llama-linear-rope": (
        "llama",
        {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}},
    ),
    "mistral": ("mistral", {}),
    "qwen2": ("qwen2", {}),
    "gemma3": ("gemma3", {}),
    # shapes and RoPE variants of models beyond the default fixtures: head_dim 80 with one
    # KV head, head_dim 96 with GQA 8, Llama 3 / YaRN rope scaling (YaRN scales cos and
    # sin by its attention factor), Gemma 3 with two KV heads and head_dim 256
    "llama-d80-mqa-llama3": ("llama", {"head_dim": 80, "num_key_value_heads": 1,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8}}),
    "qwen2-d96-g8-yarn": ("qwen2", {"head_dim": 96, "num_attention_heads": 8,
        "num_key_value_heads": 1, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4,
        "factor": 4.0, "original_max_position_embeddings": 8}}),
    "gemma3-d256-g2": ("gemma3", {"head_dim": 256, "num_key_value_heads": 2}),
}  # fmt: skip


def _run(model, adapter: ArchitectureAdapter, ids: torch.Tensor):
    """Forward with hooks on every site; returns (output, captured[(kind, layer)], attn_out)."""
    captured: dict[tuple[str, int], torch.Tensor] = {}
    handles = []

    def keep(kind, i, fn):
        def hook(_m, _inp, out):
            captured[(kind, i)] = fn(out).detach().clone()

        return hook

    def keep_attn_out(i):  # input of o_proj = attention output [B, T, H_q*D]
        def pre_hook(_m, args):
            captured[("o", i)] = args[0].detach().clone()

        return pre_hook

    for i in range(adapter.num_layers):
        for kind, (mod, fn) in (
            ("k", adapter.key_pre_rope_site(i)),
            ("v", adapter.value_site(i)),
            ("q", adapter.query_pre_rope_site(i)),
        ):
            handles.append(mod.register_forward_hook(keep(kind, i, fn)))
        handles.append(adapter.attention(i).o_proj.register_forward_pre_hook(keep_attn_out(i)))
    try:
        with torch.no_grad():
            out = model(ids, use_cache=True)
    finally:
        for h in handles:
            h.remove()
    return out, captured


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    family, overrides = CASES[request.param]
    model = make_tiny_model(family, **overrides)
    adapter = get_adapter(model)
    ids = torch.randint(
        3, model.config.vocab_size, (2, T), generator=torch.Generator().manual_seed(1)
    )
    out, captured = _run(model, adapter, ids)
    return request.param, model, adapter, out, captured


def test_rotated_pre_rope_key_and_value_equal_cache(case):
    _, _, adapter, out, captured = case
    positions = torch.arange(T)
    cache = out.cache  # 5.x renamed past_key_values -> cache (the old name still works, warns)
    for i in range(adapter.num_layers):
        k_pre, v = captured[("k", i)], captured[("v", i)]
        assert k_pre.shape == (2, adapter.num_kv_heads, T, adapter.head_dim)
        k_post = adapter.apply_rope(k_pre, *adapter.rope_cos_sin(i, positions))
        cached_k, cached_v = cache.layers[i].keys, cache.layers[i].values
        # A sliding layer's DynamicCache keeps only the last window-1 tokens.
        n = cached_k.shape[-2]
        window = adapter.sliding_window(i)
        assert n == (T if window is None else min(T, window - 1))
        torch.testing.assert_close(k_post[:, :, -n:], cached_k, atol=1e-5, rtol=0)
        torch.testing.assert_close(v[:, :, -n:], cached_v, atol=1e-5, rtol=0)


def test_query_site_scale_and_window_reproduce_attention(case):
    """softmax(rope(q) rope(k)^T * scale + causal/sliding mask) v == the model's attention."""
    _, _, adapter, _, captured = case
    positions = torch.arange(T)
    for i in range(adapter.num_layers):
        cos, sin = adapter.rope_cos_sin(i, positions)
        q = adapter.apply_rope(captured[("q", i)], cos, sin)  # [B, H_q, T, D]
        k = adapter.apply_rope(captured[("k", i)], cos, sin)  # [B, H_kv, T, D]
        v = captured[("v", i)]
        g = adapter.info.gqa_group
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        scores = q @ k.transpose(-1, -2) * adapter.attention_scaling(i)
        qi, kj = positions[:, None], positions[None, :]
        allowed = kj <= qi
        if (w := adapter.sliding_window(i)) is not None:
            allowed &= qi - kj < w
        scores = scores.masked_fill(~allowed, float("-inf"))
        o = (scores.softmax(-1) @ v).transpose(1, 2).reshape(2, T, -1)
        torch.testing.assert_close(o, captured[("o", i)], atol=1e-5, rtol=1e-4)
        assert adapter.attention_scaling(i) == pytest.approx(adapter.attention(i).scaling)


def test_rope_cos_sin_shape_and_dtype(case):
    _, _, adapter, _, _ = case
    cos, sin = adapter.rope_cos_sin(0, torch.arange(5))
    assert cos.shape == sin.shape == (5, adapter.info.rope[0].rotary_dim)
    assert cos.dtype == sin.dtype == torch.float32
    # position 0: no rotation (cos is YaRN's attention factor there, 1 for other RoPEs)
    torch.testing.assert_close(sin[0], torch.zeros_like(sin[0]))
    torch.testing.assert_close(cos[0], torch.full_like(cos[0], cos[0, 0].item()))


def test_invert_rope_roundtrip():
    adapter_cls = ArchitectureAdapter
    x = torch.randn(2, 3, 7, 16)
    angles = torch.randn(7, 8)
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    y = adapter_cls.apply_rope(x, cos, sin)
    assert not torch.allclose(y, x)
    torch.testing.assert_close(adapter_cls.invert_rope(y, cos, sin), x, atol=1e-5, rtol=0)
    # Partial rotary (R = 8 < D = 16): channels beyond R pass through untouched.
    emb = torch.cat((angles[:, :4], angles[:, :4]), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    y = adapter_cls.apply_rope(x, cos, sin)
    torch.testing.assert_close(y[..., 8:], x[..., 8:])
    torch.testing.assert_close(adapter_cls.invert_rope(y, cos, sin), x, atol=1e-5, rtol=0)


@pytest.mark.parametrize("case", ["qwen2-d96-g8-yarn", "llama-d80-mqa-llama3"])
def test_invert_rope_undoes_the_models_own_rope(case):
    """YaRN's cos/sin carry an attention factor m (cos² + sin² = m² = 1.30 at factor 4):
    un-rotating a cached key must divide it out, or pre-RoPE keys come back m² too large."""
    family, overrides = CASES[case]
    adapter = get_adapter(make_tiny_model(family, **overrides))
    cos, sin = adapter.rope_cos_sin(0, torch.arange(40))
    x = torch.randn(2, 1, 40, adapter.head_dim)
    y = adapter.apply_rope(x, cos, sin)
    torch.testing.assert_close(adapter.invert_rope(y, cos, sin), x, atol=1e-5, rtol=1e-5)


def test_info_llama():
    info = get_adapter(make_tiny_model("llama")).info
    assert (info.model_type, info.num_layers, info.num_q_heads, info.num_kv_heads) == (
        "llama",
        2,
        4,
        2,
    )
    assert info.head_dim == 16 and info.gqa_group == 2
    assert info.layer_types == ("full_attention",) * 2 and info.sliding_window is None
    assert {r.theta for r in info.rope} == {10_000.0}
    assert all(
        r.rotary_dim == 16 and r.pairing == "rotate-half" and r.scaling is None for r in info.rope
    )
    assert not info.qk_norm and not info.qk_norm_offset_one


def test_info_rope_scaling_is_canonical_json():
    model = make_tiny_model("llama", **CASES["llama-linear-rope"][1])
    rope = get_adapter(model).info.rope[0]
    assert rope.theta == 500.0
    assert rope.scaling == '{"factor":2.0,"rope_type":"linear"}'


def test_info_gemma3():
    adapter = get_adapter(make_tiny_model("gemma3"))
    info = adapter.info
    assert info.model_type == "gemma3_text"
    assert info.layer_types == ("sliding_attention",) * 3 + ("full_attention",)
    assert info.sliding_window == 8
    assert [r.theta for r in info.rope] == [10_000.0] * 3 + [1_000_000.0]
    assert (info.num_q_heads, info.num_kv_heads, info.head_dim) == (4, 1, 32)
    assert info.qk_norm and info.qk_norm_offset_one
    assert [adapter.sliding_window(i) for i in range(4)] == [8, 8, 8, None]
    assert adapter.attention_scaling(0) == pytest.approx(1 / math.sqrt(24))
    # Local and global layers really get different rotations.
    pos = torch.arange(1, 4)
    assert not torch.allclose(adapter.rope_cos_sin(0, pos)[0], adapter.rope_cos_sin(3, pos)[0])


def test_info_mistral_and_qwen2_windows():
    assert get_adapter(make_tiny_model("mistral")).info.layer_types == ("sliding_attention",) * 2
    assert get_adapter(make_tiny_model("mistral")).info.sliding_window == 8
    qwen = get_adapter(make_tiny_model("qwen2")).info
    assert qwen.layer_types == ("full_attention",) * 2 and qwen.sliding_window is None
    windowed = make_tiny_model(
        "qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1
    )
    info = get_adapter(windowed).info
    assert info.layer_types == ("full_attention", "sliding_attention") and info.sliding_window == 8


def test_gemma3_multimodal_wrapper():
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig

    text = _tiny_config("gemma3", 512)
    vision = SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=32,
        patch_size=8,
    )
    config = Gemma3Config(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        mm_tokens_per_image=4,
        image_token_index=500,
        boi_token_index=501,
        eoi_token_index=502,
    )
    model = Gemma3ForConditionalGeneration(config).eval()
    adapter = get_adapter(model)
    assert adapter.info.model_type == "gemma3"
    assert adapter.info.layer_types == ("sliding_attention",) * 3 + ("full_attention",)
    assert adapter.attention(3) is model.model.language_model.layers[3].self_attn
    ids = torch.randint(3, 400, (1, 6))
    out, captured = _run(model, adapter, ids)
    k = adapter.apply_rope(captured[("k", 3)], *adapter.rope_cos_sin(3, torch.arange(6)))
    torch.testing.assert_close(k, out.cache.layers[3].keys, atol=1e-5, rtol=0)


def test_unsupported_architecture_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(KvqError, match=r"cannot take GPT2LMHeadModel: .*absolute or ALiBi"):
        get_adapter(model)
