"""The kvq CLI end to end on a tiny local model, through typer's CliRunner."""

import json

import pytest
import typer
from typer.testing import CliRunner

from kvq.cli.app import app

runner = CliRunner()


def _run(*args):
    return runner.invoke(app, [str(a) for a in args])


def _quick_calibrate(model_dir, calib_txt, *extra):
    """channel-scales on 1 x 16 tokens: a calibration that runs in a second (refusals, flags)."""
    args = ["--model", model_dir, "--dataset", calib_txt, "--samples", 1, "--seqlen", 16]
    return _run("calibrate", "channel-scales", *args, *extra)


def _one_line_error(result, *needles):
    assert result.exit_code == 2, result.output
    # progress bars may precede it; the error itself is exactly one line, the last
    err = result.stderr.strip().splitlines()[-1]
    assert [ln for ln in result.stderr.splitlines() if "error" in ln.lower()] == [err]
    assert err.startswith("kvq: error:"), err
    assert "Traceback" not in result.output
    for n in needles:
        assert n in err, err


@pytest.fixture(scope="module")
def artifact(llama_dir, calib_txt, tmp_path_factory):
    out = tmp_path_factory.mktemp("art") / "int4"
    result = _run(
        "calibrate",
        "channel-scales",
        "--model",
        llama_dir,
        "--dataset",
        calib_txt,
        "--samples",
        2,
        "--seqlen",
        32,
        "--bits",
        4,
        "--v-group",
        8,
        "--out",
        out,
    )
    assert result.exit_code == 0, result.output + result.stderr
    return out


def test_calibrate_writes_a_valid_artifact(artifact):
    assert (artifact / "manifest.json").is_file()
    assert (artifact / "tensors.safetensors").is_file()
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["passes"][0]["method"] == "channel-scales"
    assert manifest["passes"][0]["dataset"]["samples"] == 2
    assert manifest["ledger"]["codes"] > 0
    assert set(manifest["passes"][0]["stage_seconds"]) >= {"capture keys", "fit key ranges"}


def test_calibrate_refuses_to_overwrite(artifact, llama_dir, calib_txt):
    _one_line_error(_quick_calibrate(llama_dir, calib_txt, "--out", artifact), "--overwrite")


def test_export_manifest_writes_schema(artifact, tmp_path):
    import jsonschema

    schema_path = tmp_path / "schema.json"
    result = _run("export", "manifest", artifact, "--schema-out", schema_path)
    assert result.exit_code == 0, result.output
    schema = json.loads(schema_path.read_text())
    jsonschema.validate(json.loads((artifact / "manifest.json").read_text()), schema)


def test_inspect_shows_ledger_and_validation(artifact):
    result = _run("inspect", artifact)
    assert result.exit_code == 0, result.output
    assert "validation: OK" in result.output
    assert "bits per K/V element" in result.output


def test_run_eval_json_shape(artifact, llama_dir, shared_data, tmp_path):
    out = tmp_path / "eval.json"
    result = _run(
        "run-eval",
        "--model",
        llama_dir,
        "--artifact",
        artifact,
        "--dataset",
        "wikitext2",
        "--data-dir",
        shared_data,
        "--windows",
        2,
        "--seqlen",
        32,
        "--json",
        out,
    )
    assert result.exit_code == 0, result.output + result.stderr
    report = json.loads(out.read_text())
    for key in ("model", "artifact", "dataset", "protocol", "windows", "seqlen", "seed", "tasks"):
        assert key in report
    tasks = report["tasks"]
    assert set(tasks["ppl"]) >= {"baseline", "quantized", "ratio"}
    assert set(tasks["kld"]) == {"mean", "top1_agreement", "interval95"}
    assert set(tasks["bytes"]) >= {"kv_bytes_per_token", "fp16_bytes_per_token", "ratio"}
    assert tasks["ppl"]["ratio"] == pytest.approx(
        tasks["ppl"]["quantized"] / tasks["ppl"]["baseline"]
    )
    assert 0 < tasks["bytes"]["ratio"] < 1


