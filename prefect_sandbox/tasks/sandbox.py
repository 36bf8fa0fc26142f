"""Prefect tasks over a sandbox. Each takes a backend block and a `SandboxHandle`, never a live
sandbox, so any task runner works; each attaches, does its work and detaches.

Every task here (and `store_artifacts`) has ``retries=0``, whatever Prefect's global
``PREFECT_TASKS_DEFAULT_RETRIES`` says: cells are not idempotent, and a stage retried on the same
kernel would run its side effects again. Transient backend and S3 errors are retried inside, by
the backends; a retry that makes sense is a flow retry, whose attempt gets a fresh sandbox.
Manual: docs/concepts.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextvars import ContextVar
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import anyio
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.logging.loggers import LoggingAdapter
from prefect.settings import get_current_settings

from prefect_sandbox.blocks.base import SandboxBackend
from prefect_sandbox.results import CellRecord, StageResult
from prefect_sandbox.sandbox.base import (
    CellError,
    CellResult,
    OutputCallback,
    RemoteFile,
    Sandbox,
    SandboxHandle,
    checked_timeout_s,
)
from prefect_sandbox.sandbox.errors import (
    CellExecutionError,
    CellTimeoutError,
    FileTransferError,
    SandboxDiedError,
    SandboxError,
    SandboxNotFoundError,
    SandboxUnavailableError,
    UnsafePathError,
)
from prefect_sandbox.sandbox.labels import API_LABEL, api_id, with_created_at
from prefect_sandbox.sandbox.notebook import CellSpec, StageSpec
from prefect_sandbox.sandbox.outputs import (
    StreamLogThrottle,
    cap_text,
    collapse_carriage_returns,
    error_output,
    strip_ansi,
)
from prefect_sandbox.sandbox.paths import is_utf8, resolve_inside, shown_path
from prefect_sandbox.sandbox.retries import async_retrying
from prefect_sandbox.settings import PrefectSandboxSettings
from prefect_sandbox.tasks.scopes import deadline_passed, shielded
from prefect_sandbox.tasks.storage import ArtifactStore, fetch_inputs, input_credentials

__all__ = [
    "CELL_DONE_ATTRIBUTE",
    "PROGRESS_LOG_INTERVAL_S",
    "ArtifactDownloads",
    "CellDone",
    "KeptConnections",
    "StageProgress",
    "cell_failure",
    "create_sandbox",
    "download_artifacts",
    "fetch_artifacts",
    "kept_connected",
    "kill_sandbox",
    "partial_stage_result",
    "prefect_api_id",
    "restart_kernel",
    "reusing",
    "run_stage",
    "stage_progress",
    "upload_inputs",
]

RAISES_EXCEPTION_TAG = "raises-exception"
_LOG_LINE_CHARS = 4000
_LOG_RECORD_CHARS = 64 * 1024
CANCELLED_ENAME = "RunCancelled"
"""The error name a cell gets when the flow run is cancelled while it runs."""
TIMED_OUT_ENAME = "RunTimedOut"
"""The error name a cell gets when Prefect's ``timeout_seconds`` of its flow or task run passes
while it runs."""
_PARTIAL_OUTPUT_CHARS = 1 << 20
_TIMEOUT_INTERRUPT_S = 10.0
"""Seconds an interrupt of a cell stopped by Prefect's ``timeout_seconds`` may take."""


class StageProgress:
    """Where `run_stage` leaves the stage's cells so far when a cancellation stops it (a
    cancellation carries no data), for the flow that awaits the stage in this process; see
    `stage_progress`.

    Attributes:
        stopped: the stage's result up to the cell that was running (status ``"cancelled"``,
            or ``"failed"`` for a passed ``timeout_seconds``); None while it runs or when it
            ended otherwise.
    """

    def __init__(self) -> None:
        self.stopped: StageResult | None = None


_stage_progress: ContextVar[StageProgress | None] = ContextVar(
    "prefect_sandbox_stage_progress", default=None
)


def _leave_progress(stopped: StageResult) -> None:
    """Leave a stopped stage's result in the enclosing `stage_progress`, if any.

    A function of its own: Dask's cloudpickle sends a task's function by value, with the
    module globals it names, and a `ContextVar` does not pickle.
    """
    progress = _stage_progress.get()
    if progress is not None:
        progress.stopped = stopped


@contextlib.contextmanager
def stage_progress() -> Iterator[StageProgress]:
    """Watch the `run_stage` runs awaited inside (in this process and context).

    Yields:
        The progress `run_stage` fills when a cancellation stops it; read it with
        `partial_stage_result`.
    """
    progress = StageProgress()
    token = _stage_progress.set(progress)
    try:
        yield progress
    finally:
        _stage_progress.reset(token)


_reused: ContextVar[tuple[asyncio.AbstractEventLoop, Sandbox] | None] = ContextVar(
    "prefect_sandbox_reused", default=None
)


