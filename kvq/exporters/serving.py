"""What a serving engine can take from a kvq artifact: static K/V scales, or a refusal.

vLLM (compressed-tensors), TensorRT-LLM and SGLang (ModelOpt) store K and V post-RoPE in
one 8-bit format for every attention layer, with ONE static scale per tensor (or per KV
head, where the target supports it) and nothing else: no codebook, no per-channel or
per-token qparams, no exact sink rows, no sparse exceptions. `serving_scales` walks the
artifact's policy and either returns the scales, or refuses with one line naming the
first field the target cannot represent and what it supports. Everything is checked
from the manifest, before a model is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from kvq.artifacts.store import Artifact
from kvq.errors import KvqError
from kvq.quant.schemes import QuantScheme


@dataclass(frozen=True)
class Target:
    """A serving format: what it calls itself, and the K/V caches it can hold."""

    name: str  # e.g. "vLLM (compressed-tensors)"
    formats: tuple[str, ...]  # of "fp8-e4m3", "fp8-e5m2", "int8"
    granularities: tuple[str, ...]  # of "tensor", "head"

    @property
    def supports(self) -> str:
        return f"{'/'.join(self.formats)} K/V with static per-{'/per-'.join(self.granularities)} scales"


@dataclass(frozen=True)
class ServingScales:
    """The one K/V format of an artifact and its scales, layer by layer."""

    kv_format: str  # "fp8-e4m3", "fp8-e5m2", "int8" or "nvfp4" (scales: its global ones)
    granularity: str  # "tensor" or "head"
    key: dict[int, Tensor]  # layer -> float32 [1] (tensor) or [H_kv] (head)
    value: dict[int, Tensor]


def scheme_format(scheme: QuantScheme) -> str | None:
    """The serving name of a scheme's number format, or None if engines have none."""
    if scheme.format == "fp8":
        return f"fp8-{scheme.fp8_format}"
    if scheme.format == "int" and scheme.bits == 8 and scheme.symmetric:
        return "int8"
    if scheme.format == "nvfp4":
        return "nvfp4"
    return None


def _refuse(target: Target, field: str, found: object, why: str) -> KvqError:
    return KvqError(f"{target.name} cannot represent {field} = {found}: {why}; "
                    f"it supports {target.supports}")  # fmt: skip


def _check_scheme(target: Target, where: str, scheme: QuantScheme) -> tuple[str, str]:
    """(format, granularity) of one stored scheme, or the refusal naming its field."""
    if scheme.outlier_fraction:
        raise _refuse(
            target, f"{where}.outlier_fraction", scheme.outlier_fraction, "sparse exceptions"
        )
    if scheme.format == "nvfp4":  # block scales at run time, one static global scale
        if "nvfp4" not in target.formats:
            raise _refuse(target, f"{where}.format", "nvfp4", "a format it does not store")
        return "nvfp4", "tensor"
    if scheme.format == "nuq":
        raise _refuse(target, f"{where}.format", "nuq", "a non-uniform codebook")
    if scheme.format == "int" and scheme.bits != 8:
        raise _refuse(target, f"{where}.bits", scheme.bits, f"no INT{scheme.bits} cache")
    if scheme.format == "int" and not scheme.symmetric:
        raise _refuse(target, f"{where}.symmetric", False, "an offset (asymmetric INT)")
    if scheme.lifetime != "static" or scheme.axis == "token":
        raise _refuse(
            target, f"{where}.axis", f"{scheme.axis} ({scheme.lifetime})",
            "scales computed per token at run time, where the target loads static ones",
        )  # fmt: skip
    fmt = scheme_format(scheme)
    if fmt not in target.formats:
        field = f"{where}.fp8_format" if scheme.format == "fp8" else f"{where}.format"
        raise _refuse(target, field, fmt, "a format it does not store")
    if scheme.axis not in target.granularities:
        raise _refuse(target, f"{where}.axis", scheme.axis, "scales of that shape")
    return fmt, scheme.axis


def serving_scales(artifact: Artifact, target: Target) -> ServingScales:
    """The artifact's static K/V scales for `target`, or a KvqError naming the field."""
    policy = artifact.manifest.policy
    chosen: tuple[str, str] | None = None
    key, value = {}, {}
    if policy.prefix is not None:  # an engine would serve the prompts without it
        raise _refuse(
            target, "policy.prefix", f"{policy.prefix.length} tokens", "no declared prefix state"
        )
    for i, layer in enumerate(policy.layers):
        where = f"policy.layers[{i}]"
        if not layer.key.stored or not layer.value.stored:
            raise _refuse(
                target, f"{where}.key" if not layer.key.stored else f"{where}.value",
                "16-bit", "one cache format covers every attention layer (no skipped layers)",
            )  # fmt: skip
        if layer.key_stage != "post-rope":
            raise _refuse(target, f"{where}.key_stage", layer.key_stage, "keys stored after RoPE")
        if layer.sink_tokens:
            raise _refuse(
                target, f"{where}.sink_tokens", layer.sink_tokens, "every row quantized alike"
            )
        for part, scheme in (("key", layer.key), ("value", layer.value)):
            got = _check_scheme(target, f"{where}.{part}", scheme)
            if chosen is None:
                chosen = got
            elif got != chosen:
                raise _refuse(
                    target, f"{where}.{part}", " per-".join(got),
                    f"one format and scale shape for all K and V (layer 0 has {' per-'.join(chosen)})",
                )  # fmt: skip
            # NVFP4: the calibrated global scale (its block scales are computed at append)
            name = "global_scale" if got[0] == "nvfp4" else "scale"
            if f"layers.{i}.{part}.{name}" not in artifact.tensors:  # a named policy's 1.0
                raise _refuse(target, f"{where}.{part}", "no calibrated scale",
                              "scales from `kvq calibrate kv-scales`")  # fmt: skip
            (key if part == "key" else value)[i] = artifact.tensors[f"layers.{i}.{part}.{name}"]
    return ServingScales(chosen[0], chosen[1], key, value)
