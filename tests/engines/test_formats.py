"""Serving engines' K/V formats: bit-exact with the engines' own quantizers where one is
installable here, runnable as `--policy ENGINE:FORMAT`, refused in one line otherwise."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import kvq
from kvq.cli.app import app
from kvq.engines.formats import ENGINES, engine_policy, menu, parse, policy_by_name
from kvq.errors import KvqError
from kvq.quant import ggml_blocks
from kvq.runtime.codecs import make_codec
from tests.engines.helpers import generate_through

runner = CliRunner()


def _rows(seed=0, n=2048, d=256) -> torch.Tensor:
    """Rows with the cases a quantizer gets wrong: zeros, ties, a lone outlier, halves."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g) * torch.rand(n, 1, generator=g) * 4
    x[0, :32] = 0.0
    x[1, :32] = 5.0  # every element the block maximum
    x[2, :32] = torch.linspace(-3, 3, 32)
    x[2, 7] = -9.0  # the largest magnitude negative: q4_0's d changes sign
    x[3, :32] = (torch.arange(32) - 16) * 0.5  # exact halves after scaling
    x[4, 32:64] = torch.tensor([5.0, -5.0] * 16)  # equal magnitudes, opposite signs
    return x


def _ggml_bytes(codes, d, m, name) -> np.ndarray:
    """kvq's (codes, d, m) laid out as ggml's blocks ([N, bytes]), to compare with gguf."""
    fmt = ggml_blocks.block_format(name)
    q = codes.reshape(-1, 32).to(torch.int32) - (fmt.zero if name == "q8_0" else 0)
    parts = [d.reshape(-1, 1).numpy().view(np.uint8)]
    if m is not None:
        parts.append(m.reshape(-1, 1).numpy().view(np.uint8))
    q = q.numpy()
    if name == "q8_0":
        parts.append(q.astype(np.int8).view(np.uint8))
    else:
        if fmt.bits == 5:
            high = np.packbits((q >> 4).astype(np.uint8), axis=-1, bitorder="little")
            parts.append(high.reshape(-1, 4))
        low = (q & 0x0F).astype(np.uint8)
        parts.append(low[:, :16] | (low[:, 16:] << 4))
    return np.concatenate(parts, axis=-1)


# gguf has no iq4_nl quantizer: test_iq4_nl.py compares with a transcription instead
@pytest.mark.parametrize("name", [n for n in ggml_blocks.FORMATS if n != "iq4_nl"])
def test_llamacpp_blocks_are_bit_exact_with_the_gguf_quantizer(name):
    gguf = pytest.importorskip("gguf")
    qtype = getattr(gguf.GGMLQuantizationType, name.upper())
    x = _rows()
    reference = gguf.quants.quantize(x.numpy(), qtype)  # [rows, bytes per row]
    codes, d, m = ggml_blocks.quantize(x, name)
    mine = _ggml_bytes(codes, d, m, name).reshape(reference.shape)
    assert np.array_equal(mine, reference), int((mine != reference).sum())
    decoded = ggml_blocks.dequantize(codes, d, m, name).numpy()
    assert np.array_equal(decoded, gguf.quants.dequantize(reference, qtype).reshape(x.shape))


@pytest.mark.parametrize("name", list(ggml_blocks.FORMATS))
def test_the_cache_codec_stores_and_decodes_the_same_codes(name):
    """The runtime codec of `--policy llamacpp:NAME`: its decoded rows are ggml's."""
    scheme = engine_policy(f"llamacpp:{name}", 1, 64).layers[0].key
    codec = make_codec(scheme, 64, torch.float32, {}, "layers.0.key")
    x = _rows(1, n=96, d=64).reshape(2, 3, 16, 64)  # [B, H, T, D]
    rows, flat = codec.encode(x)
    codes, d, m = ggml_blocks.quantize(x, name)
    assert torch.equal(codec.decode(rows, flat), ggml_blocks.dequantize(codes, d, m, name))


