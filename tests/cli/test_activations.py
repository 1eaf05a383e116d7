"""kvq calibrate act-scales / kv-scales --prefix-ids and run-eval --activations, end to end."""

import json

import pytest

from tests.cli.test_cli import _one_line_error, _run


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("gemma3")


@pytest.fixture(scope="module")
def calib(shared_data):
    return shared_data / "calibration" / "groups_merged.txt"


def _calibrate(pass_name, model_dir, calib, out, *extra):
    args = ("calibrate", pass_name, "--model", model_dir, "--dataset", calib)
    return _run(*args, "--samples", 2, "--seqlen", 24, "--out", out, *extra)


def _eval(model_dir, calib, *extra):
    return _run("run-eval", "--model", model_dir, "--dataset", calib, "--windows", 2,
                "--seqlen", 24, *extra)  # fmt: skip


@pytest.fixture(scope="module")
def arts(model_dir, calib, tmp_path_factory):
    root = tmp_path_factory.mktemp("a8")
    made = {}
    for name, pass_name, extra in (
        ("act", "act-scales", ("--method", "percentile")),
        ("act-prefix", "act-scales", ("--prefix-ids", "2,7")),
        ("kv-prefix", "kv-scales", ("--format", "int8", "--granularity", "head",
                                    "--prefix-ids", "2,7")),
    ):  # fmt: skip
        result = _calibrate(pass_name, model_dir, calib, root / name, *extra)
        assert result.exit_code == 0, result.output + result.stderr
        made[name] = root / name
    return made


def test_act_scales_artifact_records_the_pass(arts):
    manifest = json.loads((arts["act-prefix"] / "manifest.json").read_text())
    assert manifest["passes"][0]["method"] == "act-scales"
    assert manifest["passes"][0]["options"]["prefix_ids"] == "2,7"
    assert "capture linear inputs" in manifest["passes"][0]["stage_seconds"]
    names = [n for n in manifest["tensors"] if n.startswith("act.layers.")]
    assert len(names) == 4 * 7 and all(n.endswith(".input_scale") for n in names)


def test_inspect_and_export_manifest_accept_it(arts):
    assert _run("inspect", arts["act"]).exit_code == 0
    assert _run("export", "manifest", arts["act"]).exit_code == 0


@pytest.mark.parametrize(
    "art, extra, mode, prefix",
    [
        ("act", ("--activations", "a8-static"), "a8-static", []),
        ("act-prefix", ("--activations", "a8-static"), "a8-static", [2, 7]),  # from the artifact
        ("kv-prefix", (), "none", [2, 7]),
        (None, ("--policy", "fp16", "--activations", "a8-dynamic"), "a8-dynamic", []),
    ],
)
def test_run_eval_reports_activations_beside_the_cache(
    arts, model_dir, calib, tmp_path, art, extra, mode, prefix
):
    source = ("--artifact", arts[art]) if art else ()
    out = tmp_path / "eval.json"
    result = _eval(model_dir, calib, *source, *extra, "--json", out)
    assert result.exit_code == 0, result.output + result.stderr
    report = json.loads(out.read_text())
    assert report["activations"]["mode"] == mode
    assert report["prefix_ids"] == prefix
    if mode != "none":
        assert report["activations"]["linears"] == 28
        assert report["activations"]["path"] == "reference fake-quant"
        assert f"activations {mode}" in " ".join(result.stdout.split())
    tasks = report["tasks"]
    assert tasks["ppl"]["scored_tokens"] == 2 * 23  # the prefix is never scored
    assert tasks["kld"]["mean"] > 0 or mode == "none"
    assert "bytes" in tasks


def test_a8_dynamic_changes_the_figures(model_dir, calib, tmp_path):
    reports = []
    for mode in ("none", "a8-dynamic"):
        out = tmp_path / f"{mode}.json"
        result = _eval(model_dir, calib, "--policy", "int8", "--activations", mode, "--json", out)
        assert result.exit_code == 0, result.output + result.stderr
        reports.append(json.loads(out.read_text())["tasks"])
    assert reports[0]["ppl"]["baseline"] == reports[1]["ppl"]["baseline"]
    assert reports[0]["kld"]["mean"] != reports[1]["kld"]["mean"]


@pytest.mark.parametrize(
    "extra, needle",
    [
        (("--policy", "int8", "--activations", "a8-static"), "needs --artifact"),
        (("--policy", "int8", "--activations", "a4"), "--activations must be one of"),
        (("--policy", "int8", "--prefix-ids", "x,1"), "--prefix-ids"),
        (("--policy", "int8", "--prefix-ids", "2"), "fewer than the 1-token prefix"),
        (("--policy", "fp16", "--prefix-ids", "99999"), "outside the vocabulary"),
        (("--policy", "fp16", "--prefix-ids", "2", "--protocol", "decode"), "prefill only"),
    ],
)
def test_run_eval_refuses_bad_input(model_dir, calib, tmp_path, extra, needle):
    out = tmp_path / "r.json"
    result = _eval(model_dir, calib, *extra, "--json", out)
    _one_line_error(result, needle)
    assert not out.exists()


def test_a8_static_without_scales_is_refused(model_dir, calib, tmp_path, arts):
    out = tmp_path / "r.json"
    art = arts["kv-prefix"]
    result = _eval(model_dir, calib, "--artifact", art, "--activations", "a8-static", "--json", out)
    _one_line_error(result, "kvq calibrate act-scales")
    assert not out.exists()


@pytest.mark.parametrize("text", ["bos", "1,-2", ""])
def test_calibrate_refuses_bad_prefix_ids(model_dir, calib, tmp_path, text):
    out = tmp_path / "a"
    result = _calibrate("act-scales", model_dir, calib, out, "--prefix-ids", text)
    if text == "":  # empty means no prefix
        assert result.exit_code == 0, result.output + result.stderr
        return
    _one_line_error(result, "--prefix-ids")
    assert not out.exists()


def test_calibrate_refuses_a_prefix_outside_the_vocabulary(model_dir, calib, tmp_path):
    out = tmp_path / "a"
    result = _calibrate("kv-scales", model_dir, calib, out, "--prefix-ids", "2,999999")
    _one_line_error(result, "outside the vocabulary")
    assert not out.exists()
