"""Static per-channel K ranges from calibration windows; V quantized per token online.

For every layer, KV head and channel the calibrator observes the keys of the
calibration windows (pre-RoPE by default, where outlier channels are stable:
article 0x07B) and stores one affine scale/offset pair. Sink positions are kept
in full precision at runtime, so they are excluded from the statistics here
(article 0x07E): the calibrated range describes exactly the rows that will be
encoded with it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvq.calibrators.base import FitContext, PassResult
from kvq.calibrators.capture import capture, run_windows
from kvq.calibrators.options import ChannelScalesOptions  # noqa: F401 (re-exported)
from kvq.errors import KvqError
from kvq.progress import Progress
from kvq.quant import affine
from kvq.quant.schemes import CachePolicy, LayerPolicy, QuantScheme


def channel_ranges(samples: Tensor, percentile: float) -> tuple[Tensor, Tensor]:
    """samples [N, H, D] -> (lo, hi) each [H, D] at the given per-tail percentile."""
    n = samples.shape[0]
    if percentile >= 100.0:
        return samples.amin(0), samples.amax(0)
    k = max(1, min(n, round(n * percentile / 100.0)))
    hi = samples.kthvalue(k, dim=0).values
    lo = samples.kthvalue(n - k + 1, dim=0).values
    return lo, hi


def calibrate_channel_scales(
    model, adapter, windows: Tensor, options: ChannelScalesOptions, progress: Progress
) -> tuple[CachePolicy, dict[str, Tensor]]:
    """Run the calibration windows ([N, L] ids) and return the policy and its static tensors."""
    info = adapter.info
    if windows.shape[1] <= options.sink:
        raise KvqError(
            f"--seqlen {windows.shape[1]} leaves no tokens after {options.sink} sink tokens"
        )
    value_group = options.value_group
    if value_group is not None and value_group > info.head_dim:
        # refused, not shrunk: the manifest's options must say what the cache does
        raise KvqError(
            f"--v-group {value_group} exceeds head_dim {info.head_dim} (0: one group per head)"
        )
    if value_group == info.head_dim:
        value_group = None  # a group as wide as the head is one group per head
    if value_group is not None and info.head_dim % value_group:
        raise KvqError(
            f"--v-group {value_group} does not divide head_dim {info.head_dim} "
            "(give a divisor of it, or 0: one group per head)"
        )
    keys: list[list[Tensor]] = [[] for _ in range(info.num_layers)]

    def consume(layer: int, part: str, x: Tensor) -> None:
        # x [B, H_kv, T, D]; drop sink positions, keep [B*T', H_kv, D]
        x = x[:, :, options.sink :].float()
        keys[layer].append(x.permute(0, 2, 1, 3).reshape(-1, x.shape[1], x.shape[3]))

    with (
        progress.stage("capture keys", total=windows.shape[0]) as bar,
        capture(adapter, consume, parts=("key",), key_stage=options.key_stage),
    ):
        run_windows(model, windows, lambda _i: bar.advance())

    key_scheme = QuantScheme(format="int", bits=options.bits, axis="channel", lifetime="static")
    value_scheme = QuantScheme(
        format="int", bits=options.bits, axis="token", group_size=value_group
    )
    tensors: dict[str, Tensor] = {}
    with progress.stage("fit key ranges", total=info.num_layers) as bar:
        for layer in range(info.num_layers):
            samples = torch.cat(keys[layer])  # [N*T', H_kv, D]
            keys[layer] = []
            lo, hi = channel_ranges(samples, options.clip_percentile)
            # static: a nearly silent channel's scale is raised to fp16's smallest normal
            scale, offset = affine.affine_qparams(lo, hi, options.bits, raise_tiny=False)
            tensors[f"layers.{layer}.key.scale"] = scale.contiguous()
            tensors[f"layers.{layer}.key.offset"] = offset.contiguous()
            bar.advance()
    layer_policy = LayerPolicy(
        key=key_scheme, value=value_scheme, key_stage=options.key_stage, sink_tokens=options.sink
    )
    policy = CachePolicy(
        name=f"channel-scales-int{options.bits}", layers=(layer_policy,) * info.num_layers
    )
    return policy, tensors


def fit(ctx: FitContext) -> PassResult:
    """The registered `channel-scales` pass."""
    loaded = ctx.loaded
    policy, tensors = calibrate_channel_scales(
        loaded.model, loaded.adapter, ctx.windows.ids, ctx.options, ctx.progress
    )
    return PassResult(policy, tensors)
