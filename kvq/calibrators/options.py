"""The options of each calibration pass: frozen dataclasses that check themselves.

Kept apart from the passes themselves, which import torch: the command line builds its
`kvq calibrate NAME` subcommands from these classes (`kvq.calibrators.registry`) and
checks options (a bad --bits, say) before importing anything heavy or loading a model.

A field becomes a command-line option through `option(...)`: its flag, its help and
whether the manifest records it. Fields declared with a plain default are API-only
(ablations) but still recorded.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Literal

from kvq.errors import KvqError, shown
from kvq.quant.schemes import MAX_GROUP, KeyStage, named_policy

OptionValue = str | int | float | bool | None


def option(default: Any, help: str, flag: str | None = None, record: bool = True) -> Any:
    """A dataclass field shown on the command line as `flag` (default: --field-name).

    A bool field with flag "--x/--no-x" becomes an on/off switch.
    """
    return field(default=default, metadata={"help": help, "flag": flag, "record": record})


class PassOptions:
    """Behaviour shared by every pass's options dataclass."""

    NAME: ClassVar[str]  # the subcommand, e.g. "channel-scales"
    SUMMARY: ClassVar[str]  # one line for `kvq calibrate --help`

    def chain(self) -> tuple[PassOptions, ...]:
        """The passes this one runs as (itself; `auto` may put a model transform first)."""
        return (self,)

    def as_dict(self) -> dict[str, OptionValue]:
        """What the manifest records of these options (every field not marked otherwise)."""
        return {
            f.name: getattr(self, f.name) for f in fields(self) if f.metadata.get("record", True)
        }

    @classmethod
    def cli_fields(cls) -> list:
        """The fields that are command-line options, in declaration order."""
        return [f for f in fields(cls) if "help" in f.metadata]

    @classmethod
    def from_cli(cls, values: dict[str, Any]) -> PassOptions:
        """Options from parsed command-line values (by field name); checks run here."""
        return cls(**{name: cls._from_flag(name, v) for name, v in values.items()})

    @classmethod
    def _from_flag(cls, name: str, value: Any) -> Any:
        return value

    @classmethod
    def from_recipe(cls, values: dict[str, Any], seed: int) -> PassOptions:
        """Options from a recipe's mapping (field names, '-' or '_', or flag names), each value
        checked against its field's type; a `seed` field takes the recipe's seed."""
        hints = typing.get_type_hints(cls)
        names = {f.name for f in fields(cls)}
        # a field by its name, dashed or not, or by its command-line flag (v-group)
        aliases = {n.replace("_", "-"): n for n in names} | {n: n for n in names}
        for f in cls.cli_fields():
            if f.metadata["flag"]:
                aliases[f.metadata["flag"].split("/")[0].removeprefix("--")] = f.name
        chosen: dict[str, Any] = {"seed": seed} if "seed" in names else {}
        for key, value in values.items():
            name = aliases.get(str(key))
            if name is None or name == "seed":
                known = ", ".join(f.name for f in fields(cls) if f.name != "seed")
                raise KvqError(f"{cls.NAME}: unknown option {shown(key)} (known: {known})")
            if not _fits(value, hints[name]):
                raise KvqError(
                    f"{cls.NAME}: {name} must be {_type_name(hints[name])}, got {shown(value)}"
                )
            chosen[name] = cls._from_flag(name, value)
        return cls(**chosen)


def _fits(value: Any, tp: Any) -> bool:
    """value is of type hint tp (an int is a float; a bool is not an int)."""
    if typing.get_origin(tp) is typing.Literal:
        return value in typing.get_args(tp)
    args = typing.get_args(tp)
    if args:  # X | None
        return any(_fits(value, a) for a in args)
    if tp is type(None):
        return value is None
    if tp is float:
        return type(value) in (int, float)
    return type(value) is tp


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is typing.Literal:
        return "one of " + ", ".join(map(repr, typing.get_args(tp)))
    return " or ".join(getattr(a, "__name__", str(a)) for a in (typing.get_args(tp) or (tp,)))


def check_range(
    name: str,
    value: float,
    lo: float,
    hi: float | None = None,
    *,
    open_lo: bool = False,
    open_hi: bool = False,
) -> None:
    """Refuse `value` outside [lo, hi] (either end open; no hi: no upper bound) with one
    line naming the option, e.g. "--percentile must be in (50, 100], got 10.0". NaN is
    refused: every comparison with it is false."""
    above = value > lo if open_lo else value >= lo
    below = hi is None or (value < hi if open_hi else value <= hi)
    if above and below:
        return
    if hi is None:
        wanted = f"{'>' if open_lo else '>='} {_bound(lo)}"
    else:
        left, right = "(" if open_lo else "[", ")" if open_hi else "]"
        wanted = f"in {left}{_bound(lo)}, {_bound(hi)}{right}"
    raise KvqError(f"{name} must be {wanted}, got {shown(value)}")


