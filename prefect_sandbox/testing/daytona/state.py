"""The emulated Daytona world: sandboxes, their interpreter contexts and their lifecycles.

Each sandbox is a folder (its home inside) and each interpreter context a real local ipykernel
(`LocalKernelSandbox`) started in the context's folder. Everything here runs on the emulator's
event loop; nothing here knows HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sys
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from prefect_sandbox.sandbox.backends.local import (
    HOST_ENV_ALLOW_LIST,
    LocalKernelConfig,
    LocalKernelSandbox,
)
from prefect_sandbox.sandbox.base import CellResult
from prefect_sandbox.sandbox.errors import SandboxDiedError
from prefect_sandbox.sandbox.outputs import strip_ansi

__all__ = ["EMULATOR_LABEL", "EmulatedContext", "EmulatedSandbox", "ExecOutcome", "World"]

EMULATOR_LABEL = "prefect-sandbox-daytona-emulator"
"""Label of the local kernels the emulator starts (never a flow run's labels)."""
DEFAULT_CONTEXT = "default"
GRACE_S = 2.0
"""Seconds the daemon waits after its SIGINT before it kills a timed-out interpreter."""
DEFAULT_RUN_TIMEOUT_S = 600
DEFAULT_EXEC_TIMEOUT_S = 10
_TICK_S = 0.05


def _now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


@dataclass
class ExecOutcome:
    """How an interpreter execution ended, as the daemon reports it on the WebSocket.

    Attributes:
        close_code: the WebSocket close code (1000, 1001, 4008).
        close_reason: the close frame's reason.
        control: the ``control`` frame's text, or None when none is sent.
        error: the ``error`` frame (name, value, traceback), or None.
    """

    close_code: int = 1000
    close_reason: str = ""
    control: str | None = "completed"
    error: dict[str, str] | None = None


@dataclass
class EmulatedContext:
    """An interpreter context: a folder and, once used, a live ipykernel in it."""

    id: str
    cwd: Path
    sandbox: EmulatedSandbox
    created_at: str = field(default_factory=_now)
    kernel: LocalKernelSandbox | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    running: asyncio.Task[CellResult] | None = None
    closed: bool = False

    def model(self) -> dict[str, Any]:
        """The context as the daemon's JSON."""
        return {
            "id": self.id,
            "cwd": str(self.cwd),
            "createdAt": self.created_at,
            "active": True,
            "language": "python",
        }

    async def ensure_kernel(self) -> LocalKernelSandbox:
        """The context's kernel, started (in ``cwd``) if it has none: a fresh interpreter."""
        if self.kernel is None:
            world = self.sandbox.world
            # The kernel works in the emulated sandbox's folder on this machine, outside its
            # own working directory: a test double, not a boundary (see the README).
            config = LocalKernelConfig(
                workdir_root=world.scratch, env=self.sandbox.env, isolation="none"
            )
            kernel = await LocalKernelSandbox.create(config, {EMULATOR_LABEL: self.sandbox.id})
            if self.closed:
                # Deleted (or its sandbox stopped) while the kernel started.
                await kernel.kill()
                raise RuntimeError(f"interpreter context {self.id} was closed")
            await kernel.run_cell(f"__import__('os').chdir({str(self.cwd)!r})")
            self.kernel = kernel
        return self.kernel

    async def execute(
        self,
        code: str,
        timeout_s: float | None,
        on_output: Callable[[dict[str, Any]], None],
    ) -> ExecOutcome:
        """Run code as the daemon does: one at a time, with its deadline, SIGINT, then kill.

        Args:
            code: the code.
            timeout_s: the deadline; None for none.
            on_output: called with each nbformat output as the kernel sends it.
        """
        async with self.lock:
            if self.closed:
                return ExecOutcome(close_code=1001, close_reason="context shutdown")
            kernel = await self.ensure_kernel()
            task = asyncio.create_task(kernel.run_cell(code, on_output=on_output))
            self.running = task
            try:
                await asyncio.wait({task}, timeout=timeout_s)
                if not task.done():
                    await kernel.interrupt()
                    await asyncio.wait({task}, timeout=GRACE_S)
                if not task.done():
                    await self.stop_kernel()
                    return ExecOutcome(close_code=4008, control=None)
                if task.cancelled():
                    return ExecOutcome(close_code=1001, close_reason="context shutdown")
                error = task.exception()
                if isinstance(error, SandboxDiedError):
                    await self.stop_kernel()
                    return ExecOutcome(close_code=1001, close_reason="worker process ended")
                if error is not None:
                    raise error
                return _outcome(task.result())
            finally:
                self.running = None

    async def close(self) -> None:
        """End the interpreter for good (the context or its sandbox is going away)."""
        self.closed = True
        await self.stop_kernel()

    async def stop_kernel(self) -> None:
        """End the interpreter: a running execution is cancelled, the kernel killed."""
        kernel, self.kernel = self.kernel, None
        if self.running is not None and not self.running.done():
            self.running.cancel()
            await asyncio.wait({self.running})
        if kernel is not None:
            await kernel.kill()


def _outcome(result: CellResult) -> ExecOutcome:
    """What the daemon's Python worker reports for a finished cell."""
    if result.error is None or result.status == "ok":
        return ExecOutcome()
    if result.error.ename == "KeyboardInterrupt":
        # The worker reports an interrupt as control "interrupted" and the daemon closes 4008.
        return ExecOutcome(close_code=4008, control="interrupted")
    if result.error.ename == "SystemExit":
        return ExecOutcome()
    traceback = "\n".join(strip_ansi(line) for line in result.error.traceback)
    return ExecOutcome(
        error={"name": result.error.ename, "value": result.error.evalue, "traceback": traceback}
    )


@dataclass
class EmulatedSandbox:
    """One sandbox: settings, state, folder, contexts and lifecycle clocks."""

    world: World
    id: str
    name: str
    labels: dict[str, str]
    env: dict[str, str]
    target: str
    snapshot: str
    cpu: int = 1
    memory: int = 1
    disk: int = 3
    gpu: int = 0
    network_block_all: bool = False
    network_allow_list: str | None = None
    auto_stop_interval: int = 15
    auto_delete_interval: int = -1
    ttl_minutes: int | None = None
    state: str = "started"
    created_at: str = field(default_factory=_now)
    updated_at: str = field(default_factory=_now)
    created_monotonic: float = field(default_factory=time.monotonic)
    last_activity: float = field(default_factory=time.monotonic)
    stopped_at: float | None = None
    requests_in_flight: int = 0
    contexts: dict[str, EmulatedContext] = field(default_factory=dict)

    @property
    def root(self) -> Path:
        """Everything of this sandbox lives below this folder."""
        return self.world.root / self.id

    @property
    def home(self) -> Path:
        """The sandbox user's home, also its work directory."""
        return self.root / "home" / "daytona"

    def model(self) -> dict[str, Any]:
        """The sandbox as the control plane's JSON (every key the SDK requires)."""
        return {
            "id": self.id,
            "organizationId": "emulated-organization",
            "name": self.name,
            "snapshot": self.snapshot,
            "user": "daytona",
            "env": self.env,
            "labels": self.labels,
            "public": False,
            "networkBlockAll": self.network_block_all,
            "networkAllowList": self.network_allow_list,
            "kvm": False,
            "target": self.target,
            "cpu": self.cpu,
            "gpu": self.gpu,
            "memory": self.memory,
            "disk": self.disk,
            "state": self.state,
            "desiredState": "destroyed" if self.state == "destroyed" else self.state,
            "autoStopInterval": self.auto_stop_interval,
            "autoArchiveInterval": 10080,
            "autoDeleteInterval": self.auto_delete_interval,
            "createdAt": self.created_at,
            "updatedAt": self.updated_at,
            "toolboxProxyUrl": self.world.toolbox_url,
        }

    def context(self, context_id: str | None) -> EmulatedContext | None:
        """A context by id; the default one is made on first use."""
        key = context_id or DEFAULT_CONTEXT
        if key == DEFAULT_CONTEXT and key not in self.contexts:
            self.contexts[key] = EmulatedContext(DEFAULT_CONTEXT, self.home, self)
        return self.contexts.get(key)

    async def create_context(self, cwd: Path | None) -> EmulatedContext:
        """A new context with its interpreter started, as the daemon does."""
        context = EmulatedContext(uuid.uuid4().hex, cwd or self.home, self)
        self.contexts[context.id] = context
        await context.ensure_kernel()
        return context

    async def stop(self) -> None:
        """Stop: every interpreter ends (state lost); files are kept."""
        self.state = "stopping"
        for context in list(self.contexts.values()):
            await context.close()
        self.contexts.clear()
        self.state = "stopped"
        self.stopped_at = time.monotonic()
        self.updated_at = _now()

    def touch(self, busy: bool = False) -> None:
        """Record activity, which postpones auto-stop.

        Args:
            busy: a request started that keeps the sandbox active until `untouch`.
        """
        self.last_activity = time.monotonic()
        self.requests_in_flight += busy

    def untouch(self) -> None:
        """A request that `touch` was told about ended; activity again."""
        self.requests_in_flight -= 1
        self.last_activity = time.monotonic()


class World:
    """All emulated sandboxes, and the clock that stops and deletes them.

    Args:
        root: the folder under which each sandbox gets its own.
        toolbox_url: the toolbox proxy URL sandboxes report.
        minute_s: seconds in one of the lifecycle settings' minutes (60 unless testing).
    """

    def __init__(self, root: Path, toolbox_url: str, minute_s: float) -> None:
        self.root = root
        self.scratch = root / ".kernels"
        self.scratch.mkdir(parents=True, exist_ok=True)
        self.toolbox_url = toolbox_url
        self.minute_s = minute_s
        self.sandboxes: dict[str, EmulatedSandbox] = {}
        self._clock: asyncio.Task[None] | None = None

    def start_clock(self) -> None:
        """Start enforcing auto-stop, auto-delete and lifetimes."""
        self._clock = asyncio.create_task(self._tick_forever())

    async def close(self) -> None:
        """Delete every sandbox and stop the clock."""
        if self._clock is not None:
            self._clock.cancel()
            await asyncio.wait({self._clock})
        for sandbox_id in list(self.sandboxes):
            await self.delete(sandbox_id)

    def create(self, body: Mapping[str, Any], target: str) -> EmulatedSandbox:
        """Make a started sandbox from a create request's JSON body."""
        sandbox_id = uuid.uuid4().hex[:16]
        build_info = body.get("buildInfo") or {}
        snapshot = body.get("snapshot") or (
            "image" if build_info.get("dockerfileContent") else "daytona-emulated"
        )
        sandbox = EmulatedSandbox(
            world=self,
            id=sandbox_id,
            name=body.get("name") or sandbox_id,
            labels=dict(body.get("labels") or {}),
            env=dict(body.get("env") or {}),
            target=body.get("target") or target,
            snapshot=snapshot,
            cpu=int(body.get("cpu") or 1),
            memory=int(body.get("memory") or 1),
            disk=int(body.get("disk") or 3),
            gpu=int(body.get("gpu") or 0),
            network_block_all=bool(body.get("networkBlockAll", False)),
            network_allow_list=body.get("networkAllowList"),
            auto_stop_interval=int(body.get("autoStopInterval", 15)),
            auto_delete_interval=int(body.get("autoDeleteInterval", -1)),
            ttl_minutes=body.get("ttlMinutes"),
        )
        sandbox.home.mkdir(parents=True)
        self.sandboxes[sandbox_id] = sandbox
        return sandbox

    def find(self, id_or_name: str) -> EmulatedSandbox | None:
        """A live sandbox by id or name."""
        if id_or_name in self.sandboxes:
            return self.sandboxes[id_or_name]
        return next((s for s in self.sandboxes.values() if s.name == id_or_name), None)

    async def delete(self, sandbox_id: str) -> EmulatedSandbox | None:
        """Destroy a sandbox: interpreters killed, folder removed. None if it is unknown."""
        sandbox = self.sandboxes.pop(sandbox_id, None)
        if sandbox is None:
            return None
        for context in list(sandbox.contexts.values()):
            await context.close()
        shutil.rmtree(sandbox.root, ignore_errors=True)
        sandbox.state = "destroyed"
        sandbox.updated_at = _now()
        return sandbox

    def inside(self, sandbox: EmulatedSandbox, raw_path: str) -> Path | None:
        """A path the toolbox was given, as a host path; None if it leaves the sandbox."""
        path = Path(raw_path)
        if not path.is_absolute():
            path = sandbox.home / path
        real = Path(os.path.realpath(path))
        if not real.is_relative_to(sandbox.root.resolve()):
            return None
        return Path(os.path.normpath(path))

    async def run_command(
        self, sandbox: EmulatedSandbox, command: str, cwd: Path, timeout_s: float
    ) -> tuple[int, str] | None:
        """Run a shell command as the daemon's ``process/execute`` does.

        Returns:
            The exit code and the merged stdout and stderr; None if it timed out (killed).
        """
        env = {name: os.environ[name] for name in HOST_ENV_ALLOW_LIST if name in os.environ}
        # A sandbox has python3 on its PATH: this interpreter's.
        env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
        env.update(sandbox.env)
        process = await asyncio.create_subprocess_exec(
            "/bin/sh",
            "-c",
            command,
            cwd=cwd,
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            output, _ = await asyncio.wait_for(process.communicate(), timeout_s)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            await process.wait()
            return None
        return process.returncode or 0, output.decode("utf-8", "replace")

    async def _tick_forever(self) -> None:
        while True:
            await asyncio.sleep(_TICK_S)
            await self._tick()

    async def _tick(self) -> None:
        now = time.monotonic()
        for sandbox in list(self.sandboxes.values()):
            if sandbox.ttl_minutes and now - sandbox.created_monotonic > (
                sandbox.ttl_minutes * self.minute_s
            ):
                await self.delete(sandbox.id)
            elif (
                sandbox.state == "started"
                and sandbox.requests_in_flight == 0
                and sandbox.auto_stop_interval > 0
                and now - sandbox.last_activity > sandbox.auto_stop_interval * self.minute_s
            ):
                await sandbox.stop()
            if (
                sandbox.state == "stopped"
                and sandbox.stopped_at is not None
                and sandbox.auto_delete_interval >= 0
                and now - sandbox.stopped_at >= sandbox.auto_delete_interval * self.minute_s
            ):
                await self.delete(sandbox.id)
