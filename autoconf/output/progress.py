"""Progress bars for the long phases (search, verifying trials, a single trial, profiling).

Always on stderr, never on stdout: ``--json`` output stays one clean document. They are drawn only
where someone can see them (stderr is a terminal) and not with ``--quiet``; elsewhere every
method is a no-op.
"""

from __future__ import annotations

import sys


def wanted(quiet: bool = False, stream=None) -> bool:
    """Whether to draw progress: not ``--quiet``, and ``stream`` (stderr) is a terminal."""
    stream = sys.stderr if stream is None else stream
    try:
        return not quiet and stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class Bars:
    """A rich Progress on stderr when enabled; every method is a no-op otherwise. Use as a context
    manager; ``transient`` bars are erased when it ends."""

    def __init__(self, enabled: bool, transient: bool = False):
        self.enabled = enabled
        self.progress = None
        if enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                     TimeElapsedColumn(), console=Console(file=sys.stderr), transient=transient)

    def __enter__(self):
        if self.progress:
            self.progress.__enter__()
        return self

    def __exit__(self, *exc):
        if self.progress:
            self.progress.__exit__(*exc)

    def task(self, description: str, total: int | None = None):
        if self.progress is None:
            return None
        return self.progress.add_task(description, total=max(total, 0) if total is not None else None)

    def describe(self, task, description: str) -> None:
        if self.progress is not None and task is not None:
            self.progress.update(task, description=description)

    def advance(self, task, n: int = 1) -> None:
        if self.progress is not None and task is not None:
            self.progress.advance(task, n)

    def update(self, task, completed: int | None = None, total: int | None = None,
               description: str | None = None) -> None:
        if self.progress is None or task is None:
            return
        kw = {}
        if completed is not None:
            kw["completed"] = completed
        if total is not None:
            kw["total"] = total
        if description is not None:
            kw["description"] = description
        self.progress.update(task, **kw)
