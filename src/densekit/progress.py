"""Progress of long work on standard error: rich's bar on a terminal, and plain lines a log can show
(done/total, rate, time left) where standard error is a file or a pipe (CI, nohup, a notebook's `!`)."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from densekit.errors import SettingError

stderr_console = Console(stderr=True)
INTERVAL_VARIABLE = "DENSEKIT_PROGRESS_INTERVAL"
DEFAULT_INTERVAL_S = 30.0
# The interval's range: a line a second at most (a log, not a flood), and a day at least once (a thread
# cannot wait for ever: 1e308 seconds overflowed its timer)
MIN_INTERVAL_S, MAX_INTERVAL_S = 1.0, 86_400.0


@contextlib.contextmanager
def progress_bar(
    description: str, total: int | None, enabled: bool = True, completed: int = 0
) -> Iterator[Callable[[int], None]]:
    """Show the progress of `total` units of work; yields `advance(n)`. On a terminal (or in Jupyter) it is
    rich's bar; elsewhere a plain line at the start, every DENSEKIT_PROGRESS_INTERVAL seconds (30 by
    default, 1 to 86,400) and at the end. Shows nothing when disabled."""
    if not enabled:
        yield lambda n: None
        return
    draws_live = stderr_console.is_jupyter or (
        stderr_console.is_terminal and not stderr_console.is_dumb_terminal
    )
    interval = None if draws_live else progress_interval()
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TaskProgressColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    # rich keeps the count, rate and time left either way; it draws only where `draws_live`
    with Progress(*columns, console=stderr_console, transient=False, disable=not draws_live) as progress:
        task = progress.add_task(description, total=total, completed=completed)
        if interval is None:
            yield lambda n: progress.advance(task, n)
            return
        with _lines_every(interval, lambda: _report(progress, task, completed)):
            yield lambda n: progress.advance(task, n)


def progress_interval() -> float:
    """Seconds between plain progress lines: DENSEKIT_PROGRESS_INTERVAL (1 to 86,400), or 30."""
    text = os.environ.get(INTERVAL_VARIABLE, "").strip()
    if not text:
        return DEFAULT_INTERVAL_S
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not MIN_INTERVAL_S <= seconds <= MAX_INTERVAL_S:  # NaN too
        raise SettingError(
            f"{INTERVAL_VARIABLE}={text[:100]!r}: give the seconds between progress lines, from "
            f"{MIN_INTERVAL_S:g} to {MAX_INTERVAL_S:,.0f}"
        )
    return seconds


@contextlib.contextmanager
def _lines_every(interval: float, report: Callable[[], None]) -> Iterator[None]:
    """Call `report` now, every `interval` seconds from a thread, and once more at the end. Written here
    because rich's own refresh thread draws only on a terminal (to a file it writes the bar once, at the
    end)."""
    stop = threading.Event()

    def tick() -> None:
        while not stop.wait(interval):
            report()

    report()
    ticker = threading.Thread(target=tick, name="densekit-progress", daemon=True)
    ticker.start()
    try:
        yield
    finally:
        stop.set()
        ticker.join()
        report()


def _report(progress: Progress, task_id: TaskID, started_at: int) -> None:
    """Print one plain line of the task's state: "stage: done/total percent · rate · elapsed · ETA"."""
    (task,) = [task for task in progress.tasks if task.id == task_id]
    done = MofNCompleteColumn().render(task).plain.strip()
    if task.total is not None:
        done += " " + TaskProgressColumn().render(task).plain.strip()
    parts = [f"{task.description}: {done}"]
    speed = task.speed
    if speed is None and task.elapsed and task.completed > started_at:
        # rich's rate needs two advances in its window; one long step (or the end) gives the mean rate
        speed = (task.completed - started_at) / task.elapsed
    if speed is not None:
        parts.append(f"{speed:,.1f} it/s")  # rich's render_speed writes powers of ten in superscript
    parts.append(f"{TimeElapsedColumn().render(task).plain} elapsed")
    if task.total is not None and not task.finished:
        left = None if not speed else (task.total - task.completed) / speed
        parts.append("ETA " + ("-:--:--" if left is None else str(timedelta(seconds=int(left)))))
    stderr_console.print(" · ".join(parts), markup=False, highlight=False, soft_wrap=True)
