"""A rich-backed `Progress`: one bar per stage on stderr, timings kept."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as RichBars

from kvq.progress import Progress, Stage

STDERR = Console(stderr=True)


class RichProgress(Progress):
    """Use as a context manager so one live display spans the whole command."""

    def __init__(self) -> None:
        super().__init__()
        self._bars = RichBars(
            TextColumn("{task.description:<22}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
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
