"""kv-scales: static FP8/INT8 K/V scales per tensor or KV head from post-RoPE K and V."""

from __future__ import annotations

import pytest
import torch

from kvq.artifacts.store import read_artifact
from kvq.calibrators.capture import capture, run_windows
from kvq.calibrators.options import KV_FORMATS, ChannelScalesOptions, KVScalesOptions
from kvq.errors import KvqError
from kvq.models.loading import load_model
from kvq.pipeline import cache_for
from kvq.quant import kv_formats
from kvq.quant.schemes import FULL_PRECISION
from tests.cli.test_cli import _one_line_error, _run
from tests.conftest import calibrate, calibration_windows


def _observed_amax(model_dir, data, sink=0):
    """Per (layer, side) [H] absmax of the post-RoPE K and V the calibration windows make."""
    loaded = load_model(str(model_dir))
    windows = calibration_windows(loaded, data)
    amax = {}

    def consume(layer, part, x):
        m = x[:, :, sink:].abs().amax(dim=(0, 2, 3))
        key = (layer, part)
        amax[key] = m if key not in amax else torch.maximum(amax[key], m)

    with capture(loaded.adapter, consume, key_stage="post-rope"):
        run_windows(loaded.model, windows)
    return amax


def test_formats_agree_with_the_options():
    assert KV_FORMATS == kv_formats.KV_FORMATS


@pytest.mark.parametrize("fmt", ["fp8-e4m3", "int8"])
@pytest.mark.parametrize("granularity", ["tensor", "head"])
def test_absmax_scales_are_the_observed_post_rope_maxima(
    fmt, granularity, tiny_model_dir, data, tmp_path
):
    model_dir = tiny_model_dir("llama")
    art = calibrate(model_dir, data, tmp_path / "A", KVScalesOptions(fmt, granularity))
    amax = _observed_amax(model_dir, data)
    heads = art.manifest.architecture.num_kv_heads
    for (layer, part), m in amax.items():
        scale = art.tensors[f"layers.{layer}.{part}.scale"]
        assert scale.dtype == torch.float32
        want = m if granularity == "head" else m.amax().reshape(1)
        assert scale.shape == ((heads,) if granularity == "head" else (1,))
        assert torch.equal(scale, kv_formats.scale_for(want, fmt))
    layer = art.manifest.policy.layers[0]
    assert layer.key_stage == "post-rope" and layer.key.axis == granularity
    assert art.manifest.policy.name == f"kv-scales-{fmt}-{granularity}"


def test_methods_clip_no_wider_than_absmax_and_mse_is_no_worse(tiny_model_dir, data, tmp_path):
    model_dir = tiny_model_dir("qwen2")
    arts = {
        m: calibrate(model_dir, data, tmp_path / m, KVScalesOptions("int8", "head", m, 99.0))
        for m in ("absmax", "percentile", "mse")
    }
    loaded = load_model(str(model_dir))
    windows = calibration_windows(loaded, data)
    rows = {}

    def consume(layer, part, x):
        rows.setdefault((layer, part), []).append(x)

    with capture(loaded.adapter, consume, key_stage="post-rope"):
        run_windows(loaded.model, windows)
    for (layer, part), xs in rows.items():
        x = torch.cat(xs)  # [N, H, T, D]
        name = f"layers.{layer}.{part}.scale"
        scales = {m: a.tensors[name] for m, a in arts.items()}
        assert bool((scales["percentile"] <= scales["absmax"]).all())
        assert bool((scales["mse"] <= scales["absmax"]).all())

        # the grid holds absmax itself (c = 1): mse is never worse on its own samples
        assert bool((_err(x, scales["mse"]) <= _err(x, scales["absmax"]) * (1 + 1e-6)).all())


def _err(x, scale):
    """[H] mean squared INT8 round-trip error of rows x [N, H, T, D] under per-head scales."""
    s = scale[None, :, None, None]
    return (kv_formats.round_trip(x, s, "int8") - x).pow(2).mean(dim=(0, 2, 3))


