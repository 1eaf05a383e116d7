"""`kvq calibrate auto` and `kvq calibrate vq` through the CLI, then run-eval and generate."""

import json

import pytest

from tests.cli.test_cli import _one_line_error, _run


def _calibrate_auto(model_dir, calib_txt, out, bits, *extra, samples=4, trellis=False):
    """`kvq calibrate auto --bits bits` on samples x 32 tokens of the calibration text;
    the default --prefer speed (the layouts with Triton kernels) unless trellis."""
    return _run(
        "calibrate", "auto", "--model", model_dir, "--dataset", calib_txt, "--samples", samples,
        "--seqlen", 32, "--bits", bits, "--out", out, *extra,
        *(("--prefer", "quality") if trellis else ()),
    )  # fmt: skip


def _ok(result):
    assert result.exit_code == 0, result.output + result.stderr
    return result


@pytest.fixture(scope="module")
def auto_artifact(llama_dir, calib_txt, tmp_path_factory):
    """The 3-bit auto artifact of tiny Llama: every test here reads it, none changes it."""
    out = tmp_path_factory.mktemp("auto") / "a3"
    result = _ok(_calibrate_auto(llama_dir, calib_txt, out, 3))
    assert "auto3: vq3" in result.output  # the policy it chose, named in the output
    return out


def test_auto_records_its_choice_and_stays_within_the_bits(auto_artifact):
    manifest = json.loads((auto_artifact / "manifest.json").read_text())
    rotate, auto = manifest["passes"]  # the values are rotated first (AUTO_ROTATE[3])
    assert rotate["method"] == "rotate" and "layers.0.rotate.value" in manifest["tensors"]
    assert auto["method"] == "auto" and auto["options"]["bits"] == 3
    assert auto["options"]["method"].startswith("vq:")
    assert auto["options"]["method"].endswith("values rotated first (rotate pass)")
    assert any(
        s.startswith("auto 3 bits (--prefer balanced") and "): vq:" in s
        for s in auto["stage_seconds"]
    )
    assert auto["options"]["prefer"] == "balanced"
    assert auto["options"]["why"].startswith("--prefer balanced")
    layers = manifest["policy"]["_data"]["layers"]
    keys = [layer["key"]["bits"] for layer in layers]
    assert sum(keys) == 3 * len(keys)  # mixed precision, same total code bits
    # rotated values keep no exceptions (AUTO_V_OUTLIERS[3]): their bits widen value layers
    assert {layer["value"]["outlier_fraction"] for layer in layers} == {0.0}
    assert {layer["key"]["outlier_fraction"] for layer in layers} == {0.01}
    values = [layer["value"]["bits"] for layer in layers]
    assert sum(values) > 3 * len(values)
    assert "0% value outliers (the bits saved widen layers)" in auto["options"]["method"]
    assert {layer["key"]["format"] for layer in layers} == {"vq"}


def test_auto_artifact_evaluates_and_generates(auto_artifact, llama_dir, shared_data, tmp_path):
    report = tmp_path / "eval.json"
    _ok(_run(
        "run-eval", "--model", llama_dir, "--artifact", auto_artifact, "--dataset",
        "wikitext2", "--data-dir", shared_data, "--windows", 2, "--seqlen", 32, "--json", report,
    ))  # fmt: skip
    tasks = json.loads(report.read_text())["tasks"]
    # (a tiny model's 32 tokens do not amortise the static codebooks: no bytes bound here)
    assert tasks["ppl"]["quantized"] > 0 and tasks["bytes"]["kv_bytes_per_token"] > 0
    result = _ok(_run(
        "generate", "--model", llama_dir, "--artifact", auto_artifact,
        "--prompt", "The cache", "--max-new-tokens", 4,
    ))  # fmt: skip
    assert "4 new tokens in" in result.stderr


