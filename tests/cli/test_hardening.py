"""The CLI against careless and hostile input: nothing destroyed, nothing trusted, one line.

Every refusal here must come before the model loads (no "load model" stage on stderr)
unless it needs the model, and must leave the user's files as they were.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import safetensors.torch
import torch

from kvq.calibrators.recipe import read_recipe
from tests.cli.test_cli import _one_line_error, _quick_calibrate, _run

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def made(llama_dir, calib_txt, tmp_path_factory):
    out = tmp_path_factory.mktemp("made") / "ART"
    args = ["--model", llama_dir, "--dataset", calib_txt, "--samples", 2, "--seqlen", 24]
    result = _run("calibrate", "channel-scales", *args, "--v-group", 8, "--out", out)
    assert result.exit_code == 0, result.output + result.stderr
    return out


@pytest.fixture
def art(made, tmp_path):
    """A private copy of the module's artifact, to tamper with."""
    return Path(shutil.copytree(made, tmp_path / "ART"))


def files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


# --- nothing of the user's is destroyed -----------------------------------------------


def test_overwrite_never_replaces_a_users_folder(llama_dir, calib_txt, tmp_path):
    ext = tmp_path / "my-extension"
    ext.mkdir()
    (ext / "manifest.json").write_text('{"manifest_version": 3, "name": "mine"}')
    (ext / "background.js").write_text("// mine")
    before = files(tmp_path)
    result = _quick_calibrate(llama_dir, calib_txt, "--out", ext, "--overwrite")
    _one_line_error(result, "not a kvq artifact")
    assert "load model" not in result.stderr  # refused before any work
    assert files(tmp_path) == before


def test_overwrite_never_replaces_the_working_directory(
    llama_dir, calib_txt, tmp_path, monkeypatch
):
    (tmp_path / "mine.txt").write_text("mine")
    monkeypatch.chdir(tmp_path)
    for out in (".", ".."):
        _one_line_error(
            _quick_calibrate(llama_dir, calib_txt, "--out", out, "--overwrite"), "working"
        )
    assert (tmp_path / "mine.txt").read_text() == "mine"


def test_outputs_may_not_land_on_the_artifacts_own_files(art, llama_dir, shared_data):
    before = files(art)
    result = _run("export", "manifest", art, "--schema-out", art / "manifest.json")
    _one_line_error(result, "would overwrite a file of the artifact")
    result = _run(
        "run-eval", "--model", llama_dir, "--artifact", art, "--data-dir", shared_data,
        "--windows", 1, "--seqlen", 16, "--json", art / "tensors.safetensors",
    )  # fmt: skip
    _one_line_error(result, "would overwrite a file of the artifact")
    assert "load model" not in result.stderr
    assert files(art) == before


@pytest.mark.parametrize(
    "where, needle",
    [("/proc/kvq.json", "cannot write"), ("{tmp}/a.txt/x.json", "is not a directory")],
)
def test_bad_json_destination_fails_before_the_job(llama_dir, shared_data, tmp_path, where, needle):
    (tmp_path / "a.txt").write_text("mine")
    result = _run(
        "run-eval", "--model", llama_dir, "--policy", "int8", "--data-dir", shared_data,
        "--windows", 1, "--seqlen", 16, "--json", where.format(tmp=tmp_path),
    )  # fmt: skip
    _one_line_error(result, needle)
    assert "load model" not in result.stderr


def test_a_json_destination_that_is_a_folder_is_refused(llama_dir, shared_data, tmp_path):
    result = _run(
        "run-eval", "--model", llama_dir, "--policy", "int8", "--data-dir", shared_data,
        "--windows", 1, "--seqlen", 16, "--json", tmp_path,
    )  # fmt: skip
    _one_line_error(result, "is a directory")


# --- nothing an artifact says is trusted ------------------------------------------------


def rehash(art: Path, name: str, tensor: torch.Tensor) -> None:
    """Replace one tensor and forge its manifest entry, as a tamperer would."""
    tensors = safetensors.torch.load_file(art / "tensors.safetensors")
    tensors[name] = tensor.contiguous()
    safetensors.torch.save_file(tensors, art / "tensors.safetensors")
    raw = tensors[name].reshape(-1).view(torch.uint8).numpy().tobytes()
    d = json.loads((art / "manifest.json").read_text())
    d["tensors"][name] = {
        "dtype": str(tensor.dtype).removeprefix("torch."),
        "shape": list(tensor.shape),
        "sha256": hashlib.sha256(raw).hexdigest(),
    }
    (art / "manifest.json").write_text(json.dumps(d))


