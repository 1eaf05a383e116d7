"""Static per-tensor INT8 scales for the input of every linear layer of the decoder.

What a W8A8 engine with static activation scales loads as `input_scale`: one float32
scale per linear (q/k/v/o projections, the MLP's gate/up/down), fitted from the inputs
the full-precision model feeds it on the calibration windows. `kvq run-eval --activations
a8-static` quantizes each linear's input with it (`kvq.runtime.activations`).

Static scales are what token outliers ruin: one token with a 100x larger row (BOS, a
delimiter) sets the step of every other row. With a prefix in place (the base's declared
one, e.g. from `prefixquant`, or `--prefix-ids` declared now with its exact rows) the
windows are served after it as the runtime serves them (`prefix_state.run_served`): its
K/V rows are in the cache, so its activations are never computed, never quantized and
never in the statistics. The artifact declares the same prefix.

Stored as `act.layers.{i}.<path>.input_scale` ([1] float32), e.g.
`act.layers.3.mlp.down_proj.input_scale`: a tensor kind of its own (`tensor_kind`),
carried along a chain like model transforms.
"""

from __future__ import annotations

from torch import Tensor

from kvq.calibrators.base import FitContext, PassResult
from kvq.calibrators.capture import capture_linear_inputs
from kvq.calibrators.observers import AbsObserver, fit_static_scale
from kvq.calibrators.options import ActScalesOptions
from kvq.calibrators.prefix_state import calibration_prefix, run_served, served_tokens
from kvq.quant.activations import input_scale_name
from kvq.quant.schemes import named_policy

MAX_SAMPLES = 1 << 18  # |x| samples per linear for percentile / mse (~126 linears: ~130 MB)


def fit(ctx: FitContext) -> PassResult:
    """The registered `act-scales` pass."""
    options: ActScalesOptions = ctx.options
    adapter = ctx.loaded.adapter
    prefix = calibration_prefix(ctx, options.prefix)
    keep = options.method != "absmax"
    observers = {name: AbsObserver(keep, MAX_SAMPLES) for name in adapter.decoder_linears()}

    def consume(name: str, x: Tensor) -> None:
        observers[name].add(x[:, None])  # [B, T, K] -> [B, 1, T, K]: one "head"

    windows = served_tokens(ctx.loaded, ctx.windows.ids, prefix)  # [N, L']
    progress = ctx.progress
    with (
        progress.stage("capture linear inputs", total=windows.shape[0]) as bar,
        capture_linear_inputs(adapter, consume),
    ):
        run_served(ctx.loaded, windows, prefix, lambda _i: bar.advance())

    tensors: dict[str, Tensor] = {}
    with progress.stage(f"fit {options.method} input scales", total=len(observers)) as bar:
        for name, obs in observers.items():
            scale = fit_static_scale(obs, "int8", False, options.method, options.percentile)
            tensors[input_scale_name(name)] = scale.contiguous()  # [1] float32
            bar.advance()
    base = ctx.base
    if base is not None and (prefix is None or base.policy.prefix is not None):
        return PassResult(None, tensors)  # the base's cache policy, state and prefix stay
    if base is None:
        from kvq.runtime.cache import unit_scales  # a calibration-free layout's state

        info = adapter.info
        policy = named_policy(options.layout or "fp16", info.num_layers, info.head_dim)
        tensors |= unit_scales(policy)
    else:  # --prefix-ids on a base without a prefix: the base's layout, now with one
        policy = base.policy
        tensors |= base.policy_tensors()
    if prefix is None:
        return PassResult(policy, tensors)
    return PassResult(policy.with_prefix(prefix.spec), tensors | prefix.tensors())
