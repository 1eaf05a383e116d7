"""IntactKV: exact extraction, calibration against layer outputs, refusals."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from kvq.artifacts.store import Artifact, read_artifact, write_artifact
from kvq.calibrators.intactkv import _Trainer
from kvq.calibrators.options import IntactKVOptions, KVQuantOptions
from kvq.calibrators.prefix_state import extract_prefix
from kvq.manifests.schema import manifest_from_json, manifest_to_json
from kvq.models.loading import load_model
from kvq.pipeline import artifact_prefix, cache_for
from kvq.quant.schemes import PrefixSpec
from tests.cli.test_cli import _one_line_error, _run
from tests.conftest import calibrate


@pytest.fixture(scope="module")
def setup(tiny_model_dir, data, tmp_path_factory):
    """(model dir, dataset, kvquant base artifact, tmp folder) on tiny Gemma 3."""
    model_dir = tiny_model_dir("gemma3")
    tmp = tmp_path_factory.mktemp("intactkv")
    base = _calibrate(model_dir, data, tmp / "base", KVQuantOptions(bits=2, fisher=False))
    return model_dir, data, base, tmp


def _calibrate(model_dir, data, out, options, base=None):
    calibrate(model_dir, data, out, options, base, samples=3)
    return out  # the folder: later passes take it as --base


def test_zero_learning_rate_reproduces_the_exact_prefix_bit_for_bit(setup):
    model_dir, data, base, tmp = setup
    out = _calibrate(model_dir, data, tmp / "lr0", IntactKVOptions(lr=0.0, steps=4), base)
    art = read_artifact(out)
    report = art.manifest.passes[-1].report
    assert report["equals_exact"] is True and report["steps"] == 4
    assert report["loss_before"] == report["loss_after"] and len(report["loss_curve"]) == 4
    exact = extract_prefix(load_model(str(model_dir)), (2,), "x").tensors()
    for name, t in exact.items():
        assert torch.equal(art.tensors[name], t)
    # the base's state is carried over untouched
    base_tensors = load_file(base / "tensors.safetensors")
    for name, t in base_tensors.items():
        assert torch.equal(art.tensors[name], t)
    assert art.manifest.policy.prefix.source == "intactkv-exact"


def test_calibration_lowers_the_layer_output_loss(setup):
    model_dir, data, base, tmp = setup
    opts = IntactKVOptions(lr=1e-2, steps=12, loss="mse")
    out = _calibrate(model_dir, data, tmp / "cal", opts, base)
    art = read_artifact(out)
    report = art.manifest.passes[-1].report
    assert "mean square" not in report["objective"]
    assert report["loss_after"] < report["loss_before"]
    assert report["equals_exact"] is False
    assert art.manifest.policy.prefix.source == "intactkv-calibrated"
    assert art.manifest.ledger.prefix > 0


def test_the_relative_loss_is_each_layers_mse_over_its_power(setup):
    model_dir, data, base, tmp = setup
    opts = IntactKVOptions(lr=1e-2, steps=12, loss="relative")
    art = read_artifact(_calibrate(model_dir, data, tmp / "rel", opts, base))
    report = art.manifest.passes[-1].report
    assert "mean square" in report["objective"]
    # each layer's term is a relative error: below 1 unless the cache lost the layer
    assert 0 < report["loss_before"] < art.manifest.architecture.num_layers
    assert report["loss_after"] < report["loss_before"]


def test_the_training_forward_is_the_cache_forward(setup):
    """What IntactKV optimises is what the runtime computes: the fake-quantized forward
    over the prefix rows equals the model run through the real cache."""
    model_dir, data, base, tmp = setup
    out = _calibrate(model_dir, data, tmp / "same", IntactKVOptions(lr=0.0, steps=1), base)
    loaded = load_model(str(model_dir))
    art = read_artifact(out)
    trainer = _Trainer(loaded, art.manifest.policy, art.tensors, artifact_prefix(loaded, art))
    from kvq.calibrators.intactkv import _register

    _register(trainer)
    ids = torch.randint(3, 300, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        train = trainer._layer_outputs(ids, quantized=True)[-1]
    seen = {}
    last = loaded.adapter.decoder_layers()[-1]
    handle = last.register_forward_hook(lambda m, a, o: seen.setdefault("h", o))
    with torch.no_grad():
        loaded.model(ids, cache=cache_for(loaded, artifact=art))
    handle.remove()
    real = seen["h"][0] if isinstance(seen["h"], tuple) else seen["h"]
    # the trainer rounds its fp32 prefix rows to the cache's fp16 as the cache does (without
    # that, 1.5e-3 here, and 2-bit code flips downstream on other windows)
    torch.testing.assert_close(train, real, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--steps", 0], "--steps"),
        (["--prefix", " "], "--prefix"),
        (["--lr", -1], "--lr"),
        (["--loss", "l1"], "--loss"),
    ],
)
def test_bad_options_are_one_line_and_write_nothing(setup, flags, needle):
    model_dir, data, base, tmp = setup
    out = tmp / "bad"
    args = ["--model", model_dir, "--dataset", data, "--base", base, "--out", out]
    _one_line_error(_run("calibrate", "intactkv", *args, *flags), needle)
    assert not out.exists()


def test_a_base_is_required(setup):
    model_dir, data, base, tmp = setup
    args = ["--model", model_dir, "--dataset", data, "--samples", 2, "--seqlen", 24]
    _one_line_error(_run("calibrate", "intactkv", *args, "--out", tmp / "nb"), "--base")
    assert not (tmp / "nb").exists()


def test_a_prefix_made_with_another_tokenizer_is_refused(setup):
    model_dir, data, base, tmp = setup
    good = read_artifact(
        _calibrate(model_dir, data, tmp / "tk", IntactKVOptions(lr=0.0, steps=1), base)
    )
    spec = good.manifest.policy.prefix
    other = PrefixSpec(spec.token_ids, "0" * 64, spec.source)
    d = manifest_to_json(good.manifest)
    d["policy"] = json.loads(json.dumps(good.manifest.policy.with_prefix(other).to_json()))
    forged = tmp / "forged"
    write_artifact(Artifact(manifest_from_json(d), good.tensors), forged)
    run = ["--model", model_dir, "--dataset", data, "--windows", 1, "--seqlen", 16]
    _one_line_error(_run("run-eval", *run, "--artifact", forged), "another tokenizer")
    args = ["--model", model_dir, "--dataset", data, "--samples", 2, "--seqlen", 24]
    out = tmp / "chained"
    result = _run("calibrate", "intactkv", *args, "--base", forged, "--prefix", "prefixquant",
                  "--out", out)  # fmt: skip
    _one_line_error(result, "another tokenizer")
    assert not out.exists()


def test_manifests_written_before_prefixes_still_read(setup):
    model_dir, data, base, tmp = setup
    d = json.loads((base / "manifest.json").read_text())
    d["policy"]["_data"].pop("prefix")
    d["ledger"].pop("prefix")
    for p in d["passes"]:
        p.pop("report")
    m = manifest_from_json(d)
    assert m.policy.prefix is None and m.ledger.prefix == 0 and m.passes[0].report == {}


def test_run_eval_scores_only_the_users_tokens(setup):
    model_dir, data, base, tmp = setup
    art = _calibrate(model_dir, data, tmp / "ev", IntactKVOptions(lr=0.0, steps=1), base)
    run = ["--model", model_dir, "--dataset", data, "--windows", 2, "--seqlen", 16]
    with_prefix = _run("run-eval", *run, "--artifact", art, "--json", tmp / "a.json")
    plain = _run("run-eval", *run, "--artifact", base, "--json", tmp / "b.json")
    assert with_prefix.exit_code == 0 and plain.exit_code == 0, with_prefix.output
    a, b = (json.loads((tmp / n).read_text()) for n in ("a.json", "b.json"))
    # the prefix supplies each window's BOS: one position fewer to score per window
    assert a["tasks"]["ppl"]["scored_tokens"] == b["tasks"]["ppl"]["scored_tokens"] - 2
    assert a["prefix"] == [2] and b["prefix"] is None
    # same text, same unquantized model: the baselines agree up to fp32 rounding
    assert abs(a["tasks"]["ppl"]["baseline"] / b["tasks"]["ppl"]["baseline"] - 1) < 0.2


def test_generate_serves_the_prompt_after_the_prefix(setup):
    model_dir, data, base, tmp = setup
    art = _calibrate(model_dir, data, tmp / "gen", IntactKVOptions(lr=0.0, steps=1), base)
    result = _run("generate", "--model", model_dir, "--artifact", art, "--prompt", "The keys",
                  "--max-new-tokens", 4)  # fmt: skip
    assert result.exit_code == 0, result.output + result.stderr
