"""Artifacts on disk: exact round trip, tamper and model checks, atomic writes."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import replace

import pytest
import safetensors.torch
import torch

from kvq.artifacts import paths
from kvq.artifacts.compat import check_model_compatible
from kvq.artifacts.store import Artifact, read_artifact, tensor_index, write_artifact
from kvq.errors import IncompatibleArtifact, KvqError
from kvq.manifests.identity import RopeInfo
from kvq.manifests.schema import SCHEMA_VERSION, TensorEntry
from tests.manifests.test_schema import make_architecture, make_identity, make_manifest


def static_tensors(layers: int = 4, heads: int = 1, head_dim: int = 64) -> dict[str, torch.Tensor]:
    """What the calibrated manifest's static per-channel INT4 keys need: a positive fp16
    scale and an fp16 offset per (head, channel) and layer."""
    g = torch.Generator().manual_seed(1)
    out = {}
    for i in range(layers):
        x = torch.rand(heads, head_dim, generator=g)
        out[f"layers.{i}.key.scale"] = (x + 0.01).to(torch.float16)
        out[f"layers.{i}.key.offset"] = (x - 0.5).to(torch.float16)
    return out


def make_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 64, generator=g)
    return static_tensors() | {
        "k_scale.0": x.to(torch.float16),
        "k_offset.0": x[:, ::2].float(),  # a non-contiguous view: stored contiguous
        "codebook.1": torch.randint(0, 256, (16,), dtype=torch.uint8, generator=g),
        "signed.2": torch.randint(-128, 128, (2, 3), dtype=torch.int8, generator=g),
        "fp8.3": x[0].to(torch.float8_e4m3fn),
        "bf16.3": x[1].to(torch.bfloat16),
        "scalar": torch.tensor(0.5),
    }


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    # torch.equal has no float8 kernel on CPU; compare the raw bytes instead.
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


@pytest.fixture
def art(tmp_path):
    artifact = Artifact(manifest=make_manifest(calibrated=True), tensors=make_tensors())
    return write_artifact(artifact, tmp_path / "ART")


def test_tensor_index_hashes_raw_bytes():
    t = torch.tensor([1, 2, 3], dtype=torch.uint8)
    assert tensor_index({"t": t}) == {
        "t": TensorEntry(dtype="uint8", shape=(3,), sha256=hashlib.sha256(bytes([1, 2, 3])).hexdigest())
    }  # fmt: skip
    x = torch.arange(12, dtype=torch.float16).reshape(3, 4)
    assert tensor_index({"x": x.T})["x"] == tensor_index({"x": x.T.contiguous()})["x"]
    assert (
        tensor_index({"f": torch.zeros(2, dtype=torch.float8_e4m3fn)})["f"].dtype == "float8_e4m3fn"
    )


def test_write_read_round_trip(art):
    tensors = make_tensors()
    back = read_artifact(art)
    assert back.tensors.keys() == tensors.keys()
    for name, t in tensors.items():
        assert same_bits(back.tensors[name], t.contiguous()), name
    expected = replace(make_manifest(calibrated=True), tensors=tensor_index(tensors))
    assert replace(back.manifest, created_utc="") == replace(expected, created_utc="")
    assert back.manifest.tensors["bf16.3"].dtype == "bfloat16"
    text = (art / "manifest.json").read_text()
    assert text == json.dumps(json.loads(text), indent=2, sort_keys=True) + "\n"


def test_artifact_without_tensors(tmp_path):
    path = write_artifact(Artifact(make_manifest(), {}), tmp_path / "empty")
    assert (path / "tensors.safetensors").is_file()
    back = read_artifact(path)
    assert back.tensors == {} and back.manifest.tensors == {}


def test_tampered_tensor_is_refused(art):
    tensors = safetensors.torch.load_file(art / "tensors.safetensors")
    tensors["k_scale.0"][2, 5] += 1
    safetensors.torch.save_file(tensors, art / "tensors.safetensors")
    with pytest.raises(IncompatibleArtifact, match=r"tensors\[k_scale\.0\]\.sha256"):
        read_artifact(art)


@pytest.mark.parametrize("change", ["drop", "add", "dtype", "shape"])
def test_tensor_set_dtype_and_shape_are_checked(art, change):
    tensors = safetensors.torch.load_file(art / "tensors.safetensors")
    field = {
        "drop": "tensors[codebook.1]",
        "add": "tensors[stowaway]",
        "dtype": "tensors[codebook.1].dtype",
        "shape": "tensors[codebook.1].shape",
    }[change]
    if change == "drop":
        del tensors["codebook.1"]
    elif change == "add":
        tensors["stowaway"] = torch.zeros(1)
    elif change == "dtype":
        tensors["codebook.1"] = tensors["codebook.1"].to(torch.int16)
    else:
        tensors["codebook.1"] = tensors["codebook.1"].reshape(4, 4)
    safetensors.torch.save_file(tensors, art / "tensors.safetensors")
    with pytest.raises(IncompatibleArtifact) as err:
        read_artifact(art)
    assert err.value.field == field


def edit_manifest(art, fn) -> None:
    d = json.loads((art / "manifest.json").read_text())
    fn(d)
    (art / "manifest.json").write_text(json.dumps(d))


def test_changed_manifest_is_refused(art):
    edit_manifest(art, lambda d: d.update(schema_version=SCHEMA_VERSION + 1))
    with pytest.raises(IncompatibleArtifact, match="schema_version"):
        read_artifact(art)
    edit_manifest(art, lambda d: d.update(schema_version=SCHEMA_VERSION))
    edit_manifest(art, lambda d: d["passes"][0].pop("stage_seconds"))
    with pytest.raises(IncompatibleArtifact, match=r"passes\[0\]\.stage_seconds"):
        read_artifact(art)


def test_manifest_index_edit_is_caught(art):
    # Forging the hash in the manifest instead of the tensor is caught the same way.
    edit_manifest(art, lambda d: d["tensors"]["fp8.3"].update(sha256="0" * 64))
    with pytest.raises(IncompatibleArtifact, match=r"tensors\[fp8\.3\]\.sha256"):
        read_artifact(art)


def test_missing_pieces_are_one_line_errors(tmp_path, art):
    with pytest.raises(KvqError, match="no such artifact"):
        read_artifact(tmp_path / "nope")
    (art / "tensors.safetensors").unlink()
    with pytest.raises(KvqError, match="missing tensors.safetensors"):
        read_artifact(art)
    (art / "tensors.safetensors").write_bytes(b"garbage")
    with pytest.raises(KvqError, match="unreadable"):
        read_artifact(art)
    (art / "manifest.json").write_text("{not json")
    with pytest.raises(KvqError, match="not valid JSON"):
        read_artifact(art)


def test_model_compatibility_names_the_field():
    manifest = make_manifest()
    identity, arch = make_identity(), make_architecture()
    check_model_compatible(manifest, identity, arch)  # the same model passes

    cases = [
        (replace(identity, weights_sha256="9" * 64), arch, "identity.weights_sha256"),
        (replace(identity, model_type="llama"), arch, "identity.model_type"),
        (identity, replace(arch, num_kv_heads=4), "architecture.num_kv_heads"),
        (identity, replace(arch, sliding_window=1024), "architecture.sliding_window"),
        (identity, replace(arch, layer_types=("full_attention",) * 4, sliding_window=None), "architecture.layer_types[0]"),
        (identity, replace(arch, rope=arch.rope[:3] + (RopeInfo(5e5, 64, "rotate-half"),)), "architecture.rope[3].theta"),
        (identity, replace(arch, rope=arch.rope[:2] + (replace(arch.rope[2], pairing="interleaved"),) + arch.rope[3:]), "architecture.rope[2].pairing"),
        (identity, replace(arch, num_layers=3, layer_types=arch.layer_types[:3], rope=arch.rope[:3]), "architecture.num_layers"),
    ]  # fmt: skip
    for ident, architecture, field in cases:
        with pytest.raises(IncompatibleArtifact) as err:
            check_model_compatible(manifest, ident, architecture)
        assert err.value.field == field
        assert field in str(err.value)
    err = pytest.raises(
        IncompatibleArtifact,
        check_model_compatible,
        manifest,
        identity,
        replace(arch, head_dim=128),
    )
    assert (err.value.expected, err.value.found) == (64, 128)  # expected = artifact, found = model


def listing(tmp_path) -> list[str]:
    return sorted(p.name for p in tmp_path.iterdir())


@pytest.mark.parametrize("exc", [RuntimeError("disk full"), KeyboardInterrupt()])
def test_failed_write_leaves_nothing(tmp_path, monkeypatch, exc):
    def broken_save(*args, **kwargs):
        raise exc

    monkeypatch.setattr(safetensors.torch, "save_file", broken_save)
    with pytest.raises(type(exc)):
        write_artifact(Artifact(make_manifest(), make_tensors()), tmp_path / "ART")
    assert listing(tmp_path) == []


def test_existing_path_needs_overwrite(art):
    with pytest.raises(KvqError, match="exists; pass --overwrite"):
        write_artifact(Artifact(make_manifest(), {}), art)
    assert read_artifact(art).tensors.keys() == make_tensors().keys()  # untouched


def test_overwrite_replaces_and_cleans_up(tmp_path, art):
    write_artifact(Artifact(make_manifest(), {"only": torch.ones(2)}), art, overwrite=True)
    assert list(read_artifact(art).tensors) == ["only"]
    assert listing(tmp_path) == ["ART"]  # no temp or old directory left behind


def test_failed_overwrite_keeps_the_old_artifact(tmp_path, art, monkeypatch):
    def broken_save(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", broken_save)
    with pytest.raises(RuntimeError):
        write_artifact(Artifact(make_manifest(), {}), art, overwrite=True)
    assert listing(tmp_path) == ["ART"]
    assert read_artifact(art).tensors.keys() == make_tensors().keys()


def test_failed_final_rename_restores_the_old_artifact(tmp_path, art, monkeypatch):
    # where the filesystem cannot exchange two names, the old artifact is moved aside first
    monkeypatch.setattr(paths, "_exchange", lambda a, b: False)
    real_rename = os.rename

    def rename(src, dst):
        if ".tmp-" in str(src):  # the new artifact moving into place
            raise OSError("rename failed")
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(OSError, match="rename failed"):
        write_artifact(Artifact(make_manifest(), {}), art, overwrite=True)
    monkeypatch.undo()
    assert listing(tmp_path) == ["ART"]
    assert read_artifact(art).tensors.keys() == make_tensors().keys()


def test_overwrite_refuses_a_directory_that_is_not_an_artifact(tmp_path):
    precious = tmp_path / "home"
    precious.mkdir()
    (precious / "thesis.tex").write_text("...")
    with pytest.raises(KvqError, match="not a kvq artifact"):
        write_artifact(Artifact(make_manifest(), {}), precious, overwrite=True)
    assert (precious / "thesis.tex").exists()
    # a web extension's folder holds a manifest.json too: not a kvq manifest
    (precious / "manifest.json").write_text('{"manifest_version": 3, "name": "ext"}')
    with pytest.raises(KvqError, match="not a kvq artifact"):
        write_artifact(Artifact(make_manifest(), {}), precious, overwrite=True)
    assert sorted(p.name for p in precious.iterdir()) == ["manifest.json", "thesis.tex"]
    empty = tmp_path / "empty"
    empty.mkdir()
    write_artifact(Artifact(make_manifest(), {}), empty, overwrite=True)
    assert read_artifact(empty).tensors == {}


def test_overwrite_through_a_symlink_keeps_the_target(tmp_path, art):
    link = tmp_path / "link"
    link.symlink_to(art)
    write_artifact(Artifact(make_manifest(), {}), link, overwrite=True)
    assert not link.is_symlink() and read_artifact(link).tensors == {}
    assert read_artifact(art).tensors.keys() == make_tensors().keys()
