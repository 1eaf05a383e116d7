"""Quantization schemes and cache policies: frozen, validated, versioned data.

A `QuantScheme` says how one tensor family (K or V of a layer) is stored: the
number format, bit width, the axis its qparams vary along, the group size,
the qparam storage dtype and the scale lifetime. A `LayerPolicy` pairs a K and
a V scheme with the RoPE stage of the stored keys and the sink-token exception.
A `CachePolicy` is the per-layer list the runtime builds its layers from.

Everything here serialises to JSON as {"_type", "_version", "_data"} so that an
artifact written by one kvq release is either read exactly or refused.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Literal

from kvq.errors import KvqError

SCHEME_VERSION = 1

Format = Literal["int", "fp8", "nuq", "vq", "trellis", "ggml", "nvfp4", "mxfp4", "none"]
Axis = Literal["token", "channel", "head", "tensor"]
Lifetime = Literal["static", "dynamic"]
KeyStage = Literal["pre-rope", "post-rope"]
ScaleDtype = Literal["float16", "bfloat16", "float32"]
Fp8Format = Literal["e4m3", "e5m2"]
Engine = Literal["vllm", "sglang", "trtllm", "turboquant"]

INT_BITS = (2, 3, 4, 8)
VQ_DIMS = (2, 4)  # kvq.quant.vq.DIMS (no torch here)
VQ_MAX_CENTROIDS = 4096
TRELLIS_WINDOWS = range(2, 17)  # kvq.quant.trellis.MAX_WINDOW (no torch here)
# llama.cpp block formats: type -> code bits (kvq.quant.ggml_blocks.FORMATS, no torch here)
GGML_TYPES = {"q8_0": 8, "q4_0": 4, "q4_1": 4, "q5_0": 5, "q5_1": 5, "iq4_nl": 4}
GGML_BLOCK = 32


def ggml_symmetric(name: str) -> bool:
    """A llama.cpp block format without a minimum (all but q4_1 and q5_1)."""
    return not name.endswith("_1")


NVFP4_BLOCK = 16  # kvq.quant.nvfp4.BLOCK
MXFP4_BLOCK = 16  # kvq.quant.mxfp4.BLOCK (SGLang's; OCP's MXFP4 has 32)
# SGLang's fp4_e2m1 K/V rows, the one "mxfp4" scheme (scale_dtype unused: its scales are
# exponents), field by field
_SGLANG_FP4 = dict(
    format="mxfp4", bits=4, axis="token", symmetric=True, group_size=MXFP4_BLOCK,
    scale_dtype="float16", lifetime="dynamic", fp8_format=None, outlier_fraction=0.0,
    qnorm=False, zero_point=False, vector_dim=None, window=None, ggml_type=None,
    engine="sglang",
)  # fmt: skip
# TensorRT-LLM's INT8 K/V, the one "trtllm" scheme, field by field
_TRTLLM_INT8 = dict(_SGLANG_FP4, format="int", bits=8, axis="tensor", group_size=None,
                    scale_dtype="float32", lifetime="static", engine="trtllm")  # fmt: skip
MAX_GROUP = 4096  # channels per qparam group: at most a head (head_dim <= 4096)
# run-eval --activations: decoder linear inputs unquantized, INT8 per token, INT8 static
ACTIVATION_MODES = ("none", "a8-dynamic", "a8-static")
MAX_SINK = 1 << 16  # sink tokens kept exact: far beyond any real use, a bound for tampering


@dataclass(frozen=True)
class QuantScheme:
    """How one cached tensor family is stored.

    format:     "int" (uniform integer), "fp8", "nuq" (codebook indices), "vq" (NUQ's
                normalisation, then one codebook index per group of `vector_dim`
                channels, stored as `vector_dim` digits of `bits` bits), "trellis"
                (NUQ's normalisation, then a bit-shift trellis code: one `bits`-bit digit
                per element, each element decoded from the last `window` bits of its
                row, `kvq.quant.trellis`), "ggml" (one of llama.cpp's block formats,
                `ggml_type`, with ggml's numerics: `kvq.quant.ggml_blocks`), "nvfp4"
                (FP4 E2M1 codes per block of 16 channels of a row, an FP8 E4M3 scale per
                block and a float32 global scale per tensor: `kvq.quant.nvfp4`), "mxfp4"
                (FP4 E2M1 codes per block of 16 channels of a row with a power-of-two scale
                per block: SGLang's fp4_e2m1, `kvq.quant.mxfp4`) or "none" (kept in full
                precision).
    bits:       payload bits per element (16 for "none", 8 for fp8).
    symmetric:  int only: signed codes and no offset, else unsigned codes with
                a floating offset (x ~ code * scale + offset).
    axis:       what one qparam set covers: "token" (one row of one head,
                optionally split in groups of `group_size` channels),
                "channel" (one channel of one head across tokens: static, or
                dynamic over each group of `group_size` tokens, KIVI's keys),
                "head" (one head, all its rows), "tensor" (the whole layer).
    lifetime:   "static" qparams come from calibration and never change;
                "dynamic" qparams are computed from each appended row.
    zero_point: int asymmetric per-token only: the offset is a floating zero-point in
                code units, added before rounding and neither rounded nor clamped,
                x ~ (code - zero_point) * scale (QServe's KV4 ABI, `affine.quantize_qserve`:
                4 bits, one fp16 pair per token and head), instead of x ~ code * scale +
                offset.
    engine:     whose quantizer the codes reproduce where it is not kvq's own: "vllm" is
                vLLM's per-(token, head) kernel (`kvq.quant.token_head`: int8 codes
                truncated toward zero, FP8 E4M3 rounded), for an int8 or fp8-e4m3 scheme
                per token with one float32 scale per row, or its int4 (asymmetric:
                `kvq.quant.vllm_int4`, rows Hadamard-rotated first); "sglang" SGLang's block-16 FP4
                (format "mxfp4", the only one so far); "trtllm" TensorRT-LLM's INT8
                (`kvq.quant.trtllm_int8`: reciprocal multiply, round to nearest even,
                saturated to [-128, 127]), static per tensor, float32 scale; "turboquant"
                vLLM's TurboQuant presets (`kvq.quant.turboquant`: `turboquant_key`,
                `turboquant_value`).
    """

    format: Format
    bits: int
    axis: Axis = "token"
    symmetric: bool = False
    group_size: int | None = None
    scale_dtype: ScaleDtype = "float16"
    lifetime: Lifetime = "dynamic"
    fp8_format: Fp8Format | None = None
    outlier_fraction: float = 0.0  # nuq: share of values kept exactly as sparse exceptions
    qnorm: bool = False  # nuq: decode through mean/std-corrected levels (KVQuant Q-Norm)
    zero_point: bool = False
    vector_dim: int | None = None  # vq: channels coded jointly (2 or 4)
    window: int | None = None  # trellis: state bits (a table of 2^window levels)
    ggml_type: str | None = None  # ggml: "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl"
    engine: Engine | None = None

    def __post_init__(self) -> None:
        if self.engine is not None:
            self._check_engine()
        if self.format == "none":
            if self.bits != 16:
                raise KvqError(f"full-precision scheme must declare 16 bits, got {self.bits}")
            return
        if self.format == "mxfp4":
            if self.engine != "sglang":  # checked whole in _check_engine
                raise KvqError("mxfp4 is SGLang's block-16 fp4_e2m1 only (engine 'sglang')")
            return
        if self.format == "nvfp4":
            nvfp4 = (4, "token", True, NVFP4_BLOCK, "float32", "dynamic")
            found = (self.bits, self.axis, self.symmetric, self.group_size, self.scale_dtype,
                     self.lifetime)  # fmt: skip
            others = (self.fp8_format, self.outlier_fraction, self.qnorm, self.zero_point,
                      self.vector_dim, self.window, self.ggml_type)  # fmt: skip
            if found != nvfp4 or others != (None, 0.0, False, False, None, None, None):
                raise KvqError(
                    f"an nvfp4 scheme is NVFP4 exactly: 4 bits, per-token blocks of "
                    f"{NVFP4_BLOCK}, symmetric, a float32 global scale"
                )
            return
        if (self.format == "ggml") != (self.ggml_type is not None):
            raise KvqError("ggml_type is set exactly for format='ggml'")
        if self.format == "ggml":
            # one of llama.cpp's block formats exactly (`kvq.quant.ggml_blocks`)
            expected = (GGML_TYPES.get(self.ggml_type), "token", ggml_symmetric(self.ggml_type),
                        GGML_BLOCK, "float16", "dynamic")  # fmt: skip
            found = (self.bits, self.axis, self.symmetric, self.group_size, self.scale_dtype,
                     self.lifetime)  # fmt: skip
            others = (self.fp8_format, self.outlier_fraction, self.qnorm, self.zero_point,
                      self.vector_dim, self.window)  # fmt: skip
            if found != expected or others != (None, 0.0, False, False, None, None):
                raise KvqError(
                    f"a ggml scheme is one of llama.cpp's block formats ({', '.join(GGML_TYPES)}) "
                    f"exactly: its bits, per-token blocks of {GGML_BLOCK}, fp16 scales"
                )
            return
        if self.format in ("int", "nuq") and self.bits not in INT_BITS:
            raise KvqError(f"bits must be one of {INT_BITS}, got {self.bits}")
        if (self.format == "vq") != (self.vector_dim is not None):
            raise KvqError("vector_dim is set exactly for format='vq'")
        if self.format == "vq" and (
            self.vector_dim not in VQ_DIMS
            or self.bits not in (1, 2, 3, 4)
            or 2 ** (self.bits * self.vector_dim) > VQ_MAX_CENTROIDS
        ):
            raise KvqError(
                f"vq: vector_dim one of {VQ_DIMS}, bits 1..4, at most {VQ_MAX_CENTROIDS} "
                f"centroids; got {self.vector_dim} x {self.bits} bits"
            )
        if (self.format == "trellis") != (self.window is not None):
            raise KvqError("window is set exactly for format='trellis'")
        if self.format == "trellis" and (
            self.bits not in (1, 2, 3, 4)
            or self.window not in TRELLIS_WINDOWS
            or self.window <= self.bits
            or self.window % self.bits
        ):
            raise KvqError(
                f"trellis: bits 1..4 and a window that is a multiple of them in "
                f"({self.bits}, {TRELLIS_WINDOWS[-1]}]; got {self.bits} bits, window {self.window}"
            )
        if self.format == "fp8":
            if self.bits != 8 or self.fp8_format not in ("e4m3", "e5m2"):
                raise KvqError("fp8 scheme needs bits=8 and fp8_format e4m3 or e5m2")
        elif self.fp8_format is not None:
            raise KvqError("fp8_format is only meaningful for format='fp8'")
        if not 0.0 <= self.outlier_fraction < 0.5:
            raise KvqError(f"outlier_fraction must be in [0, 0.5), got {self.outlier_fraction}")
        if self.format not in ("nuq", "vq", "trellis") and self.outlier_fraction:
            raise KvqError("sparse outliers are only defined for format='nuq', 'vq' or 'trellis'")
        if self.format != "nuq" and self.qnorm:
            raise KvqError("Q-Norm is only defined for format='nuq'")
        if self.group_size is not None and not 0 < self.group_size <= MAX_GROUP:
            raise KvqError(f"group_size must be in [1, {MAX_GROUP}], got {self.group_size}")
        if self.axis == "channel" and self.lifetime != "static" and not self.group_size:
            # Online per-channel scales over all tokens rewrite history (article 0x05A); KIVI
            # fixes them per group of `group_size` tokens once the group is full.
            raise KvqError("dynamic per-channel qparams need a token group size (KIVI)")
        if self.axis == "token" and self.lifetime != "dynamic":
            raise KvqError("per-token qparams are computed at append time (dynamic)")
        if self.zero_point:
            qserve = QuantScheme(format="int", bits=4, zero_point=False)
            if replace(self, zero_point=False) != qserve:
                # the one layout its quantizer and kernels implement
                raise KvqError(
                    "a floating zero-point is QServe's layout only: int, 4 bits, asymmetric, "
                    "per token and head (no groups), float16 qparams"
                )

    def _check_engine(self) -> None:
        """vLLM's per-token-head formats exactly: int8 or fp8-e4m3, a float32 scale per row;
        SGLang's: block-16 FP4 with power-of-two scales (`SGLANG_FP4`)."""
        if asdict(self) == _SGLANG_FP4:
            return
        if asdict(self) == _TRTLLM_INT8:
            return
        if self.engine == "turboquant":  # every other field at its default
            mine, plain = asdict(self), {f.name: f.default for f in fields(QuantScheme)}
            others = [k for k in plain if k not in ("format", "bits", "engine")]
            if (self.format, self.bits) not in {
                ("nuq", 3),
                ("nuq", 4),
                ("int", 3),
                ("int", 4),
            } or any(mine[k] != plain[k] for k in others):
                raise KvqError(
                    "a turboquant scheme is vLLM's TurboQuant exactly: 3- or 4-bit keys "
                    "(Lloyd-Max levels, fp16 norm per row) or values (min/max, fp16 qparams)"
                )
            return
        row = QuantScheme(format="int", bits=8, symmetric=True, scale_dtype="float32")
        fp8_row = replace(row, format="fp8", fp8_format="e4m3")
        int4_row = replace(row, bits=4, symmetric=False)  # rotated, min/max (vllm_int4)
        if self.engine != "vllm" or replace(self, engine=None) not in (row, fp8_row, int4_row):
            raise KvqError(
                "an engine scheme is vLLM's per-token-head int8, fp8-e4m3 (per token, "
                "symmetric, one float32 scale per (token, head)) or int4 (asymmetric), "
                "SGLang's fp4_e2m1 or TensorRT-LLM's int8 (static, one float32 scale per "
                "tensor)"
            )

    @property
    def stored(self) -> bool:
        return self.format != "none"

    def describe(self) -> str:
        if self.format == "none":
            return "fp16"
        if self.format == "mxfp4":
            return f"SGLang fp4_e2m1 (E2M1 blocks of {MXFP4_BLOCK}, power-of-two scales)"
        if self.engine == "trtllm":
            return "TensorRT-LLM int8 (one static float32 scale per layer, K and V)"
        if self.engine == "turboquant" and self.format == "nuq":
            return f"vLLM TurboQuant {self.bits}-bit keys (Hadamard, Lloyd-Max, fp16 norm)"
        if self.engine == "turboquant":
            return f"vLLM TurboQuant {self.bits}-bit values (min/max per token and head)"
        if self.engine == "vllm" and self.bits == 4:
            return "vLLM int4_per_token_head (Hadamard-rotated, min/max per token and head)"
        if self.engine == "vllm":
            kind = "int8" if self.format == "int" else "fp8"
            return f"vLLM {kind}_per_token_head (a float32 scale per token and head)"
        if self.format == "ggml":
            return f"llama.cpp {self.ggml_type} (blocks of {GGML_BLOCK}, fp16 scales)"
        if self.format == "nvfp4":
            return f"nvfp4 (E2M1 blocks of {NVFP4_BLOCK}, E4M3 block scales, global scale)"
        name = f"{self.format}{self.bits}" if self.format != "fp8" else f"fp8-{self.fp8_format}"
        group = f"/g{self.group_size}" if self.group_size else ""
        kind = "sym" if self.symmetric else "asym"
        kind += " zero-point" if self.zero_point else ""
        extra = f" +{self.outlier_fraction:.1%} sparse" if self.outlier_fraction else ""
        extra += " qnorm" if self.qnorm else ""
        if self.format == "nuq":
            kind = "codebook"
        if self.format == "vq":
            kind = f"{self.vector_dim}-D codebook"
        if self.format == "trellis":
            kind = f"{self.window}-bit trellis"
        return f"{name} {kind} per-{self.axis}{group} ({self.lifetime}){extra}"


