"""Static FP8 / INT8 K and V scales, per tensor or per KV head, from post-RoPE K and V.

What vLLM, SGLang and TensorRT-LLM load as `k_scale` / `v_scale`: keys are stored after
RoPE there, so they are observed after RoPE here. Rows the cache keeps exact (the sink or
prefix a base artifact declares) are left out of the statistics: the scale describes
exactly the rows it will encode. Layers named by --skip-layers stay in 16 bits.

Methods, per (layer, K or V[, head]):
  absmax      the largest |x| seen maps to the top code;
  percentile  the given percentile of |x| does (the rest saturate);
  mse         the clip c x absmax (c on a grid in [0.3, 1]) whose stored scale gives the
              least squared error of the format's own round trip over the samples.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvq.calibrators.base import FitContext, PassResult
from kvq.calibrators.capture import capture, run_windows
from kvq.calibrators.options import KVScalesOptions
from kvq.errors import KvqError
from kvq.quant import kv_formats
from kvq.quant.schemes import FULL_PRECISION, CachePolicy, LayerPolicy

MAX_SAMPLES = 1 << 21  # |x| samples kept per (layer, side, head) for percentile / mse
MSE_GRID = torch.linspace(0.3, 1.0, 36)  # clip ratios tried by --method mse


def skipped_layers(options: KVScalesOptions, adapter) -> set[int]:
    """The layer numbers --skip-layers keeps in 16 bits ("sliding": every sliding-window
    layer of the model)."""
    n = adapter.info.num_layers
    chosen = set()
    for item in options.skipped:
        if item == "sliding":
            chosen |= {i for i in range(n) if adapter.sliding_window(i) is not None}
        elif item >= n:
            raise KvqError(f"--skip-layers: layer {item} does not exist (the model has {n})")
        else:
            chosen.add(item)
    if len(chosen) == n:
        raise KvqError("--skip-layers keeps every layer in 16 bits: nothing to calibrate")
    return chosen


class _Observer:
    """Running |x| statistics of one (layer, side): the max per head, and for percentile
    and mse a bounded sample of |x| per head ([N, H], strided when it grows too big)."""

    def __init__(self, keep_samples: bool):
        self.amax: Tensor | None = None  # [H]
        self.samples: list[Tensor] = [] if keep_samples else None
        self.count = 0

    def add(self, x: Tensor) -> None:
        # x [B, H, T, D] -> |x| as [B*T*D, H]
        a = x.float().abs().permute(1, 0, 2, 3).reshape(x.shape[1], -1).T
        m = a.amax(0)
        self.amax = m if self.amax is None else torch.maximum(self.amax, m)
        if self.samples is not None:
            self.samples.append(a)
            self.count += a.shape[0]
            if self.count > 2 * MAX_SAMPLES:  # thin out: keep every other row
                joined = torch.cat(self.samples)[::2]
                self.samples, self.count = [joined], joined.shape[0]

    def values(self) -> Tensor:
        joined = torch.cat(self.samples)
        step = max(1, -(-joined.shape[0] // MAX_SAMPLES))
        return joined[::step]  # [N, H]


def fit_scale(obs: _Observer, options: KVScalesOptions) -> Tensor:
    """The stored float32 scale of one (layer, side): [1] per tensor, [H] per head."""
    per_head = options.granularity == "head"
    amax = obs.amax if per_head else obs.amax.amax().reshape(1)
    fmt = options.kv_format
    if options.method == "absmax":
        return kv_formats.scale_for(amax, fmt)
    values = obs.values()  # [N, H]
    if not per_head:
        values = values.reshape(-1, 1)
    if options.method == "percentile":
        n = values.shape[0]
        k = max(1, min(n, round(n * options.percentile / 100.0)))
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


def fit(ctx: FitContext) -> PassResult:
    """The registered `kv-scales` pass."""
    options: KVScalesOptions = ctx.options
    adapter = ctx.loaded.adapter
    info = adapter.info
    skip = skipped_layers(options, adapter)
    # rows a base artifact keeps exact (sinks) stay exact, and out of the statistics
    sinks = [0] * info.num_layers
    if ctx.base is not None:
        sinks = [layer.sink_tokens for layer in ctx.base.policy.layers]
    windows = ctx.windows.ids
    if windows.shape[1] <= max(sinks):
        raise KvqError(f"--seqlen {windows.shape[1]} leaves no rows after {max(sinks)} sink rows")
    keep = options.method != "absmax"
    observers = {
        (i, part): _Observer(keep)
        for i in range(info.num_layers)
        if i not in skip
        for part in ("key", "value")
    }

    def consume(layer: int, part: str, x: Tensor) -> None:
        if layer not in skip:  # x [B, H_kv, T, D], keys already rotated
            observers[(layer, part)].add(x[:, :, sinks[layer] :])

    progress = ctx.progress
    with (
        progress.stage("capture post-RoPE K/V", total=windows.shape[0]) as bar,
        capture(adapter, consume, parts=("key", "value"), key_stage="post-rope"),
    ):
        run_windows(ctx.loaded.model, windows, lambda _i: bar.advance())

    scheme = kv_formats.scheme_for(options.kv_format, options.granularity)
    tensors: dict[str, Tensor] = {}
    layers = []
    with progress.stage(f"fit {options.method} scales", total=info.num_layers) as bar:
        for i in range(info.num_layers):
            if i in skip:
                layers.append(LayerPolicy(FULL_PRECISION, FULL_PRECISION, "post-rope"))
            else:
                for part in ("key", "value"):
                    obs = observers.pop((i, part))
                    tensors[f"layers.{i}.{part}.scale"] = fit_scale(obs, options).contiguous()
                layers.append(LayerPolicy(scheme, scheme, "post-rope", sink_tokens=sinks[i]))
            bar.advance()
    name = f"kv-scales-{options.kv_format}-{options.granularity}"
    return PassResult(CachePolicy(name=name, layers=tuple(layers)), tensors)
