"""`E2BEmulator`: the E2B emulator's server, on uvicorn in a thread of its own.

Manual: docs/backends/e2b.md.
"""

from __future__ import annotations

import secrets
import shutil
import tempfile
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path

from starlette.types import ASGIApp

from prefect_sandbox.testing.e2b.app import build_app
from prefect_sandbox.testing.e2b.state import World
from prefect_sandbox.testing.e2b.wire import ROUTES
from prefect_sandbox.testing.faults import FaultBook
from prefect_sandbox.testing.limits import Gcra, Limits, RateLimits
from prefect_sandbox.testing.server import EmulatorServer

__all__ = ["OPERATIONS", "E2BEmulator"]

OPERATIONS = frozenset(name for _, _, name in ROUTES)
"""The calls a `Fault` can name (see `prefect_sandbox.testing.e2b.wire.ROUTES`)."""


class E2BEmulator(EmulatorServer):
    """An offline E2B that the real SDK talks to: the control plane, envd and the code
    interpreter on one port of 127.0.0.1.

    Use it as a context manager, or call `start` and `stop`. Point the SDK at it with `env`
    (or the `api_key` and `url` attributes). Each sandbox is a folder, each code context a real
    local ipykernel. Faults are injected with `inject`; `expire` ends a sandbox as its lifetime
    would; every request is recorded in `requests`.

    Args:
        api_key: the key the emulator accepts; a random one when None.
        root: folder holding the sandboxes' files; a fresh temporary folder when None
            (removed by `stop`).
        port: TCP port on 127.0.0.1; 0 for a free one.
        interrupt_delay_s: seconds from a client leaving an execution to the kernel's interrupt
            (the real server's call to Jupyter, made after it let the context go).
        dead_kernel_poll_s: how often a dead kernel is looked for and restarted (Jupyter's
            restarter looks every 3 s).
        reply_after_idle: pass each ``execute_reply`` on after its execution's ``idle``, so
            an error only the reply holds is dropped, as the real server does now and then.
        kernel_pythonpath: a folder first on the kernels' ``PYTHONPATH``; one holding
            ipykernel 6.x (``pip install --target DIR ipykernel==6.31.0 --no-deps``) gives the
            template's kernel, which tags a thread's output with the cell that started it.
        shared_ipython_dir: one IPython folder for all sandboxes' kernels, as E2B's server
            run on one machine has (see `prefect_sandbox.testing.e2b.state.World`).
        limits: rate limits and a quota of live sandboxes, enforced and answered as E2B's API
            does (`prefect_sandbox.testing.limits`, e.g. ``E2B_PRO``); none when None. What
            they refused is counted in `limits`' ``refused``.
        log_level: uvicorn's log level.
    """

    def __init__(
        self,
        *,
        api_key: str | None = None,
        root: Path | None = None,
        port: int = 0,
        interrupt_delay_s: float = 0.1,
        dead_kernel_poll_s: float = 3.0,
        reply_after_idle: bool = False,
        kernel_pythonpath: Path | None = None,
        shared_ipython_dir: bool = False,
        limits: Limits | None = None,
        log_level: str = "warning",
    ) -> None:
        super().__init__(
            faults=FaultBook(OPERATIONS), port=port, log_level=log_level, graceful_shutdown_s=5.0
        )
        self.api_key = api_key or f"e2b_emulator_{secrets.token_hex(16)}"
        self._owns_root = root is None
        self.root = root or Path(tempfile.mkdtemp(prefix="prefect-sandbox-e2b-"))
        self._interrupt_delay_s = interrupt_delay_s
        self._dead_kernel_poll_s = dead_kernel_poll_s
        self._reply_after_idle = reply_after_idle
        self._kernel_pythonpath = kernel_pythonpath
        self._shared_ipython_dir = shared_ipython_dir
        self.limits = RateLimits(limits or Limits(), Gcra)
        self._world: World | None = None

    @property
    def url(self) -> str:
        """The URL of the API, of envd and of the code interpreter (after `start`)."""
        return self.base_url

    def env(self) -> dict[str, str]:
        """The SDK's environment variables that point it at this emulator."""
        return {"E2B_API_KEY": self.api_key, "E2B_API_URL": self.url, "E2B_SANDBOX_URL": self.url}

    def sandbox_ids(self, labels: Mapping[str, str] | None = None) -> list[str]:
        """Ids of live sandboxes whose metadata includes ``labels``."""

        async def ids() -> list[str]:
            return sorted(s.sandbox_id for s in self._require_world().listed(dict(labels or {})))

        return self._on_loop(ids())

    @property
    def peak_live_sandboxes(self) -> int:
        """The most sandboxes alive at once since `start`."""
        return self._require_world().peak_live

    def end_at(self, sandbox_id: str) -> datetime:
        """When the sandbox expires unless extended (UTC).

        Raises:
            KeyError: no live sandbox has that id.
        """
        return self._require_world().sandboxes[sandbox_id].end_at

    def expire(self, sandbox_id: str) -> None:
        """Make a sandbox expire now, as if its lifetime had run out; waits until it is gone.

        Raises:
            KeyError: no live sandbox has that id.
        """

        async def expire() -> None:
            world = self._require_world()
            await world.kill(world.sandboxes[sandbox_id])

        self._on_loop(expire())

    def _require_world(self) -> World:
        if self._world is None:
            raise RuntimeError("the E2B emulator is not running")
        return self._world

    async def _open(self) -> ASGIApp:
        self._world = World(
            self.root,
            interrupt_delay_s=self._interrupt_delay_s,
            dead_kernel_poll_s=self._dead_kernel_poll_s,
            reply_after_idle=self._reply_after_idle,
            kernel_pythonpath=self._kernel_pythonpath,
            shared_ipython_dir=self._shared_ipython_dir,
        )
        self._world.start_clock()
        return build_app(self._world, api_key=self.api_key, faults=self.faults, limits=self.limits)

    async def _close(self) -> None:
        if self._world is not None:
            await self._world.close()
            self._world = None
        if self._owns_root:
            shutil.rmtree(self.root, ignore_errors=True)
