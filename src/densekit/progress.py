"""Progress bars for long work, drawn on standard error."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

stderr_console = Console(stderr=True)


@contextlib.contextmanager
def progress_bar(
    description: str, total: int | None, enabled: bool = True, completed: int = 0
) -> Iterator[Callable[[int], None]]:
    """Show a bar for `total` units of work; yields `advance(n)`. Draws nothing when disabled."""
    if not enabled:
        yield lambda n: None
        return
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TaskProgressColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=stderr_console, transient=False) as progress:
        task = progress.add_task(description, total=total, completed=completed)
        yield lambda n: progress.advance(task, n)
