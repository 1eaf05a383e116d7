"""Bit widths per layer-side from a table of measured losses: an exact knapsack.

Each layer-side (one layer's keys, or its values) takes one of a few candidate widths;
at width b it costs b bits for each of its `weight` elements (its elements per token)
and adds its measured loss. The allocation minimises the summed loss with the total cost
at most the budget (the uniform policy's): a multiple-choice knapsack, solved exactly by
dynamic programming over the total cost (costs divided by their common factor first, so
that equal-sized sides count widths). A few dozen sides and a handful of widths: at most
a few million steps even for unequal sides. No torch here: the CLI's tests call it freely.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvq.errors import KvqError


def choose_widths(
    losses: Sequence[Sequence[float]],
    widths: Sequence[Sequence[int]],
    weights: Sequence[int],
    budget: int,
) -> list[int]:
    """The width of each side, minimising sum(losses[i][j]) under sum(width * weight) <= budget.

    losses[i][j]: side i's loss at its candidate width widths[i][j]; weights[i]: side i's
    elements per token (> 0); budget: total bits per token. Among equal losses the cheaper
    total wins; the answer is deterministic.
    """
    n = len(losses)
    if not (n == len(widths) == len(weights)):
        raise KvqError("choose_widths: losses, widths and weights differ in length")
    if any(len(a) != len(b) or not a for a, b in zip(losses, widths, strict=True)):
        raise KvqError("choose_widths: every side needs as many losses as candidate widths")
    if any(w <= 0 for w in weights) or any(b <= 0 for ws in widths for b in ws):
        raise KvqError("choose_widths: widths and weights must be positive")
    if any(not math.isfinite(x) for row in losses for x in row):
        raise KvqError("choose_widths: a measured loss is not finite")
    costs = [[b * w for b in ws] for ws, w in zip(widths, weights, strict=True)]
    unit = math.gcd(*(c for row in costs for c in row))
    costs = [[c // unit for c in row] for row in costs]
    cap = budget // unit
    if sum(min(row) for row in costs) > cap:
        raise KvqError(f"no allocation fits {budget} bits per token: the narrowest needs more")
    inf = math.inf
    best = [0.0] + [inf] * cap  # best[c]: least loss of the sides so far at total cost c
    picks: list[list[int]] = []  # picks[i][c]: side i's candidate on the path to best[c]
    for row_loss, row_cost in zip(losses, costs, strict=True):
        nxt, pick = [inf] * (cap + 1), [-1] * (cap + 1)
        for c, base in enumerate(best):
            if base == inf:
                continue
            for j, (loss, cost) in enumerate(zip(row_loss, row_cost, strict=True)):
                t = c + cost
                if t <= cap and base + loss < nxt[t]:
                    nxt[t], pick[t] = base + loss, j
        best = nxt
        picks.append(pick)
    total = min(range(cap + 1), key=lambda c: (best[c], c))
    chosen = []
    for i in range(n - 1, -1, -1):
        j = picks[i][total]
        chosen.append(widths[i][j])
        total -= costs[i][j]
    return chosen[::-1]