def check_choice(name: str, value: Any, choices: typing.Iterable[Any], suffix: str = "") -> None:
    """Refuse `value` not among `choices` with one line that lists them, e.g. "--bits must
    be 2, 3 or 4 for kvquant, got 5" (suffix " for kvquant")."""
    choices = tuple(choices)
    if value in choices:
        return
    *head, last = map(str, choices)
    listed = f"{', '.join(head)} or {last}" if head else last
    raise KvqError(f"{name} must be {listed}{suffix}, got {shown(value)}")


def _bound(x: float) -> str:
    """50.0 -> "50", 0.5 -> "0.5", 1_000_000 -> "1000000" (not 1e+06)."""
    return str(int(x)) if float(x).is_integer() else str(x)


def _check_layout(layout: str | None) -> None:
    """A pass's --layout: None (its default, or the base's) or a calibration-free policy."""
    if layout is not None:
        named_policy(layout, 1)  # one line naming the known policies


def _check_scale_method(method: str, percentile: float) -> None:
    """--method and --percentile of the static-scale passes (kv-scales, act-scales)."""
    check_choice("--method", method, SCALE_METHODS)
    check_range("--percentile", percentile, 50, 100, open_lo=True)


@dataclass(frozen=True)
class ChannelScalesOptions(PassOptions):
    NAME: ClassVar[str] = "channel-scales"
    SUMMARY: ClassVar[str] = (
        "Static per-channel K scales (pre-RoPE by default); V per token at append."
    )

    bits: int = option(4, "2, 3, 4 or 8")
    key_stage: KeyStage = option("pre-rope", "pre-rope or post-rope")
    # per tail; 100 keeps min/max (99.9 measured best KLD at INT4)
    clip_percentile: float = option(99.9, "per-tail key percentile")
    sink: int = option(1, "first N positions kept in full precision")
    value_group: int | None = option(
        32, "V channels per qparam group (0: whole head)", flag="--v-group"
    )

    def __post_init__(self) -> None:
        check_choice("--bits", self.bits, (2, 3, 4, 8))
        check_range("--clip-percentile", self.clip_percentile, 50, 100, open_lo=True)
        check_range("--sink", self.sink, 0)
        check_choice("--key-stage", self.key_stage, ("pre-rope", "post-rope"))
        # not check_range: on the command line 0 is allowed (it arrives here as None)
        if self.value_group is not None and not 0 < self.value_group <= MAX_GROUP:
            raise KvqError(f"--v-group must be in [0, {MAX_GROUP}], got {self.value_group}")

    @classmethod
    def _from_flag(cls, name: str, value: Any) -> Any:
        return (value or None) if name == "value_group" else value  # --v-group 0: whole head


class _SideExceptions:
    """What kvquant and vq share about exact exceptions: --outliers, and --k-outliers /
    --v-outliers apart from it (fields declared by each pass, for its own help text)."""

    outliers: float
    k_outliers: float | None
    v_outliers: float | None

    def check_exceptions(self) -> None:
        check_range("--outliers", self.outliers, 0, 0.5, open_hi=True)
        for flag, own in (("--k-outliers", self.k_outliers), ("--v-outliers", self.v_outliers)):
            if own is not None:
                check_range(flag, own, 0, 0.5, open_hi=True)

    def outliers_of(self, part: str) -> float:
        """The exception fraction of `part` ("key" or "value"): its own flag, else --outliers."""
        own = self.k_outliers if part == "key" else self.v_outliers
        return self.outliers if own is None else own

    @property
    def value_outliers(self) -> float:
        return self.outliers_of("value")


def _side_outliers_option(part: str):
    """--v-outliers / --k-outliers of the passes whose --mixed widths take the bits a
    side's exceptions save (vq, trellis)."""
    what = "each value row" if part == "value" else "key entries"
    return option(
        None,
        f"fraction of {what} kept exactly (default: --outliers); with --mixed the bits it "
        f"saves widen {part} layers",
        flag=f"--{part[0]}-outliers",
    )


