"""Whether an artifact may serve a model: its identity and architecture, its declared state.

`load_artifact` is what every command and the Python API call: read and verify the files
(`kvq.artifacts.store`), then, given the model, refuse one made for another.
"""

from __future__ import annotations

from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvq.artifacts.store import Artifact, read_artifact
from kvq.errors import IncompatibleArtifact, KvqError
from kvq.manifests.identity import ArchitectureInfo, ModelIdentity
from kvq.manifests.schema import Manifest

if TYPE_CHECKING:
    from kvq.models.loading import LoadedModel


def load_artifact(path: str | Path, loaded: LoadedModel | None = None) -> Artifact:
    """Read and validate an artifact; with a model, also check it was made for that model."""
    artifact = read_artifact(Path(path))
    check_prefix_declared(artifact.manifest)
    if loaded is not None:
        check_model_compatible(artifact.manifest, loaded.identity, loaded.adapter.info)
    return artifact


def check_prefix_declared(manifest) -> None:
    """A pass calibrated with --prefix-ids needs that prefix served: kvq before prefixes
    were declared state kept it as sink rows and in the pass options only; refuse such an
    artifact rather than serve it without its prefix."""
    if manifest.policy.prefix is not None:
        return
    for p in manifest.passes:
        ids = p.options.get("prefix_ids")
        if ids not in (None, "", "none"):
            raise KvqError(
                f"the artifact's {p.method} pass was calibrated with --prefix-ids {ids}, but "
                "its policy declares no prefix (made before prefixes were declared state); "
                "calibrate it again"
            )


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
