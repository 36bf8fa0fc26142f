"""The local Prefect server's own process: Prefect's server app (``create_app``, as ``prefect
server start`` runs it, UI and services included) under uvicorn, on the listening socket its
starter bound, and a watchdog that stops it once idle.

Idle means: no request open and none for ``PREFECT_SANDBOX_LOCAL_SERVER_IDLE_STOP_S`` seconds
(health checks do not count), and no run's touch of ``last-used`` for as long. The watchdog
decides under the folder's lock and removes ``state.json`` before the server stops, so a run
either found this server and touched it first, or finds no state and starts a new one. A server
whose ``state.json`` no longer names it (``prefect-sandbox server stop``, or a replacement)
stops too. Run as ``python -m prefect_sandbox.local_server.serve --fd FD --folder FOLDER``.
See docs/how-to/local-server.md.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

from prefect_sandbox.local_server import LocalServer

__all__ = ["Activity", "main"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
ASGIApp = Callable[
    [Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]],
    Awaitable[None],
]


class Activity:
    """An ASGI wrapper that counts the app's open requests and websockets and notes when the
    last ended; ``/api/health`` does not count.

    Args:
        app: the ASGI app to wrap.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.open = 0
        self.last_end = time.monotonic()

    async def __call__(
        self,
        scope: Scope,
        receive: Callable[[], Awaitable[Message]],
        send: Callable[[Message], Awaitable[None]],
    ) -> None:
        if scope["type"] not in ("http", "websocket") or scope.get("path") == "/api/health":
            await self.app(scope, receive, send)
            return
        self.open += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.open -= 1
            self.last_end = time.monotonic()

    def idle_s(self) -> float:
        """Seconds since the last request ended; 0 while one is open."""
        return 0.0 if self.open else time.monotonic() - self.last_end


def _idle_s(activity: Activity, server: LocalServer) -> float:
    """Seconds since the later of the last request and the last run's touch."""
    try:
        touched = time.time() - server.last_used_path.stat().st_mtime
    except OSError:
        touched = float("inf")
    return min(activity.idle_s(), max(touched, 0.0))


def _still_named(server: LocalServer) -> bool:
    """Whether ``state.json`` still names this process."""
    state = server.read_state()
    return state is not None and state.pid == os.getpid()


async def watch(
    activity: Activity,
    server: LocalServer,
    idle_stop_s: float | None,
    serving: Callable[[], bool],
    stop: Callable[[], None],
) -> None:
    """Once ``serving()`` (idle time counts from then, not through a slow start), call ``stop``
    when the server is idle for ``idle_stop_s`` seconds (removing its state under the lock
    first), or when its state names another process or none."""
    every_s = min(max((idle_stop_s or 300.0) / 10, 0.2), 30.0)
    while not serving():
        await asyncio.sleep(0.1)
    since = time.monotonic()

    def idle_s() -> float:
        return min(_idle_s(activity, server), time.monotonic() - since)

    while True:
        await asyncio.sleep(every_s)
        if not _still_named(server):
            break
        if idle_stop_s is None or idle_s() < idle_stop_s:
            continue
        with server.locked(blocking=False) as got:
            # Not got: a run is finding this server right now, and will touch it.
            if got and idle_s() >= idle_stop_s and _still_named(server):
                server.state_path.unlink(missing_ok=True)
                print(f"idle for {idle_stop_s:g} s: stopping", file=sys.stderr, flush=True)
                break
    stop()


def _record_idle_stop(server: LocalServer, idle_stop_s: float | None) -> None:
    """Write the idle time this server keeps into ``state.json``, for ``server status``."""
    with server.locked():
        state = server.read_state()
        if state is not None and state.pid == os.getpid():
            server.write_state(dataclasses.replace(state, idle_stop_s=idle_stop_s))


def _forget(server: LocalServer) -> None:
    """Remove ``state.json`` if it still names this process."""
    with server.locked():
        if _still_named(server):
            server.state_path.unlink(missing_ok=True)


async def _serve(listener: socket.socket, server: LocalServer, idle_stop_s: float | None) -> None:
    import uvicorn
    from prefect.server.api.server import create_app

    activity = Activity(create_app(final=True))
    config = uvicorn.Config(activity, log_level="warning", lifespan="on")
    running = uvicorn.Server(config)

    def stop() -> None:
        running.should_exit = True

    watchdog = asyncio.create_task(
        watch(activity, server, idle_stop_s, lambda: running.started, stop)
    )
    try:
        await running.serve(sockets=[listener])
    finally:
        watchdog.cancel()


def main(argv: list[str] | None = None) -> int:
    """Serve until idle, stopped, or signalled; ``state.json`` is removed on the way out if it
    still names this process.

    Args:
        argv: ``--fd FD`` (the listening socket, inherited) and ``--folder FOLDER`` (the
            server's folder under ``PREFECT_HOME``).

    Returns:
        0.
    """
    from prefect_sandbox.settings import PrefectSandboxSettings

    # Its starter held SIGINT and SIGTERM off while starting it, and a mask survives exec.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    parser = argparse.ArgumentParser(prog="prefect_sandbox.local_server.serve")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--folder", type=Path, required=True)
    args = parser.parse_args(argv)
    server = LocalServer(args.folder.parent)
    idle_stop_s = PrefectSandboxSettings().local_server_idle_stop_s
    listener = socket.socket(fileno=args.fd)
    _record_idle_stop(server, idle_stop_s)
    print(
        f"pid {os.getpid()} serving on {listener.getsockname()}, idle stop {idle_stop_s} s",
        file=sys.stderr,
        flush=True,
    )
    try:
        asyncio.run(_serve(listener, server, idle_stop_s))
    finally:
        _forget(server)
    return 0


if __name__ == "__main__":
    sys.exit(main())
