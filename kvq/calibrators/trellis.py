"""Trellis-coded KVQuant (`kvq calibrate trellis`), with optional mixed precision.

KVQuant's normalisers and exact exceptions (pre-RoPE per-channel keys with calibrated
thresholds, per-row values with round(fraction D) exceptions, sink tokens exact), as in
`kvq calibrate vq`, but the dense codes are bit-shift trellis codes (`kvq.quant.trellis`):
one `bits`-bit digit per element, each element decoded from a `window`-bit sliding state
through a table of 2^window levels, found by a Viterbi search at every append. At equal
code bits it removes 35-40% of a Lloyd-Max scalar code's squared error on near-Gaussian
rows (QTIP's figures; `tests/quant/test_trellis.py` checks it on Gaussian rows), where
the measured loss of a kvq cache is proportional to that error (README "Low-bit caches").

Tables are weighted Lloyd fits (Viterbi encode, then each state's weighted mean), with the
weights of `kvq calibrate vq`: the diagonal Fisher times the normaliser's scale squared,
so the error they minimise is the Fisher-weighted error in the original units.
`--tables shared` fits one table per side (keys, values) and width on rows pooled from
every layer: 2^window fp16 levels each (8 KB at the default window of 12), stored with
every layer that uses it and held once by the cache; `--tables layer` fits one per
layer-side.

`--mixed fisher`: bits per layer within each side from the Fisher-weighted error at the
nominal width, as `kvq calibrate vq` allocates them (`vq.allocate_bits`: the error
modelled as falling 4x per bit), widths within nominal +-1, the sides' code bits equal to
the uniform policy's (plus the bits fewer exceptions free).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from kvq.calibrators.base import FitContext, PassResult
from kvq.calibrators.kvquant import capture_kv, spare_bits
from kvq.calibrators.options import KVQuantOptions, TrellisOptions
from kvq.calibrators.vq import (
    _key_side,
    _Side,
    _value_side,
    allocate_bits,
    fit_with,
    pre_rope_layers,
)
from kvq.errors import KvqError
from kvq.progress import Progress
from kvq.quant import trellis
from kvq.quant.schemes import CachePolicy, QuantScheme

POOLED_ROWS = 4096  # rows of a table's fit (pooled over layers for shared tables)
ERROR_ROWS = 512  # rows of a side on which --mixed fisher measures its error


def _rows(side: _Side, count: int, seed: int) -> tuple[Tensor, Tensor]:
    """Up to `count` of the side's rows: normalised values and fit weights, [n, D] each."""
    x = side.xn.reshape(-1, side.xn.shape[-1])  # [N * H, D]
    w = side.fit_weight.reshape(-1, side.xn.shape[-1])
    if x.shape[0] > count:
        pick = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(seed))[:count]
        x, w = x[pick], w[pick]
    return x, w


