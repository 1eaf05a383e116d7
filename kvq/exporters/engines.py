"""`kvq export vllm|modelopt`: a kvq artifact's K/V scales as a serving checkpoint.

    vllm      compressed-tensors: config.json `quantization_config.kv_cache_scheme`
              (num_bits 8, type float|int, strategy tensor|attn_head, dynamic false,
              symmetric true) and `<attn>.k_scale` / `<attn>.v_scale` float32 tensors of
              shape [1] (per tensor) or [H_kv] (per head), `<attn>` the layer's attention
              module (`model.layers.N.self_attn` for Llama-like models).
    modelopt  ModelOpt's layout, read by TensorRT-LLM and SGLang: `hf_quant_config.json`
              with `kv_cache_quant_algo` FP8|INT8 (weights unquantized: quant_algo null)
              and scalar float32 `<attn>.k_proj.k_scale` / `<attn>.v_proj.v_scale`.

Both hold the model's weights with the artifact's model transforms folded in (what kvq
calibrated against) and `kvq_export.json`: the scale manifest (format, scale convention,
shape and dtype, calibration passes, artifact identity, layers skipped) that makes the
checkpoint reproducible and lets `--overwrite` recognise it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from kvq.artifacts.paths import EXPORT_MARKER, MANIFEST_FILE, check_artifact_out
from kvq.artifacts.store import Artifact, read_artifact, tensor_index
from kvq.errors import KvqError
from kvq.exporters.checkpoint import write_checkpoint
from kvq.exporters.serving import ServingScales, Target, serving_scales
from kvq.manifests.schema import KVQ_VERSION
from kvq.progress import Progress


@dataclass(frozen=True)
class Engine:
    target: Target
    # (scales, attention module name per layer) -> tensors to add to the checkpoint
    tensors: Callable[[ServingScales, dict[int, str]], dict[str, Tensor]]
    edit_config: Callable[[ServingScales], Callable[[dict], None]]
    files: Callable[[ServingScales], dict[str, dict]]
    # how the engine is told to use the scales, and what it needs (the manifest records it)
    serve: Callable[[ServingScales], str]


# --- vLLM (compressed-tensors) --------------------------------------------------------

CT_STRATEGY = {"tensor": "tensor", "head": "attn_head"}


def kv_cache_scheme(s: ServingScales) -> dict:
    """compressed-tensors' QuantizationArgs of the K/V cache, as JSON."""
    if s.kv_format == "nvfp4":  # compressed-tensors' NVFP4 arguments, on K and V rows
        return {
            "num_bits": 4,
            "type": "float",
            "strategy": "tensor_group",
            "group_size": 16,
            "dynamic": "local",  # block scales at run time, the global scale static
            "symmetric": True,
            "scale_dtype": "float8_e4m3fn",
        }
    return {
        "num_bits": 8,
        "type": "int" if s.kv_format == "int8" else "float",
        "strategy": CT_STRATEGY[s.granularity],
        "dynamic": False,
        "symmetric": True,
    }


def _vllm_tensors(s: ServingScales, attn: dict[int, str]) -> dict[str, Tensor]:
    out = {}
    if s.kv_format == "nvfp4":  # compressed-tensors names a global scale <base>_global_scale
        for i, name in attn.items():
            out[f"{name}.k_global_scale"] = s.key[i].float().reshape(-1)  # [1]
            out[f"{name}.v_global_scale"] = s.value[i].float().reshape(-1)
        return out
    for i, name in attn.items():
        out[f"{name}.k_scale"] = s.key[i].float().reshape(-1)  # [1] or [H_kv]
        out[f"{name}.v_scale"] = s.value[i].float().reshape(-1)
    return out


def _vllm_config(s: ServingScales) -> Callable[[dict], None]:
    def edit(config: dict) -> None:
        config["quantization_config"] = {
            "quant_method": "compressed-tensors",
            "format": "dense",  # the weights are stored as they are
            "quantization_status": "frozen",
            "config_groups": {},
            "ignore": [],
            "kv_cache_scheme": kv_cache_scheme(s),
        }

    return edit


VLLM = Engine(
    Target("vLLM (compressed-tensors)", ("fp8-e4m3", "int8", "nvfp4"), ("tensor", "head")),
    _vllm_tensors,
    _vllm_config,
    lambda s: {},
    lambda s: (
        f"vllm serve DIR --kv-cache-dtype {'nvfp4' if s.kv_format == 'nvfp4' else 'fp8'}"
        + (" (per-head scales: the FlashAttention backend)" if s.granularity == "head" else "")
    ),
)


# --- ModelOpt (TensorRT-LLM, SGLang) ------------------------------------------------------


def _modelopt_tensors(s: ServingScales, attn: dict[int, str]) -> dict[str, Tensor]:
    out = {}
    for i, name in attn.items():
        k, v = s.key[i].float().reshape(()), s.value[i].float().reshape(())  # scalar per layer
        if s.kv_format == "nvfp4":  # ModelOpt's second-level scale: amax / (6 * 448) = 1 / g
            k, v = 1.0 / k, 1.0 / v
        out[f"{name}.k_proj.k_scale"] = k
        out[f"{name}.v_proj.v_scale"] = v
    return out


def hf_quant_config(s: ServingScales) -> dict:
    return {
        "producer": {"name": "kvq", "version": KVQ_VERSION},
        "quantization": {
            "quant_algo": None,
            "kv_cache_quant_algo": {"int8": "INT8", "nvfp4": "NVFP4"}.get(s.kv_format, "FP8"),
            "exclude_modules": [],
        },
    }


