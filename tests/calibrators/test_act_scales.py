"""act-scales: static per-tensor INT8 input scales of every decoder linear; prefix-aware
statistics (shared with kv-scales)."""

from __future__ import annotations

import pytest
import torch

from kvq.calibrators.base import tensor_kind
from kvq.calibrators.capture import capture, capture_linear_inputs, run_windows
from kvq.calibrators.options import ActScalesOptions, KVScalesOptions, parse_prefix_ids
from kvq.data.prefix import with_prefix
from kvq.errors import IncompatibleArtifact, KvqError
from kvq.exporters.artifact import read_artifact, write_artifact
from kvq.models.loading import load_model
from kvq.pipeline import CalibrationRequest, calibrate_job, load_windows
from kvq.progress import Progress
from kvq.quant import kv_formats
from kvq.quant.activations import input_scale_name

SAMPLES, SEQLEN = 2, 24


@pytest.fixture(scope="module")
def data(shared_data):
    return str(shared_data / "calibration" / "groups_merged.txt")


def _calibrate(model_dir, data, out, options, base=None):
    request = CalibrationRequest(
        passes=(options,), model_spec=str(model_dir), dataset=data, out=out,
        samples=SAMPLES, seqlen=SEQLEN, base=base,
    )  # fmt: skip
    return calibrate_job(request, Progress())


def _input_amax(model_dir, data, prefix=()):
    """Per linear: max |input| over the windows forwarded after `prefix`, prefix cut."""
    loaded = load_model(str(model_dir))
    windows = load_windows(loaded, data, SAMPLES, SEQLEN, 0, None).ids
    seqs = with_prefix(windows, prefix).ids
    amax = {}
    hooks = []
    for name, module in loaded.adapter.decoder_linears().items():

        def hook(_m, args, name=name):
            m = args[0][:, len(prefix) :].abs().amax()
            amax[name] = torch.maximum(amax[name], m) if name in amax else m

        hooks.append(module.register_forward_pre_hook(hook))
    with torch.no_grad():
        for i in range(seqs.shape[0]):
            loaded.model(seqs[i : i + 1])
    for h in hooks:
        h.remove()
    return amax, loaded


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_absmax_scales_are_every_linear_inputs_maximum(family, tiny_model_dir, data, tmp_path):
    model_dir = tiny_model_dir(family)
    art = _calibrate(model_dir, data, tmp_path / "a", ActScalesOptions("absmax"))
    amax, loaded = _input_amax(model_dir, data)
    assert set(amax) == set(loaded.adapter.decoder_linears())
    assert len(amax) == 7 * loaded.adapter.info.num_layers  # q k v o gate up down
    for name, m in amax.items():
        t = art.tensors[input_scale_name(name)]
        assert t.dtype == torch.float32 and t.shape == (1,)
        assert torch.equal(t, kv_formats.scale_for(m.reshape(1), "int8"))
        assert tensor_kind(input_scale_name(name)) == "activation"
    assert art.manifest.passes[-1].method == "act-scales"
    assert art.manifest.policy.name == "fp16"  # no --base: the cache stays unquantized


def test_prefix_positions_are_left_out(tiny_model_dir, data, tmp_path):
    model_dir = tiny_model_dir("llama")
    prefix = (7, 9, 11)  # prepended before each window (not its BOS)
    options = ActScalesOptions("absmax", prefix_ids="7,9,11")
    art = _calibrate(model_dir, data, tmp_path / "a", options)
    with_p, _ = _input_amax(model_dir, data, prefix)
    plain, _ = _input_amax(model_dir, data)
    for name, m in with_p.items():
        assert torch.equal(
            art.tensors[input_scale_name(name)], kv_formats.scale_for(m[None], "int8")
        )
    assert any(not torch.equal(with_p[n], plain[n]) for n in plain)  # the prefix mattered
    assert art.manifest.passes[-1].options["prefix_ids"] == "7,9,11"


def test_kv_scales_prefix_rows_exact_and_out_of_statistics(tiny_model_dir, data, tmp_path):
    model_dir = tiny_model_dir("llama")
    options = KVScalesOptions("int8", "head", prefix_ids="7,9")
    art = _calibrate(model_dir, data, tmp_path / "kv", options)
    loaded = load_model(str(model_dir))
    windows = load_windows(loaded, data, SAMPLES, SEQLEN, 0, None).ids
    amax = {}

    def consume(layer, part, x):  # x [B, H, T - 2, D]: the prefix already cut
        m = x.abs().amax(dim=(0, 2, 3))
        amax[(layer, part)] = torch.maximum(amax[(layer, part)], m) if (layer, part) in amax else m

    with capture(loaded.adapter, consume, key_stage="post-rope", skip_positions=2):
        run_windows(loaded.model, windows, prefix_ids=(7, 9))
    for (layer, part), m in amax.items():
        want = kv_formats.scale_for(m, "int8")
        assert torch.equal(art.tensors[f"layers.{layer}.{part}.scale"], want)
    assert all(layer.sink_tokens == 2 for layer in art.manifest.policy.layers)


