"""Serving engines' K/V cache formats, reproduced as kvq layouts named ENGINE:FORMAT.

Each entry reproduces what that engine stores for a cached key or value row: its number
format, what one scale covers, its rounding and clamping, and the scale it assumes when a
checkpoint has none. `--policy ENGINE:FORMAT` runs it through kvq's cache like any layout;
`kvq advise` sweeps an engine's menu. Where the engine takes K and V formats apart
(llama.cpp's -ctk / -ctv), `ENGINE:K/V` names both (`llamacpp:q8_0/q4_0`).

Sources the numerics were read from (public code; see also the README):
- llama.cpp: ggml-org/llama.cpp ggml/src/ggml-quants.c (`quantize_row_q8_0_ref`,
  `quantize_row_q4_0_ref`, ...) and gguf-py/gguf/quants.py, which kvq's tests compare
  against bit for bit; K rows are stored after RoPE, V rows along head_dim (flash
  attention), blocks of 32 channels. iq4_nl: ggml/src/ggml-cuda/cpy-utils.cuh
  (`quantize_f32_iq4_nl_block`, what a CUDA K/V cache stores; the CPU backend's
  `quantize_row_iq4_nl_ref` searches 15 scales and can pick other codes), decoded as
  gguf-py's `IQ4_NL` (bit-exact in the tests).
- vLLM per-token-head int8 / fp8: vllm-project/vllm
  vllm/v1/attention/ops/triton_reshape_and_cache_flash.py (`_reshape_cache_per_token_head`),
  reproduced in `kvq.quant.token_head` (int8 codes truncated toward zero).
- vLLM int4_per_token_head: vllm/v1/attention/ops/int4_per_token_head.py (a randomized
  Hadamard transform, then 4-bit min/max codes and one float32 word per row, its zero
  in the scale's low mantissa bits), reproduced in `kvq.quant.vllm_int4`.
- SGLang fp4_e2m1: sgl-project/sglang python/sglang/srt/layers/quantization/kvfp4_tensor.py
  (`FP4MXBlock16KVQuantizeUtil`), reproduced in `kvq.quant.mxfp4`.
- vLLM / SGLang: FP8 E4M3 / E5M2 of x / scale, saturated to the format's largest finite
  value, one scale per K or V tensor of a layer, 1.0 when the checkpoint carries none
  (compressed-tensors' `quantize` is the reference the tests compare against).
- vLLM TurboQuant (turboquant_k8v4, _4bit_nc, _k3v4_nc, _3bit_nc): vllm-project/vllm
  vllm/model_executor/layers/quantization/turboquant/ (presets, codebook, the boundary
  layers it never quantizes) and vllm/v1/attention/ops/triton_turboquant_store.py /
  triton_turboquant_decode.py, reproduced in `kvq.quant.turboquant`.
- TensorRT-LLM: FP8 per tensor as above. INT8: NVIDIA/TensorRT-LLM's attention layer
  (one `kv_cache_scaling_factor` per layer for K and V; the fused QKV kernel stores
  `cvt.rni.sat.s8.f32(x * (1 / scale))`) and NVIDIA/TensorRT-Model-Optimizer's
  `get_kv_cache_scaling_factor` (the larger of the K and V scales, amax / 127), reproduced in
  `kvq.quant.trtllm_int8`; it has no default scale, so it runs only with calibrated ones.
- NVFP4 (vLLM, TensorRT-LLM): E2M1 codes in blocks of 16, FP8 E4M3 block scales, a
  float32 global scale per tensor (compressed-tensors' `generate_gparam`,
  `calculate_qparams`, `quantize`, bit-exact in the tests; 1.0 uncalibrated).

No torch here: `policy_by_name` resolves these names (and kvq's own) before the model
loads.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvq.errors import KvqError
from kvq.quant.schemes import (
    FULL_PRECISION,
    GGML_BLOCK,
    GGML_TYPES,
    SGLANG_FP4,
    TRTLLM_INT8,
    TURBOQUANT_PRESETS,
    CachePolicy,
    LayerPolicy,
    QuantScheme,
    ggml_symmetric,
    named_policy,
    turboquant_boundary,
    turboquant_head_dim,
    turboquant_key,
    turboquant_value,
)


def _ggml(name: str) -> QuantScheme:
    return QuantScheme(
        format="ggml", bits=GGML_TYPES[name], axis="token", symmetric=ggml_symmetric(name),
        group_size=GGML_BLOCK, ggml_type=name,
    )  # fmt: skip


NVFP4 = QuantScheme(format="nvfp4", bits=4, axis="token", symmetric=True, group_size=16,
                    scale_dtype="float32")  # fmt: skip


def _token_head(fmt: str) -> QuantScheme:
    """vLLM's int8 / fp8 per-token-head: a float32 scale per (token, head) at append."""
    return QuantScheme(
        format=fmt, bits=8, symmetric=True, scale_dtype="float32", engine="vllm",
        fp8_format="e4m3" if fmt == "fp8" else None,
    )  # fmt: skip


