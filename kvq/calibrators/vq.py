"""Vector-codebook KVQuant (`kvq calibrate vq`), with optional mixed precision.

KVQuant's normalisers and exact exceptions (pre-RoPE per-channel keys with calibrated
thresholds, per-row values with round(1% D) exceptions, sink tokens exact), but the dense
codes are indices into a layer codebook over groups of `dim` channels (`kvq.quant.vq`):
keys over RoPE pairs (and pairs of neighbouring pairs), values over neighbouring channels.
Each codebook is a weighted k-means fit whose weights are the diagonal Fisher times the
normaliser's scale squared: the error it minimises is the Fisher-weighted error in the
original units (measured by `bench/lowbit_probe.py` on held-out rows).

Mixed precision, `--mixed fisher`: bits per layer from the Fisher sensitivity, keys' among
the keys and values' among the values. Every layer-side is first fitted at the nominal width
and its Fisher-weighted calibration error e measured; moving one bit from layer v to layer
u of the same side pays when u's error drop, modelled as e_u (1 - 1/4), exceeds v's rise,
e_v (4 - 1). Swaps run until none pays, so each side's code bits equal the uniform
policy's exactly; widths stay within nominal +-1 (1..4 bits), and the changed sides are
refitted. Bits do not move between keys and values: the Fisher-weighted squared error
weighs a key error like a value error, while key errors act through the softmax, and on
Gemma 3 270M moving bits from keys to values made the 2-bit cache worse than uniform
widths (KLD 0.1585 vs 0.1534), where allocating within each side makes it better
(0.1525; README "Low-bit caches").

`--mixed loss` (KVTuner-style) measures instead of modelling: every layer-side is fitted
at each width of nominal - 1 .. nominal + 1 (within 1..4), and the model's KL divergence
from the exact model is measured with that side alone quantized through the runtime cache
(`kvq.calibrators.side_loss`). The widths minimising the summed KL at no more code bits
than the uniform policy's are chosen exactly (`bit_allocation.choose_widths`); since the
loss is the model's own, bits may move between keys and values. The table travels as
provenance (`mixed.kld` [L, 2, W] over `mixed.widths` [W]).

Either way the per-layer widths are the policy's schemes, recorded in the manifest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvq.calibrators.base import FitContext, PassResult
from kvq.calibrators.fisher import fisher_cached
from kvq.calibrators.kvquant import (
    _key_thresholds,
    capture_kv,
    key_fraction,
    spare_layer_bits,
    value_rows,
)
from kvq.calibrators.options import KVQuantOptions, VQOptions
from kvq.calibrators.side_loss import allocate_by_loss
from kvq.errors import KvqError
from kvq.models.adapters import rope_partners
from kvq.progress import Progress
from kvq.quant import nuq, sparse, vq
from kvq.quant.schemes import FULL_PRECISION, CachePolicy, LayerPolicy, QuantScheme

MIN_BITS, MAX_BITS = 1, 4


def vector_dim(bits: int, dim: int) -> int:
    """The group size for `bits` (dim 0: 4 channels up to 2 bits, else 2, so that a
    codebook has at most 256 centroids)."""
    if dim:
        return dim
    return 4 if bits <= 2 else 2


def key_groups(adapter, layer: int, dim: int) -> Tensor:
    """[D / dim, dim]: RoPE pairs of the layer (pairs of neighbouring pairs for dim 4)."""
    info = adapter.info
    rope, d = info.rope[layer], info.head_dim
    partners = rope_partners(d, rope.rotary_dim, rope.pairing)
    pairs = [(c, int(p)) for c, p in enumerate(partners.tolist()) if c < p]
    singles = [c for c, p in enumerate(partners.tolist()) if c == p]
    if singles or len(pairs) * 2 != d:
        return vq.channel_groups(d, dim, pairs=False)
    flat = torch.tensor(pairs)  # [D/2, 2]
    if dim == 2:
        return flat
    return torch.cat([flat[0::2, :1], flat[1::2, :1], flat[0::2, 1:], flat[1::2, 1:]], 1)


@dataclass
class _Side:
    """What one layer-side's fit needs and keeps: normalised rows and weights."""

    xn: Tensor  # [N, H, D] normalised rows
    fit_weight: Tensor  # [N, H, D] weights of the fit (0 at exceptions)
    search_weight: Tensor  # [H, D] static weights of the nearest-centroid search
    groups: Tensor  # [G, m] for the nominal dim
    static: dict[str, Tensor]  # normaliser state (keys) stored beside the codebook


