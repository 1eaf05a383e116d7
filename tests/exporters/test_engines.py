"""`kvq export vllm|modelopt`: serving checkpoints validated by compressed-tensors' own
config model and round-tripped through transformers on CPU; refusals write nothing."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvq.artifacts.paths import EXPORT_MARKER
from kvq.artifacts.store import Artifact, read_artifact, write_artifact
from kvq.calibrators.options import (
    ChannelScalesOptions,
    KVQuantOptions,
    KVScalesOptions,
    PrefixQuantOptions,
)
from kvq.exporters.checkpoint import read_checkpoint_tensors
from kvq.models.loading import load_model
from kvq.quant.schemes import CachePolicy, LayerPolicy, QuantScheme
from tests.cli.test_cli import _one_line_error, _run
from tests.conftest import calibrate

compressed_tensors = pytest.importorskip("compressed_tensors")


@pytest.fixture(scope="module")
def llama(tiny_model_dir):
    return tiny_model_dir("llama")


def _calibrate(model_dir, data, out, options, base=None):
    calibrate(model_dir, data, out, options, base)
    return out  # the folder: exports and later passes take it


@pytest.fixture(scope="module")
def arts(llama, data, tmp_path_factory):
    root = tmp_path_factory.mktemp("arts")
    return {
        g: _calibrate(llama, data, root / g, KVScalesOptions("fp8-e4m3", g))
        for g in ("tensor", "head")
    }


def _logits(model, seed=0):
    ids = torch.randint(3, 200, (2, 12), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("granularity", ["tensor", "head"])
def test_vllm_export_is_a_valid_compressed_tensors_checkpoint(granularity, arts, llama, tmp_path):
    from compressed_tensors.quantization import QuantizationConfig

    out = tmp_path / "ckpt"
    result = _run("export", "vllm", arts[granularity], "--model", llama, "--out", out)
    assert result.exit_code == 0, result.stderr
    config = json.loads((out / "config.json").read_text())
    qc = QuantizationConfig.model_validate(config["quantization_config"])  # its own model
    kv = qc.kv_cache_scheme
    assert (kv.num_bits, kv.type, kv.dynamic, kv.symmetric) == (8, "float", False, True)
    assert kv.strategy == {"tensor": "tensor", "head": "attn_head"}[granularity]
    assert qc.quant_method == "compressed-tensors"

    artifact = read_artifact(arts[granularity])
    heads = artifact.manifest.architecture.num_kv_heads
    stored = read_checkpoint_tensors(out)
    for i in range(artifact.manifest.architecture.num_layers):
        for part, short in (("key", "k"), ("value", "v")):
            t = stored[f"model.layers.{i}.self_attn.{short}_scale"]
            assert t.dtype == torch.float32
            assert t.shape == ((1,) if granularity == "tensor" else (heads,))
            assert torch.equal(t, artifact.tensors[f"layers.{i}.{part}.scale"])

    # transformers loads it on CPU (the scales are extra tensors to it): same weights, logits
    source = load_model(str(llama)).model
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    for name, p in source.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], p), name
    assert torch.equal(_logits(loaded), _logits(source))
    marker = json.loads((out / EXPORT_MARKER).read_text())
    assert marker["kv_cache"]["format"] == "fp8-e4m3"
    assert marker["artifact"]["passes"][0]["method"] == "kv-scales"
    assert (out / "tokenizer_config.json").is_file()


def test_modelopt_export_has_hf_quant_config_and_scalar_scales(arts, llama, tmp_path):
    out = tmp_path / "mo"
    result = _run("export", "modelopt", arts["tensor"], "--model", llama, "--out", out)
    assert result.exit_code == 0, result.stderr
    hf = json.loads((out / "hf_quant_config.json").read_text())
    assert hf["quantization"]["kv_cache_quant_algo"] == "FP8"
    assert hf["quantization"]["quant_algo"] is None
    artifact = read_artifact(arts["tensor"])
    stored = read_checkpoint_tensors(out)
    for i in range(artifact.manifest.architecture.num_layers):
        k = stored[f"model.layers.{i}.self_attn.k_proj.k_scale"]
        v = stored[f"model.layers.{i}.self_attn.v_proj.v_scale"]
        assert k.shape == () and v.shape == () and k.dtype == torch.float32
        assert float(k) == float(artifact.tensors[f"layers.{i}.key.scale"])
        assert float(v) == float(artifact.tensors[f"layers.{i}.value.scale"])
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert torch.equal(_logits(loaded, 1), _logits(load_model(str(llama)).model, 1))
    # a per-head artifact: ModelOpt has one scale per layer
    refused = _run("export", "modelopt", arts["head"], "--model", llama, "--out", tmp_path / "x")
    _one_line_error(refused, "policy.layers[0].key.axis", "head", "static per-tensor")
    assert not (tmp_path / "x").exists()


def test_int8_exports_as_int_and_overwrite_replaces_only_an_export(llama, data, tmp_path):
    art = _calibrate(llama, data, tmp_path / "int8", KVScalesOptions("int8", "head"))
    out = tmp_path / "ckpt"
    assert _run("export", "vllm", art, "--model", llama, "--out", out).exit_code == 0
    kv = json.loads((out / "config.json").read_text())["quantization_config"]["kv_cache_scheme"]
    assert kv["type"] == "int"
    # readable by whoever reads config.json (safetensors alone would write 0600)
    mode = (out / "config.json").stat().st_mode
    assert (out / "model.safetensors").stat().st_mode == mode
    again = _run("export", "vllm", art, "--model", llama, "--out", out)
    _one_line_error(again, "exists", "--overwrite")
    assert _run("export", "vllm", art, "--model", llama, "--out", out, "--overwrite").exit_code == 0
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("keep me")
    refused = _run("export", "vllm", art, "--model", llama, "--out", folder, "--overwrite")
    _one_line_error(refused, "not a kvq export")
    assert (folder / "notes.txt").read_text() == "keep me"


def _synthetic(src, out, scheme, **layer):
    """The artifact `src` with every layer's K and V stored as `scheme` (no static state)."""
    art = read_artifact(src)
    n = art.manifest.policy.num_layers
    policy = CachePolicy("synthetic", (LayerPolicy(scheme, scheme, **layer),) * n)
    write_artifact(Artifact(replace(art.manifest, policy=policy), {}), out)
    return out


