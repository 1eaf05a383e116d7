"""Bit-shift trellis codes: the Viterbi search is exact, decode is the sliding-state gather,
fitted tables beat the best scalar code at equal bits."""

import itertools

import pytest
import torch

from kvq.errors import KvqError
from kvq.quant import trellis


def _cost(x, w, table, digits, bits, window):
    return float((w * (trellis.decode(digits, table, bits, window) - x).square()).sum())


@pytest.mark.parametrize(("bits", "window", "d"), [(2, 4, 5), (1, 3, 7), (3, 6, 3)])
def test_viterbi_finds_the_least_cost_digits_of_every_row(bits, window, d):
    g = torch.Generator().manual_seed(bits)
    table = torch.rand(1 << window, generator=g) * 2 - 1
    x = torch.rand(3, d, generator=g) * 2 - 1
    w = torch.rand(3, d, generator=g)
    digits = trellis.encode(x, w, table, bits, window)
    assert digits.dtype == torch.uint8 and digits.shape == x.shape
    for r in range(3):
        every = torch.tensor(list(itertools.product(range(1 << bits), repeat=d)))
        costs = (w[r] * (trellis.decode(every, table, bits, window) - x[r]).square()).sum(-1)
        found = _cost(x[r], w[r], table, digits[r], bits, window)
        assert found == pytest.approx(float(costs.min()), rel=1e-5, abs=1e-7)


def test_states_are_the_last_window_bits_with_zeros_before_the_row():
    digits = torch.tensor([[1, 2, 3, 0, 1]])
    # 2-bit digits, a 6-bit window: state_i = c_i + 4 c_{i-1} + 16 c_{i-2}
    assert trellis.states(digits, 2, 6).tolist() == [
        [1, 2 + 4, 3 + 8 + 16, 0 + 12 + 32, 1 + 0 + 48]
    ]
    table = torch.arange(64.0)
    assert torch.equal(trellis.decode(digits, table, 2, 6), trellis.states(digits, 2, 6).float())


def test_zero_weights_leave_a_coordinate_free():
    g = torch.Generator().manual_seed(0)
    table = torch.rand(256, generator=g) * 2 - 1
    x = torch.rand(4, 32, generator=g) * 2 - 1
    w = torch.ones_like(x)
    free = w.clone()
    free[:, ::3] = 0  # e.g. exact exceptions: any level will do there
    tight = _cost(x, w, table, trellis.encode(x, w, table, 2, 8), 2, 8)
    loose = _cost(x, free, table, trellis.encode(x, free, table, 2, 8), 2, 8)
    assert loose < tight


def test_fitted_tables_beat_lloyd_max_at_equal_bits_on_gaussian_rows():
    """Lloyd-Max on a unit Gaussian leaves 0.1175 (2 bits) / 0.0345 (3 bits) of the
    variance; a 10-bit trellis fitted here leaves about 0.08 / 0.024 (QTIP's 16-bit
    window: 0.069 at 2 bits)."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(700, 64, generator=g) / 4).clamp(-1, 1)
    w = torch.ones_like(x)
    for bits, lloyd_max in ((2, 0.1175), (3, 0.0345)):
        window = 9 if bits == 3 else 10
        table = trellis.fit_table(x[:500], w[:500], bits, window=window, iters=6)
        rec = trellis.decode(
            trellis.encode(x[500:], w[500:], table, bits, window), table, bits, window
        )
        rel = float((rec - x[500:]).square().mean() / x.var())
        assert rel < 0.8 * lloyd_max, (bits, rel)


def test_table_fit_is_deterministic_and_refuses_what_it_cannot_fit():
    g = torch.Generator().manual_seed(1)
    x = torch.rand(50, 16, generator=g) * 2 - 1
    w = torch.ones_like(x)
    a = trellis.fit_table(x, w, 2, window=6, iters=2, seed=3)
    assert torch.equal(a, trellis.fit_table(x, w, 2, window=6, iters=2, seed=3))
    assert a.shape == (64,) and torch.isfinite(a).all()
    with pytest.raises(KvqError, match="no calibration rows"):
        trellis.fit_table(x, torch.zeros_like(w), 2, window=6)
    with pytest.raises(KvqError, match="multiple of the 3 digit bits"):
        trellis.check_window(3, 8)
    with pytest.raises(KvqError, match="1-4 bits"):
        trellis.check_window(5, 10)
    with pytest.raises(KvqError, match=r"expected shape \[64\]"):
        trellis.check_table(torch.zeros(32), 6, "layers.0.key")
    with pytest.raises(KvqError, match="NaN or Inf"):
        trellis.check_table(torch.full((64,), float("nan")), 6, "layers.0.key")


def test_the_search_for_a_few_rows_equals_the_one_for_many(monkeypatch):
    g = torch.Generator().manual_seed(5)
    table = torch.rand(1 << 9, generator=g) * 2 - 1
    x = torch.rand(5, 40, generator=g) * 2 - 1
    w = torch.rand(5, 40, generator=g)
    few = trellis.encode(x, w, table, 3, 9)  # 5 rows: the few-rows search
    monkeypatch.setattr(trellis, "_FEW_ROWS", 0)
    assert torch.equal(few, trellis.encode(x, w, table, 3, 9))
