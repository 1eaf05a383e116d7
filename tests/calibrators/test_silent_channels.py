"""A nearly silent key channel: its static calibrated scale is stored at the scale dtype's
smallest normal (rounding up never clips), while a stored subnormal scale is refused.

A dead channel of a real model (or a quiet one of a tiny random model on other text) has a
range whose ideal fp16 scale (range / levels) is subnormal or zero in fp16; calibration
used to refuse it with "scale underflows float16".
"""

from __future__ import annotations

import shutil

import pytest
import torch

import kvq
from kvq.artifacts.store import read_artifact
from kvq.calibrators.capture import capture, run_windows
from kvq.calibrators.channel_scales import channel_ranges
from kvq.models.loading import load_model
from kvq.quant import affine, fp8, kv_formats, nuq
from tests.cli.test_cli import _one_line_error, _run
from tests.cli.test_hardening import rehash
from tests.conftest import calibration_windows, make_tiny_model, nuq_key_state, tiny_tokenizer

SILENT = 1e-6  # factor on the silent channel's k_proj rows
CHANNEL = 3  # of KV head 0
FP16_TINY = torch.finfo(torch.float16).tiny


@pytest.fixture(scope="module")
def silent_llama(tmp_path_factory):
    """A tiny llama whose key channel CHANNEL of KV head 0 and its RoPE partner (Llama
    rotates channel c with c + D/2) are scaled by SILENT in every layer, so the channel is
    nearly silent before and after RoPE: its range is ~1e-8, its ideal fp16 scale
    subnormal."""
    model = make_tiny_model("llama")
    d = model.config.head_dim
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.k_proj.weight[[CHANNEL, CHANNEL + d // 2]] *= SILENT
    out = tmp_path_factory.mktemp("silent-llama")
    model.save_pretrained(out)
    tiny_tokenizer().save_pretrained(out)
    return out


# passes whose static key state holds an fp16 scale per (KV head, channel)
PASSES = {
    "channel-scales": ["--bits", 4, "--v-group", 8],
    "kvquant": ["--bits", 3, "--no-fisher"],
    "vq": ["--bits", 3, "--no-fisher"],
}


@pytest.mark.parametrize("name", list(PASSES))
def test_a_silent_key_channel_calibrates_loads_and_generates(name, silent_llama, data, tmp_path):
    art = tmp_path / "A"
    args = ["--model", silent_llama, "--dataset", data, "--samples", 2, "--seqlen", 24]
    result = _run("calibrate", name, *args, *PASSES[name], "--out", art)
    assert result.exit_code == 0, result.stderr
    # a note in the manifest, nothing louder on the terminal
    assert "smallest normal" not in result.output and "warning" not in result.output.lower()

    artifact = read_artifact(art)
    d = artifact.manifest.architecture.head_dim
    floored = 0
    for i in range(artifact.manifest.architecture.num_layers):
        scale = artifact.tensors[f"layers.{i}.key.scale"]  # [H_kv, D] fp16
        assert scale.dtype == torch.float16
        assert scale[0, CHANNEL] == FP16_TINY and scale[0, CHANNEL + d // 2] == FP16_TINY
        floored += int((scale == FP16_TINY).sum())
    assert floored >= 2 * artifact.manifest.architecture.num_layers
    assert artifact.manifest.passes[-1].report["scales_at_smallest_normal"] == floored

    # the public path: kvq.load_model, a kvq cache from the artifact, generate
    model, _ = kvq.load_model(str(silent_llama))
    ids = torch.randint(3, 200, (1, 8), generator=torch.Generator().manual_seed(0))
    cache = kvq.make_cache(model, art)
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        out = model.generate(ids, cache=cache, **kw)
    assert out.shape == (1, 12) and cache.get_seq_length() == 11
    assert cache.nbytes().codes > 0


def _silent_keys(model_dir, data, sink: int) -> torch.Tensor:
    """The calibration windows' pre-RoPE keys of layer 0, KV head 0, channel CHANNEL after
    `sink` rows: [N] float32."""
    loaded = load_model(str(model_dir))
    rows = []

    def consume(layer, part, x):  # x [B, H_kv, T, D]
        if layer == 0:
            rows.append(x[:, 0, sink:, CHANNEL].reshape(-1))

    with capture(loaded.adapter, consume, parts=("key",), key_stage="pre-rope"):
        run_windows(loaded.model, calibration_windows(loaded, data))
    return torch.cat(rows).float()


def test_the_floored_scale_covers_the_silent_range_without_clipping(silent_llama, data, tmp_path):
    """The stored (floored) scale and offset encode every value of the calibrated range to
    within half a step: rounding the scale up to fp16's smallest normal clips nothing."""
    art = tmp_path / "A"
    args = ["--model", silent_llama, "--dataset", data, "--samples", 2, "--seqlen", 24]
    result = _run("calibrate", "channel-scales", *args, *PASSES["channel-scales"], "--out", art)
    assert result.exit_code == 0, result.stderr
    artifact = read_artifact(art)
    options = artifact.manifest.passes[-1].options
    x = _silent_keys(silent_llama, data, options["sink"])
    lo, hi = channel_ranges(x[:, None, None], options["clip_percentile"])  # [1, 1]
    assert 0 < float(hi - lo) < 1e-6  # nearly silent: an fp16 scale of it would underflow
    inside = x.clamp(float(lo), float(hi))  # the calibrated range (the tails clip by design)
    scale = artifact.tensors["layers.0.key.scale"][0, CHANNEL]
    offset = artifact.tensors["layers.0.key.offset"][0, CHANNEL]
    assert scale == FP16_TINY
    codes = affine.affine_encode(inside, scale, offset, options["bits"])
    back = affine.affine_decode(codes, scale, offset)
    assert float((back - inside).abs().max()) <= float(scale) / 2


def test_a_stored_subnormal_scale_is_still_refused_in_one_line(silent_llama, data, tmp_path):
    """Calibration never writes one, so a subnormal (or zero) scale in an artifact is a
    hand-made or corrupted one: refused at load, however its hashes were forged."""
    art = tmp_path / "A"
    args = ["--model", silent_llama, "--dataset", data, "--samples", 2, "--seqlen", 24]
    result = _run("calibrate", "kvquant", *args, *PASSES["kvquant"], "--out", art)
    assert result.exit_code == 0, result.stderr
    name = "layers.0.key.scale"
    for bad in (FP16_TINY / 4, 0.0):  # an fp16 subnormal, and zero
        copy = tmp_path / f"B{bad}"
        shutil.copytree(art, copy)
        scale = read_artifact(copy).tensors[name].clone()
        scale[0, CHANNEL] = bad
        assert scale.dtype == torch.float16 and float(scale[0, CHANNEL]) == bad
        rehash(copy, name, scale)
        _one_line_error(_run("inspect", copy), "incompatible artifact", name, "positive normal")
        ev = _run("run-eval", "--model", silent_llama, "--artifact", copy, "--dataset", data,
                  "--windows", 1, "--seqlen", 16)  # fmt: skip
        _one_line_error(ev, "incompatible artifact", name, "positive normal float16 scales")


def test_static_normalisers_floor_while_live_ones_still_refuse():
    """The shared quantizers: raise_tiny=False (static, calibrated) stores the smallest
    normal; the default (live data at run time) keeps refusing."""
    lo, hi = torch.tensor([0.0, -1.0]), torch.tensor([1e-7, 1.0])
    scale, center = nuq.normalizer(lo, hi, raise_tiny=False)
    assert scale[0] == FP16_TINY and scale[1] == 1.0
    assert bool((nuq.normalize(torch.stack([lo, hi]), scale, center).abs() <= 1).all())
    with pytest.raises(kvq.KvqError, match="scale underflows float16"):
        nuq.normalizer(lo, hi)
    with pytest.raises(kvq.KvqError, match="scale underflows float16"):
        affine.quantize_affine(torch.tensor([[0.0, 1e-7]]), 4, dim=-1)


@pytest.mark.parametrize("fmt", ["fp8-e4m3", "int8"])
def test_static_kv_and_activation_scales_floor_in_float32(fmt):
    """kv-scales and act-scales store float32 scales through `kv_formats.scale_for`: an
    absmax so small its scale is below float32's smallest normal is floored there too,
    while a live fp16 scale of it is still refused."""
    tiny = torch.finfo(torch.float32).tiny
    scale = kv_formats.scale_for(torch.tensor([1e-37, 0.0, 1.0]), fmt)
    assert scale.dtype == torch.float32 and scale[0] == tiny and scale[1] == 1.0
    assert scale[2] > tiny
    with pytest.raises(kvq.KvqError, match="scale underflows float16"):
        fp8.fp8_scale(torch.tensor([1e-7]), "e4m3", torch.float16)


def test_tuning_never_moves_a_floored_key_scale_below_the_floor():
    """tune's key scale is scale0 * exp(r): at fp16's smallest normal a negative r would
    store a subnormal scale the runtime refuses, so the tuned scale stops at the floor."""
    from kvq.calibrators.tune import _Side
    from kvq.quant.schemes import QuantScheme

    heads, d = 2, 8
    state = nuq_key_state(3, heads, d, 0.0)
    state["scale"] = state["scale"].clone()
    state["scale"][0, CHANNEL] = FP16_TINY  # a silent channel, as calibration stores it
    scheme = QuantScheme(format="nuq", bits=3, axis="channel", lifetime="static")
    side = _Side(0, "key", scheme, state, d, scales=True)
    with torch.no_grad():
        side.params["log_scale"].fill_(-1.0)  # an optimizer step that shrinks every scale
    tuned = side.stored()["scale"]
    assert tuned.dtype == torch.float16 and tuned[0, CHANNEL] == FP16_TINY
    assert bool((tuned.float() >= FP16_TINY).all())
    assert bool((tuned < state["scale"]).sum() == heads * d - 1)  # the others did shrink


@pytest.fixture(scope="module")
def silent_values_llama(tmp_path_factory):
    """A tiny llama whose KV head 0 values are scaled by SILENT in every layer: each live
    value row of that head has an ideal per-token fp16 scale below the smallest normal."""
    model = make_tiny_model("llama")
    d = model.config.head_dim
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.v_proj.weight[:d] *= SILENT
    out = tmp_path_factory.mktemp("silent-values-llama")
    model.save_pretrained(out)
    tiny_tokenizer().save_pretrained(out)
    return out


@pytest.mark.parametrize(
    "name,options",
    [("channel-scales", ["--bits", 8, "--v-group", 8, "--sink", 2]),
     ("kvquant", ["--bits", 3, "--no-fisher"])],
)  # fmt: skip
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_silent_live_values_are_stored_not_refused(
    name, options, backend, silent_values_llama, data, tmp_path
):
    """Per-token value scales are computed from live rows at run time: a quiet head's rows
    floor at fp16's smallest normal (coarser steps than they need, no clip) on both append
    paths, where calibration's own cache measurement and generation used to raise "scale
    underflows float16"."""
    art = tmp_path / "A"
    args = ["--model", silent_values_llama, "--dataset", data, "--samples", 2, "--seqlen", 24]
    result = _run("calibrate", name, *args, *options, "--out", art)
    assert result.exit_code == 0, result.stderr
    model, _ = kvq.load_model(str(silent_values_llama))
    ids = torch.randint(3, 200, (1, 8), generator=torch.Generator().manual_seed(0))
    cache = kvq.make_cache(model, art, backend=backend)
    with torch.no_grad():
        out = model.generate(ids, cache=cache, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 12)
    layer = cache.layers[0]
    _, value = layer.decoded(layer.state)  # [B, H, rows, D]: head 0 stays quiet, not zero
    assert 0 < float(value[:, 0].abs().max()) < 1e-3
