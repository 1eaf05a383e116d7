"""kvq calibrate act-scales / kv-scales with a declared prefix (a prefixquant --base or
--prefix-ids) and run-eval --activations with such artifacts, end to end."""

import json

import pytest
import torch
from safetensors.torch import load_file

from kvq.artifacts.compat import load_artifact
from kvq.artifacts.store import Artifact, read_artifact, write_artifact
from kvq.manifests.schema import manifest_from_json, manifest_to_json
from kvq.models.loading import load_model
from kvq.pipeline import cache_for
from kvq.quant.schemes import PrefixSpec
from kvq.runtime.activations import quantized_linear_inputs, static_scales
from tests.cli.test_cli import _one_line_error, _run

SEQLEN = 24


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("gemma3")


def _calibrate(pass_name, model_dir, calib_txt, out, *extra):
    args = ("calibrate", pass_name, "--model", model_dir, "--dataset", calib_txt)
    return _run(*args, "--samples", 2, "--seqlen", SEQLEN, "--out", out, *extra)


def _eval(model_dir, calib_txt, *extra):
    return _run("run-eval", "--model", model_dir, "--dataset", calib_txt, "--windows", 2,
                "--seqlen", SEQLEN, *extra)  # fmt: skip


def _report(model_dir, calib_txt, out, *extra):
    result = _eval(model_dir, calib_txt, *extra, "--json", out)
    assert result.exit_code == 0, result.output + result.stderr
    return json.loads(out.read_text()), result


@pytest.fixture(scope="module")
def arts(model_dir, calib_txt, tmp_path_factory):
    root = tmp_path_factory.mktemp("a8")
    made = {}
    for name, pass_name, extra in (
        ("act", "act-scales", ("--method", "percentile")),
        ("pq", "prefixquant", ("--eta", 2.0)),
        ("act-pq", "act-scales", ("--base", root / "pq")),
        ("kv-pq", "kv-scales", ("--format", "int8", "--granularity", "head",
                                "--base", root / "pq")),
        ("act-ids", "act-scales", ("--prefix-ids", "2,7")),
    ):  # fmt: skip
        result = _calibrate(pass_name, model_dir, calib_txt, root / name, *extra)
        assert result.exit_code == 0, result.output + result.stderr
        made[name] = root / name
    return made


def _manifest(art):
    return json.loads((art / "manifest.json").read_text())


def test_prefix_ids_declare_the_prefix(arts):
    manifest = _manifest(arts["act-ids"])
    assert manifest["passes"][0]["method"] == "act-scales"
    assert manifest["passes"][0]["options"]["prefix_ids"] == "2,7"
    assert "capture linear inputs" in manifest["passes"][0]["stage_seconds"]
    prefix = manifest["policy"]["_data"]["prefix"]
    assert prefix["token_ids"] == [2, 7] and prefix["source"] == "prefix-ids"
    assert manifest["policy"]["_data"]["name"] == "fp16"
    assert manifest["ledger"]["prefix"] > 0
    names = [n for n in manifest["tensors"] if n.startswith("act.layers.")]
    assert len(names) == 4 * 7 and all(n.endswith(".input_scale") for n in names)
    assert {f"layers.{i}.prefix.{s}" for i in range(4) for s in ("key", "value")} <= set(
        manifest["tensors"]
    )


@pytest.mark.parametrize("name, method, policy", [("act-pq", "act-scales", None),
                                                  ("kv-pq", "kv-scales", "kv-scales-int8-head")])  # fmt: skip
def test_a_prefix_base_passes_its_declared_prefix_on(arts, name, method, policy):
    base, made = _manifest(arts["pq"]), _manifest(arts[name])
    assert [p["method"] for p in made["passes"]] == ["prefixquant", method]
    assert made["policy"]["_data"]["prefix"] == base["policy"]["_data"]["prefix"]
    assert made["policy"]["_data"]["name"] == (policy or base["policy"]["_data"]["name"])
    assert made["ledger"]["prefix"] == base["ledger"]["prefix"] > 0
    rows = load_file(arts["pq"] / "tensors.safetensors")
    got = load_file(arts[name] / "tensors.safetensors")
    prefix_rows = [n for n in rows if ".prefix." in n]
    assert prefix_rows and all(torch.equal(got[n], rows[n]) for n in prefix_rows)


