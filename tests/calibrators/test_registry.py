"""Every registered pass, end to end on each tiny family; chains (--base) and recipes."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from kvq.artifacts.store import read_artifact
from kvq.calibrators.options import (
    ActScalesOptions,
    AutoOptions,
    ChannelScalesOptions,
    IntactKVOptions,
    KVQuantOptions,
    KVScalesOptions,
    PrefixQuantOptions,
    RotateOptions,
    SmoothAttentionOptions,
    TrellisOptions,
    TuneOptions,
    VQOptions,
)
from kvq.calibrators.recipe import read_recipe
from kvq.calibrators.registry import PASSES, get_pass
from kvq.errors import KvqError
from kvq.models.loading import load_model
from kvq.pipeline import CalibrationRequest, cache_for, calibrate_job
from kvq.progress import Progress
from kvq.quant.schemes import CachePolicy, LayerPolicy, QuantScheme
from tests.cli.test_cli import _one_line_error, _run

# small, fast settings per pass (the tiny llama/qwen2 heads are 16 wide)
SMALL = {
    "channel-scales": ChannelScalesOptions(bits=4, value_group=8),
    "kvquant": KVQuantOptions(bits=3, fisher=False),
    "kv-scales": KVScalesOptions(granularity="head"),
    "smoothattention": SmoothAttentionOptions(alpha=0.5),
    "rotate": RotateOptions(layout="int4"),
    "act-scales": ActScalesOptions(layout="fp8-e4m3"),  # + a calibration-free cache layout
    "vq": VQOptions(bits=3, fisher=False),
    "trellis": TrellisOptions(bits=2, window=8, fisher=False),
    "auto": AutoOptions(bits=3, prefer="quality", static_tokens=0),  # trellis: no table charge
    "prefixquant": PrefixQuantOptions(eta=2.0),
    "intactkv": IntactKVOptions(steps=2, lr=1e-3),
    "tune": TuneOptions(steps=2, checkpoints=1),
}
# passes that calibrate for a quantized layout, chained after the pass that makes it
NEEDS_BASE = {"intactkv": SMALL["channel-scales"], "tune": SMALL["kvquant"]}


def test_every_registered_pass_has_small_settings_here():
    assert set(SMALL) == set(PASSES)


def test_the_passes_that_need_a_base_declare_it():
    assert {n for n, e in PASSES.items() if e.base == "required"} == set(NEEDS_BASE)
    # the ones with rules on the base (tests/cli/test_pass_bases.py runs each refusal)
    ruled = {n for n, e in PASSES.items() if e.rules}
    assert ruled == {"intactkv", "tune", "rotate", "smoothattention", "act-scales"}


def test_tune_refuses_a_nuq_base_that_holds_rows_back():
    """No pass makes NUQ state with a residual window: only a hand-made manifest could."""
    nuq = LayerPolicy(QuantScheme("nuq", 3, axis="channel", lifetime="static"),
                      QuantScheme("nuq", 3), key_stage="pre-rope")  # fmt: skip
    policy = CachePolicy("nuq3-r8", (replace(nuq, residual_tokens=8),) * 2)
    with pytest.raises(KvqError, match=r"cannot use the base \(cache policy 'nuq3-r8'\).*per-row"):
        get_pass("tune").check_base(TuneOptions(), policy, ())
    get_pass("tune").check_base(TuneOptions(), replace(policy, layers=(nuq,) * 2), ())


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("name", sorted(PASSES))
def test_pass_fit_write_read_cache_decode(name, family, tiny_model_dir, data, tmp_path):
    model_dir = tiny_model_dir(family)
    chain = (NEEDS_BASE[name],) if name in NEEDS_BASE else ()
    request = CalibrationRequest(
        passes=(*chain, SMALL[name]),
        model_spec=str(model_dir),
        dataset=data,
        out=tmp_path / "ART",
        samples=2,
        seqlen=24,
    )
    written = calibrate_job(request, Progress())
    artifact = read_artifact(tmp_path / "ART")
    assert artifact.manifest == written.manifest
    ran = [*(c.NAME for c in chain), *(p.NAME for p in SMALL[name].chain())]  # auto: + rotate
    assert [p.method for p in artifact.manifest.passes] == ran and ran[-1] == name
    loaded = load_model(str(model_dir))
    cache = cache_for(loaded, artifact=artifact)
    ids = torch.randint(3, 200, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        prefill = loaded.model(ids[:, :8], cache=cache).logits
        step = loaded.model(ids[:, 8:], cache=cache).logits
    assert torch.isfinite(prefill).all() and torch.isfinite(step).all()
    assert cache.get_seq_length() == 9
    assert cache.nbytes().codes > 0  # real packed codes, not floats


def test_a_chain_records_every_pass_and_drops_the_replaced_state(tiny_model_dir, data, tmp_path):
    model_dir = str(tiny_model_dir("llama"))
    first = CalibrationRequest(
        passes=(KVQuantOptions(bits=3),), model_spec=model_dir, dataset=data,
        out=tmp_path / "A", samples=2, seqlen=24,
    )  # fmt: skip
    base = calibrate_job(first, Progress())
    assert "fisher.key" in base.tensors  # KVQuant's provenance
    second = CalibrationRequest(
        passes=(ChannelScalesOptions(bits=8, value_group=8),), model_spec=model_dir,
        dataset=data, out=tmp_path / "B", samples=2, seqlen=24, base=tmp_path / "A",
    )  # fmt: skip
    chained = calibrate_job(second, Progress())
    assert [p.method for p in chained.manifest.passes] == ["kvquant", "channel-scales"]
    assert chained.manifest.passes[0] == base.manifest.passes[0]
    assert chained.manifest.policy.name == "channel-scales-int8"
    # the new policy replaced the base's state and provenance
    assert not any(n.startswith("fisher.") or n.endswith(".codebook") for n in chained.tensors)


def test_cli_chain_with_base_and_its_refusals(tiny_model_dir, data, tmp_path):
    model_dir = tiny_model_dir("llama")
    args = ["--model", model_dir, "--dataset", data, "--samples", 2, "--seqlen", 24]
    ok = _run("calibrate", "channel-scales", *args, "--v-group", 8, "--out", tmp_path / "A")
    assert ok.exit_code == 0, ok.stderr
    chained = _run(
        "calibrate", "kvquant", *args, "--bits", 4, "--no-fisher",
        "--base", tmp_path / "A", "--out", tmp_path / "B",
    )  # fmt: skip
    assert chained.exit_code == 0, chained.stderr
    manifest = json.loads((tmp_path / "B" / "manifest.json").read_text())
    assert [p["method"] for p in manifest["passes"]] == ["channel-scales", "kvquant"]
    missing = _run(
        "calibrate", "kvquant", *args, "--base", tmp_path / "nope", "--out", tmp_path / "C"
    )
    _one_line_error(missing, "--base", "no such artifact")
    other = _run(
        "calibrate", "kvquant", "--model", tiny_model_dir("qwen2"), "--dataset", data,
        "--samples", 2, "--seqlen", 24, "--base", tmp_path / "A", "--out", tmp_path / "D",
    )  # fmt: skip
    _one_line_error(other, "incompatible artifact")
    assert not (tmp_path / "C").exists() and not (tmp_path / "D").exists()


RECIPE = """
# channel scales, then KVQuant on top
samples: 2
seqlen: 24
passes:
  - channel-scales: {bits: 8, v-group: 8}
  - kvquant:
      bits: 3
      fisher: false