@dataclass(frozen=True)
class KVQuantOptions(_SideExceptions, PassOptions):
    NAME: ClassVar[str] = "kvquant"
    SUMMARY: ClassVar[str] = (
        "KVQuant: pre-RoPE per-channel K, per-token V, Fisher-weighted NUQ, sparse outliers, sinks."
    )

    bits: int = option(4, "2, 3 or 4")
    outliers: float = option(0.01, "fraction kept exactly (sparse)")
    sink: int = option(1, "first N positions kept in full precision")
    fisher: bool = option(True, "Fisher-weighted k-means", flag="--fisher/--no-fisher")
    # Q-Norm (decode through levels with the originals' mean and std): on by default, it
    # lowered perplexity at 2, 3 and 4 bits on Gemma 3 270M (WikiText-2, 16 x 512)
    qnorm: bool = option(
        True,
        "Q-Norm level correction (mean/std of decoded values)",
        flag="--qnorm/--no-qnorm",
    )
    mixed: str = option(
        "none",
        "per-layer, per-side bits: none, or loss (measured KL of each layer-side at each "
        "NUQ width, bits move across sides; --bits 3 or 4)",
    )
    # values' exceptions apart (as vq's --v-outliers): with --mixed loss the bits they free
    # widen layer-sides
    v_outliers: float | None = option(
        None,
        "fraction of each value row kept exactly (default: --outliers); with --mixed loss "
        "the bits it saves widen layer-sides",
        flag="--v-outliers",
    )
    k_outliers: float | None = option(
        None,
        "fraction of key entries kept exactly (default: --outliers); with --mixed loss the "
        "bits it saves widen layer-sides",
        flag="--k-outliers",
    )
    nonuniform: bool = True  # False: uniform levels on the same normalised grid (ablation)
    key_stage: KeyStage = "pre-rope"
    # "fisher": the K outlier budget goes to the channels whose Fisher-weighted range it
    # shrinks most (`sparse.allocated_thresholds`); "uniform": the same quantile in every
    # channel (the paper). Without Fisher sums the allocation is uniform.
    key_outliers: str = "fisher"
    # True: the K thresholds are fitted for `outliers` of NEW text, not of the calibration
    # text itself: thresholds fitted on the first half of the calibration windows flag more
    # than `outliers` of the second half (unseen text is wider), so the fraction is scaled
    # by nominal / held-out rate (at most down to a quarter) before the final fit.
    key_heldout: bool = True
    seed: int = 0  # k-means; the command line passes its --seed
    max_samples: int = field(default=200_000, metadata={"record": False})  # per codebook fit

    def __post_init__(self) -> None:
        check_choice("--bits", self.bits, (2, 3, 4), " for kvquant")
        check_choice("--mixed", self.mixed, ("none", "loss"), " for kvquant")
        if self.mixed == "loss" and self.bits == 2:
            raise KvqError("--mixed loss needs --bits 3 or 4 for kvquant: NUQ has no 1-bit width")
        self.check_exceptions()
        check_range("--sink", self.sink, 0)
        check_choice("key_outliers", self.key_outliers, ("fisher", "uniform"))


KVFormat = Literal["fp8-e4m3", "fp8-e5m2", "int8", "nvfp4"]
Granularity = Literal["tensor", "head"]
ScaleMethod = Literal["absmax", "percentile", "mse"]
KV_FORMATS = typing.get_args(KVFormat)
GRANULARITIES = typing.get_args(Granularity)
SCALE_METHODS = typing.get_args(ScaleMethod)


def parse_skip_layers(text: str) -> tuple[str | int, ...]:
    """--skip-layers: "none" -> (), "sliding" -> ("sliding",), "0,5" -> (0, 5). Layer
    numbers are checked against the model when it is loaded."""
    text = text.strip()
    if text in ("none", ""):
        return ()
    if text == "sliding":
        return ("sliding",)
    parts = [p.strip() for p in text.split(",")]
    # isdecimal, not isdigit: int() refuses "²"; and no 5000-digit number reaches int()
    if not all(p.isdecimal() and len(p) < 12 for p in parts):
        raise KvqError(
            "--skip-layers must be sliding, none or comma-separated layer numbers, "
            f"got {shown(text)}"
        )
    layers = tuple(sorted({int(p) for p in parts}))
    if layers[-1] >= 1 << 16:
        raise KvqError(f"--skip-layers: layer {layers[-1]} is out of range")
    return layers


MAX_PREFIX = 1 << 10  # prefix tokens: far beyond PrefixQuant's handful


def parse_prefix_ids(text: str) -> tuple[int, ...]:
    """--prefix-ids: "" or "none" -> (), "2,106" -> (2, 106). Ids are checked against the
    model's vocabulary when it is loaded."""
    text = text.strip()
    if text in ("", "none"):
        return ()
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isdecimal() and len(p) < 12 for p in parts):
        raise KvqError(f"--prefix-ids must be none or comma-separated token ids, got {shown(text)}")
    if len(parts) > MAX_PREFIX:
        raise KvqError(f"--prefix-ids: at most {MAX_PREFIX} tokens, got {len(parts)}")
    return tuple(int(p) for p in parts)


PREFIX_HELP = (
    "declare a prefix of these token ids (e.g. BOS and outlier tokens: 2,107): their exact "
    "K/V rows are served before every window, out of the statistics, and kept in the "
    "artifact (a --base that declares a prefix brings its own)"
)


