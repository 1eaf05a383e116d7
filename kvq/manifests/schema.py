"""The versioned artifact manifest and its exact JSON form.

A `Manifest` says what an artifact is (schema and kvq versions), which model it
was made for (`ModelIdentity`, `ArchitectureInfo`), how the cache is stored
(`CachePolicy`), how it was calibrated, which tensors it carries (with hashes)
and, when measured, its byte ledger.

The JSON form is read back *exactly* or refused: every field is required,
unknown fields are errors, and types are checked against the dataclass type
hints, so a manifest from another schema version can never half-load. The
decoder walks the same type hints that `kvq.manifests.jsonschema` turns into a
JSON Schema, so the two cannot drift apart.
"""

from __future__ import annotations

import importlib.metadata
import math
import types
import typing
from dataclasses import dataclass, field, fields, is_dataclass
from datetime import datetime, timezone
from typing import Any, Literal, Union

from kvq.errors import FieldError, IncompatibleArtifact, KvqError, require
from kvq.manifests.identity import ArchitectureInfo, ModelIdentity, is_sha256
from kvq.manifests.ledger import ByteLedger
from kvq.quant.schemes import SCHEME_VERSION, CachePolicy

# 2: `passes`, the ordered chain of calibration passes, replaced the single `calibration`
SCHEMA_VERSION = 2
READABLE_VERSIONS = (1, 2)  # older versions are read through `_migrate`

try:
    KVQ_VERSION = importlib.metadata.version("kvq-live")