def test_run_eval_quantizes_one_side_alone(artifact, llama_dir, shared_data, tmp_path):
    """--quantize keys / values keeps the other side at full precision (the model's dtype):
    the quantized parts of the two measured ledgers add up to those of both sides."""
    reports = {}
    for side in ("both", "keys", "values"):
        out = tmp_path / f"{side}.json"
        result = _run(
            "run-eval", "--model", llama_dir, "--artifact", artifact, "--data-dir", shared_data,
            "--windows", 2, "--seqlen", 32, "--quantize", side, "--json", out,
        )  # fmt: skip
        assert result.exit_code == 0, result.output + result.stderr
        reports[side] = json.loads(out.read_text())
        assert reports[side]["quantize"] == side
    ledger = {side: r["tasks"]["bytes"]["ledger"] for side, r in reports.items()}
    for part in ("codes", "qparams"):
        assert 0 < ledger["keys"][part] < ledger["both"][part]
        assert ledger["keys"][part] + ledger["values"][part] == ledger["both"][part]
    assert ledger["both"]["full_precision"] == 0
    assert ledger["keys"]["full_precision"] > 0 and ledger["values"]["full_precision"] > 0


def test_run_eval_refuses_an_unknown_side(artifact, llama_dir):
    result = _run("run-eval", "--model", llama_dir, "--artifact", artifact, "--quantize", "k")
    _one_line_error(result, "--quantize", "keys")


def test_run_eval_decode_protocol_with_named_policy(llama_dir, shared_data):
    result = _run(
        "run-eval",
        "--model",
        llama_dir,
        "--policy",
        "int8",
        "--data-dir",
        shared_data,
        "--windows",
        1,
        "--seqlen",
        16,
        "--protocol",
        "decode",
        "--tasks",
        "ppl,kld",
    )
    assert result.exit_code == 0, result.output + result.stderr
    assert "perplexity" in result.output


def test_generate(artifact, llama_dir):
    result = _run(
        "generate",
        "--model",
        llama_dir,
        "--artifact",
        artifact,
        "--prompt",
        "The cache",
        "--max-new-tokens",
        4,
    )
    assert result.exit_code == 0, result.output + result.stderr
    assert "4 new tokens in" in result.stderr and "tokens/s" in result.stderr


def test_generate_prefills_a_long_prompt_on_the_triton_backend(llama_dir):
    """`kvq generate --backend triton` (interpreted) prefills a prompt of more query rows per
    KV head than a kernel program holds (2 query heads per KV head x 32 positions) in
    chunks, and writes the reference backend's text."""
    from tests.conftest import tiny_tokenizer

    prompt = "The cache stores packed codes and the kernels read them back " * 3
    assert len(tiny_tokenizer()(prompt)["input_ids"]) > 32
    text = {}
    for backend in ("reference", "triton"):
        args = ("--policy", "int4", "--prompt", prompt, "--max-new-tokens", 4)
        result = _run("generate", "--model", llama_dir, *args, "--backend", backend)
        assert result.exit_code == 0, result.output + result.stderr
        text[backend] = result.stdout
    assert text["triton"] == text["reference"] and text["triton"].strip()


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--policy", "nope"], "unknown policy"),
        (["--artifact", "/no/such/artifact"], "does not exist"),
        (["--policy", "int4", "--backend", "cuda"], "backend"),
    ],
)
def test_generate_refuses_bad_input_before_loading_the_model(args, needle):
    # the model path does not exist either: the error must be about the input checked first
    result = _run("generate", "--model", "/no/such/model", "--prompt", "x", *args)
    _one_line_error(result, needle)
    assert "/no/such/model" not in result.stderr


def test_artifact_for_another_model_is_refused(artifact, tiny_model_dir, shared_data):
    result = _run(
        "run-eval",
        "--model",
        tiny_model_dir("qwen2"),
        "--artifact",
        artifact,
        "--data-dir",
        shared_data,
        "--windows",
        1,
        "--seqlen",
        16,
    )
    _one_line_error(result, "incompatible artifact", "expected", "found")


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--model", "/no/such/model"], "does not exist"),
        (["--dataset", "/no/such/file.txt"], "does not exist"),
        (["--bits", "5"], "--bits"),
        (["--seqlen", "0"], "--seqlen"),
        (["--samples", "-1"], "--samples"),
        (["--key-stage", "sideways"], "--key-stage"),
        (["--bits", "four"], "--bits"),
    ],
)
def test_bad_calibrate_input_is_one_line_exit_2(args, needle, llama_dir, calib_txt, tmp_path):
    base = {
        "--model": str(llama_dir),
        "--dataset": str(calib_txt),
        "--out": str(tmp_path / "a"),
        "--samples": "1",
        "--seqlen": "16",
    }
    for flag, value in zip(args[::2], args[1::2], strict=True):
        base[flag] = value
    flat = [x for kv in base.items() for x in kv]
    result = _run("calibrate", "channel-scales", *flat)
    _one_line_error(result, needle)
    assert not (tmp_path / "a").exists()


