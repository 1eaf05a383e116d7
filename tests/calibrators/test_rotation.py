"""The `rotate` pass: value rotations folded exactly, what they buy a per-token code, the
chain through the CLI, refusals."""

from __future__ import annotations

import json

import pytest
import safetensors.torch
import torch

from kvq.calibrators.options import KVQuantOptions, RotateOptions
from kvq.calibrators.rotation import random_rotation
from kvq.errors import KvqError
from kvq.models.loading import load_model
from kvq.pipeline import apply_transforms, cache_for
from tests.cli.test_cli import _one_line_error, _run
from tests.cli.test_hardening import rehash
from tests.conftest import calibrate, make_tiny_model, tiny_tokenizer

FAMILIES = ["llama", "qwen2", "gemma3"]


@pytest.mark.parametrize("d", [16, 256, 80])
def test_rotations_are_orthogonal_and_flatten_an_outlier_channel(d):
    r = random_rotation(d, torch.Generator().manual_seed(0))
    torch.testing.assert_close(r @ r.T, torch.eye(d), atol=1e-5, rtol=0)
    v = torch.randn(1000, d)
    v[:, 3] *= 30  # one channel far wider than the rest
    peak = lambda x: (x.abs().amax(-1) / x.pow(2).mean(-1).sqrt()).mean()  # noqa: E731
    assert peak(v @ r.T) < 0.5 * peak(v)


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_folded_rotation_keeps_the_logits_and_rotates_the_cached_values(
    family, tiny_model_dir, data, tmp_path
):
    """GQA (Llama), biases (Qwen2), one KV head and sliding layers (Gemma 3): logits equal
    within fp32 rounding; only v_proj and o_proj change; the cache stores R v."""
    model_dir = tiny_model_dir(family)
    art = calibrate(model_dir, data, tmp_path / "A", RotateOptions())
    assert art.manifest.policy.name == "fp16"
    loaded = load_model(str(model_dir))
    ids = torch.randint(3, 500, (2, 20), generator=torch.Generator().manual_seed(1))
    before = loaded.model(ids, use_cache=True)
    weights = {n: p.clone() for n, p in loaded.model.named_parameters()}
    apply_transforms(loaded, art.tensors)
    changed = {n for n, p in loaded.model.named_parameters() if not torch.equal(p, weights[n])}
    after = loaded.model(ids, use_cache=True)
    torch.testing.assert_close(after.logits, before.logits, atol=2e-5, rtol=1e-4)
    assert changed and all(".v_proj." in n or ".o_proj." in n for n in changed)
    assert (family == "qwen2") == any(n.endswith("bias") for n in changed)
    rot = art.tensors["layers.1.rotate.value"]  # [H_kv, D, D]
    v0, v1 = before.past_key_values.layers[1].values, after.past_key_values.layers[1].values
    torch.testing.assert_close(v1, torch.einsum("hij,bhtj->bhti", rot, v0), atol=1e-5, rtol=1e-4)


@torch.no_grad()
def test_rotation_cuts_the_error_of_a_per_token_code_on_an_outlier_channel(
    tiny_model_dir, data, tmp_path
):
    """A value channel 30x wider than the rest sets every per-token INT4 step; rotated, the
    same cache is closer to the exact model (the property the pass exists for)."""
    model = make_tiny_model("llama")
    for layer in model.model.layers:
        layer.self_attn.v_proj.weight[3::16] *= 30  # channel 3 of each KV head
        layer.self_attn.o_proj.weight[:, 3::16] /= 30  # same function
    model_dir = tmp_path / "outlier"
    model.save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    plain = calibrate(model_dir, data, tmp_path / "P", RotateOptions(layout="int4"))
    errors = []
    ids = torch.randint(3, 500, (2, 24), generator=torch.Generator().manual_seed(2))
    for rotated in (False, True):
        loaded = load_model(str(model_dir))
        exact = loaded.model(ids).logits
        if rotated:
            apply_transforms(loaded, plain.tensors)
        policy_only = {n: t for n, t in plain.tensors.items() if ".rotate." not in n}
        art = plain if rotated else type(plain)(plain.manifest, policy_only)
        cache = cache_for(loaded, artifact=art)
        quant = loaded.model(ids, cache=cache).logits
        errors.append((quant - exact).pow(2).mean().item())
    assert errors[1] < 0.5 * errors[0]