@contextlib.contextmanager
def reusing(sandbox: Sandbox) -> Iterator[None]:
    """Let the tasks here awaited inside (in this process, on this event loop) use ``sandbox``
    for its handle instead of attaching anew and closing after: a session's calls keep one
    client (a Jupyter client's sockets, an SDK object) for the session's life."""
    token = _reused.set((asyncio.get_running_loop(), sandbox))
    try:
        yield
    finally:
        _reused.reset(token)


class KeptConnections:
    """The sandboxes create-sandbox made inside one `kept_connected` scope, still connected
    (a Jupyter client's sockets and handshake, an SDK object), by id, with the event loop
    their clients belong to."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._by_id: dict[str, Sandbox] = {}

    def keep(self, sandbox: Sandbox) -> bool:
        """Keep ``sandbox`` connected; False (not kept) off this scope's event loop."""
        if asyncio.get_running_loop() is not self._loop:
            return False
        self._by_id[sandbox.handle.sandbox_id] = sandbox
        return True

    def get(self, handle: SandboxHandle) -> Sandbox | None:
        """The kept sandbox of ``handle``, on this scope's event loop; else None."""
        if asyncio.get_running_loop() is not self._loop:
            return None
        return self._by_id.get(handle.sandbox_id)

    def take(self, handle: SandboxHandle) -> Sandbox | None:
        """Hand the kept sandbox of ``handle`` over to the caller, who closes it; None when
        there is none (`get`)."""
        sandbox = self.get(handle)
        if sandbox is not None:
            del self._by_id[handle.sandbox_id]
        return sandbox

    async def close(self) -> None:
        """Close every sandbox still kept (the sandboxes keep running)."""
        while self._by_id:
            _, sandbox = self._by_id.popitem()
            await sandbox.close()


_kept: ContextVar[KeptConnections | None] = ContextVar("prefect_sandbox_kept", default=None)


@contextlib.asynccontextmanager
async def kept_connected() -> AsyncIterator[KeptConnections]:
    """Keep the sandboxes create-sandbox makes inside connected, for the tasks here awaited
    inside (in this process, on this event loop) to use instead of attaching anew and closing
    after: a pipeline's inputs, stages, artifacts and kill all go through the client its
    create made and handshook. kill-sandbox drops what it kills; what is still kept is closed
    on exit.

    Yields:
        The kept sandboxes, for a caller that takes one over (`KeptConnections.take`).
    """
    kept = KeptConnections()
    token = _kept.set(kept)
    try:
        yield kept
    finally:
        _kept.reset(token)
        with shielded():
            await kept.close()


def _kept_connection(handle: SandboxHandle) -> Sandbox | None:
    """The sandbox of ``handle`` kept by the enclosing `kept_connected`, if any.

    A function of its own, as `_leave_progress`: a task's code names no `ContextVar`.
    """
    kept = _kept.get()
    return None if kept is None else kept.get(handle)


def _keep_connected(sandbox: Sandbox) -> bool:
    """Keep ``sandbox`` in the enclosing `kept_connected`; False when there is none here."""
    kept = _kept.get()
    return kept is not None and kept.keep(sandbox)


def _drop_kept(handle: SandboxHandle) -> None:
    """Forget the kept sandbox of ``handle`` (it was killed, which closed it)."""
    kept = _kept.get()
    if kept is not None:
        kept.take(handle)


@contextlib.asynccontextmanager
async def _attached(backend: SandboxBackend, handle: SandboxHandle) -> AsyncIterator[Sandbox]:
    """The sandbox of ``handle``: the one `reusing` names, or `kept_connected` keeps, else
    attached now and closed after.

    Raises:
        SandboxError: as ``backend.attach`` raises.
    """
    reused = _reused.get()
    if reused is not None:
        loop, sandbox = reused
        if loop is asyncio.get_running_loop() and sandbox.handle.sandbox_id == handle.sandbox_id:
            yield sandbox
            return
    kept = _kept_connection(handle)
    if kept is not None:
        yield kept
        return
    sandbox = await backend.attach(handle)
    try:
        yield sandbox
    finally:
        with shielded():
            await sandbox.close()


def prefect_api_id() -> str:
    """The id (`api_id`) of the Prefect API this process talks to: of ``PREFECT_API_URL``; with
    none set, of the database Prefect's temporary server uses.
    """
    settings = get_current_settings()
    if settings.api.url:
        return api_id(settings.api.url)
    database = settings.server.database.connection_url
    return api_id(f"ephemeral:{database.get_secret_value() if database else ''}")


