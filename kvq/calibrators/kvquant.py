"""KVQuant: pre-RoPE per-channel keys, per-token values, Fisher-weighted NUQ codebooks,
dense-and-sparse outliers and attention-sink tokens (article 0x07–0x07F).

Offline, per layer:
- keys: per (KV head, channel) outlier thresholds, and a normaliser mapping the
  inlier range onto the codebook's [-1, 1] domain; fixed for every request
  (article 0x05A, design 2). The declared fraction is the budget: with Fisher
  sums it goes to the (channel, tail)s whose Fisher-weighted squared range it
  shrinks most (`sparse.allocated_thresholds`; zero-sensitivity channels get
  none), else the same quantile in every tail (the paper). The fraction is
  first scaled so that the outlier rate on held-out text (the second half of
  the calibration windows, thresholds fitted on the first) is the declared one:
  unseen text flags more outliers than the text the thresholds were fitted on,
  and every outlier costs index + fp16 value. Thresholds are stored in fp16,
  rounded outwards;
- values: nothing per channel — each row gets its own normaliser and
  round(fraction * D) outliers at append time, taken from whichever end of the
  row shrinks its range more — except the layer's codebook;
- one codebook of 2^bits levels for K and one for V: k-means over the
  normalised calibration inliers, each value weighted by the Fisher
  sensitivity of its (head, channel) (plain k-means with fisher off).
Sink positions are excluded from every statistic: the runtime keeps them exact.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch import Tensor

from kvq.calibrators.base import FitContext, PassResult
from kvq.calibrators.capture import capture, run_windows
from kvq.calibrators.fisher import fisher_cached
from kvq.calibrators.options import KVQuantOptions  # noqa: F401 (re-exported)
from kvq.calibrators.side_loss import allocate_by_loss
from kvq.errors import KvqError
from kvq.progress import Progress
from kvq.quant import nuq, sparse
from kvq.quant.schemes import FULL_PRECISION, CachePolicy, LayerPolicy, QuantScheme
from kvq.runtime.codecs.nuq import SPARSE_DTYPE, VALUE_SPLIT, _index_dtype


def capture_kv(
    model, adapter, windows: Tensor, sink: int, key_stage: str, progress: Progress
) -> tuple[list[Tensor], list[Tensor]]:
    """Per layer K and V samples [N*(L - sink), H_kv, D] of the calibration windows."""
    n_layers = adapter.info.num_layers
    parts: dict[str, list[list[Tensor]]] = {
        "key": [[] for _ in range(n_layers)],
        "value": [[] for _ in range(n_layers)],
    }

    def consume(layer: int, part: str, x: Tensor) -> None:
        x = x[:, :, sink:].float()  # [B, H, T', D]: sink rows never shape the statistics
        parts[part][layer].append(x.permute(0, 2, 1, 3).reshape(-1, x.shape[1], x.shape[3]))

    with (
        progress.stage("capture K/V", total=windows.shape[0]) as bar,
        capture(adapter, consume, parts=("key", "value"), key_stage=key_stage),
    ):
        run_windows(model, windows, lambda _i: bar.advance())
    keys = [torch.cat(xs) for xs in parts["key"]]
    values = [torch.cat(xs) for xs in parts["value"]]
    return keys, values


def _codebook(values: Tensor, weights: Tensor | None, opts: KVQuantOptions, bits: int) -> Tensor:
    if not opts.nonuniform:
        return nuq.uniform_codebook(bits)
    return nuq.fit_codebook(values, bits, weights, seed=opts.seed, max_samples=opts.max_samples)


def _qnorm_levels(values: Tensor, codebook: Tensor) -> Tensor:
    """Levels whose decoded population has the mean and std of the originals (Q-Norm)."""
    decoded = nuq.nuq_decode(nuq.nuq_encode(values, codebook), codebook)
    mu, sd = values.mean(), values.std()
    mu_d, sd_d = decoded.mean(), decoded.std().clamp_min(1e-12)
    return ((codebook - mu_d) * (sd / sd_d) + mu).float()


def _levels(
    normed: Tensor, inlier: Tensor, fisher: Tensor | None, opts: KVQuantOptions, bits: int
) -> dict[str, Tensor]:
    """Codebook (and Q-Norm levels) over normalised inliers [N, H, D], Fisher [H, D] weighted."""
    values = normed[inlier]
    weights = fisher.expand_as(normed)[inlier] if fisher is not None else None
    out = {"codebook": _codebook(values, weights, opts, bits)}
    if opts.qnorm:
        out["qnorm_levels"] = _qnorm_levels(values, out["codebook"])
    return out


def _outward_fp16(lower: Tensor, upper: Tensor) -> tuple[Tensor, Tensor]:
    """Thresholds stored in fp16, rounded outwards so no calibration inlier becomes an outlier."""
    lo, hi = lower.half(), upper.half()
    lo = torch.where(lo.float() > lower.float(), torch.nextafter(lo, lo.new_tensor(-65504.0)), lo)
    hi = torch.where(hi.float() < upper.float(), torch.nextafter(hi, hi.new_tensor(65504.0)), hi)
    return lo, hi


def _key_thresholds(
    samples: Tensor, fisher: Tensor | None, opts: KVQuantOptions, fraction: float
) -> tuple[Tensor, Tensor]:
    if fisher is not None and opts.key_outliers == "fisher":
        lower, upper = sparse.allocated_thresholds(samples, fisher, fraction)
    else:
        lower, upper = sparse.channel_thresholds(samples, fraction)
    return _outward_fp16(lower, upper)


def key_fraction(samples: Tensor, fisher: Tensor | None, opts: KVQuantOptions) -> float:
    """The K threshold fraction whose expected outlier rate on unseen text is `opts.outliers`.

    samples [N, H, D] in window order: thresholds fitted on the first half flag a rate
    r of the second half; the fraction is outliers * outliers / r, within
    [outliers / 4, outliers]. Too few samples to split: `opts.outliers`.
    """
    n = samples.shape[0] // 2
    k, _ = sparse.tail_counts(max(n, 1), opts.outliers)
    if n <= 2 * k + 1 or k == 0:
        return opts.outliers
    lower, upper = _key_thresholds(samples[:n], fisher, opts, opts.outliers)
    rate = float(
        sparse.threshold_outliers(samples[n:], lower.float(), upper.float()).float().mean()
    )
    if rate <= opts.outliers:
        return opts.outliers
    return max(opts.outliers / 4, opts.outliers * opts.outliers / rate)


def fit_key_layer(
    samples: Tensor, fisher: Tensor | None, opts: KVQuantOptions
) -> dict[str, Tensor]:
    """samples [N, H, D] pre-RoPE keys, fisher [H, D] or None -> the layer's static key tensors."""
    return fit_key_widths(samples, fisher, opts, (opts.bits,))[opts.bits]


