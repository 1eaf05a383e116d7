"""Artifacts on disk: a directory with `manifest.json` and `tensors.safetensors`.

    ART/
      manifest.json         the Manifest, indent 2, sorted keys
      tensors.safetensors   every tensor the manifest indexes (possibly none)

Writing is atomic: the artifact is built in a hidden sibling directory and
renamed into place, so a reader sees the old artifact, the new one, or none,
never a half-written one. Reading trusts nothing: the schema version, every
field, the set of tensor names and each tensor's dtype, shape and sha256 are
checked, and any difference is an `IncompatibleArtifact` naming the field.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
from dataclasses import dataclass, fields, is_dataclass, replace
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from torch import Tensor

from kvq.errors import IncompatibleArtifact, KvqError
from kvq.manifests.identity import ArchitectureInfo, ModelIdentity
from kvq.manifests.schema import Manifest, TensorEntry, manifest_from_json, manifest_to_json

MANIFEST_FILE = "manifest.json"
TENSORS_FILE = "tensors.safetensors"


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


def _check_replaceable(path: Path) -> None:
    """Only an artifact (or an empty directory) may be replaced by --overwrite.

    A mistyped `--out ~` must not delete a home directory.
    """
    if not path.is_dir():
        raise KvqError(f"{path} exists and is not a directory; refusing to overwrite it")
    if any(path.iterdir()) and not (path / MANIFEST_FILE).is_file():
        raise KvqError(f"{path} is a non-empty directory without {MANIFEST_FILE}; not replacing")


def write_artifact(artifact: Artifact, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
    """Write `artifact` to the directory `path` atomically; return its absolute path.

    The manifest written has its `tensors` index recomputed from the tensors,
    so it cannot disagree with them. An existing `path` is refused unless
    `overwrite`; then the old artifact is moved aside, the new one renamed in,
    and only then the old one deleted. On any exception, KeyboardInterrupt
    included, the temporary directory is removed and the old artifact restored.
    """
    path = Path(os.path.abspath(path))  # so "." and "ART/" have a name to rename
    if path.exists() or path.is_symlink():
        if not overwrite:
            raise KvqError(f"{path} exists; pass --overwrite")
        _check_replaceable(path)
    path.parent.mkdir(parents=True, exist_ok=True)

    tensors = {name: _cpu_contiguous(t) for name, t in artifact.tensors.items()}
    manifest = replace(artifact.manifest, tensors=tensor_index(tensors))
    text = json.dumps(manifest_to_json(manifest), indent=2, sort_keys=True, allow_nan=False)

    tmp = _sibling(path, "tmp", create=True)
    aside: Path | None = None
    try:
        (tmp / MANIFEST_FILE).write_text(text + "\n", encoding="utf-8")
        _fsync_file(tmp / MANIFEST_FILE)
        safetensors.torch.save_file(tensors, str(tmp / TENSORS_FILE), metadata={"format": "pt"})
        _fsync_file(tmp / TENSORS_FILE)
        _fsync_dir(tmp)
        if path.exists() or path.is_symlink():
            aside = _sibling(path, "old", create=False)
            os.rename(path, aside)
        os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if aside is not None and os.path.lexists(aside) and not os.path.lexists(path):
            os.rename(aside, path)  # put the old artifact back
        raise
    # The new artifact is in place; what remains cannot leave a half-written one.
    try:
        _fsync_dir(path.parent)
    finally:
        if aside is not None:
            _remove(aside)
    return path


def _remove(path: Path) -> None:
    # A symlinked artifact is replaced by a real directory: drop the link, not its target.
    if path.is_symlink():
        path.unlink()
    else:
        shutil.rmtree(path, ignore_errors=True)


def _sibling(path: Path, kind: str, *, create: bool) -> Path:
    """A fresh hidden name next to `path`, e.g. ".ART.tmp-1f2e3d4c".

    Created with a plain mkdir (not tempfile.mkdtemp, whose 0700 mode would
    stick to the finished artifact) so the usual umask applies.
    """
    for _ in range(100):
        candidate = path.with_name(f".{path.name}.{kind}-{secrets.token_hex(4)}")
        if create:
            try:
                candidate.mkdir()
            except FileExistsError:
                continue
            return candidate
        if not os.path.lexists(candidate):
            return candidate
    raise KvqError(f"cannot find a free temporary name next to {path}")


# --- reading ------------------------------------------------------------------------


def _reject_constant(name: str) -> Any:
    raise KvqError(f"manifest contains the non-JSON number {name}")


def read_artifact(path: str | os.PathLike) -> Artifact:
    """Load and verify an artifact; raise `KvqError` / `IncompatibleArtifact` if it is not sound."""
    path = Path(path)
    if not path.is_dir():
        raise KvqError(f"{path}: no such artifact directory")
    for name in (MANIFEST_FILE, TENSORS_FILE):
        if not (path / name).is_file():
            raise KvqError(f"{path}: missing {name}; not a kvq artifact")
    try:
        raw = json.loads(
            (path / MANIFEST_FILE).read_text(encoding="utf-8"), parse_constant=_reject_constant
        )
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise KvqError(f"{path / MANIFEST_FILE}: not valid JSON ({e})") from e
    manifest = manifest_from_json(raw)
    try:
        tensors = safetensors.torch.load_file(str(path / TENSORS_FILE))
    except Exception as e:  # SafetensorError and friends: a corrupt or truncated file
        raise KvqError(f"{path / TENSORS_FILE}: unreadable ({e})") from e
    _verify_tensors(manifest.tensors, tensors)
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


# --- compatibility ------------------------------------------------------------------


def check_model_compatible(
    manifest: Manifest, identity: ModelIdentity, architecture: ArchitectureInfo
) -> None:
    """Refuse a model that differs from the one the artifact was made for.

    Raises `IncompatibleArtifact` on the first difference, expected = the
    manifest's value, found = the model's, with a precise path such as
    "architecture.rope[3].theta". The model type is compared first and the
    architecture before the fingerprints: "num_kv_heads: expected 1, found 4"
    explains a wrong model better than two differing config hashes do.
    """
    _compare("identity.model_type", manifest.identity.model_type, identity.model_type)
    _compare("architecture", manifest.architecture, architecture)
    _compare("identity", manifest.identity, identity)


def _compare(path: str, expected: Any, found: Any) -> None:
    if is_dataclass(expected) and type(expected) is type(found):
        for f in fields(expected):
            _compare(f"{path}.{f.name}", getattr(expected, f.name), getattr(found, f.name))
    elif isinstance(expected, tuple) and isinstance(found, tuple):
        if len(expected) != len(found):
            raise IncompatibleArtifact(f"len({path})", len(expected), len(found))
        for i, (e, f) in enumerate(zip(expected, found, strict=True)):
            _compare(f"{path}[{i}]", e, f)
    elif expected != found:
        hint = "the artifact was made for a different model" if "sha256" in path else ""
        raise IncompatibleArtifact(path, expected, found, hint)