def test_inspect_shows_the_chosen_method_and_each_layer_side_width(auto_artifact):
    manifest = json.loads((auto_artifact / "manifest.json").read_text())
    layers = manifest["policy"]["_data"]["layers"]
    result = _ok(_run("inspect", auto_artifact))
    out = " ".join(result.output.split())  # the table wraps long cells
    assert "auto (bits=3, method=vq:" in out
    widths = [layer[side]["bits"] for side in ("key", "value") for layer in layers]
    keys = " ".join(str(layer["key"]["bits"]) for layer in layers)
    values = " ".join(str(layer["value"]["bits"]) for layer in layers)
    mean = sum(widths) / len(widths)  # above 3: the values' exception bits widen them
    assert f"code bits per layer: K {keys} | V {values} (mean {mean:.2f})" in out
    for layer in layers:  # each width with its codebook dimension, in the policy table
        for side in ("key", "value"):
            assert f"vq{layer[side]['bits']} {layer[side]['vector_dim']}-D codebook" in out


def test_decode_protocol_is_the_same_on_the_triton_kernel_and_the_reference(
    auto_artifact, llama_dir, shared_data, tmp_path
):
    """`run-eval --protocol decode` (one token at a time through the vq cache) with the
    Triton decode kernel (interpreted on CPU) and with the pure-torch reference."""
    tasks = {}
    for backend in ("reference", "triton"):
        report = tmp_path / f"{backend}.json"
        _ok(_run(
            "run-eval", "--model", llama_dir, "--artifact", auto_artifact, "--data-dir",
            shared_data, "--windows", 1, "--seqlen", 20, "--protocol", "decode", "--tasks",
            "ppl,kld", "--backend", backend, "--json", report,
        ))  # fmt: skip
        assert json.loads(report.read_text())["protocol"] == "decode"
        tasks[backend] = json.loads(report.read_text())["tasks"]
    ref, tri = tasks["reference"], tasks["triton"]
    assert ref["ppl"]["quantized"] != ref["ppl"]["baseline"]  # the cache is really quantized
    assert tri["ppl"]["quantized"] == pytest.approx(ref["ppl"]["quantized"], rel=1e-5)
    assert tri["kld"]["mean"] == pytest.approx(ref["kld"]["mean"], rel=1e-3, abs=1e-7)


def test_a_base_artifact_of_another_model_is_one_line(
    auto_artifact, tiny_model_dir, calib_txt, tmp_path
):
    gemma = tiny_model_dir("gemma3")
    # (--no-rotate: a rotating auto refuses any quantized base before the model loads)
    result = _calibrate_auto(
        gemma, calib_txt, tmp_path / "x", 3, "--base", auto_artifact, "--no-rotate", samples=2
    )
    _one_line_error(result, "incompatible artifact", "identity.model_type", "llama")
    assert not (tmp_path / "x").exists()  # nothing half-written


@pytest.mark.parametrize(
    "args,needle",
    [
        (["auto", "--bits", "5"], "--bits must be 2, 3 or 4 for auto"),
        (["auto", "--bits", "5", "--no-rotate"], "--bits must be 2, 3 or 4 for auto"),
        (["vq", "--bits", "5"], "--bits must be 1, 2, 3 or 4"),
        (["vq", "--bits", "4", "--dim", "4"], "4096 centroids"),
        (["vq", "--dim", "3"], "--dim must be"),
        (["vq", "--mixed", "sideways"], "--mixed must be none, fisher or loss"),
        (["kvquant", "--mixed", "fisher"], "--mixed must be none or loss for kvquant"),
        (["kvquant", "--bits", "2", "--mixed", "loss"], "NUQ has no 1-bit width"),
    ],
)
def test_bad_options_are_one_line_before_loading(args, needle, llama_dir, tmp_path):
    result = _run(
        "calibrate", *args, "--model", llama_dir, "--dataset", "wikitext2",
        "--out", tmp_path / "x",
    )  # fmt: skip
    assert result.exit_code == 2, result.output
    assert needle in result.stderr and "Traceback" not in result.output


