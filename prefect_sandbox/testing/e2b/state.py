"""The emulated E2B world: sandboxes, their files and code contexts, and their lifetimes.

Each sandbox's filesystem is a folder on this machine (``/home/user`` inside is
``<root>/<sandbox id>/home/user``); each code context is a real local ipykernel, a
`LocalKernelSandbox`, moved to the context's working directory. As the real code interpreter
server does, per-execution environment variables are set by lines put before the cell's code
and removed by a silent execution after it, and the working directory is changed by a silent
execution, so neither counts as an execution. Everything here runs on the emulator's event loop;
nothing here knows HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import shutil
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path, PurePosixPath
from typing import Any

from jupyter_client.asynchronous.client import AsyncKernelClient

from prefect_sandbox.sandbox.backends.local import LocalKernelConfig, LocalKernelSandbox
from prefect_sandbox.sandbox.base import CellResult
from prefect_sandbox.sandbox.errors import SandboxDiedError

__all__ = [
    "ENVD_VERSION",
    "HOME",
    "NOT_FOUND_MESSAGE",
    "CellEvent",
    "ContextNotFoundError",
    "EmulatedContext",
    "EmulatedSandbox",
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
_SILENT_TIMEOUT_S = 30.0
# Folders every sandbox has from the start, as in E2B's images.
_SANDBOX_FOLDERS = (HOME, "/tmp")


class ContextNotFoundError(LookupError):
    """No context of the sandbox has this id."""


class UnsupportedLanguageError(ValueError):
    """A context of a language the emulator has no kernel for was asked for."""


def normalize_language(language: str | None) -> str:
    """The language as the real server names it: lower case, ``js`` is javascript, None python."""
    if not language:
        return "python"
    language = language.lower().strip()
    return {"js": "javascript", "ts": "typescript"}.get(language, language)


def env_code(env_vars: Mapping[str, str], indent: str) -> str:
    """The lines the real server puts before a cell's code to set its environment variables.

    Quoted as the real server quotes them (with no escaping), indented like the cell's first line.
    """
    return "\n".join(f"{indent}import os; os.environ['{k}'] = '{v}'" for k, v in env_vars.items())


def first_indent(code: str) -> str:
    """The indentation of the first non-blank line of ``code``."""
    for line in code.split("\n"):
        if line.strip():
            return line[: len(line) - len(line.lstrip())]
    return ""


@dataclass(frozen=True)
class CellEvent:
    """What a running cell produced: ``output`` (an nbformat output), ``done`` (its
    `CellResult`) or ``died`` (its kernel died; the context was restarted)."""

    kind: str
    value: Any = None


@dataclass
class EmulatedContext:
    """A code context: its working directory and, once started, its kernel."""

    id: str
    language: str
    cwd: str
    kernel: LocalKernelSandbox | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    cell: asyncio.Task[None] | None = None

    def model(self) -> dict[str, Any]:
        """The context as the server's JSON."""
        return {"id": self.id, "language": self.language, "cwd": self.cwd}

    async def stop(self) -> None:
        """End the running cell and the kernel."""
        if self.cell is not None:
            self.cell.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.cell
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
        interrupt_grace_s: how long the kernels wait between interrupt attempts.
    """

    def __init__(self, root: Path, interrupt_grace_s: float) -> None:
        self.root = root
        self.interrupt_grace_s = interrupt_grace_s
        self.sandboxes: dict[str, EmulatedSandbox] = {}
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
        if idempotency_key is not None:
            for existing in self.sandboxes.values():
                if existing.idempotency_key == idempotency_key and not existing.killed.is_set():
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
        return sandbox

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
        sandbox.contexts[context.id] = context
        return context

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
        """Restart a context's kernel (state lost), after ending its running cell."""
        if context.cell is not None:
            context.cell.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await context.cell
        async with context.lock:
            assert context.kernel is not None
            await context.kernel.restart()
            await self._change_directory(sandbox, context)

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
        config = LocalKernelConfig(
            workdir_root=self.root / "_kernels",
            env=sandbox.envs,
            interrupt_grace_s=self.interrupt_grace_s,
            max_output_chars=None,
            # The kernel works in the emulated sandbox's folder on this machine, outside its
            # own working directory: a test double, not a boundary (see the README).
            isolation="none",
        )
        kernel = await LocalKernelSandbox.create(config)
        try:
            context.kernel = kernel
            await self._change_directory(sandbox, context)
        except BaseException:
            context.kernel = None
            await kernel.kill()
            raise

    async def _change_directory(self, sandbox: EmulatedSandbox, context: EmulatedContext) -> None:
        # Home first: the kernel starts in a folder of the emulator, the real one at home.
        assert context.kernel is not None
        home, target = sandbox.local_path(HOME), sandbox.local_path(context.cwd)
        await _run_silently(
            context.kernel,
            f"import os as _os\n_os.chdir({str(home)!r})\n"
            f"try:\n    _os.chdir({str(target)!r})\nexcept OSError:\n    pass\ndel _os",
        )

    # --- cells ---------------------------------------------------------------------------

    @staticmethod
    async def claim(context: EmulatedContext, abandoned: asyncio.Event) -> bool:
        """Take the context's lock, cells running one at a time; False (and no lock) if
        ``abandoned`` is set first."""
        acquire = asyncio.create_task(context.lock.acquire())
        left = asyncio.create_task(abandoned.wait())
        await asyncio.wait({acquire, left}, return_when=asyncio.FIRST_COMPLETED)
        left.cancel()
        if not acquire.done():
            acquire.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await acquire
            if not acquire.cancelled():
                context.lock.release()
            return False
        if abandoned.is_set():
            context.lock.release()
            return False
        return True

    def start_cell(
        self,
        sandbox: EmulatedSandbox,
        context: EmulatedContext,
        code: str,
        env_vars: Mapping[str, str],
    ) -> asyncio.Queue[CellEvent]:
        """Run a cell in a context whose lock the caller holds (`claim`); the lock is released
        when the cell ends.

        Returns:
            The cell's events, in order (`CellEvent`); ``done`` or ``died`` comes last.
        """
        events: asyncio.Queue[CellEvent] = asyncio.Queue()
        if env_vars:
            code = f"{env_code(env_vars, first_indent(code))}\n{code}"
        context.cell = asyncio.create_task(
            self._run_cell(sandbox, context, code, dict(env_vars), events)
        )
        return events

    async def _run_cell(
        self,
        sandbox: EmulatedSandbox,
        context: EmulatedContext,
        code: str,
        env_vars: dict[str, str],
        events: asyncio.Queue[CellEvent],
    ) -> None:
        assert context.kernel is not None
        try:
            result: CellResult = await context.kernel.run_cell(
                code, on_output=lambda output: events.put_nowait(CellEvent("output", output))
            )
            events.put_nowait(CellEvent("done", result))
            if env_vars:
                lines = "\n".join(f"import os; del os.environ['{k}']" for k in env_vars)
                with contextlib.suppress(Exception):
                    await _run_silently(context.kernel, lines)
        except SandboxDiedError:
            events.put_nowait(CellEvent("died"))
            # Jupyter's restarter brings a dead kernel back, with its state lost.
            await context.kernel.restart()
            await self._change_directory(sandbox, context)
        finally:
            context.cell = None
            context.lock.release()

    @staticmethod
    async def interrupt(context: EmulatedContext) -> None:
        """Interrupt the context's running cell, as the server does when its client leaves."""
        if context.kernel is not None and context.cell is not None and not context.cell.done():
            await context.kernel.interrupt()


async def _run_silently(kernel: LocalKernelSandbox, code: str) -> None:
    """Run code as the real server runs its own (``silent``, out of the history): no
    execution count, no output.

    Raises:
        SandboxDiedError: the kernel did not run it.
    """
    connection_file = Path(kernel.handle.connection["runtime_dir"]) / "connection.json"
    client = AsyncKernelClient(connection_file=os.fspath(connection_file))
    client.load_connection_file()
    client.start_channels(stdin=False, hb=False)
    try:
        reply = await client.execute_interactive(
            code,
            silent=True,
            store_history=False,
            allow_stdin=False,
            timeout=_SILENT_TIMEOUT_S,
            output_hook=lambda msg: None,
        )
    except TimeoutError as exc:
        raise SandboxDiedError(f"kernel did not answer: {exc}") from exc
    finally:
        client.stop_channels()
    if reply["content"]["status"] != "ok":
        raise SandboxDiedError(f"kernel refused {code!r}: {reply['content'].get('evalue')}")