def _key_side(samples: Tensor, fisher: Tensor | None, kv: KVQuantOptions) -> _Side:
    """samples [N, H, D] pre-RoPE keys -> the static normaliser and the fit's inputs."""
    static: dict[str, Tensor] = {}
    if kv.outliers:
        fraction = key_fraction(samples, fisher, kv)
        lower, upper = _key_thresholds(samples, fisher, kv, fraction)
        inlier = ~sparse.threshold_outliers(samples, lower, upper)
        static |= {"lower": lower.contiguous(), "upper": upper.contiguous()}
    else:
        lower, upper = samples.amin(0), samples.amax(0)
        inlier = torch.ones_like(samples, dtype=torch.bool)
    # static: a nearly silent channel's scale is raised to fp16's smallest normal
    scale, center = nuq.normalizer(lower, upper, raise_tiny=False)
    static |= {"scale": scale, "center": center}
    f = torch.ones_like(scale.float()) if fisher is None else fisher.float()
    weight = f * scale.float() ** 2  # [H, D]: error in original units
    xn = nuq.normalize(samples, scale, center)
    return _Side(xn, weight.expand_as(xn) * inlier, weight, torch.empty(0), static)


def _value_side(samples: Tensor, fisher: Tensor | None, kv: KVQuantOptions) -> _Side:
    inlier, scale, center = value_rows(samples, kv.outliers)  # the runtime's normaliser
    f = torch.ones(samples.shape[1:]) if fisher is None else fisher.float()
    xn = nuq.normalize(samples, scale[..., None], center[..., None])
    fit_weight = f * scale.float()[..., None] ** 2 * inlier
    return _Side(xn, fit_weight, f.contiguous(), torch.empty(0), {})


def _fit(side: _Side, groups: Tensor, bits: int, seed: int) -> dict[str, Tensor]:
    m = groups.shape[1]
    vectors = side.xn[..., groups].reshape(-1, m)
    weights = side.fit_weight[..., groups].reshape(-1, m)
    # stored in float16 (and the runtime decodes the stored values); groups in int16
    codebook = vq.fit_codebook(vectors, weights, bits, seed=seed).half()
    return side.static | {
        "vq_codebook": codebook,
        "vq_groups": groups.to(torch.int16).contiguous(),
        "vq_weight": side.search_weight.contiguous(),
    }