# vLLM's int4_per_token_head: rows Hadamard-rotated, then min/max 4-bit (kvq.quant.vllm_int4)
VLLM_INT4 = QuantScheme(format="int", bits=4, symmetric=False, scale_dtype="float32",
                        engine="vllm")  # fmt: skip


def _fp8_tensor(fmt: str) -> QuantScheme:
    return QuantScheme(
        format="fp8", bits=8, axis="tensor", symmetric=True, scale_dtype="float32",
        lifetime="static", fp8_format=fmt,
    )  # fmt: skip


@dataclass(frozen=True)
class StoredAs:
    """One side's format in an engine: the kvq scheme and the engine's bits per element."""

    scheme: QuantScheme
    bits: float  # what the engine stores per element, scales included
    calibrated: str | None = None  # the kv-scales --format whose scales the engine loads
    needs_scales: bool = False  # no default scale: the engine serves it calibrated only
    # a format whose K and V differ (TurboQuant): this entry is its K side, `value` its V
    value: StoredAs | None = None
    boundary: bool = False  # the engine keeps the boundary layers unquantized (TurboQuant)


_GGML_BITS = {"q8_0": 8.5, "q4_0": 4.5, "q4_1": 5.0, "q5_0": 5.5, "q5_1": 6.0, "iq4_nl": 4.5}
LLAMACPP = {"f16": StoredAs(FULL_PRECISION, 16.0)} | {
    name: StoredAs(_ggml(name), bits) for name, bits in _GGML_BITS.items()
}
_FP8 = {
    "fp8_e4m3": StoredAs(_fp8_tensor("e4m3"), 8.0, "fp8-e4m3"),
    "fp8_e5m2": StoredAs(_fp8_tensor("e5m2"), 8.0, "fp8-e5m2"),
}


def _turboquant(name: str) -> StoredAs:
    """A TurboQuant preset (`kvq.quant.turboquant`): its K side, V side inside."""
    k, v = TURBOQUANT_PRESETS[name]
    key = _fp8_tensor("e4m3") if k == 8 else turboquant_key(k)  # k8: FP8 of x, scale 1
    value = StoredAs(turboquant_value(v), float(v))
    return StoredAs(key, float(k), value=value, boundary=True)


