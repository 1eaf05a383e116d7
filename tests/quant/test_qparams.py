"""Stored-scale policy: round up, exact 1 for empty rows, refuse overflow/underflow."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvq.errors import KvqError
from kvq.quant.qparams import (
    STORAGE_DTYPES,
    check_finite,
    count_floored,
    storage_dtype,
    store_scale,
)

POSITIVE = st.floats(min_value=2.0**-13, max_value=6e4, allow_nan=False, width=32)


def test_storage_dtype_names():
    assert storage_dtype("float16") is torch.float16
    assert storage_dtype("bfloat16") is torch.bfloat16
    with pytest.raises(KvqError):
        storage_dtype("float64")


@pytest.mark.parametrize("name", list(STORAGE_DTYPES))
@settings(max_examples=50, deadline=None)
@given(values=st.lists(POSITIVE, min_size=1, max_size=16))
def test_store_scale_never_rounds_down(name, values):
    dtype = STORAGE_DTYPES[name]
    ideal = torch.tensor(values, dtype=torch.float32)
    stored = store_scale(ideal, dtype, torch.ones_like(ideal, dtype=torch.bool))
    assert stored.dtype == dtype
    assert bool((stored.float() >= ideal).all())
    # ... and by at most one ulp of the storage dtype: the next value down is below.
    below = torch.nextafter(stored, torch.zeros_like(stored)).float()
    assert bool((below < ideal).all())


def test_store_scale_rounds_up_a_known_value():
    ideal = torch.tensor([1.0 + 2.0**-12])  # between fp16 1.0 and 1.0 + 2^-10
    stored = store_scale(ideal, torch.float16, torch.tensor([True]))
    assert stored.item() == 1.0 + 2.0**-10


def test_store_scale_masked_entries_are_exactly_one():
    ideal = torch.tensor([0.0, 3.0, float("nan"), 1e-30])
    nonzero = torch.tensor([False, True, False, False])
    stored = store_scale(ideal, torch.float16, nonzero)
    assert stored.tolist() == [1.0, 3.0, 1.0, 1.0]


@pytest.mark.parametrize("ideal", [1e-9, 0.0, 3e-5])  # 3e-5 would be an fp16 subnormal
def test_store_scale_underflow(ideal):
    with pytest.raises(KvqError, match="scale underflows float16"):
        store_scale(torch.tensor([ideal]), torch.float16, torch.tensor([True]))


@pytest.mark.parametrize("name", list(STORAGE_DTYPES))
def test_store_scale_floors_a_static_scale_at_the_smallest_normal(name):
    """raise_tiny=False (static, calibrated scales): a scale below the dtype's smallest
    normal is stored as that normal (>= the ideal: nothing clips); others are unchanged."""
    dtype = STORAGE_DTYPES[name]
    tiny = torch.finfo(dtype).tiny
    ideal = torch.tensor([tiny / 1e3, tiny / 2, 0.0, 3.0])
    nonzero = torch.tensor([True, True, True, False])
    stored = store_scale(ideal, dtype, nonzero, raise_tiny=False)
    assert stored.dtype == dtype and stored.tolist() == [tiny, tiny, tiny, 1.0]
    assert count_floored(stored) == 3 and count_floored(torch.ones(2, dtype=dtype)) == 0
    with pytest.raises(KvqError, match="scale underflows"):
        store_scale(ideal, dtype, nonzero)  # live data: refused


def test_store_scale_overflow_and_nan():
    with pytest.raises(KvqError, match="overflows"):
        store_scale(torch.tensor([65505.0]), torch.float16, torch.tensor([True]))
    with pytest.raises(KvqError):
        store_scale(torch.tensor([float("nan")]), torch.float32, torch.tensor([True]))
    with pytest.raises(KvqError):
        store_scale(torch.tensor([-1.0]), torch.float32, torch.tensor([True]))


def test_check_finite():
    check_finite(torch.zeros(3), "x")
    with pytest.raises(KvqError, match="x contains NaN or Inf"):
        check_finite(torch.tensor([1.0, float("inf")]), "x")