@task(name="create-sandbox", cache_policy=NO_CACHE, retries=0)
async def create_sandbox(backend: SandboxBackend, labels: dict[str, str]) -> SandboxHandle:
    """Make a sandbox and return its handle.

    Args:
        backend: the backend block.
        labels: labels for the sandbox (see `flow_run_labels`); the sandbox also gets
            `CREATED_AT_LABEL`, the time it is made, by which the reaper tells its age, and
            `API_LABEL`, the Prefect API's id (`prefect_api_id`).

    Returns:
        The new sandbox's handle.

    Raises:
        SandboxError: the backend could not make it.
    """
    sandbox = await backend.create(with_created_at({**labels, API_LABEL: prefect_api_id()}))
    if not _keep_connected(sandbox):
        await sandbox.close()
    get_run_logger().info("Sandbox %s started", sandbox.handle.sandbox_id)
    return sandbox.handle


@task(name="upload-inputs", cache_policy=NO_CACHE, retries=0)
async def upload_inputs(
    backend: SandboxBackend,
    handle: SandboxHandle,
    inputs: list[str],
    staging_dir: str,
    store: ArtifactStore | None = None,
) -> list[str]:
    """Copy local files and folders, and ``s3://`` objects and prefixes, into the sandbox.

    A file lands under its own name; a folder or prefix under its name with its tree. Links in
    a folder that leave it, links to folders and broken links are skipped, each named in a
    warning; an input that is itself such a link is refused. S3 objects are streamed to
    ``staging_dir`` on disk first.

    Args:
        backend: the backend block.
        handle: the sandbox.
        inputs: local paths or ``s3://`` URIs.
        staging_dir: a local folder for downloaded objects.
        store: the run's artifact store; an S3 one lends its credentials to ``s3://`` inputs.

    Returns:
        The uploaded files' paths inside the sandbox.

    Raises:
        FileTransferError: an input does not exist, cannot be read, or is a link to a folder,
            out of its own folder or to nothing (names it); or two would land on one path
            (names both; `plan_inputs`).
        UnsafePathError: an S3 key would leave its folder.
    """
    pairs, skipped = await asyncio.to_thread(
        fetch_inputs, inputs, Path(staging_dir), input_credentials(store)
    )
    logger = get_run_logger()
    for line in skipped:
        logger.warning("Input link skipped: %s", line)
    async with _attached(backend, handle) as sandbox:
        for source, dest in pairs:
            await sandbox.upload(source, dest)
    logger.info("Uploaded %d input file(s)", len(pairs))
    return [dest for _, dest in pairs]


PROGRESS_LOG_INTERVAL_S = 5.0
"""Least seconds between two run-log records of a cell's unfinished output line (a progress
bar redrawn with ``\r``); its last state is logged when the line ends or the cell does."""


class CellDone(NamedTuple):
    """What the record that a cell ended carries, under `CELL_DONE_ATTRIBUTE`, for a handler
    of the run logger (the CLI's progress display).

    Attributes:
        stage: the cell's stage.
        cell_index: the cell's number (`CellSpec.number`: its 0-based index in the notebook
            as written); None for the injected parameters cell.
        status: ``"ok"``, ``"error"`` or ``"timeout"`` (`CellResult.status`).
        duration_s: seconds the cell ran.
    """

    stage: str
    cell_index: int | None
    status: str
    duration_s: float


CELL_DONE_ATTRIBUTE = "prefect_sandbox_cell_done"
"""The log record attribute holding a `CellDone`, on the run-stage task's record that a cell
ended (``[stage cell N] ok in 0.40 s``)."""


