"""kvq.models: loading models by spec, architecture adapters, fingerprints.

`kvq.models.spec` is torch-free and checked by the command line before anything heavy;
the rest imports torch and transformers, so it is loaded on first use.
"""

from kvq.models.spec import DEFAULT_MODEL

__all__ = [
    "DEFAULT_MODEL",
    "ArchitectureAdapter",
    "LoadedModel",
    "get_adapter",
    "load_model",
    "load_model_pair",
    "model_identity",
]

_LAZY = {
    "ArchitectureAdapter": "kvq.models.adapters",
    "get_adapter": "kvq.models.adapters",
    "model_identity": "kvq.models.fingerprint",
    "LoadedModel": "kvq.models.loading",
    "load_model": "kvq.models.loading",
    "load_model_pair": "kvq.models.loading",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvq.models' has no attribute {name!r}")
