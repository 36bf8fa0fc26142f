"""`DaytonaEmulator`: the Daytona emulator's server, on uvicorn in a thread of its own.

Manual: docs/backends/daytona.md.
"""

from __future__ import annotations

import secrets
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

from starlette.types import ASGIApp

from prefect_sandbox.testing.daytona.app import OPERATIONS, WEBSOCKET_OPERATIONS, build_app
from prefect_sandbox.testing.daytona.state import World
from prefect_sandbox.testing.faults import FaultBook
from prefect_sandbox.testing.limits import FixedWindow, Limits, RateLimits
from prefect_sandbox.testing.server import EmulatorServer

__all__ = ["DaytonaEmulator"]


class DaytonaEmulator(EmulatorServer):
    """An offline Daytona: the control-plane and toolbox APIs on 127.0.0.1.

    The real daytona SDK talks to it when pointed at `api_url` with `api_key` (see `env`).
    Each sandbox is a folder, and each interpreter context a plain Python worker process
    running in it, as Daytona's daemon runs one (see `prefect_sandbox.testing.daytona.worker`).
    Faults are injected with `inject`; `expire` ends a sandbox as its lifetime would; every
    request is recorded in `requests`.

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
        limits: rate limits and a quota of live sandboxes (Daytona's CPU quota, at 1 CPU a
            sandbox), enforced and answered as Daytona's API does
            (`prefect_sandbox.testing.limits`); none when None. What they refused is counted
            in `limits`' ``refused``.
    """

    def __init__(
        self,
        *,
        api_key: str | None = None,
        target: str = "us",
        port: int = 0,
        minute_s: float = 60.0,
        limits: Limits | None = None,
    ) -> None:
        if minute_s <= 0:
            raise ValueError(f"minute_s must be positive, not {minute_s}")
        super().__init__(
            faults=FaultBook(OPERATIONS, WEBSOCKET_OPERATIONS), port=port, ws="wsproto"
        )
        self.api_key = api_key or f"dtn_emulated_{secrets.token_hex(16)}"
        self.target = target
        self._minute_s = minute_s
        self.limits = RateLimits(limits or Limits(), FixedWindow)
        self._root: Path | None = None
        self._world: World | None = None

    @property
    def api_url(self) -> str:
        """The control plane's URL: the SDK's ``api_url``."""
        return f"{self.base_url}/api"

    def env(self) -> dict[str, str]:
        """The SDK's environment variables that point it at this emulator."""
        return {
            "DAYTONA_API_KEY": self.api_key,
            "DAYTONA_API_URL": self.api_url,
            "DAYTONA_TARGET": self.target,
        }

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

    @property
    def peak_live_sandboxes(self) -> int:
        """The most sandboxes that existed at once since `start`."""
        return self._require_world().peak_live

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

    def _require_world(self) -> World:
        if self._world is None:
            raise RuntimeError("the Daytona emulator is not running")
        return self._world

    async def _open(self) -> ASGIApp:
        self._root = Path(tempfile.mkdtemp(prefix="prefect-sandbox-daytona-"))
        self._world = World(self._root, f"{self.base_url}/toolbox", self._minute_s)
        self._world.start_clock()
        return build_app(
            self._world,
            api_key=self.api_key,
            target=self.target,
            faults=self.faults,
            limits=self.limits,
        )

    async def _close(self) -> None:
        if self._world is not None:
            await self._world.close()
            self._world = None
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
            self._root = None
