"""Sandbox sessions: code that an agent writes as it goes, one cell per call, in one sandbox per
flow run.

``sandbox_session(...)`` is used inside any flow (``async with`` or ``with``). It makes the flow
run's sandbox and uploads the inputs through the run's one lifecycle (`PipelineRun.running`, as
the pipeline flows do), and yields a session whose ``run_cell(code)`` runs one cell as a task
run ``run-cell-<step>`` and returns a `CellRun` (status, the text a model reads, the
`CellResult`): a failed cell is data, not an exception. With ``fix``, a failed step's fixer
gives the code of its next attempt. However the block is left, the sandbox is killed and the
executed notebook, artifacts and ``summary.json`` are stored as `run_notebook` stores them: a
session is a pipeline whose stages (one per step, ``cell-<step>``, one cell per attempt) are
decided at run time. Manual: docs/how-to/agents.md.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, ExitStack, asynccontextmanager
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, TypeVar, cast

import httpx
import nbformat
from anyio.from_thread import BlockingPortal, start_blocking_portal
from prefect import get_client, get_run_logger
from prefect.client.schemas import OrchestrationResult
from prefect.client.schemas.objects import FlowRun
from prefect.context import FlowRunContext
from prefect.exceptions import PrefectHTTPStatusError
from prefect.states import Cancelled
from prefect.utilities.annotations import quote
from pydantic import BaseModel

from prefect_sandbox.blocks.base import SandboxBackend
from prefect_sandbox.flows.errors import FixerError, SessionFailedError
from prefect_sandbox.flows.pipeline_run import PipelineRun, new_run
from prefect_sandbox.options import RunOptions, check_options
from prefect_sandbox.results import StageResult
from prefect_sandbox.sandbox.base import (
    CellResult,
    RemoteFile,
    Sandbox,
    SandboxHandle,
    checked_timeout_s,
)
from prefect_sandbox.sandbox.errors import CellTimeoutError, SandboxDiedError, SandboxError
from prefect_sandbox.sandbox.model_text import DEFAULT_MODEL_TEXT_CHARS, cell_text
from prefect_sandbox.sandbox.notebook import METADATA_KEY, CellSpec, StageSpec
from prefect_sandbox.tasks.sandbox import (
    cell_failure,
    download_artifacts,
    partial_stage_result,
    restart_kernel,
    reusing,
    run_stage,
    stage_progress,
)
from prefect_sandbox.tasks.scopes import shielded

if TYPE_CHECKING:
    from prefect_aws import S3Bucket

__all__ = [
    "DEFAULT_FIX_ATTEMPTS",
    "DEFAULT_MAX_IDLE_S",
    "SESSION_SUMMARY_KEY",
    "CellRun",
    "Fixer",
    "SandboxSession",
    "SessionContext",
    "SyncSandboxSession",
    "sandbox_session",
]

SESSION_SUMMARY_KEY = "session-summary"
"""The key of the markdown artifact a session posts on its flow run."""

DEFAULT_MAX_IDLE_S = 3600.0
"""Seconds an open session keeps its remote sandbox alive with no call, by default."""

DEFAULT_FIX_ATTEMPTS = 3
"""Attempts a step with a fixer gets when ``max_attempts`` is not given: the first, and two
fixes."""

# Made once: each Task made with with_options hashes its function's source (milliseconds).
_run_attempt = run_stage.with_options(task_run_name="run-{stage.name}")

T = TypeVar("T")


class CellRun(BaseModel):
    """What one `SandboxSession.run_cell` call gave: its last attempt.

    Attributes:
        step: the call's number in the session, from 1 (its task run is ``run-cell-<step>``).
        attempt: which attempt this is, from 1 (a fixer's code is attempt 2 and on).
        code: the code that attempt ran.
        status: ``"ok"``, ``"error"`` (the code raised) or ``"timeout"``.
        text: the outputs rendered for a model (`cell_text`), capped.
        cell: the full result.
        cell_index: the attempt's 0-based index in the executed notebook.
    """

    step: int
    attempt: int
    code: str
    status: Literal["ok", "error", "timeout"]
    text: str
    cell: CellResult
    cell_index: int


Fixer = Callable[[str, CellRun], "str | Awaitable[str | None] | None"]
"""``fixer(code, report)``: given the code that failed and its `CellRun` (``report.text`` is
what a model reads), the code to try next, or None to give up. Sync or async."""


def _untraversed(value: T) -> T:
    """``value`` in Prefect's `quote`, for a task's parameter: passed as it is, without Prefect
    walking it for futures and states to resolve (its blocks and models hold none), which
    took a few milliseconds of each session call."""
    return cast(T, quote(value))


def _checked_code(code: object, what: str) -> str:
    if not isinstance(code, str):
        raise TypeError(f"{what} must be Python source as a str, not {type(code).__name__}")
    return code


def _checked_attempts(max_attempts: int | None, fix: Fixer | None) -> int:
    """A step's attempts at most: ``max_attempts``, else `DEFAULT_FIX_ATTEMPTS` with a fixer
    and 1 without. Raises ValueError for one that is not an int of at least 1."""
    if max_attempts is None:
        return 1 if fix is None else DEFAULT_FIX_ATTEMPTS
    if isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1:
        raise ValueError(f"max_attempts must be an int of at least 1, not {max_attempts!r}")
    return max_attempts


def _merge_attempt(step: StageResult, attempt: StageResult) -> None:
    """Add an attempt's cell to its step's result; the step's status is its last attempt's."""
    step.cells.extend(attempt.cells)
    step.late_outputs.update(attempt.late_outputs)
    step.duration_s += attempt.duration_s
    last = attempt.cells[-1] if attempt.cells else None
    failed = last is not None and last.result.status != "ok"
    step.status = "cancelled" if attempt.status == "cancelled" else "failed" if failed else "ok"
    step.failed_cell_index = last.index if failed and last else None
    step.error = last.result.error if failed and last else None


RESTARTED_AFTER_DEATH = (
    "; a fresh kernel was started: variables and imports are gone, files in the working "
    "directory are kept"
)
"""What the error of a cell during which the kernel died says once the session has started a
fresh one."""


def _restarted_after_death(stopped: StageResult) -> StageResult:
    """``stopped`` (its last cell the one the kernel died in), that cell's error saying that a
    fresh kernel was started."""
    record = stopped.cells[-1]
    died = record.result
    error = died.error
    if error is not None:
        error = error.model_copy(update={"evalue": error.evalue + RESTARTED_AFTER_DEATH})
        outputs = [*died.outputs[:-1], {**died.outputs[-1], "evalue": error.evalue}]
        record.result = died.model_copy(update={"error": error, "outputs": outputs})
    stopped.error = error
    return stopped


class SandboxSession:
    """One flow run's sandbox, running cells decided at run time; made by `sandbox_session`.

    A session runs one cell at a time (calls made at once run in turn). Its `handle` may be
    passed to other tasks, on any task runner, to reach the same sandbox and state.
    """

    def __init__(
        self,
        run: PipelineRun,
        sandbox: Sandbox,
        *,
        cell_timeout_s: float | None,
        max_text_chars: int,
        max_idle_s: float | None = None,
    ) -> None:
        self._run = run
        # Attached once: every call's task uses it (`reusing`), instead of a client of its own.
        self._sandbox = sandbox
        self._handle = sandbox.handle
        self._cell_timeout_s = cell_timeout_s
        self._max_text_chars = max_text_chars
        self._max_idle_s = max_idle_s
        self._steps = 0
        self._open = True
        self._turn = asyncio.Lock()
        self._last_call_at = time.monotonic()

    @property
    def handle(self) -> SandboxHandle:
        """The sandbox's handle."""
        return self._handle

    @property
    def backend(self) -> SandboxBackend:
        """The backend block the sandbox was made with."""
        return self._run.backend

    def end(self) -> None:
        """Refuse any later call; the session's block is being left."""
        self._open = False

    async def close(self) -> None:
        """Drop the session's connection to its sandbox (not the sandbox), once it has ended."""
        await self._sandbox.close()

    async def keep_alive(self) -> None:
        """Renew the sandbox's vendor-side lifetime while the session is open and waits for
        calls (E2B's lifetime, Daytona's auto-stop), through the backend's own calls; runs
        until cancelled. It stops renewing once no call came for ``max_idle_s``, and goes on
        at the next call. A failed renewal is a warning: the next call finds a lost sandbox.
        """
        period_s = self._sandbox.keep_alive_period_s()
        while period_s is not None:
            await asyncio.sleep(period_s)
            idle_s = time.monotonic() - self._last_call_at
            if self._max_idle_s is not None and idle_s > self._max_idle_s:
                continue
            try:
                await self._sandbox.keep_alive()
            except SandboxError as exc:
                get_run_logger().warning(
                    "Sandbox %s: lifetime not renewed while idle: %s", self._handle.sandbox_id, exc
                )

    @asynccontextmanager
    async def kept_alive(self) -> AsyncIterator[None]:
        """Within, the sandbox's lifetime is renewed while idle (`keep_alive`); on exit the
        session ends (`end`) and drops its connection (`close`), shielded."""
        keeper = asyncio.create_task(self.keep_alive())
        try:
            yield
        finally:
            self.end()
            keeper.cancel()
            with shielded():
                await asyncio.gather(keeper, return_exceptions=True)
                await self.close()

    async def settled(self) -> None:
        """Wait until no cell of this session is running, or recording how it ended."""
        async with self._turn:
            pass

    def _check_open(self) -> None:
        if not self._open:
            raise RuntimeError(
                f"this sandbox session has ended (its sandbox {self._handle.sandbox_id} is "
                "killed): run cells inside its `async with sandbox_session(...)` block, or open "
                "a new session"
            )

    async def run_cell(
        self,
        code: str,
        *,
        timeout_s: float | None = None,
        fix: Fixer | None = None,
        max_attempts: int | None = None,
        raise_on_error: bool = False,
    ) -> CellRun:
        """Run one step: ``code`` as a cell, then, while it fails and attempts remain, the code
        ``fix`` gives for it.

        Each attempt is a task run (``run-cell-3``, then ``run-cell-3-attempt-2``...) whose
        output goes to the run log, and a cell of the executed notebook whose
        ``metadata.prefect_sandbox`` holds its ``step`` and ``attempt``.

        A kernel that dies in a cell (``exit()``, ``os._exit``, a crash, the OOM killer) is
        restarted (task ``restart-kernel``); the attempt ends as a ``SandboxDiedError`` error
        saying the state is gone. A cancelled call (``asyncio.wait_for``, a tool timeout)
        stops its cell as a timeout does before the cancellation is raised, so the next call
        runs at once; the notebook keeps the outputs, then ``RunCancelled`` saying how.

        Args:
            code: the cell's source.
            timeout_s: seconds each attempt may run, -1 for no limit; None takes the session's
                ``cell_timeout_s``, else the backend block's.
            fix: called after a failed attempt (error or timeout) as ``fix(code, report)``; it
                returns the next attempt's code, or None to give up. A sync fixer runs in a
                worker thread, an async one on the flow's event loop. The session is free
                while it runs: a fixer may run cells on it (probes, say), each a step of its
                own, numbered and stored as any other.
            max_attempts: attempts at most, the first included; None takes
                `DEFAULT_FIX_ATTEMPTS` with ``fix``, else 1 (no fixing).
            raise_on_error: raise for a step whose last attempt failed, instead of returning it.

        Returns:
            The last attempt.

        Raises:
            RuntimeError: the session has ended.
            TypeError: ``code`` is not a str.
            ValueError: ``max_attempts`` is below 1, or ``timeout_s`` is zero, negative other
                than -1, NaN or infinite.
            FixerError: the fixer raised, returned something other than a str or None, or
                returned the code that just failed (the attempts so far are kept).
            CellExecutionError, CellTimeoutError: with ``raise_on_error``, the step failed.
            SandboxNotFoundError: the sandbox went away (killed, expired).
            SandboxError: the kernel died and a fresh one could not be started.
        """
        self._check_open()
        _checked_code(code, "code")
        max_attempts = _checked_attempts(max_attempts, fix)
        if timeout_s is None:
            timeout_s = self._cell_timeout_s
        else:
            checked_timeout_s(timeout_s, "timeout_s")
        self._last_call_at = time.monotonic()
        async with self._turn:
            self._check_open()
            self._steps += 1
            step = self._steps
            spec, result = self._run.add_stage(f"cell-{step}")
            done = await self._attempt(spec, result, step, 1, code, timeout_s)
        while done.status != "ok" and fix is not None and done.attempt < max_attempts:
            # Unlocked: the fixer may run cells of its own on this session.
            fixed = await self._fixed(fix, done)
            if fixed is None:
                break
            async with self._turn:
                self._check_open()
                done = await self._attempt(spec, result, step, done.attempt + 1, fixed, timeout_s)
        self._last_call_at = time.monotonic()
        if raise_on_error and done.status != "ok":
            cell = CellSpec(index=done.cell_index, source=done.code)
            raise cell_failure(spec.name, cell, done.cell, checked_timeout_s(timeout_s))
        return done

    async def _attempt(
        self,
        spec: StageSpec,
        step_result: StageResult,
        step: int,
        attempt: int,
        code: str,
        timeout_s: float | None,
    ) -> CellRun:
        index = self._run.executed.add_code_cell(code, step=step, attempt=attempt)
        cell = CellSpec(index=index, source=code)
        spec.cells.append(cell)
        name = spec.name if attempt == 1 else f"{spec.name}-attempt-{attempt}"
        with stage_progress() as progress, reusing(self._sandbox):
            try:
                outcome = await _run_attempt(
                    _untraversed(self._run.backend),
                    _untraversed(self._handle),
                    _untraversed(StageSpec(name=name, cells=[cell])),
                    timeout_s,
                    allow_errors=True,
                )
            except CellTimeoutError as exc:
                # A timeout is data for the agent too; run_stage raises it even when errors
                # are allowed, so that a pipeline stops.
                partial = partial_stage_result(exc)
                if partial is None:
                    raise
                outcome = partial
            except SandboxDiedError as exc:
                # So is a death (exit(), os._exit, a crash, the OOM killer): the session goes
                # on in a fresh kernel, and the model is told its state is gone.
                partial = partial_stage_result(exc)
                if partial is None or not partial.cells:
                    raise
                await restart_kernel(self._run.backend, self._handle)
                outcome = _restarted_after_death(partial)
            except (SandboxError, asyncio.CancelledError) as exc:
                partial = partial_stage_result(exc, progress)
                if partial is not None:
                    _merge_attempt(step_result, partial)
                raise
        _merge_attempt(step_result, outcome)
        ran = outcome.cells[-1].result
        return CellRun(
            step=step,
            attempt=attempt,
            code=code,
            status=ran.status,
            text=cell_text(ran, cell_index=index, max_chars=self._max_text_chars),
            cell=ran,
            cell_index=index,
        )

    async def _fixed(self, fix: Fixer, failed: CellRun) -> str | None:
        """The fixer's code for a failed attempt, checked; None when it gives up."""
        where = f"step {failed.step} (run-cell-{failed.step}), attempt {failed.attempt}"
        try:
            if inspect.iscoroutinefunction(fix):
                fixed = await fix(failed.code, failed)
            else:
                # In a thread: a sync fixer (an LLM client's call) must not stall the loop
                # that renews the sandbox's slot and watches for cancellation.
                fixed = await asyncio.to_thread(fix, failed.code, failed)
            if inspect.isawaitable(fixed):
                fixed = await fixed
        except Exception as exc:
            message = f"{where}: the fixer raised {type(exc).__name__}: {exc}"
            cell = self._run.executed.notebook.cells[failed.cell_index]
            cell.metadata[METADATA_KEY]["fix_error"] = message
            raise FixerError(message, step=failed.step, attempt=failed.attempt) from exc
        if fixed is None:
            return None
        if not isinstance(fixed, str):
            raise FixerError(
                f"{where}: the fixer returned a {type(fixed).__name__}; it must return the "
                "next attempt's code as a str, or None to give up",
                step=failed.step,
                attempt=failed.attempt,
            )
        if fixed.strip() == failed.code.strip():
            raise FixerError(
                f"{where}: the fixer returned the code that just failed; it must change it, or "
                "return None to give up",
                step=failed.step,
                attempt=failed.attempt,
            )
        return fixed

    async def restart(self) -> None:
        """Restart the sandbox's kernel (the ``restart-kernel`` task), in turn with the
        session's cells: files in the working directory kept, variables and imports lost.

        Raises:
            RuntimeError: the session has ended.
            SandboxNotFoundError: the sandbox was killed or expired.
            SandboxError: the kernel could not be started again.
        """
        self._check_open()
        async with self._turn:
            self._check_open()
            with reusing(self._sandbox):
                await restart_kernel(self._run.backend, self._handle)

    async def list_files(self, pattern: str = "**/*") -> list[RemoteFile]:
        """The sandbox's files matching a glob relative to its working directory, by path.

        Raises:
            RuntimeError: the session has ended.
            UnsafePathError: the pattern is absolute or climbs out with ``..``.
        """
        self._check_open()
        sandbox = await self._run.backend.attach(self._handle)
        try:
            return await sandbox.list_files(pattern)
        finally:
            await sandbox.close()

    async def download(self, patterns: list[str], folder: str) -> list[str]:
        """Copy the sandbox's files matching globs into a local folder now (the
        ``download-artifacts`` task), keeping their relative paths.

        Returns:
            The relative paths copied.

        Raises:
            RuntimeError: the session has ended.
        """
        self._check_open()
        return await download_artifacts(self._run.backend, self._handle, patterns, folder)


_WAKE_S = 0.1
"""Seconds a sync session's call waits at a time for its result (see `SyncSandboxSession`)."""


_sessions_opened: dict[tuple[str, int], int] = {}
"""Sessions opened so far in each flow run attempt of this process, by flow run id and
``run_count``."""


async def _end_flow_run_cancelled(flow_run: FlowRun, message: str) -> None:
    """Set the session's flow run Cancelled, as a pipeline flow ends, before the cancellation
    is re-raised: Prefect's engine takes a BaseException raised once its flow run is final as
    raised after the run ended (not as a crash), and the flow's caller gets `CancelledRun`.
    Where the API refuses, the run ends Crashed as before (a warning says why)."""
    try:
        async with get_client() as client:
            answer: OrchestrationResult[Any] = await client.set_flow_run_state(
                flow_run.id, Cancelled(message=message), force=True
            )
    except (httpx.HTTPError, PrefectHTTPStatusError) as exc:
        get_run_logger().warning("Flow run %s not set Cancelled: %s", flow_run.name, exc)
        return
    if answer.state is not None:
        flow_run.state = answer.state  # the engine's own copy: it reads this one


def _session_suffix() -> str:
    """What the folder and artifact key of the session being opened add to the flow run's:
    nothing for its attempt's first, ``-session-<n>`` for the n-th (nested or in turn), so
    that sessions never store over each other; each attempt counts from 1 again."""
    context = FlowRunContext.get()
    if context is None or context.flow_run is None:
        return ""  # refused by new_run
    key = (str(context.flow_run.id), context.flow_run.run_count)
    number = _sessions_opened[key] = _sessions_opened.get(key, 0) + 1
    return "" if number == 1 else f"-session-{number}"


@asynccontextmanager
async def _open_session(
    backend: SandboxBackend | None,
    inputs: list[str],
    artifacts: list[str],
    storage: S3Bucket | str | None,
    cell_timeout_s: float | None,
    max_text_chars: int,
    max_idle_s: float | None,
) -> AsyncIterator[SandboxSession]:
    suffix = _session_suffix()
    run, flow_run = await new_run(
        nbformat.v4.new_notebook(), [], backend, storage, "a sandbox session", folder_suffix=suffix
    )
    async with run.running(
        flow_run,
        inputs=inputs,
        artifacts=artifacts,
        summary=(SESSION_SUMMARY_KEY + suffix, "Sandbox session summary"),
    ) as handle:
        if handle is not None:
            session = SandboxSession(
                run,
                await run.connected(handle),
                cell_timeout_s=cell_timeout_s,
                max_text_chars=max_text_chars,
                max_idle_s=max_idle_s,
            )
            async with session.kept_alive():
                yield session
    await _ended(run, flow_run)


async def _ended(run: PipelineRun, flow_run: FlowRun) -> None:
    """The session's end, from its run's outcome: a cancelled run's flow run set Cancelled,
    then what left the block (or the set-up) raised again as it is, else a failure to collect
    or store raised as `SessionFailedError`."""
    outcome, result = run.outcome, run.result
    assert result is not None, "running stores the result on every way out"
    if outcome.cancelled:
        with shielded():
            await _end_flow_run_cancelled(flow_run, f"sandbox session {result.error}")
    if outcome.raised is not None:
        raise outcome.raised
    if outcome.failure is not None:
        raise SessionFailedError(
            result.error or "the session's files were not all stored",
            output_dir=run.store.output_dir,
            sandbox_id=run.sandbox_id,
        ) from outcome.failure


async def _in_context(context: contextvars.Context, call: Callable[[], Awaitable[T]]) -> T:
    """Await ``call()`` with the caller's context variables (Prefect's run contexts) set, in a
    task of the session's own event loop."""
    for var, value in context.items():
        var.set(value)
    return await call()


@asynccontextmanager
async def _context_around(
    context: contextvars.Context, manager: AbstractAsyncContextManager[T]
) -> AsyncIterator[T]:
    for var, value in context.items():
        var.set(value)
    async with manager as value:
        yield value


class SyncSandboxSession:
    """A `SandboxSession` for sync flows: the same methods, blocking. Its cells run on an event
    loop of its own, in a thread, with the flow run's context."""

    def __init__(
        self, session: SandboxSession, portal: BlockingPortal, context: contextvars.Context
    ) -> None:
        self._session = session
        self._portal = portal
        self._context = context

    @property
    def handle(self) -> SandboxHandle:
        """The sandbox's handle."""
        return self._session.handle

    @property
    def backend(self) -> SandboxBackend:
        """The backend block the sandbox was made with."""
        return self._session.backend

    def _call(self, call: Callable[[], Awaitable[T]]) -> T:
        self._session._check_open()
        future = self._portal.start_task_soon(_in_context, self._context, call)
        try:
            # In slices: the exception by which Prefect times out a sync flow outside the main
            # thread reaches this thread only between two Python instructions.
            while not concurrent.futures.wait([future], timeout=_WAKE_S).done:
                pass
            return future.result()
        except BaseException:
            # Raised in this thread while the call ran on (the flow's timeout comes so): stop
            # the call, and let it record what its cell did, before the block is left.
            if future.cancel():
                self._portal.call(self._session.settled)
            raise

    def run_cell(
        self,
        code: str,
        *,
        timeout_s: float | None = None,
        fix: Fixer | None = None,
        max_attempts: int | None = None,
        raise_on_error: bool = False,
    ) -> CellRun:
        """`SandboxSession.run_cell`, blocking (an async ``fix`` runs on the session's loop)."""
        return self._call(
            lambda: self._session.run_cell(
                code,
                timeout_s=timeout_s,
                fix=fix,
                max_attempts=max_attempts,
                raise_on_error=raise_on_error,
            )
        )

    def restart(self) -> None:
        """`SandboxSession.restart`, blocking."""
        self._call(self._session.restart)

    def list_files(self, pattern: str = "**/*") -> list[RemoteFile]:
        """`SandboxSession.list_files`, blocking."""
        return self._call(lambda: self._session.list_files(pattern))

    def download(self, patterns: list[str], folder: str) -> list[str]:
        """`SandboxSession.download`, blocking."""
        return self._call(lambda: self._session.download(patterns, folder))


class SessionContext:
    """What `sandbox_session` returns: ``async with`` it in an async flow (a `SandboxSession`),
    ``with`` it in a sync one (a `SyncSandboxSession`). Enter it once."""

    def __init__(self, **options: Any) -> None:
        self._options = options
        self._async: AbstractAsyncContextManager[SandboxSession] | None = None
        self._sync: ExitStack | None = None

    async def __aenter__(self) -> SandboxSession:
        self._async = _open_session(**self._options)
        return await self._async.__aenter__()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        assert self._async is not None, "the session was not entered with async with"
        return await self._async.__aexit__(exc_type, exc, tb)

    def __enter__(self) -> SyncSandboxSession:
        context = contextvars.copy_context()
        with ExitStack() as stack:
            portal = stack.enter_context(start_blocking_portal(name="prefect-sandbox-session"))
            manager = _context_around(context, _open_session(**self._options))
            session = stack.enter_context(portal.wrap_async_context_manager(manager))
            self._sync = stack.pop_all()
        return SyncSandboxSession(session, portal, context)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        assert self._sync is not None, "the session was not entered with with"
        return self._sync.__exit__(exc_type, exc, tb)


def sandbox_session(
    *,
    backend: SandboxBackend | None = None,
    inputs: list[str] | None = None,
    artifacts: list[str] | None = None,
    storage: S3Bucket | str | None = None,
    cell_timeout_s: float | None = None,
    max_text_chars: int = DEFAULT_MODEL_TEXT_CHARS,
    max_idle_s: float | None = DEFAULT_MAX_IDLE_S,
) -> SessionContext:
    """A sandbox for the current flow run, for cells decided as the flow goes.

    Use ``async with sandbox_session(...) as session:`` in an async flow, ``with`` in a sync
    one. Entering waits for a slot of the backend's live-sandbox cap (when it has one), makes
    the sandbox (labelled with the flow run for the reaper) and uploads ``inputs``. Leaving,
    however it happens, downloads ``artifacts``, kills the sandbox, and stores the artifacts,
    ``executed.ipynb`` (every attempt of every step, in order) and ``summary.json`` (one
    ``cell-<step>`` stage per step, its ``cell_count`` the attempts made), and posts the
    ``session-summary`` artifact, as `run_notebook` does. A flow run's second session and
    later (nested or in turn) store in a folder and an artifact key of their own, the run's
    with ``-session-<n>`` added; a retried flow run's attempt starts each afresh.

    Args:
        backend: the backend block; when empty, the saved block named by
            PREFECT_SANDBOX_BACKEND_BLOCK, else a local Jupyter kernel.
        inputs: local files or folders (or ``s3://`` URIs) uploaded into the sandbox first.
        artifacts: glob patterns, relative to the sandbox's working directory, of files to
            collect and store at the end.
        storage: where files are stored, as for `run_notebook`.
        cell_timeout_s: seconds a cell may run unless ``run_cell`` says otherwise, -1 for no
            limit; the backend block's ``cell_timeout_s`` when empty.
        max_text_chars: the most characters of a cell's rendering for a model (`CellRun.text`).
        max_idle_s: seconds the session keeps a remote sandbox alive (E2B's ``lifetime_s``,
            Daytona's auto-stop) while no call comes, by renewing it as a cell does; past it
            the vendor's own limit ends the sandbox. None: as long as the session is open.
            Each call starts the count again. Nothing ends a local kernel meanwhile.

    Returns:
        The session's context manager.

    Raises:
        ValueError: a parameter breaks a rule of `prefect_sandbox.options.RunOptions`
            (``cell_timeout_s`` zero, negative other than -1, NaN or infinite; an artifact
            pattern or ``s3://`` key that climbs, as `UnsafePathError`), ``max_text_chars``
            is below 100, or ``max_idle_s`` is not positive (here, before any sandbox starts).
        RuntimeError: on entering, outside a flow run.
        FileTransferError: on entering, an input could not be uploaded (the sandbox is killed
            and ``summary.json`` stored first).
        SessionFailedError: on leaving a block that raised nothing, files could not all be
            collected or stored. An exception the block raised leaves as it is, after storing.
        asyncio.CancelledError: the flow's task was cancelled (a signal, or the flow run set
            Cancelling through the API or UI); it is re-raised once the sandbox is killed, the
            files stored (``summary.json`` says ``"cancelled"``) and the flow run set
            Cancelled, so that it ends Cancelled (not Crashed) and its caller gets
            ``prefect.exceptions.CancelledRun``.
    """
    check_options(
        RunOptions,
        inputs=inputs,
        artifacts=artifacts,
        storage=storage,
        cell_timeout_s=cell_timeout_s,
    )
    if max_text_chars < 100:
        raise ValueError(f"max_text_chars must be at least 100, not {max_text_chars}")
    if max_idle_s is not None and not max_idle_s > 0:
        raise ValueError(
            f"max_idle_s must be a positive number of seconds or None, not {max_idle_s}"
        )
    return SessionContext(
        backend=backend,
        inputs=inputs or [],
        artifacts=artifacts or [],
        storage=storage,
        cell_timeout_s=cell_timeout_s,
        max_text_chars=max_text_chars,
        max_idle_s=max_idle_s,
    )
