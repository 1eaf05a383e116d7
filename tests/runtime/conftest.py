"""Shared by the runtime tests: the interpreted Triton decode kernel, checked call by call."""

from __future__ import annotations

import pytest


@pytest.fixture
def triton_decode_diffs(monkeypatch) -> list:
    """Run the Triton decode kernel interpreted and compare every call with the torch
    reference on the same inputs: the max |Triton - reference| of each call, appended as
    the test decodes."""
    from kvq.runtime.kernels.decode import attention as da

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kernel, diffs = da.decode_attention_triton, []

    def checked(query, segments, **kw):
        out = kernel(query, segments, **kw)
        kw.pop("path", None)  # the kernel's route, not an argument of the reference
        diffs.append((out - da.decode_attention_reference(query, segments, **kw)).abs().max())
        return out

    monkeypatch.setattr(da, "decode_attention_triton", checked)
    return diffs
