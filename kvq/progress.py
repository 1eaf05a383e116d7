"""Progress reporting the library can call without knowing about the terminal.

Library code takes a `Progress` and wraps each long stage in `stage(name,
total)`; the CLI passes a rich-backed implementation, tests pass nothing. Each
stage's wall time is recorded for the manifest's provenance.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

# Ctrl-C seen by the command line's signal handler. Some libraries swallow the
# KeyboardInterrupt it raises (torch does, while it imports numpy), so the next stage
# raises it again: an interrupted job stops at a stage boundary at the latest.
_interrupt_seen = False


def interrupt_received() -> None:
    global _interrupt_seen
    _interrupt_seen = True


def interrupted() -> bool:
    return _interrupt_seen


class Stage:
    def __init__(self, advance_fn=None):
        self._advance = advance_fn

    def advance(self, n: int = 1) -> None:
        if self._advance is not None:
            self._advance(n)


class Progress:
    """Silent progress: records stage timings only."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def stage(self, name: str, total: int | None = None) -> Iterator[Stage]:
        if _interrupt_seen:
            raise KeyboardInterrupt
        start = time.perf_counter()
        try:
            yield self._open(name, total)
        finally:
            self._close(name)
            self.seconds[name] = round(time.perf_counter() - start, 3)

    def _open(self, name: str, total: int | None) -> Stage:
        return Stage()

    def _close(self, name: str) -> None:
        return None
