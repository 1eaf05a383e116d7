"""The range and choice checks every pass's options share (one line each, NaN refused)."""

import math

import pytest

from kvq.calibrators.options import (
    IntactKVOptions,
    KVQuantOptions,
    PrefixQuantOptions,
    check_choice,
    check_range,
)
from kvq.errors import KvqError


@pytest.mark.parametrize(
    "args, kwargs, message",
    [
        (("--p", 50.0, 50, 100), {"open_lo": True}, "--p must be in (50, 100], got 50.0"),
        (("--p", 101, 50, 100), {}, "--p must be in [50, 100], got 101"),
        (("--f", 0.5, 0, 0.5), {"open_hi": True}, "--f must be in [0, 0.5), got 0.5"),
        (("--n", -1, 0), {}, "--n must be >= 0, got -1"),
        (("--x", 1.0, 1), {"open_lo": True}, "--x must be > 1, got 1.0"),
        (("--s", 0, 1, 1_000_000), {}, "--s must be in [1, 1000000], got 0"),
        (("--a", math.nan, 0, 1), {}, "--a must be in [0, 1], got nan"),
        (("--b", math.nan, 0), {}, "--b must be >= 0, got nan"),
    ],
)
def test_check_range_refuses_with_one_line(args, kwargs, message):
    with pytest.raises(KvqError) as err:
        check_range(*args, **kwargs)
    assert str(err.value) == message


@pytest.mark.parametrize(
    "args, kwargs",
    [
        (("--p", 100.0, 50, 100), {"open_lo": True}),
        (("--f", 0.0, 0, 0.5), {"open_hi": True}),
        (("--n", 0, 0), {}),
        (("--x", 1.5, 1), {"open_lo": True}),
    ],
)
def test_check_range_accepts_its_bounds(args, kwargs):
    check_range(*args, **kwargs)


def test_check_choice_lists_the_choices():
    check_choice("--bits", 3, (2, 3, 4))
    with pytest.raises(KvqError, match=r"^--bits must be 2, 3 or 4 for x, got 5$"):
        check_choice("--bits", 5, (2, 3, 4), " for x")
    with pytest.raises(KvqError, match=r"^--loss must be mse, got 'l1'$"):
        check_choice("--loss", "l1", ("mse",))


@pytest.mark.parametrize(
    "cls, kwargs, needle",
    [
        (KVQuantOptions, {"outliers": math.nan}, "--outliers must be in [0, 0.5)"),
        (KVQuantOptions, {"sink": -1}, "--sink must be >= 0"),
        (PrefixQuantOptions, {"eta": 1.0}, "--eta (a ratio to the median) must be > 1"),
        (IntactKVOptions, {"lr": 1.0}, "--lr must be in [0, 1)"),
        (IntactKVOptions, {"loss": "l1"}, "--loss must be mse or relative"),
    ],
)
def test_pass_options_use_the_shared_checks(cls, kwargs, needle):
    with pytest.raises(KvqError) as err:
        cls(**kwargs)
    assert needle in str(err.value)