def test_a_chain_calibrates_kvquant_on_the_rotated_values(tiny_model_dir, data, tmp_path, caplog):
    model_dir = tiny_model_dir("qwen2")
    calibrate(model_dir, data, tmp_path / "R", RotateOptions())
    options = KVQuantOptions(bits=4, outliers=0.0)
    chained = calibrate(model_dir, data, tmp_path / "B", options, base=tmp_path / "R")
    assert [p.method for p in chained.manifest.passes] == ["rotate", "kvquant"]
    assert "layers.0.rotate.value" in chained.tensors
    loaded = load_model(str(model_dir))
    cache = cache_for(loaded, artifact=chained)
    assert "folded the artifact's model transforms (rotate)" in caplog.text
    with torch.no_grad():
        out = loaded.model(torch.randint(3, 200, (1, 9)), cache=cache).logits
    assert torch.isfinite(out).all()
    # a transform after a quantizing pass would leave its qparams on unrotated values
    with pytest.raises(KvqError, match="run it first in the chain"):
        calibrate(model_dir, data, tmp_path / "C", RotateOptions(), base=tmp_path / "B")


def test_cli_rotate_then_kvquant_then_run_eval(tiny_model_dir, shared_data, data, tmp_path):
    model_dir = tiny_model_dir("gemma3")
    args = ["--model", model_dir, "--dataset", data, "--samples", 2, "--seqlen", 24]
    result = _run("calibrate", "rotate", *args, "--out", tmp_path / "R")
    assert result.exit_code == 0, result.stderr
    result = _run(
        "calibrate",
        "kvquant",
        *args,
        "--bits",
        3,
        "--base",
        tmp_path / "R",
        "--out",
        tmp_path / "A",
    )
    assert result.exit_code == 0, result.stderr
    manifest = json.loads((tmp_path / "A" / "manifest.json").read_text())
    assert [p["method"] for p in manifest["passes"]] == ["rotate", "kvquant"]
    shown = _run("inspect", tmp_path / "A")
    assert shown.exit_code == 0 and "rotate (folded into the weights at load)" in shown.stdout
    report = tmp_path / "eval.json"
    result = _run(
        "run-eval", "--model", model_dir, "--artifact", tmp_path / "A", "--data-dir",
        shared_data, "--windows", 2, "--seqlen", 32, "--json", report,
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    assert "apply rotate" in result.stderr
    assert json.loads(report.read_text())["tasks"]["ppl"]["ratio"] > 0


def test_models_that_normalise_their_values_are_refused():
    from kvq.models.adapters import get_adapter

    model = make_tiny_model("llama")
    model.model.layers[1].self_attn.v_norm = torch.nn.LayerNorm(16)  # as Gemma 3n has
    with pytest.raises(KvqError, match="layer 1 normalises its values"):
        get_adapter(model).check_values_rotatable()


@pytest.mark.parametrize(
    "change, needle",
    [
        (lambda t: t * 1.01, "an orthogonal matrix"),
        (lambda t: torch.full_like(t, float("nan")), "finite values"),
        (lambda t: t[:, :8].contiguous(), "shape"),
        (lambda t: t.double(), "dtype"),
    ],
)
def test_tampered_rotations_are_refused(tiny_model_dir, data, tmp_path, change, needle):
    art = tmp_path / "A"
    calibrate(tiny_model_dir("llama"), data, art, RotateOptions())
    name = "layers.1.rotate.value"
    rehash(art, name, change(safetensors.torch.load_file(art / "tensors.safetensors")[name]))
    _one_line_error(_run("inspect", art), "incompatible artifact", name, needle)