def test_fp8_formats_match_compressed_tensors_quantize():
    ct = pytest.importorskip("compressed_tensors.quantization")
    from compressed_tensors.quantization.lifecycle.forward import quantize

    from kvq.quant.fp8 import fp8_encode

    x = _rows(2, n=512, d=128) * 100  # past e4m3's 448: saturation
    for fmt in ("e4m3",):
        args = ct.QuantizationArgs(num_bits=8, type="float", strategy="tensor", symmetric=True)
        for scale in (1.0, 0.37):
            s = torch.tensor([scale])
            ref = quantize(x, s, torch.zeros(1), args, dtype=torch.float8_e4m3fn)
            mine = fp8_encode(x, s, fmt)
            assert torch.equal(mine.view(torch.uint8), ref.view(torch.uint8))


def test_vllm_per_token_head_numerics():
    """vLLM's kernel: scale = max(absmax / QMAX, 1e-6), codes = row * (1 / scale) clamped,
    int8 truncated toward zero (kvq's own int8 rounds), fp8 rounded to nearest even."""
    from kvq.quant import token_head

    row = torch.tensor([[1.0, -0.5, 0.3, 0.0], [0.0, 0.0, 0.0, 0.0]])
    codes, scale = token_head.quantize(row, "int8")
    assert scale.dtype == torch.float32 and scale[1].item() == pytest.approx(1e-6)
    assert codes.tolist() == [[127, -63, 38, 0], [0, 0, 0, 0]]  # -63.5 -> -63, 38.1 -> 38
    # an independent float32 transcription of the kernel (numpy), on rows of every kind
    x = _rows(3, n=1024, d=128).reshape(4, 2, 128, 128)
    xs = x.numpy()
    for fmt, dtype in (("int8", torch.int8), ("fp8_e4m3", torch.float8_e4m3fn)):
        qmin, qmax = token_head.RANGES[fmt]
        ref_scale = np.maximum(np.abs(xs).max(-1, keepdims=True) / np.float32(qmax),
                               np.float32(1e-6)).astype(np.float32)  # fmt: skip
        y = np.clip(xs * (np.float32(1.0) / ref_scale), qmin, qmax).astype(np.float32)
        codes, scale = token_head.quantize(x, fmt)
        assert codes.dtype == dtype and np.array_equal(scale.numpy(), ref_scale)
        if fmt == "int8":
            assert np.array_equal(codes.numpy(), np.trunc(y).astype(np.int8))
        else:  # the cast rounds: compare with torch's RNE cast of the same float32 values
            assert torch.equal(codes.view(torch.uint8),
                               torch.from_numpy(y).to(dtype).view(torch.uint8))  # fmt: skip
    decoded = token_head.dequantize(*token_head.quantize(x, "int8"))
    assert bool((decoded.abs() <= x.abs()).all())  # truncation never grows a value


@pytest.mark.parametrize("name", ["vllm:int8_per_token_head", "vllm:fp8_per_token_head"])
def test_vllm_per_token_head_runs_through_generate(tiny_model_dir, name):
    model, cache = generate_through(tiny_model_dir("gemma3"), name)
    # stored: 8-bit codes and a float32 scale per (token, head): 8 + 32 / head_dim bits
    ledger, head_dim = cache.nbytes(), model.config.head_dim
    assert ledger.qparams == ledger.codes * 4 // head_dim
    assert ledger.total / ledger.fp16_bytes == pytest.approx((8 + 32 / head_dim) / 16)


@pytest.mark.parametrize("name", ["vllm:int8_per_token_head", "vllm:fp8_per_token_head"])
def test_vllm_per_token_head_rows_decode_alike_on_triton(name):
    """The Triton decode reads these rows with the shared affine / lookup kernels. (Whole
    generations are not compared across backends: truncation makes int8 codes flip on
    float noise, the row maximum's x / scale sitting within an ulp of 127.)"""
    from kvq.runtime.kernels.decode.attention import decode_attention
    from kvq.runtime.kernels.decode.segments import Segment

    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(2, 2, 40, 64, generator=g) for _ in range(2))  # [B, H_kv, T, D]
    q = torch.randn(2, 4, 3, 64, generator=g)  # [B, H_q, Q, D]
    codec = make_codec(engine_policy(name, 1, 64).layers[0].key, 64, torch.float32, {}, "k")
    seg = Segment(*(codec.packed(*codec.encode(x)) for x in (k, v)))
    ref, tri = (
        decode_attention(q, [seg], scaling=0.125, backend=b) for b in ("reference", "triton")
    )
    torch.testing.assert_close(tri, ref, rtol=1e-5, atol=1e-5)


