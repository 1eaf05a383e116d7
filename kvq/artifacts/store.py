"""Artifacts on disk: a directory with `manifest.json` and `tensors.safetensors`.

    ART/
      manifest.json         the Manifest, indent 2, sorted keys
      tensors.safetensors   every tensor the manifest indexes (possibly none)

Writing is atomic: the artifact is built in a hidden sibling directory and
swapped into place, so a reader sees the old artifact or the new one, never a
half-written one (`kvq.artifacts.paths`). Reading trusts nothing: the schema
version, every field and its range, the set of tensor names, each tensor's
dtype, shape and sha256, and the values of every stored qparam are checked, and
any difference is an `IncompatibleArtifact` naming the field.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import safetensors.torch
import torch
from torch import Tensor

from kvq.artifacts import paths
from kvq.artifacts.paths import MANIFEST_FILE, TENSORS_FILE
from kvq.errors import IncompatibleArtifact, KvqError
from kvq.jsonio import strict_loads
from kvq.manifests.schema import Manifest, TensorEntry, manifest_from_json, manifest_to_json
from kvq.runtime.validate import check_artifact_state


@dataclass
class Artifact:
    """A manifest and the tensors it indexes, as held in memory."""

    manifest: Manifest
    tensors: dict[str, Tensor]


def _dtype_name(t: Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")  # torch.float8_e4m3fn -> "float8_e4m3fn"


def _cpu_contiguous(t: Tensor) -> Tensor:
    # A private contiguous copy: safetensors refuses views that share storage,
    # and the hash must cover exactly the bytes that are written.
    return t.detach().to("cpu").clone(memory_format=torch.contiguous_format)


def _sha256(t: Tensor) -> str:
    """sha256 of the raw little-endian bytes of a contiguous CPU tensor, any dtype."""
    raw = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    return hashlib.sha256(raw.numpy().tobytes()).hexdigest()


def tensor_index(tensors: dict[str, Tensor]) -> dict[str, TensorEntry]:
    """The manifest's tensor index: dtype name, shape and sha256 of each tensor."""
    return {
        name: TensorEntry(dtype=_dtype_name(t), shape=tuple(t.shape), sha256=_sha256(t))
        for name, t in sorted(tensors.items())
    }


# --- writing ------------------------------------------------------------------------


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    # Makes the renames themselves durable; not every platform can open a directory.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_artifact(artifact: Artifact, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
    """Write `artifact` to the directory `path` atomically; return its absolute path.

    The manifest written has its `tensors` index recomputed from the tensors,
    so it cannot disagree with them. An existing `path` is refused unless
    `overwrite`, and even then only a kvq artifact or an empty directory is
    replaced (`paths.check_replaceable`). The new artifact is built in a hidden
    sibling and swapped in (`paths.swap_into_place`); on any exception,
    KeyboardInterrupt included, the sibling is removed and the old artifact stays.
    """
    path = paths.claim(Path(path), overwrite, paths.check_replaceable)

    tensors = {name: _cpu_contiguous(t) for name, t in artifact.tensors.items()}
    manifest = replace(artifact.manifest, tensors=tensor_index(tensors))
    text = json.dumps(manifest_to_json(manifest), indent=2, sort_keys=True, allow_nan=False)

    # a plain mkdir (not tempfile.mkdtemp, whose 0700 mode would stick to the artifact)
    tmp = paths.sibling(path, "tmp")
    tmp.mkdir()
    old: Path | None = None
    try:
        (tmp / MANIFEST_FILE).write_text(text + "\n", encoding="utf-8")
        _fsync_file(tmp / MANIFEST_FILE)
        safetensors.torch.save_file(tensors, str(tmp / TENSORS_FILE), metadata={"format": "pt"})
        _fsync_file(tmp / TENSORS_FILE)
        _fsync_dir(tmp)
        old = paths.swap_into_place(tmp, path)
    finally:
        if old is None and os.path.lexists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    # The new artifact is in place; what remains cannot leave a half-written one.
    try:
        _fsync_dir(path.parent)
    finally:
        if old is not None:
            paths.remove_tree(old)
    return path


# --- reading ------------------------------------------------------------------------


def read_artifact(path: str | os.PathLike) -> Artifact:
    """Load and verify an artifact; raise `KvqError` / `IncompatibleArtifact` if it is not sound.

    Beyond bytes (hashes), the values are checked: the manifest's numbers by the manifest
    dataclasses, every stored qparam and codebook by `check_artifact_state`.
    """
    path = Path(path)
    with contextlib.suppress(OSError):  # a read-only place: nothing to restore there
        paths.recover(path)  # a write killed mid-swap: put the old artifact back
    if not path.is_dir():
        raise KvqError(f"{path}: no such artifact directory")
    before = paths.identity(path)
    for name in (MANIFEST_FILE, TENSORS_FILE):
        if not (path / name).is_file():
            raise KvqError(f"{path}: missing {name}; not a kvq artifact")
    try:
        raw = strict_loads((path / MANIFEST_FILE).read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise KvqError(f"{path / MANIFEST_FILE}: not valid JSON ({e})") from None
    manifest = manifest_from_json(raw)
    try:
        tensors = safetensors.torch.load_file(str(path / TENSORS_FILE))
    except Exception as e:  # SafetensorError and friends: a corrupt or truncated file
        raise KvqError(f"{path / TENSORS_FILE}: unreadable ({e})") from e
    # a concurrent --overwrite between the two reads: the files are of two artifacts
    if paths.identity(path) != before:
        raise KvqError(f"{path}: another run replaced the artifact while this one read it")
    _verify_tensors(manifest.tensors, tensors)
    check_artifact_state(manifest, tensors)
    return Artifact(manifest=manifest, tensors={n: tensors[n] for n in sorted(tensors)})


def _verify_tensors(index: dict[str, TensorEntry], tensors: dict[str, Tensor]) -> None:
    missing = sorted(index.keys() - tensors.keys())
    if missing:
        raise IncompatibleArtifact(f"tensors[{missing[0]}]", "present", "missing")
    extra = sorted(tensors.keys() - index.keys())
    if extra:
        raise IncompatibleArtifact(
            f"tensors[{extra[0]}]", "absent", "present (not in the manifest)"
        )
    for name in sorted(index):
        entry, t = index[name], tensors[name]
        if _dtype_name(t) != entry.dtype:
            raise IncompatibleArtifact(f"tensors[{name}].dtype", entry.dtype, _dtype_name(t))
        if tuple(t.shape) != entry.shape:
            raise IncompatibleArtifact(f"tensors[{name}].shape", entry.shape, tuple(t.shape))
        digest = _sha256(t)
        if digest != entry.sha256:
            raise IncompatibleArtifact(
                f"tensors[{name}].sha256", entry.sha256, digest, "tensor data was modified"
            )