@dataclass(frozen=True)
class KVScalesOptions(PassOptions):
    NAME: ClassVar[str] = "kv-scales"
    SUMMARY: ClassVar[str] = (
        "Static FP8/INT8 K and V scales per tensor or KV head, post-RoPE, as engines serve."
    )

    kv_format: KVFormat = option(
        "fp8-e4m3", "fp8-e4m3, fp8-e5m2, int8 or nvfp4 (its global scale)", flag="--format"
    )
    granularity: Granularity = option("tensor", "one scale per tensor or per KV head")
    method: ScaleMethod = option("absmax", "absmax, percentile or mse (clip search)")
    percentile: float = option(99.99, "|x| percentile for --method percentile")
    skip_layers: str = option("none", "layers kept in 16 bits: sliding, none or e.g. 0,5")
    prefix_ids: str = option("none", PREFIX_HELP, flag="--prefix-ids")

    def __post_init__(self) -> None:
        parse_prefix_ids(self.prefix_ids)
        check_choice("--format", self.kv_format, KV_FORMATS)
        check_choice("--granularity", self.granularity, GRANULARITIES)
        _check_scale_method(self.method, self.percentile)
        parse_skip_layers(self.skip_layers)
        if self.kv_format == "nvfp4" and (self.granularity, self.method) != ("tensor", "absmax"):
            raise KvqError(
                "--format nvfp4 calibrates one global scale per tensor from its absmax (the "
                "engines' convention): --granularity tensor --method absmax"
            )

    @property
    def skipped(self) -> tuple[str | int, ...]:
        return parse_skip_layers(self.skip_layers)

    @property
    def prefix(self) -> tuple[int, ...]:
        return parse_prefix_ids(self.prefix_ids)


@dataclass(frozen=True)
class ActScalesOptions(PassOptions):
    NAME: ClassVar[str] = "act-scales"
    SUMMARY: ClassVar[str] = (
        "Static per-tensor INT8 scales for the input of every decoder linear (A8 static)."
    )

    method: ScaleMethod = option("absmax", "absmax, percentile or mse (clip search)")
    percentile: float = option(99.99, "|x| percentile for --method percentile")
    prefix_ids: str = option("none", PREFIX_HELP, flag="--prefix-ids")
    # None: fp16 (activations only), or the base artifact's cache policy with --base
    layout: str | None = option(
        None, "calibration-free cache policy of the artifact without --base (default fp16)"
    )

    def __post_init__(self) -> None:
        parse_prefix_ids(self.prefix_ids)
        _check_scale_method(self.method, self.percentile)
        _check_layout(self.layout)

    @property
    def prefix(self) -> tuple[int, ...]:
        return parse_prefix_ids(self.prefix_ids)


@dataclass(frozen=True)
class SmoothAttentionOptions(PassOptions):
    NAME: ClassVar[str] = "smoothattention"
    SUMMARY: ClassVar[str] = (
        "QServe SmoothAttention: move post-RoPE key range into queries (RoPE-paired scales)."
    )

    alpha: float = option(0.5, "key exponent: lambda = max|K|^alpha / max|Q|^beta, in [0, 1]")
    beta: float = option(0.0, "query exponent, in [0, 1]")
    # None: kv4-qserve, or the base artifact's layout with --base
    layout: str | None = option(
        None, "calibration-free cache policy of the artifact (default kv4-qserve)"
    )

    def __post_init__(self) -> None:
        check_range("--alpha", self.alpha, 0, 1)
        check_range("--beta", self.beta, 0, 1)
        _check_layout(self.layout)


@dataclass(frozen=True)
class RotateOptions(PassOptions):
    NAME: ClassVar[str] = "rotate"
    SUMMARY: ClassVar[str] = (
        "Values rotated by a randomized Hadamard folded into v_proj/o_proj (same attention)."
    )

    # None: fp16, or the base artifact's layout with --base (chain a quantizing pass after)
    layout: str | None = option(None, "cache policy of the artifact (default fp16 or the base's)")
    seed: int = 0  # the random signs; the command line passes its --seed

    def __post_init__(self) -> None:
        _check_layout(self.layout)


# per-layer, per-side bit widths (mixed precision) of the low-bit passes
MIXED_CHOICES = ("none", "fisher", "loss")
MIXED_HELP = (
    "per-layer, per-side bits: none; fisher (Fisher-weighted error, bits move within each "
    "side); loss (measured KL of each layer-side at each width, bits move across sides)"
)


@dataclass(frozen=True)
class VQOptions(_SideExceptions, PassOptions):
    NAME: ClassVar[str] = "vq"
    SUMMARY: ClassVar[str] = (
        "KVQuant with vector codebooks over channel groups (RoPE pairs for K); mixed bits."
    )

    bits: int = option(3, "1, 2, 3 or 4 bits per element (codes)")
    dim: int = option(0, "channels per codebook vector: 2, 4, or 0 (4 up to 2 bits, else 2)")
    outliers: float = option(0.01, "fraction kept exactly (sparse)")
    sink: int = option(1, "first N positions kept in full precision")
    fisher: bool = option(True, "Fisher-weighted codebooks", flag="--fisher/--no-fisher")
    mixed: str = option("none", MIXED_HELP)
    # values' exceptions apart: rotated values (`rotate`) have no outlier channel left, and
    # with --mixed the bytes their exceptions would take go to wider value layers
    v_outliers: float | None = _side_outliers_option("value")
    k_outliers: float | None = _side_outliers_option("key")
    seed: int = 0  # k-means; the command line passes its --seed

    def __post_init__(self) -> None:
        if isinstance(self.mixed, bool):  # the former on/off switch: on was the Fisher allocator
            object.__setattr__(self, "mixed", "fisher" if self.mixed else "none")
        check_choice("--mixed", self.mixed, MIXED_CHOICES, " for vq")
        check_choice("--bits", self.bits, (1, 2, 3, 4), " for vq")
        check_choice("--dim", self.dim, (0, 2, 4))
        if self.dim and 2 ** (self.bits * self.dim) > 4096:
            raise KvqError(f"--dim {self.dim} at {self.bits} bits needs over 4096 centroids")
        self.check_exceptions()
        check_range("--sink", self.sink, 0)


