"""Who a model is (fingerprints) and what shape its attention has (architecture).

Both records go into every artifact manifest; the runtime recomputes them for
the model it is handed and refuses an artifact whose record differs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

RopePairing = Literal["rotate-half", "interleaved"]
LayerType = Literal["full_attention", "sliding_attention"]


@dataclass(frozen=True)
class ModelIdentity:
    """Fingerprints of a model: sha256 hex digests."""

    model_type: str  # the HF config's model_type, e.g. "gemma3_text"
    config_sha256: str  # canonical JSON of the architecture-defining config fields
    weights_sha256: str  # parameter names, shapes, dtypes and values
    tokenizer_sha256: str  # vocabulary, merges and special tokens


@dataclass(frozen=True)
class RopeInfo:
    """The rotary embedding of one layer, enough to rotate a pre-RoPE key."""

    theta: float
    rotary_dim: int  # number of leading head_dim channels that rotate
    pairing: RopePairing  # rotate-half pairs (i, i + d/2); interleaved pairs (2i, 2i+1)
    scaling: str | None = None  # canonical JSON of rope scaling parameters, None if plain


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

    @property
    def gqa_group(self) -> int:
        """Query heads per KV head."""
        return self.num_q_heads // self.num_kv_heads