@pytest.mark.parametrize(
    "change, needle",
    [
        (lambda s: torch.zeros_like(s), "positive normal float16 scales"),
        (lambda s: -s, "positive normal float16 scales"),
        (lambda s: torch.full_like(s, float("nan")), "NaN or Inf"),
        (lambda s: torch.cat([s, s]), "shape"),  # shaped for twice the KV heads
        (lambda s: s.float(), "dtype"),
    ],
)
def test_tampered_values_with_forged_hashes_are_refused(art, change, needle):
    name = "layers.0.key.scale"
    rehash(art, name, change(safetensors.torch.load_file(art / "tensors.safetensors")[name]))
    for command in (["inspect", art], ["export", "manifest", art]):
        result = _run(*command)
        _one_line_error(result, "incompatible artifact", name, needle)
        assert "valid" not in result.stdout


def edit(art: Path, fn) -> None:
    d = json.loads((art / "manifest.json").read_text())
    fn(d)
    (art / "manifest.json").write_text(json.dumps(d))


def _layer(d, key, value):
    d["policy"]["_data"]["layers"][0]["value"][key] = value


@pytest.mark.parametrize(
    "fn, field",
    [
        (lambda d: d["architecture"].update(head_dim=10**30), "architecture.head_dim"),
        (lambda d: d["architecture"].update(num_kv_heads=-2), "architecture.num_kv_heads"),
        (lambda d: d["architecture"].update(num_q_heads=0), "architecture.num_q_heads"),
        (lambda d: d["architecture"].update(layer_types=["full_attention"]), "layer_types"),
        (lambda d: _layer(d, "group_size", 7), "group_size"),
        (lambda d: _layer(d, "bits", 5), "policy"),
        (lambda d: d["architecture"]["rope"][0].update(theta=-1.0), "rope[0].theta"),
        (lambda d: d["ledger"].update(tokens=0), "ledger.tokens"),
    ],
)
def test_manifests_that_cannot_load_are_not_called_valid(art, fn, field):
    edit(art, fn)
    for command in (["inspect", art], ["export", "manifest", art]):
        result = _run(*command)
        _one_line_error(result, "incompatible artifact", field)
        assert "valid" not in result.stdout


HOSTILE = "\x1b]52;c;SGVsbG8=\x07\x1b[2J\x1b]0;pwned\x07[/bold][red]x\u202e"


def test_manifest_strings_reach_the_terminal_as_data(art):
    edit(art, lambda d: d.update(model_spec=HOSTILE))
    edit(art, lambda d: d["passes"][0].update(method=HOSTILE))
    edit(art, lambda d: d["policy"]["_data"].update(name=HOSTILE))
    for command in (["inspect", art], ["export", "manifest", art]):
        result = _run(*command)
        assert result.exit_code == 0, result.output + result.stderr
        for raw in ("\x1b", "\x07", "\u202e"):
            assert raw not in result.output
        assert "validation: OK" in result.output or "valid" in result.output
    shown = _run("inspect", art).output
    assert "[/bold][red]x" in shown  # printed, not interpreted
    assert "\\x1b]52;c;SGVsbG8=" in shown


def test_error_messages_escape_what_they_quote(llama_dir, calib_txt, tmp_path):
    result = _quick_calibrate(llama_dir, calib_txt, "--out", tmp_path / "o", "--key-stage", HOSTILE)
    _one_line_error(result, "--key-stage")
    assert "\x1b" not in result.stderr and "\u202e" not in result.stderr


# --- no traceback for any input ---------------------------------------------------------


def dataset(tmp_path: Path, kind: str) -> Path:
    if kind == "nested.jsonl":
        text = '{"text": ' + "[" * 100_000 + "]" * 100_000 + "}\n"
    elif kind == "huge-float.jsonl":
        text = '{"text": "a", "n": 1e999999}\n'
    elif kind == "huge-int.jsonl":
        text = '{"text": "a", "n": ' + "9" * 100_000 + "}\n"
    elif kind == "ints.parquet":
        path = tmp_path / kind
        pq.write_table(pa.table({"text": [1, 2, 3]}), path)
        return path
    elif kind == "binary.txt":
        path = tmp_path / kind
        path.write_bytes(bytes(range(256)) * 64)
        return path
    path = tmp_path / kind
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "kind, needle",
    [
        ("nested.jsonl", "nested too deeply"),
        ("huge-float.jsonl", "does not fit a 64-bit float"),
        ("huge-int.jsonl", "invalid JSON"),
        ("ints.parquet", "holds int values, not strings"),
        ("binary.txt", "not UTF-8"),
    ],
)
def test_bad_datasets_are_one_line_errors(llama_dir, tmp_path, kind, needle):
    path = dataset(tmp_path, kind)
    result = _run(
        "run-eval", "--model", llama_dir, "--policy", "int8", "--dataset", path, "--seqlen", 64
    )  # within the tiny model's context, so the dataset is what fails
    _one_line_error(result, needle)