class _OutputLog:
    """Sends a cell's outputs to the run logger as they arrive; `flush` when the cell ends.

    Each line is ANSI-stripped, shown as a terminal ends up showing it, cut at
    `_LOG_LINE_CHARS` characters and prefixed ``[stage cell N]``; one record holds at most
    `_LOG_RECORD_CHARS`. A stream's unfinished line reaches the log at most once per
    `PROGRESS_LOG_INTERVAL_S` (`StreamLogThrottle`). What is logged, prefixes included,
    counts against ``budget_chars``: once a cell's budget is used up, one marker line says
    the rest is in the notebook only. An error is logged with its traceback, capped as in
    `CellError`, whatever the budget.
    """

    def __init__(
        self,
        stage: str,
        cell: CellSpec,
        budget_chars: int | None,
        logger: logging.Logger | LoggingAdapter,
    ) -> None:
        self._logger = logger
        self._prefix = f"[{stage} {cell.label}]"
        self._budget_chars = budget_chars
        self._logged = 0
        self._streams: dict[str, StreamLogThrottle] = {}

    def __call__(self, output: dict[str, Any]) -> None:
        kind = output["output_type"]
        if kind == "error":
            self.flush()
            error = CellError(
                ename=output["ename"], evalue=output["evalue"], traceback=output["traceback"]
            )
            report = "\n".join([f"{error.ename}: {error.evalue}", *error.traceback])
            self._logger.error("%s", self._prefixed(report))
            return
        if kind == "stream":
            name = output.get("name", "stdout")
            throttle = self._streams.setdefault(
                name, StreamLogThrottle(PROGRESS_LOG_INTERVAL_S, _LOG_RECORD_CHARS)
            )
            text = throttle.feed(output["text"], time.monotonic())
            if text is not None:
                self._log(text)
        else:
            self._log(
                collapse_carriage_returns(
                    strip_ansi(output.get("data", {}).get("text/plain", f"<{kind}>"))
                )
            )

    def flush(self) -> None:
        """Log what the streams' unfinished lines show last, if not logged yet."""
        for throttle in self._streams.values():
            text = throttle.flush()
            if text is not None:
                self._log(text)

    def _prefixed(self, text: str) -> str:
        """``text`` with the cell's prefix on every line: a line the cell prints can never
        start where a log record of the CLI's or Prefect's own does."""
        return "\n".join(f"{self._prefix} {line}" for line in text.split("\n"))

    def _log(self, text: str) -> None:
        budget_chars = self._budget_chars
        if budget_chars is not None and self._logged >= budget_chars:
            return
        text = "\n".join(
            cap_text(line.split("\r", 1)[0], _LOG_LINE_CHARS) for line in text.split("\n")
        ).strip("\n")
        if not text.strip():
            return
        # The prefixes count against the budget: short lines must not multiply the log.
        text = self._prefixed(text)
        room = _LOG_RECORD_CHARS
        if budget_chars is not None:
            room = min(room, budget_chars - self._logged)
        self._logged += min(len(text), room)
        if len(text) > room:
            text = f"{text[:room]}... [{len(text) - room} more characters]"
        self._logger.info("%s", text)
        if budget_chars is not None and self._logged >= budget_chars:
            self._logger.warning(
                "%s output past %d characters is not logged", self._prefix, budget_chars
            )


def _log_cell_done(
    logger: logging.Logger | LoggingAdapter, stage: str, cell: CellSpec, result: CellResult
) -> None:
    """The run-log record that a cell ended, carrying a `CellDone`."""
    done = CellDone(stage, cell.number, result.status, result.duration_s)
    logger.info(
        "[%s %s] %s in %.2f s",
        stage,
        cell.label,
        result.status,
        result.duration_s,
        extra={CELL_DONE_ATTRIBUTE: done},
    )


def _keeping(log: OutputCallback, budget_chars: int) -> tuple[OutputCallback, list[dict[str, Any]]]:
    """``log``, also keeping the outputs (while they total at most ``budget_chars``
    characters) in the list returned with it, for the notebook if the run is cancelled
    mid-cell."""
    kept: list[dict[str, Any]] = []
    chars = 0

    def on_output(output: dict[str, Any]) -> None:
        nonlocal chars
        log(output)
        chars += len(str(output))
        if chars <= budget_chars:
            kept.append(output)

    return on_output, kept


def _cancelled_cell(
    started_at: datetime,
    start: float,
    outputs: list[dict[str, Any]],
    stopped: CellResult | None,
    *,
    timed_out: bool,
) -> CellResult:
    """A cell the flow run's cancellation, its caller's, or a flow or task run's timeout,
    stopped: its outputs so far (``stopped``'s, as the sandbox stopped it, else those seen),
    and an error saying so."""
    how = ""
    if stopped is not None:
        outputs = stopped.outputs
        how = (
            "; the cell ignored its interrupts, so its kernel was restarted (state lost)"
            if stopped.state_lost
            else "; the cell was interrupted"
        )
    if timed_out:
        error = CellError(
            ename=TIMED_OUT_ENAME,
            evalue="the flow or task run's timeout (Prefect's timeout_seconds) passed during "
            f"this cell{how}",
        )
    else:
        error = CellError(
            ename=CANCELLED_ENAME,
            evalue="the call was cancelled during this cell (the flow run was cancelled, or "
            f"its caller stopped waiting){how}",
        )
    return CellResult(
        status="error",
        execution_count=stopped.execution_count if stopped else None,
        outputs=[*outputs, error_output(error.ename, error.evalue, [])],
        error=error,
        started_at=started_at,
        duration_s=time.monotonic() - start,
        interrupted=stopped is not None and stopped.interrupted,
        state_lost=stopped is not None and stopped.state_lost,
    )


def partial_stage_result(
    error: BaseException, progress: StageProgress | None = None
) -> StageResult | None:
    """What a stage produced before ``error``, when `run_stage` raised it; else None.

    The pipeline flows read it to store the cells that ran before the failing one.

    Args:
        error: what `run_stage` raised: a `SandboxError` carries the stage's cells so far in
            its ``partial_result`` (from any process: it survives pickling); a cancellation
            carries nothing, and they are read from ``progress``.
        progress: the `stage_progress` the stage ran in, if any.
    """
    if isinstance(error, SandboxError):
        partial = error.partial_result
        return partial if isinstance(partial, StageResult) else None
    return None if progress is None else progress.stopped