def test_auto_runs_scalar_kvquant_where_the_table_says(llama_dir, calib_txt, tmp_path, monkeypatch):
    from kvq.calibrators import options

    monkeypatch.setitem(options.AUTO_CHOICES, 2, ("kvquant", 0, "none"))
    out = tmp_path / "a2"
    result = _ok(_calibrate_auto(llama_dir, calib_txt, out, 2))
    assert "auto2: kvquant-nuq2" in result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["passes"][-1]["options"]["method"].startswith("kvquant:")
    layers = manifest["policy"]["_data"]["layers"]
    assert {(layer["key"]["format"], layer["key"]["bits"]) for layer in layers} == {("nuq", 2)}
    _ok(_run(
        "run-eval", "--model", llama_dir, "--artifact", out, "--dataset", calib_txt,
        "--windows", 2, "--seqlen", 32, "--tasks", "ppl,bytes",
    ))  # fmt: skip


def test_vq_mixed_loss_writes_a_loadable_artifact_with_its_widths_and_table(
    tiny_model_dir, calib_txt, tmp_path
):
    """`kvq calibrate vq --mixed loss` on tiny Gemma 3: the manifest records the option and
    every layer-side's width, the measured table travels as provenance, and the artifact
    evaluates."""
    from kvq.artifacts.store import read_artifact

    gemma, out = tiny_model_dir("gemma3"), tmp_path / "loss"
    result = _ok(_run(
        "calibrate", "vq", "--model", gemma, "--dataset", calib_txt, "--samples", 2,
        "--seqlen", 32, "--bits", 2, "--dim", 2, "--mixed", "loss", "--out", out,
    ))  # fmt: skip
    assert "measure layer-side KLD" in result.output + result.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["passes"][-1]["options"]["mixed"] == "loss"
    layers = manifest["policy"]["_data"]["layers"]
    widths = [layer[side]["bits"] for layer in layers for side in ("key", "value")]
    assert sum(widths) <= 2 * len(widths) and set(widths) <= {1, 2, 3}
    tensors = read_artifact(out).tensors
    assert tuple(tensors["mixed.kld"].shape) == (len(layers), 2, 3)
    assert tensors["mixed.widths"].tolist() == [1, 2, 3]
    _ok(_run(
        "run-eval", "--model", gemma, "--artifact", out, "--dataset", calib_txt,
        "--windows", 1, "--seqlen", 32, "--tasks", "ppl,kld",
    ))  # fmt: skip


def test_no_rotate_runs_auto_alone_and_a_quantized_base_says_so(llama_dir, calib_txt, tmp_path):
    plain = tmp_path / "plain"
    _ok(_calibrate_auto(llama_dir, calib_txt, plain, 4, "--no-rotate", samples=2))
    manifest = json.loads((plain / "manifest.json").read_text())
    assert [p["method"] for p in manifest["passes"]] == ["auto"]
    assert not any(".rotate." in n for n in manifest["tensors"])
    # the rotation would change the values the base's qparams were calibrated on
    result = _calibrate_auto(llama_dir, calib_txt, tmp_path / "x", 3, "--base", plain, samples=2)
    _one_line_error(result, "rotate transforms the model", "--no-rotate skips it")
    assert not (tmp_path / "x").exists()


def test_values_drop_their_exceptions_only_when_rotated():
    """AUTO_V_OUTLIERS applies to rotated values; --no-rotate keeps the 1% (outlier channels
    are still there), and the method text says which."""
    from kvq.calibrators.options import AUTO_V_OUTLIERS, AutoOptions

    def auto(bits, **kw):
        return AutoOptions(bits=bits, **kw)

    assert AUTO_V_OUTLIERS[2] == AUTO_V_OUTLIERS[3] == 0.0 and AUTO_V_OUTLIERS[4] is None
    assert auto(4).chosen().value_outliers == 0.01  # measured worse without
    rotated, plain = auto(3).chosen(), auto(3, rotate=False).chosen()
    assert rotated.value_outliers == 0.0 and rotated.outliers == 0.01
    assert plain.value_outliers == plain.outliers == 0.01
    assert "1% exact outliers" in auto(3, rotate=False).method()


