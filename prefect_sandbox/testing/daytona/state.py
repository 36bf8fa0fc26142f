"""The emulated Daytona world: sandboxes, their interpreter contexts and their lifecycles.

Each sandbox is a folder (its home inside). Each interpreter context is what Daytona's daemon
runs: a plain Python worker process (`prefect_sandbox.testing.daytona.worker`, no Jupyter
kernel) started in the context's folder, fed one JSON command a line on its stdin, whose JSON
chunks on stdout are read as the daemon reads them (a line of 1 MiB or more stops the reading
for good; a line that is not JSON is dropped). Everything here runs on the emulator's event loop;
nothing here knows HTTP. Manual: docs/backends/daytona.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import shutil
import signal
import sys
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import Any

from prefect_sandbox.sandbox.backends.kernel.local import HOST_ENV_ALLOW_LIST

__all__ = ["EmulatedContext", "EmulatedSandbox", "ExecOutcome", "World"]

logger = logging.getLogger(__name__)

DEFAULT_CONTEXT = "default"
SANDBOX_HOME = "/home/daytona"
"""The sandbox user's home, and its work directory, as paths inside the sandbox."""
GRACE_S = 2.0
"""Seconds the daemon waits after its SIGINT (or SIGTERM) before it kills an interpreter."""
DEFAULT_RUN_TIMEOUT_S = 600
DEFAULT_EXEC_TIMEOUT_S = 10
MAX_CHUNK_LINE_BYTES = 1 << 20
"""The daemon reads its worker's output with a line scanner whose buffer holds at most this."""
_WORKER_SCRIPT = Path(__file__).with_name("worker.py")
_TICK_S = 0.05
_SURROGATE = re.compile("[\ud800-\udfff]")


def _now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def process_env(sandbox: EmulatedSandbox) -> dict[str, str]:
    """The environment of a sandbox's processes: a few host variables, its own variables, and
    this Python first on the PATH (a sandbox has ``python3``)."""
    env = {name: os.environ[name] for name in HOST_ENV_ALLOW_LIST if name in os.environ}
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    env.update(sandbox.env)
    return env


@dataclass
class ExecOutcome:
    """How an interpreter execution ended, as the daemon reports it on the WebSocket.

    Attributes:
        close_code: the WebSocket close code (1000, 1001, 4008).
        close_reason: the close frame's reason.
        control: the ``control`` frame's text, or None when none is sent.
    """

    close_code: int = 1000
    close_reason: str = ""
    control: str | None = "completed"


@dataclass
class _Running:
    """The command a worker runs now: where its chunks go, and how it ended."""

    worker: _Worker
    on_chunk: Callable[[dict[str, str]], None]
    ended: asyncio.Future[str] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class _Worker(asyncio.SubprocessProtocol):
    """The daemon's side of a worker process: a line scanner over its stdout (a line of
    `MAX_CHUNK_LINE_BYTES` or more stops the reading for good, and the worker then blocks on
    a full pipe), its stdin for commands, and a watch on its exit (which closes the pipes,
    as Go's ``cmd.Wait`` does)."""

    def __init__(self, on_line: Callable[[_Worker, bytes], None]) -> None:
        self.on_line = on_line
        self.pending = bytearray()
        self.stalled = False
        self.exited: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.transport: asyncio.SubprocessTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.SubprocessTransport)
        self.transport = transport

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        if fd != 1 or self.stalled:
            return
        self.pending += data
        while (end := self.pending.find(b"\n")) >= 0 and not self.stalled:
            line = bytes(self.pending[:end])
            del self.pending[: end + 1]
            if len(line) >= MAX_CHUNK_LINE_BYTES:
                self._stall()
            else:
                self.on_line(self, line)
        if len(self.pending) >= MAX_CHUNK_LINE_BYTES:
            self._stall()

    def _stall(self) -> None:
        logger.warning("an interpreter wrote a line of 1 MiB or more; its output stops")
        self.stalled = True
        self.pending.clear()
        assert self.transport is not None
        stdout = self.transport.get_pipe_transport(1)
        assert isinstance(stdout, asyncio.ReadTransport)
        stdout.pause_reading()

    def process_exited(self) -> None:
        assert self.transport is not None
        self.transport.close()
        if not self.exited.done():
            self.exited.set_result(None)

    @property
    def running(self) -> bool:
        return self.transport is not None and self.transport.get_returncode() is None

    def send(self, command: dict[str, Any]) -> None:
        assert self.transport is not None
        stdin = self.transport.get_pipe_transport(0)
        assert isinstance(stdin, asyncio.WriteTransport)
        stdin.write(json.dumps(command).encode() + b"\n")

    def signal(self, signum: int) -> None:
        assert self.transport is not None
        with contextlib.suppress(ProcessLookupError):
            self.transport.send_signal(signum)