def test_missing_required_option_is_one_line(llama_dir):
    result = _run("calibrate", "channel-scales", "--model", llama_dir)
    _one_line_error(result, "--dataset")


def test_missing_artifact_and_unknown_policy(llama_dir, tmp_path):
    _one_line_error(_run("inspect", tmp_path / "nothing"), "no such artifact")
    _one_line_error(_run("run-eval", "--model", llama_dir, "--policy", "int5"), "unknown policy")
    _one_line_error(_run("run-eval", "--model", llama_dir), "--artifact or --policy")


def test_backend_option(llama_dir, shared_data, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    base = ("run-eval", "--model", llama_dir, "--policy", "int4", "--data-dir", shared_data)
    small = ("--windows", 1, "--seqlen", 16)
    _one_line_error(_run(*base, *small, "--backend", "cuda"), "unknown backend 'cuda'")
    _one_line_error(_run(*base, *small, "--backend", "triton"), "needs CUDA")
    ok = _run(*base, *small, "--backend", "reference")
    assert ok.exit_code == 0, ok.output + ok.stderr


def test_cli_starts_without_torch():
    """--help and input errors must not wait for torch and transformers (seconds to import):
    the command line and its input checks import neither."""
    import subprocess
    import sys

    code = (
        "import sys, kvq, kvq.cli.app, kvq.eval.inputs, kvq.calibrators.options, "
        "kvq.calibrators.recipe, kvq.models.spec, kvq.artifacts.paths, kvq.data.text; "
        "heavy = [m for m in ('torch', 'transformers') if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    "command",
    [
        ["run-eval", "--policy", "int4"],
        ["calibrate", "kvquant", "--out", "unused-out"],
        ["calibrate", "channel-scales", "--out", "unused-out"],
    ],
)
def test_missing_model_and_dataset_are_refused_before_loading_the_model(command):
    result = _run(*command, "--model", "/no/such/model", "--dataset", "/no/such/text.txt")
    _one_line_error(result, "model path '/no/such/model' does not exist")
    result = _run(*command, "--model", "gemma3-270m", "--dataset", "/no/such/text.txt")
    _one_line_error(result, "dataset file", "does not exist")
    assert "load model" not in result.stderr


def test_version_and_help_on_every_option():
    """`kvq --version` answers; every option of every command says what it is for, and the
    help shows no type noise on --help."""
    import click

    result = _run("--version")
    assert result.exit_code == 0 and result.output.startswith("kvq ")
    root = typer.main.get_command(app)
    todo = [((), root)]
    while todo:
        path, command = todo.pop()
        if isinstance(command, click.Group):
            todo += [((*path, n), c) for n, c in command.commands.items()]
            continue
        for param in command.params:
            if isinstance(param, click.Option):
                assert param.help, f"kvq {' '.join(path)} {param.opts[0]} has no help"
        shown = _run(*path, "--help").output
        assert "--help" in shown and "<bool>" not in shown


def test_lengths_past_the_context_are_refused_before_the_model_loads(
    llama_dir, calib_txt, shared_data, monkeypatch
):
    import json as _json

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    for module in ("kvq.pipeline", "kvq.eval.run"):
        monkeypatch.setattr(f"{module}.load_model", no_load)
    context = _json.loads((llama_dir / "config.json").read_text())["max_position_embeddings"]
    over = str(context + 1)
    eval_args = ("run-eval", "--model", llama_dir, "--policy", "int8", "--data-dir", shared_data)
    _one_line_error(_run(*eval_args, "--seqlen", over), "--seqlen", f"context is {context}")
    _one_line_error(_run(*eval_args, "--tasks", "passkey", "--contexts", over), "--contexts", over)
    _one_line_error(
        _run("calibrate", "kvquant", "--model", llama_dir, "--dataset", calib_txt,
             "--seqlen", over, "--out", llama_dir.parent / "never"),
        "--seqlen",
    )  # fmt: skip