def fit_key_widths(
    samples: Tensor, fisher: Tensor | None, opts: KVQuantOptions, widths: tuple[int, ...]
) -> dict[int, dict[str, Tensor]]:
    """`fit_key_layer` at each of `widths`: one normaliser (and outlier thresholds), a
    codebook per width."""
    static: dict[str, Tensor] = {}
    opts = replace(opts, outliers=opts.outliers_of("key"), k_outliers=None)  # keys' own
    if opts.outliers:
        fraction = key_fraction(samples, fisher, opts) if opts.key_heldout else opts.outliers
        lower, upper = _key_thresholds(samples, fisher, opts, fraction)
        inlier = ~sparse.threshold_outliers(samples, lower, upper)
        static |= {"lower": lower.contiguous(), "upper": upper.contiguous()}
    else:
        lower, upper = samples.amin(0), samples.amax(0)
        inlier = torch.ones_like(samples, dtype=torch.bool)
    # static: a nearly silent channel's scale is raised to fp16's smallest normal
    scale, center = nuq.normalizer(lower, upper, raise_tiny=False)
    normed = nuq.normalize(samples, scale, center)
    static |= {"scale": scale, "center": center}
    return {w: _levels(normed, inlier, fisher, opts, w) | static for w in widths}


def value_rows(samples: Tensor, outliers: float) -> tuple[Tensor, Tensor, Tensor]:
    """samples [N, H, D] values -> inlier mask [N, H, D] and the per-row normaliser
    (scale, center) [N, H]: the same one the runtime computes at append time."""
    if outliers:
        idx, _, lo, hi = sparse.row_outliers(samples, outliers, VALUE_SPLIT)
        inlier = torch.ones_like(samples, dtype=torch.bool).scatter(-1, idx.long(), False)
    else:
        lo, hi = samples.amin(-1), samples.amax(-1)
        inlier = torch.ones_like(samples, dtype=torch.bool)
    scale, center = nuq.normalizer(lo, hi, raise_tiny=False)  # live rows: see store_scale
    return inlier, scale, center


