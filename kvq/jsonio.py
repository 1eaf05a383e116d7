"""Strict JSON reading for text kvq did not write itself (manifests, JSONL datasets).

`json.loads` accepts NaN and Infinity, turns 1e999 into inf, raises a bare ValueError for
an integer of more than 4300 digits and a RecursionError for deeply nested arrays. Here
each of those is one `ValueError` with a readable reason, for the caller to name the file.
"""

from __future__ import annotations

import json
import math
from typing import Any


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:20]} does not fit a 64-bit float")
    return value


def _constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def strict_loads(text: str) -> Any:
    """Parse JSON text; ValueError (one line) for anything not plain, finite JSON."""
    try:
        return json.loads(text, parse_float=_finite, parse_constant=_constant)
    except RecursionError:
        raise ValueError("nested too deeply") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{e.msg} at line {e.lineno} column {e.colno}") from None
    except ValueError as e:  # e.g. an integer of more than 4300 digits
        raise ValueError(str(e).split(";")[0].split("\n")[0]) from None