async def _interrupt_timed_out(sandbox: Sandbox, where: str) -> None:
    """Interrupt the cell that a flow or task run's ``timeout_seconds`` stopped waiting for:
    the kernel would run it on, and hold up what the flow does next on that sandbox (collect
    its files, run another stage). Whether the sandbox is then killed is the flow's call. An
    interrupt that fails, or takes over `_TIMEOUT_INTERRUPT_S`, is a warning."""
    with shielded(), anyio.move_on_after(_TIMEOUT_INTERRUPT_S) as scope:
        try:
            await sandbox.interrupt()
        except SandboxError as exc:
            get_run_logger().warning("%s: not interrupted after the timeout: %s", where, exc)
    if scope.cancelled_caught:
        get_run_logger().warning(
            "%s: not interrupted after the timeout within %s s", where, _TIMEOUT_INTERRUPT_S
        )


def _where(stage: str, cell: CellSpec) -> str:
    return f"stage {stage!r}, {cell.label}"


def _lost_in_cell(stage: str, cell: CellSpec, exc: SandboxError) -> SandboxError:
    """A copy of ``exc`` (the sandbox died, is gone, or could not be reached during the cell):
    the same type and fields, its message and its ``stage`` and ``cell_index`` naming the
    stage and cell."""
    lost = copy.copy(exc)
    lost.message = f"{_where(stage, cell)}: {exc.message}"
    lost.args = (lost.message,)
    lost.stage, lost.cell_index = stage, cell.number
    return lost


def cell_failure(
    stage: str, cell: CellSpec, result: CellResult, timeout_s: float | None
) -> SandboxError:
    """The error for a cell that raised or timed out (``result.status`` not ``"ok"``).

    Returns:
        A `CellTimeoutError` or a `CellExecutionError` naming the stage and cell.
    """
    assert result.error is not None
    where = _where(stage, cell)
    if result.status == "timeout":
        what = "restarted the kernel, state lost" if result.state_lost else "interrupted"
        return CellTimeoutError(
            f"{where}: timed out after {timeout_s} s ({what})",
            timeout_s=timeout_s,
            stage=stage,
            cell_index=cell.number,
            interrupted=result.interrupted,
            state_lost=result.state_lost,
        )
    return CellExecutionError(
        f"{where}: {result.error.ename}: {result.error.evalue}",
        ename=result.error.ename,
        evalue=result.error.evalue,
        traceback=result.error.traceback,
        stage=stage,
        cell_index=cell.number,
    )


def _death_result(
    exc: SandboxError, seen: list[dict[str, Any]], started_at: datetime, duration_s: float
) -> CellResult:
    """The result of a cell during which the sandbox died, went away or could not be reached:
    what the cell made before (the error's ``outputs`` when it carries them, else ``seen``),
    then an ``error`` output whose ``ename`` names what happened (``SandboxDiedError``,
    ``SandboxNotFoundError``, ``SandboxUnavailableError``...). Its state counts as lost only
    when the sandbox ended."""
    error = CellError(ename=type(exc).__name__, evalue=exc.message)
    before, ended = seen, False
    if isinstance(exc, SandboxDiedError | SandboxNotFoundError):
        before, ended = exc.outputs, True
    return CellResult(
        status="error",
        outputs=[*before, error_output(error.ename, error.evalue, [])],
        error=error,
        started_at=started_at,
        duration_s=duration_s,
        state_lost=ended,
    )