TABLE_CHOICES = ("shared", "width", "layer")


@dataclass(frozen=True)
class TrellisOptions(_SideExceptions, PassOptions):
    NAME: ClassVar[str] = "trellis"
    SUMMARY: ClassVar[str] = (
        "KVQuant with bit-shift trellis codes (QTIP-style TCQ) for the dense codes; mixed bits."
    )

    bits: int = option(3, "1, 2, 3 or 4 bits per element (codes)")
    window: int = option(12, "trellis state bits: a table of 2^window levels (a multiple of bits)")
    tables: str = option(
        "shared",
        "shared: one table per side (keys, values) for every layer and width; width: one "
        "per side and width; layer: one per layer, side and width",
    )
    outliers: float = option(0.01, "fraction kept exactly (sparse)")
    sink: int = option(1, "first N positions kept in full precision")
    fisher: bool = option(True, "Fisher-weighted tables and search", flag="--fisher/--no-fisher")
    mixed: str = option("none", "per-layer, per-side bits: none; fisher (within each side)")
    static_tokens: int | None = option(
        None,
        "with --mixed: the context over which the tables and weights are charged to the "
        "code bits, so the cache holds no more bytes than scalar NUQ there (default: "
        "--seqlen; 0: code bits only)",
        flag="--static-tokens",
    )
    v_outliers: float | None = _side_outliers_option("value")
    k_outliers: float | None = _side_outliers_option("key")
    seed: int = 0  # table initialisation and subsample; the command line passes its --seed

    def __post_init__(self) -> None:
        check_choice("--mixed", self.mixed, ("none", "fisher"), " for trellis")
        check_choice("--bits", self.bits, (1, 2, 3, 4), " for trellis")
        check_choice("--tables", self.tables, TABLE_CHOICES)
        if self.static_tokens is not None:
            check_range("--static-tokens", self.static_tokens, 0)
        if not all(b < self.window <= 16 and self.window % b == 0 for b in self.widths()):
            listed = ", ".join(map(str, self.widths()))
            raise KvqError(
                f"--window must be at most 16, above and a multiple of the widths {listed}; "
                f"got {self.window}"
            )
        self.check_exceptions()
        check_range("--sink", self.sink, 0)

    def widths(self) -> tuple[int, ...]:
        """The widths the layer-sides may take: --bits, or within +-1 of it with --mixed."""
        if self.mixed == "none":
            return (self.bits,)
        return tuple(range(max(1, self.bits - 1), min(4, self.bits + 1) + 1))


