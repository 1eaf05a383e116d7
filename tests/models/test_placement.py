"""--device-map / --max-memory: a dispatched model (part of it offloaded to disk or kept
on the CPU by accelerate) calibrates and evaluates exactly as the one-device model."""

from __future__ import annotations

import json

import pytest
import torch

from kvq.artifacts.store import read_artifact
from kvq.errors import KvqError
from kvq.models.loading import load_model
from kvq.models.placement import Placement, input_device, parse_placement
from tests.cli.test_cli import _one_line_error, _run
from tests.conftest import make_tiny_model


def _map_file(tmp_path, family):
    """Layer 1 on disk (loaded at each forward), every other module on the CPU."""
    body = make_tiny_model(family).model
    device_map = {f"model.{n}": "cpu" for n, _ in body.named_children() if n != "layers"}
    device_map |= {
        f"model.layers.{i}": "disk" if i == 1 else "cpu" for i in range(len(body.layers))
    }
    device_map["lm_head"] = "cpu"
    path = tmp_path / f"{family}-map.json"
    path.write_text(json.dumps(device_map))
    return path


def test_a_disk_offloaded_model_has_the_same_identity(tiny_model_dir, tmp_path):
    model_dir = str(tiny_model_dir("llama"))
    one = load_model(model_dir)
    placement = parse_placement(str(_map_file(tmp_path, "llama")), None)
    spread = load_model(model_dir, placement=placement)
    assert spread.model.hf_device_map["model.layers.1"] == "disk"
    assert any(p.device.type == "meta" for p in spread.model.parameters())  # really offloaded
    assert spread.identity == one.identity  # weights read back from disk for the digest
    assert input_device(spread.model) == torch.device("cpu")
    ids = torch.randint(3, 200, (1, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(spread.model(ids).logits, one.model(ids).logits)


@pytest.mark.parametrize(
    "family, pass_args",
    [
        (
            "llama",
            ["kv-scales", "--format", "fp8-e4m3", "--granularity", "head", "--method", "mse"],
        ),
        ("gemma3", ["channel-scales", "--bits", 4, "--v-group", 8]),
        ("qwen2", ["kvquant", "--bits", 3]),  # Fisher: a backward pass through the hooks
    ],
)
def test_calibration_artifacts_equal_the_one_device_run_tensor_for_tensor(
    family, pass_args, tiny_model_dir, data, tmp_path, monkeypatch
):
    args = ["calibrate", *pass_args, "--model", tiny_model_dir(family), "--dataset", data,
            "--samples", 2, "--seqlen", 24]  # fmt: skip
    monkeypatch.setenv("KVQ_CACHE", str(tmp_path / "cache-one"))
    one = _run(*args, "--out", tmp_path / "one")
    assert one.exit_code == 0, one.stderr
    # a cache of its own: the Fisher sums are recomputed through the dispatched model
    monkeypatch.setenv("KVQ_CACHE", str(tmp_path / "cache-spread"))
    map_file = _map_file(tmp_path, family)
    spread = _run(*args, "--device-map", map_file, "--out", tmp_path / "spread")
    assert spread.exit_code == 0, spread.stderr
    a, b = read_artifact(tmp_path / "one"), read_artifact(tmp_path / "spread")
    assert a.tensors.keys() == b.tensors.keys() and a.tensors
    for name, t in a.tensors.items():
        assert torch.equal(t, b.tensors[name]), name
    assert a.manifest.identity == b.manifest.identity
    assert a.manifest.policy == b.manifest.policy
    assert a.manifest.ledger == b.manifest.ledger


def test_max_memory_offloads_and_run_eval_matches(tiny_model_dir, data, tmp_path):
    model_dir = tiny_model_dir("llama")
    common = ["--model", model_dir, "--dataset", data, "--windows", 2, "--seqlen", 16,
              "--policy", "fp8-e4m3", "--tasks", "ppl,kld"]  # fmt: skip
    one = _run("run-eval", *common, "--json", tmp_path / "one.json")
    assert one.exit_code == 0, one.stderr
    # a CPU budget far below the model's size: accelerate sends the rest to disk
    spread = _run("run-eval", *common, "--device-map", "auto", "--max-memory", "cpu=60KB",
                  "--json", tmp_path / "spread.json")  # fmt: skip
    assert spread.exit_code == 0, spread.stderr
    a = json.loads((tmp_path / "one.json").read_text())["tasks"]
    b = json.loads((tmp_path / "spread.json").read_text())["tasks"]
    assert a == b
    placement = parse_placement("auto", "cpu=60KB")
    spread_model = load_model(str(model_dir), placement=placement).model
    assert "disk" in set(spread_model.hf_device_map.values())


@pytest.mark.parametrize(
    "device_map, max_memory, needle",
    [
        (None, "cpu=1GiB", "--max-memory needs --device-map"),
        ("auto", "cpu", "not DEVICE=SIZE"),
        ("auto", "disk=1GiB", "not DEVICE=SIZE"),
        ("nope.json", None, "no such JSON file"),
    ],
)
def test_bad_placements_are_refused(device_map, max_memory, needle, tmp_path):
    with pytest.raises(KvqError, match=needle):
        parse_placement(device_map, max_memory)


def test_bad_map_files_are_one_line_errors_before_loading(tiny_model_dir, data, tmp_path):
    bad = tmp_path / "map.json"
    bad.write_text(json.dumps({"model.layers.0": "gpu7"}))
    result = _run("calibrate", "kv-scales", "--model", tiny_model_dir("llama"), "--dataset",
                  data, "--device-map", bad, "--out", tmp_path / "a")  # fmt: skip
    _one_line_error(result, "--device-map", "'gpu7'")
    assert not (tmp_path / "a").exists()
    assert parse_placement(None, None) == Placement()
    assert parse_placement("balanced", "0=10GiB,cpu=2.5GB").max_memory == {
        0: "10GiB",
        "cpu": "2.5GB",
    }
