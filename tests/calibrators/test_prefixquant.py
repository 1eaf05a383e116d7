"""PrefixQuant: the outlier statistic, the token choice, the pass through the CLI."""

from __future__ import annotations

import json
import math

import pytest
import torch

from kvq.calibrators.options import PrefixQuantOptions
from kvq.calibrators.prefixquant import OutlierStats, choose_tokens, outlier_stats
from kvq.errors import KvqError
from kvq.models.loading import load_model
from kvq.pipeline import load_windows
from kvq.progress import Progress
from tests.cli.test_cli import _one_line_error, _run


def test_tokens_are_bos_then_the_most_frequent_outliers():
    ids = torch.tensor([[2, 5, 9, 5, 7], [2, 9, 5, 8, 5], [2, 7, 7, 9, 6]])
    ratios = torch.ones(3, 2, 5)
    ratios[:, 0, 0] = 100.0  # BOS stands out in layer 0 of every window (position 0)
    ratios[0, 1, [1, 3]] = 80.0  # token 5 twice in window 0 (layer 1)
    ratios[1, 1, 2] = ratios[1, 1, 4] = 90.0  # token 5 twice more in window 1
    ratios[2, 0, 1] = 70.0  # token 7 once
    ratios[1, 0, 1] = 65.0  # token 9 once
    stats = OutlierStats(ratios, ids)
    # per layer mean count per window: layer 0 (1 + 2 + 2) / 3, layer 1 4 / 3 -> ceil 2
    tokens, wanted, counts = choose_tokens(stats, eta=64.0, max_tokens=4, bos=2)
    assert wanted == math.ceil(5 / 3) == 2
    assert tokens == (2, 5)  # BOS + the one most frequent (4 times), position 0 excluded
    assert counts == {5: 4, 7: 1, 9: 1}
    assert choose_tokens(stats, eta=64.0, max_tokens=1, bos=2)[0] == (2,)
    assert choose_tokens(stats, eta=200.0, max_tokens=4, bos=2)[0] == (2,)  # none: BOS


def test_statistic_is_max_over_channels_over_the_window_median(tiny_model_dir, data):
    loaded = load_model(str(tiny_model_dir("llama")))
    windows = load_windows(loaded, data, 2, 25, 0, None).ids
    stats = outlier_stats(loaded.adapter, windows, Progress())
    assert stats.ratios.shape == (2, loaded.adapter.info.num_layers, 25)
    # recompute layer 1 of window 1 by hand
    seen = {}
    site = loaded.adapter.mlp_down_site(1)
    handle = site.register_forward_pre_hook(lambda m, a: seen.setdefault("x", a[0]))
    with torch.no_grad():
        loaded.model(windows[1:2])
    handle.remove()
    top = seen["x"][0].abs().amax(-1)
    torch.testing.assert_close(stats.ratios[1, 1], top / top.median())


@pytest.mark.parametrize("eta", [1.0, 0.5, math.nan])
def test_eta_must_exceed_one(eta):
    with pytest.raises(KvqError, match="--eta"):
        PrefixQuantOptions(eta=eta)


def test_cli_records_the_statistic_and_inspect_shows_the_tokens(tiny_model_dir, data, tmp_path):
    args = ["--model", tiny_model_dir("gemma3"), "--dataset", data, "--samples", 2, "--seqlen", 24]
    bad = _run("calibrate", "prefixquant", *args, "--eta", 1, "--out", tmp_path / "x")
    _one_line_error(bad, "--eta")
    assert not (tmp_path / "x").exists()
    out = tmp_path / "pq"
    result = _run("calibrate", "prefixquant", *args, "--eta", 2.0, "--out", out)
    assert result.exit_code == 0, result.output + result.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    prefix = manifest["policy"]["_data"]["prefix"]
    assert prefix["token_ids"][0] == 2 and prefix["source"] == "prefixquant"
    report = manifest["passes"][-1]["report"]
    assert len(report["top_ratio_per_layer"]) == 4 and report["why"]
    assert manifest["ledger"]["prefix"] > 0
    shown = _run("inspect", out)
    assert shown.exit_code == 0
    assert "prefix" in shown.output and "top_ratio_per_layer" in shown.output


def test_a_transformed_base_keeps_its_transform_down_the_prefix_chain(
    tiny_model_dir, data, tmp_path
):
    """smoothattention -> prefixquant --base -> kv-scales --base: the transform is carried
    (not returned again as a new one), the prefix rows come from the smoothed model, and
    the last artifact serves both."""
    from kvq.artifacts.store import read_artifact
    from kvq.calibrators.prefix_state import extract_prefix
    from kvq.pipeline import apply_transforms

    model_dir = tiny_model_dir("llama")
    args = ["--model", model_dir, "--dataset", data, "--samples", 2, "--seqlen", 24]
    chain = [("smoothattention", ()), ("prefixquant", ("--eta", 2.0)),
             ("kv-scales", ("--format", "int8"))]  # fmt: skip
    previous = None
    for name, extra in chain:
        out = tmp_path / name
        base = ("--base", previous) if previous else ()
        result = _run("calibrate", name, *args, *extra, *base, "--out", out)
        assert result.exit_code == 0, result.output + result.stderr
        previous = out
    art = read_artifact(previous)
    assert [p.method for p in art.manifest.passes] == [n for n, _ in chain]
    smooth = read_artifact(tmp_path / "smoothattention").tensors
    assert all(torch.equal(art.tensors[n], t) for n, t in smooth.items() if ".smooth." in n)
    loaded = load_model(str(model_dir))
    apply_transforms(loaded, smooth)
    exact = extract_prefix(loaded, art.manifest.policy.prefix.token_ids, "x").tensors()
    assert all(torch.equal(art.tensors[n], t) for n, t in exact.items())
    run = ["--model", model_dir, "--dataset", data, "--windows", 1, "--seqlen", 16]
    assert _run("run-eval", *run, "--artifact", previous).exit_code == 0


def test_a_recipe_calibrates_static_scales_after_the_prefix_it_finds(
    tiny_model_dir, data, tmp_path
):
    """prefixquant then kv-scales in one command: the second pass takes the first's
    declared prefix as a --base would, and gives the same artifact as the two commands."""
    from kvq.artifacts.store import read_artifact

    model_dir = tiny_model_dir("gemma3")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"model: {model_dir}\ndataset: {data}\nsamples: 2\nseqlen: 24\npasses:\n"
        "  - prefixquant: {eta: 2.0}\n  - kv-scales: {format: int8, granularity: head}\n"
    )
    result = _run("calibrate", "recipe", recipe, "--out", tmp_path / "one")
    assert result.exit_code == 0, result.output + result.stderr
    args = ["--model", model_dir, "--dataset", data, "--samples", 2, "--seqlen", 24]
    result = _run("calibrate", "prefixquant", *args, "--eta", 2.0, "--out", tmp_path / "pq")
    assert result.exit_code == 0, result.output + result.stderr
    result = _run("calibrate", "kv-scales", *args, "--format", "int8", "--granularity",
                  "head", "--base", tmp_path / "pq", "--out", tmp_path / "two")  # fmt: skip
    assert result.exit_code == 0, result.output + result.stderr
    one, two = read_artifact(tmp_path / "one"), read_artifact(tmp_path / "two")
    assert one.manifest.policy == two.manifest.policy and one.manifest.policy.prefix
    assert one.tensors.keys() == two.tensors.keys()
    assert all(torch.equal(one.tensors[n], two.tensors[n]) for n in one.tensors)
