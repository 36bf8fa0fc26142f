"""`DaytonaEmulator`: the emulator's server, on uvicorn in a thread of its own."""

from __future__ import annotations

import asyncio
import secrets
import shutil
import socket
import tempfile
import threading
from collections.abc import Coroutine, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import uvicorn

from prefect_sandbox.testing.daytona.app import build_app
from prefect_sandbox.testing.daytona.faults import Fault, FaultBook
from prefect_sandbox.testing.daytona.state import World

__all__ = ["DaytonaEmulator"]

T = TypeVar("T")

_START_TIMEOUT_S = 30.0
_STOP_TIMEOUT_S = 30.0
_CALL_TIMEOUT_S = 60.0


class DaytonaEmulator:
    """An offline Daytona: the control-plane and toolbox APIs on 127.0.0.1.

    The real daytona SDK talks to it when pointed at `api_url` with `api_key` (see `env`).
    Each sandbox is a folder, and each interpreter context a real local ipykernel running in
    it. Faults are injected with `inject`; `expire` ends a sandbox as its lifetime would.

    Example:
        ```python
        with DaytonaEmulator() as emulator:
            config = DaytonaConfig(
                api_key=emulator.api_key, api_url=emulator.api_url, target=emulator.target
            )
        ```

    Args:
        api_key: the API key it accepts; a random one by default.
        target: the region it reports.
        port: the port to listen on; 0 for a free one.
        minute_s: seconds in one minute of the lifecycle settings (auto-stop, auto-delete,
            lifetime), so tests can see them act; 60 by default.
    """

    def __init__(
        self,
        *,
        api_key: str | None = None,
        target: str = "us",
        port: int = 0,
        minute_s: float = 60.0,
    ) -> None:
        if minute_s <= 0:
            raise ValueError(f"minute_s must be positive, not {minute_s}")
        self.api_key = api_key or f"dtn_emulated_{secrets.token_hex(16)}"
        self.target = target
        self.faults = FaultBook()
        self._port = port
        self._minute_s = minute_s
        self._root: Path | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: uvicorn.Server | None = None
        self._world: World | None = None
        self._failure: BaseException | None = None

    @property
    def port(self) -> int:
        """The port it listens on (after `start`)."""
        return self._port

    @property
    def api_url(self) -> str:
        """The control plane's URL: the SDK's ``api_url``."""
        return f"http://127.0.0.1:{self._port}/api"

    def env(self) -> dict[str, str]:
        """The SDK's environment variables that point it at this emulator."""
        return {
            "DAYTONA_API_KEY": self.api_key,
            "DAYTONA_API_URL": self.api_url,
            "DAYTONA_TARGET": self.target,
        }

    def start(self) -> DaytonaEmulator:
        """Start serving; returns once it answers.

        Raises:
            RuntimeError: it did not start within 30 s.
        """
        # IPPROTO_TCP, so asyncio sets TCP_NODELAY on accepted connections (no 40 ms stalls).
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self._port))
        self._port = listener.getsockname()[1]
        self._root = Path(tempfile.mkdtemp(prefix="prefect-sandbox-daytona-"))
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(listener, ready), name="daytona-emulator", daemon=True
        )
        self._thread.start()
        if not ready.wait(_START_TIMEOUT_S) or self._failure is not None:
            self.stop()
            raise RuntimeError(f"the Daytona emulator did not start: {self._failure}")
        return self

    def stop(self) -> None:
        """Stop serving, end every sandbox's kernels and remove their folders. Idempotent."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(_STOP_TIMEOUT_S)
            self._thread = None
        self._loop = None
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
            self._root = None

    def inject(self, fault: Fault) -> None:
        """Make the next matching call(s) fail (see `Fault`)."""
        self.faults.add(fault)

    def sandbox_ids(self, labels: Mapping[str, str] | None = None) -> list[str]:
        """Ids of the sandboxes that exist (started or stopped) and carry ``labels``."""
        wanted = dict(labels or {})

        async def ids() -> list[str]:
            world = self._require_world()
            return sorted(
                sandbox.id
                for sandbox in world.sandboxes.values()
                if wanted.items() <= sandbox.labels.items()
            )

        return self._on_loop(ids())

    def sandbox_state(self, sandbox_id: str) -> str | None:
        """A sandbox's state (``started``, ``stopped``); None once it is gone."""

        async def state() -> str | None:
            sandbox = self._require_world().find(sandbox_id)
            return None if sandbox is None else sandbox.state

        return self._on_loop(state())

    def expire(self, sandbox_id: str) -> None:
        """Delete a sandbox as the end of its lifetime would: later calls find it gone."""

        async def expire() -> None:
            await self._require_world().delete(sandbox_id)

        self._on_loop(expire())

    def __enter__(self) -> DaytonaEmulator:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _require_world(self) -> World:
        if self._world is None:
            raise RuntimeError("the Daytona emulator is not running")
        return self._world

    def _on_loop(self, coroutine: Coroutine[Any, Any, T]) -> T:
        if self._loop is None or self._thread is None:
            coroutine.close()
            raise RuntimeError("the Daytona emulator is not running")
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(_CALL_TIMEOUT_S)

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
        assert self._root is not None
        world = World(self._root, f"http://127.0.0.1:{self._port}/toolbox", self._minute_s)
        self._world = world
        world.start_clock()
        app = build_app(world, api_key=self.api_key, target=self.target, faults=self.faults)
        config = uvicorn.Config(
            app,
            log_level="warning",
            access_log=False,
            lifespan="off",
            ws="wsproto",
            timeout_graceful_shutdown=2,
        )
        self._server = uvicorn.Server(config)
        serving = asyncio.create_task(self._server.serve(sockets=[listener]))
        try:
            while not self._server.started and not serving.done():
                await asyncio.sleep(0.01)
            ready.set()
            await serving
        finally:
            await world.close()
            self._world = None
