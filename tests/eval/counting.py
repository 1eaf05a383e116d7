"""A Progress that records each stage's total and every advance: tests check that a task's
progress bar starts with the right total and ends full."""

from __future__ import annotations

from kvq.progress import Progress, Stage


class CountingProgress(Progress):
    def __init__(self):
        super().__init__()
        self.totals, self.advanced = {}, 0

    def _open(self, name, total):
        self.totals[name] = total

        def advance(n):
            self.advanced += n

        return Stage(advance)