def test_prefix_ids_and_a_prefix_base_are_one_code_path(arts, model_dir, calib_txt, tmp_path):
    """--prefix-ids with the base's token ids builds the same declared prefix (exact rows
    from the same model), so the same statistics and the same scales, bit for bit."""
    ids = _manifest(arts["pq"])["policy"]["_data"]["prefix"]["token_ids"]
    out = tmp_path / "kv-ids"
    result = _calibrate("kv-scales", model_dir, calib_txt, out, "--format", "int8",
                        "--granularity", "head", "--prefix-ids", ",".join(map(str, ids)))  # fmt: skip
    assert result.exit_code == 0, result.output + result.stderr
    a, b = read_artifact(out), read_artifact(arts["kv-pq"])
    assert a.manifest.policy.prefix.token_ids == b.manifest.policy.prefix.token_ids
    assert a.tensors.keys() == b.tensors.keys()
    assert all(torch.equal(a.tensors[n], b.tensors[n]) for n in a.tensors)


def test_inspect_and_export_manifest_accept_them(arts):
    for name in ("act", "act-ids"):
        assert _run("inspect", arts[name]).exit_code == 0
        assert _run("export", "manifest", arts[name]).exit_code == 0


@pytest.mark.parametrize(
    "art, extra, mode",
    [
        ("act", ("--activations", "a8-static"), "a8-static"),
        ("act-pq", ("--activations", "a8-static"), "a8-static"),
        ("act-ids", ("--activations", "a8-static"), "a8-static"),
        ("kv-pq", ("--activations", "a8-dynamic"), "a8-dynamic"),
        ("kv-pq", (), "none"),
        (None, ("--policy", "fp16", "--prefix-ids", "2,7", "--activations", "a8-dynamic"),
         "a8-dynamic"),
        (None, ("--policy", "int8", "--activations", "a8-dynamic"), "a8-dynamic"),
    ],
)  # fmt: skip
def test_run_eval_reports_activations_beside_the_cache(
    arts, model_dir, calib_txt, tmp_path, art, extra, mode
):
    source = ("--artifact", arts[art]) if art else ()
    report, result = _report(model_dir, calib_txt, tmp_path / "eval.json", *source, *extra)
    assert report["activations"]["mode"] == mode
    declared = _manifest(arts[art])["policy"]["_data"].get("prefix") if art else None
    if "--prefix-ids" in extra:
        assert report["prefix"] == [2, 7] and report["prefix_source"] == "prefix-ids"
    elif declared is not None:
        assert report["prefix"] == declared["token_ids"]
    else:
        assert report["prefix"] is None
    if mode != "none":
        assert report["activations"]["linears"] == 28
        assert report["activations"]["path"] == "reference fake-quant"
        assert f"activations {mode}" in " ".join(result.stdout.split())
    tasks = report["tasks"]
    # the prefix is never scored; it starts with BOS and supplies the windows' own
    scored = SEQLEN - 1 - (report["prefix"] is not None)
    assert tasks["ppl"]["scored_tokens"] == 2 * scored
    assert tasks["kld"]["mean"] > 0
    assert tasks["bytes"]["ledger"]["prefix"] > 0 or report["prefix"] is None