@pytest.mark.parametrize(
    "make, needles",
    [
        ("pre-rope", ["policy.layers[0].key_stage", "pre-rope", "keys stored after RoPE"]),
        ("int4", ["policy.layers[0].key.bits", "no INT4 cache"]),
        ("nuq", ["policy.layers[0].key.format", "nuq", "non-uniform codebook"]),
        ("sparse", ["policy.layers[0].key.outlier_fraction", "sparse exceptions"]),
        ("per-token", ["policy.layers[0].key.axis", "token (dynamic)", "static"]),
        ("e5m2", ["policy.layers[0].key.fp8_format", "fp8-e5m2", "fp8-e4m3/int8"]),
        ("skip", ["policy.layers[", "16-bit", "no skipped layers"]),
        ("sink", ["policy.layers[0].sink_tokens", "every row quantized alike"]),
        ("prefix", ["policy.prefix", "1 tokens", "no declared prefix state"]),
    ],
)
def test_what_the_target_cannot_represent_is_refused(
    make, needles, arts, llama, data, tiny_model_dir, tmp_path
):
    model, art = llama, tmp_path / "art"
    if make == "pre-rope":
        _calibrate(llama, data, art, ChannelScalesOptions(bits=8, value_group=8))
    elif make == "int4":
        opts = ChannelScalesOptions(bits=4, key_stage="post-rope", sink=0, value_group=8)
        _calibrate(llama, data, art, opts)
    elif make in ("nuq", "sparse"):
        opts = KVQuantOptions(
            bits=4, fisher=False, key_stage="post-rope", sink=0,
            outliers=0.01 if make == "sparse" else 0.0,
        )  # fmt: skip
        _calibrate(llama, data, art, opts)
    elif make == "per-token":
        scheme = QuantScheme("int", 8, axis="token", symmetric=True)
        _synthetic(arts["tensor"], art, scheme)
    elif make == "e5m2":
        _calibrate(llama, data, art, KVScalesOptions("fp8-e5m2"))
    elif make == "skip":
        model = tiny_model_dir("gemma3")
        _calibrate(model, data, art, KVScalesOptions(skip_layers="sliding"))
    else:  # a base's sink kept exact, or its prefix (carried along the chain)
        if make == "prefix":
            base = _calibrate(llama, data, tmp_path / "b", PrefixQuantOptions())
        else:
            opts = ChannelScalesOptions(sink=1, value_group=8)
            base = _calibrate(llama, data, tmp_path / "b", opts)
        _calibrate(llama, data, art, KVScalesOptions(), base)
    out = tmp_path / "ckpt"
    result = _run("export", "vllm", art, "--model", model, "--out", out)
    _one_line_error(result, "vLLM (compressed-tensors) cannot represent", *needles)
    assert not out.exists() and not any(p.name.startswith(".ckpt") for p in tmp_path.iterdir())