def test_a_binary_wikitext_is_one_line(llama_dir, tmp_path):
    raw = tmp_path / "wikitext-2-raw"
    raw.mkdir()
    (raw / "wiki.test.raw").write_bytes(b"\xff\xfe" * 1000)
    result = _run(
        "run-eval", "--model", llama_dir, "--policy", "int8", "--data-dir", tmp_path, "--seqlen", 64
    )
    _one_line_error(result, "not UTF-8")


def test_a_hostile_gguf_is_one_line_before_the_model(calib_txt, tmp_path):
    # a valid magic and version, then 2**40 tensors and metadata entries in 88 bytes
    gguf = tmp_path / "bomb.gguf"
    gguf.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 2**40, 2**40) + bytes(64))
    result = _run(
        "calibrate", "channel-scales", "--model", gguf, "--dataset", calib_txt,
        "--samples", 1, "--seqlen", 16, "--out", tmp_path / "o",
    )  # fmt: skip
    _one_line_error(result, "bomb.gguf' is not a readable GGUF", "more than its 88 bytes")
    assert "load model" not in result.stderr and "converting" not in result.stderr
    assert not (tmp_path / "o").exists()


# nine levels of nine aliases: 9**9 strings once expanded ("billion laughs")
LEVELS = ["a: &a [x, x, x, x, x, x, x, x, x]"] + [
    f"{n}: &{n} [{', '.join(['*' + p] * 9)}]" for p, n in zip("abcdefgh", "bcdefghi", strict=True)
]
LAUGHS = "{" + ", ".join(LEVELS) + "}"


@pytest.mark.parametrize(
    "text, needle",
    [
        ("\n".join(LEVELS) + "\npasses: [kvquant]", "more than 10000 values"),
        (f"model: {LAUGHS}\npasses: [channel-scales]", "more than 10000 values"),
        (f"passes:\n  - channel-scales: {{bits: {LAUGHS}}}", "more than 10000 values"),
        ("passes: [{channel-scales: {bits: &r [*r]}}]", "nested more than 64 levels"),
        ("passes: " + "[" * 10_000 + "]" * 10_000, "nested more than 64 levels"),
        ("seed: " + "9" * 5000 + "\npasses: [channel-scales]", "not a YAML document"),
        ("passes: [{channel-scales: {key_stage: " + "x" * 100_000 + "}}]", "key_stage"),
        ("passes: [{kv-scales: {skip_layers: '\u00b2'}}]", "--skip-layers must be"),
    ],
)
def test_hostile_recipes_are_one_line_errors_at_once(tmp_path, text, needle):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(text)
    start = time.monotonic()
    result = _run("calibrate", "recipe", recipe, "--dataset", "wikitext2", "--out", tmp_path / "o")
    assert time.monotonic() - start < 2  # was minutes, then out of memory
    _one_line_error(result, needle)
    assert len(result.stderr) < 500


def test_a_recipe_may_still_use_aliases(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("passes:\n  - kvquant: &o {bits: 3}\n  - vq: *o\n")
    r = read_recipe(recipe)
    assert r.passes == [("kvquant", {"bits": 3}), ("vq", {"bits": 3})]


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--seed", str(2**70)], "--seed"),
        (["--seed", "-1"], "--seed"),
        (["--v-group", "100000"], "--v-group"),
    ],
)
def test_out_of_range_numbers_before_the_model(llama_dir, calib_txt, tmp_path, args, needle):
    result = _quick_calibrate(llama_dir, calib_txt, "--out", tmp_path / "o", *args)
    _one_line_error(result, needle)
    assert "load model" not in result.stderr and not (tmp_path / "o").exists()


def test_windows_longer_than_the_context_are_refused(llama_dir, calib_txt, tmp_path):
    # the tiny models have max_position_embeddings 256
    result = _run(
        "calibrate", "channel-scales", "--model", llama_dir, "--dataset", calib_txt,
        "--samples", 1, "--seqlen", 300, "--out", tmp_path / "o",
    )  # fmt: skip
    _one_line_error(result, "--seqlen asks for 300 tokens", "context is 256")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--prompt", "lone \udc80 surrogate"], "--prompt is not valid text"),
        (["--prompt", "x", "--max-new-tokens", str(10**9)], "--max-new-tokens"),
        (["--prompt", "x", "--max-new-tokens", "300"], "context is 256"),
    ],
)
def test_generate_bounds(llama_dir, args, needle):
    _one_line_error(_run("generate", "--model", llama_dir, "--policy", "int8", *args), needle)


# --- interruption --------------------------------------------------------------------