def _fit_table(sides: list[_Side], bits: int, opts: TrellisOptions, seed: int) -> Tensor:
    """One table for `sides` (rows pooled evenly), stored in float16."""
    per = max(1, POOLED_ROWS // len(sides))
    pooled = [_rows(s, per, seed + i) for i, s in enumerate(sides)]
    x, w = torch.cat([p[0] for p in pooled]), torch.cat([p[1] for p in pooled])
    table = trellis.fit_table(x, w, bits, opts.window, seed=seed, max_rows=POOLED_ROWS)
    return table.half()


def _error(side: _Side, table: Tensor, bits: int, window: int) -> float:
    """Fisher-weighted squared error of `table` on up to ERROR_ROWS of the side's rows."""
    step = max(1, side.xn.shape[0] // ERROR_ROWS)
    xn, w = side.xn[::step], side.fit_weight[::step]  # [n, H, D]
    search = side.search_weight * (w > 0)  # exact exceptions are free, as in the codecs
    digits = trellis.encode(xn.clamp(-1, 1), search, table, bits, window)
    return float((w * (trellis.decode(digits, table, bits, window) - xn).square()).sum())


def static_bytes(opts: TrellisOptions, adapter) -> int:
    """Bytes of one side's state beyond a scalar NUQ side's: its tables (for `--tables
    width`, one per width it may take) and the fp16 search weights of every layer."""
    info = adapter.info
    tables = {"shared": 1, "width": len(opts.widths()), "layer": info.num_layers}[opts.tables]
    weights = info.num_layers * info.num_kv_heads * info.head_dim
    return 2 * (tables * (1 << opts.window) + weights)


def spare_layer_bits(opts: TrellisOptions, adapter, tokens: int, progress) -> dict[str, int]:
    """Whole layer-bits per side beyond the uniform policy's: what fewer exceptions free,
    less the static state charged over `tokens` positions (one layer-bit: H D tokens / 8
    bytes), so that at that context the cache stores no more bytes than scalar NUQ's."""
    info = adapter.info
    charge = 0.0
    if tokens:
        charge = static_bytes(opts, adapter) / (info.num_kv_heads * info.head_dim * tokens / 8)
        kb = static_bytes(opts, adapter) / 1024
        with progress.stage(f"static state {kb:.0f} KB per side = {charge:.2f} layer-bits"):
            pass  # the stage is the report
    spare = {
        part: math.floor(info.num_layers * spare_bits(info.head_dim, opts, part) - charge + 1e-9)
        for part in ("key", "value")
    }
    can_give = info.num_layers * (opts.bits - min(opts.widths()))
    short = min(spare.values())
    if -short > can_give:
        raise KvqError(
            f"the trellis tables and search weights ({static_bytes(opts, adapter) / 1024:.1f} "
            f"KB per side) cost {charge:.1f} layer-bits at {tokens} tokens, and the layers "
            f"can give up {can_give}; raise --static-tokens (the context to compare bytes "
            "at), or set it to 0 to count code bits only"
        )
    return spare


def _stored_weight(weight: Tensor) -> Tensor:
    """[H, D] search weights in fp16, scaled to a maximum of 1: the search's argmin does not
    depend on the scale, and unscaled Fisher sums (often far below 1) would flush to zero."""
    return (weight / weight.max().clamp_min(1e-30)).half().contiguous()


def _scheme(bits: int, part: str, opts: TrellisOptions) -> QuantScheme:
    if part == "key":
        return QuantScheme(
            format="trellis", bits=bits, axis="channel", lifetime="static",
            outlier_fraction=opts.outliers_of("key"), window=opts.window,
        )  # fmt: skip
    return QuantScheme(
        format="trellis", bits=bits, axis="token", lifetime="dynamic",
        outlier_fraction=opts.value_outliers, window=opts.window,
    )  # fmt: skip


class _Tables:
    """Tables by (layer, part, width), fitted on first use (`--tables`): one per part for
    every layer and width ("shared", fitted at --bits), per part and width ("width"), or
    per layer, part and width ("layer")."""

    def __init__(self, sides: dict[tuple[int, str], _Side], opts: TrellisOptions, progress):
        self.sides, self.opts, self.progress = sides, opts, progress
        self.fitted: dict[tuple, Tensor] = {}

    def get(self, layer: int, part: str, bits: int) -> Tensor:
        mode = self.opts.tables
        fit_bits = self.opts.bits if mode == "shared" else bits
        key = (layer, part, bits) if mode == "layer" else (part, fit_bits)
        if key not in self.fitted:
            if mode == "layer":
                sides, what = [self.sides[(layer, part)]], f"layer {layer} {part}s"
            else:
                sides, what = [s for (_, p), s in self.sides.items() if p == part], f"{part}s"
            with self.progress.stage(f"fit the {fit_bits}-bit trellis table of the {what}"):
                self.fitted[key] = _fit_table(
                    sides, fit_bits, self.opts,
                    self.opts.seed + 7919 * fit_bits + (layer + 1) * (mode == "layer"),
                )  # fmt: skip
        return self.fitted[key]


def calibrate_trellis(
    model, adapter, windows: Tensor, opts: TrellisOptions, progress: Progress,
    fisher: tuple[Tensor, Tensor] | None, name: str | None = None,
) -> tuple[CachePolicy, dict[str, Tensor]]:  # fmt: skip
    """Windows [N, L] ids and optional Fisher sums ([L, H, D] for K and V) -> policy and
    tensors."""
    if windows.shape[1] <= opts.sink + 1:
        raise KvqError(
            f"--seqlen {windows.shape[1]} leaves no tokens after {opts.sink} sink tokens"
        )
    kv = KVQuantOptions(bits=max(2, opts.bits), outliers=opts.outliers_of("key"), sink=opts.sink)
    kv_values = KVQuantOptions(bits=kv.bits, outliers=opts.value_outliers, sink=opts.sink)
    tokens = windows.shape[1] if opts.static_tokens is None else opts.static_tokens
    spare = spare_layer_bits(opts, adapter, tokens if opts.mixed == "fisher" else 0, progress)
    keys, values = capture_kv(model, adapter, windows, opts.sink, "pre-rope", progress)
    n_layers = adapter.info.num_layers
    sides: dict[tuple[int, str], _Side] = {}
    for layer in range(n_layers):
        fk = fisher[0][layer] if fisher is not None else None
        fv = fisher[1][layer] if fisher is not None else None
        sides[(layer, "key")] = _key_side(keys[layer].float(), fk, kv)
        sides[(layer, "value")] = _value_side(values[layer].float(), fv, kv_values)
        keys[layer] = values[layer] = torch.empty(0)  # release as we go
    tables = _Tables(sides, opts, progress)
    widths = dict.fromkeys(sides, opts.bits)
    if opts.mixed == "fisher":  # keys' bits among the keys, values' among the values
        errors = {}
        with progress.stage("measure each layer-side's error", total=len(sides)) as bar:
            for (layer, part), side in sides.items():
                table = tables.get(layer, part, opts.bits)
                errors[(layer, part)] = _error(side, table, opts.bits, opts.window)
                bar.advance()
        for part in ("key", "value"):
            mine = [k for k in sides if k[1] == part]
            chosen = allocate_bits([errors[k] for k in mine], opts.bits, spare[part])
            widths.update(zip(mine, chosen, strict=True))
    tensors: dict[str, Tensor] = {}
    schemes: dict[tuple[int, str], QuantScheme] = {}
    for (layer, part), side in sides.items():
        bits = widths[(layer, part)]
        schemes[(layer, part)] = _scheme(bits, part, opts)
        state = side.static | {
            "trellis_table": tables.get(layer, part, bits),
            "trellis_weight": _stored_weight(side.search_weight),
        }
        for n, t in state.items():
            tensors[f"layers.{layer}.{part}.{n}"] = t.contiguous()
    layers = pre_rope_layers(schemes, n_layers, opts.sink)
    suffix = "-mixed" if opts.mixed == "fisher" else ""
    default = f"trellis{opts.bits}-w{opts.window}-{opts.tables}{suffix}"
    return CachePolicy(name or default, layers), tensors


def fit(ctx: FitContext) -> PassResult:
    """The registered `trellis` pass."""
    return fit_with(ctx, calibrate_trellis)
