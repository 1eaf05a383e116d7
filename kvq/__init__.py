"""kvq: calibration, versioned artifacts and a packed-code runtime for live-data quantization."""

from kvq.api import load_artifact, load_model, make_cache
from kvq.errors import IncompatibleArtifact, KvqError

__all__ = ["IncompatibleArtifact", "KvqError", "load_artifact", "load_model", "make_cache"]