def test_an_fp16_cache_after_the_prefix_is_a_plain_forward_over_prefix_and_prompt(
    arts, model_dir, calib_txt, tmp_path
):
    """run-eval's baseline is the unquantized model over prefix + window: with an fp16 cache
    seeded with the exact prefix, only the cache's fp16 rounding separates the two; and
    --prefix-ids on a policy serves the very prefix the act-scales artifact declares."""
    art, _ = _report(model_dir, calib_txt, tmp_path / "a.json", "--artifact", arts["act-ids"])
    ids, _ = _report(model_dir, calib_txt, tmp_path / "b.json", "--policy", "fp16",
                     "--prefix-ids", "2,7")  # fmt: skip
    for report in (art, ids):
        assert report["tasks"]["kld"]["mean"] < 1e-5
        assert abs(report["tasks"]["ppl"]["ratio"] - 1) < 1e-3
        assert report["tasks"]["kld"]["top1_agreement"] == 1.0
    assert art["tasks"]["ppl"] == ids["tasks"]["ppl"] and art["tasks"]["kld"] == ids["tasks"]["kld"]
    # the same, logits by logits, through the library
    loaded = load_model(str(model_dir))
    artifact = load_artifact(arts["act-ids"], loaded)
    prompt = torch.randint(3, 300, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = loaded.model(torch.cat([torch.tensor([[2, 7]]), prompt], 1)).logits[:, 2:]
        got = loaded.model(prompt, cache=cache_for(loaded, artifact=artifact)).logits
    torch.testing.assert_close(got, want, atol=5e-4, rtol=1e-3)


def test_the_decode_protocol_serves_the_prefix_too(arts, model_dir, calib_txt, tmp_path):
    report, _ = _report(model_dir, calib_txt, tmp_path / "d.json", "--artifact", arts["act-ids"],
                        "--protocol", "decode", "--activations", "a8-static")  # fmt: skip
    users = SEQLEN - 1  # the prefix supplies BOS
    assert report["tasks"]["ppl"]["scored_tokens"] == 2 * (users - 1 - users // 2)
    assert report["prefix"] == [2, 7] and report["tasks"]["kld"]["mean"] > 0
    plain, _ = _report(model_dir, calib_txt, tmp_path / "p.json", "--artifact", arts["act-ids"],
                       "--protocol", "decode")  # fmt: skip
    assert plain["tasks"]["kld"]["mean"] < 1e-5  # fp16 cache + exact prefix: a plain forward


@pytest.mark.parametrize("name, mode", [("act-pq", "a8-static"), ("kv-pq", "a8-dynamic")])
def test_left_padded_and_unpadded_batches_agree_with_a8_and_a_prefix(arts, model_dir, name, mode):
    loaded = load_model(str(model_dir))
    artifact = load_artifact(arts[name], loaded)
    scales = static_scales(artifact.tensors, loaded.adapter) if mode == "a8-static" else None
    g = torch.Generator().manual_seed(3)
    rows = [torch.randint(3, 300, (n,), generator=g) for n in (14, 5)]
    width = max(r.numel() for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - r.numel() :], mask[i, width - r.numel() :] = r, 1
    model = loaded.model
    positions = (mask.cumsum(1) - 1).clamp(min=0)  # as generate() numbers a padded batch
    with torch.no_grad(), quantized_linear_inputs(loaded.adapter, mode, scales):
        cache = cache_for(loaded, artifact=artifact)
        padded = model(ids, attention_mask=mask, position_ids=positions, cache=cache).logits
        step = model(torch.tensor([[9], [9]]), cache=cache,
                     attention_mask=torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1),
                     position_ids=positions[:, -1:] + 1).logits  # fmt: skip
        for i, r in enumerate(rows):
            alone_cache = cache_for(loaded, artifact=artifact)
            alone = model(r[None], cache=alone_cache).logits[0]
            torch.testing.assert_close(padded[i, width - r.numel() :], alone, atol=2e-4, rtol=1e-4)
            nxt = model(torch.tensor([[9]]), cache=alone_cache).logits[0]
            torch.testing.assert_close(step[i], nxt, atol=2e-4, rtol=1e-4)
    assert cache.nbytes().prefix > 0


def test_a8_dynamic_changes_the_figures(model_dir, calib_txt, tmp_path):
    reports = []
    for mode in ("none", "a8-dynamic"):
        report, _ = _report(model_dir, calib_txt, tmp_path / f"{mode}.json", "--policy", "int8",
                            "--activations", mode)  # fmt: skip
        reports.append(report["tasks"])
    assert reports[0]["ppl"]["baseline"] == reports[1]["ppl"]["baseline"]
    assert reports[0]["kld"]["mean"] != reports[1]["kld"]["mean"]


@pytest.mark.parametrize(
    "extra, needle",
    [
        (("--policy", "int8", "--activations", "a8-static"), "needs --artifact"),
        (("--policy", "int8", "--activations", "a4"), "--activations must be one of"),
        (("--policy", "int8", "--prefix-ids", "x,1"), "--prefix-ids"),
        (("--policy", "fp16", "--prefix-ids", "99999"), "outside the vocabulary"),
    ],
)
def test_run_eval_refuses_bad_input(model_dir, calib_txt, tmp_path, extra, needle):
    out = tmp_path / "r.json"
    result = _eval(model_dir, calib_txt, *extra, "--json", out)
    _one_line_error(result, needle)
    assert not out.exists()


def test_a8_static_without_scales_is_refused(model_dir, calib_txt, tmp_path, arts):
    out = tmp_path / "r.json"
    art = arts["kv-pq"]
    result = _eval(
        model_dir, calib_txt, "--artifact", art, "--activations", "a8-static", "--json", out
    )
    _one_line_error(result, "kvq calibrate act-scales")
    assert not out.exists()


def test_a_second_prefix_is_refused(model_dir, calib_txt, tmp_path, arts):
    out = tmp_path / "r.json"
    result = _eval(model_dir, calib_txt, "--artifact", arts["kv-pq"], "--prefix-ids", "2",
                   "--json", out)  # fmt: skip
    _one_line_error(result, "--prefix-ids", "declares its own prefix")
    assert not out.exists()
    for pass_name in ("kv-scales", "act-scales"):
        made = tmp_path / pass_name
        result = _calibrate(pass_name, model_dir, calib_txt, made, "--base", arts["pq"],
                            "--prefix-ids", "2,7")  # fmt: skip
        _one_line_error(result, "--prefix-ids", "already declares a prefix")
        assert not made.exists()


def _forge(art, out, change):
    """A copy of `art` whose manifest `change(d)` edits (tensors re-hashed by the writer)."""
    good = read_artifact(art)
    d = json.loads(json.dumps(manifest_to_json(good.manifest)))  # plain JSON values
    change(d, good.manifest)
    write_artifact(Artifact(manifest_from_json(d), good.tensors), out)
    return out


def test_a_base_prefix_made_with_another_tokenizer_is_refused(model_dir, calib_txt, tmp_path, arts):
    def other_tokenizer(d, manifest):
        spec = manifest.policy.prefix
        other = PrefixSpec(spec.token_ids, "0" * 64, spec.source)
        d["policy"] = json.loads(json.dumps(manifest.policy.with_prefix(other).to_json()))

    forged = _forge(arts["pq"], tmp_path / "forged", other_tokenizer)
    for pass_name in ("kv-scales", "act-scales"):
        out = tmp_path / pass_name
        result = _calibrate(pass_name, model_dir, calib_txt, out, "--base", forged)
        _one_line_error(result, "another tokenizer")
        assert not out.exists()


def test_a_prefix_kept_only_in_the_pass_options_is_refused(model_dir, calib_txt, tmp_path, arts):
    """Artifacts from before the prefix was declared state recorded --prefix-ids in the
    pass options only: served without it, their figures would be wrong; refused."""

    def undeclared(d, manifest):
        d["passes"][0]["options"]["prefix_ids"] = "2,7"

    legacy = _forge(arts["act"], tmp_path / "legacy", undeclared)
    out = tmp_path / "r.json"
    result = _eval(model_dir, calib_txt, "--artifact", legacy, "--activations", "a8-static",
                   "--json", out)  # fmt: skip
    _one_line_error(result, "--prefix-ids 2,7", "declares no prefix")
    assert not out.exists()
    made = tmp_path / "chained"
    result = _calibrate("kv-scales", model_dir, calib_txt, made, "--base", legacy)
    _one_line_error(result, "declares no prefix")
    assert not made.exists()


@pytest.mark.parametrize("text", ["bos", "1,-2", ""])
def test_calibrate_refuses_bad_prefix_ids(model_dir, calib_txt, tmp_path, text):
    out = tmp_path / "a"
    result = _calibrate("act-scales", model_dir, calib_txt, out, "--prefix-ids", text)
    if text == "":  # empty means no prefix
        assert result.exit_code == 0, result.output + result.stderr
        assert _manifest(out)["policy"]["_data"].get("prefix") is None
        return
    _one_line_error(result, "--prefix-ids")
    assert not out.exists()


def test_calibrate_refuses_a_prefix_outside_the_vocabulary(model_dir, calib_txt, tmp_path):
    out = tmp_path / "a"
    result = _calibrate("kv-scales", model_dir, calib_txt, out, "--prefix-ids", "2,999999")
    _one_line_error(result, "outside the vocabulary")
    assert not out.exists()