def fit_value_layer(
    samples: Tensor, fisher: Tensor | None, opts: KVQuantOptions
) -> dict[str, Tensor]:
    """samples [N, H, D] values, fisher [H, D] or None -> the layer's codebook (rows are online)."""
    return fit_value_widths(samples, fisher, opts, (opts.bits,))[opts.bits]


def fit_value_widths(
    samples: Tensor, fisher: Tensor | None, opts: KVQuantOptions, widths: tuple[int, ...]
) -> dict[int, dict[str, Tensor]]:
    """`fit_value_layer` at each of `widths`."""
    inlier, scale, center = value_rows(samples, opts.value_outliers)
    normed = nuq.normalize(samples, scale[..., None], center[..., None])
    return {w: _levels(normed, inlier, fisher, opts, w) for w in widths}


def loss_widths(nominal: int) -> tuple[int, ...]:
    """The widths `--mixed loss` measures: the NUQ widths next to `nominal` (none below 2
    bits; at 4 bits the next is 8, which costs what four sides dropping to 3 bits save)."""
    return {3: (2, 3, 4), 4: (3, 4, 8)}[nominal]


def _scheme(opts: KVQuantOptions, part: str, bits: int) -> QuantScheme:
    axis, lifetime = ("channel", "static") if part == "key" else ("token", "dynamic")
    fraction = opts.outliers_of(part)
    return QuantScheme(format="nuq", bits=bits, axis=axis, lifetime=lifetime,
                       outlier_fraction=fraction, qnorm=opts.qnorm)  # fmt: skip


def exception_bits(head_dim: int, fraction: float, part: str) -> float:
    """Stored bits per element of a side's exact exceptions at `fraction`: an index and an
    fp16 value per entry; values take a fixed number of slots per row (`NuqValueCodec`),
    keys a variable number, expected `fraction` of them, plus a count byte per row."""
    if not fraction:
        return 0.0
    entry = 8 * torch.empty(0, dtype=_index_dtype(head_dim)).element_size()
    entry += 8 * SPARSE_DTYPE.itemsize
    if part == "key":
        return fraction * entry + 8 / head_dim
    return sparse.range_count(head_dim, fraction) * entry / head_dim


def spare_bits(head_dim: int, opts, part: str) -> float:
    """Bits per element of `part` that fewer exceptions than `--outliers` free
    (`--k-outliers`, `--v-outliers`); the uniform policy's budget counts `--outliers`."""
    nominal = exception_bits(head_dim, opts.outliers, part)
    return nominal - exception_bits(head_dim, opts.outliers_of(part), part)


def spare_layer_bits(adapter, opts) -> dict[str, int]:
    """Whole layer-bits per side that `spare_bits` buys over the model's layers."""
    n, d = adapter.info.num_layers, adapter.info.head_dim
    # floor: a side with more exceptions than --outliers gives up whole layer-bits
    return {part: math.floor(n * spare_bits(d, opts, part) + 1e-9) for part in ("key", "value")}