"""


def test_recipe_runs_a_chain(tiny_model_dir, data, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(RECIPE)
    result = _run(
        "calibrate", "recipe", recipe, "--model", tiny_model_dir("llama"), "--dataset", data,
        "--out", tmp_path / "ART",
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    m = read_artifact(tmp_path / "ART").manifest
    assert [(p.method, p.options["bits"]) for p in m.passes] == [
        ("channel-scales", 8),
        ("kvquant", 3),
    ]
    assert m.passes[0].options["value_group"] == 8 and m.passes[1].dataset.samples == 2


@pytest.mark.parametrize(
    "text, needle",
    [
        ("passes: []", "non-empty list"),
        ("passes: [nope]", "unknown pass 'nope'"),
        ("passes: [{kvquant: {bits: four}}]", "bits must be int"),
        ("passes: [{kvquant: {colour: red}}]", "unknown option 'colour'"),
        ("passes: [{kvquant: {bits: 5}}]", "--bits must be 2, 3 or 4"),
        ("samples: many\npasses: [kvquant]", "samples must be a int"),
        ("dataset: x\nmodle: y\npasses: [kvquant]", "unknown key 'modle'"),
        ("passes: [kvquant", "not a YAML document"),
        ("!!python/object:os.system {}", "not a YAML document"),
        ("- just\n- a list", "expected a mapping"),
    ],
)
def test_bad_recipes_are_one_line_errors(tmp_path, text, needle):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(text)
    result = _run("calibrate", "recipe", recipe, "--dataset", "wikitext2", "--out", tmp_path / "o")
    _one_line_error(result, needle)
    assert not (tmp_path / "o").exists()


def test_recipe_options_check_their_types():
    entry = get_pass("channel-scales")
    assert entry.options.from_recipe({"clip_percentile": 99}, 0).clip_percentile == 99
    with pytest.raises(KvqError, match="clip_percentile must be float"):
        entry.options.from_recipe({"clip_percentile": "x"}, 0)
    with pytest.raises(KvqError, match="key_stage must be one of"):
        entry.options.from_recipe({"key_stage": "sideways"}, 0)
    assert entry.options.from_recipe({"v-group": 0}, 0).value_group is None  # 0: whole head
    assert get_pass("kvquant").options.from_recipe({}, 7).seed == 7


def test_read_recipe_keeps_order_and_settings(tmp_path):
    path = Path(tmp_path / "r.yaml")
    path.write_text(RECIPE)
    r = read_recipe(path)
    assert r.settings == {"samples": 2, "seqlen": 24}
    assert [name for name, _ in r.passes] == ["channel-scales", "kvquant"]
