"""The seam every backend implements: `Sandbox`, and the values that cross it.

Manual: docs/backends/index.md.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Any, ClassVar, Literal, NoReturn, Self

import anyio
from pydantic import BaseModel, Field, field_validator

from prefect_sandbox.sandbox.errors import (
    FileTransferError,
    SandboxDiedError,
    SandboxError,
    SandboxNotFoundError,
)
from prefect_sandbox.sandbox.outputs import (
    DEFAULT_MAX_OUTPUT_CHARS,
    CellOutputs,
    cap_text,
    cap_traceback,
    strip_ansi,
)

__all__ = [
    "NO_TIMEOUT",
    "SECOND_INTERRUPT_S",
    "TIMEOUT_ENAME",
    "CellError",
    "CellReply",
    "CellResult",
    "KernelInfo",
    "OutputCallback",
    "RemoteFile",
    "RunningCell",
    "Sandbox",
    "SandboxConfig",
    "SandboxHandle",
    "cell_result",
    "checked_timeout_s",
    "is_python_language",
]

TIMEOUT_ENAME = "CellTimeoutError"
"""The ``ename`` of the ``error`` output a cell that ran past its deadline ends with."""

SECOND_INTERRUPT_S = 1.0
"""Seconds a cell gets to stop after a second interrupt, before its kernel is restarted."""

logger = logging.getLogger(__name__)

OutputCallback = Callable[[dict[str, Any]], None]
"""Called with nbformat output dicts as they arrive from the kernel, before the cell's outputs
are coalesced and capped; stream text that arrived back to back may come merged into one."""


NO_TIMEOUT = -1
"""A cell timeout of -1 means no deadline, as in nbclient; ``None`` means no deadline for a
`Sandbox`, and "the backend's default" for the flows, the CLI and `run_stage`."""


def checked_timeout_s(timeout_s: float | None, name: str = "timeout_s") -> float | None:
    """Check a cell timeout and give the deadline it sets.

    Args:
        timeout_s: seconds (positive and finite), `NO_TIMEOUT` (-1) or None for no deadline.
        name: what the error calls it (``cell_timeout_s``, ``--cell-timeout``).

    Returns:
        The seconds, or None for no deadline.

    Raises:
        ValueError: zero, another negative number, NaN or infinity (names ``name``).
    """
    if timeout_s is None or timeout_s == NO_TIMEOUT:
        return None
    if not (math.isfinite(timeout_s) and timeout_s > 0):
        raise ValueError(
            f"{name} must be a positive number of seconds, or -1 for no timeout; got {timeout_s:g}"
        )
    return timeout_s


_PYTHON_LANGUAGES = {"python", "python2", "python3", "ipython"}


def is_python_language(language: str) -> bool:
    """Whether a kernelspec's ``language`` or a ``language_info`` ``name`` means Python.

    Every backend runs Python cells only: parameters are injected, and outputs gathered, as
    Python.
    """
    return language.strip().lower() in _PYTHON_LANGUAGES


class KernelInfo(BaseModel):
    """The kernel that runs a sandbox's cells, in the terms of a notebook's metadata.

    Attributes:
        kernelspec: nbformat's ``metadata.kernelspec``: ``name``, ``display_name`` and
            ``language``.
        language_info: nbformat's ``metadata.language_info``: at least ``name``; the local
            kernel's own kernel_info reply also gives ``version``, ``mimetype`` and more.
    """

    kernelspec: dict[str, str]
    language_info: dict[str, Any]

    @classmethod
    def python(cls, display_name: str) -> KernelInfo:
        """A Python 3 kernel known by no more than its language, as a remote backend knows it.

        Args:
            display_name: the kernelspec's ``display_name``, e.g. ``"Python 3 (E2B)"``.
        """
        return cls(
            kernelspec={"name": "python3", "display_name": display_name, "language": "python"},
            language_info={"name": "python"},
        )


class SandboxHandle(BaseModel):
    """A small, picklable, JSON-able address of a live sandbox.

    Tasks pass handles, never live objects, so retries, thread pools and process-based task
    runners all work; ``Backend.attach(handle)`` returns a live `Sandbox` again. A handle never
    holds a backend's API key.

    Attributes:
        backend: the backend's slug (``"local"``, ``"e2b"``, ``"daytona"``).
        sandbox_id: the backend's id for the sandbox.
        workdir: the sandbox's working directory, as a path inside the sandbox.
        labels: labels the sandbox was created with (flow run id and name, our marker).
        connection: backend-specific details needed to reach the sandbox again.
        kernel: the kernel that runs its cells, as the backend knows it when the sandbox is
            made; None from handles that listings rebuilt.
        limits: each resource limit set on the sandbox (``memory``, ``processes``, ``cpu``,
            ...) to how it applies, e.g. ``"whole sandbox (cgroup v1): 1073741824 bytes"`` or
            ``"each process (RLIMIT_DATA): ..."``; empty where the backend reports none.
    """

    backend: str
    sandbox_id: str
    workdir: str
    labels: dict[str, str] = Field(default_factory=dict)
    connection: dict[str, Any] = Field(default_factory=dict)
    kernel: KernelInfo | None = None
    limits: dict[str, str] = Field(default_factory=dict)


class CellError(BaseModel):
    """The exception user code raised in a cell, as people read it wherever it is copied (errors,
    logs, ``summary.json``): terminal controls removed (`strip_ansi`), ``ename`` on one line,
    ``ename`` and ``evalue`` capped at `ERROR_TEXT_CHARS` and ``traceback`` at
    `TRACEBACK_CHARS` (joined), with a marker where text was left out. The cell's ``error``
    output keeps the full text.

    Attributes:
        ename: the exception's class name.
        evalue: its message.
        traceback: the traceback's lines; they name the cell's failing source line.
    """

    ename: str
    evalue: str
    traceback: list[str] = Field(default_factory=list)

    @field_validator("ename", "evalue")
    @classmethod
    def _capped_text(cls, text: str) -> str:
        # A class name is the cell's to choose too (type("\x1b]52;...", (Exception,), {})).
        return cap_text(strip_ansi(text))

    @field_validator("ename")
    @classmethod
    def _one_line(cls, name: str) -> str:
        # No class name has a line break; one would split every line that names the error.
        return " ".join(name.split())

    @field_validator("traceback")
    @classmethod
    def _capped_traceback(cls, traceback: list[str]) -> list[str]:
        return cap_traceback(traceback)


class CellResult(BaseModel):
    """What running one cell produced.

    Attributes:
        status: ``"ok"``; ``"error"`` when user code raised; ``"timeout"`` when the deadline
            passed and the cell was interrupted.
        execution_count: the kernel's execution counter for the cell, when it reported one.
        outputs: nbformat v4 output dicts (``stream``, ``display_data``, ``execute_result``,
            ``error``) in the order they were produced, consecutive streams coalesced.
        error: the exception, when ``status`` is not ``"ok"``.
        started_at: when the cell was sent (UTC).
        duration_s: seconds from sending the cell to its reply.
        interrupted: True when an interrupt stopped the cell after its deadline.
        state_lost: True when the kernel was restarted, losing variables and imports.
        msg_id: the Jupyter ``execute_request`` id, to match output that arrives later.
        output_chars: size of all output the cell produced, in characters (of text, and of
            rich values as strings: base64 for images).
        omitted_chars: how many of those characters the output cap dropped from ``outputs``.
        display_ids: each display id (``display(..., display_id=...)``) to the indexes in
            ``outputs`` of the outputs shown with it.
        display_updates: each display id to the last ``data`` and ``metadata`` the cell sent
            for it (an update, or a new display with that id): outputs that earlier cells
            showed with the id show it too, as nbclient does (see ``ExecutedNotebook``).
        widget_state: each widget model's comm id to the ``state`` (and binary ``buffers``,
            base64) the cell's ``comm_open`` and ``comm_msg`` messages sent for it; the
            executed notebook keeps the last of each in ``metadata.widgets``.
    """

    status: Literal["ok", "error", "timeout"]
    execution_count: int | None = None
    outputs: list[dict[str, Any]] = Field(default_factory=list)
    error: CellError | None = None
    started_at: datetime
    duration_s: float
    interrupted: bool = False
    state_lost: bool = False
    msg_id: str | None = None
    output_chars: int = 0
    omitted_chars: int = 0
    display_ids: dict[str, list[int]] = Field(default_factory=dict)
    display_updates: dict[str, dict[str, Any]] = Field(default_factory=dict)
    widget_state: dict[str, dict[str, Any]] = Field(default_factory=dict)


class RemoteFile(BaseModel):
    """A file inside a sandbox.

    Attributes:
        path: POSIX path relative to the sandbox's working directory.
        size_bytes: its size in bytes (a link's own, not its target's).
        identity: the file the path leads to, links followed (``"DEV:INODE"``, or on E2B,
            whose listing has no inode, the target's path): two paths with one identity are
            one file, collected once. None where the backend cannot tell.
    """

    path: str
    size_bytes: int
    identity: str | None = None


@dataclass(frozen=True, kw_only=True)
class SandboxConfig:
    """Settings every backend has; each backend's config subclasses this one.

    Configs hold what a sandbox needs to be made, reached and driven, credentials included
    (through a client factory, never as plain fields of a handle). They are built by the
    backend blocks (`prefect_sandbox.blocks`) from what a user saved.

    Attributes:
        interrupt_grace_s: seconds a timed-out cell gets to stop after the first interrupt
            before the backend escalates (a second interrupt, then a restart).
        max_output_chars: cap on each cell's stored output, in characters (head and tail
            kept; see `OutputCollector`); None for none.

    Raises:
        ValueError: a duration or a limit is zero or negative.
    """

    interrupt_grace_s: float = 5.0
    max_output_chars: int | None = DEFAULT_MAX_OUTPUT_CHARS

    def __post_init__(self) -> None:
        self._check_positive("interrupt_grace_s", "max_output_chars")

    def _check_positive(self, *names: str) -> None:
        """Raise `ValueError` for each named field that is set but zero or negative."""
        for name in names:
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive or None, not {value}")


@dataclass(frozen=True)
class CellReply:
    """What a backend's transport knows of a cell once it has finished (see `RunningCell`).

    Attributes:
        execution_count: the kernel's execution counter for the cell, when it reported one.
        raised: whether user code raised, when the transport's reply says so (a Jupyter
            ``execute_reply``'s status); None to judge by whether an ``error`` output came.
        error: the exception as the reply reports it, used when no ``error`` output came for
            it (a reply-only failure, a cell stopped from outside); None if none.
        msg_id: the Jupyter ``execute_request`` id, for backends that talk Jupyter's protocol
            (so that late output can be matched to the cell); None for the others.
        state_lost: True when the backend itself had to restart the kernel (its own deadline
            ended the cell), so the cell counts as timed out with its state lost.
    """

    execution_count: int | None = None
    raised: bool | None = None
    error: CellError | None = None
    msg_id: str | None = None
    state_lost: bool = False


def cell_result(
    outputs: CellOutputs,
    reply: CellReply,
    *,
    timeout_s: float | None,
    interrupts: int,
    state_lost: bool,
    started_at: datetime,
    duration_s: float,
) -> CellResult:
    """Build a finished cell's `CellResult`, the same way for every backend.

    A cell that was interrupted or restarted after its deadline has status ``"timeout"`` and
    a `TIMEOUT_ENAME` error (also added as an ``error`` output when the kernel sent none, or
    when a restart cut it off). Otherwise the status is ``"error"`` when user code raised (as
    the reply says, or else as an ``error`` output or the reply's error shows), with the last
    ``error`` output as the error. ``execute_result`` outputs get the reply's execution count.

    Args:
        outputs: what the cell produced (the collector gets the error output, if any is added).
        reply: what the transport said once the cell finished.
        timeout_s: the cell's deadline, for the timeout message.
        interrupts: how many interrupts the deadline took (0 when it never passed).
        state_lost: True when the kernel was restarted (by the deadline or by the backend).
        started_at: when the cell was sent.
        duration_s: seconds from sending the cell to its end.
    """
    collector = outputs.collector
    state_lost = state_lost or reply.state_lost
    status: Literal["ok", "error", "timeout"] = "ok"
    error = None
    if interrupts or state_lost:
        status = "timeout"
        how = "interrupted" + (" on the second try" if interrupts == 2 else "")
        if state_lost:
            how = "the kernel was restarted, state lost"
        error = CellError(
            ename=TIMEOUT_ENAME, evalue=f"cell exceeded its {timeout_s} s timeout; {how}"
        )
        if state_lost or not collector.has_error():
            collector.append_error(error.ename, error.evalue, error.traceback)
    elif reply.raised or (
        reply.raised is None and (reply.error is not None or collector.has_error())
    ):
        status = "error"
        if not collector.has_error():
            missing = reply.error or CellError(ename="UnknownError", evalue="the cell failed")
            collector.append_error(missing.ename, missing.evalue, missing.traceback)
    result_outputs = collector.outputs
    if status == "error":
        last = [o for o in result_outputs if o["output_type"] == "error"][-1]
        error = CellError(ename=last["ename"], evalue=last["evalue"], traceback=last["traceback"])
    if reply.execution_count is not None:
        for output in result_outputs:
            if output["output_type"] == "execute_result":
                output["execution_count"] = reply.execution_count
    return CellResult(
        status=status,
        execution_count=reply.execution_count,
        outputs=result_outputs,
        error=error,
        started_at=started_at,
        duration_s=duration_s,
        interrupted=bool(interrupts) and not state_lost,
        state_lost=state_lost,
        msg_id=reply.msg_id,
        output_chars=collector.total_chars,
        omitted_chars=collector.omitted_chars,
        display_ids=collector.display_ids,
        display_updates=collector.display_updates,
        widget_state=collector.widget_state,
    )


class RunningCell(abc.ABC):
    """One cell in flight: the transport half of `Sandbox.run_cell`.

    Made by a backend's `Sandbox._start_cell`. `Sandbox.run_cell` calls `wait` until it returns
    True; when it returns False (the deadline passed), `interrupt` with the attempt number and
    `wait` again with the grace period as the deadline; when the backend's interrupts are spent,
    `abandon` and then `Sandbox.restart`. Last, `finish` (with ``state_lost`` after a
    restart). A cancelled call interrupts the cell the same way, at once, before the
    cancellation is raised. On any error, `abandon`. Outputs go to the `CellOutputs` given to
    `Sandbox._start_cell` as they arrive.
    """

    @abc.abstractmethod
    async def wait(self, deadline: float | None) -> bool:
        """Wait until the cell has finished, its outputs all in, or until ``deadline``.

        Args:
            deadline: a `time.monotonic` time; None for no deadline.

        Returns:
            True when the cell finished; False when the deadline passed, or earlier when the
            backend already knows that its interrupt failed.

        Raises:
            SandboxDiedError: the kernel ended.
        """

    @abc.abstractmethod
    async def interrupt(self, attempt: int) -> None:
        """Interrupt the cell after its deadline; ``attempt`` counts from 1."""

    @abc.abstractmethod
    async def abandon(self) -> None:
        """Stop waiting for the cell and release what waits for it. Safe to call twice."""

    @abc.abstractmethod
    async def finish(self, *, state_lost: bool) -> CellReply:
        """What the finished cell's reply says; called once, after `wait` returned True or a
        restart (``state_lost``).

        Raises:
            SandboxDiedError: the cell ended the kernel (``exit()``, a crash).
            SandboxNotFoundError: the sandbox went away during the cell.
            SandboxUnavailableError: the connection failed; the cell may or may not have run.
        """


class Sandbox(abc.ABC):
    """One live execution environment whose state persists between cells.

    Made by `create` or reached again with `attach`; the backend blocks
    (`prefect_sandbox.blocks`) call these with their config, and tasks pass the resulting
    `handle` around, never the live object. Every path inside the sandbox is relative to its
    working directory; paths that leave it raise `UnsafePathError`. User code that raises is
    data, not an exception: `run_cell` returns a `CellResult` with ``error`` set, and the caller
    decides what to do.

    ``async with sandbox:`` kills it on exit.

    A live sandbox holds sockets, clients and an event loop's tasks, so it refuses pickling
    (and copying) with a `TypeError`: task runners that move work to other processes (Dask,
    Ray) get its `handle` instead.

    A backend whose SDK is an optional extra imports it lazily, and raises
    `BackendNotInstalledError` (naming the extra) from the first call that needs it.

    `run_cell` is written here once; a backend supplies the transport through two hooks,
    `_prepare_cell` and `_start_cell`, and the `RunningCell` the latter returns.
    """

    _config: SandboxConfig
    """The sandbox's settings; each backend sets it to its own config."""

    _interrupts_before_restart: ClassVar[int] = 2
    """How many interrupts a timed-out cell gets before its kernel is restarted."""

    _cancelled_cell: CellResult | None = None
    """The last cancelled call's cell, as it stopped (`take_cancelled_cell`)."""

    @classmethod
    @abc.abstractmethod
    async def create(cls, config: Any, labels: Mapping[str, str] | None = None) -> Self:
        """Make a new sandbox and wait until it can run cells.

        Called by the backend block's ``create`` (the ``create-sandbox`` task). A failure
        halfway through kills what was started before the error is raised.

        Args:
            config: the backend's settings, an instance of its `SandboxConfig` subclass.
            labels: labels to find the sandbox by later (flow run id and name, our marker).

        Returns:
            The live sandbox.

        Raises:
            BackendNotInstalledError: the backend's extra is not installed.
            SandboxAuthError: the backend refused the credentials.
            SandboxUnavailableError: the backend stayed busy or unreachable through retries.
            SandboxDiedError: the sandbox's kernel ended while starting.
            SandboxError: the backend refused the settings.
        """

    @classmethod
    @abc.abstractmethod
    async def attach(cls, handle: SandboxHandle, config: Any) -> Self:
        """Reach a sandbox again from its handle, from any task, thread or process.

        Called by the backend block's ``attach`` (every task after ``create-sandbox``, and the
        flow's cancellation hooks). Never makes a new sandbox in place of a gone one.

        Args:
            handle: the sandbox's handle, as `handle` gave it.
            config: the backend's settings, as for `create`.

        Returns:
            A live sandbox with its state as it was.

        Raises:
            BackendNotInstalledError: the backend's extra is not installed.
            SandboxNotFoundError: the sandbox was killed or expired.
            SandboxAuthError, SandboxUnavailableError: as for `create`.
        """

    @classmethod
    @abc.abstractmethod
    async def list_handles(
        cls, config: Any, labels: Mapping[str, str] | None = None
    ) -> list[SandboxHandle]:
        """Handles of live sandboxes whose labels include ``labels``.

        Called by the backend block's ``list_sandboxes``, for cleanup (the flow's
        cancellation and crash hooks, the reaper).

        Args:
            config: the backend's settings, as for `create`.
            labels: labels every returned sandbox carries; None or empty for all.

        Returns:
            Handles sorted by sandbox id.

        Raises:
            BackendNotInstalledError: the backend's extra is not installed.
            SandboxAuthError, SandboxUnavailableError: as for `create`.
        """

    @property
    @abc.abstractmethod
    def handle(self) -> SandboxHandle:
        """The address of this sandbox, to pass between tasks, threads and processes."""

    async def run_cell(
        self,
        code: str,
        *,
        timeout_s: float | None = None,
        on_output: OutputCallback | None = None,
    ) -> CellResult:
        """Run one cell of code and wait for it to finish.

        On the deadline the cell is interrupted; if it is still busy ``interrupt_grace_s``
        later, it is interrupted once more where the backend has a second try
        (`_interrupts_before_restart`) and given a second; then the kernel is restarted and the
        result says ``state_lost``. The cell is never sent twice.

        A cancelled call (a cancelled task, ``asyncio.wait_for``, an anyio cancel scope) stops
        its cell the same way, at once: interrupts, then a restart if they are ignored, shielded
        from further cancellation; only then is the cancellation raised, so the kernel is idle
        for the next call. What the cell made until it stopped is kept for
        `take_cancelled_cell`.

        Args:
            code: the cell's source.
            timeout_s: seconds before the cell is interrupted; None or -1 (`NO_TIMEOUT`) for
                no deadline (see `checked_timeout_s`).
            on_output: called with each output as it arrives.

        Returns:
            The cell's result; ``status`` is ``"timeout"`` when the deadline passed.

        Raises:
            ValueError: ``timeout_s`` is zero, negative other than -1, NaN or infinite.
            SandboxDiedError: the sandbox's kernel ended before or during the cell; its
                ``outputs`` are what the cell made before.
            SandboxNotFoundError: the sandbox was killed or expired (``outputs`` as above).
            SandboxUnavailableError: the connection failed during the cell; the cell may or
                may not have run, and is not run again.
        """
        timeout_s = checked_timeout_s(timeout_s)
        await self._prepare_cell()
        outputs = CellOutputs(self._config.max_output_chars, on_output)
        started_at = datetime.now(UTC)
        start = time.monotonic()
        cell = await self._start_cell(code, outputs, timeout_s)
        deadline = None if timeout_s is None else start + timeout_s
        try:
            interrupts, state_lost = await self._wait_or_stop(cell, deadline, "cell")
            outputs.flush()
            reply = await cell.finish(state_lost=state_lost)
        except (SandboxDiedError, SandboxNotFoundError) as exc:
            await cell.abandon()
            # What the cell made before the end stays with it (the notebook shows it).
            outputs.flush()
            exc.outputs = outputs.collector.outputs
            raise
        except asyncio.CancelledError:
            self._cancelled_cell = await self._stop_cancelled(cell, outputs, started_at, start)
            raise
        except BaseException:
            await cell.abandon()
            raise
        return cell_result(
            outputs,
            reply,
            timeout_s=timeout_s,
            interrupts=interrupts,
            state_lost=state_lost,
            started_at=started_at,
            duration_s=time.monotonic() - start,
        )

    async def _wait_or_stop(
        self, cell: RunningCell, deadline: float | None, what: str
    ) -> tuple[int, bool]:
        """Wait for ``cell`` until ``deadline``, then stop it: interrupts, each with its grace
        period, then a restart. ``what`` names the cell in the log.

        Returns:
            The interrupts sent, and whether the kernel was restarted (state lost).
        """
        interrupts = 0
        while not await cell.wait(deadline):
            if interrupts == self._interrupts_before_restart:
                logger.warning(
                    "Sandbox %s: %s still busy after %d interrupt(s); restarting its kernel, "
                    "state lost",
                    self.handle.sandbox_id,
                    what,
                    interrupts,
                )
                await cell.abandon()
                await self.restart()
                return interrupts, True
            interrupts += 1
            await cell.interrupt(interrupts)
            grace_s = self._config.interrupt_grace_s if interrupts == 1 else SECOND_INTERRUPT_S
            deadline = time.monotonic() + grace_s
        return interrupts, False

    async def _stop_cancelled(
        self, cell: RunningCell, outputs: CellOutputs, started_at: datetime, start: float
    ) -> CellResult:
        """Stop a cell whose call was cancelled, as its deadline would: interrupts, then a
        restart when it ignores them. A sandbox lost meanwhile is logged, not raised: the
        cancellation is what the caller gets, and the next call finds the loss.

        Returns:
            The cell up to where it stopped: status ``"error"`` with no error of its own,
            ``interrupted`` or ``state_lost`` saying how it stopped.
        """
        state_lost = False
        interrupts = 0
        with anyio.CancelScope(shield=True):
            try:
                interrupts, state_lost = await self._wait_or_stop(
                    cell, time.monotonic(), "a cancelled call's cell"
                )
                outputs.flush()
                reply = await cell.finish(state_lost=state_lost)
            except SandboxError as exc:
                await cell.abandon()
                outputs.flush()
                logger.warning(
                    "Sandbox %s: a cancelled call's cell could not be stopped cleanly: %s",
                    self.handle.sandbox_id,
                    exc,
                )
                reply = CellReply()
                state_lost = state_lost or isinstance(exc, SandboxDiedError | SandboxNotFoundError)
        return CellResult(
            status="error",
            execution_count=reply.execution_count,
            outputs=outputs.collector.outputs,
            started_at=started_at,
            duration_s=time.monotonic() - start,
            interrupted=bool(interrupts) and not state_lost,
            state_lost=state_lost,
            msg_id=reply.msg_id,
            output_chars=outputs.collector.total_chars,
            omitted_chars=outputs.collector.omitted_chars,
        )

    def take_cancelled_cell(self) -> CellResult | None:
        """What the last cell whose `run_cell` was cancelled made before it was stopped, once.

        Returns:
            Its outputs up to the stop (an interrupt's ``KeyboardInterrupt`` included),
            status ``"error"``, ``interrupted`` or ``state_lost`` saying how it was stopped;
            None when no call was cancelled since the last take.
        """
        cancelled, self._cancelled_cell = self._cancelled_cell, None
        return cancelled

    @abc.abstractmethod
    async def _prepare_cell(self) -> None:
        """Make the sandbox ready to run a cell, before the cell's clock starts.

        Raises:
            SandboxDiedError: its kernel is known to have ended.
            SandboxNotFoundError: the sandbox was killed or expired.
        """

    @abc.abstractmethod
    async def _start_cell(
        self, code: str, outputs: CellOutputs, timeout_s: float | None
    ) -> RunningCell:
        """Send the cell to the kernel; pure transport, called once per cell by `run_cell`.

        Args:
            code: the cell's source.
            outputs: where the cell's outputs go as they arrive.
            timeout_s: the cell's deadline, for a backend that sets a backstop of its own.

        Returns:
            The cell in flight.
        """

    @abc.abstractmethod
    async def take_late_outputs(self) -> dict[str, list[dict[str, Any]]]:
        """Output that earlier cells' background threads printed after those cells ended.

        Output a kernel attributes to the cell running when it was printed stays in that
        cell's result; this returns only what arrived between cells or for cells already done.

        Returns:
            The earlier cell's ``CellResult.msg_id`` to its late nbformat outputs; each output
            is returned once.
        """

    def _missing_file(self, path: str) -> FileTransferError:
        """The error for ``path``, which `download` did not find as a file in the sandbox."""
        sandbox_id = self.handle.sandbox_id
        return FileTransferError(
            f"file {path!r} is not in sandbox {sandbox_id}", path=path, sandbox_id=sandbox_id
        )

    @abc.abstractmethod
    async def upload(self, src: Path, dest: str) -> None:
        """Copy the local file ``src`` to ``dest`` inside the sandbox, making folders as needed.

        Raises:
            UnsafePathError: ``dest`` leaves the working directory.
            FileTransferError: the copy failed.
        """

    @abc.abstractmethod
    async def download(self, src: str, dest: Path, *, max_bytes: int | None = None) -> int:
        """Copy ``src`` from inside the sandbox to the local file ``dest``.

        Args:
            src: the file, relative to the working directory, as `list_files` gave it.
            dest: the local file to write; its folder is made if needed.
            max_bytes: the largest file copied, in bytes; None for no cap.

        Returns:
            The number of bytes copied.

        Raises:
            UnsafePathError: ``src`` leaves the working directory (a symlink included).
            FileTransferError: the file is missing, is not a regular file, is larger than
                ``max_bytes``, or the copy failed.
        """

    @abc.abstractmethod
    async def list_files(self, pattern: str = "**/*") -> list[RemoteFile]:
        """List files under the working directory that an artifact pattern names.

        A pattern that spells out an existing file's path names that file alone, glob
        characters and all; any other is a glob (`prefect_sandbox.sandbox.paths.matching_files`).
        Links may be listed (`download` refuses those that lead out), and, on backends that
        read the folder from this machine, special files too (`download` refuses them). A name
        that is not UTF-8 comes with surrogate escapes (as `os.fsdecode` gives it).

        Args:
            pattern: a glob relative to the working directory (``**`` crosses folders).

        Returns:
            Matching files, sorted by path.

        Raises:
            UnsafePathError: the pattern is absolute or climbs out with ``..``.
        """

    def keep_alive_period_s(self) -> float | None:
        """Seconds between `keep_alive` calls that keep an idle sandbox from its vendor's end
        (half E2B's lifetime, a quarter of Daytona's auto-stop); None when nothing ends it."""
        return None

    async def keep_alive(self) -> None:
        """Renew the sandbox's vendor-side lifetime now, as a cell does; nothing for a
        sandbox that no vendor ends.

        Raises:
            SandboxNotFoundError: the sandbox already ended.
            SandboxUnavailableError: the vendor could not be reached.
        """
        return None

    @abc.abstractmethod
    async def interrupt(self) -> None:
        """Interrupt the running cell, as Jupyter's stop button does."""

    @abc.abstractmethod
    async def restart(self) -> None:
        """Restart the kernel in place: same handle, files kept, variables and imports lost."""

    @abc.abstractmethod
    async def kill(self) -> bool:
        """End the sandbox and free what it holds. Idempotent.

        Returns:
            True if this call ended it, False if it was already gone.
        """

    @abc.abstractmethod
    async def close(self) -> None:
        """Drop this process's connection to the sandbox without ending the sandbox."""

    def __reduce__(self) -> NoReturn:
        """Refuse pickling and copying: a live sandbox holds connections of this process.

        Raises:
            TypeError: always; the message says to pass the handle instead.
        """
        raise TypeError(
            f"a live {type(self).__name__} cannot be pickled or copied: pass its handle "
            "(`sandbox.handle`, a SandboxHandle) and reach it again with "
            "`backend.attach(handle)` where it is needed"
        )

    async def __aenter__(self) -> Sandbox:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.kill()
