"""The options of each calibration pass, with their checks.

Kept apart from the passes themselves, which import torch: the command line builds and
checks options (a bad --bits, say) before importing anything heavy or loading a model.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvq.errors import KvqError
from kvq.quant.schemes import MAX_GROUP, KeyStage


@dataclass(frozen=True)
class ChannelScalesOptions:
    bits: int = 4
    key_stage: KeyStage = "pre-rope"
    clip_percentile: float = 99.9  # per tail; 100 keeps min/max (99.9 measured best KLD at INT4)
    sink: int = 1
    value_group: int | None = 32  # channels per V qparam group (None: whole head)

    def __post_init__(self) -> None:
        if self.bits not in (2, 3, 4, 8):
            raise KvqError(f"--bits must be one of 2, 3, 4, 8, got {self.bits}")
        if not 50.0 < self.clip_percentile <= 100.0:
            raise KvqError(f"--clip-percentile must be in (50, 100], got {self.clip_percentile}")
        if self.sink < 0:
            raise KvqError(f"--sink must be >= 0, got {self.sink}")
        if self.key_stage not in ("pre-rope", "post-rope"):
            raise KvqError(f"--key-stage must be pre-rope or post-rope, got {self.key_stage!r}")
        if self.value_group is not None and not 0 < self.value_group <= MAX_GROUP:
            raise KvqError(f"--v-group must be in [0, {MAX_GROUP}], got {self.value_group}")

    def as_dict(self) -> dict[str, str | int | float | bool | None]:
        return {
            "bits": self.bits,
            "key_stage": self.key_stage,
            "clip_percentile": self.clip_percentile,
            "sink": self.sink,
            "value_group": self.value_group,
        }


@dataclass(frozen=True)
class KVQuantOptions:
    bits: int = 4
    outliers: float = 0.01  # fraction of values kept exactly, split over both tails
    sink: int = 1
    fisher: bool = True
    # Q-Norm (decode through levels with the originals' mean and std): on by default, it
    # lowered perplexity at 2, 3 and 4 bits on Gemma 3 270M (WikiText-2, 16 x 512)
    qnorm: bool = True
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
    seed: int = 0
    max_samples: int = 200_000  # per codebook fit

    def __post_init__(self) -> None:
        if self.bits not in (2, 3, 4):
            raise KvqError(f"--bits must be 2, 3 or 4 for kvquant, got {self.bits}")
        if not 0.0 <= self.outliers < 0.5:
            raise KvqError(f"--outliers must be a fraction in [0, 0.5), got {self.outliers}")
        if self.sink < 0:
            raise KvqError(f"--sink must be >= 0, got {self.sink}")
        if self.key_outliers not in ("fisher", "uniform"):
            raise KvqError(f"key_outliers must be 'fisher' or 'uniform', got {self.key_outliers!r}")

    def as_dict(self) -> dict[str, str | int | float | bool | None]:
        return {
            "bits": self.bits,
            "outliers": self.outliers,
            "sink": self.sink,
            "fisher": self.fisher,
            "qnorm": self.qnorm,
            "nonuniform": self.nonuniform,
            "key_stage": self.key_stage,
            "key_outliers": self.key_outliers,
            "key_heldout": self.key_heldout,
            "seed": self.seed,
        }