# What `kvq calibrate auto --bits B` runs, from the measurements on Gemma 3 270M
# (WikiText-2 test 16 x 512, prefill; README "Low-bit caches"): bits -> (method, vq
# vector dim, mixed precision). "kvquant" is scalar KVQuant NUQ with its defaults.
# Perplexity ratio / KLD / top-1 (`kvq run-eval`):
#   2 bits: scalar 1.2145 / 0.1808 / 0.782, vq 4-D + Fisher bits within each side
#           1.1696 / 0.1525 / 0.796, vq 4-D + measured-loss bits across sides
#           1.1644 / 0.1473 / 0.795: loss (its calibration measures 108 layer-side
#           widths: 29 min on the shared 2 cores, against 6)
#   3 bits: scalar 1.0355 / 0.0394 / 0.889, vq 2-D + Fisher bits 1.0425 / 0.0354 / 0.898
#           (measured-loss bits 1.0417 / 0.0351 / 0.898, within noise at 4x the
#           calibration time): vq + Fisher, on KLD and top-1 (decode protocol: 1.0317 /
#           0.0370 vs scalar 1.0391 / 0.0396)
#   4 bits: scalar 1.0094 / 0.0098 / 0.944, vq 2-D + mixed 1.0135 / 0.0106 / 0.946: scalar
AUTO_CHOICES: dict[int, tuple[str, int, str]] = {
    2: ("vq", 4, "loss"),
    3: ("vq", 0, "fisher"),  # 2-D codebooks, 4-D where a layer-side takes 2 bits
    4: ("kvquant", 0, "none"),
}
# per width: whether auto runs `rotate` first (values rotated by a folded randomized
# Hadamard). Ratio / KLD / top-1 without -> with (16 x 512 prefill, README "Low-bit caches"):
#   3 bits, vq + Fisher bits: 1.0425 / 0.0354 / 0.898 -> 1.0337 / 0.0337 / 0.893 (2-D at
#           2-bit sides), 1.0362 / 0.0321 / 0.899 (4-D there: chosen, AUTO_CHOICES[3];
#           decode protocol 1.0326 / 0.0352 / 0.896 against 1.0351 / 0.0328 / 0.903)
#           (scalar NUQ3: 1.0355 / 0.0394 / 0.889 -> 1.0311 / 0.0351 / 0.893)
#   4 bits, scalar NUQ4: 1.0094 / 0.0098 / 0.944 -> 1.0097 / 0.0091 / 0.945
#   2 bits, vq 4-D + measured-loss bits: 1.1644 / 0.1473 / 0.795 -> 1.1518 / 0.1419 / 0.795
#           (scalar NUQ2: 1.2159 / 0.1824 / 0.777 -> 1.1897 / 0.1636 / 0.787)
# per width: what auto runs with --prefer speed, the fastest codes that meet the width's
# default quality budget (`kvq.eval.verdict.DEFAULTS`). Measured on Gemma 3 270M, 2-core CPU
# (reference backend), rotated, 16 x 512 prefill ratio / KLD, and `model.generate` of a
# 2,048-token prompt + 128 tokens against DynamicCache (bench/decode_profile.py):
#   3 bits: scalar NUQ3 1.0392 / 0.0425, 1.77x; vq (AUTO_CHOICES) 1.0266 / 0.0290, 2.42x;
#           trellis (AUTO_TRELLIS) 1.0189 / 0.0198, ~20x (512 + 32 tokens)
#   2 bits: scalar NUQ2 1.1897 / 0.1636 fails the 2-bit budget (ppl 1.15): vq stays
AUTO_FAST: dict[int, tuple[str, int, str]] = {
    2: AUTO_CHOICES[2],
    3: ("kvquant", 0, "none"),
    4: AUTO_CHOICES[4],
}
AUTO_ROTATE: dict[int, bool] = {2: True, 3: True, 4: True}
# per width: the values' exception fraction when they are rotated first (None: --outliers,
# 1%). Rotated values have no outlier channel left; without their exceptions (3 slots of
# index + fp16 per 256-channel row, 0.28 bits per element) the bits widen value layers
# (`--v-outliers`). Ratio / KLD / top-1, 16 x 512 prefill, rotated, 1% -> none:
#   2 bits, vq 4-D + measured-loss bits: 1.1518 / 0.1419 / 0.795 -> 1.1299 / 0.1202 / 0.807
#   3 bits, vq + Fisher bits: 1.0362 / 0.0321 / 0.899 -> 1.0307 / 0.0297 / 0.907
#   4 bits, scalar NUQ4: 1.0097 / 0.0091 / 0.945; none, with measured-loss bits (the only
#           allocator scalar NUQ has; one value side to 8 bits): 1.0090 / 0.0100 / 0.937
AUTO_V_OUTLIERS: dict[int, float | None] = {2: 0.0, 3: 0.0, 4: None}
# per width: the keys' exception fraction in that rotated chain (None: --outliers, 1%).
# Their 1% (0.27 bits per element) as key layer-bits or a 2% bought with them; ratio / KLD /
# top-1, 16 x 512 prefill (decode protocol):
#   2 bits, measured-loss bits: 1.1299 / 0.1202 / 0.807 (1.1170 / 0.1252 / 0.807) -> none
#           1.1186 / 0.1192 / 0.814 (1.1029 / 0.1239 / 0.811), bytes 0.163 -> 0.160
#   3 bits, Fisher bits: 1.0307 / 0.0297 / 0.907 -> none 1.0305 / 0.0352 / 0.901, 2%
#           1.0322 / 0.0324 / 0.899
AUTO_K_OUTLIERS: dict[int, float | None] = {2: 0.0, 3: None, 4: None}


# per width: what auto runs with --prefer quality: `kvq calibrate trellis` with shared
# tables after `rotate`, as (--mixed, keys' exception fraction, values' exception fraction;
# None: --outliers, 1%). Measured against the choices above (--prefer balanced, the
# default: trellis appends cost a Viterbi search per row, AUTO_FAST's figures), ratio / KLD / top-1 / bytes at 512
# tokens, 16 x 512 prefill (docs/methods.md "Trellis codes"):
#   2 bits: 1.1186 / 0.1192 / 0.814 / 0.1601 -> 1.0861 / 0.0822 / 0.846 / 0.1484
#   3 bits: 1.0307 / 0.0297 / 0.907 / 0.2218 -> 1.0189 / 0.0198 / 0.919 / 0.2125 (keys keep
#           their 1%, AUTO_K_OUTLIERS's choice for vq at 3 bits; not measured without)
#   4 bits: 1.0097 / 0.0091 / 0.945 / 0.2774 -> 1.0059 / 0.0050 / 0.959 / 0.2745 (--mixed widens nothing
#           past 4 bits: uniform; half the values' exceptions keep the bytes under NUQ4's)
AUTO_TRELLIS: dict[int, tuple[str, float | None, float | None]] = {
    2: ("fisher", 0.0, 0.0),
    3: ("fisher", None, 0.0),
    4: ("none", None, 0.005),
}


