"""Running |x| statistics and the static scale fitted from them, shared by the passes
that store one scale per tensor or per head (K/V scales, linear-input scales).

Methods, per observed tensor (or head):
  absmax      the largest |x| seen maps to the top code;
  percentile  the given percentile of |x| does (the rest saturate);
  mse         the clip c x absmax (c on a grid in [0.3, 1]) whose stored scale gives the
              least squared error of the format's own round trip over the samples.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvq.quant import kv_formats

MAX_SAMPLES = 1 << 21  # |x| samples kept per observer (and head) for percentile / mse
MSE_GRID = torch.linspace(0.3, 1.0, 36)  # clip ratios tried by --method mse


class AbsObserver:
    """Running |x| statistics of one tensor: the max per head, and for percentile and mse
    a bounded sample of |x| per head ([N, H], strided when it grows too big)."""

    def __init__(self, keep_samples: bool, max_samples: int = MAX_SAMPLES):
        self.amax: Tensor | None = None  # [H]
        self.samples: list[Tensor] | None = [] if keep_samples else None
        self.count = 0
        self.max_samples = max_samples

    def add(self, x: Tensor) -> None:
        """x: [B, H, T, D] (one head: [B, 1, T, D])."""
        a = x.float().abs().permute(1, 0, 2, 3).reshape(x.shape[1], -1).T  # [B*T*D, H]
        if a.shape[0] == 0:
            return
        m = a.amax(0)
        self.amax = m if self.amax is None else torch.maximum(self.amax, m)
        if self.samples is not None:
            self.samples.append(a)
            self.count += a.shape[0]
            if self.count > 2 * self.max_samples:  # thin out: keep every other row
                joined = torch.cat(self.samples)[::2]
                self.samples, self.count = [joined], joined.shape[0]

    def values(self) -> Tensor:
        joined = torch.cat(self.samples)
        step = max(1, -(-joined.shape[0] // self.max_samples))
        return joined[::step]  # [N, H]


def fit_static_scale(
    obs: AbsObserver, fmt: str, per_head: bool, method: str, percentile: float
) -> Tensor:
    """The stored float32 scale of one observed tensor in `fmt`: [1] per tensor, [H] per
    head."""
    amax = obs.amax if per_head else obs.amax.amax().reshape(1)
    if method == "absmax":
        return kv_formats.scale_for(amax, fmt)
    values = obs.values()  # [N, H]
    if not per_head:
        values = values.reshape(-1, 1)
    if method == "percentile":
        n = values.shape[0]
        k = max(1, min(n, round(n * percentile / 100.0)))
        return kv_formats.scale_for(values.kthvalue(k, dim=0).values, fmt)
    # mse: the same |x| samples with random signs would give the same error; the formats
    # are symmetric, so |x| is enough
    best, best_err = None, None
    for c in MSE_GRID:
        scale = kv_formats.scale_for(amax * c, fmt)  # [H] or [1]
        err = (kv_formats.round_trip(values, scale, fmt) - values).pow(2).mean(0)  # [H]
        if best is None:
            best, best_err = scale.clone(), err
        else:
            better = err < best_err
            best = torch.where(better, scale, best)
            best_err = torch.where(better, err, best_err)
    return best
