"""Human-readable numbers, consoles and progress displays for terminal output (Parquet keeps
the raw values)."""

from __future__ import annotations

import contextlib
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.errors import MarkupError
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text

from dlrm_lab.config.values import env_seconds


def console(stderr: bool = False) -> Console:
    """A rich console; when piped (not a terminal) it is 120 columns, not rich's 80,
    so that tables stay readable in logs."""
    stream = sys.stderr if stderr else sys.stdout
    return Console(stderr=stderr, width=None if stream.isatty() else 120)


PROGRESS_INTERVAL_ENV = "DLRM_LAB_PROGRESS_INTERVAL_S"
DEFAULT_PROGRESS_INTERVAL_S = 5.0
_SPEED_WINDOW_S = 30.0  # rich's speed estimate period: the rate (and time left) is over the last 30 s


def progress_interval_s() -> float:
    """Seconds between plain progress lines: $DLRM_LAB_PROGRESS_INTERVAL_S, default 5."""
    return env_seconds(PROGRESS_INTERVAL_ENV, DEFAULT_PROGRESS_INTERVAL_S)


def progress(
    *fields: str,
    unit: str = "",
    rate: bool = True,
    to: Console | None = None,
    enabled: bool = True,
    interval_s: float | None = None,
    refresh_per_second: float = 10,
    clock: Callable[[], float] = time.monotonic,
) -> Progress | LineProgress:
    """A progress display for the console `to` (default: `console(stderr=True)`).

    On an interactive terminal it is rich's live `Progress` bar: description, bar, done/total,
    `unit`, one text column per entry of `fields`, elapsed and time left. Otherwise (a pipe,
    `| tee`, a file, TERM=dumb) rich would show nothing until the end, so it is a
    `LineProgress` with the same interface (`add_task`, `update`, `advance`, `start`, `stop`,
    `console`, context manager) that prints one plain line, flushed, on the same console, at
    most every `interval_s` seconds (on an update that comes that long after the previous
    line), and a final line when stopped (unless the last line already shows the end):

        train: 120/300 steps (40%), 10.2 steps/s, elapsed 12s, left 18s, 52,000 samples/s, loss 0.4512

    `fields` are rich text-column templates over the task, e.g. "loss {task.fields[loss]}"
    (pass the values as keyword fields of `add_task` / `update`); the same templates make
    the bar's columns and the line's last parts, so both show the same. `rate=False` leaves
    the done-per-second part out of the line. `interval_s` defaults to
    $DLRM_LAB_PROGRESS_INTERVAL_S, else 5 s (0: a line on every update, as tests use).
    `refresh_per_second` is the bar's redraw rate (lower it where a measurement shares the
    process). `enabled=False` (`--no-progress`) prints nothing either way. `clock` is for tests.
    """
    to = to if to is not None else console(stderr=True)
    if enabled and to.is_interactive:
        columns: list[ProgressColumn] = [TextColumn("[bold]{task.description}[/]"), BarColumn(), MofNCompleteColumn()]
        if unit:
            columns.append(TextColumn(unit))
        columns += [TextColumn(f) for f in fields]
        columns += [TimeElapsedColumn(), TimeRemainingColumn()]
        return Progress(*columns, console=to, refresh_per_second=refresh_per_second)
    interval = progress_interval_s() if interval_s is None else interval_s
    return LineProgress(fields, unit=unit, rate=rate, to=to, enabled=enabled, interval_s=interval, clock=clock)


@dataclass
class _LineTask:
    description: str
    total: float | None
    completed: float
    fields: dict[str, Any]
    start_time: float
    last_line: float  # clock time of this task's last line (or of the start)
    samples: deque[tuple[float, float]] = field(default_factory=deque)  # (time, completed) of recent updates
    unshown: bool = False  # updated since its last line

    def speed(self) -> float | None:
        """Done per second over the recent updates (None until two updates apart in time)."""
        if len(self.samples) < 2:
            return None
        (t0, c0), (t1, c1) = self.samples[0], self.samples[-1]
        return (c1 - c0) / (t1 - t0) if t1 > t0 else None