class _StageRecorder:
    """A running stage's record: its cells' results so far and the late outputs seen, from
    which it builds the stage's result, whole or partial; ``logger`` is the task run's, got
    once per stage (Prefect builds a new adapter at each ``get_run_logger``)."""

    def __init__(self, stage: StageSpec) -> None:
        self.logger = get_run_logger()
        self.stage = stage
        self.start = time.monotonic()
        self.records: list[CellRecord] = []
        self.late_outputs: dict[str, list[dict[str, Any]]] = {}

    def result(self, failed: CellSpec | None, result: CellResult | None) -> StageResult:
        """The stage's result so far; ``failed`` is the cell that stopped it, with its
        ``result``."""
        return StageResult(
            name=self.stage.name,
            status="failed" if failed else "ok",
            cells=self.records,
            duration_s=time.monotonic() - self.start,
            failed_cell_index=failed.number if failed else None,
            error=result.error if result else None,
            late_outputs=self.late_outputs,
        )

    def lost_in(
        self,
        cell: CellSpec,
        exc: SandboxError,
        seen: list[dict[str, Any]],
        at: datetime,
        cell_start: float,
    ) -> SandboxError:
        """The error to raise for a sandbox lost during ``cell`` (it ended, lost its
        connection or could not be reached), with the stage so far as its partial result."""
        # The cell shows the loss in the notebook as an error output; earlier cells are kept.
        died = _death_result(exc, seen, at, time.monotonic() - cell_start)
        self.records.append(CellRecord(index=cell.index, result=died))
        lost = _lost_in_cell(self.stage.name, cell, exc)
        lost.partial_result = self.result(cell, died)
        return lost

    async def run_cell(
        self, sandbox: Sandbox, cell: CellSpec, timeout_s: float | None, max_chars: int | None
    ) -> CellResult:
        """Run ``cell``, logging its output as it arrives, and record its result.

        Raises:
            SandboxError: the sandbox was lost during it (`lost_in`).
            asyncio.CancelledError: the run was cancelled or timed out during it; the stage so
                far is left in the enclosing `stage_progress` (`cancelled_in`).
        """
        output_log = _OutputLog(self.stage.name, cell, max_chars, self.logger)
        on_output, seen = _keeping(output_log, max_chars or _PARTIAL_OUTPUT_CHARS)
        started_at, cell_start = datetime.now(UTC), time.monotonic()
        try:
            result = await sandbox.run_cell(cell.source, timeout_s=timeout_s, on_output=on_output)
            output_log.flush()
            self.late_outputs.update(await sandbox.take_late_outputs())
        except asyncio.CancelledError:
            output_log.flush()
            await self.cancelled_in(sandbox, cell, seen, started_at, cell_start)
            raise
        except SandboxError as exc:
            output_log.flush()
            raise self.lost_in(cell, exc, seen, started_at, cell_start) from exc
        self.records.append(CellRecord(index=cell.index, result=result))
        return result

    async def cancelled_in(
        self,
        sandbox: Sandbox,
        cell: CellSpec,
        seen: list[dict[str, Any]],
        started_at: datetime,
        cell_start: float,
    ) -> None:
        """Record ``cell`` as stopped by a cancellation (the sandbox interrupted it), or by the
        run's deadline, and leave the stage so far in the enclosing `stage_progress`."""
        timed_out = deadline_passed()
        interrupted = sandbox.take_cancelled_cell()
        if timed_out and interrupted is None:
            await _interrupt_timed_out(sandbox, _where(self.stage.name, cell))
        stopped = _cancelled_cell(started_at, cell_start, seen, interrupted, timed_out=timed_out)
        self.records.append(CellRecord(index=cell.index, result=stopped))
        partial = self.result(cell, stopped)
        if not timed_out:
            partial = partial.model_copy(update={"status": "cancelled"})
        _leave_progress(partial)


@task(name="run-stage", task_run_name="run-stage-{stage.name}", cache_policy=NO_CACHE, retries=0)
async def run_stage(
    backend: SandboxBackend,
    handle: SandboxHandle,
    stage: StageSpec,
    cell_timeout_s: float | None = None,
    allow_errors: bool = False,
) -> StageResult:
    """Run a stage's cells in order in the sandbox; state carries over to later stages.

    A cell that raises stops the stage, unless ``allow_errors`` or the cell is tagged
    ``raises-exception`` (nbclient's rules). Cell output goes to the run logger as it arrives.

    Args:
        backend: the backend block.
        handle: the sandbox.
        stage: the stage's cells.
        cell_timeout_s: seconds per cell, -1 for no limit; None takes the backend's
            ``cell_timeout_s``.
        allow_errors: record failing cells and go on.

    Returns:
        The stage's cells and their results.

    Raises:
        ValueError: the timeout is zero, negative other than -1, NaN or infinite.
        SandboxError: a cell failed (`CellExecutionError`, `CellTimeoutError`), or the sandbox
            died, expired or could not be reached during it (`SandboxDiedError`,
            `SandboxNotFoundError`, `SandboxUnavailableError`: a copy of the backend's error,
            raised from it); the error names the stage and cell, and its ``partial_result``
            holds what the stage produced before (`partial_stage_result`). A sandbox that
            cannot be reached when the stage starts is reported as lost in its first cell.
        asyncio.CancelledError: the flow run was cancelled during a cell; the stage's cells so
            far (status ``"cancelled"``), that cell's output included, are left in the
            enclosing `stage_progress` (`partial_stage_result`). Or the flow or task run's
            ``timeout_seconds`` passed (`deadline_passed`): the same, status ``"failed"``,
            the cell's error `TIMED_OUT_ENAME`, and the cell is interrupted (the sandbox
            lives on, for the flow to collect its files and kill it).
    """
    timeout_s = checked_timeout_s(
        cell_timeout_s if cell_timeout_s is not None else backend.cell_timeout_s, "cell_timeout_s"
    )
    recorder = _StageRecorder(stage)
    async with contextlib.AsyncExitStack() as stack:
        try:
            sandbox = await stack.enter_async_context(_attached(backend, handle))
        except SandboxError as exc:
            if not stage.cells:
                raise
            # Stopped where its first cell was to run, not shown as a stage that never ran.
            raise recorder.lost_in(
                stage.cells[0], exc, [], datetime.now(UTC), time.monotonic()
            ) from exc
        for cell in stage.cells:
            result = await recorder.run_cell(sandbox, cell, timeout_s, backend.max_output_chars)
            _log_cell_done(recorder.logger, stage.name, cell, result)
            tolerated = allow_errors or RAISES_EXCEPTION_TAG in cell.tags
            if result.status == "ok" or (result.status == "error" and tolerated):
                continue
            error = cell_failure(stage.name, cell, result, timeout_s)
            error.partial_result = recorder.result(cell, result)
            raise error
    return recorder.result(None, None)