# Runs the real CLI and delivers a real signal to itself once the model has loaded;
# "swallowed": a library catches the KeyboardInterrupt (as torch does during its import).
_CHILD = """
import os, signal, sys
sys.path.insert(0, {repo!r})
import kvq.pipeline as pipeline
real = pipeline.load_windows
def interrupted(*a, **k):
    try:
        os.kill(os.getpid(), signal.{sig})
    except KeyboardInterrupt:
        if not {swallow}:
            raise
    return real(*a, **k)
pipeline.load_windows = interrupted
from kvq.cli.app import main
sys.argv = ["kvq"] + sys.argv[1:]
main()
"""


@pytest.mark.parametrize("sig, swallow", [("SIGTERM", False), ("SIGINT", True)])
def test_an_interrupt_is_one_line_exit_130_and_writes_nothing(
    llama_dir, calib_txt, tmp_path, sig, swallow
):
    child = _CHILD.format(repo=str(REPO), sig=sig, swallow=swallow)
    out = tmp_path / "o"
    args = ["calibrate", "channel-scales", "--model", str(llama_dir), "--dataset", str(calib_txt)]
    args += ["--samples", "1", "--seqlen", "16", "--v-group", "8", "--out", str(out)]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-c", child, *args], capture_output=True, env=env)
    err = run.stderr.decode()
    assert run.returncode == 130, err[-3000:]
    assert err.strip().splitlines()[-1] == "kvq: aborted, nothing written"
    assert err.count("kvq: aborted") == 1  # said once, not again on the way out
    assert "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    assert signal.Signals[sig]  # both signals are handled the same way


# A filesystem without renameat2: --overwrite moves the old artifact aside, then the new
# one in; the signal lands between the two renames.
_SWAP_CHILD = """
import os, signal, sys
sys.path.insert(0, {repo!r})
from kvq.artifacts import paths
paths._exchange = lambda a, b: False
real = os.rename
def rename(src, dst):
    real(src, dst)
    if ".old-" in str(dst):
        os.kill(os.getpid(), signal.{sig})
os.rename = rename
from kvq.cli.app import main
sys.argv = ["kvq"] + sys.argv[1:]
main()
"""


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_an_interrupt_between_the_renames_keeps_the_old_artifact(art, llama_dir, calib_txt, sig):
    before = files(art)
    child = _SWAP_CHILD.format(repo=str(REPO), sig=sig)
    args = ["calibrate", "channel-scales", "--model", str(llama_dir), "--dataset", str(calib_txt)]
    args += ["--samples", "1", "--seqlen", "16", "--v-group", "8", "--out", str(art), "--overwrite"]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-c", child, *args], capture_output=True, env=env)
    err = run.stderr.decode()
    assert run.returncode == 130, err[-3000:]
    assert err.strip().splitlines()[-1] == "kvq: aborted, nothing written"
    assert err.count("kvq: aborted") == 1 and "Traceback" not in err
    # true at once, not after the next kvq command has recovered it
    assert sorted(p.name for p in art.parent.iterdir()) == ["ART"]
    assert files(art) == before


def _another_run_replaces(out: Path, made: Path) -> None:
    """What a concurrent `--overwrite` of the same --out does, from another process."""
    theirs = Path(shutil.copytree(made, out.with_name("theirs")))
    shutil.rmtree(out)
    os.rename(theirs, out)


def test_the_loser_of_two_overwrites_says_so(art, made, llama_dir, calib_txt, monkeypatch):
    from kvq.artifacts import paths

    real_swap = paths.swap_into_place

    def swap_then_lose(new, path):  # the other run swaps its artifact in right after ours
        old = real_swap(new, path)
        _another_run_replaces(path, made)
        return old

    monkeypatch.setattr(paths, "swap_into_place", swap_then_lose)
    result = _quick_calibrate(llama_dir, calib_txt, "--v-group", 8, "--out", art, "--overwrite")
    _one_line_error(result, "another run replaced the artifact this one wrote")
    assert files(art) == files(made)  # the winner's, untouched


def test_a_replacement_during_the_read_back_is_named(art, made, llama_dir, calib_txt, monkeypatch):
    real_load = safetensors.torch.load_file

    def load_file(name, *a, **k):  # the other run swaps in between the manifest and tensors
        if Path(name).parent == art and not (art.parent / "theirs").exists():
            _another_run_replaces(art, made)
        return real_load(name, *a, **k)

    monkeypatch.setattr(safetensors.torch, "load_file", load_file)
    result = _quick_calibrate(llama_dir, calib_txt, "--v-group", 8, "--out", art, "--overwrite")
    _one_line_error(result, "another run replaced the artifact while this one read it")
    assert "tensor data was modified" not in result.stderr