MODELOPT = Engine(
    Target("ModelOpt (TensorRT-LLM, SGLang)", ("fp8-e4m3", "int8", "nvfp4"), ("tensor",)),
    _modelopt_tensors,
    lambda s: lambda config: None,
    lambda s: {"hf_quant_config.json": hf_quant_config(s)},
    lambda s: (
        "TensorRT-LLM or SGLang: ModelOpt checkpoint, KV cache quant from hf_quant_config.json"
    ),
)

ENGINES = {"vllm": VLLM, "modelopt": MODELOPT}


# --- the job ------------------------------------------------------------------------------


def check_export(engine_name: str, artifact_path: Path, out: Path, overwrite: bool) -> Path:
    """Everything checkable before torch: the engine, the destination (a new folder, an
    empty one or a previous kvq export), the artifact folder. Returns the absolute out."""
    if engine_name not in ENGINES:
        raise KvqError(f"unknown export target {engine_name!r}; known: {', '.join(ENGINES)}")
    if not Path(artifact_path).is_dir():
        raise KvqError(f"{artifact_path}: no such artifact directory")
    return check_artifact_out(out, overwrite, export=True)


EXPORT_DTYPES = ("auto", "bfloat16", "float16", "float32")


def source_dtype(model_spec: str) -> torch.dtype:
    """The dtype the model's own files declare (config.json), which an export keeps: a
    bf16 model is not written at twice its size in fp32. A GGUF holds block-quantized
    weights, which kvq converts to fp32: bf16, the dtype engines serve, for those."""
    from kvq.models.loading import resolve_model_dir
    from kvq.models.spec import model_kind

    if model_kind(model_spec) in ("packaged", "gguf"):
        return torch.bfloat16
    config = Path(resolve_model_dir(model_spec)) / "config.json"
    declared = None
    if config.is_file():
        raw = json.loads(config.read_text(encoding="utf-8"))
        declared = raw.get("dtype") or raw.get("torch_dtype")
    return getattr(torch, declared) if declared in EXPORT_DTYPES[1:] else torch.float32


def export_job(
    engine_name: str,
    artifact_path: Path,
    model_spec: str | None,
    out: Path,
    overwrite: bool,
    progress: Progress,
    dtype: str = "auto",
) -> dict:
    """Read and check the artifact (refusing what the engine cannot represent before any
    model loads), load the model, fold the artifact's transforms in, write the checkpoint.
    Returns the scale manifest written as kvq_export.json.
    model_spec None: the model the artifact's manifest names. dtype: of the written
    weights; "auto" keeps the source model's (`source_dtype`). Scales stay fp32."""
    from kvq.artifacts.compat import load_artifact
    from kvq.pipeline import apply_transforms

    engine = ENGINES[engine_name]
    out = check_export(engine_name, artifact_path, out, overwrite)
    with progress.stage("read artifact"):
        artifact = read_artifact(artifact_path)
        scales = serving_scales(artifact, engine.target)
    model_spec = model_spec or artifact.manifest.model_spec
    weights_dtype = source_dtype(model_spec) if dtype == "auto" else getattr(torch, dtype)
    from kvq.models.loading import load_model

    with progress.stage("load model"):
        loaded = load_model(model_spec)
        load_artifact(artifact_path, loaded)  # the model the artifact was made for
    apply_transforms(loaded, artifact.tensors, progress)
    modules = {id(m): n for n, m in loaded.model.named_modules()}
    attn = {i: modules[id(loaded.adapter.attention(i))] for i in scales.key}
    marker = _marker(engine_name, engine, artifact, Path(artifact_path), model_spec, loaded, scales)
    marker["model"]["dtype"] = str(weights_dtype).removeprefix("torch.")
    loaded.model.to(weights_dtype)  # last use of the model: its fp32 copy is not needed
    with progress.stage(f"write {engine_name} checkpoint"):
        write_checkpoint(
            loaded.model,
            loaded.tokenizer,
            out,
            engine.tensors(scales, attn),
            engine.edit_config(scales),
            {**engine.files(scales), EXPORT_MARKER: marker},
            overwrite,
        )
    return marker


def _marker(name, engine, artifact: Artifact, path: Path, model_spec, loaded, s) -> dict:
    """The scale manifest: what an engine needs to reproduce kvq's numbers from this
    checkpoint, and where they came from."""
    manifest = artifact.manifest
    scale_names = {n for i in s.key for n in (f"layers.{i}.key.scale", f"layers.{i}.value.scale")}
    return {
        "kvq_export": name,
        "kvq_version": KVQ_VERSION,
        "target": engine.target.name,
        "model": {"spec": model_spec, "weights_sha256": loaded.identity.weights_sha256},
        "artifact": {
            "path": str(path),
            "manifest_sha256": hashlib.sha256((path / MANIFEST_FILE).read_bytes()).hexdigest(),
            "policy": manifest.policy.name,
            "passes": [
                {"method": p.method, "options": p.options, "dataset": p.dataset and p.dataset.spec}
                for p in manifest.passes
            ],
            "scales_sha256": {
                n: e.sha256 for n, e in tensor_index(artifact.tensors).items() if n in scale_names
            },
        },
        "kv_cache": {
            "format": s.kv_format,
            "granularity": s.granularity,
            "scale": "x = code * scale; scale = clip / largest code (448 E4M3, 127 INT8)",
            "scale_dtype": "float32",
            "key_stage": "post-rope",
            "query_quantized": False,
            "serve": engine.serve(s),
            "layers": sorted(s.key),
            "skipped_layers": [],
        },
    }