T = TypeVar("T")
TRANSFER_RETRY_DELAY_S = 2.0
"""The first wait before listing or downloading again once the backend's own retries gave
up (unless the service named a ``Retry-After``), doubling each time."""
_TRANSFER_ATTEMPTS = 50  # the time budget is the bound that counts


class ArtifactDownloads(NamedTuple):
    """What `fetch_artifacts` fetched.

    Attributes:
        downloaded: relative paths of the files downloaded.
        not_fetched: one line per pattern that could not be listed, or file that could not be
            downloaded, after the retries: what, and why.
    """

    downloaded: list[str]
    not_fetched: list[str]


class _TransferRetries:
    """Retries of one run's artifact listings and downloads, all within one time budget
    (setting ``transfer_retry_budget_s``): a 429 or other transient failure that outlasted the
    backend's own retries is tried again after the service's ``Retry-After``, else after
    `TRANSFER_RETRY_DELAY_S` doubling, until the next wait would end past the budget."""

    def __init__(self, budget_s: float) -> None:
        self._deadline = time.monotonic() + budget_s

    async def call(self, what: str, call: Callable[[], Awaitable[T]]) -> T:
        """``call()``, retried as the class says.

        Raises:
            SandboxError: as ``call`` raised it last.
        """
        retrying = async_retrying(
            attempts=_TRANSFER_ATTEMPTS,
            retry_if=lambda error: isinstance(error, SandboxUnavailableError),
            first_delay_s=TRANSFER_RETRY_DELAY_S,
            what=what,
            deadline=self._deadline,
        )
        async for attempt in retrying:
            with attempt:
                return await call()
        raise AssertionError("unreachable: tenacity reraises")


@task(name="download-artifacts", cache_policy=NO_CACHE, retries=0)
async def download_artifacts(
    backend: SandboxBackend, handle: SandboxHandle, patterns: list[str], staging_dir: str
) -> list[str]:
    """Copy the sandbox's files that match artifact patterns into a local staging folder, as
    `fetch_artifacts` does; what could not be fetched is only logged, as a warning.

    Returns:
        Relative paths of the files downloaded.
    """
    return (await _fetch(backend, handle, patterns, staging_dir)).downloaded


@task(name="fetch-artifacts", cache_policy=NO_CACHE, retries=0)
async def fetch_artifacts(
    backend: SandboxBackend, handle: SandboxHandle, patterns: list[str], staging_dir: str
) -> ArtifactDownloads:
    """Copy the sandbox's files that match artifact patterns into a local staging folder.

    A pattern that spells out an existing file's path names that file alone, glob characters
    and all; any other is a glob (`prefect_sandbox.sandbox.paths.matching_files`). Patterns and
    files that cannot be collected are skipped with a warning naming them, and the rest are
    still downloaded: a pattern that leaves the working directory (``..``, an absolute path),
    a link that leads out, a FIFO, a device, a socket, a sparse file, a file over setting
    ``max_artifact_bytes`` (default 1 GiB), a file past setting ``max_total_artifact_bytes``
    (default 4 GiB, all files together), a file that went away meanwhile, and a file whose
    name is not UTF-8 (no store, summary or S3 key can hold that name as it is). A link or a
    hard link to a file already collected is skipped with a warning naming both: one file is
    stored once, whatever the number of names it has (`RemoteFile.identity`).

    A listing or download that stays rate limited (429) or unavailable through the backend's
    retries is tried again within the call's time budget (`_TransferRetries`); a pattern or
    file still not fetched is named in ``not_fetched`` and a warning, and the rest are
    fetched.

    Args:
        backend: the backend block.
        handle: the sandbox.
        patterns: globs relative to the working directory, e.g. ``figures/*.png``.
        staging_dir: local folder to copy into, keeping relative paths.

    Returns:
        The files downloaded, and what could not be fetched.

    Raises:
        SandboxNotFoundError: the sandbox is gone.
    """
    return await _fetch(backend, handle, patterns, staging_dir)