def test_with_prefix_replaces_a_leading_bos():
    windows = torch.tensor([[1, 5, 6], [1, 7, 8]])
    same = with_prefix(windows, (1, 4))  # starts with the windows' BOS: takes its place
    assert same.ids.tolist() == [[1, 4, 5, 6], [1, 4, 7, 8]]
    assert (same.prefix_len, same.window_start) == (2, 1)
    other = with_prefix(windows, (4,))
    assert other.ids.tolist() == [[4, 1, 5, 6], [4, 1, 7, 8]]
    assert (other.prefix_len, other.window_start) == (1, 1)
    assert with_prefix(windows, None).ids is windows


def test_linear_input_capture_cuts_the_prefix(tiny_model_dir):
    loaded = load_model(str(tiny_model_dir("llama")))
    seen = {}
    with capture_linear_inputs(loaded.adapter, lambda n, x: seen.setdefault(n, x.shape), 3):
        run_windows(loaded.model, torch.arange(10)[None] + 3, prefix_ids=(4, 5, 6))
    assert all(shape[:2] == (1, 10) for shape in seen.values())


@pytest.mark.parametrize("text", ["x", "1,,2", "-1", "1.5", "1e3"])
def test_bad_prefix_ids_are_refused(text):
    with pytest.raises(KvqError, match="--prefix-ids"):
        parse_prefix_ids(text)
    with pytest.raises(KvqError, match="--prefix-ids"):
        ActScalesOptions(prefix_ids=text)


def test_prefix_outside_the_vocabulary_writes_nothing(tiny_model_dir, data, tmp_path):
    out = tmp_path / "a"
    with pytest.raises(KvqError, match="outside the vocabulary"):
        _calibrate(tiny_model_dir("llama"), data, out, ActScalesOptions(prefix_ids="99999"))
    assert not out.exists()


def test_chains_keep_activation_scales(tiny_model_dir, data, tmp_path):
    model_dir = tiny_model_dir("llama")
    kv = _calibrate(model_dir, data, tmp_path / "kv", KVScalesOptions("int8", "head"))
    both = _calibrate(model_dir, data, tmp_path / "both", ActScalesOptions(), base=tmp_path / "kv")
    assert both.manifest.policy == kv.manifest.policy  # act-scales keeps the base's cache
    acts = {n for n in both.tensors if tensor_kind(n) == "activation"}
    assert acts and all(torch.equal(both.tensors[n], kv.tensors[n]) for n in kv.tensors)
    # a policy pass on top replaces the cache policy but carries the activation scales
    again = _calibrate(
        model_dir, data, tmp_path / "again", KVScalesOptions("fp8-e4m3"), base=tmp_path / "both"
    )
    assert {n for n in again.tensors if tensor_kind(n) == "activation"} == acts
    assert again.manifest.policy.name.startswith("kv-scales-fp8")


@pytest.mark.parametrize(
    "name, value, field",
    [
        ("act.layers.0.self_attn.q_proj.input_scale", torch.tensor([-1.0]), "tensors[act"),
        ("act.layers.0.self_attn.q_proj.input_scale", torch.ones(2), ".shape"),
        ("act.layers.0.self_attn.q_proj.input_scale", torch.ones(1).half(), ".dtype"),
        ("act.layers.99.mlp.down_proj.input_scale", torch.ones(1), "tensors[act"),
        ("act.layers.0.mlp.down_proj.bias", torch.ones(1), "tensors[act"),
    ],
)
def test_tampered_activation_scales_are_refused(name, value, field, tiny_model_dir, data, tmp_path):
    art = _calibrate(tiny_model_dir("llama"), data, tmp_path / "a", ActScalesOptions())
    art.tensors[name] = value
    write_artifact(art, tmp_path / "b")  # re-hashed: only the value checks can refuse it
    with pytest.raises(IncompatibleArtifact, match=field.replace("[", r"\[")):
        read_artifact(tmp_path / "b")