def vq_dims(v: VQOptions) -> str:
    """The codebook dimensions of `v` in words: --dim, or the default's (4 up to 2 bits,
    else 2, and 4 on the layer-sides that --mixed moves down to 2 bits or fewer)."""
    if v.dim:
        return f"{v.dim}-D"
    return "4-D" if v.bits <= 2 else "2-D (4-D at 1-2-bit layer-sides)"


def _exceptions(v: VQOptions | KVQuantOptions) -> str:
    k, val = v.outliers_of("key"), v.outliers_of("value")
    if k == val == v.outliers:
        return f"{v.outliers:.0%} exact outliers"
    fewer = k < v.outliers or val < v.outliers
    spent = " (the bits saved widen layers)" if fewer and v.mixed != "none" else ""
    return f"{k:.0%} exact key outliers, {val:.0%} value outliers{spent}"


@dataclass(frozen=True)
class AutoOptions(PassOptions):
    NAME: ClassVar[str] = "auto"
    SUMMARY: ClassVar[str] = (
        "The best cache kvq measured at --bits: it says which method it ran (manifest too)."
    )

    bits: int = option(3, "2, 3 or 4 bits per K/V element (codes), overheads as KVQuant's")
    rotate: bool = option(
        True,
        "rotate the values first (`rotate` pass) at the widths where it was measured to pay",
        flag="--rotate/--no-rotate",
    )
    prefer: str = option(
        "balanced",
        "balanced: vector codebooks at 2-3 bits, scalar NUQ at 4; speed: scalar NUQ where it "
        "meets the width's quality budget (3, 4 bits); quality: trellis codes, the best "
        "perplexity, but a Viterbi search per appended row (~20x slower generation on a "
        "CPU). docs/benchmarks.md 'auto: speed, balanced or quality'",
    )
    static_tokens: int | None = option(
        None,
        "with --prefer quality and --mixed fisher widths: the context over which the tables are "
        "charged to the code bits (default: --seqlen; 0: code bits only)",
        flag="--static-tokens",
    )
    seed: int = 0  # k-means; the command line passes its --seed

    def __post_init__(self) -> None:
        check_choice("--bits", self.bits, AUTO_CHOICES, " for auto")
        check_choice("--prefer", self.prefer, ("speed", "balanced", "quality"))
        if self.static_tokens is not None:
            check_range("--static-tokens", self.static_tokens, 0)

    def chain(self) -> tuple[PassOptions, ...]:
        if self.rotate and AUTO_ROTATE[self.bits]:
            return (RotateOptions(seed=self.seed), self)
        return (self,)

    def chosen(self) -> VQOptions | KVQuantOptions | TrellisOptions:
        method, dim, mixed = (AUTO_FAST if self.prefer == "speed" else AUTO_CHOICES)[self.bits]
        # unrotated values keep their exceptions: their outlier channels are still there
        rotated = len(self.chain()) > 1
        exceptions = {
            "v_outliers": AUTO_V_OUTLIERS[self.bits] if rotated else None,
            "k_outliers": AUTO_K_OUTLIERS[self.bits] if rotated else None,  # measured so
        }
        if self.prefer == "quality":
            method, (mixed, k_outliers, v_outliers) = "trellis", AUTO_TRELLIS[self.bits]
            exceptions = {
                "v_outliers": v_outliers if rotated else None,
                "k_outliers": k_outliers if rotated else None,
            }
        if method == "kvquant":
            return KVQuantOptions(bits=self.bits, mixed=mixed, seed=self.seed, **exceptions)
        if method == "trellis":
            return TrellisOptions(
                bits=self.bits, mixed=mixed, seed=self.seed, static_tokens=self.static_tokens,
                **exceptions,
            )  # fmt: skip
        return VQOptions(bits=self.bits, dim=dim, mixed=mixed, seed=self.seed, **exceptions)

    def method(self) -> str:
        v = self.chosen()
        if isinstance(v, KVQuantOptions):
            return (
                f"kvquant: scalar Fisher-weighted NUQ{v.bits}, pre-RoPE per-channel keys, "
                f"{_exceptions(v)}, sink {v.sink}, Q-Norm"
                + (
                    ", per-layer/side bits by measured KL (across sides)"
                    if v.mixed == "loss"
                    else ""
                )
            )
        mixed = {
            "none": "",
            "fisher": ", per-layer bits within each side by Fisher sensitivity",
            "loss": ", per-layer/side bits by measured KL (across sides)",
        }[v.mixed]
        if isinstance(v, TrellisOptions):
            return (
                f"trellis: KVQuant normalisers + {_exceptions(v)} + sink {v.sink}, "
                f"{v.window}-bit bit-shift trellis codes, Fisher-weighted tables shared by "
                f"the layers{mixed}"
            )
        return (
            f"vq: KVQuant normalisers + {_exceptions(v)} + sink 1, {vq_dims(v)} Fisher-weighted "
            f"codebooks (keys over RoPE pairs){mixed}"
        )

    def as_dict(self):
        rotated = "; values rotated first (rotate pass)" if len(self.chain()) > 1 else ""
        return super().as_dict() | {"method": self.method() + rotated, "why": self.why()}

    def why(self) -> str:
        """Why this method: what --prefer asked for (AUTO_FAST, AUTO_CHOICES, AUTO_TRELLIS)."""
        return {
            "speed": "--prefer speed: the fastest codes that meet this width's quality budget",
            "balanced": "--prefer balanced: the best quality whose appends stay cheap",
            "quality": "--prefer quality: the best measured quality; every appended row pays "
            "a Viterbi search (generation ~20x slower on a CPU)",
        }[self.prefer]


