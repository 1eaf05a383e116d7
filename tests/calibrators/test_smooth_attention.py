"""SmoothAttention: RoPE-paired scales, exact folding, the pass through the CLI, refusals."""

from __future__ import annotations

import json
import math

import pytest
import safetensors.torch
import torch

from kvq.calibrators.options import ChannelScalesOptions, SmoothAttentionOptions
from kvq.calibrators.smooth_attention import key_channel_spread, smooth_lambda
from kvq.errors import KvqError
from kvq.models.adapters import rope_partners
from kvq.models.loading import load_model
from kvq.pipeline import (
    apply_transforms,
    cache_for,
    load_windows,
)
from kvq.progress import Progress
from tests.cli.test_cli import _one_line_error, _run
from tests.cli.test_hardening import rehash
from tests.conftest import calibrate, make_tiny_model, tiny_tokenizer

FAMILIES = ["llama", "qwen2", "gemma3"]


def _smooth(model_dir, data, out, options=None, base=None, samples=2, seqlen=24):
    options = options or SmoothAttentionOptions()
    return calibrate(model_dir, data, out, options, base, samples=samples, seqlen=seqlen)


@pytest.mark.parametrize("value", [-0.1, 1.5, math.nan])
@pytest.mark.parametrize("name", ["alpha", "beta"])
def test_exponents_outside_the_unit_interval_are_refused(name, value):
    with pytest.raises(KvqError, match=f"--{name} must be in \\[0, 1\\]"):
        SmoothAttentionOptions(**{name: value})


def test_rope_partners_follow_the_declared_pairing():
    assert rope_partners(8, 8, "rotate-half").tolist() == [4, 5, 6, 7, 0, 1, 2, 3]
    assert rope_partners(8, 8, "interleaved").tolist() == [1, 0, 3, 2, 5, 4, 7, 6]
    # partial rotary: channels past R rotate with nothing and partner themselves
    assert rope_partners(6, 4, "rotate-half").tolist() == [2, 3, 0, 1, 4, 5]


def test_lambda_is_tied_within_pairs_and_one_where_a_pair_never_moved():
    kmax = torch.tensor([[4.0, 1.0, 0.0, 9.0, 0.0, 0.0]])
    qmax = torch.tensor([[2.0, 2.0, 1.0, 1.0, 0.0, 3.0]])
    partners = rope_partners(6, 4, "rotate-half")  # (0, 2), (1, 3), 4, 5
    lam = smooth_lambda(kmax, qmax, 0.5, 0.0, partners)
    assert lam.tolist() == [[2.0, 3.0, 2.0, 3.0, 1.0, 1.0]]
    lam = smooth_lambda(kmax, qmax, 1.0, 1.0, partners)  # 4 / 2, 9 / 2; channel 5: k = 0
    assert lam.tolist() == [[2.0, 4.5, 2.0, 4.5, 1.0, 1.0]]


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_folded_smoothing_keeps_the_logits_and_flattens_the_keys(
    family, tiny_model_dir, data, tmp_path, caplog
):
    """No quantization: logits equal within fp32 rounding (Qwen2's biases, Gemma's (1 + w)
    q/k norms and sliding layers included), and the widest key channel comes closer to
    the median one."""
    model_dir = tiny_model_dir(family)
    artifact = _smooth(model_dir, data, tmp_path / "A", seqlen=32)
    assert artifact.manifest.policy.name == "kv4-qserve"
    loaded = load_model(str(model_dir))
    ids = torch.randint(3, 500, (2, 40), generator=torch.Generator().manual_seed(1))
    before = loaded.model(ids).logits
    windows = load_windows(loaded, data, 2, 32, 0, None).ids  # the calibration's
    spread_before = key_channel_spread(loaded.adapter, windows, 1, Progress())
    weights = {n: p.clone() for n, p in loaded.model.named_parameters()}
    apply_transforms(loaded, artifact.tensors)
    changed = {n for n, p in loaded.model.named_parameters() if not torch.equal(p, weights[n])}
    after = loaded.model(ids).logits
    torch.testing.assert_close(after, before, atol=2e-5, rtol=1e-4)
    if family == "gemma3":
        assert changed and all(n.endswith(("q_norm.weight", "k_norm.weight")) for n in changed)
    else:
        assert changed and all("q_proj" in n or "k_proj" in n for n in changed)
        assert (family == "qwen2") == any(n.endswith("bias") for n in changed)
    spread_after = key_channel_spread(loaded.adapter, windows, 1, Progress())
    assert all(a < b for a, b in zip(spread_after, spread_before, strict=True))
    # the cache runtime applies it once: a second artifact load changes nothing
    cache_for(loaded, artifact=artifact)
    assert not caplog.records  # nothing newly folded, nothing said
    torch.testing.assert_close(loaded.model(ids).logits, after, atol=0, rtol=0)


@pytest.mark.slow
@torch.no_grad()
def test_folded_smoothing_keeps_the_real_gemma3_logits(data, tmp_path):
    """Gemma 3 270M, a short calibration and sequence so the suite stays fast."""
    artifact = _smooth("gemma3-270m", data, tmp_path / "A", samples=2, seqlen=64)
    loaded = load_model("gemma3-270m")
    text = "The tower is 324 metres tall, about the same height as an 81-storey building."
    ids = loaded.tokenizer(text, return_tensors="pt").input_ids
    before = loaded.model(ids).logits
    apply_transforms(loaded, artifact.tensors)
    after = loaded.model(ids).logits
    # fp32 rounding through 18 layers of logits of magnitude ~30
    torch.testing.assert_close(after, before, atol=2e-3, rtol=1e-4)
    assert torch.equal(after.argmax(-1), before.argmax(-1))