# engine -> its K/V formats; "fp8" is vLLM's alias of fp8_e4m3
ENGINES: dict[str, dict[str, StoredAs]] = {
    "llamacpp": LLAMACPP,
    "vllm": {
        "auto": StoredAs(FULL_PRECISION, 16.0),
        **_FP8,
        "fp8": _FP8["fp8_e4m3"],
        "nvfp4": StoredAs(NVFP4, 4.5, "nvfp4"),
        # 8 bits plus a float32 scale per (token, head): 8.125 at head_dim 256
        "int8_per_token_head": StoredAs(_token_head("int"), 8.0),
        "fp8_per_token_head": StoredAs(_token_head("fp8"), 8.0),
        # 4 bits plus a float32 word (scale and zero) per (token, head): 4.125 at 256
        "int4_per_token_head": StoredAs(VLLM_INT4, 4.0),
        **{name: _turboquant(name) for name in TURBOQUANT_PRESETS},
    },  # fmt: skip
    "sglang": {
        "auto": StoredAs(FULL_PRECISION, 16.0),
        **_FP8,
        "fp4_e2m1": StoredAs(SGLANG_FP4, 4.5),  # 4-bit codes, an exponent byte per 16
    },  # fmt: skip
    "trtllm": {
        "fp8": _FP8["fp8_e4m3"],
        "int8": StoredAs(TRTLLM_INT8, 8.0, "int8", needs_scales=True),
        "nvfp4": StoredAs(NVFP4, 4.5, "nvfp4"),
    },
}
SPLIT_KV = ("llamacpp",)  # engines with separate K and V formats
UNIT_SCALE = 1.0  # the scale an engine assumes when the checkpoint carries none


@dataclass(frozen=True)
class EngineFormat:
    engine: str
    key_name: str  # the engine's own names of the K and V formats
    value_name: str

    @property
    def key(self) -> StoredAs:
        return ENGINES[self.engine][self.key_name]

    @property
    def value(self) -> StoredAs:
        side = ENGINES[self.engine][self.value_name]
        return side.value or side

    @property
    def name(self) -> str:
        k, v = self.key_name, self.value_name
        return f"{self.engine}:{k}" if k == v else f"{self.engine}:{k}/{v}"

    @property
    def bits_per_element(self) -> float:
        """The engine's storage, mean of K and V."""
        return (self.key.bits + self.value.bits) / 2

    @property
    def loads_scales(self) -> bool:
        return self.key.calibrated is not None

    @property
    def needs_scales(self) -> bool:
        return self.key.needs_scales or self.value.needs_scales

    def loaded_scales(self, tensors: dict) -> dict:
        """Calibrated per-tensor K and V scales (`kv-scales` tensors, "layers.{i}.key.scale"
        ...) as this engine loads them: TensorRT-LLM's INT8 has one scale per layer for
        both, the larger (`trtllm_int8.shared_scale`); other engines load each as is."""
        if self.key.scheme != TRTLLM_INT8:
            return tensors
        from kvq.quant.trtllm_int8 import shared_scale

        out = dict(tensors)
        for name in tensors:
            if name.endswith(".key.scale"):
                layer = name.removesuffix(".key.scale")
                both = shared_scale(tensors[name], tensors[f"{layer}.value.scale"])
                out[name] = out[f"{layer}.value.scale"] = both
        return out

    def flags(self) -> str:
        """What to pass the engine for this format."""
        k, v = self.key_name, self.value_name
        if self.engine == "llamacpp":
            fa = " -fa on" if v != "f16" else ""  # a quantized V cache needs flash attention
            return f"-ctk {k} -ctv {v}{fa}"
        if self.engine in ("vllm", "sglang"):
            return f"--kv-cache-dtype {k}"
        algo = {"nvfp4": "NVFP4", "int8": "INT8"}.get(k, "FP8")
        return f"kv_cache_quant_algo {algo} (hf_quant_config.json of a ModelOpt checkpoint)"


def parse(name: str) -> EngineFormat:
    """ "ENGINE:FORMAT" or "ENGINE:K/V" -> EngineFormat; one-line KvqError otherwise."""
    engine, _, rest = name.partition(":")
    if engine not in ENGINES:
        raise KvqError(f"unknown engine {engine!r} in {name!r}; known: {', '.join(ENGINES)}")
    menu = ENGINES[engine]
    k, slash, v = rest.partition("/")
    if slash and engine not in SPLIT_KV:
        raise KvqError(f"{engine} takes one K/V cache format, not separate K and V ({name!r})")
    v = v if slash else k
    for side in (k, v):
        if side not in menu:
            raise KvqError(f"{engine} has no K/V cache format {side!r}; it has: {', '.join(menu)}")
    return EngineFormat(engine, k, v)


