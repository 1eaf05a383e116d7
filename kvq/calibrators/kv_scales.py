"""Static FP8 / INT8 K and V scales, per tensor or per KV head, from post-RoPE K and V.

What vLLM, SGLang and TensorRT-LLM load as `k_scale` / `v_scale`: keys are stored after
RoPE there, so they are observed after RoPE here. Rows the cache keeps exact (the sink or
prefix a base artifact declares) are left out of the statistics: the scale describes
exactly the rows it will encode. Layers named by --skip-layers stay in 16 bits.

With a prefix in place (the base's declared one, e.g. from `prefixquant` or `intactkv`,
or `--prefix-ids` declared now with its exact rows) the windows are served after it as
the runtime serves them (`prefix_state.run_served`): the prefix positions never reach the
statistics, and the artifact declares the same prefix, so its rows stay exact in the cache.

Methods (`kvq.calibrators.observers`), per (layer, K or V[, head]): absmax, percentile,
or mse (the clip whose stored scale gives the least error of the format's round trip).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvq.calibrators.base import FitContext, PassResult
from kvq.calibrators.capture import capture
from kvq.calibrators.observers import AbsObserver, fit_static_scale
from kvq.calibrators.options import KVScalesOptions
from kvq.calibrators.prefix_state import calibration_prefix, run_served, served_tokens
from kvq.errors import KvqError
from kvq.quant import kv_formats
from kvq.quant.schemes import FULL_PRECISION, CachePolicy, LayerPolicy


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


def fit_scale(obs: AbsObserver, options: KVScalesOptions) -> Tensor:
    """The stored float32 scale of one (layer, side): [1] per tensor, [H] per head."""
    per_head = options.granularity == "head"
    return fit_static_scale(obs, options.kv_format, per_head, options.method, options.percentile)


def fit(ctx: FitContext) -> PassResult:
    """The registered `kv-scales` pass."""
    options: KVScalesOptions = ctx.options
    adapter = ctx.loaded.adapter
    info = adapter.info
    skip = skipped_layers(options, adapter)
    prefix = calibration_prefix(ctx, options.prefix)
    # rows a base artifact keeps exact (sinks: each sequence's first real tokens, after
    # the prefix) stay exact, and out of the statistics
    sinks = [0] * info.num_layers
    if ctx.base is not None:
        sinks = [layer.sink_tokens for layer in ctx.base.policy.layers]
    windows = served_tokens(ctx.loaded, ctx.windows.ids, prefix)  # [N, L']
    if windows.shape[1] <= max(sinks):
        raise KvqError(f"--seqlen {windows.shape[1]} leaves no rows after {max(sinks)} sink rows")
    keep = options.method != "absmax"
    observers = {
        (i, part): AbsObserver(keep)
        for i in range(info.num_layers)
        if i not in skip
        for part in ("key", "value")
    }

    def consume(layer: int, part: str, x: Tensor) -> None:
        if layer not in skip:  # x [B, H_kv, T, D], keys already rotated
            observers[(layer, part)].add(x[:, :, sinks[layer] :])

    start = 0 if prefix is None else prefix.length  # the windows' first position
    progress = ctx.progress
    with (
        progress.stage("capture post-RoPE K/V", total=windows.shape[0]) as bar,
        capture(
            adapter,
            consume,
            parts=("key", "value"),
            key_stage="post-rope",
            positions=torch.arange(start, start + windows.shape[1]),  # as served
        ),
    ):
        run_served(ctx.loaded, windows, prefix, lambda _i: bar.advance())

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
                    name = "global_scale" if options.kv_format == "nvfp4" else "scale"
                    tensors[f"layers.{i}.{part}.{name}"] = fit_scale(obs, options).contiguous()
                layers.append(LayerPolicy(scheme, scheme, "post-rope", sink_tokens=sinks[i]))
            bar.advance()
    name = f"kv-scales-{options.kv_format}-{options.granularity}"
    policy = CachePolicy(name=name, layers=tuple(layers))
    if prefix is not None:  # served as calibrated: the same prefix, its rows exact
        policy = policy.with_prefix(prefix.spec)
        tensors |= prefix.tensors()
    return PassResult(policy, tensors)