def test_bad_destinations_fail_before_any_work(arts, llama, tmp_path):
    result = _run("export", "vllm", tmp_path / "nope", "--model", llama, "--out", tmp_path / "o")
    _one_line_error(result, "no such artifact directory")
    inside = _run("export", "vllm", arts["tensor"], "--model", llama,
                  "--out", arts["tensor"] / "sub")  # fmt: skip
    _one_line_error(inside, "inside the artifact")
    over = _run("export", "vllm", arts["tensor"], "--model", llama, "--out", arts["tensor"],
                "--overwrite")  # fmt: skip
    _one_line_error(over, "not a kvq export")
    assert read_artifact(arts["tensor"]).manifest.policy.name.startswith("kv-scales")


def test_an_interrupted_export_leaves_nothing(arts, llama, tmp_path, monkeypatch):
    from kvq.exporters import checkpoint

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint, "_add_tensors", boom)
    result = _run("export", "vllm", arts["tensor"], "--model", llama, "--out", tmp_path / "c")
    assert result.exit_code == 130
    assert list(tmp_path.iterdir()) == []


def test_export_takes_the_artifacts_model_and_keeps_or_sets_the_weights_dtype(arts, tmp_path):
    """Without --model the export loads the model the manifest names (no default model
    loaded, then refused); the weights keep the source's declared dtype unless --dtype says
    otherwise; the K/V scales stay fp32 either way."""
    out = tmp_path / "ckpt"
    result = _run("export", "vllm", arts["tensor"], "--out", out)
    assert result.exit_code == 0, result.stderr
    stored = read_checkpoint_tensors(out)
    weights = {n: t for n, t in stored.items() if not n.endswith("_scale")}
    source = json.loads(
        (Path(read_artifact(arts["tensor"]).manifest.model_spec) / "config.json").read_text()
    )
    declared = source.get("dtype") or source.get("torch_dtype")
    assert {str(t.dtype) for t in weights.values()} == {f"torch.{declared}"}
    marker = json.loads((out / EXPORT_MARKER).read_text())
    assert marker["model"]["dtype"] == declared

    half = tmp_path / "bf16"
    assert (
        _run("export", "vllm", arts["tensor"], "--out", half, "--dtype", "bfloat16").exit_code == 0
    )
    stored = read_checkpoint_tensors(half)
    assert {t.dtype for n, t in stored.items() if not n.endswith("_scale")} == {torch.bfloat16}
    assert {t.dtype for n, t in stored.items() if n.endswith("_scale")} == {torch.float32}
    _one_line_error(
        _run("export", "vllm", arts["tensor"], "--out", tmp_path / "x", "--dtype", "int4"),
        "--dtype",
        "auto, bfloat16, float16 or float32",
    )
