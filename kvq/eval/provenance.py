"""What every run-eval report carries so that a figure can be traced and reproduced: the
model's identity, the cache policy and its settings, the backend and hardware, library
versions, the data's fingerprint, the seed and the baseline (article 0x0CD)."""

from __future__ import annotations

import platform
from importlib.metadata import PackageNotFoundError, version

import torch


def _version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def cpu_name() -> str:
    """The CPU model as /proc/cpuinfo names it (else what platform knows)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _policy_settings(policy) -> dict:
    """The cache policy's name and, per distinct layer setting, the layers that use it."""
    groups: dict[str, list[int]] = {}
    for i, lp in enumerate(policy.layers):
        desc = (f"K {lp.key.describe()} | V {lp.value.describe()} | {lp.key_stage} | "
                f"sink {lp.sink_tokens} | residual {lp.residual_tokens}")  # fmt: skip
        groups.setdefault(desc, []).append(i)
    prefix = policy.prefix
    return {
        "name": policy.name,
        "layers": [{"setting": d, "layers": layers} for d, layers in groups.items()],
        "prefix": None
        if prefix is None
        else {"tokens": len(prefix.token_ids), "source": prefix.source},  # fmt: skip
    }


def provenance(loaded, policy, backend, params, source, tasks) -> dict:
    """The report's `provenance` section (documented in the report schema)."""
    ident = loaded.identity
    device = next(loaded.model.parameters()).device
    return {
        "model": {"spec": loaded.spec, "model_type": ident.model_type,
                  "config_sha256": ident.config_sha256, "weights_sha256": ident.weights_sha256,
                  "tokenizer_sha256": ident.tokenizer_sha256,
                  "dtype": str(next(loaded.model.parameters()).dtype).removeprefix("torch.")},
        "tasks": list(tasks),
        "params": params.as_dict(),
        "cache_policy": _policy_settings(policy),
        "backend": backend or "auto",
        "device": str(device),
        "hardware": {"cpu": cpu_name(), "cpu_threads": torch.get_num_threads(),
                     "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None},
        "versions": {"kvq": _version("kvq-live"), "torch": torch.__version__,
                     "transformers": _version("transformers"), "python": platform.python_version()},
        "dataset": {"spec": source.spec, "sha256": source.sha256},
        "seed": params.seed,
        "baseline": "the same model unquantized: no cache for window tasks, transformers' "
                    "DynamicCache in its dtype for the others",
    }  # fmt: skip
