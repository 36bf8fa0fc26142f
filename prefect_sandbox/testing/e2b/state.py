"""The emulated E2B world: sandboxes, their files and code contexts, and their lifetimes.

Each sandbox's filesystem is a folder on this machine (``/home/user`` inside is
``<root>/<sandbox id>/home/user``); each code context is a real local ipykernel (a
`LocalKernelSandbox` used only as a process: the emulator talks to it over Jupyter's channels,
`prefect_sandbox.testing.e2b.channel`, as the real server does). Its kernels run with the
template's IPython profile (`prefect_sandbox.testing.e2b.profile`) and without envd's
variables in their environment: they get those only from the lines the server puts before the
first execution on each connection. Jupyter's restarter is played too: a kernel that died is
found within ``dead_kernel_poll_s``, its running executions end with ``ContextRestarting`` and it
is started again, at home (Jupyter's root folder), as is a kernel a context restart brings back.
Everything here runs on the emulator's event loop; nothing here knows HTTP.
Manual: docs/backends/e2b.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import shutil
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path, PurePosixPath
from typing import Any

from prefect_sandbox.sandbox.backends.kernel.local import LocalKernelConfig, LocalKernelSandbox
from prefect_sandbox.sandbox.errors import SandboxDiedError
from prefect_sandbox.testing.e2b.channel import KernelChannel
from prefect_sandbox.testing.e2b.profile import write_template_profile

__all__ = [
    "ENVD_VERSION",
    "HOME",
    "NOT_FOUND_MESSAGE",
    "ContextNotFoundError",
    "EmulatedContext",
    "EmulatedSandbox",
    "RestartRefusedError",
    "UnsupportedLanguageError",
    "World",
]

logger = logging.getLogger(__name__)

ENVD_VERSION = "0.5.7"
HOME = "/home/user"
DEFAULT_LIFETIME_S = 300
NOT_FOUND_MESSAGE = "The sandbox was not found"
LANGUAGES = frozenset({"python"})
"""Languages the emulator has kernels for (the real server also runs javascript, r, java...)."""
_REAP_EVERY_S = 0.2
# Folders every sandbox has from the start, as in E2B's images.
_SANDBOX_FOLDERS = (HOME, "/tmp")


class ContextNotFoundError(LookupError):
    """No context of the sandbox has this id."""


class UnsupportedLanguageError(ValueError):
    """A context of a language the emulator has no kernel for was asked for."""


class RestartRefusedError(RuntimeError):
    """A context restart that came while Jupyter was restarting a dead kernel (the real
    server answers 500 once then)."""


def normalize_language(language: str | None) -> str:
    """The language as the real server names it: lower case, ``js`` is javascript, None python."""
    if not language:
        return "python"
    language = language.lower().strip()
    return {"js": "javascript", "ts": "typescript"}.get(language, language)


@dataclass
class EmulatedContext:
    """A code context: its working directory and, once started, its kernel."""

    id: str
    language: str
    cwd: str
    kernel: LocalKernelSandbox | None = None
    channel: KernelChannel | None = None
    restarter: asyncio.Task[None] | None = None
    auto_restart: asyncio.Task[None] | None = None
    refused_restart: bool = False
    restart_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def model(self) -> dict[str, Any]:
        """The context as the server's JSON."""
        return {"id": self.id, "language": self.language, "cwd": self.cwd}

    async def stop(self) -> None:
        """End the connection, the restarter and the kernel."""
        for task in (self.restarter, self.auto_restart):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        if self.channel is not None:
            await self.channel.close()
        if self.kernel is not None:
            await self.kernel.kill()


