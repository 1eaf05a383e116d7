"""kvq.models: loading models by spec, architecture adapters, fingerprints."""

from kvq.models.adapters import ArchitectureAdapter, get_adapter
from kvq.models.fingerprint import model_identity
from kvq.models.loading import DEFAULT_MODEL, LoadedModel, load_model, load_model_pair

__all__ = [
    "DEFAULT_MODEL",
    "ArchitectureAdapter",
    "LoadedModel",
    "get_adapter",
    "load_model",
    "load_model_pair",
    "model_identity",
]
