"""Shared by the kernel tests: spies on the planned decode path."""

from __future__ import annotations

import pytest


@pytest.fixture
def planned_calls(monkeypatch) -> list:
    """The calls that took the planned path (`run_planned`'s positional arguments)."""
    from kvq.runtime.kernels.decode import planned as planned_decode

    calls, run = [], planned_decode.run_planned

    def spy(*args, **kwargs):
        calls.append(args)
        return run(*args, **kwargs)

    monkeypatch.setattr(planned_decode, "run_planned", spy)
    return calls


@pytest.fixture
def paths(monkeypatch) -> list:
    """The route (`triton_path`: planned or general kernel) of each Triton decode call."""
    from kvq.runtime.kernels.decode import attention

    routes, route = [], attention.triton_path

    def spy(*args):
        routes.append(route(*args))
        return routes[-1]

    monkeypatch.setattr(attention, "triton_path", spy)
    return routes