def test_engine_names_parse_and_refuse_in_one_line():
    assert parse("llamacpp:q8_0/q4_0").name == "llamacpp:q8_0/q4_0"
    assert parse("vllm:fp8").flags() == "--kv-cache-dtype fp8"
    assert parse("vllm:fp8").key == parse("vllm:fp8_e4m3").key
    assert parse("llamacpp:q8_0/q4_0").flags() == "-ctk q8_0 -ctv q4_0 -fa on"
    assert {f.name for f in menu("vllm")} == {
        "vllm:auto",
        "vllm:fp8_e4m3",
        "vllm:fp8_e5m2",
        "vllm:nvfp4",
        "vllm:int8_per_token_head",
        "vllm:fp8_per_token_head",
        "vllm:int4_per_token_head",
        "vllm:turboquant_k8v4",
        "vllm:turboquant_4bit_nc",
        "vllm:turboquant_k3v4_nc",
        "vllm:turboquant_3bit_nc",
    }
    assert len(menu("all")) == sum(len(menu(e)) for e in ENGINES)
    for bad, why in [
        ("vllm:q4_0", "vllm has no K/V cache format 'q4_0'"),
        ("tgi:fp8", "unknown engine 'tgi'"),
        ("vllm:fp8_e4m3/fp8_e5m2", "vllm takes one K/V cache format"),
    ]:
        with pytest.raises(KvqError, match=why) as e:
            policy_by_name(bad, 2, 64)
        assert "\n" not in str(e.value)
    with pytest.raises(KvqError, match="llama.cpp refuses this K/V cache type"):
        policy_by_name("llamacpp:q4_0", 2, 48)
    with pytest.raises(KvqError, match="blocks of 16 channels do not divide head_dim 40"):
        policy_by_name("sglang:fp4_e2m1", 2, 40)


