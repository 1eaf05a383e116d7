"""act-scales: static per-tensor INT8 input scales of every decoder linear; prefix-aware
statistics (shared with kv-scales)."""

from __future__ import annotations

import pytest
import torch

from kvq.artifacts.store import read_artifact, write_artifact
from kvq.calibrators.base import tensor_kind
from kvq.calibrators.capture import capture, run_windows
from kvq.calibrators.options import ActScalesOptions, KVScalesOptions, parse_prefix_ids
from kvq.calibrators.prefix_state import extract_prefix
from kvq.errors import IncompatibleArtifact, KvqError
from kvq.models.loading import load_model
from kvq.quant import kv_formats
from kvq.quant.activations import input_scale_name
from tests.conftest import calibrate, calibration_windows


def _input_amax(model_dir, data, prefix=(), with_prefix_rows=False):
    """Per linear: max |input| over the windows served after `prefix` by a plain forward
    over prefix + window (the window's BOS replaced by a prefix that starts with it), the
    prefix positions cut unless `with_prefix_rows`."""
    loaded = load_model(str(model_dir))
    windows = calibration_windows(loaded, data)
    seqs = _served(windows, prefix)
    cut = 0 if with_prefix_rows else len(prefix)
    amax = {}
    hooks = []
    for name, module in loaded.adapter.decoder_linears().items():

        def hook(_m, args, name=name):
            m = args[0][:, cut:].abs().amax()
            amax[name] = torch.maximum(amax[name], m) if name in amax else m

        hooks.append(module.register_forward_pre_hook(hook))
    with torch.no_grad():
        for i in range(seqs.shape[0]):
            loaded.model(seqs[i : i + 1])
    for h in hooks:
        h.remove()
    return amax, loaded


def _served(windows, prefix):
    """prefix + windows as one plain sequence each ([N, P + L'])."""
    if not prefix:
        return windows
    body = windows[:, 1:] if prefix[0] == int(windows[0, 0]) else windows
    return torch.cat([torch.tensor(prefix)[None].expand(len(windows), -1), body], 1)


OUTLIER = 7  # the token the outlier model makes extreme


@pytest.fixture(scope="module")
def outlier_model_dir(tmp_path_factory):
    """Tiny Llama whose token 7 embeds as one huge channel, the one layer 0's input norm
    weighs most: an outlier token at every layer-0 q/k/v/gate/up input and in its keys
    and values (what PrefixQuant moves into the prefix)."""
    from tests.conftest import make_tiny_model, tiny_tokenizer

    model = make_tiny_model("llama")
    with torch.no_grad():
        channel = int(model.model.layers[0].input_layernorm.weight.abs().argmax())
        row = model.model.embed_tokens.weight[OUTLIER]
        row.zero_()
        row[channel] = 100.0
    out = tmp_path_factory.mktemp("outlier-llama")
    model.save_pretrained(out)
    tiny_tokenizer().save_pretrained(out)
    return out


@pytest.mark.parametrize("prefix", [(2, OUTLIER), (OUTLIER, 9, 11)])
def test_prefix_positions_are_left_out(outlier_model_dir, data, tmp_path, prefix):
    """The scales are those of the windows' own rows served after the prefix (a plain
    forward over prefix + window, prefix positions cut); with the outlier token's rows
    included they would be far wider."""
    ids = ",".join(map(str, prefix))
    art = calibrate(outlier_model_dir, data, tmp_path / "a", ActScalesOptions(prefix_ids=ids))
    assert art.manifest.policy.prefix.token_ids == prefix
    without, _ = _input_amax(outlier_model_dir, data, prefix)
    included, _ = _input_amax(outlier_model_dir, data, prefix, with_prefix_rows=True)
    for name, m in without.items():
        got = art.tensors[input_scale_name(name)]
        torch.testing.assert_close(got, kv_formats.scale_for(m[None], "int8"), rtol=1e-5, atol=0)
        # against the same computation (got matches it to 1e-5, not bit for bit): with equal
        # maxima the two scales are equal, never one rounding step apart
        wide = kv_formats.scale_for(included[name][None], "int8")
        assert bool((wide >= kv_formats.scale_for(m[None], "int8")).all())
    for name in ("self_attn.q_proj", "mlp.gate_proj"):  # the outlier token's own row
        ratio = included[f"layers.0.{name}"] / without[f"layers.0.{name}"]
        assert ratio > 2, (name, ratio)
    assert art.manifest.passes[-1].options["prefix_ids"] == ids