except importlib.metadata.PackageNotFoundError:  # running from a source tree
    KVQ_VERSION = "0.0.0+local"


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the artifact: dtype name (e.g. "float16"), shape, sha256 of its bytes."""

    dtype: str
    shape: tuple[int, ...]
    sha256: str

    def __post_init__(self) -> None:
        require(self.dtype in TENSOR_DTYPES, "dtype", "a safetensors dtype name", self.dtype)
        require(len(self.shape) <= 8, "shape", "at most 8 dimensions", self.shape)
        require(all(0 <= n < 1 << 40 for n in self.shape), "shape", "sizes >= 0", self.shape)
        require(is_sha256(self.sha256), "sha256", "a lowercase hex sha256 digest", self.sha256)


# the dtypes kvq stores, by their torch names (float8 for the FP8 formats)
TENSOR_DTYPES = (
    "float32", "float16", "bfloat16", "float64", "float8_e4m3fn", "float8_e5m2",
    "uint8", "int8", "int16", "int32", "int64", "bool",
)  # fmt: skip


@dataclass(frozen=True)
class DatasetInfo:
    """The calibration text: its spec, hashes of the text and of the token windows."""

    spec: str  # as given on the command line, e.g. "wikitext2:train"
    text_sha256: str
    windows_sha256: str  # the exact token windows fed to the model
    samples: int
    seqlen: int
    seed: int

    def __post_init__(self) -> None:
        for name in ("text_sha256", "windows_sha256"):
            require(is_sha256(getattr(self, name)), name, "a hex sha256", getattr(self, name))
        require(self.samples >= 1, "samples", "positive", self.samples)
        require(self.seqlen >= 2, "seqlen", "at least 2", self.seqlen)
        require(0 <= self.seed < 1 << 63, "seed", "in [0, 2**63)", self.seed)


ReportValue = str | int | float | bool | None | tuple[float, ...] | tuple[str, ...]


@dataclass(frozen=True)
class Calibration:
    """One calibration pass of the artifact's chain: what ran, on which text, how long, and
    what it found (`report`: e.g. PrefixQuant's per-layer statistic and chosen tokens,
    IntactKV's losses)."""

    method: str  # calibrator name, or the named policy for calibration-free artifacts
    dataset: DatasetInfo | None  # None for calibration-free policies
    options: dict[str, str | int | float | bool | None]
    stage_seconds: dict[str, float]  # wall time per calibration stage
    report: dict[str, ReportValue] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, seconds in self.stage_seconds.items():
            ok = math.isfinite(seconds) and seconds >= 0
            require(ok, f"stage_seconds[{name}]", "a duration >= 0", seconds)


@dataclass(frozen=True)
class Manifest:
    """Everything needed to check an artifact against a model and rebuild its cache."""

    schema_version: int
    kvq_version: str
    created_utc: str  # ISO 8601, e.g. "2026-05-09T07:35:25Z"
    model_spec: str  # the model as the user named it
    identity: ModelIdentity
    architecture: ArchitectureInfo
    policy: CachePolicy
    passes: tuple[Calibration, ...]  # in the order they ran; each builds on the one before
    tensors: dict[str, TensorEntry]  # filled in by the artifact writer
    ledger: ByteLedger | None

    def __post_init__(self) -> None:
        # Raised as IncompatibleArtifact so that a read names the field too.
        if self.policy.num_layers != self.architecture.num_layers:
            raise IncompatibleArtifact(
                "policy.layers",
                self.architecture.num_layers,
                self.policy.num_layers,
                "one layer policy per decoder layer",
            )
        require(len(self.passes) >= 1, "passes", "at least one pass", self.passes)
        head_dim = self.architecture.head_dim
        for i, layer in enumerate(self.policy.layers):
            for part, scheme in (("key", layer.key), ("value", layer.value)):
                group = scheme.group_size
                require(
                    group is None or head_dim % group == 0,
                    f"policy.layers[{i}].{part}.group_size",
                    f"a divisor of head_dim {head_dim}",
                    group,
                )
        if self.ledger is not None:
            # a stored ledger was measured on real tokens; ratios divide by both
            require(self.ledger.tokens > 0, "ledger.tokens", "positive", self.ledger.tokens)
            fp16 = self.ledger.fp16_bytes
            require(fp16 > 0, "ledger.fp16_bytes", "positive", fp16)


def utc_now() -> str:
    """The current time in the manifest's `created_utc` format."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def new_manifest(
    *,
    model_spec: str,
    identity: ModelIdentity,
    architecture: ArchitectureInfo,
    policy: CachePolicy,
    passes: tuple[Calibration, ...],
    ledger: ByteLedger | None = None,
) -> Manifest:
    """A manifest stamped with this schema, this kvq and now; tensors indexed at write."""
    return Manifest(
        schema_version=SCHEMA_VERSION,
        kvq_version=KVQ_VERSION,
        created_utc=utc_now(),
        model_spec=model_spec,
        identity=identity,
        architecture=architecture,
        policy=policy,
        passes=passes,
        tensors={},
        ledger=ledger,
    )


# --- encoding -----------------------------------------------------------------------


def manifest_to_json(m: Manifest) -> dict[str, Any]:
    """The manifest as plain JSON data (tuples become lists)."""
    return _encode(m)


def _encode(value: Any) -> Any:
    if isinstance(value, CachePolicy):
        return value.to_json()  # the policy owns its versioned envelope
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: _encode(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, (tuple, list)):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        return {k: _encode(v) for k, v in value.items()}
    return value


# --- decoding -----------------------------------------------------------------------

_MISSING = "<missing>"
# fields added within schema 2, whose defaults reproduce what earlier artifacts meant
LATER_FIELDS = {
    ("QuantScheme", "zero_point"),
    ("QuantScheme", "vector_dim"),
    ("QuantScheme", "window"),
    ("QuantScheme", "ggml_type"),
    ("QuantScheme", "engine"),
    ("LayerPolicy", "residual_tokens"),
    ("CachePolicy", "prefix"),
    ("ByteLedger", "prefix"),
    ("Calibration", "report"),
}


def manifest_from_json(d: Any) -> Manifest:
    """Rebuild a manifest exactly, or raise `IncompatibleArtifact` naming the field."""
    if not isinstance(d, dict):
        raise IncompatibleArtifact("manifest", "a JSON object", type(d).__name__)
    # The version first: a manifest from another schema is refused as such, not
    # as a confusing list of missing or unknown fields.
    found = d.get("schema_version", _MISSING)
    if found not in READABLE_VERSIONS or type(found) is not int:
        raise IncompatibleArtifact(
            "schema_version",
            SCHEMA_VERSION,
            found,
            f"this kvq reads schema versions {', '.join(map(str, READABLE_VERSIONS))}; "
            "regenerate the artifact with this kvq's `kvq calibrate`",
        )
    return _decode(Manifest, _migrate(d), "")


def _migrate(d: dict[str, Any]) -> dict[str, Any]:
    """A manifest of an older readable schema in the current form (read-only: files on
    disk are never rewritten). 1 -> 2: the single `calibration` became `passes`."""
    if d["schema_version"] == 1:
        d = {k: v for k, v in d.items() if k != "calibration"} | {
            "schema_version": SCHEMA_VERSION,
            "passes": [d.get("calibration", _MISSING)],
        }
    return d


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _decode(tp: Any, value: Any, path: str) -> Any:
    """Check `value` against the type hint `tp` and rebuild it (tuples, dataclasses)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is CachePolicy:
        return _decode_policy(value, path)
    if is_dataclass(tp):
        return _decode_dataclass(tp, value, path)
    if origin in (Union, types.UnionType):
        return _decode_union(tp, args, value, path)
    if origin is Literal:
        if value not in args or isinstance(value, bool):
            raise IncompatibleArtifact(path, f"one of {list(args)}", value)
        return value
    if origin in (tuple, list):
        if not isinstance(value, list):
            raise IncompatibleArtifact(path, "a JSON array", value)
        items = [_decode(args[0], v, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise IncompatibleArtifact(path, "a JSON object", value)
        return {k: _decode(args[1], v, f"{path}[{k}]") for k, v in value.items()}
    return _decode_scalar(tp, value, path)


def _decode_scalar(tp: Any, value: Any, path: str) -> Any:
    # Exact types: JSON true is not the integer 1, and "4" is not 4.
    if tp is float and type(value) in (int, float):
        return float(value)
    if tp is type(None) and value is None:
        return None
    if tp in (int, str, bool) and type(value) is tp:
        return value
    raise IncompatibleArtifact(path, _type_name(tp), value)


def _decode_union(tp: Any, args: tuple, value: Any, path: str) -> Any:
    if value is None and type(None) in args:
        return None
    members = [a for a in args if a is not type(None)]
    if len(members) == 1:  # `X | None`: report X's own, more precise error
        return _decode(members[0], value, path)
    for member in members:
        try:
            return _decode(member, value, path)
        except IncompatibleArtifact:
            continue
    raise IncompatibleArtifact(path, _type_name(tp), value)


def _decode_dataclass(cls: type, value: Any, path: str) -> Any:
    if not isinstance(value, dict):
        raise IncompatibleArtifact(path or cls.__name__, f"a {cls.__name__} object", value)
    hints = typing.get_type_hints(cls)
    names = [f.name for f in fields(cls)]
    for key in value:
        if key not in names:
            raise IncompatibleArtifact(_join(path, key), "no such field", value[key])
    kwargs = {}
    for name in names:
        if name not in value and (cls.__name__, name) in LATER_FIELDS:
            continue  # written before the field existed: its default is what that kvq did
        if name not in value:
            raise IncompatibleArtifact(_join(path, name), _type_name(hints[name]), _MISSING)
        kwargs[name] = _decode(hints[name], value[name], _join(path, name))
    try:
        return cls(**kwargs)
    except IncompatibleArtifact:
        raise
    except FieldError as e:  # a value out of range: name it by its full path
        raise IncompatibleArtifact(_join(path, e.field), e.rule, e.value) from None
    except KvqError as e:  # well-typed but invalid, e.g. a negative byte count
        raise IncompatibleArtifact(path or cls.__name__, f"a valid {cls.__name__}", str(e)) from e


def _decode_policy(value: Any, path: str) -> CachePolicy:
    """Check the versioned envelope and field types, then let CachePolicy rebuild itself."""
    if not isinstance(value, dict):
        raise IncompatibleArtifact(path, "a CachePolicy object", value)
    expected = {"_type": "CachePolicy", "_version": SCHEME_VERSION}
    for key in value:
        if key not in (*expected, "_data"):
            raise IncompatibleArtifact(_join(path, key), "no such field", value[key])
    for key, want in expected.items():
        if value.get(key, _MISSING) != want:
            raise IncompatibleArtifact(_join(path, key), want, value.get(key, _MISSING))
    if "_data" not in value:
        raise IncompatibleArtifact(_join(path, "_data"), "a CachePolicy object", _MISSING)
    # Decoding `_data` as the dataclass checks every field by name, type and
    # __post_init__ rule; from_json then stays the one way policies are read.
    _decode_dataclass(CachePolicy, value["_data"], _join(path, "_data"))
    try:
        return CachePolicy.from_json(value)
    except KvqError as e:
        raise IncompatibleArtifact(path, "a valid CachePolicy", str(e)) from e
