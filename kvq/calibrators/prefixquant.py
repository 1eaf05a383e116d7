"""PrefixQuant: find the tokens that carry token-wise outliers; make them a declared prefix.

Statistic (per calibration window, layer and token): the largest |x| over the channels of
the MLP down-projection input, divided by that window's median of the same quantity. A
token above `eta` is an outlier. Outliers recur on a few token ids (BOS, punctuation, a
newline); served once as a prefix whose K/V the cache holds exactly, those tokens no
longer appear among the user's tokens with extreme activations, so static per-tensor or
per-head scales fit the rest.

How many: the ceiling of the largest per-layer mean outlier count per window (position 0
counted: BOS is the typical first outlier), at most --max-tokens. Which: BOS (or the
model's equivalent) first, then the most frequent outlier token ids at positions > 0.
The rows come from the unquantized model (`prefix_state.extract_prefix`).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import torch
from torch import Tensor

from kvq.calibrators.base import FitContext, PassResult
from kvq.calibrators.capture import run_windows
from kvq.calibrators.options import PrefixQuantOptions
from kvq.calibrators.prefix_state import bos_id, extract_prefix
from kvq.progress import Progress
from kvq.quant.schemes import named_policy
from kvq.runtime.cache import unit_scales

DEFAULT_LAYOUT = "int8"


@dataclass(frozen=True)
class OutlierStats:
    """What the calibration windows showed."""

    ratios: Tensor  # [N, L, T] per window, layer and token: max |x| / window median
    ids: Tensor  # [N, T] the windows' token ids

    def outliers(self, eta: float) -> Tensor:
        return self.ratios > eta  # [N, L, T]

    def mean_count(self, eta: float) -> Tensor:
        """[L] mean outliers per window, per layer."""
        return self.outliers(eta).sum(-1).float().mean(0)

    def top_ratio(self) -> Tensor:
        """[L] the largest ratio seen per layer."""
        return self.ratios.amax(dim=(0, 2))


@torch.no_grad()
def outlier_stats(adapter, windows: Tensor, progress: Progress) -> OutlierStats:
    """Run the windows ([N, T] ids) and measure the down-projection input statistic."""
    n, t = windows.shape
    layers = adapter.info.num_layers
    ratios = torch.zeros(n, layers, t)
    current = {"window": 0}

    def hook_for(layer: int):
        def hook(_module, inputs):
            x = inputs[0].detach()  # [1, T, I]
            top = x.float().abs().amax(-1)[0]  # [T]
            ratios[current["window"], layer] = (top / top.median().clamp_min(1e-12)).cpu()

        return hook

    handles = [
        adapter.mlp_down_site(i).register_forward_pre_hook(hook_for(i)) for i in range(layers)
    ]
    try:
        with progress.stage("capture down-proj inputs", total=n) as bar:

            def advance(i: int) -> None:
                current["window"] = i + 1
                bar.advance()

            run_windows(adapter.model, windows, advance)
    finally:
        for h in handles:
            h.remove()
    return OutlierStats(ratios, windows.cpu())


def choose_tokens(stats: OutlierStats, eta: float, max_tokens: int, bos: int):
    """(prefix token ids, how many the statistic asked for, {token id: outlier count}):
    BOS, then the most frequent outlier ids at positions > 0 (each (window, position)
    counted once, in whichever layers it stands out)."""
    wanted = math.ceil(float(stats.mean_count(eta).max()))
    kept = max(1, min(max_tokens, wanted))
    flagged = stats.outliers(eta).any(1)  # [N, T]
    flagged[:, 0] = False  # position 0 is the sequence's start, whatever its token
    counts = Counter(int(i) for i in stats.ids[flagged].tolist() if int(i) != bos)
    ranked = [tok for tok, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
    return (bos, *ranked[: kept - 1]), wanted, counts


def fit(ctx: FitContext) -> PassResult:
    """The registered `prefixquant` pass: the base's layout (or --layout, default int8)
    with the discovered prefix declared; the manifest's report says what was found."""
    options: PrefixQuantOptions = ctx.options
    loaded = ctx.loaded
    info = loaded.adapter.info
    bos = bos_id(loaded.tokenizer)
    stats = outlier_stats(loaded.adapter, ctx.windows.ids, ctx.progress)
    token_ids, wanted, counts = choose_tokens(stats, options.eta, options.max_tokens, bos)
    with ctx.progress.stage("extract prefix K/V"):
        prefix = extract_prefix(loaded, token_ids, "prefixquant")
    if options.layout is not None or ctx.base is None:
        policy = named_policy(options.layout or DEFAULT_LAYOUT, info.num_layers, info.head_dim)
        tensors = unit_scales(policy)
    else:  # the base's layout and every tensor of its own
        policy = ctx.base.policy
        tensors = ctx.base.policy_tensors()
    tokenizer = loaded.tokenizer
    report = {
        "eta": options.eta,
        "mean_outliers_per_window": tuple(
            round(float(c), 4) for c in stats.mean_count(options.eta)
        ),
        "top_ratio_per_layer": tuple(round(float(r), 2) for r in stats.top_ratio()),
        "tokens_wanted": wanted,
        "token_ids": tuple(str(t) for t in token_ids),
        "token_text": tuple(repr(tokenizer.decode([t])) for t in token_ids),
        "candidate_counts": tuple(
            f"{tok} {tokenizer.decode([tok])!r}: {c}" for tok, c in counts.most_common(8)
        ),
        "why": (
            f"the largest per-layer mean of outliers (ratio > {options.eta:g}) per window is "
            f"{float(stats.mean_count(options.eta).max()):.2f}: {wanted} wanted, "
            f"{len(token_ids)} kept (BOS + the most frequent outlier tokens, "
            f"--max-tokens {options.max_tokens})"
        ),
    }
    return PassResult(policy.with_prefix(prefix.spec), tensors | prefix.tensors(), report)
