"""How a run is stopped from outside, in one room; `prefect_sandbox.tasks.scopes` holds the
scopes its clean-up runs in. A run is stopped three ways, each a cancellation of its asyncio task
that the run takes as handled (`take_cancellation`), then kills its sandbox, stores what it made
and ends Cancelled, or TimedOut:

- a signal: SIGINT or SIGTERM to the CLI or a sync twin (`SignalStop`, `sync_twin`), a SIGINT
  a script inherited as ignored (`sigint_honoured`);
- the API's Cancelling (the UI's Cancel): polled by the run itself, since only a runner or a
  worker acts on it (`cancelled_from_api`, every ``PREFECT_SANDBOX_CANCEL_POLL_S``);
- Prefect's ``timeout_seconds``: its cancel scope cancels every await until the flow returns
  (`deadline_passed`), so the clean-up is shielded and the run ends TimedOut.

Prefect turns SIGTERM into its own exception only on the main thread's event loop; a sync twin
runs its flow on another thread, where nothing would catch it (docs/concepts.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import signal
import threading
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any, Literal, ParamSpec, TypeVar, cast
from uuid import UUID

import httpx
from prefect import get_run_logger
from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import StateType
from prefect.exceptions import PrefectHTTPStatusError
from prefect.flows import Flow
from prefect.utilities.asyncutils import run_coro_as_sync

from prefect_sandbox.sandbox.backends import cancel_and_wait
from prefect_sandbox.tasks.scopes import deadline_passed

__all__ = [
    "SignalStop",
    "cancelled_from_api",
    "sigint_honoured",
    "sync_twin",
    "take_cancellation",
    "uncancel_current_task",
]

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")

_STOPPING = frozenset({StateType.CANCELLING, StateType.CANCELLED})


def uncancel_current_task() -> None:
    """Take the current asyncio task's cancellation as handled, so the awaits of its clean-up
    (killing sandboxes, storing files) are not cancelled in turn."""
    task = asyncio.current_task()
    if task is not None:
        task.uncancel()


def take_cancellation() -> Literal["cancelled", "timed_out"]:
    """Take the cancellation just caught in the current task as the run's stop: ``"timed_out"``
    when its ``timeout_seconds`` passed (`deadline_passed`; Prefect's scope cancels each await
    until the flow returns, whatever is uncancelled here, so the clean-up's awaits are shielded
    instead), else ``"cancelled"``, the task uncancelled (`uncancel_current_task`)."""
    if deadline_passed():
        return "timed_out"
    uncancel_current_task()
    return "cancelled"


class SignalStop:
    """Within, the first of ``signals`` cancels what `run` runs (at once if it comes before):
    the pipeline flows then kill the sandbox, store what was made and end Cancelled. Later
    signals are ignored while that happens. Enter it on the main thread (signals are its).

    `run` runs its coroutine on an event loop in a worker thread: there Prefect's flow engine
    installs no SIGTERM handler of its own, which would raise out of the event loop wherever
    it stood.

    Args:
        signals: the signals that stop the run.
        on_signal: called (in the signal handler) when the first of them arrives, e.g. to
            quiet the console.

    Attributes:
        signum: the signal received, or None.
    """

    def __init__(
        self,
        signals: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM),
        on_signal: Callable[[], None] | None = None,
    ) -> None:
        self.signum: int | None = None
        self._signals = signals
        self._on_first = on_signal
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[Any] | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> SignalStop:
        self._previous = {sig: signal.signal(sig, self._on_signal) for sig in self._signals}
        return self

    def __exit__(self, *exc_info: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def run(self, make: Callable[[], Coroutine[Any, Any, T]]) -> T:
        """Run ``make()`` to its end and return its value, or raise what it raised
        (`asyncio.CancelledError` when a signal came before it started)."""
        outcome: list[tuple[bool, Any]] = []
        context = contextvars.copy_context()  # Prefect's settings context goes along

        def work() -> None:
            try:
                outcome.append((True, context.run(asyncio.run, self._main(make))))
            except BaseException as exc:
                outcome.append((False, exc))

        thread = threading.Thread(target=work, name="prefect-sandbox-flow")
        thread.start()
        thread.join()
        done, value = outcome[0]
        if not done:
            raise value
        return cast(T, value)

    async def _main(self, make: Callable[[], Coroutine[Any, Any, T]]) -> T:
        self._loop, self._task = asyncio.get_running_loop(), asyncio.current_task()
        if self.signum is not None:
            raise asyncio.CancelledError
        return await make()

    def _on_signal(self, signum: int, frame: object) -> None:
        if self.signum is not None:
            return
        self.signum = signum
        if self._on_first is not None:
            self._on_first()
        if self._loop is not None and self._task is not None:
            with contextlib.suppress(RuntimeError):  # the loop already closed: the run is over
                self._loop.call_soon_threadsafe(self._task.cancel)


@asynccontextmanager
async def sigint_honoured() -> AsyncIterator[None]:
    """Within, on the main thread's event loop where SIGINT is ignored (inherited so), the first
    SIGINT cancels the current task, as ``asyncio.run``'s own handler does where it is not: the
    pipeline then kills its sandbox, stores what was made and ends Cancelled. Later ones are
    ignored while that happens; on exit SIGINT is ignored again. Elsewhere nothing changes."""
    task = asyncio.current_task()
    if (
        task is None
        or threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.SIG_IGN
    ):
        yield
        return
    loop = asyncio.get_running_loop()
    received: list[bool] = []

    def stop() -> None:
        if not received:
            received.append(True)
            task.cancel()

    loop.add_signal_handler(signal.SIGINT, stop)
    try:
        yield
    finally:
        loop.remove_signal_handler(signal.SIGINT)
        signal.signal(signal.SIGINT, signal.SIG_IGN)


@asynccontextmanager
async def cancelled_from_api(flow_run_id: UUID, *, poll_s: float) -> AsyncIterator[None]:
    """While inside, cancel the current asyncio task once the flow run is Cancelling.

    Only the inside is cancelled: once it is left, a late poll cancels nothing. A read that
    fails (the API busy or unreachable) is logged at debug level and tried again next time.

    Args:
        flow_run_id: the flow run to watch.
        poll_s: seconds between reads of its state.
    """
    task = asyncio.current_task()
    assert task is not None, "must run in an asyncio task"
    inside = True

    logger = get_run_logger()

    async def watch() -> None:
        async with get_client() as client:
            while True:
                await asyncio.sleep(poll_s)
                try:
                    flow_run = await client.read_flow_run(flow_run_id)
                except (httpx.HTTPError, PrefectHTTPStatusError) as exc:
                    logger.debug("Flow run %s: state not read (%s)", flow_run_id, exc)
                    continue
                if flow_run.state is not None and flow_run.state.type in _STOPPING and inside:
                    logger.warning(
                        "Flow run %s is %s (through the API or UI): stopping it",
                        flow_run_id,
                        flow_run.state.name,
                    )
                    task.cancel()
                    return

    watcher = asyncio.create_task(watch())
    try:
        yield
    finally:
        inside = False
        await cancel_and_wait(watcher)


def sync_twin(async_flow: Flow[P, Coroutine[Any, Any, R]]) -> Callable[P, R]:
    """Derive the blocking twin of an async flow, for plain Python callers.

    On the main thread, outside an event loop and with SIGTERM's default action, the twin runs
    the flow on a worker thread's event loop and takes SIGTERM while it runs (`SignalStop`):
    the flow's task is cancelled, so the run kills its sandbox, stores what it made, removes
    its staging folder and ends Cancelled; the twin then raises ``SystemExit(143)``. Elsewhere
    it runs the flow with Prefect's ``run_coro_as_sync``.

    Returns:
        A function with the flow's signature that runs the flow and returns its result.
    """

    @functools.wraps(async_flow.fn)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        if not _may_take_sigterm():
            return run_coro_as_sync(async_flow(*args, **kwargs))
        stop = SignalStop((signal.SIGTERM,))
        with stop:
            try:
                return stop.run(lambda: async_flow(*args, **kwargs))
            finally:
                if stop.signum is not None:
                    # The run has cleaned up and ended Cancelled: exit as the CLI does (143),
                    # through the interpreter's exit handlers (Prefect's temporary server).
                    raise SystemExit(128 + stop.signum)

    return run


def _may_take_sigterm() -> bool:
    """Whether a sync twin called here may handle SIGTERM itself: on the main thread, outside an
    event loop, where SIGTERM still has its default action (no handler of the caller's)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    return False
