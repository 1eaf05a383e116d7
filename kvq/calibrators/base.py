"""What a calibration pass receives and returns.

A pass is `fit(context: FitContext) -> PassResult` (registered in
`kvq.calibrators.registry`). The context holds the model with the transforms of the
chain so far already applied (`--base ART`: e.g. SmoothAttention's scales folded into
the weights), the calibration windows and the base artifact, if any.

Artifact tensors fall in three kinds, told apart by name:
    layers.{i}.key.* / layers.{i}.value.*   the cache policy's static state (codecs)
    layers.{i}.prefix.key / .value          declared prefix rows (`CachePolicy.prefix`)
    layers.{i}.<other>.*                    model transforms (e.g. layers.3.smooth.lambda)
    act.layers.{i}.<linear>.input_scale     static activation scales (A8, `act-scales`)
    anything else                           provenance of the pass that made the policy
                                            (e.g. fisher.key)
A pass that returns a policy replaces the base's policy state and provenance; transforms
and activation scales always carry forward along the chain, and so does a prefix unless
the pass declares its own.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from torch import Tensor

from kvq.calibrators.options import PassOptions
from kvq.data.windows import TokenWindows
from kvq.models.loading import LoadedModel
from kvq.progress import Progress
from kvq.quant.schemes import CachePolicy

_POLICY_STATE = re.compile(r"^layers\.\d+\.(key|value)\.")
_PREFIX = re.compile(r"^layers\.\d+\.prefix\.")
_LAYER_TENSOR = re.compile(r"^layers\.\d+\.")
_ACTIVATION = re.compile(r"^act\.layers\.\d+\.")
_POLICY_KINDS = ("policy", "provenance")


def tensor_kind(name: str) -> str:
    """ "policy", "prefix", "activation", "transform" or "provenance" (see the module
    docstring)."""
    if _POLICY_STATE.match(name):
        return "policy"
    if _PREFIX.match(name):
        return "prefix"
    if _ACTIVATION.match(name):
        return "activation"
    return "transform" if _LAYER_TENSOR.match(name) else "provenance"


@dataclass
class ChainState:
    """What the passes of a chain have produced so far (a base artifact's, or the passes
    run before in this command): the policy and every tensor, by kind."""

    policy: CachePolicy
    tensors: dict[str, Tensor]
    report: dict = field(default_factory=dict)  # what the latest pass found (its manifest entry)

    def of_kind(self, kind: str) -> dict[str, Tensor]:
        return {n: t for n, t in self.tensors.items() if tensor_kind(n) == kind}

    def policy_tensors(self) -> dict[str, Tensor]:
        """The policy's state and provenance: what a pass that re-declares the base's policy
        (with a prefix of its own) returns; transforms and activation scales are carried by
        the chain, and returning them again would read as new ones."""
        return {n: t for n, t in self.tensors.items() if tensor_kind(n) in _POLICY_KINDS}


@dataclass
class FitContext:
    loaded: LoadedModel  # the chain's transforms already applied to loaded.model
    windows: TokenWindows
    options: PassOptions
    progress: Progress
    base: ChainState | None = None
    # identifies the model's current weights, transforms included (cache keys such as the
    # Fisher cache's must not confuse a smoothed model with the original)
    weights_key: str = ""


@dataclass
class PassResult:
    policy: CachePolicy | None  # None: keep the base artifact's policy and its state
    tensors: dict[str, Tensor] = field(default_factory=dict)  # named by kind, see above
    # what the pass found, recorded in its manifest entry and shown by `kvq inspect`:
    # str / int / float / bool / None values, or tuples of floats or of strings
    report: dict = field(default_factory=dict)