@dataclass(frozen=True)
class PrefixQuantOptions(PassOptions):
    NAME: ClassVar[str] = "prefixquant"
    SUMMARY: ClassVar[str] = (
        "PrefixQuant: find outlier tokens at the MLP down-projection input; prefix them, exact."
    )

    eta: float = option(64.0, "outlier threshold: token max |x| over the sequence median, > 1")
    max_tokens: int = option(4, "most prefix tokens kept (BOS included)")
    # None: int8, or the base artifact's layout with --base
    layout: str | None = option(
        None, "calibration-free cache policy of the artifact (default int8)"
    )

    def __post_init__(self) -> None:
        check_range("--eta (a ratio to the median)", self.eta, 1, open_lo=True)
        check_range("--max-tokens", self.max_tokens, 1, 64)
        _check_layout(self.layout)


@dataclass(frozen=True)
class IntactKVOptions(PassOptions):
    NAME: ClassVar[str] = "intactkv"
    SUMMARY: ClassVar[str] = (
        "IntactKV: exact prefix K/V from the full model, then calibrated against layer outputs."
    )

    prefix: str = option("bos", "bos, prefixquant (the base's, or found now) or a TEXT after BOS")
    # 48 steps of one window each (a forward and a backward: about three forwards), plus
    # 16 + 2 x 16 forwards for the targets and the losses before and after: 13 minutes
    # for 16 x 512 on Gemma 3 270M on this 2-core machine while other jobs ran.
    steps: int = option(48, "optimizer steps, one calibration window each (cycling)")
    # lr and loss from held-out windows (WikiText-2 test 8 x 512, KVQuant NUQ3 base):
    # exact prefix 1.0406 / KLD 0.0374; mse at 2e-3 1.0315 / 0.0368 (and one calibration
    # window's loss 10x worse); relative at 2e-3 1.0296 / 0.0362. At 2e-4 the rows barely
    # move in 48 steps (Adam moves each element about lr per step).
    lr: float = option(2e-3, "AdamW learning rate (0: the exact prefix, loss measured)")
    loss: str = option(
        "relative", "relative (each layer's MSE over its output's mean square) or mse"
    )
    clip: float = 1.0  # gradient norm clipping
    seed: int = 0  # window order; the command line passes its --seed

    def __post_init__(self) -> None:
        if not self.prefix.strip():
            raise KvqError("--prefix is empty: give bos, prefixquant or a text")
        check_range("--steps", self.steps, 1, 1_000_000)
        check_range("--lr", self.lr, 0, 1, open_hi=True)
        check_range("clip", self.clip, 0, open_lo=True)
        check_choice("--loss", self.loss, ("mse", "relative"))

    @property
    def prefix_kind(self) -> str:
        """ "bos", "prefixquant" or "text"."""
        return self.prefix if self.prefix in ("bos", "prefixquant") else "text"


@dataclass(frozen=True)
class TuneOptions(PassOptions):
    NAME: ClassVar[str] = "tune"
    SUMMARY: ClassVar[str] = (
        "Tune a vq/NUQ base's codebooks and key normaliser end to end on the model's KL."
    )

    steps: int = option(100, "Adam steps, one calibration window each (the last is held out)")
    lr: float = option(1e-3, "Adam learning rate (normalised units: codebook entries in [-1, 1])")
    scales: bool = option(
        True, "tune the keys' static scale and center too", flag="--scales/--no-scales"
    )
    checkpoints: int = option(4, "held-out KL measurements along the steps; the best is kept")
    seed: int = 0  # window order; the command line passes its --seed

    def __post_init__(self) -> None:
        check_range("--steps", self.steps, 1, 100_000)
        check_range("--lr", self.lr, 0, 1, open_lo=True, open_hi=True)
        check_range("--checkpoints", self.checkpoints, 1, 100)

    def as_dict(self):
        return super().as_dict() | {"method": f"tuned end-to-end on KL ({self.steps} steps)"}
