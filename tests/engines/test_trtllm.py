"""TensorRT-LLM's INT8 K/V cache (`trtllm:int8`): its numerics against an independent
float32 transcription, one scale per layer for K and V, calibrated-only, served by the
shared decoders on both backends."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvq.engines.advise import candidates
from kvq.engines.formats import engine_policy, parse, policy_by_name
from kvq.errors import KvqError
from kvq.quant import trtllm_int8
from kvq.runtime.codecs import make_codec


def _transcribed(x: np.ndarray, scale: np.float32) -> np.ndarray:
    """cvt.rni.sat.s8.f32(x * (1 / scale)), written from the PTX semantics in numpy."""
    reciprocal = np.float32(1.0) / np.float32(scale)
    y = x.astype(np.float32) * reciprocal  # float32 multiply
    return np.clip(np.rint(y), -128, 127).astype(np.int8)  # rint: ties to even


def test_trtllm_int8_matches_the_transcription_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 128, generator=g) * 3
    scale = torch.tensor([0.05])
    x[0, :6] = torch.tensor([0.025, 0.075, -0.025, -0.125, 0.0, 6.35])  # ties: 0.5, 1.5 ...
    x[1, :3] = torch.tensor([-9.0, 9.0, -6.4])  # beyond the range: -128, 127, -128
    codes = trtllm_int8.quantize(x, scale)
    expected = _transcribed(x.numpy(), np.float32(scale.item()))
    assert np.array_equal(codes.numpy(), expected)  # 65,536 values, max difference 0
    assert codes[1, :3].tolist() == [-128, 127, -128]  # -128 is a code, unlike kvq's int8
    assert torch.equal(trtllm_int8.dequantize(codes, scale), codes.float() * 0.05)


def test_one_scale_per_layer_the_larger_of_k_and_v():
    tensors = {
        "layers.0.key.scale": torch.tensor([0.5]),
        "layers.0.value.scale": torch.tensor([0.25]),
        "layers.1.key.scale": torch.tensor([0.1]),
        "layers.1.value.scale": torch.tensor([0.3]),
    }
    loaded = parse("trtllm:int8").loaded_scales(tensors)
    assert [loaded[f"layers.{i}.{s}.scale"].item() for i in (0, 1) for s in ("key", "value")] == [
        0.5, 0.5, pytest.approx(0.3), pytest.approx(0.3)
    ]  # fmt: skip
    assert parse("trtllm:fp8").loaded_scales(tensors) is tensors  # FP8: as calibrated


def test_trtllm_int8_is_calibrated_only():
    with pytest.raises(KvqError, match="no default scale") as e:
        policy_by_name("trtllm:int8", 2, 64)
    assert "\n" not in str(e.value)
    names = [c.name for c, _ in candidates("trtllm", calibrated=False)]
    assert "trtllm:int8" not in names and "trtllm:fp8" in names
    names = [c.name for c, _ in candidates("trtllm", calibrated=True)]
    assert "trtllm:int8 + kvq scales" in names and "trtllm:int8" not in names
    assert parse("trtllm:int8").flags().startswith("kv_cache_quant_algo INT8")


def test_trtllm_int8_rows_decode_alike_on_both_backends():
    from kvq.runtime.kernels.decode.attention import decode_attention
    from kvq.runtime.kernels.decode.segments import Segment

    scheme = engine_policy("trtllm:int8", 1, 64, calibrated=True).layers[0].key
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(2, 2, 40, 64, generator=g) for _ in range(2))  # [B, H_kv, T, D]
    q = torch.randn(2, 4, 3, 64, generator=g)  # [B, H_q, Q, D]
    scale = torch.tensor([0.03])
    codec = make_codec(scheme, 64, torch.float32, {"scale": scale}, "layers.0.key")
    rows, flat = codec.encode(k)
    decoded = codec.packed(rows, flat)
    assert torch.equal(  # what the cache reads back is the engine's code * scale
        (rows["codes"].to(torch.int16) - 128).float() * 0.03,
        trtllm_int8.dequantize(trtllm_int8.quantize(k, scale), scale),
    )
    seg = Segment(decoded, codec.packed(*codec.encode(v)))
    ref, tri = (
        decode_attention(q, [seg], scaling=0.125, backend=b) for b in ("reference", "triton")
    )
    torch.testing.assert_close(tri, ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(KvqError, match="needs a calibrated scale"):
        make_codec(scheme, 64, torch.float32, {}, "layers.0.key")


def test_run_eval_serves_trtllm_int8_with_an_artifacts_scales(tiny_model_dir, data, tmp_path):
    """The public path: `kvq calibrate kv-scales --format int8`, then `run-eval --policy
    trtllm:int8 --artifact ART` (and `kvq.make_cache` alike) store TensorRT-LLM's codes with
    one scale per layer; a mismatched artifact or a kvq layout beside --artifact is refused
    in one line."""
    import json

    from typer.testing import CliRunner

    import kvq
    from kvq.cli.app import app
    from kvq.runtime.codecs.trtllm import TrtllmInt8Codec

    runner = CliRunner()
    model_dir = str(tiny_model_dir("gemma3"))
    common = ["--model", model_dir, "--dataset", data, "--samples", "2", "--seqlen", "48"]
    art = tmp_path / "int8"
    result = runner.invoke(
        app, ["calibrate", "kv-scales", "--format", "int8", "--out", str(art), *common]
    )
    assert result.exit_code == 0, result.output + result.stderr
    report = tmp_path / "r.json"
    result = runner.invoke(app, [
        "run-eval", "--model", model_dir, "--artifact", str(art), "--policy", "trtllm:int8",
        "--dataset", data, "--windows", "2", "--seqlen", "48", "--json", str(report),
    ])  # fmt: skip
    assert result.exit_code == 0, result.output + result.stderr
    assert json.loads(report.read_text())["tasks"]["kld"]["mean"] > 0

    model, _ = kvq.load_model(model_dir)
    cache = kvq.make_cache(model, artifact=str(art), policy="trtllm:int8")
    codecs = [layer.key_codec for layer in cache.layers] + [
        layer.value_codec for layer in cache.layers
    ]
    assert all(isinstance(c, TrtllmInt8Codec) for c in codecs)
    for layer in cache.layers:  # K and V of a layer share the larger scale
        assert torch.equal(layer.key_codec.static["scale"], layer.value_codec.static["scale"])

    for policy, why in [("int8", "give exactly one of --artifact or --policy"),
                        ("vllm:nvfp4", "loads per-tensor nvfp4 scales")]:  # fmt: skip
        result = runner.invoke(app, [
            "run-eval", "--model", model_dir, "--artifact", str(art), "--policy", policy,
            "--dataset", data, "--windows", "2", "--seqlen", "48",
        ])  # fmt: skip
        last = result.stderr.strip().splitlines()[-1]  # after progress lines, one error line
        assert result.exit_code == 2 and last.startswith("kvq: error:") and why in last, last
