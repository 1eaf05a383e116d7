"""An engine's K/V format served with the scales of a kvq artifact: `--policy ENGINE:FORMAT
--artifact ART` (run-eval, generate, `kvq.make_cache`), what the engine does with the
checkpoint `kvq export` writes from ART.

ART holds per-tensor K and V scales of the format the engine loads (`kvq calibrate
kv-scales --format int8 | fp8-e4m3 | fp8-e5m2 | nvfp4`); the cache stores every layer with
the engine's numerics and those scales as the engine loads them (`loaded_scales`:
TensorRT-LLM's INT8 keeps one per layer for K and V). The only way to run a format without
a default scale (`trtllm:int8`) on all of run-eval's tasks.
"""

from __future__ import annotations

import hashlib
import json

from kvq.artifacts.compat import check_model_compatible
from kvq.artifacts.store import Artifact
from kvq.calibrators.base import tensor_kind
from kvq.engines.formats import check_scaled, engine_policy, parse
from kvq.errors import KvqError
from kvq.models.loading import LoadedModel
from kvq.quant import kv_formats
from kvq.runtime.cache import QuantizedKVCache, build_cache
from kvq.runtime.prefix import Prefix


def engine_cache(
    loaded: LoadedModel,
    artifact: Artifact,
    name: str,
    backend: str | None = None,
    quantize: str = "both",
    prefix: Prefix | None = None,
) -> QuantizedKVCache:
    check_scaled(name)
    fmt = parse(name)
    info = loaded.adapter.info
    check_model_compatible(artifact.manifest, loaded.identity, info)
    wanted = kv_formats.scheme_for(fmt.key.calibrated, "tensor")
    stored = artifact.manifest.policy
    if stored.prefix is not None:
        raise KvqError(f"{name}: the artifact declares a prefix, which the engine does not serve")
    for i, layer in enumerate(stored.layers):
        for scheme in (layer.key, layer.value):
            if scheme != wanted:
                raise KvqError(
                    f"{name} loads per-tensor {fmt.key.calibrated} scales; the artifact's "
                    f"layer {i} holds {scheme.describe()} (make them: kvq calibrate kv-scales "
                    f"--format {fmt.key.calibrated})"
                )
    static = {n: t for n, t in artifact.tensors.items() if tensor_kind(n) == "policy"}
    cache = scaled_cache(loaded, name, static, backend, quantize, prefix)
    index = {n: e.sha256 for n, e in sorted(artifact.manifest.tensors.items())}
    cache.identity["artifact"] = hashlib.sha256(json.dumps(index).encode()).hexdigest()
    return cache


def scaled_cache(
    loaded: LoadedModel,
    name: str,
    scales: dict,
    backend: str | None = None,
    quantize: str = "both",
    prefix: Prefix | None = None,
) -> QuantizedKVCache:
    """The engine format `name` over every layer with calibrated per-tensor K/V `scales`
    ("layers.{i}.key.scale", ...), as the engine loads them (`loaded_scales`)."""
    info = loaded.adapter.info
    served = engine_policy(name, info.num_layers, info.head_dim, calibrated=True).only(quantize)
    if prefix is not None:
        served = served.with_prefix(prefix.spec)
    loaded_scales = parse(name).loaded_scales(scales)
    return build_cache(loaded.model, served, loaded_scales, loaded.adapter, backend, prefix)
