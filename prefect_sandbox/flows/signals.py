"""Stop signals turned into a cancellation of the flow a blocking caller runs, so that the
pipeline flows kill the sandbox, store what was made, end Cancelled and remove their staging
folder before the process goes.

Prefect's flow engine turns SIGTERM into its own exception only on the main thread's event loop,
where it raises out of the loop wherever it stood; a flow run from a plain script (the flows'
sync twins) runs on another thread, where nothing catches the signal and the process dies at
once, leaving its staging folder and its flow run Running.

A process started with SIGINT ignored (a background job of a non-interactive shell, ``python
script.py &``) keeps it ignored, and ``asyncio.run`` then installs no handler of its own: a
SIGINT sent to a script running a flow with ``asyncio.run`` did nothing. `sigint_honoured` takes
it there while a run's sandbox lives.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import signal
import threading
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any, TypeVar, cast

__all__ = ["SignalStop", "sigint_honoured"]

T = TypeVar("T")


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