def test_kv_scales_prefix_rows_exact_and_out_of_statistics(outlier_model_dir, data, tmp_path):
    prefix = (2, OUTLIER)
    options = KVScalesOptions("int8", "head", prefix_ids="2,7")
    art = calibrate(outlier_model_dir, data, tmp_path / "kv", options)
    loaded = load_model(str(outlier_model_dir))
    windows = calibration_windows(loaded, data)
    amax = {True: {}, False: {}}  # prefix rows included?

    def consume(layer, part, x):  # x [1, H, P + L', D], post-RoPE at served positions
        for included, rows in ((True, x), (False, x[:, :, len(prefix) :])):
            m = rows.abs().amax(dim=(0, 2, 3))
            old = amax[included].get((layer, part))
            amax[included][(layer, part)] = m if old is None else torch.maximum(old, m)

    with capture(loaded.adapter, consume, key_stage="post-rope"):
        run_windows(loaded.model, _served(windows, prefix))
    for (layer, part), m in amax[False].items():
        got = art.tensors[f"layers.{layer}.{part}.scale"]
        torch.testing.assert_close(got, kv_formats.scale_for(m, "int8"), rtol=1e-5, atol=0)
        assert bool((kv_formats.scale_for(amax[True][(layer, part)], "int8") >= got).all())
    for part in ("key", "value"):
        assert bool((amax[True][(0, part)] > 1.2 * amax[False][(0, part)]).any())
    policy = art.manifest.policy
    assert policy.prefix.token_ids == prefix and policy.prefix.source == "prefix-ids"
    assert all(layer.sink_tokens == 0 for layer in policy.layers)  # the prefix is no sink
    assert art.manifest.ledger.prefix > 0
    exact = extract_prefix(loaded, prefix, "x").tensors()
    assert all(torch.equal(art.tensors[n], t) for n, t in exact.items())


def test_a_base_prefix_and_prefix_ids_on_a_plain_base_serve_the_same_rows(
    tiny_model_dir, data, tmp_path
):
    """act-scales --prefix-ids on a base without a prefix declares it on the base's layout
    (its state kept); act-scales on a base that declares it keeps it: same scales."""
    model_dir = tiny_model_dir("llama")
    calibrate(model_dir, data, tmp_path / "kv", KVScalesOptions("int8", "head"))
    on_plain = calibrate(
        model_dir, data, tmp_path / "a", ActScalesOptions(prefix_ids="2,9"), base=tmp_path / "kv"
    )
    kv = read_artifact(tmp_path / "kv")
    assert on_plain.manifest.policy == kv.manifest.policy.with_prefix(
        on_plain.manifest.policy.prefix
    )
    assert all(torch.equal(on_plain.tensors[n], t) for n, t in kv.tensors.items())
    with_prefix = calibrate(
        model_dir, data, tmp_path / "b", KVScalesOptions("int8", "head", prefix_ids="2,9")
    )
    on_prefixed = calibrate(model_dir, data, tmp_path / "c", ActScalesOptions(),
                             base=tmp_path / "b")  # fmt: skip
    assert on_prefixed.manifest.policy == with_prefix.manifest.policy
    acts = [n for n in on_plain.tensors if tensor_kind(n) == "activation"]
    assert acts and all(torch.equal(on_plain.tensors[n], on_prefixed.tensors[n]) for n in acts)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_absmax_scales_are_every_linear_inputs_maximum(family, tiny_model_dir, data, tmp_path):
    model_dir = tiny_model_dir(family)
    art = calibrate(model_dir, data, tmp_path / "a", ActScalesOptions("absmax"))
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


@pytest.mark.parametrize("text", ["x", "1,,2", "-1", "1.5", "1e3"])
def test_bad_prefix_ids_are_refused(text):
    with pytest.raises(KvqError, match="--prefix-ids"):
        parse_prefix_ids(text)
    with pytest.raises(KvqError, match="--prefix-ids"):
        ActScalesOptions(prefix_ids=text)


def test_prefix_outside_the_vocabulary_writes_nothing(tiny_model_dir, data, tmp_path):
    out = tmp_path / "a"
    with pytest.raises(KvqError, match="outside the vocabulary"):
        calibrate(tiny_model_dir("llama"), data, out, ActScalesOptions(prefix_ids="99999"))
    assert not out.exists()


def test_chains_keep_activation_scales(tiny_model_dir, data, tmp_path):
    model_dir = tiny_model_dir("llama")
    kv = calibrate(model_dir, data, tmp_path / "kv", KVScalesOptions("int8", "head"))
    both = calibrate(model_dir, data, tmp_path / "both", ActScalesOptions(), base=tmp_path / "kv")
    assert both.manifest.policy == kv.manifest.policy  # act-scales keeps the base's cache
    acts = {n for n in both.tensors if tensor_kind(n) == "activation"}
    assert acts and all(torch.equal(both.tensors[n], kv.tensors[n]) for n in kv.tensors)
    # a policy pass on top replaces the cache policy but carries the activation scales
    again = calibrate(
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
    art = calibrate(tiny_model_dir("llama"), data, tmp_path / "a", ActScalesOptions())
    art.tensors[name] = value
    write_artifact(art, tmp_path / "b")  # re-hashed: only the value checks can refuse it
    with pytest.raises(IncompatibleArtifact, match=field.replace("[", r"\[")):
        read_artifact(tmp_path / "b")
