"""Progress of a long command on stderr: a bar on a terminal, a line every 10% otherwise.

Off a terminal (a CI log, a pipe, `nohup`) a bar shows nothing until it ends, so a
command that runs for minutes would look hung; there, each task prints one line each
time it passes another tenth of its total. Both forms take the same calls (the subset
of rich's `Progress` the commands use).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any, TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

STEPS = 10
"""Lines per task off a terminal: one per tenth."""


def progress(*, transient: bool = True, stream: TextIO | None = None) -> Any:
    """A rich bar on stderr if it is a terminal, else `LineProgress` (use it as a context manager)."""
    out = stream or sys.stderr
    if out.isatty():
        return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=Console(file=out), transient=transient)
    return LineProgress(out)


@dataclass(slots=True)
class _Task:
    description: str
    total: float | None
    completed: float = 0.0
    reported: int = 0
    """Tenths already printed."""


class LineProgress:
    """Progress as plain lines: `description: 30% (300/1000), 12 s`."""

    def __init__(self, out: TextIO) -> None:
        self._out = out
        self._tasks: list[_Task] = []
        self._t0 = time.monotonic()

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def add_task(self, description: str, total: float | None = None, **_: Any) -> int:
        self._tasks.append(_Task(description, total))
        return len(self._tasks) - 1

    def advance(self, task: int, advance: float = 1) -> None:
        self.update(task, completed=self._tasks[task].completed + advance)

    def update(self, task: int, *, completed: float | None = None, advance: float | None = None, **_: Any) -> None:
        t = self._tasks[task]
        if completed is not None:
            t.completed = completed
        if advance is not None:
            t.completed += advance
        if not t.total:
            return
        tenths = min(STEPS, int(STEPS * t.completed / t.total))
        if tenths > t.reported:
            t.reported = tenths
            self._out.write(f"{t.description}: {10 * tenths}% ({t.completed:,.0f}/{t.total:,.0f}), "
                            f"{time.monotonic() - self._t0:.0f} s\n")
            self._out.flush()