def test_keys_drop_their_exceptions_at_2_bits_only():
    """AUTO_K_OUTLIERS: the rotated 2-bit chain spends the keys' exception bytes on layers
    (measured ahead there); 3 and 4 bits keep 1%; --no-rotate keeps everything."""
    from kvq.calibrators.options import AutoOptions

    def auto(bits, **kw):
        return AutoOptions(bits=bits, **kw)

    two, three = auto(2).chosen(), auto(3).chosen()
    assert two.outliers_of("key") == 0.0 and two.outliers_of("value") == 0.0
    assert three.outliers_of("key") == 0.01 and auto(4).chosen().outliers_of("key")
    assert auto(2, rotate=False).chosen().outliers_of("key") == 0.01
    text = auto(2).method()
    assert "0% exact key outliers, 0% value outliers (the bits saved widen layers)" in text


def test_auto_prefer_quality_runs_trellis_codes_and_charges_their_tables(
    llama_dir, calib_txt, tmp_path
):
    """--prefer quality: rotate -> trellis with AUTO_TRELLIS's settings, named in the
    output and manifest. Its tables are charged to the code bits over --seqlen tokens,
    which 32 tokens of a tiny model cannot pay: a one-line error says what to do."""
    from kvq.calibrators.options import AUTO_TRELLIS

    out = tmp_path / "t3"
    result = _ok(_calibrate_auto(llama_dir, calib_txt, out, 3, "--static-tokens", 0, trellis=True))
    assert "auto3: trellis3-w12" in result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert [p["method"] for p in manifest["passes"]] == ["rotate", "auto"]
    method = manifest["passes"][-1]["options"]["method"]
    assert method.startswith("trellis:") and "12-bit bit-shift trellis codes" in method
    layers = manifest["policy"]["_data"]["layers"]
    assert {layer[s]["format"] for layer in layers for s in ("key", "value")} == {"trellis"}
    mixed, k_outliers, v_outliers = AUTO_TRELLIS[3]
    assert {layer["value"]["outlier_fraction"] for layer in layers} == {v_outliers}
    charged = _calibrate_auto(llama_dir, calib_txt, tmp_path / "x", 3, trellis=True)
    _one_line_error(charged, "raise --static-tokens")
    assert not (tmp_path / "x").exists()


def test_prefer_picks_the_measured_trade_off_and_says_why():
    """--prefer speed|balanced|quality: scalar NUQ where it meets the width's budget, vector
    codebooks (balanced, the default) or trellis codes; the recorded options say why."""
    from kvq.calibrators.options import (
        AutoOptions,
        KVQuantOptions,
        TrellisOptions,
        VQOptions,
    )
    from kvq.errors import KvqError

    kinds = {
        (bits, prefer): type(AutoOptions(bits=bits, prefer=prefer).chosen())
        for bits in (2, 3, 4)
        for prefer in ("speed", "balanced", "quality")
    }
    assert kinds[3, "speed"] is KVQuantOptions and kinds[4, "speed"] is KVQuantOptions
    assert kinds[2, "speed"] is VQOptions  # scalar NUQ2 misses the 2-bit budget
    assert kinds[3, "balanced"] is VQOptions and kinds[2, "balanced"] is VQOptions
    assert all(kinds[b, "quality"] is TrellisOptions for b in (2, 3, 4))
    assert AutoOptions().prefer == "balanced"
    recorded = AutoOptions(bits=3, prefer="speed").as_dict()
    assert recorded["prefer"] == "speed" and recorded["why"].startswith("--prefer speed")
    with pytest.raises(KvqError, match="--prefer must be speed, balanced or quality"):
        AutoOptions(prefer="fast")