def test_a_chain_calibrates_channel_scales_on_the_smoothed_keys(
    tiny_model_dir, data, tmp_path, caplog
):
    model_dir = tiny_model_dir("qwen2")
    _smooth(model_dir, data, tmp_path / "A")
    options = ChannelScalesOptions(bits=4, key_stage="post-rope", value_group=8)
    chained = _smooth(model_dir, data, tmp_path / "B", options, base=tmp_path / "A")
    plain = _smooth(model_dir, data, tmp_path / "C", options)
    assert [p.method for p in chained.manifest.passes] == ["smoothattention", "channel-scales"]
    assert "layers.0.smooth.lambda" in chained.tensors
    # the key ranges were measured on keys divided by lambda
    lam = chained.tensors["layers.0.smooth.lambda"]
    scale, plain_scale = chained.tensors["layers.0.key.scale"], plain.tensors["layers.0.key.scale"]
    ratio = (plain_scale.float() / scale.float()) / lam
    assert ratio.median().item() == pytest.approx(1.0, rel=0.05)
    loaded = load_model(str(model_dir))
    cache = cache_for(loaded, artifact=chained)
    assert "folded the artifact's model transforms (smooth)" in caplog.text
    with torch.no_grad():
        out = loaded.model(torch.randint(3, 200, (1, 9)), cache=cache).logits
    assert torch.isfinite(out).all()


def test_cli_calibrate_then_run_eval_says_it_applies_the_smoothing(
    tiny_model_dir, shared_data, data, tmp_path
):
    model_dir = tiny_model_dir("gemma3")
    art = tmp_path / "ART"
    result = _run(
        "calibrate", "smoothattention", "--model", model_dir, "--dataset", data,
        "--samples", 2, "--seqlen", 24, "--alpha", 0.4, "--beta", 0.1, "--out", art,
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["passes"][0]["options"] == {"alpha": 0.4, "beta": 0.1, "layout": None}
    assert manifest["policy"]["_data"]["name"] == "kv4-qserve"
    shown = _run("inspect", art)
    assert shown.exit_code == 0 and "smooth (folded into the weights at load)" in shown.stdout
    assert "int4 asym zero-point per-token" in shown.stdout
    report = tmp_path / "eval.json"
    result = _run(
        "run-eval", "--model", model_dir, "--artifact", art, "--data-dir", shared_data,
        "--windows", 2, "--seqlen", 32, "--json", report,
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    assert "apply smooth" in result.stderr
    tasks = json.loads(report.read_text())["tasks"]
    assert math.isfinite(tasks["ppl"]["quantized"]) and tasks["bytes"]["ledger"]["codes"] > 0
    gen = _run(
        "generate", "--model", model_dir, "--artifact", art, "--prompt", "The", "--max-new-tokens", 3
    )  # fmt: skip
    assert gen.exit_code == 0, gen.stderr
    assert "applied the artifact's model transforms: smooth" in gen.stderr
    other = _run(
        "calibrate", "smoothattention", "--model", model_dir, "--dataset", data,
        "--samples", 2, "--seqlen", 24, "--layout", "int8", "--out", tmp_path / "B",
    )  # fmt: skip
    assert other.exit_code == 0, other.stderr
    assert (
        json.loads((tmp_path / "B" / "manifest.json").read_text())["policy"]["_data"]["name"]
        == "int8"
    )


def test_refusals_are_one_line_and_write_nothing(tiny_model_dir, data, tmp_path):
    args = ["--dataset", data, "--samples", 2, "--seqlen", 24]
    for flag, value in (("--alpha", 1.5), ("--beta", -0.5)):
        result = _run("calibrate", "smoothattention", *args, flag, value, "--out", tmp_path / "x")
        _one_line_error(result, flag, "[0, 1]")
        assert "load model" not in result.stderr  # refused before any heavy work
    # Gemma 3 with two KV heads: one q/k norm weight shared by both cannot take per-head scales
    two_heads = tmp_path / "gemma-2kv"
    make_tiny_model("gemma3", num_key_value_heads=2).save_pretrained(two_heads)
    tiny_tokenizer().save_pretrained(two_heads)
    result = _run(
        "calibrate", "smoothattention", "--model", two_heads, *args, "--out", tmp_path / "y"
    )
    _one_line_error(result, "2 KV heads", "cannot be folded")
    # a base artifact made for another model
    _smooth(tiny_model_dir("llama"), data, tmp_path / "L")
    result = _run(
        "calibrate", "channel-scales", "--model", tiny_model_dir("qwen2"), *args,
        "--base", tmp_path / "L", "--out", tmp_path / "z",
    )  # fmt: skip
    _one_line_error(result, "incompatible artifact")
    assert not any((tmp_path / n).exists() for n in ("x", "y", "z"))


@pytest.mark.parametrize(
    "change, needle",
    [
        (lambda t: -t, "finite positive normal"),
        (lambda t: torch.full_like(t, math.inf), "finite positive normal"),
        (lambda t: t * torch.linspace(1, 2, t.shape[-1]), "equal within each RoPE pair"),
        (lambda t: t[:, :8].contiguous(), "shape"),
        (lambda t: t.half(), "dtype"),
    ],
)
def test_tampered_lambdas_are_refused(tiny_model_dir, data, tmp_path, change, needle):
    art = tmp_path / "A"
    _smooth(tiny_model_dir("llama"), data, art)
    name = "layers.1.smooth.lambda"
    rehash(art, name, change(safetensors.torch.load_file(art / "tensors.safetensors")[name]))
    _one_line_error(_run("inspect", art), "incompatible artifact", name, needle)
