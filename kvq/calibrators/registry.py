"""Calibration passes by name: the one extension point the command line is built from.

A pass is its options dataclass (torch-free, in `kvq.calibrators.options`) and a `fit`
function named by "module:function", imported only when the pass runs, so that
`kvq --help` and bad-input errors never wait for torch. Adding a pass: write its module
with `fit(context) -> PassResult` (see `kvq.calibrators.base`), its options class, and
one line below.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

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


@dataclass(frozen=True)
class PassEntry:
    options: type[PassOptions]
    fit: str  # "module:function", the function taking a FitContext

    @property
    def name(self) -> str:
        return self.options.NAME

    def load_fit(self) -> Callable:
        module, function = self.fit.split(":")
        return getattr(importlib.import_module(module), function)


PASSES: dict[str, PassEntry] = {
    entry.name: entry
    for entry in (
        PassEntry(ChannelScalesOptions, "kvq.calibrators.channel_scales:fit"),
        PassEntry(KVQuantOptions, "kvq.calibrators.kvquant:fit"),
        PassEntry(KVScalesOptions, "kvq.calibrators.kv_scales:fit"),
        PassEntry(SmoothAttentionOptions, "kvq.calibrators.smooth_attention:fit"),
        PassEntry(RotateOptions, "kvq.calibrators.rotation:fit"),
        PassEntry(ActScalesOptions, "kvq.calibrators.act_scales:fit"),
        PassEntry(VQOptions, "kvq.calibrators.vq:fit"),
        PassEntry(TrellisOptions, "kvq.calibrators.trellis:fit"),
        PassEntry(AutoOptions, "kvq.calibrators.auto:fit"),
        PassEntry(PrefixQuantOptions, "kvq.calibrators.prefixquant:fit"),
        PassEntry(IntactKVOptions, "kvq.calibrators.intactkv:fit"),
        PassEntry(TuneOptions, "kvq.calibrators.tune:fit"),
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
