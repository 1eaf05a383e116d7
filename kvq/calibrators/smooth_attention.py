"""QServe's SmoothAttention: move post-RoPE key range into the queries.

Per layer, KV head and channel c: lambda_c = max|K_c|^alpha / max|Q_c|^beta over the
calibration tokens (post-RoPE; queries' maximum over the KV head's GQA group), taken
equal within each RoPE pair, because only a scale equal on both coordinates of a pair
commutes with that pair's rotation. Keys are divided by lambda and queries multiplied,
folded into the weights (`kvq.models.smoothing`), so attention is unchanged before
quantization while the per-token key range that INT4 must cover shrinks: the outlier
channels carry most of it.

Sink positions are kept exact by the layout, so they are left out of the statistics: the
first token's keys are often far from the rest and would set every channel's maximum.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvq.calibrators.base import FitContext, PassResult
from kvq.calibrators.capture import capture, run_windows
from kvq.calibrators.options import SmoothAttentionOptions
from kvq.errors import KvqError
from kvq.models.adapters import rope_partners
from kvq.progress import Progress
from kvq.quant.schemes import named_policy

DEFAULT_LAYOUT = "kv4-qserve"


def channel_maxima(
    adapter, windows: Tensor, sink: int, progress: Progress
) -> tuple[list[Tensor], list[Tensor]]:
    """Per layer, max |post-RoPE key| [H_kv, D] and max |post-RoPE query| over each KV head's
    query group [H_kv, D], over windows ([N, L] ids) without their first `sink` tokens."""
    info = adapter.info
    if windows.shape[1] <= sink:
        raise KvqError(f"--seqlen {windows.shape[1]} leaves no tokens after {sink} sink tokens")
    keys: list[Tensor | None] = [None] * info.num_layers
    queries: list[Tensor | None] = [None] * info.num_layers
    group = info.num_q_heads // info.num_kv_heads

    def consume(layer: int, part: str, x: Tensor) -> None:
        # x [B, H, T, D] -> [H_kv, D], running max
        m = x[:, :, sink:].float().abs().amax(dim=(0, 2))
        if part == "query":  # [H_q, D] -> [H_kv, group, D]: the heads reading one KV head
            m = m.view(info.num_kv_heads, group, -1).amax(1)
        store = keys if part == "key" else queries
        store[layer] = m if store[layer] is None else torch.maximum(store[layer], m)

    with (
        progress.stage("capture keys and queries", total=windows.shape[0]) as bar,
        capture(adapter, consume, parts=("key", "query"), key_stage="post-rope"),
    ):
        run_windows(adapter.model, windows, lambda _i: bar.advance())
    return keys, queries


def pair_max(x: Tensor, partners: Tensor) -> Tensor:
    """x [H, D] with each channel and its RoPE partner set to the larger of the two."""
    return torch.maximum(x, x[:, partners.to(x.device)])


def smooth_lambda(
    kmax: Tensor, qmax: Tensor, alpha: float, beta: float, partners: Tensor
) -> Tensor:
    """lambda [H_kv, D] float32 = pair_max(kmax)^alpha / pair_max(qmax)^beta; 1 for a pair
    that never moved (max 0) or whose ratio is not a positive normal float32."""
    k, q = pair_max(kmax.float(), partners), pair_max(qmax.float(), partners)
    lam = k.pow(alpha) / q.pow(beta)
    ok = (k > 0) & (q > 0) & torch.isfinite(lam) & (lam >= torch.finfo(torch.float32).tiny)
    return torch.where(ok, lam, torch.ones_like(lam)).contiguous()


def fit(ctx: FitContext) -> PassResult:
    """The registered `smoothattention` pass: lambdas as `layers.{i}.smooth.lambda`; the
    cache layout is `--layout` (kv4-qserve by default), or the base artifact's."""
    options: SmoothAttentionOptions = ctx.options
    adapter = ctx.loaded.adapter
    adapter.check_qk_scalable()  # before the capture: an unsupported model fails at once
    info = adapter.info
    if options.layout is not None or ctx.base is None:
        policy = named_policy(options.layout or DEFAULT_LAYOUT, info.num_layers, info.head_dim)
    else:
        policy = None  # keep the base artifact's layout (its state checked by the chain)
    layout = policy if policy is not None else ctx.base.policy
    sink = max(layer.sink_tokens for layer in layout.layers)
    kmax, qmax = channel_maxima(adapter, ctx.windows.ids, sink, ctx.progress)
    tensors = {}
    for i in range(info.num_layers):
        rope = info.rope[i]
        partners = rope_partners(info.head_dim, rope.rotary_dim, rope.pairing)
        lam = smooth_lambda(kmax[i], qmax[i], options.alpha, options.beta, partners)
        tensors[f"layers.{i}.smooth.lambda"] = lam
    return PassResult(policy, tensors)


def key_channel_spread(adapter, windows: Tensor, sink: int, progress: Progress) -> list[float]:
    """Per layer: the largest post-RoPE key channel range (max - min over the tokens of
    `windows` after `sink`, per KV head and channel) over the median one. What a per-token
    INT4 step is set by (the widest channel) against what most channels need."""
    n = adapter.info.num_layers
    lo: list[Tensor | None] = [None] * n
    hi: list[Tensor | None] = [None] * n

    def consume(layer: int, part: str, x: Tensor) -> None:
        x = x[:, :, sink:].float()  # [B, H_kv, T, D]
        a, b = x.amin(dim=(0, 2)), x.amax(dim=(0, 2))
        lo[layer] = a if lo[layer] is None else torch.minimum(lo[layer], a)
        hi[layer] = b if hi[layer] is None else torch.maximum(hi[layer], b)

    with (
        progress.stage("capture keys", total=windows.shape[0]) as bar,
        capture(adapter, consume, parts=("key",), key_stage="post-rope"),
    ):
        run_windows(adapter.model, windows, lambda _i: bar.advance())
    spreads = []
    for a, b in zip(lo, hi, strict=True):
        width = (b - a).reshape(-1)
        spreads.append(float(width.max() / width.median()))
    return spreads