@dataclass
class EmulatedSandbox:
    """One sandbox: its settings, lifetime, folder and code contexts."""

    sandbox_id: str
    template_id: str
    metadata: dict[str, str]
    envs: dict[str, str]
    allow_internet_access: bool
    started_at: datetime
    end_at: datetime
    root: Path
    access_token: str
    idempotency_key: str | None
    contexts: dict[str, EmulatedContext] = field(default_factory=dict)
    killed: asyncio.Event = field(default_factory=asyncio.Event)

    def sandbox_json(self) -> dict[str, Any]:
        """The control plane's ``Sandbox`` JSON (create, connect)."""
        return {
            "templateID": self.template_id,
            "sandboxID": self.sandbox_id,
            "clientID": "emulator",
            "envdVersion": ENVD_VERSION,
            "envdAccessToken": self.access_token,
            "trafficAccessToken": None,
            "domain": None,
        }

    def envd_envs(self) -> dict[str, str]:
        """envd's ``GET /envs``: E2B's own variables and those given at creation."""
        return {
            "E2B_SANDBOX": "true",
            "E2B_SANDBOX_ID": self.sandbox_id,
            "E2B_TEMPLATE_ID": self.template_id,
            **self.envs,
        }

    def detail_json(self) -> dict[str, Any]:
        """The control plane's ``SandboxDetail`` JSON (get_info, list)."""
        return {
            "templateID": self.template_id,
            "sandboxID": self.sandbox_id,
            "clientID": "emulator",
            "startedAt": self.started_at.isoformat().replace("+00:00", "Z"),
            "endAt": self.end_at.isoformat().replace("+00:00", "Z"),
            "envdVersion": ENVD_VERSION,
            "cpuCount": 2,
            "memoryMB": 512,
            "diskSizeMB": 1024,
            "state": "running",
            "metadata": self.metadata,
            "allowInternetAccess": self.allow_internet_access,
        }

    def local_path(self, path: str) -> Path:
        """The folder on this machine for a sandbox path; relative paths start at home."""
        pure = PurePosixPath(HOME) / path
        parts: list[str] = []
        for part in pure.parts[1:]:
            if part == "..":
                if parts:
                    parts.pop()
            elif part != ".":
                parts.append(part)
        return self.root.joinpath(*parts)

    def sandbox_path(self, local: Path) -> str:
        """The sandbox path of a path on this machine; paths outside the sandbox stay as is."""
        try:
            return "/" + local.relative_to(self.root).as_posix()
        except ValueError:
            return str(local)

    def inside(self, local: Path) -> bool:
        """Whether ``local``, symlinks resolved, stays in the sandbox's folder."""
        return local.resolve().is_relative_to(self.root.resolve())


