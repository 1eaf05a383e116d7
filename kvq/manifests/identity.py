"""Who a model is (fingerprints) and what shape its attention has (architecture).

Both records go into every artifact manifest; the runtime recomputes them for
the model it is handed and refuses an artifact whose record differs.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Literal

from kvq.errors import require

RopePairing = Literal["rotate-half", "interleaved"]
LayerType = Literal["full_attention", "sliding_attention"]

# Bounds no real model reaches (the largest have ~130 layers, 128 heads, head_dim 256) and
# that keep a tampered manifest from asking the runtime for absurd allocations.
MAX_LAYERS = 1024
MAX_HEADS = 1024
MAX_HEAD_DIM = 4096
MAX_WINDOW = 1 << 24
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def is_sha256(value: str) -> bool:
    """A lowercase hex sha256 digest."""
    return bool(_SHA256.match(value))


def in_range(value: int, low: int, high: int) -> bool:
    return low <= value <= high


@dataclass(frozen=True)
class ModelIdentity:
    """Fingerprints of a model: sha256 hex digests."""

    model_type: str  # the HF config's model_type, e.g. "gemma3_text"
    config_sha256: str  # canonical JSON of the architecture-defining config fields
    weights_sha256: str  # parameter names, shapes, dtypes and values
    tokenizer_sha256: str  # vocabulary, merges and special tokens

    def __post_init__(self) -> None:
        for name in ("config_sha256", "weights_sha256", "tokenizer_sha256"):
            value = getattr(self, name)
            require(is_sha256(value), name, "a lowercase hex sha256 digest", value)


@dataclass(frozen=True)
class RopeInfo:
    """The rotary embedding of one layer, enough to rotate a pre-RoPE key."""

    theta: float
    rotary_dim: int  # number of leading head_dim channels that rotate
    pairing: RopePairing  # rotate-half pairs (i, i + d/2); interleaved pairs (2i, 2i+1)
    scaling: str | None = None  # canonical JSON of rope scaling parameters, None if plain

    def __post_init__(self) -> None:
        require(math.isfinite(self.theta) and self.theta > 0, "theta", "positive", self.theta)
        require(
            self.rotary_dim % 2 == 0 and in_range(self.rotary_dim, 2, MAX_HEAD_DIM),
            "rotary_dim",
            f"an even number in [2, {MAX_HEAD_DIM}]",
            self.rotary_dim,
        )


@dataclass(frozen=True)
class ArchitectureInfo:
    """The attention layout the cache depends on."""

    model_type: str
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    layer_types: tuple[LayerType, ...]
    sliding_window: int | None
    rope: tuple[RopeInfo, ...]  # one per layer
    qk_norm: bool  # whether q/k are RMS-normalised per head before RoPE
    qk_norm_offset_one: bool  # Gemma parametrises the norm weight as (1 + w)

    def __post_init__(self) -> None:
        n = self.num_layers
        require(in_range(n, 1, MAX_LAYERS), "num_layers", f"in [1, {MAX_LAYERS}]", n)
        heads = f"in [1, {MAX_HEADS}]"
        require(in_range(self.num_q_heads, 1, MAX_HEADS), "num_q_heads", heads, self.num_q_heads)
        require(
            in_range(self.num_kv_heads, 1, self.num_q_heads)
            and self.num_q_heads % self.num_kv_heads == 0,
            "num_kv_heads",
            f"a divisor of num_q_heads {self.num_q_heads}",
            self.num_kv_heads,
        )
        require(
            self.head_dim % 2 == 0 and in_range(self.head_dim, 2, MAX_HEAD_DIM),
            "head_dim",
            f"an even number in [2, {MAX_HEAD_DIM}]",
            self.head_dim,
        )
        require(len(self.layer_types) == n, "layer_types", f"{n} entries", self.layer_types)
        require(len(self.rope) == n, "rope", f"{n} entries", len(self.rope))
        for i, rope in enumerate(self.rope):
            require(
                rope.rotary_dim <= self.head_dim,
                f"rope[{i}].rotary_dim",
                f"at most head_dim {self.head_dim}",
                rope.rotary_dim,
            )
        sliding = "sliding_attention" in self.layer_types
        window = self.sliding_window
        if not sliding:
            require(window is None, "sliding_window", "null without sliding layers", window)
        else:
            require(
                window is not None and in_range(window, 1, MAX_WINDOW),
                "sliding_window",
                f"in [1, {MAX_WINDOW}] for sliding layers",
                window,
            )

    @property
    def gqa_group(self) -> int:
        """Query heads per KV head."""
        return self.num_q_heads // self.num_kv_heads