FULL_PRECISION = QuantScheme(format="none", bits=16)


# vLLM TurboQuant preset -> (key bits, value bits); 8-bit keys are FP8 E4M3 without a
# scale (`kvq.quant.turboquant` holds the numerics; no torch here)
TURBOQUANT_PRESETS = {
    "turboquant_k8v4": (8, 4),
    "turboquant_4bit_nc": (4, 4),
    "turboquant_k3v4_nc": (3, 4),
    "turboquant_3bit_nc": (3, 3),
}


def turboquant_boundary(num_layers: int) -> set[int]:
    """The layers vLLM keeps unquantized under any TurboQuant preset of a dense model,
    whatever the user asks: the first and last min(2, layers // 2)."""
    n = min(2, num_layers // 2)
    return set(range(n)) | set(range(num_layers - n, num_layers))


def turboquant_head_dim(d: int) -> None:
    """Refuse a head_dim vLLM's TurboQuant cannot take (its Hadamard and 3-bit packing)."""
    if d < 8 or d & (d - 1):
        raise KvqError(f"vLLM's TurboQuant needs a power-of-two head_dim of 8 or more, not {d}")


def turboquant_key(bits: int) -> QuantScheme:
    """vLLM TurboQuant's 3- or 4-bit keys (`kvq.quant.turboquant`): codebook indices of
    the rotated unit row, one fp16 norm per (token, head)."""
    return QuantScheme(format="nuq", bits=bits, engine="turboquant")


def turboquant_value(bits: int) -> QuantScheme:
    """vLLM TurboQuant's 3- or 4-bit values: min/max codes, fp16 scale and minimum."""
    return QuantScheme(format="int", bits=bits, engine="turboquant")


QUANTIZE_SIDES = ("both", "keys", "values")  # what `CachePolicy.only` keeps quantized


def check_quantize(side: str) -> None:
    if side not in QUANTIZE_SIDES:
        raise KvqError(f"--quantize must be one of {', '.join(QUANTIZE_SIDES)}, got {side!r}")


@dataclass(frozen=True)
class LayerPolicy:
    """The K and V storage of one attention layer."""

    key: QuantScheme
    value: QuantScheme
    key_stage: KeyStage = "post-rope"
    sink_tokens: int = 0
    residual_tokens: int = 0  # most recent tokens kept exact (KIVI's residual window)

    def __post_init__(self) -> None:
        if not 0 <= self.sink_tokens <= MAX_SINK:
            raise KvqError(f"sink_tokens must be in [0, {MAX_SINK}], got {self.sink_tokens}")
        if not 0 <= self.residual_tokens <= MAX_SINK:
            raise KvqError(
                f"residual_tokens must be in [0, {MAX_SINK}], got {self.residual_tokens}"
            )
        if self.value.axis == "channel":
            raise KvqError("per-channel V is not supported: V rows are quantized at append time")

    @property
    def full_precision(self) -> bool:
        return not self.key.stored and not self.value.stored


MAX_PREFIX = 1 << 12  # prefix tokens: far beyond any real use, a bound for tampering


@dataclass(frozen=True)
class PrefixSpec:
    """Declared prefix state (IntactKV, PrefixQuant): tokens whose K/V rows every sequence's
    cache is seeded with, in full precision, before its first real token.

    token_ids: the prefix, in order; tokenizer_sha256: the tokenizer that made them (a
    string means nothing under another tokenizer); source: the pass that made the rows
    ("prefixquant", "intactkv-exact", "intactkv-calibrated"). The rows themselves are
    artifact tensors `layers.{i}.prefix.key` (pre-RoPE) and `.value`, [H_kv, P, D].
    """

    token_ids: tuple[int, ...]
    tokenizer_sha256: str
    source: str

    def __post_init__(self) -> None:
        if not 1 <= len(self.token_ids) <= MAX_PREFIX:
            raise KvqError(f"a prefix needs 1 to {MAX_PREFIX} tokens, got {len(self.token_ids)}")
        if any(type(t) is not int or t < 0 for t in self.token_ids):
            raise KvqError(f"prefix token ids must be ints >= 0, got {self.token_ids}")

    @property
    def length(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class CachePolicy:
    """One `LayerPolicy` per decoder layer, in layer order, and the prefix (if any) that
    every layer holds before each sequence's first real token."""

    name: str
    layers: tuple[LayerPolicy, ...]
    version: int = field(default=SCHEME_VERSION)
    prefix: PrefixSpec | None = None

    def __post_init__(self) -> None:
        if not self.layers:
            raise KvqError("a cache policy needs at least one layer")
        if self.version != SCHEME_VERSION:
            raise KvqError(f"cache policy version {self.version} is not {SCHEME_VERSION}")

    def with_prefix(self, prefix: PrefixSpec | None) -> CachePolicy:
        return replace(self, prefix=prefix)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def only(self, side: str) -> CachePolicy:
        """This policy with only `side` quantized ("keys" or "values"), the other side kept
        at full precision: what each side costs in quality. "both": the policy itself."""
        check_quantize(side)
        if side == "both":
            return self
        other = "value" if side == "keys" else "key"
        layers = tuple(replace(layer, **{other: FULL_PRECISION}) for layer in self.layers)
        return CachePolicy(f"{self.name} ({side} only)", layers, self.version, self.prefix)

    def to_json(self) -> dict[str, Any]:
        return {"_type": "CachePolicy", "_version": self.version, "_data": asdict(self)}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> CachePolicy:
        if obj.get("_type") != "CachePolicy":
            raise KvqError(f"expected a CachePolicy, found _type={obj.get('_type')!r}")
        if obj.get("_version") != SCHEME_VERSION:
            raise KvqError(
                f"cache policy _version: expected {SCHEME_VERSION}, found {obj.get('_version')!r}"
            )
        data = obj["_data"]
        layers = tuple(
            LayerPolicy(
                key=_scheme(layer["key"]),
                value=_scheme(layer["value"]),
                key_stage=layer["key_stage"],
                sink_tokens=layer["sink_tokens"],
                residual_tokens=layer.get("residual_tokens", 0),
            )
            for layer in data["layers"]
        )
        prefix = data.get("prefix")
        if prefix is not None:
            prefix = PrefixSpec(
                token_ids=tuple(prefix["token_ids"]),
                tokenizer_sha256=prefix["tokenizer_sha256"],
                source=prefix["source"],
            )
        return cls(name=data["name"], layers=layers, version=data["version"], prefix=prefix)


def _scheme(d: dict[str, Any]) -> QuantScheme:
    known = {f.name for f in fields(QuantScheme)}
    unknown = set(d) - known
    if unknown:
        raise KvqError(f"unknown QuantScheme fields {sorted(unknown)}")
    return QuantScheme(**d)


SGLANG_FP4 = QuantScheme(**_SGLANG_FP4)
# TensorRT-LLM's INT8 K/V: static, one float32 scale per tensor (`kvq.quant.trtllm_int8`)
TRTLLM_INT8 = QuantScheme(**_TRTLLM_INT8)


# --- named calibration-free policies ------------------------------------------------


def _int_token(bits: int, group: int | None) -> QuantScheme:
    return QuantScheme(format="int", bits=bits, axis="token", group_size=group)


def _fp8(fmt: str, lifetime: str) -> QuantScheme:
    axis = "tensor" if lifetime == "static" else "token"
    return QuantScheme(
        format="fp8", bits=8, axis=axis, symmetric=True, scale_dtype="float32",
        lifetime=lifetime, fp8_format=fmt,
    )  # fmt: skip


# QServe's KV4: post-RoPE K and V, INT4 per (token, head) with a floating zero-point
QSERVE_KV4 = QuantScheme(format="int", bits=4, zero_point=True)

NAMED_POLICIES: dict[str, tuple[QuantScheme, QuantScheme, str]] = {
    # name: (key scheme, value scheme, description)
    "fp16": (FULL_PRECISION, FULL_PRECISION, "no quantization (reference)"),
    "int8": (_int_token(8, None), _int_token(8, None), "K and V INT8 per token, post-RoPE"),
    "int4": (_int_token(4, 64), _int_token(4, 64), "K and V INT4 per token, groups of 64"),
    "int2": (_int_token(2, 32), _int_token(2, 32), "K and V INT2 per token, groups of 32"),
    # what an engine does without calibration: a static scale of exactly 1.0 (not fitted)
    "fp8-e4m3": (_fp8("e4m3", "static"),) * 2 + ("FP8 E4M3 K and V, static scale 1.0",),
    "fp8-e5m2": (_fp8("e5m2", "static"),) * 2 + ("FP8 E5M2 K and V, static scale 1.0",),
    "fp8-e4m3-dynamic": (_fp8("e4m3", "dynamic"),) * 2
    + ("FP8 E4M3 K and V, scale per token from its absmax",),
    "kv4-qserve": (
        QSERVE_KV4,
        QSERVE_KV4,
        "QServe KV4: K and V INT4 per token and head, floating zero-point, first token exact",
    ),
}
# first tokens kept exact by a named policy (QServe keeps the attention sink)
NAMED_SINKS: dict[str, int] = {"kv4-qserve": 1}
# named policies whose static scales are all 1.0 (`kvq.runtime.cache.unit_scales`)
UNIT_SCALE_POLICIES = ("fp8-e4m3", "fp8-e5m2")


KIVI_GROUP, KIVI_RESIDUAL = 32, 128  # the KIVI paper's defaults
KIVI_NAMES = {"kivi2": 2, "kivi4": 4}


def kivi_policy(name: str, num_layers: int, head_dim: int | None = None) -> CachePolicy:
    """KIVI (article 0x06): `kivi{2,4}[-g{G}][-r{R}]`, e.g. "kivi2", "kivi4-g64-r256".

    Keys per channel over groups of G tokens, values per token in groups of G channels,
    asymmetric; the most recent R tokens (up to R + G - 1) stay exact. Post-RoPE keys.
    """
    base, *opts = name.split("-")
    group, residual = KIVI_GROUP, KIVI_RESIDUAL
    for opt in opts:
        if opt[:1] in ("g", "r") and opt[1:].isdigit() and 0 < int(opt[1:]) <= MAX_GROUP:
            group, residual = (int(opt[1:]), residual) if opt[0] == "g" else (group, int(opt[1:]))
        else:
            raise KvqError(f"policy {name!r}: options are -g<group> and -r<residual>, got {opt!r}")
    bits = KIVI_NAMES[base]
    key = QuantScheme(format="int", bits=bits, axis="channel", group_size=group)
    value = _int_token(bits, group)
    if head_dim is not None:
        value = _fit_group(value, head_dim)
    layer = LayerPolicy(key=key, value=value, key_stage="post-rope", residual_tokens=residual)
    return CachePolicy(name=name, layers=(layer,) * num_layers)


def named_policy(name: str, num_layers: int, head_dim: int | None = None) -> CachePolicy:
    """A calibration-free policy applied to every layer (KIVI: see `kivi_policy`).

    Groups larger than the model's head_dim shrink to one group per head.
    """
    if name.split("-")[0] in KIVI_NAMES:
        return kivi_policy(name, num_layers, head_dim)
    if name not in NAMED_POLICIES:
        known = ", ".join(sorted([*NAMED_POLICIES, *KIVI_NAMES]))
        raise KvqError(f"unknown policy {name!r}; known: {known}")
    key, value, _ = NAMED_POLICIES[name]
    if head_dim is not None:
        key, value = (_fit_group(s, head_dim) for s in (key, value))
    sink = NAMED_SINKS.get(name, 0)
    layer = LayerPolicy(key=key, value=value, key_stage="post-rope", sink_tokens=sink)
    return CachePolicy(name=name, layers=(layer,) * num_layers)


def _fit_group(scheme: QuantScheme, head_dim: int) -> QuantScheme:
    if scheme.axis == "token" and scheme.group_size is not None and scheme.group_size >= head_dim:
        return replace(scheme, group_size=None)
    return scheme