def kvquant_policy(
    num_layers: int, opts: KVQuantOptions, widths: list[int] | None = None
) -> CachePolicy:
    """widths: per layer-side, layer-major (keys then values), else `opts.bits` everywhere."""
    widths = widths or [opts.bits] * (2 * num_layers)
    layers = tuple(
        LayerPolicy(
            key=_scheme(opts, "key", widths[2 * i]),
            value=_scheme(opts, "value", widths[2 * i + 1]),
            key_stage=opts.key_stage,
            sink_tokens=opts.sink,
        )
        for i in range(num_layers)
    )
    suffix = "-mixed-loss" if opts.mixed == "loss" else ""
    return CachePolicy(name=f"kvquant-nuq{opts.bits}{suffix}", layers=layers)


def calibrate_kvquant(
    model,
    adapter,
    windows: Tensor,
    opts: KVQuantOptions,
    progress: Progress,
    fisher: tuple[Tensor, Tensor] | None,
) -> tuple[CachePolicy, dict[str, Tensor]]:
    """Windows [N, L] ids and optional Fisher sums ([L, H, D] for K and V) -> policy + tensors."""
    if windows.shape[1] <= opts.sink + 1:
        raise KvqError(
            f"--seqlen {windows.shape[1]} leaves no tokens after {opts.sink} sink tokens"
        )
    keys, values = capture_kv(model, adapter, windows, opts.sink, opts.key_stage, progress)
    n_layers = adapter.info.num_layers
    fit_widths = loss_widths(opts.bits) if opts.mixed == "loss" else (opts.bits,)
    fitted: list[dict[int, dict[str, Tensor]]] = []  # per side, layer-major: width -> state
    with progress.stage("fit codebooks", total=n_layers) as bar:
        for layer in range(n_layers):
            fk = fisher[0][layer] if fisher is not None else None
            fv = fisher[1][layer] if fisher is not None else None
            fitted.append(fit_key_widths(keys[layer], fk, opts, fit_widths))
            fitted.append(fit_value_widths(values[layer], fv, opts, fit_widths))
            keys[layer] = values[layer] = torch.empty(0)  # release as we go
            bar.advance()
    widths = [opts.bits] * len(fitted)
    extra: dict[str, Tensor] = {}
    if opts.mixed == "loss":
        template = LayerPolicy(FULL_PRECISION, FULL_PRECISION, opts.key_stage, opts.sink)
        widths, extra = allocate_by_loss(
            model, adapter, windows, fitted,
            lambda _layer, part, bits, _state: _scheme(opts, part, bits),
            template, opts.bits, progress,
            sum(spare_layer_bits(adapter, opts).values())
            * adapter.info.num_kv_heads * adapter.info.head_dim,
        )  # fmt: skip
    tensors: dict[str, Tensor] = {}
    for i, (states, bits) in enumerate(zip(fitted, widths, strict=True)):
        layer, part = divmod(i, 2)
        for name, t in states[bits].items():
            tensors[f"layers.{layer}.{('key', 'value')[part]}.{name}"] = t.contiguous()
    return kvquant_policy(n_layers, opts, widths), tensors | extra


def fit(ctx: FitContext) -> PassResult:
    """The registered `kvquant` pass: Fisher sums (cached per model state and windows) weight
    the codebooks and are stored as provenance."""
    opts, loaded, windows = ctx.options, ctx.loaded, ctx.windows
    fisher = None
    extra: dict[str, Tensor] = {}
    if opts.fisher:
        info = fisher_cached(
            loaded.model,
            loaded.adapter,
            windows.ids,
            windows.fingerprint,
            ctx.weights_key or loaded.identity.weights_sha256,
            ctx.progress,
            exclude_first=opts.sink,
        )
        fisher = (info.key, info.value)
        extra = info.to_tensors()  # provenance: the sensitivities the codebooks used
    policy, tensors = calibrate_kvquant(
        loaded.model, loaded.adapter, windows.ids, opts, ctx.progress, fisher
    )
    return PassResult(policy, tensors | extra)
