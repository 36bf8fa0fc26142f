"""What the ``prefect-sandbox`` command shows on the console while a run goes: per-cell progress,
and which of Prefect's console log lines a quiet run keeps.

The run-stage task logs one record as each cell ends (``[stage cell N] ok in 0.40 s``, carrying
a `CellDone` under `CELL_DONE_ATTRIBUTE`). `CellProgress` is a logging handler that turns those
records into a progress bar (rich's, drawn on Prefect's own console so that its log lines
print above it) when stderr is a terminal, or into one plain line per cell when it is not
(`progress_mode`); Prefect's console handler then leaves those records out, so each cell shows
once. Every record still reaches the Prefect API. Manual: docs/reference/cli.md.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Literal, TextIO

from prefect_sandbox.sandbox.notebook import cell_label
from prefect_sandbox.sandbox.outputs import strip_ansi
from prefect_sandbox.tasks.sandbox import CELL_DONE_ATTRIBUTE, CellDone

if TYPE_CHECKING:
    from prefect.logging.handlers import PrefectConsoleHandler
    from rich.console import Console
    from rich.progress import Progress, TaskID

__all__ = [
    "CellProgress",
    "ProgressMode",
    "engine_tracebacks_hidden",
    "prefect_console_handlers",
    "progress_mode",
    "quiet_run_errors",
    "shown_progress",
]

ProgressMode = Literal["bar", "lines"]

RUN_LOGGERS = ("prefect.flow_runs", "prefect.task_runs")
"""The loggers of flow runs and task runs (Prefect's run loggers)."""
STAGE_TASK_NAME = "run-stage"
"""The task whose failure fails the run: a stage's cell failed, or its sandbox went."""


def progress_mode(quiet: bool, stream: TextIO) -> ProgressMode | None:
    """How per-cell progress is shown on ``stream``.

    Args:
        quiet: ``-q/--quiet`` was given.
        stream: where progress goes (the CLI's stderr).

    Returns:
        None when quiet; ``"bar"`` when ``stream`` is a terminal (not ``TERM=dumb``);
        ``"lines"``, one plain line per cell, otherwise (a pipe, a file, CI logs).
    """
    if quiet:
        return None
    if stream.isatty() and os.environ.get("TERM") != "dumb":
        return "bar"
    return "lines"


def prefect_console_handlers() -> list[PrefectConsoleHandler]:
    """Prefect's console handlers on any logger (its logging configuration shares one)."""
    from prefect.logging.handlers import PrefectConsoleHandler

    found: list[PrefectConsoleHandler] = []
    for logger in [
        logging.getLogger(),
        *map(logging.getLogger, list(logging.Logger.manager.loggerDict)),
    ]:
        for handler in logger.handlers:
            if isinstance(handler, PrefectConsoleHandler) and handler not in found:
                found.append(handler)
    return found


def _is_cell_done(record: logging.LogRecord) -> bool:
    return isinstance(getattr(record, CELL_DONE_ATTRIBUTE, None), CellDone)


def _not_cell_done(record: logging.LogRecord) -> bool:
    return not _is_cell_done(record)


def _not_run_error(record: logging.LogRecord) -> bool:
    return record.levelno < logging.ERROR or record.name not in RUN_LOGGERS


@contextmanager
def quiet_run_errors() -> Iterator[None]:
    """Within, Prefect's console shows no error records of flow and task runs (a failing
    cell's traceback, the engine's tracebacks of the task and flow it failed): a quiet run's
    failure is the one line the CLI prints last. They still reach the API."""
    handlers = prefect_console_handlers()
    for handler in handlers:
        handler.addFilter(_not_run_error)
    try:
        yield
    finally:
        for handler in handlers:
            handler.removeFilter(_not_run_error)


class _EngineTracebacksHidden(logging.Filter):
    """Leaves out Prefect's error records that carry a traceback (the engine's "Task run
    failed with exception", "Encountered exception during execution"), and, once the run is
    failing (such a record from a run-stage task or from the flow run), every later record of
    flow and task runs: a failure then ends with the CLI's own lines."""

    def __init__(self) -> None:
        super().__init__()
        self.failing = False

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name not in RUN_LOGGERS:
            return True
        if self.failing:
            return False
        if record.levelno < logging.ERROR or not record.exc_info:
            return True
        task = getattr(record, "task_name", None)
        self.failing = record.name == "prefect.flow_runs" or task == STAGE_TASK_NAME
        return False


@contextmanager
def engine_tracebacks_hidden() -> Iterator[None]:
    """Within, Prefect's console shows no engine tracebacks, and nothing of the run's after
    it began to fail (`_EngineTracebacksHidden`): a failing cell's traceback is followed only
    by the CLI's lines. Everything still reaches the API; ``-v`` keeps it all."""
    handlers = prefect_console_handlers()
    hidden = _EngineTracebacksHidden()
    for handler in handlers:
        handler.addFilter(hidden)
    try:
        yield
    finally:
        for handler in handlers:
            handler.removeFilter(hidden)


class CellProgress(logging.Handler):
    """Shows each cell-done record as progress: a bar's step, or a line on ``stream``.

    The bar names the cell that runs now: the next of ``plan`` after the last that ended (a
    run's cells end in its plan's order), or, without a plan, the last that ended.

    Args:
        mode: ``"bar"`` (rich's progress bar on Prefect's console, or a console of its own on
            ``stream``) or ``"lines"``.
        plan: the run's code cells in running order (injected parameters included), each as
            its stage's name and its number (`CellSpec.number`); None when unknown.
        stream: where lines go, and the bar when Prefect has no console handler.
    """

    def __init__(
        self, mode: ProgressMode, plan: list[tuple[str, int | None]] | None, stream: TextIO
    ) -> None:
        super().__init__()
        self.mode = mode
        self.plan = plan
        self.total = None if plan is None else len(plan)
        self.done = 0
        self._stream = stream
        self._bar: Progress | None = None
        self._console: Console | None = None
        self._task: TaskID | None = None
        self._ended: str | None = None

    def start(self) -> None:
        """Draw the bar (``"bar"`` mode); it then redraws twice a second, its elapsed time
        running while a cell is silent."""
        if self.mode != "bar":
            return
        from rich.console import Console
        from rich.default_styles import DEFAULT_STYLES
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )
        from rich.theme import Theme

        consoles = [handler.console for handler in prefect_console_handlers()]
        console = consoles[0] if consoles else Console(file=self._stream)
        # Prefect's console theme has only its own styles; the bar's are added while it shows.
        bar_styles = {
            name: style
            for name, style in DEFAULT_STYLES.items()
            if name.startswith(("bar.", "progress."))
        }
        console.push_theme(Theme(bar_styles))
        self._console = console
        self._bar = Progress(
            TextColumn("{task.description}", markup=False),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("cells"),
            TimeElapsedColumn(),
            console=console,
            refresh_per_second=2,
            redirect_stdout=False,
            redirect_stderr=False,
        )
        self._task = self._bar.add_task(self._running() or "running", total=self.total)
        self._bar.start()

    def _running(self) -> str | None:
        """``stage 'fit' cell 7 running``: the plan's cell after those done; None past its end
        or without a plan."""
        if self.plan is None or self.done >= len(self.plan):
            return None
        stage, number = self.plan[self.done]
        return f"{strip_ansi(stage)} {cell_label(number)} running"

    @property
    def description(self) -> str | None:
        """What the bar says now (None when no bar shows)."""
        if self._bar is None or self._task is None:
            return None
        return str(self._bar.tasks[0].description)

    def stop(self) -> None:
        """Leave the bar's last state on the console: the last cell that ended."""
        if self._bar is not None:
            if self._ended is not None and self._task is not None:
                self._bar.update(self._task, description=self._ended)
            self._bar.stop()
            self._bar = None
        if self._console is not None:
            self._console.pop_theme()
            self._console = None

    def emit(self, record: logging.LogRecord) -> None:
        done = getattr(record, CELL_DONE_ATTRIBUTE, None)
        if not isinstance(done, CellDone):
            return
        self.done += 1
        # A stage's name is the notebook's: no terminal controls reach the console.
        stage = strip_ansi(done.stage)
        if self._bar is not None and self._task is not None:
            self._ended = f"{stage} {cell_label(done.cell_index)} {done.status}"
            description = self._running() or self._ended
            self._bar.update(self._task, completed=self.done, description=description)
            return
        total = "?" if self.total is None else str(self.total)
        self._stream.write(
            f"prefect-sandbox: [{self.done}/{total}] stage {stage!r} {cell_label(done.cell_index)} "
            f"{done.status} in {done.duration_s:.2f} s\n"
        )
        self._stream.flush()


@contextmanager
def shown_progress(
    mode: ProgressMode | None, plan: list[tuple[str, int | None]] | None, stream: TextIO
) -> Iterator[None]:
    """Within, cells that end show as progress on the console (`CellProgress`, with the run's
    ``plan``), and Prefect's console leaves their records out; nothing when ``mode`` is None."""
    if mode is None:
        yield
        return
    progress = CellProgress(mode, plan, stream)
    loggers = [logging.getLogger(name) for name in RUN_LOGGERS]
    handlers = prefect_console_handlers()
    for logger in loggers:
        logger.addHandler(progress)
    for handler in handlers:
        handler.addFilter(_not_cell_done)
    progress.start()
    try:
        yield
    finally:
        progress.stop()
        for handler in handlers:
            handler.removeFilter(_not_cell_done)
        for logger in loggers:
            logger.removeHandler(progress)
