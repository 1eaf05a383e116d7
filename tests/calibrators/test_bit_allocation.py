"""The exact knapsack behind `--mixed loss`: optimal, within the budget, deterministic."""

import itertools
import random

import pytest

from kvq.calibrators.bit_allocation import choose_widths
from kvq.errors import KvqError


def _brute_force(losses, widths, weights, budget):
    best = None
    for pick in itertools.product(*(range(len(w)) for w in widths)):
        cost = sum(widths[i][j] * weights[i] for i, j in enumerate(pick))
        if cost <= budget:
            loss = sum(losses[i][j] for i, j in enumerate(pick))
            if best is None or loss < best[0] - 1e-12:
                best = (loss, cost)
    return best


@pytest.mark.parametrize("seed", range(12))
def test_the_knapsack_is_exact_against_brute_force(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 6)
    weights = [rng.choice((64, 128, 256)) for _ in range(n)]
    widths = [sorted(rng.sample([1, 2, 3, 4, 8], rng.randint(1, 3))) for _ in range(n)]
    # losses falling with width, as measured ones do, but at uneven rates
    losses = [[rng.random() * 4.0**-b for b in ws] for ws in widths]
    budget = sum(2 * w for w in weights) + rng.choice((0, 64, -64))
    expected = _brute_force(losses, widths, weights, budget)
    if expected is None:
        with pytest.raises(KvqError, match="no allocation fits"):
            choose_widths(losses, widths, weights, budget)
        return
    chosen = choose_widths(losses, widths, weights, budget)
    cost = sum(b * w for b, w in zip(chosen, weights, strict=True))
    loss = sum(losses[i][widths[i].index(b)] for i, b in enumerate(chosen))
    assert cost <= budget
    assert loss == pytest.approx(expected[0], abs=1e-12)


def test_a_side_with_a_huge_loss_takes_bits_from_the_others():
    widths = [(1, 2, 3)] * 6
    losses = [[4.0, 1.0, 0.25]] * 6
    losses[2] = [4000.0, 1000.0, 250.0]
    chosen = choose_widths(losses, widths, [256] * 6, 2 * 256 * 6)
    assert chosen[2] == 3 and sum(chosen) <= 12
    # equal sides and convex losses: nothing pays, the uniform widths stay
    assert choose_widths([[4.0, 1.0, 0.25]] * 4, widths[:4], [256] * 4, 2 * 256 * 4) == [2] * 4


def test_the_total_never_exceeds_the_budget_and_bad_tables_are_refused():
    rng = random.Random(7)
    for _ in range(50):
        losses = [[rng.random() for _ in range(3)] for _ in range(10)]
        chosen = choose_widths(losses, [(2, 3, 4)] * 10, [128] * 10, 3 * 128 * 10)
        assert sum(chosen) <= 30
    with pytest.raises(KvqError, match="not finite"):
        choose_widths([[float("nan"), 1.0]], [(1, 2)], [8], 16)
    with pytest.raises(KvqError, match="as many losses"):
        choose_widths([[1.0]], [(1, 2)], [8], 16)
