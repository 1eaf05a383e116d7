"""Fuzzing what users and files can hand kvq: never a traceback, never a false "valid".

Three generators (hypothesis, derandomised so CI sees the same examples every run):
  * random JSON documents as manifests;
  * real artifacts (channel-scales and KVQuant on the tiny Llama) with one mutation of
    their manifest, or of one tensor with its hash forged as a tamperer would;
  * random values for every option of every subcommand.
A mutated artifact that reads is then built into a cache and run on the tiny model: what
`inspect` calls valid must load.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import safetensors.torch
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

import kvq.pipeline
from kvq.artifacts.store import read_artifact
from kvq.cli.app import app
from kvq.errors import IncompatibleArtifact, KvqError
from kvq.manifests.schema import manifest_from_json
from kvq.models.loading import load_model

# many interpreted Triton launches or every model family: `make test-quick` skips it
pytestmark = pytest.mark.slow

runner = CliRunner()
# KVQ_FUZZ_EXAMPLES=2000 KVQ_FUZZ_RANDOM=1 for a long hunt with fresh examples
FUZZ = settings(
    max_examples=int(os.environ.get("KVQ_FUZZ_EXAMPLES", 60)),
    deadline=None,
    derandomize=not os.environ.get("KVQ_FUZZ_RANDOM"),
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
HOSTILE = ["\x1b]52;c;SGVsbG8=\x07", "[/bold]", "\u202e", "\x00", "a" * 300, "", " "]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, -1, 2, 3, 7, 255, 256, 2**31, 10**30]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
    st.sampled_from(HOSTILE),
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def check_cli(result) -> None:
    """exit 0, or 2 with exactly one 'kvq: error:' line; never an unhandled exception."""
    assert result.exit_code in (0, 2), (result.exit_code, result.stderr[-2000:])
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(
        result.exception
    )
    assert "Traceback" not in result.output
    if result.exit_code == 2:
        assert result.stderr.strip().splitlines()[-1].startswith("kvq: error:"), result.stderr
    for raw in ("\x1b", "\x07", "\u202e"):
        assert raw not in result.output


# --- manifests from nothing ------------------------------------------------------------


@FUZZ
@given(doc=json_values)
def test_random_json_is_refused_as_a_manifest(doc):
    with pytest.raises(KvqError):
        manifest_from_json(doc)


# --- real artifacts, one mutation each -----------------------------------------------------


@pytest.fixture(scope="module")
def llama(tiny_model_dir):
    path = tiny_model_dir("llama")
    return path, load_model(str(path))


@pytest.fixture(scope="module")
def sources(llama, shared_data, tmp_path_factory):
    """{name: artifact dir} made by the CLI on the tiny Llama."""
    model_dir, _ = llama
    root = tmp_path_factory.mktemp("fuzz-src")
    data = shared_data / "calibration" / "groups_merged.txt"
    base = ["--model", model_dir, "--dataset", data, "--samples", 2, "--seqlen", 32]
    made = {}
    for name, extra in {
        "channel-scales": ["--v-group", 8],
        "kvquant": ["--bits", 3],
        "kv-scales": ["--granularity", "head"],
        "vq": ["--bits", 3, "--no-fisher"],
    }.items():
        out = root / name
        result = runner.invoke(app, ["calibrate", name, *map(str, base + extra), "--out", str(out)])
        assert result.exit_code == 0, result.stderr
        made[name] = out
    return made


def _paths(doc, prefix=()):
    """Every (path to a value) in a JSON document."""
    yield prefix
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _paths(v, (*prefix, i))


def _mutate_manifest(doc: dict, draw) -> None:
    paths = [p for p in _paths(doc) if p]
    path = draw(st.sampled_from(paths))
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    key = path[-1]
    old = parent[key]
    op = draw(st.sampled_from(["replace", "delete", "nudge", "add"]))
    if op == "delete" and isinstance(parent, dict):
        del parent[key]
    elif op == "add" and isinstance(parent, dict):
        parent[draw(st.text(min_size=1, max_size=6))] = draw(json_values)
    elif op == "nudge" and type(old) in (int, float):
        parent[key] = draw(st.sampled_from([old + 1, old - 1, -old, old * 2, 0, old * 10**6]))
    else:
        parent[key] = draw(json_values)


def _forge(art: Path, tensors: dict[str, torch.Tensor], doc: dict) -> None:
    safetensors.torch.save_file(
        {n: t.contiguous() for n, t in tensors.items()}, art / "tensors.safetensors"
    )
    for name, t in tensors.items():
        raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        doc["tensors"][name] = {
            "dtype": str(t.dtype).removeprefix("torch."),
            "shape": list(t.shape),
            "sha256": hashlib.sha256(raw).hexdigest(),
        }
    for name in list(doc["tensors"]):
        if name not in tensors:
            del doc["tensors"][name]


def _mutate_tensor(tensors: dict[str, torch.Tensor], draw) -> None:
    name = draw(st.sampled_from(sorted(tensors)))
    t = tensors[name]
    op = draw(
        st.sampled_from(
            ["zero", "negate", "nan", "inf", "tiny", "huge", "double-heads", "float32",
             "flatten", "drop", "extra", "reverse"]
        )
    )  # fmt: skip
    f = t.float()
    if op == "drop":
        del tensors[name]
        return
    if op == "extra":
        tensors[name.rsplit(".", 1)[0] + ".stowaway"] = torch.ones(2)
        return
    at = draw(st.integers(0, max(t.numel() - 1, 0)))
    flat = f.reshape(-1).clone()
    if op in ("nan", "inf", "tiny", "huge") and flat.numel():
        flat[at] = {"nan": float("nan"), "inf": float("inf"), "tiny": 1e-30, "huge": 1e30}[op]
        f = flat.view(f.shape)
    elif op == "zero":
        f = torch.zeros_like(f)
    elif op == "negate":
        f = -f
    elif op == "reverse":
        f = f.flip(-1)
    elif op == "double-heads":
        f = torch.cat([f, f])
    elif op == "flatten":
        f = f.reshape(-1)
    tensors[name] = f if op == "float32" else f.to(t.dtype)


@pytest.mark.parametrize("source", ["channel-scales", "kvquant", "kv-scales", "vq"])
@FUZZ
@given(data=st.data())
def test_mutated_artifacts_are_refused_or_load(sources, llama, tmp_path_factory, source, data):
    _, loaded = llama
    src = sources[source]
    art = Path(shutil.copytree(src, tmp_path_factory.mktemp("fuzz") / "ART"))
    doc = json.loads((art / "manifest.json").read_text())
    original = copy.deepcopy(doc)
    if data.draw(st.booleans()):
        _mutate_manifest(doc, data.draw)
    else:
        tensors = safetensors.torch.load_file(art / "tensors.safetensors")
        _mutate_tensor(tensors, data.draw)
        _forge(art, tensors, doc)
    (art / "manifest.json").write_text(json.dumps(doc))

    for command in (["inspect", str(art)], ["export", "manifest", str(art)]):
        result = runner.invoke(app, command)
        check_cli(result)
    try:
        artifact = read_artifact(art)
    except KvqError:
        assert result.exit_code == 2 and "valid" not in result.stdout
        event("refused")
        return
    event("read as valid")
    assert result.exit_code == 0  # read, so called valid: it must load
    same_model = {k: original[k] for k in ("identity", "architecture")} == {
        k: doc.get(k) for k in ("identity", "architecture")
    }
    if not same_model:
        event("valid, for another model")
        with pytest.raises(IncompatibleArtifact):
            kvq.pipeline.cache_for(loaded, artifact=artifact)
        return
    cache = kvq.pipeline.cache_for(loaded, artifact=artifact)
    ids = torch.randint(3, 200, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = loaded.model(ids, cache=cache).logits
        step = loaded.model(ids[:, :1], cache=cache).logits
    assert torch.isfinite(logits).all() and torch.isfinite(step).all()


# --- random option values for every subcommand -------------------------------------------------

ints = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from(["0", "-1", "1", "2", "3", "4", "8", "16", "1e3", "nan", "x", ""]),
)
floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(["nan", "-inf", "1e999", "x"])
)
texts = st.one_of(st.text(max_size=10), st.sampled_from(HOSTILE))
OPTIONS = {
    "calibrate channel-scales": {
        "--samples": ints, "--seqlen": ints, "--bits": ints, "--key-stage": texts,
        "--clip-percentile": floats, "--sink": ints, "--v-group": ints, "--seed": ints,
    },
    "calibrate kvquant": {
        "--samples": ints, "--seqlen": ints, "--bits": ints, "--outliers": floats,
        "--sink": ints, "--seed": ints,
    },
    "calibrate vq": {
        "--samples": ints, "--seqlen": ints, "--bits": ints, "--dim": ints,
        "--outliers": floats, "--sink": ints, "--seed": ints,
    },
    "calibrate auto": {"--samples": ints, "--seqlen": ints, "--bits": ints, "--seed": ints},
    "calibrate kv-scales": {
        "--samples": ints, "--seqlen": ints, "--format": texts, "--granularity": texts,
        "--method": texts, "--percentile": floats, "--skip-layers": texts, "--seed": ints,
        "--device-map": texts, "--max-memory": texts, "--prefix-ids": texts,
    },
    "calibrate act-scales": {
        "--samples": ints, "--seqlen": ints, "--method": texts, "--percentile": floats,
        "--prefix-ids": texts, "--layout": texts, "--seed": ints,
    },
    "run-eval": {
        "--policy": st.sampled_from(["int8", "int4", "fp16", "fp8-e4m3", "nope", ""]),
        "--tasks": texts, "--device-map": texts, "--max-memory": texts,
        "--windows": ints, "--seqlen": ints, "--protocol": texts, "--quantize": texts,
        "--seed": ints, "--backend": texts, "--activations": texts, "--prefix-ids": texts,
    },
    "generate": {
        "--policy": st.sampled_from(["int8", "int2", "nope"]), "--prompt": texts,
        "--max-new-tokens": ints, "--backend": texts,
    },
}  # fmt: skip


class ModelLoadReached(KvqError):
    """Raised instead of loading the model: everything before it was accepted."""


@pytest.mark.parametrize("command", sorted(OPTIONS))
@FUZZ
@given(data=st.data())
def test_random_option_values_never_end_in_a_traceback(
    command, data, monkeypatch, shared_data, tmp_path_factory
):
    def stop(*args, **kwargs):
        raise ModelLoadReached("model load reached")

    for module in ("kvq.pipeline", "kvq.eval.run"):
        monkeypatch.setattr(f"{module}.load_model", stop)
    chosen = data.draw(st.lists(st.sampled_from(sorted(OPTIONS[command])), unique=True))
    args = command.split()
    if command.startswith("calibrate"):
        args += ["--out", str(tmp_path_factory.mktemp("fz") / "out")]
        args += ["--dataset", str(shared_data / "calibration" / "groups_merged.txt")]
    if command == "run-eval":
        args += ["--data-dir", str(shared_data)]
    if command == "generate" and "--prompt" not in chosen:
        args += ["--prompt", "x"]
    if command in ("run-eval", "generate") and "--policy" not in chosen:
        args += ["--policy", "int8"]
    for option in chosen:
        args += [option, str(data.draw(OPTIONS[command][option]))]
    result = runner.invoke(app, args)
    check_cli(result)
    event("reached the model load" if "model load reached" in result.stderr else "refused")
