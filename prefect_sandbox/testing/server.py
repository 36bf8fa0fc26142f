"""`EmulatorServer`: serves an emulator's ASGI app with uvicorn on 127.0.0.1, in a thread of
its own, and `serve_until_stopped` for the emulators' ``python -m`` entry points.
Manual: docs/development.md.
"""

from __future__ import annotations

import abc
import asyncio
import signal
import socket
import threading
from collections.abc import Coroutine
from typing import Any, Literal, Self, TypeVar

import uvicorn
from starlette.types import ASGIApp

from prefect_sandbox.testing.faults import Fault, FaultBook, RequestRecord
from prefect_sandbox.testing.stopping import StopsOnExit

__all__ = ["EmulatorServer", "serve_until_stopped"]

T = TypeVar("T")

_START_TIMEOUT_S = 30.0
_STOP_TIMEOUT_S = 30.0
_CALL_TIMEOUT_S = 60.0


class EmulatorServer(StopsOnExit):
    """An emulator's server: `start` binds a port and serves in a background thread with its
    own event loop, where the emulated state lives; `stop` ends it. A context manager.

    Subclasses build their state and app in `_open` and tear them down in `_close`, both on
    the server's loop. Their app plays the faults of `faults` and records requests there.

    Args:
        faults: the faults to inject, and the record of requests.
        port: the port on 127.0.0.1; 0 for a free one.
        log_level: uvicorn's log level.
        ws: uvicorn's WebSocket implementation (``"none"`` for an app without WebSockets).
        graceful_shutdown_s: how long `stop` lets open requests finish.
    """

    def __init__(
        self,
        *,
        faults: FaultBook,
        port: int = 0,
        log_level: str = "warning",
        ws: Literal["auto", "none", "websockets", "wsproto"] = "none",
        graceful_shutdown_s: float = 2.0,
    ) -> None:
        self.faults = faults
        self._port = port
        self._log_level = log_level
        self._ws: Literal["auto", "none", "websockets", "wsproto"] = ws
        self._graceful_shutdown_s = graceful_shutdown_s
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: uvicorn.Server | None = None
        self._failure: BaseException | None = None

    @property
    def port(self) -> int:
        """The port it listens on (after `start`)."""
        return self._port

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:PORT`` (after `start`)."""
        return f"http://127.0.0.1:{self._port}"

    @property
    def requests(self) -> list[RequestRecord]:
        """Every request received so far, oldest first."""
        return self.faults.requests

    def inject(self, *faults: Fault) -> None:
        """Make the next matching calls fail (see `Fault`); each fault hits until spent."""
        self.faults.add(*faults)

    def clear_faults(self) -> None:
        """Remove every fault not yet spent."""
        self.faults.clear()

    @abc.abstractmethod
    def env(self) -> dict[str, str]:
        """The vendor SDK's environment variables that point it at this emulator."""

    @abc.abstractmethod
    async def _open(self) -> ASGIApp:
        """Make the emulated state and return the app that serves it (on the server's loop)."""

    @abc.abstractmethod
    async def _close(self) -> None:
        """End the emulated state: sandboxes, processes, files (on the server's loop)."""

    def start(self) -> Self:
        """Start serving; returns once it answers.

        Raises:
            RuntimeError: it did not start within 30 s.
        """
        # IPPROTO_TCP, so asyncio sets TCP_NODELAY on accepted connections (no 40 ms stalls).
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self._port))
        self._port = listener.getsockname()[1]
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()
        self._thread = threading.Thread(
            target=self._run,
            args=(listener, ready),
            name=f"{type(self).__name__}-server",
            daemon=True,
        )
        self._thread.start()
        if not ready.wait(_START_TIMEOUT_S) or self._failure is not None:
            self.stop()
            raise RuntimeError(f"{type(self).__name__} did not start: {self._failure}")
        return self

    def stop(self) -> None:
        """Stop serving and end the emulated state. Idempotent."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(_STOP_TIMEOUT_S)
            self._thread = None
        self._loop = None

    def _on_loop(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run a coroutine on the server's loop, where the state lives, and wait for it.

        Raises:
            RuntimeError: the server is not running.
        """
        if self._loop is None or self._thread is None:
            coroutine.close()
            raise RuntimeError(f"{type(self).__name__} is not running")
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(_CALL_TIMEOUT_S)

    def __enter__(self) -> Self:
        return self.start()

    def _run(self, listener: socket.socket, ready: threading.Event) -> None:
        assert self._loop is not None
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._serve(listener, ready))
        except BaseException as exc:  # reported to the thread that called start()
            self._failure = exc
            ready.set()
        finally:
            self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            self._loop.close()
            listener.close()

    async def _serve(self, listener: socket.socket, ready: threading.Event) -> None:
        app = await self._open()
        try:
            config = uvicorn.Config(
                app,
                log_level=self._log_level,
                access_log=False,
                lifespan="off",
                ws=self._ws,
                timeout_graceful_shutdown=int(self._graceful_shutdown_s),
            )
            self._server = uvicorn.Server(config)
            serving = asyncio.create_task(self._server.serve(sockets=[listener]))
            while not self._server.started and not serving.done():
                await asyncio.sleep(0.01)
            ready.set()
            await serving
        finally:
            await self._close()


def serve_until_stopped(server: EmulatorServer) -> None:
    """Run an emulator in the foreground: print its `EmulatorServer.env`, one ``NAME=value`` a
    line, then serve until Ctrl-C or SIGTERM, and stop it (its sandboxes end, their files are
    removed).
    """
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: stopping.set())
    with server:
        for name, value in server.env().items():
            print(f"{name}={value}", flush=True)
        try:
            while not stopping.wait(0.5):
                pass
        except KeyboardInterrupt:
            pass
