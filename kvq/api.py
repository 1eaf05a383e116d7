"""The Python API for users who embed kvq.

model, tokenizer = kvq.load_model("gemma3-270m")
artifact = kvq.load_artifact("artifacts/int4", model=model)   # validates
cache = kvq.make_cache(model, artifact=artifact)              # or policy="int8"
out = model.generate(**inputs, cache=cache)
cache.save("state.safetensors"); kvq.load_cache("state.safetensors", model, artifact=artifact)
"""

from __future__ import annotations

import os
from pathlib import Path

from kvq.artifacts.compat import load_artifact as _load_artifact
from kvq.artifacts.store import Artifact
from kvq.errors import KvqError
from kvq.models.loading import LoadedModel
from kvq.models.loading import load_model as _load
from kvq.pipeline import cache_for
from kvq.runtime.cache import QuantizedKVCache

_ATTR = "_kvq_loaded"


def load_model(spec: str = "gemma3-270m"):
    """Resolve a MODEL spec to (model, tokenizer); see `kvq.models.loading`."""
    loaded = _load(spec)
    # remembered on the model so artifacts can be checked against its identity later
    object.__setattr__(loaded.model, _ATTR, loaded)
    return loaded.model, loaded.tokenizer


def _loaded(model) -> LoadedModel:
    loaded = getattr(model, _ATTR, None)
    if loaded is None:
        raise KvqError("this model was not loaded through kvq.load_model; load it with kvq first")
    return loaded


def _check_type(value, types: tuple, what: str, expected: str) -> None:
    if not isinstance(value, types) or isinstance(value, bool):
        raise KvqError(f"{what} must be {expected}, got {type(value).__name__}")


def load_artifact(path: str | Path, model=None) -> Artifact:
    """Read an artifact, verify its tensors and, given a model, its compatibility."""
    _check_type(path, (str, os.PathLike), "path", "an artifact folder (str or Path)")
    return _load_artifact(path, _loaded(model) if model is not None else None)


def make_cache(
    model,
    artifact: Artifact | str | Path | None = None,
    policy: str | None = None,
    backend: str | None = None,
) -> QuantizedKVCache:
    """A fresh `QuantizedKVCache` for `model` from an artifact (object or path) or a policy name.

    backend: "auto" (Triton on CUDA, else the torch reference), "triton" or "reference";
    None reads the KVQ_BACKEND environment variable.
    An artifact with model transforms (SmoothAttention's scales) folds them into `model`'s
    weights in place, once (logged as a warning on the "kvq" logger); a second cache from
    the same artifact leaves the model alone.
    """
    loaded = _loaded(model)
    if artifact is not None:
        kinds = (Artifact, str, os.PathLike)
        _check_type(artifact, kinds, "artifact", "an Artifact or an artifact folder (str or Path)")
    for value, what in ((policy, "policy"), (backend, "backend")):
        if value is not None:
            _check_type(value, (str,), what, "a name (str)")
    if isinstance(artifact, (str, os.PathLike)):
        artifact = _load_artifact(artifact, loaded)
    return cache_for(loaded, artifact=artifact, policy=policy, backend=backend)


def load_cache(
    path: str | Path,
    model,
    artifact: Artifact | str | Path | None = None,
    policy: str | None = None,
    backend: str | None = None,
) -> QuantizedKVCache:
    """A cache for `model` from `artifact` or `policy` (as `make_cache`) holding the state
    `QuantizedKVCache.save` wrote at `path`; refuses a state saved for another model,
    artifact or layout."""
    from kvq.runtime.saved import restore_cache

    _check_type(path, (str, os.PathLike), "path", "a saved cache file (str or Path)")
    return restore_cache(make_cache(model, artifact=artifact, policy=policy, backend=backend), path)
