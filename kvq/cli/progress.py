"""Progress on stderr for the command line: rich bars on a terminal, plain lines elsewhere.

A log file or a CI console cannot redraw a bar (rich prints it once, at the end), so when
stderr is not a terminal each stage prints a line when it starts, a line with its count,
elapsed time and ETA at most every `PlainProgress.every` seconds, and one when it ends.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.progress import Progress as RichBars

from kvq.progress import Progress, Stage

STDERR = Console(stderr=True)


def cli_progress(terminal: bool | None = None) -> Progress:
    """The progress a command shows: bars on a terminal (None: whether stderr is one), else
    plain lines. Use it as a context manager so one display spans the whole command."""
    terminal = STDERR.is_terminal if terminal is None else terminal
    return RichProgress() if terminal else PlainProgress(sys.stderr)


def _clock(seconds: float) -> str:
    s = int(round(seconds))
    return (
        f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"
    )


class RichProgress(Progress):
    def __init__(self) -> None:
        super().__init__()
        self._bars = RichBars(
            TextColumn("{task.description:<22}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=STDERR,
            transient=False,
        )
        self._tasks: dict[str, int] = {}

    def __enter__(self) -> RichProgress:
        self._bars.start()
        return self

    def __exit__(self, *exc) -> None:
        self._bars.stop()

    def _open(self, name: str, total: int | None) -> Stage:
        task = self._bars.add_task(name, total=total)
        self._tasks[name] = task
        return Stage(lambda n: self._bars.advance(task, n))

    def _close(self, name: str) -> None:
        task = self._tasks.pop(name)
        t = self._bars.tasks[self._bars.task_ids.index(task)]
        if t.total is None:
            self._bars.update(task, total=1, completed=1)


@dataclass
class _Counted:
    """One open stage of `PlainProgress`."""

    start: float
    total: int | None
    done: int = 0
    last_line: float = 0.0  # when the last count line was printed
    first: tuple[float, int] | None = None  # (time, count) at the first advance


class PlainProgress(Progress):
    """One line per event, flushed: `name: 3/16, 0:12 elapsed, eta 0:52`."""

    every = 10.0  # seconds between count lines of one stage

    def __init__(self, stream) -> None:
        super().__init__()
        self._stream = stream
        self._open_stages: dict[str, _Counted] = {}

    def __enter__(self) -> PlainProgress:
        return self

    def __exit__(self, *exc) -> None:
        return None

    def _say(self, line: str) -> None:
        self._stream.write(line + "\n")
        self._stream.flush()

    def _open(self, name: str, total: int | None) -> Stage:
        start = time.perf_counter()
        stage = self._open_stages[name] = _Counted(start, total, last_line=start)
        self._say(f"{name}: started" + (f" (0/{total})" if total else ""))

        def advance(n: int) -> None:
            stage.done += n
            now = time.perf_counter()
            if stage.first is None:
                stage.first = (now, stage.done)
            if now - stage.last_line < self.every:
                return
            stage.last_line = now
            count = f"{stage.done}/{total}" if total else str(stage.done)
            # the rate since the first item: a stage's first item often carries its set-up
            (t1, d1), eta = stage.first, ""
            if total and d1 < stage.done < total:
                eta = f", eta {_clock((now - t1) / (stage.done - d1) * (total - stage.done))}"
            self._say(f"{name}: {count}, {_clock(now - start)} elapsed{eta}")

        return Stage(advance)

    def _close(self, name: str) -> None:
        stage = self._open_stages.pop(name)
        count = f" ({stage.done}/{stage.total})" if stage.total else ""
        self._say(f"{name}: done in {_clock(time.perf_counter() - stage.start)}{count}")