def test_skip_layers_keep_sliding_layers_in_16_bits(tiny_model_dir, data, tmp_path):
    model_dir = tiny_model_dir("gemma3")
    loaded = load_model(str(model_dir))
    sliding = [
        i
        for i in range(loaded.adapter.info.num_layers)
        if loaded.adapter.sliding_window(i) is not None
    ]
    assert 0 < len(sliding) < loaded.adapter.info.num_layers
    art = calibrate(model_dir, data, tmp_path / "A", KVScalesOptions(skip_layers="sliding"))
    for i, layer in enumerate(art.manifest.policy.layers):
        skipped = i in sliding
        assert (layer.key == FULL_PRECISION and layer.value == FULL_PRECISION) == skipped
        assert (f"layers.{i}.key.scale" in art.tensors) != skipped
    cache = cache_for(loaded, artifact=read_artifact(tmp_path / "A"))
    with torch.no_grad():
        loaded.model(torch.randint(3, 200, (1, 8)), cache=cache)
    ledger = cache.nbytes()
    assert ledger.full_precision > 0 and ledger.codes > 0
    listed = calibrate(model_dir, data, tmp_path / "B", KVScalesOptions(skip_layers="0,1"))
    assert listed.manifest.policy.layers[0].key == FULL_PRECISION
    with pytest.raises(KvqError, match="layer 99 does not exist"):
        calibrate(model_dir, data, tmp_path / "C", KVScalesOptions(skip_layers="0,99"))


def test_a_base_sink_is_kept_exact_and_out_of_the_statistics(tiny_model_dir, data, tmp_path):
    model_dir = tiny_model_dir("llama")
    base = calibrate(
        model_dir, data, tmp_path / "A", ChannelScalesOptions(bits=8, sink=2, value_group=8)
    )
    assert base.manifest.policy.layers[0].sink_tokens == 2
    art = calibrate(model_dir, data, tmp_path / "B", KVScalesOptions(granularity="head"),
                     base=tmp_path / "A")  # fmt: skip
    assert all(layer.sink_tokens == 2 for layer in art.manifest.policy.layers)
    assert [p.method for p in art.manifest.passes] == ["channel-scales", "kv-scales"]
    assert not any(n.endswith(".offset") for n in art.tensors)  # the base's state replaced
    amax = _observed_amax(model_dir, data, sink=2)
    for (layer, part), m in amax.items():
        want = kv_formats.scale_for(m, "fp8-e4m3")
        assert torch.equal(art.tensors[f"layers.{layer}.{part}.scale"], want)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(kv_format="int4"),
        dict(granularity="channel"),
        dict(method="minmax"),
        dict(percentile=10.0),
        dict(skip_layers="sliding,0"),
        dict(skip_layers="-1"),
    ],
)
def test_options_are_validated(kwargs):
    with pytest.raises(KvqError):
        KVScalesOptions(**kwargs)


def test_cli_kv_scales_and_its_refusals(tiny_model_dir, data, tmp_path):
    args = ["--model", tiny_model_dir("llama"), "--dataset", data, "--samples", 2]
    ok = _run("calibrate", "kv-scales", *args, "--seqlen", 24, "--format", "fp8-e5m2",
              "--granularity", "head", "--method", "mse", "--out", tmp_path / "A")  # fmt: skip
    assert ok.exit_code == 0, ok.stderr
    art = read_artifact(tmp_path / "A")
    assert art.manifest.passes[0].options["kv_format"] == "fp8-e5m2"
    assert art.manifest.passes[0].options["method"] == "mse"
    assert art.manifest.policy.layers[0].key.fp8_format == "e5m2"
    bad = _run("calibrate", "kv-scales", *args, "--format", "int4", "--out", tmp_path / "B")
    _one_line_error(bad, "--format", "fp8-e4m3, fp8-e5m2, int8 or nvfp4")
    bad = _run("calibrate", "kv-scales", *args, "--skip-layers", "x", "--out", tmp_path / "B")
    _one_line_error(bad, "--skip-layers")
    assert not (tmp_path / "B").exists()


@pytest.mark.parametrize(
    "change, needle",
    [
        (lambda s: torch.full_like(s, float("nan")), "NaN or Inf"),
        (lambda s: torch.zeros_like(s), "positive normal float32 scales"),
        (lambda s: torch.full_like(s, 1e37), "overflows float32"),  # x 448 is Inf
        (lambda s: torch.cat([s, s]), "shape"),  # per head, for twice the KV heads
        (lambda s: s.half(), "dtype"),
    ],
)
def test_tampered_scales_with_forged_hashes_are_refused(
    change, needle, tiny_model_dir, data, tmp_path
):
    from tests.cli.test_hardening import rehash

    art = tmp_path / "A"
    calibrate(tiny_model_dir("llama"), data, art, KVScalesOptions(granularity="head"))
    name = "layers.1.value.scale"
    rehash(art, name, change(read_artifact(art).tensors[name]))
    _one_line_error(_run("inspect", art), "incompatible artifact", name, needle)