def test_an_engine_format_runs_through_generate_and_run_eval(tiny_model_dir, shared_data, tmp_path):
    model_dir = tiny_model_dir("gemma3")  # head_dim 32: one llama.cpp block per head
    model, _ = kvq.load_model(str(model_dir))
    ids = torch.randint(3, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    cache = kvq.make_cache(model, policy="llamacpp:q8_0/q4_0")
    out = model.generate(ids, cache=cache, **kw)
    assert out.shape == (2, 32)
    assert torch.equal(model.generate(ids, cache=kvq.make_cache(model, policy="llamacpp:f16"),
                                      **kw), model.generate(ids, **kw))  # fmt: skip
    report = tmp_path / "r.json"
    result = runner.invoke(app, [
        "run-eval", "--model", str(model_dir), "--policy", "llamacpp:q4_0", "--windows", "2",
        "--seqlen", "48", "--data-dir", str(shared_data), "--json", str(report),
    ])  # fmt: skip
    assert result.exit_code == 0, result.output + result.stderr
    r = json.loads(report.read_text())
    assert r["policy"] == "llamacpp:q4_0" and r["tasks"]["kld"]["mean"] > 0


def test_advise_sweeps_an_engine_and_recommends(tiny_model_dir, shared_data, data, tmp_path):
    model_dir = tiny_model_dir("gemma3")
    out, plot = tmp_path / "advise.json", tmp_path / "advise.png"
    result = runner.invoke(app, [
        "advise", "--model", str(model_dir), "--engine", "all", "--windows", "2", "--seqlen",
        "48", "--data-dir", str(shared_data), "--calibration", data, "--samples", "2",
        "--max-kld", "1.0", "--max-ppl-ratio", "2.0", "--json", str(out), "--plot", str(plot),
    ])  # fmt: skip
    assert result.exit_code == 0, result.output + result.stderr
    report = json.loads(out.read_text())
    names = {r["name"] for r in report["rows"]}
    assert {"llamacpp:q4_0", "llamacpp:q8_0/q4_0", "vllm:fp8_e4m3",
            "vllm:fp8_e4m3 + kvq scales", "kvq int4", "trtllm:int8 + kvq scales"} <= names  # fmt: skip
    engine = [r for r in report["rows"] if r["kind"] != "kvq" and r["within_budget"]]
    best = min(engine, key=lambda r: (r["bytes_per_token"], r["kld"]))  # iq4_nl = q4_0 bytes
    assert report["recommendation"] == best["name"]
    q4 = next(r for r in report["rows"] if r["name"] == "llamacpp:q4_0")
    assert q4["ratio_to_fp16"] == pytest.approx(4.5 / 16)
    # the tiny model's 4 layers are all TurboQuant boundary layers: 16-bit, as vLLM keeps them
    tq = next(r for r in report["rows"] if r["name"] == "vllm:turboquant_4bit_nc")
    assert tq["ratio_to_fp16"] == pytest.approx(1.0)
    assert "verdict:" in result.output and plot.stat().st_size > 0


def test_advise_flags_name_export_targets_that_exist():
    import re

    from kvq.engines.advise import candidates
    from kvq.exporters.engines import ENGINES as EXPORT_TARGETS

    named = [
        t for c, _ in candidates("all", True) for t in re.findall(r"kvq export (\w+)", c.flags)
    ]
    assert named and set(named) <= set(EXPORT_TARGETS)  # no `kvq export trtllm`


def test_advise_refuses_an_unknown_engine_in_one_line():
    result = runner.invoke(app, ["advise", "--engine", "tgi"])
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines()[-1].startswith("kvq: error: unknown engine 'tgi'")


# --- NVFP4 ----------------------------------------------------------------------------------


@pytest.mark.parametrize("calibrated", [True, False])
def test_nvfp4_is_bit_exact_with_compressed_tensors(calibrated):
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    from kvq.quant import nvfp4

    x = _rows(3, n=1024, d=128)
    x[5, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2)  # E2M1 ties
    args = QuantizationArgs(num_bits=4, type="float", strategy="tensor_group", group_size=16,
                            symmetric=True, scale_dtype=torch.float8_e4m3fn)  # fmt: skip
    amax = x.abs().max().reshape(1)
    g = generate_gparam(-amax, amax).reshape(1) if calibrated else torch.ones(1)
    assert torch.equal(nvfp4.global_scale(amax), g) or not calibrated
    blocks = x.reshape(1024, 8, 16)
    scale, zp = calculate_qparams(blocks.amin(-1), blocks.amax(-1), args, global_scale=g)
    ref = quantize(x, scale, zp, args, global_scale=g)  # E2M1 values
    codes, s = nvfp4.quantize(x, g.reshape(()))
    assert torch.equal(s.float(), scale.float())  # every block scale, bit for bit
    assert torch.equal(torch.tensor(nvfp4.LEVELS)[codes.long()], ref)
    want = dequantize(ref, scale, zp, args, global_scale=g)
    assert torch.equal(nvfp4.dequantize(codes, s, g.reshape(())), want)


def test_nvfp4_calibrated_runs_and_exports_to_vllm_and_modelopt(tiny_model_dir, data, tmp_path):
    from compressed_tensors.quantization import QuantizationArgs

    model_dir, art = tiny_model_dir("gemma3"), tmp_path / "ART"
    result = runner.invoke(app, [
        "calibrate", "kv-scales", "--model", str(model_dir), "--format", "nvfp4",
        "--dataset", data, "--samples", "2", "--seqlen", "32", "--out", str(art),
    ])  # fmt: skip
    assert result.exit_code == 0, result.output + result.stderr
    model, _ = kvq.load_model(str(model_dir))
    cache = kvq.make_cache(model, artifact=art)
    ids = torch.randint(3, 300, (1, 20), generator=torch.Generator().manual_seed(0))
    model.generate(ids, cache=cache, max_new_tokens=4, do_sample=False, pad_token_id=0)
    g = kvq.load_artifact(art).tensors["layers.0.key.global_scale"]
    assert g.shape == (1,) and float(g) > 0
    for engine in ("vllm", "modelopt"):
        out = tmp_path / engine
        result = runner.invoke(app, ["export", engine, str(art), "--out", str(out)])
        assert result.exit_code == 0, result.output + result.stderr
    config = json.loads((tmp_path / "vllm" / "config.json").read_text())
    scheme = config["quantization_config"]["kv_cache_scheme"]
    assert QuantizationArgs(**scheme).num_bits == 4 and scheme["group_size"] == 16
    quant = json.loads((tmp_path / "modelopt" / "hf_quant_config.json").read_text())
    assert quant["quantization"]["kv_cache_quant_algo"] == "NVFP4"


def test_nvfp4_scales_are_per_tensor_absmax_only(tiny_model_dir, data, tmp_path):
    result = runner.invoke(app, [
        "calibrate", "kv-scales", "--model", str(tiny_model_dir("gemma3")), "--format",
        "nvfp4", "--granularity", "head", "--dataset", data, "--out", str(tmp_path / "A"),
    ])  # fmt: skip
    assert result.exit_code == 2
    assert "--granularity tensor --method absmax" in result.stderr.strip().splitlines()[-1]


# --- SGLang fp4_e2m1 ------------------------------------------------------------------------


def test_sglang_fp4_numerics():
    """SGLang's block-16 FP4: exponent ceil(log2(amax / 6)), codes by reaching E2M1's
    midpoints (ties round up, unlike NVFP4's ties to even), a sign bit for x < 0."""
    from kvq.quant import mxfp4

    block = torch.tensor([3.0, -0.125, 0.375, 0.625, 0.3125, -0.05] + [0.0] * 10)
    codes, e = mxfp4.quantize(torch.cat([block, torch.zeros(16)]))
    assert e.tolist() == [126, 127 - 33]  # 2^-1; a zero block: ceil(log2(1e-10)) = -33
    # y = x * 2: 6 -> 6 (7), -0.25 -> -0.5 (tie up: 8 | 1), 0.75 -> 1 (2), 1.25 -> 1.5
    # (tie up: 3), 0.625 -> 0.5 (1), -0.1 -> -0 (8)
    assert codes[:6].tolist() == [7, 9, 2, 3, 1, 8] and codes[16:].eq(0).all()
    assert mxfp4.dequantize(codes, e)[:6].tolist() == [3.0, -0.25, 0.5, 0.75, 0.25, -0.0]
    # an independent float32 transcription (numpy) on rows of every kind
    x = _rows(4, n=512, d=128)
    blocks = x.numpy().reshape(512, 8, 16)
    amax = np.abs(blocks).max(-1, keepdims=True)
    ref_e = np.ceil(np.log2(np.maximum(amax / np.float32(6.0), np.float32(1e-10))))
    y = blocks / np.exp2(ref_e)
    mag = sum((np.abs(y) >= b).astype(np.uint8) for b in (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5))
    ref_codes = (mag | ((y < 0).astype(np.uint8) << 3)).reshape(512, 128)
    codes, e = mxfp4.quantize(x)
    assert np.array_equal(codes.numpy(), ref_codes)
    assert np.array_equal(e.numpy(), (ref_e[..., 0] + 127).astype(np.uint8))


def test_sglang_fp4_runs_through_generate_and_stores_4_5_bits(tiny_model_dir):
    _, cache = generate_through(tiny_model_dir("gemma3"), "sglang:fp4_e2m1")
    ledger = cache.nbytes()  # 4-bit codes and one exponent byte per 16 channels
    assert ledger.total / ledger.fp16_bytes == pytest.approx(4.5 / 16)
    codec = make_codec(engine_policy("sglang:fp4_e2m1", 1, 64).layers[0].key, 64,
                       torch.float32, {}, "layers.0.key")  # fmt: skip
    x = _rows(5, n=64, d=64).reshape(2, 2, 16, 64)
    from kvq.quant import mxfp4

    assert torch.equal(codec.decode(*codec.encode(x)), mxfp4.dequantize(*mxfp4.quantize(x)))


def test_advise_prints_a_lossless_rows_rounding_level_kld_as_zero(capsys):
    from kvq.cli.render import print_advise

    row = {"name": "llamacpp:f16", "kind": "engine", "ppl_ratio": 1.0, "kld": -3e-9,
           "top1": 1.0, "bytes_per_token": 4989.0, "ratio_to_fp16": 1.0, "within_budget": True}  # fmt: skip
    print_advise({
        "engine": "llamacpp", "model": "m", "windows": 2, "seqlen": 4096, "dataset": "wikitext2",
        "budget": {"max_kld": 0.02, "max_ppl_ratio": 1.02}, "rows": [row],
        "recommendation": "llamacpp:f16", "recommended_flags": "-ctk f16",
    })  # fmt: skip
    out = capsys.readouterr().out
    assert "0.00000" in out and "-0.00000" not in out