@dataclass
class EmulatedContext:
    """An interpreter context: a folder and, once used, a Python worker process in it.

    Attributes:
        cwd: the folder on this machine the worker runs in.
        shown_cwd: the working directory as the client named it (the daemon echoes it).
    """

    id: str
    cwd: Path
    shown_cwd: str
    sandbox: EmulatedSandbox
    created_at: str = field(default_factory=_now)
    worker: _Worker | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    running: _Running | None = None
    closed: bool = False

    def model(self) -> dict[str, Any]:
        """The context as the daemon's JSON."""
        return {
            "id": self.id,
            "cwd": self.shown_cwd,
            "createdAt": self.created_at,
            "active": self.worker is not None and self.worker.running,
            "language": "python",
        }

    async def start_worker(self) -> None:
        """Start the worker if none runs: a fresh interpreter, state lost.

        Raises:
            OSError: it could not start (its working directory is gone, say).
        """
        if self.worker is not None and self.worker.running:
            return
        loop = asyncio.get_running_loop()
        _, worker = await loop.subprocess_exec(
            lambda: _Worker(self._take),
            sys.executable,
            str(_WORKER_SCRIPT),
            cwd=self.cwd,
            env=process_env(self.sandbox),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
        )
        worker.exited.add_done_callback(lambda _: self._worker_ended(worker))
        self.worker = worker
        if self.closed:
            # Deleted (or its sandbox stopped) while the worker started.
            await self.stop_worker(gently=False)
            raise RuntimeError(f"interpreter context {self.id} was closed")

    def _worker_ended(self, worker: _Worker) -> None:
        running = self.running
        if running is not None and running.worker is worker and not running.ended.done():
            running.ended.set_result("ended")

    def _take(self, worker: _Worker, line: bytes) -> None:
        """One line of a worker's stdout, as the daemon takes it."""
        try:
            chunk = json.loads(line)
        except json.JSONDecodeError:
            return  # the daemon logs it and drops it
        running = self.running
        if (
            not isinstance(chunk, dict)
            or running is None
            or running.worker is not worker
            or running.ended.done()
        ):
            return  # nothing asked for it: dropped
        fields = {
            key: _SURROGATE.sub("\ufffd", value) if isinstance(value, str) else ""
            for key in ("type", "text", "name", "value", "traceback")
            for value in [chunk.get(key, "")]
        }
        if fields["type"] == "control":
            running.ended.set_result(fields["text"])
        else:
            running.on_chunk(fields)

    async def execute(
        self,
        code: str,
        envs: Mapping[str, str] | None,
        timeout_s: float | None,
        on_chunk: Callable[[dict[str, str]], None],
        *,
        interrupt_after_s: float | None = None,
    ) -> ExecOutcome:
        """Run code as the daemon does: one at a time, with its deadline, SIGINT, then kill.

        Args:
            code: the code.
            envs: environment variables for this execution only.
            timeout_s: the deadline; None for none.
            on_chunk: called with each ``stdout``, ``stderr`` and ``error`` chunk (all five
                frame keys) as the worker sends it.
            interrupt_after_s: seconds into the execution at which a SIGINT reaches the
                worker from outside the daemon (an injected fault); None for none.
        """
        async with self.lock:
            if self.closed:
                return ExecOutcome(close_code=1001, close_reason="context shutdown")
            await self.start_worker()
            worker = self.worker
            assert worker is not None
            running = _Running(worker, on_chunk)
            self.running = running
            outside = None
            if interrupt_after_s is not None:
                loop = asyncio.get_running_loop()
                outside = loop.call_later(interrupt_after_s, worker.signal, signal.SIGINT)
            try:
                worker.send({"id": uuid.uuid4().hex, "code": code, "envs": dict(envs or {})})
                ended = await self._wait(running, worker, timeout_s)
            finally:
                self.running = None
                if outside is not None:
                    outside.cancel()
            if ended == "completed":
                return ExecOutcome()
            if ended in ("interrupted", "timeout"):
                return ExecOutcome(close_code=4008, control=None)
            if self.closed:
                return ExecOutcome(close_code=1001, close_reason="context shutdown")
            return ExecOutcome(close_code=1001, close_reason="worker process ended")

    async def _wait(self, running: _Running, worker: _Worker, timeout_s: float | None) -> str:
        """How the command ended: its control text, ``ended`` (the worker died) or
        ``timeout`` (killed at the deadline)."""
        done, _ = await asyncio.wait({running.ended}, timeout=timeout_s)
        if not done:
            worker.signal(signal.SIGINT)
            done, _ = await asyncio.wait({running.ended}, timeout=GRACE_S)
        if done:
            return running.ended.result()
        await self.stop_worker(gently=False)
        return "timeout"

    async def close(self, *, gently: bool) -> None:
        """End the interpreter for good.

        Args:
            gently: as the daemon deletes a context (SIGTERM, then SIGKILL 2 s later); else
                at once, as a sandbox that stops takes its processes with it.
        """
        self.closed = True
        await self.stop_worker(gently=gently)

    async def stop_worker(self, *, gently: bool) -> None:
        """End the worker: SIGTERM and up to 2 s to leave when ``gently``, then SIGKILL."""
        worker, self.worker = self.worker, None
        if worker is None:
            return
        if gently:
            worker.signal(signal.SIGTERM)
            await asyncio.wait({worker.exited}, timeout=GRACE_S)
        if not worker.exited.done():
            worker.signal(signal.SIGKILL)
            await worker.exited


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
        """The sandbox user's home, also its work directory (`SANDBOX_HOME` on this machine)."""
        return self.root / SANDBOX_HOME.lstrip("/")

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
            self.contexts[key] = EmulatedContext(DEFAULT_CONTEXT, self.home, str(self.home), self)
        return self.contexts.get(key)

    async def create_context(self, cwd: Path | None, shown_cwd: str | None) -> EmulatedContext:
        """A new context with its interpreter started, as the daemon does.

        Args:
            cwd: its folder on this machine; the home when None.
            shown_cwd: the working directory as the client named it.

        Raises:
            OSError: the interpreter could not start there (no such folder, say).
        """
        folder = cwd or self.home
        context = EmulatedContext(uuid.uuid4().hex, folder, shown_cwd or str(folder), self)
        await context.start_worker()
        self.contexts[context.id] = context
        return context

    async def stop(self) -> None:
        """Stop: every interpreter ends (state lost); files are kept."""
        self.state = "stopping"
        for context in list(self.contexts.values()):
            await context.close(gently=False)
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
        self.toolbox_url = toolbox_url
        self.minute_s = minute_s
        self.sandboxes: dict[str, EmulatedSandbox] = {}
        self.peak_live = 0
        """The most sandboxes that existed at once so far."""
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
        (sandbox.root / "tmp").mkdir()
        self.sandboxes[sandbox_id] = sandbox
        self.peak_live = max(self.peak_live, len(self.sandboxes))
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
            await context.close(gently=False)
        shutil.rmtree(sandbox.root, ignore_errors=True)
        sandbox.state = "destroyed"
        sandbox.updated_at = _now()
        return sandbox

    @staticmethod
    def inside(sandbox: EmulatedSandbox, raw_path: str) -> Path | None:
        """A path the toolbox was given, as a path on this machine; None if it leaves the
        sandbox.

        Relative paths start at the work directory (the home). Absolute ones are the sandbox's
        own (``/home/daytona/a.txt``, ``/tmp``), or the paths on this machine that the
        sandbox's processes see, which `World` reports as its work directory.
        """
        if raw_path.startswith("/") and Path(raw_path).is_relative_to(sandbox.root):
            path = Path(os.path.normpath(raw_path))
        else:
            # A sandbox path: ".." stops at its root, as it does at "/".
            kept: list[str] = []
            for part in (PurePosixPath(SANDBOX_HOME) / raw_path).parts[1:]:
                if part == "..":
                    if kept:
                        kept.pop()
                elif part != ".":
                    kept.append(part)
            path = sandbox.root.joinpath(*kept)
        real = Path(os.path.realpath(path))
        if not real.is_relative_to(sandbox.root.resolve()):
            return None
        return path

    async def run_command(
        self, sandbox: EmulatedSandbox, command: str, cwd: Path, timeout_s: float
    ) -> tuple[int, str] | None:
        """Run a shell command as the daemon's ``process/execute`` does.

        Returns:
            The exit code and the merged stdout and stderr; None if it timed out (killed).
        """
        process = await asyncio.create_subprocess_exec(
            "/bin/sh",
            "-c",
            command,
            cwd=cwd,
            env=process_env(sandbox),
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