def check_scaled(name: str) -> None:
    """An ENGINE:FORMAT whose engine loads scales (to serve with an artifact's kv-scales,
    `kvq.engines.scaled`), else the one-line refusal of an artifact and a policy together."""
    if ":" not in name or not parse(name).loads_scales:
        raise KvqError(
            "give exactly one of --artifact or --policy (both: an ENGINE:FORMAT whose engine "
            f"loads scales, served with the artifact's kv-scales; {name!r} is not one)"
        )


def menu(engine: str) -> list[EngineFormat]:
    """Every format of `engine` ("all": of every engine), K and V alike, aliases once."""
    if engine == "all":
        return [f for e in ENGINES for f in menu(e)]
    if engine not in ENGINES:
        raise KvqError(f"unknown engine {engine!r}; known: {', '.join(ENGINES)}, all")
    seen, out = set(), []
    for name, side in ENGINES[engine].items():
        if (side.scheme, side.bits, side.value) not in seen:  # an alias (vllm:fp8) once
            seen.add((side.scheme, side.bits, side.value))
            out.append(EngineFormat(engine, name, name))
    return out


def engine_policy(
    name: str, num_layers: int, head_dim: int | None = None, calibrated: bool = False
) -> CachePolicy:
    """The kvq cache policy of an engine format: every layer, keys stored after RoPE.
    `calibrated`: the caller brings calibrated scales (a format without a default needs
    them)."""
    fmt = parse(name)
    if fmt.needs_scales and not calibrated:
        raise KvqError(
            f"{name}: the engine has no default scale for this K/V format (it serves it "
            "from calibrated checkpoints only): add --artifact, a `kvq calibrate kv-scales "
            f"--format {fmt.key.calibrated}` artifact, or compare it in `kvq advise --engine "
            f"{fmt.engine} --calibration TEXT`"
        )
    for side in (fmt.key, fmt.value):
        scheme = side.scheme
        if scheme.format == "ggml" and head_dim is not None and head_dim % GGML_BLOCK:
            # as llama.cpp refuses it when it creates the context
            raise KvqError(
                f"{name}: llama.cpp's {scheme.ggml_type} blocks of {GGML_BLOCK} do not divide "
                f"head_dim {head_dim} (llama.cpp refuses this K/V cache type for this model)"
            )
        if scheme == VLLM_INT4 and head_dim is not None and head_dim & (head_dim - 1):
            # vLLM's Hadamard transform asserts it
            raise KvqError(f"{name}: vLLM's int4 rotation needs a power-of-two head_dim, "
                           f"not {head_dim}")  # fmt: skip
        block = scheme.group_size if scheme.format in ("nvfp4", "mxfp4") else None
        if block and head_dim is not None and head_dim % block:
            raise KvqError(
                f"{name}: its blocks of {block} channels do not divide head_dim {head_dim}"
            )
        if scheme.engine == "turboquant" and head_dim is not None:
            turboquant_head_dim(head_dim)
    layer = LayerPolicy(key=fmt.key.scheme, value=fmt.value.scheme, key_stage="post-rope")
    layers = [layer] * num_layers
    if fmt.key.boundary:  # vLLM keeps them unquantized, whatever the user asks
        exact = LayerPolicy(key=FULL_PRECISION, value=FULL_PRECISION)
        skip = turboquant_boundary(num_layers)
        layers = [exact if i in skip else layer for i in range(num_layers)]
    return CachePolicy(name=fmt.name, layers=tuple(layers))


def policy_by_name(name: str, num_layers: int, head_dim: int | None = None) -> CachePolicy:
    """Any calibration-free layout a user can name: an engine's (ENGINE:FORMAT) or kvq's."""
    if ":" in name:
        return engine_policy(name, num_layers, head_dim)
    return named_policy(name, num_layers, head_dim)