def _error(side: _Side, state: dict[str, Tensor], bits: int, rows: int = 4096) -> float:
    """Fisher-weighted error of the fitted codebook on (up to `rows` of) the rows."""
    step = max(1, side.xn.shape[0] // rows)
    xn = side.xn[::step].permute(1, 0, 2)[None]  # [1, H, N', D]
    cb, groups = state["vq_codebook"].float(), state["vq_groups"].long()
    digits = vq.encode(xn, cb, state["vq_weight"], groups, bits)
    rec = vq.decode(digits, cb, groups, bits)
    w = side.fit_weight[::step].permute(1, 0, 2)[None]
    # exceptions carry weight 0; inliers lie within [-1, 1] by the normaliser's construction
    return float((w * (rec - xn).square()).sum())


def allocate_bits(errors: list[float], nominal: int, spare: int = 0) -> list[int]:
    """Widths per side (see the module doc): swaps of one bit while the modelled error falls.
    errors: the Fisher-weighted error of each side at the nominal width; spare: bits (one
    per layer-side) beyond the uniform policy's, each given first where it cuts most
    (negative: bits short of it, each taken first where it costs least)."""
    bits = [nominal] * len(errors)
    lo, hi = max(MIN_BITS, nominal - 1), min(MAX_BITS, nominal + 1)

    def err(i: int, b: int) -> float:
        return errors[i] * 4.0 ** (nominal - b)

    for _ in range(spare):
        ups = [(err(i, b) - err(i, b + 1), i) for i, b in enumerate(bits) if b < hi]
        if not ups:
            break
        bits[max(ups)[1]] += 1
    for _ in range(-spare):  # more exceptions than the budget's: bits come off where cheapest
        downs = [(err(i, b - 1) - err(i, b), i) for i, b in enumerate(bits) if b > lo]
        if not downs:
            break
        bits[min(downs)[1]] -= 1

    for _ in range(4 * len(errors)):
        ups = [(err(i, b) - err(i, b + 1), i) for i, b in enumerate(bits) if b < hi]
        downs = [(err(i, b - 1) - err(i, b), i) for i, b in enumerate(bits) if b > lo]
        if not ups or not downs:
            break
        gain, u = max(ups)
        cost, v = min(downs)
        if u == v or gain <= cost:
            break
        bits[u] += 1
        bits[v] -= 1
    return bits


def _scheme(bits: int, dim: int, side: str, opts: VQOptions) -> QuantScheme:
    if side == "key":
        return QuantScheme(
            format="vq", bits=bits, axis="channel", lifetime="static",
            outlier_fraction=opts.outliers_of("key"), vector_dim=dim,
        )  # fmt: skip
    return QuantScheme(
        format="vq", bits=bits, axis="token", lifetime="dynamic",
        outlier_fraction=opts.value_outliers, vector_dim=dim,
    )  # fmt: skip


def _dim_at(width: int, opts: VQOptions) -> int:
    """The vector dim of a side at `width`: the nominal's, else as `vector_dim` with --dim
    kept only up to 2 bits (a 4-D codebook at 3 bits would have 4096 centroids)."""
    if width == opts.bits:
        return vector_dim(opts.bits, opts.dim)
    return vector_dim(width, opts.dim if width <= 2 else 0)


def _groups(adapter, layer: int, part: str, dim: int) -> Tensor:
    if part == "key":
        return key_groups(adapter, layer, dim)
    return vq.channel_groups(adapter.info.head_dim, dim, False)


def loss_widths(nominal: int) -> tuple[int, ...]:
    """The widths `--mixed loss` measures: nominal - 1 .. nominal + 1 within 1..4."""
    return tuple(range(max(MIN_BITS, nominal - 1), min(MAX_BITS, nominal + 1) + 1))


def calibrate_vq(
    model, adapter, windows: Tensor, opts: VQOptions, progress: Progress,
    fisher: tuple[Tensor, Tensor] | None, name: str | None = None,
) -> tuple[CachePolicy, dict[str, Tensor]]:  # fmt: skip
    """Windows [N, L] ids and optional Fisher sums ([L, H, D] for K and V) -> policy + tensors
    (with `--mixed loss`, the measured table as provenance: `mixed.kld`, `mixed.widths`)."""
    if windows.shape[1] <= opts.sink + 1:
        raise KvqError(
            f"--seqlen {windows.shape[1]} leaves no tokens after {opts.sink} sink tokens"
        )
    kv = KVQuantOptions(bits=max(2, opts.bits), outliers=opts.outliers_of("key"), sink=opts.sink)
    kv_values = KVQuantOptions(bits=kv.bits, outliers=opts.value_outliers, sink=opts.sink)
    # layer-bits each side's budget gains from fewer exceptions (whole layer-sides only)
    spare = spare_layer_bits(adapter, opts)
    keys, values = capture_kv(model, adapter, windows, opts.sink, "pre-rope", progress)
    n_layers = adapter.info.num_layers
    widths_fitted = loss_widths(opts.bits) if opts.mixed == "loss" else (opts.bits,)
    sides: list[tuple[int, str, _Side | None]] = []
    fitted: list[dict[int, dict[str, Tensor]]] = []  # per side: width -> state
    errors: list[float] = []
    total = 2 * n_layers * len(widths_fitted)
    with progress.stage("fit vector codebooks", total=total) as bar:
        for layer in range(n_layers):
            fk = fisher[0][layer] if fisher is not None else None
            fv = fisher[1][layer] if fisher is not None else None
            for part, side in (
                ("key", _key_side(keys[layer].float(), fk, kv)),
                ("value", _value_side(values[layer].float(), fv, kv_values)),
            ):
                states = {}
                for w in widths_fitted:
                    groups = _groups(adapter, layer, part, _dim_at(w, opts))
                    states[w] = _fit(side, groups, w, opts.seed)
                    bar.advance()
                # the Fisher allocator refits the sides it changes: keep their rows
                sides.append((layer, part, side if opts.mixed == "fisher" else None))
                fitted.append(states)
                if opts.mixed == "fisher":
                    errors.append(_error(side, states[opts.bits], opts.bits))
            keys[layer] = values[layer] = torch.empty(0)  # release as we go
    widths = [opts.bits] * len(sides)
    extra: dict[str, Tensor] = {}
    if opts.mixed == "fisher":  # keys' bits among the keys, values' among the values
        for part in ("key", "value"):
            idx = [i for i, (_, p, _) in enumerate(sides) if p == part]
            chosen = allocate_bits([errors[i] for i in idx], opts.bits, spare[part])
            for i, b in zip(idx, chosen, strict=True):
                widths[i] = b
        changed = [i for i, b in enumerate(widths) if b != opts.bits]
        if changed:
            with progress.stage("refit mixed-precision sides", total=len(changed)) as bar:
                for i in changed:
                    layer, part, side = sides[i]
                    groups = _groups(adapter, layer, part, _dim_at(widths[i], opts))
                    fitted[i][widths[i]] = _fit(side, groups, widths[i], opts.seed)
                    bar.advance()
    elif opts.mixed == "loss":

        def scheme_at(_layer: int, part: str, bits: int, state: dict[str, Tensor]) -> QuantScheme:
            return _scheme(bits, state["vq_groups"].shape[1], part, opts)

        template = LayerPolicy(FULL_PRECISION, FULL_PRECISION, "pre-rope", opts.sink)
        widths, extra = allocate_by_loss(
            model, adapter, windows, fitted, scheme_at, template, opts.bits, progress,
            sum(spare.values()) * adapter.info.num_kv_heads * adapter.info.head_dim,
        )  # fmt: skip
    tensors: dict[str, Tensor] = {}
    schemes: dict[tuple[int, str], QuantScheme] = {}
    for (layer, part, _), states, bits in zip(sides, fitted, widths, strict=True):
        state = states[bits]
        m = state["vq_groups"].shape[1]  # [G, m]
        schemes[(layer, part)] = _scheme(bits, m, part, opts)
        for n, t in state.items():
            tensors[f"layers.{layer}.{part}.{n}"] = t.contiguous()
    layers = pre_rope_layers(schemes, n_layers, opts.sink)
    suffix = {"none": "", "fisher": "-mixed", "loss": "-mixed-loss"}[opts.mixed]
    dim = vector_dim(opts.bits, opts.dim)
    return CachePolicy(name or f"vq{opts.bits}-d{dim}{suffix}", layers), tensors | extra


def fisher_sums(ctx: FitContext, sink: int):
    loaded, windows = ctx.loaded, ctx.windows
    info = fisher_cached(
        loaded.model, loaded.adapter, windows.ids, windows.fingerprint,
        ctx.weights_key or loaded.identity.weights_sha256, ctx.progress, exclude_first=sink,
    )  # fmt: skip
    return info


def fit_with(ctx: FitContext, calibrate) -> PassResult:
    """A pass that runs `calibrate` (`calibrate_vq`'s signature) with the Fisher sums when
    its options ask for them (cached per model and windows, stored as provenance)."""
    opts = ctx.options
    fisher, extra = None, {}
    if opts.fisher:
        info = fisher_sums(ctx, opts.sink)
        fisher, extra = (info.key, info.value), info.to_tensors()
    policy, tensors = calibrate(
        ctx.loaded.model, ctx.loaded.adapter, ctx.windows.ids, opts, ctx.progress, fisher
    )
    return PassResult(policy, tensors | extra)


def fit(ctx: FitContext) -> PassResult:
    """The registered `vq` pass."""
    return fit_with(ctx, calibrate_vq)


def pre_rope_layers(schemes: dict[tuple[int, str], QuantScheme], n_layers: int,
                    sink: int) -> tuple[LayerPolicy, ...]:  # fmt: skip
    """Per-layer policies of KVQuant's layout (keys before RoPE, `sink` full-precision
    tokens) from schemes keyed by (layer, "key" | "value")."""
    return tuple(
        LayerPolicy(schemes[(i, "key")], schemes[(i, "value")], "pre-rope", sink_tokens=sink)
        for i in range(n_layers)
    )
