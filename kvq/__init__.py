"""kvq: calibration, versioned artifacts and a packed-code runtime for live-data quantization."""

from kvq.errors import IncompatibleArtifact, KvqError

__all__ = [
    "IncompatibleArtifact",
    "KvqError",
    "QuantizedKVCache",
    "load_artifact",
    "load_cache",
    "load_model",
    "make_cache",
]

_API = ("load_artifact", "load_cache", "load_model", "make_cache", "QuantizedKVCache")


def __getattr__(name: str):
    # The library entry points import torch and transformers (seconds); loading them on
    # first use keeps `import kvq` and the command line's --help and input errors instant.
    if name in _API:
        from kvq import api

        return getattr(api, name)
    raise AttributeError(f"module 'kvq' has no attribute {name!r}")
