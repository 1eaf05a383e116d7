"""Calibration passes by name: the one extension point the command line is built from.

A pass is its options dataclass (torch-free, in `kvq.calibrators.options`) and a `fit`
function named by "module:function", imported only when the pass runs, so that
`kvq --help` and bad-input errors never wait for torch. Adding a pass: write its module
with `fit(context) -> PassResult` (see `kvq.calibrators.base`), its options class, and
one line below, with what it needs of a base (`base`, `rules`) if anything.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

from kvq.calibrators.options import (
    ActScalesOptions,
    AutoOptions,
    ChannelScalesOptions,
    IntactKVOptions,
    KVQuantOptions,
    KVScalesOptions,
    PassOptions,
    PrefixQuantOptions,
    RotateOptions,
    SmoothAttentionOptions,
    TrellisOptions,
    TuneOptions,
    VQOptions,
)
from kvq.errors import KvqError
from kvq.quant.schemes import CachePolicy, LayerPolicy

TUNED_FORMATS = ("vq", "nuq")  # the formats whose float state `tune` trains


@dataclass(frozen=True)
class BaseView:
    """What a pass's base rules read: the base's cache policy and what its tensors are, by
    name only, so that a manifest will do as well as a loaded artifact."""

    policy: CachePolicy
    kinds: frozenset[str]  # its tensors' kinds (`kvq.calibrators.base.tensor_kind`)
    transforms: frozenset[str]  # the model transforms it carries ("smooth", "rotate")

    @classmethod
    def of(cls, policy: CachePolicy, names: Iterable[str]) -> BaseView:
        from kvq.calibrators.base import tensor_kind  # torch: only once a pass runs

        kinds = {n: tensor_kind(n) for n in names}
        transforms = {n.split(".")[2] for n, k in kinds.items() if k == "transform"}
        return cls(policy, frozenset(kinds.values()), frozenset(transforms))


@dataclass(frozen=True)
class BaseRule:
    """A base a pass cannot use: `refuses(options, base)`, and why (the end of its
    one-line refusal; "{name}" stands for the pass)."""

    refuses: Callable[[PassOptions, BaseView], bool]
    reason: str


def _holds_rows_back(layer: LayerPolicy) -> bool:
    """A residual window, or keys encoded per group of tokens (KIVI): what the runtime
    calls a windowed layer (`kvq.runtime.layers`), which the training forwards of intactkv
    and tune, one row at a time, do not reproduce."""
    key = layer.key
    grouped = key.axis == "channel" and key.lifetime == "dynamic" and (key.group_size or 1) > 1
    return layer.residual_tokens > 0 or grouped


QUANTIZED = BaseRule(
    lambda _o, b: all(not (lp.key.stored or lp.value.stored) for lp in b.policy.layers),
    "it keeps K and V at full precision, so there is no quantization error to calibrate "
    "the prefix for (start from a quantized base, e.g. kvquant or channel-scales)",
)
PER_ROW = BaseRule(
    lambda _o, b: any(_holds_rows_back(lp) for lp in b.policy.layers),
    "it keeps a residual window or token groups (KIVI); only per-row layouts (kvquant, vq, "
    "channel-scales...) are supported",
)
TUNABLE = BaseRule(
    lambda _o, b: (
        not any(s.format in TUNED_FORMATS for lp in b.policy.layers for s in (lp.key, lp.value))
    ),
    "it holds no vq or NUQ state to tune (calibrate it with kvquant or vq first)",
)
NO_PREFIX = BaseRule(
    lambda _o, b: b.policy.prefix is not None,
    "it declares a prefix; tune the artifact before adding it",
)
# act-scales keeps a base's cache policy: a --layout next to one would go unused
LAYOUT_WITHOUT_BASE = BaseRule(
    lambda o, _b: o.layout is not None,
    "--layout sets the cache policy of an artifact made without a base, and this pass keeps "
    "the base's (drop --layout)",
)


def first_in_chain(kind: str, hint: str = "") -> tuple[BaseRule, ...]:
    """The rules of a pass that folds a `kind` transform into the weights: whatever the base
    calibrated on the model before it (qparams, activation scales, prefix rows) would no
    longer describe it, and a model takes one transform of each kind."""
    hint = f" ({hint})" if hint else ""
    return (
        BaseRule(
            lambda _o, b: bool(b.kinds & {"policy", "activation"}),
            "{name} transforms the model, and the base holds qparams or activation scales "
            f"calibrated on the untransformed one; run it first in the chain{hint}",
        ),
        BaseRule(
            lambda _o, b: b.policy.prefix is not None,
            "{name} transforms the model, and the base's prefix rows come from the "
            f"untransformed one; run it first in the chain{hint}",
        ),
        BaseRule(
            lambda _o, b: kind in b.transforms,
            f"the base already carries a {kind} transform, and a model takes one of each kind",
        ),
    )


@dataclass(frozen=True)
class PassEntry:
    options: type[PassOptions]
    fit: str  # "module:function", the function taking a FitContext
    # a base: `--base ART`, or the state the passes before it in a recipe left
    base: Literal["optional", "required"] = "optional"
    rules: tuple[BaseRule, ...] = ()  # the bases it cannot use

    @property
    def name(self) -> str:
        return self.options.NAME

    def load_fit(self) -> Callable:
        module, function = self.fit.split(":")
        return getattr(importlib.import_module(module), function)

    def check_base(
        self, options: PassOptions, policy: CachePolicy | None, names: Iterable[str] = ()
    ) -> None:
        """Refuse, in one line, a base this pass cannot use (no base, where it needs one),
        from the base's policy and tensor names alone: before any of the pass's work."""
        if policy is None:
            if self.base == "required":
                raise KvqError(
                    f"{self.name} needs a base to start from: an artifact (--base ART) or an "
                    "earlier pass of the recipe"
                )
            return
        view = BaseView.of(policy, names)
        for rule in self.rules:
            if rule.refuses(options, view):
                why = rule.reason.format(name=self.name)
                raise KvqError(
                    f"{self.name} cannot use the base (cache policy {policy.name!r}): {why}"
                )


PASSES: dict[str, PassEntry] = {
    entry.name: entry
    for entry in (
        # a pass without rules makes its own policy (kv-scales: keeping the base's sinks and
        # prefix) or keeps the base's: any base will do, if only for the transforms it carries
        PassEntry(ChannelScalesOptions, "kvq.calibrators.channel_scales:fit"),
        PassEntry(KVQuantOptions, "kvq.calibrators.kvquant:fit"),
        PassEntry(KVScalesOptions, "kvq.calibrators.kv_scales:fit"),
        PassEntry(
            SmoothAttentionOptions,
            "kvq.calibrators.smooth_attention:fit",
            rules=first_in_chain("smooth"),
        ),
        PassEntry(
            RotateOptions,
            "kvq.calibrators.rotation:fit",
            rules=first_in_chain("rotate", "auto runs it: --no-rotate skips it"),
        ),
        PassEntry(ActScalesOptions, "kvq.calibrators.act_scales:fit", rules=(LAYOUT_WITHOUT_BASE,)),
        PassEntry(VQOptions, "kvq.calibrators.vq:fit"),
        PassEntry(TrellisOptions, "kvq.calibrators.trellis:fit"),
        PassEntry(AutoOptions, "kvq.calibrators.auto:fit"),  # its rotate: rotate's rules
        PassEntry(PrefixQuantOptions, "kvq.calibrators.prefixquant:fit"),
        # calibrated for the base's quantized cache, through its own codecs
        PassEntry(
            IntactKVOptions, "kvq.calibrators.intactkv:fit", "required", (QUANTIZED, PER_ROW)
        ),
        PassEntry(
            TuneOptions, "kvq.calibrators.tune:fit", "required", (TUNABLE, NO_PREFIX, PER_ROW)
        ),
    )
}


def get_pass(name: str) -> PassEntry:
    if name not in PASSES:
        raise KvqError(f"unknown calibration pass {name!r}; known: {', '.join(PASSES)}")
    return PASSES[name]


# Model transforms stored in artifacts as layers.{i}.KIND.*, by KIND: "module:function"
# taking (loaded model, that kind's tensors) and folding them into the model's weights.
TRANSFORMS: dict[str, str] = {
    "smooth": "kvq.models.smoothing:fold_smooth",  # SmoothAttention's lambda [H_kv, D]
    "rotate": "kvq.models.rotation:fold_rotation",  # value rotations [H_kv, D, D]
}


def transform_function(kind: str) -> Callable:
    if kind not in TRANSFORMS:
        known = ", ".join(TRANSFORMS) or "none"
        raise KvqError(f"unknown model transform {kind!r} in the artifact; known: {known}")
    module, function = TRANSFORMS[kind].split(":")
    return getattr(importlib.import_module(module), function)