class World:
    """All emulated sandboxes, and the clock that kills them when their lifetime ends.

    Args:
        root: the folder under which each sandbox gets its own.
        interrupt_delay_s: seconds from a client leaving an execution to the kernel's interrupt.
        dead_kernel_poll_s: how often Jupyter's restarter looks for a dead kernel (seconds).
        reply_after_idle: pass each ``execute_reply`` on after its ``idle`` (see
            `KernelChannel`).
        kernel_pythonpath: a folder put first on the kernels' ``PYTHONPATH``: one holding
            another ipykernel (the template pins 6.31) makes the kernels that version.
        shared_ipython_dir: give every sandbox's kernels one IPython folder, as a server run
            on one machine does (a startup file one sandbox writes is run by every later
            kernel); False for one per sandbox, as in E2B.
    """

    def __init__(
        self,
        root: Path,
        *,
        interrupt_delay_s: float,
        dead_kernel_poll_s: float,
        reply_after_idle: bool = False,
        kernel_pythonpath: Path | None = None,
        shared_ipython_dir: bool = False,
    ) -> None:
        self.root = root
        self.interrupt_delay_s = interrupt_delay_s
        self.dead_kernel_poll_s = dead_kernel_poll_s
        self.reply_after_idle = reply_after_idle
        self.kernel_pythonpath = kernel_pythonpath
        self.shared_ipython_dir = shared_ipython_dir
        self.sandboxes: dict[str, EmulatedSandbox] = {}
        self.peak_live = 0
        """The most sandboxes alive at once so far."""
        self._reaper: asyncio.Task[None] | None = None

    def start_clock(self) -> None:
        """Start killing sandboxes past their lifetime, as E2B does."""
        self._reaper = asyncio.create_task(self._reap_forever())

    async def close(self) -> None:
        """Kill every sandbox and stop the clock."""
        if self._reaper is not None:
            self._reaper.cancel()
            await asyncio.wait({self._reaper})
        for sandbox in list(self.sandboxes.values()):
            await self.kill(sandbox)

    # --- lifecycle -----------------------------------------------------------------------

    def create(self, body: Mapping[str, Any], idempotency_key: str | None) -> EmulatedSandbox:
        """A running sandbox from a create request's JSON body; the same one for a repeated
        ``Idempotency-Key``."""
        existing = self.made_for(idempotency_key)
        if existing is not None:
            return existing
        sandbox_id = "i" + uuid.uuid4().hex[:19]
        now = datetime.now(UTC)
        root = self.root / sandbox_id
        for folder in _SANDBOX_FOLDERS:
            (root / folder.lstrip("/")).mkdir(parents=True)
        sandbox = EmulatedSandbox(
            sandbox_id=sandbox_id,
            template_id=body.get("templateID") or "code-interpreter-v1",
            metadata=dict(body.get("metadata") or {}),
            envs=dict(body.get("envVars") or {}),
            allow_internet_access=bool(body.get("allow_internet_access", True)),
            started_at=now,
            end_at=now + timedelta(seconds=int(body.get("timeout") or DEFAULT_LIFETIME_S)),
            root=root,
            access_token=secrets.token_hex(16),
            idempotency_key=idempotency_key,
        )
        self.sandboxes[sandbox_id] = sandbox
        self.peak_live = max(self.peak_live, len(self.sandboxes))
        return sandbox

    def made_for(self, idempotency_key: str | None) -> EmulatedSandbox | None:
        """The running sandbox a create with this ``Idempotency-Key`` made, if any."""
        if idempotency_key is None:
            return None
        for existing in self.sandboxes.values():
            if existing.idempotency_key == idempotency_key and not existing.killed.is_set():
                return existing
        return None

    def live(self, sandbox_id: str | None) -> EmulatedSandbox | None:
        """The running sandbox with this id, if any."""
        sandbox = self.sandboxes.get(sandbox_id or "")
        if sandbox is None or sandbox.killed.is_set():
            return None
        return sandbox

    def listed(self, metadata: Mapping[str, str]) -> list[EmulatedSandbox]:
        """Running sandboxes whose metadata includes ``metadata``."""
        return [
            s
            for s in self.sandboxes.values()
            if not s.killed.is_set() and metadata.items() <= s.metadata.items()
        ]

    @staticmethod
    def set_lifetime(sandbox: EmulatedSandbox, timeout_s: int, *, only_extend: bool) -> None:
        """Make the sandbox end ``timeout_s`` from now (no earlier than today's end, if told)."""
        end_at = datetime.now(UTC) + timedelta(seconds=timeout_s)
        sandbox.end_at = max(sandbox.end_at, end_at) if only_extend else end_at

    async def kill(self, sandbox: EmulatedSandbox) -> None:
        """End a sandbox: its kernels killed, its folder removed."""
        self.sandboxes.pop(sandbox.sandbox_id, None)
        sandbox.killed.set()
        for context in list(sandbox.contexts.values()):
            await context.stop()
        await asyncio.to_thread(shutil.rmtree, sandbox.root, True)

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(_REAP_EVERY_S)
            now = datetime.now(UTC)
            for sandbox in list(self.sandboxes.values()):
                if sandbox.end_at <= now:
                    logger.info("Sandbox %s expired", sandbox.sandbox_id)
                    await self.kill(sandbox)

    # --- code contexts -------------------------------------------------------------------

    async def create_context(
        self, sandbox: EmulatedSandbox, language: str | None, cwd: str | None
    ) -> EmulatedContext:
        """A new context with its kernel started in ``cwd`` (home when None).

        As the real server's ``%cd``, a ``cwd`` that does not exist leaves the kernel at home.

        Raises:
            UnsupportedLanguageError: no kernel for ``language``.
            SandboxError: the kernel did not start (nothing is left running).
        """
        context = EmulatedContext(
            id=str(uuid.uuid4()), language=self._checked(language), cwd=cwd or HOME
        )
        await self._start_kernel(sandbox, context)
        return await self._added(sandbox, context)

    async def default_context(
        self, sandbox: EmulatedSandbox, language: str | None = None
    ) -> EmulatedContext:
        """The sandbox's default context of ``language`` (python when None), made on first use.

        Raises:
            UnsupportedLanguageError: no kernel for ``language``.
        """
        language = self._checked(language)
        for context in sandbox.contexts.values():
            if context.id.startswith(f"default-{language}-"):
                return context
        context_id = f"default-{language}-{uuid.uuid4()}"
        context = EmulatedContext(id=context_id, language=language, cwd=HOME)
        await self._start_kernel(sandbox, context)
        return await self._added(sandbox, context)

    @staticmethod
    async def _added(sandbox: EmulatedSandbox, context: EmulatedContext) -> EmulatedContext:
        """Add a context whose kernel has started to its sandbox; one killed during the start is
        gone with it: the context is stopped (its connection's sockets closed, its kernel ended)
        rather than left in a sandbox no one will kill again.

        Raises:
            SandboxDiedError: the sandbox was killed while the kernel started.
        """
        if sandbox.killed.is_set():
            await context.stop()
            raise SandboxDiedError(f"sandbox {sandbox.sandbox_id} was killed as a context started")
        sandbox.contexts[context.id] = context
        return context

    @staticmethod
    def context(sandbox: EmulatedSandbox, context_id: str) -> EmulatedContext:
        """A context of the sandbox.

        Raises:
            ContextNotFoundError: the sandbox has no context with that id.
        """
        found = sandbox.contexts.get(context_id)
        if found is None:
            raise ContextNotFoundError(f"Context {context_id} not found")
        return found

    async def restart_context(self, sandbox: EmulatedSandbox, context: EmulatedContext) -> None:
        """Restart a context as the server does: close its connection (running executions end
        with ``UnexpectedEndOfExecution``), restart the kernel (state lost, at home), open a new
        connection (whose first execution gets envd's variables again).

        Raises:
            RestartRefusedError: Jupyter was restarting the dead kernel; refused once per
                such restart, later calls wait for it.
        """
        if context.auto_restart is not None and not context.auto_restart.done():
            if not context.refused_restart:
                context.refused_restart = True
                raise RestartRefusedError(f"Failed to restart context {context.id}")
            await asyncio.shield(context.auto_restart)
        async with context.restart_lock:
            assert context.kernel is not None and context.channel is not None
            await context.channel.close()
            context.channel = None
            await context.kernel.restart()
            self._connect(sandbox, context)
            await self._change_directory(sandbox, context, HOME)

    @staticmethod
    async def remove_context(sandbox: EmulatedSandbox, context: EmulatedContext) -> None:
        """Remove a context and end its kernel."""
        sandbox.contexts.pop(context.id, None)
        await context.stop()

    @staticmethod
    def _checked(language: str | None) -> str:
        normalized = normalize_language(language)
        if normalized not in LANGUAGES:
            raise UnsupportedLanguageError(
                f"Failed to create context: the emulator has no {normalized} kernel"
            )
        return normalized

    async def _start_kernel(self, sandbox: EmulatedSandbox, context: EmulatedContext) -> None:
        ipython_dir = sandbox.root / "root" / ".ipython"
        if self.shared_ipython_dir:
            ipython_dir = self.root / "_shared" / ".ipython"
        write_template_profile(ipython_dir)
        # No envd variables: the kernel is Jupyter's child, not envd's.
        env = {"IPYTHONDIR": str(ipython_dir)}
        if self.kernel_pythonpath is not None:
            env["PYTHONPATH"] = str(self.kernel_pythonpath)
        config = LocalKernelConfig(
            workdir_root=self.root / "_kernels",
            env=env,
            max_output_chars=None,
            # The kernel works in the emulated sandbox's folder on this machine, outside its
            # own working directory: a test double, not a boundary (see docs/backends/e2b.md).
            isolation="none",
        )
        kernel = await LocalKernelSandbox.create(config)
        try:
            context.kernel = kernel
            self._connect(sandbox, context)
            await self._change_directory(sandbox, context, context.cwd)
            context.restarter = asyncio.create_task(self._restart_when_dead(sandbox, context))
        except BaseException:
            if context.channel is not None:
                await context.channel.close()
            context.kernel = context.channel = None
            await kernel.kill()
            raise

    def _connect(self, sandbox: EmulatedSandbox, context: EmulatedContext) -> None:
        assert context.kernel is not None
        kernel = context.kernel
        context.channel = KernelChannel(
            Path(kernel.handle.connection["runtime_dir"]) / "connection.json",
            interrupt=kernel.interrupt,
            envd_envs=sandbox.envd_envs,
            interrupt_delay_s=self.interrupt_delay_s,
            reply_after_idle=self.reply_after_idle,
        )

    @staticmethod
    async def _change_directory(
        sandbox: EmulatedSandbox, context: EmulatedContext, cwd: str
    ) -> None:
        """The server's silent ``%cd`` (or, after a restart, the kernel starting in Jupyter's
        root folder, which is home); a folder that is not there leaves the kernel at home."""
        assert context.channel is not None
        # A new connection, or one whose kernel was started again, may not hear iopub yet.
        await context.channel.nudge()
        home, target = sandbox.local_path(HOME), sandbox.local_path(cwd)
        lines = await context.channel.run_background(
            f"import os as _os\n_os.chdir({str(home)!r})\n"
            f"try:\n    _os.chdir({str(target)!r})\nexcept OSError:\n    pass\ndel _os"
        )
        errors = [line for line in lines if line["type"] == "error"]
        if errors:
            raise SandboxDiedError(f"kernel refused to change directory: {errors[0]['value']}")

    async def _restart_when_dead(self, sandbox: EmulatedSandbox, context: EmulatedContext) -> None:
        """Jupyter's restarter: a kernel found dead is started again (at home, state lost)."""
        while True:
            await asyncio.sleep(self.dead_kernel_poll_s)
            async with context.restart_lock:
                assert context.kernel is not None
                try:
                    await context.kernel._check_alive()
                    continue
                except SandboxDiedError:
                    logger.info("Context %s: kernel died; restarting it", context.id)
                context.refused_restart = False
                context.auto_restart = asyncio.create_task(self._auto_restart(sandbox, context))
                await asyncio.shield(context.auto_restart)

    async def _auto_restart(self, sandbox: EmulatedSandbox, context: EmulatedContext) -> None:
        assert context.kernel is not None and context.channel is not None
        await context.kernel.restart()
        # Jupyter tells the connection once the new kernel is up; the connection stays.
        context.channel.kernel_restarting()
        await self._change_directory(sandbox, context, HOME)
