"""`kvq calibrate trellis` through the CLI, then run-eval; its one-line refusals."""

import json

import pytest

from kvq.calibrators import trellis as trellis_pass
from tests.cli.test_cli import _one_line_error, _run


@pytest.fixture(autouse=True)
def _small_fits(monkeypatch):
    monkeypatch.setattr(trellis_pass, "POOLED_ROWS", 256)  # seconds, not minutes


def test_the_cli_calibrates_evaluates_and_refuses_bad_options(
    llama_dir, calib_txt, shared_data, tmp_path
):
    out = tmp_path / "t3"
    result = _run(
        "calibrate", "trellis", "--model", llama_dir, "--dataset", calib_txt, "--samples", 2,
        "--seqlen", 24, "--bits", 3, "--window", 9, "--out", out,
    )  # fmt: skip
    assert result.exit_code == 0, result.output + result.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    layers = manifest["policy"]["_data"]["layers"]
    assert {(layer["key"]["format"], layer["key"]["window"]) for layer in layers} == {
        ("trellis", 9)
    }
    report = tmp_path / "eval.json"
    result = _run(
        "run-eval", "--model", llama_dir, "--artifact", out, "--dataset", "wikitext2",
        "--data-dir", shared_data, "--windows", 2, "--seqlen", 32, "--json", report,
    )  # fmt: skip
    assert result.exit_code == 0, result.output + result.stderr
    tasks = json.loads(report.read_text())["tasks"]
    assert tasks["ppl"]["quantized"] > 0 and tasks["bytes"]["kv_bytes_per_token"] > 0
    bad = _run(
        "calibrate", "trellis", "--model", llama_dir, "--dataset", calib_txt,
        "--bits", 3, "--window", 8, "--out", tmp_path / "bad",
    )  # fmt: skip
    _one_line_error(bad, "--window must be")
    assert not (tmp_path / "bad").exists()


def test_a_mismatched_table_is_refused_at_load(llama_dir, calib_txt, tmp_path):
    import torch

    from kvq.artifacts.store import read_artifact
    from kvq.errors import IncompatibleArtifact
    from kvq.runtime.validate import check_artifact_state

    out = tmp_path / "t2"
    result = _run(
        "calibrate", "trellis", "--model", llama_dir, "--dataset", calib_txt, "--samples", 2,
        "--seqlen", 24, "--bits", 2, "--window", 8, "--no-fisher", "--out", out,
    )  # fmt: skip
    assert result.exit_code == 0, result.output + result.stderr
    artifact = read_artifact(out)
    check_artifact_state(artifact.manifest, artifact.tensors)  # as written: accepted
    tensors = dict(artifact.tensors)
    tensors["layers.1.value.trellis_table"] = tensors["layers.1.value.trellis_table"][:128]
    with pytest.raises(IncompatibleArtifact, match=r"layers\.1\.value.*trellis_table"):
        check_artifact_state(artifact.manifest, tensors)
    tensors = dict(artifact.tensors)
    tensors["layers.0.key.trellis_weight"] = -torch.ones_like(
        tensors["layers.0.key.trellis_weight"]
    )
    with pytest.raises(IncompatibleArtifact, match="trellis_weight"):
        check_artifact_state(artifact.manifest, tensors)