async def _fetch(
    backend: SandboxBackend, handle: SandboxHandle, patterns: list[str], staging_dir: str
) -> ArtifactDownloads:
    logger = get_run_logger()
    settings = PrefectSandboxSettings()
    retries = _TransferRetries(settings.transfer_retry_budget_s)
    collector = _Collector(Path(staging_dir), settings, logger, retries)
    async with _attached(backend, handle) as sandbox:
        for pattern in patterns:
            try:
                matches = await retries.call(
                    "Listing artifacts", partial(sandbox.list_files, pattern)
                )
            except UnsafePathError as exc:
                logger.warning("Artifact pattern refused: %s", exc)
                continue
            except SandboxUnavailableError as exc:
                collector.not_fetched.append(f"artifact pattern {pattern!r} not listed: {exc}")
                logger.warning("Artifact pattern %r could not be listed: %s", pattern, exc)
                continue
            if not matches:
                logger.warning("Artifact pattern %r matched no file", pattern)
            for remote in matches:
                await collector.collect(sandbox, remote)
    logger.info("Downloaded %d artifact(s)", len(collector.downloaded))
    return ArtifactDownloads(collector.downloaded, collector.not_fetched)


class _Collector:
    """One run's artifact downloads: each file once, all of them within the run's total cap."""

    def __init__(
        self,
        staging: Path,
        settings: PrefectSandboxSettings,
        logger: logging.Logger | LoggingAdapter,
        retries: _TransferRetries,
    ) -> None:
        self.downloaded: list[str] = []
        self.not_fetched: list[str] = []
        self._retries = retries
        self._staging = staging
        self._max_bytes = settings.max_artifact_bytes
        self._left_bytes = settings.max_total_artifact_bytes
        self._first_path_of: dict[str, str] = {}
        self._logger = logger

    async def collect(self, sandbox: Sandbox, remote: RemoteFile) -> None:
        """Download ``remote`` unless it is collected already or cannot be (warned)."""
        if remote.path in self.downloaded:
            return
        shown = shown_path(remote.path)
        if not is_utf8(remote.path):
            self._logger.warning(
                "Artifact %r skipped: its name is not UTF-8 text, so it cannot be stored under "
                "it; rename it in a cell to collect it",
                shown,
            )
            return
        first = self._first_path_of.get(remote.identity or "")
        if first is not None:
            self._logger.warning(
                "Artifact %r skipped: it is a link to %r, collected already (a file is stored "
                "once)",
                shown,
                shown_path(first),
            )
            return
        max_bytes = self._max_bytes
        if self._left_bytes is not None:
            if remote.size_bytes > self._left_bytes:
                self._logger.warning(
                    "Artifact %r skipped: its %d bytes are past the run's total cap "
                    "(max_total_artifact_bytes, %d bytes left)",
                    shown,
                    remote.size_bytes,
                    self._left_bytes,
                )
                return
            max_bytes = self._left_bytes if max_bytes is None else min(max_bytes, self._left_bytes)
        dest = resolve_inside(self._staging, remote.path)
        try:
            size = await self._retries.call(
                f"Downloading artifact {shown!r}",
                partial(sandbox.download, remote.path, dest, max_bytes=max_bytes),
            )
        except (UnsafePathError, FileTransferError) as exc:
            dest.unlink(missing_ok=True)
            self._logger.warning("Artifact refused: %s", exc)
            return
        except SandboxUnavailableError as exc:
            dest.unlink(missing_ok=True)
            self.not_fetched.append(f"artifact {shown!r} not downloaded: {exc}")
            self._logger.warning("Artifact %r could not be downloaded: %s", shown, exc)
            return
        if self._left_bytes is not None:
            self._left_bytes -= size
        if remote.identity is not None:
            self._first_path_of[remote.identity] = remote.path
        self.downloaded.append(remote.path)


@task(name="restart-kernel", cache_policy=NO_CACHE, retries=0)
async def restart_kernel(backend: SandboxBackend, handle: SandboxHandle) -> None:
    """Restart the sandbox's kernel in place (`Sandbox.restart`): a fresh one after a death,
    or on request; files kept, variables and imports lost.

    Raises:
        SandboxNotFoundError: the sandbox was killed or expired.
        SandboxError: the kernel could not be started again.
    """
    async with _attached(backend, handle) as sandbox:
        await sandbox.restart()
    get_run_logger().info("Sandbox %s: kernel restarted, state lost", handle.sandbox_id)


@task(name="kill-sandbox", cache_policy=NO_CACHE, retries=0)
async def kill_sandbox(backend: SandboxBackend, handle: SandboxHandle) -> bool:
    """Kill the sandbox. Idempotent.

    Returns:
        True if this call ended it, False if it was already gone.
    """
    kept = _kept_connection(handle)
    try:
        sandbox = kept or await backend.attach(handle)
    except SandboxNotFoundError:
        killed = False
    else:
        killed = await sandbox.kill()
        if kept is not None:
            _drop_kept(handle)  # the kill closed it
    get_run_logger().info(
        "Sandbox %s %s", handle.sandbox_id, "killed" if killed else "already gone"
    )
    return killed
