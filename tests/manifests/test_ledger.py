"""ByteLedger: totals, per-token figures, summing over layers, strict dict form."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvq.errors import IncompatibleArtifact, KvqError
from kvq.manifests.ledger import CATEGORIES, ByteLedger


def layer(tokens: int = 100, codes: int = 1000, qparams: int = 200) -> ByteLedger:
    # 100 tokens, 1 KV head of dim 64: fp16 K and V = 100 * 64 * 2 * 2 bytes.
    return ByteLedger(
        codes=codes,
        qparams=qparams,
        sparse=0,
        sink=64,
        residual=0,
        full_precision=0,
        tokens=tokens,
        fp16_bytes=tokens * 64 * 2 * 2,
    )


def test_totals_and_ratios():
    ledger = layer()
    assert ledger.total == 1000 + 200 + 64
    assert ledger.bytes_per_token == pytest.approx(12.64)
    assert ledger.fp16_bytes_per_token == 256
    assert ledger.ratio == pytest.approx(1264 / 25600)


def test_sum_over_layers_keeps_tokens():
    total = layer() + layer(codes=10)
    assert total.tokens == 100  # same positions, two layers
    assert total.codes == 1010
    assert total.fp16_bytes == 2 * layer().fp16_bytes
    assert sum([layer(), layer(codes=10)]) == total  # builtin sum starts from 0


def test_zero_token_ledger_adds_bytes_only():
    static_qparams = ByteLedger.zero() + ByteLedger(0, 512, 0, 0, 0, 0, 0, 0)
    total = layer() + static_qparams
    assert total.tokens == 100
    assert total.qparams == 200 + 512
    assert ByteLedger.zero() + layer() == layer()


def test_different_lengths_cannot_be_summed():
    with pytest.raises(KvqError, match="100 and 7 tokens"):
        layer() + layer(tokens=7)


def test_undefined_per_token_figures_are_errors():
    with pytest.raises(KvqError, match="no tokens"):
        _ = ByteLedger.zero().bytes_per_token
    with pytest.raises(KvqError, match="fp16"):
        _ = ByteLedger.zero().ratio


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3"])
def test_counts_must_be_non_negative_ints(bad):
    with pytest.raises(KvqError, match="codes"):
        ByteLedger(bad, 0, 0, 0, 0, 0, 0, 0)


def test_dict_round_trip_and_strict_fields():
    ledger = layer()
    assert ByteLedger.from_dict(ledger.to_dict()) == ledger
    d = ledger.to_dict()
    del d["sink"]
    with pytest.raises(IncompatibleArtifact, match=r"ledger\.sink"):
        ByteLedger.from_dict(d)
    with pytest.raises(IncompatibleArtifact, match=r"ledger\.padding"):
        ByteLedger.from_dict({**ledger.to_dict(), "padding": 3})


counts = st.integers(min_value=0, max_value=10**9)
ledgers = st.builds(
    ByteLedger,
    **{name: counts for name in CATEGORIES},
    tokens=st.sampled_from([0, 50]),
    fp16_bytes=counts,
)


@given(ledgers, ledgers, ledgers)
def test_addition_is_commutative_and_associative(a, b, c):
    assert a + b == b + a
    assert (a + b) + c == a + (b + c)
    assert (a + b).total == a.total + b.total