class LineProgress:
    """Progress as plain lines, for output that is not a terminal: see `progress`."""

    def __init__(
        self,
        fields: tuple[str, ...] | list[str] = (),
        *,
        unit: str = "",
        rate: bool = True,
        to: Console,
        enabled: bool = True,
        interval_s: float = DEFAULT_PROGRESS_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.fields = tuple(fields)
        self.unit = unit
        self.rate = rate
        self.console = to
        self.enabled = enabled
        self.interval_s = interval_s
        self.clock = clock
        self.started = False
        self._tasks: list[_LineTask] = []

    def __enter__(self) -> LineProgress:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Lines are printed only between `start` and `stop` (as rich shows its bar)."""
        if not self.started:
            self.started = True
            now = self.clock()
            for task in self._tasks:
                task.last_line = now

    def stop(self) -> None:
        """The final line of every task updated since its last line (nothing when never
        started or already stopped: an error before any progress stays the only line)."""
        if self.started:
            self.started = False
            for task in self._tasks:
                if task.unshown:
                    self._print(task, self.clock())

    def add_task(self, description: str, total: float | None = None, completed: float = 0, **fields: Any) -> int:
        now = self.clock()
        self._tasks.append(_LineTask(description, total, completed, fields, start_time=now, last_line=now))
        return len(self._tasks) - 1

    def update(
        self,
        task_id: int,
        *,
        total: float | None = None,
        completed: float | None = None,
        advance: float | None = None,
        description: str | None = None,
        visible: bool | None = None,
        refresh: bool = False,
        **fields: Any,
    ) -> None:
        task = self._tasks[task_id]
        now = self.clock()
        if total is not None:
            task.total = total
        if completed is not None:
            task.completed = completed
        if advance is not None:
            task.completed += advance
        if description is not None:
            task.description = description
        task.fields.update(fields)
        task.unshown = True
        if completed is not None or advance is not None:
            task.samples.append((now, task.completed))
            while len(task.samples) > 2 and task.samples[0][0] < now - _SPEED_WINDOW_S:
                task.samples.popleft()
        if self.started and now - task.last_line >= self.interval_s:
            self._print(task, now)

    def advance(self, task_id: int, advance: float = 1) -> None:
        self.update(task_id, advance=advance)

    def _print(self, task: _LineTask, now: float) -> None:
        task.last_line = now
        task.unshown = False
        if self.enabled:
            self.console.print(self._line(task, now), markup=False, highlight=False, soft_wrap=True)

    def _line(self, task: _LineTask, now: float) -> str:
        unit = f" {self.unit}" if self.unit else ""
        if task.total:
            share = task.completed / task.total
            parts = [f"{_amount(task.completed)}/{_amount(task.total)}{unit} ({share:.0%})"]
        else:
            parts = [f"{_amount(task.completed)}{unit}"]
        speed = task.speed()
        if self.rate and speed is not None:
            parts.append(f"{speed:,.0f}{unit}/s" if speed >= 100 else f"{speed:.3g}{unit}/s")
        parts.append(f"elapsed {_duration(now - task.start_time)}")
        if task.total and speed:
            parts.append(f"left {_duration(max(0.0, task.total - task.completed) / speed)}")
        for template in self.fields:
            text = _plain(template.format(task=task)).strip()
            if text:
                parts.append(text)
        return f"{_plain(task.description)}: {', '.join(parts)}"


def _amount(x: float) -> str:
    return f"{x:,.0f}" if float(x).is_integer() else f"{x:,.1f}"


def _duration(seconds: float) -> str:
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _plain(text: str) -> str:
    """`text` without rich markup (as the bar's column would render it)."""
    try:
        return Text.from_markup(text).plain
    except MarkupError:
        return text


@contextlib.contextmanager
def say_interrupted(to: Console | None = None) -> Iterator[None]:
    """On Ctrl-C, one line before the exit (130): the run's status and where it is. The
    library marks the run interrupted and names its directory on the exception (`run_dir`)."""
    try:
        yield
    except KeyboardInterrupt as exc:
        where = getattr(exc, "run_dir", None)
        line = f"interrupted: run {where} marked interrupted, its rows kept" if where else "interrupted"
        (to or console(stderr=True)).print(line, highlight=False, soft_wrap=True)
        raise
