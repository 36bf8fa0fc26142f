"""`E2BEmulator`: E2B's lifecycle API, envd and the code interpreter, on one loopback port.

What it serves (the wire facts are those of e2b 2.63.0 / e2b-code-interpreter 2.11.5):

- the REST control plane: create (``Idempotency-Key`` honoured), connect, set_timeout, get_info,
  list (metadata filter), kill; the ``X-API-KEY`` header is checked on each call;
- envd: ``/health``, ``GET``/``POST /files`` (multipart and octet-stream) and the Connect-RPC
  filesystem calls ``Stat``, ``ListDir``, ``MakeDir``, ``Remove``, ``Move`` (through the server
  stubs the SDK ships); ``X-Access-Token`` is checked;
- the code interpreter: ``/execute`` (NDJSON stream), ``/contexts`` (create, list, restart,
  remove).

Each sandbox's filesystem is a folder on this machine (``/home/user`` inside is
``<root>/<sandbox id>/home/user``); each code context is a real local ipykernel, a
`LocalKernelSandbox`, whose working directory is changed to the context's. As the real server
does, a client that disconnects from ``/execute`` gets its cell interrupted; a kernel that dies
during a cell is restarted and the cell ends with a ``ContextRestarting`` error. Sandboxes past
their lifetime are killed, kernels included. Calls for a killed or expired sandbox get 404 from
the control plane and 502 ``The sandbox was not found`` from envd and the code interpreter.

Faults are injected with `E2BEmulator.inject`; every request is recorded in
`E2BEmulator.requests`.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.parser
import email.policy
import json
import logging
import os
import secrets
import shutil
import socket
import tempfile
import threading
import time
import urllib.parse
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path, PurePosixPath
from typing import Any

import uvicorn
from connectrpc.code import Code
from connectrpc.errors import ConnectError
from e2b.envd.filesystem.filesystem_connect import Filesystem, FilesystemASGIApplication
from e2b.envd.filesystem.filesystem_pb import (
    EntryInfo,
    ListDirResponse,
    MakeDirResponse,
    MoveResponse,
    RemoveResponse,
    StatResponse,
)

from prefect_sandbox.sandbox.backends.local import LocalKernelConfig, LocalKernelSandbox
from prefect_sandbox.sandbox.base import CellResult
from prefect_sandbox.sandbox.errors import SandboxDiedError
from prefect_sandbox.testing.e2b.wire import execute_lines, operation_of

__all__ = ["E2BEmulator", "Fault", "RequestRecord"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

logger = logging.getLogger(__name__)

ENVD_VERSION = "0.5.7"
HOME = "/home/user"
DEFAULT_LIFETIME_S = 300
_KEEPALIVE_S = 5.0
_REAP_EVERY_S = 0.2
_NOT_FOUND_MESSAGE = "The sandbox was not found"


@dataclass
class Fault:
    """A fault the emulator injects into the requests of one operation.

    Attributes:
        operation: the call it hits, as `operation_of` names it: ``"create"``, ``"connect"``,
            ``"set_timeout"``, ``"kill"``, ``"list"``, ``"files.read"``, ``"files.write"``,
            ``"files.list"``, ``"files.stat"``, ``"execute"``, ``"contexts.create"``, ...
        status: answer with this HTTP status instead of serving (429, 500, 502, 503, 504...).
        retry_after_s: the ``Retry-After`` header sent with ``status``, in whole seconds.
        delay_s: seconds to wait before answering (a slow response).
        serve_first: serve the request, then answer with ``status`` anyway (a 504 whose
            sandbox was made all the same).
        drop_after_lines: for ``execute``: close the connection abruptly after this many
            NDJSON lines; the cell goes on running in the kernel.
        times: how many requests it hits before it is spent; None for every one.
    """

    operation: str
    status: int | None = None
    retry_after_s: int | None = None
    delay_s: float = 0.0
    serve_first: bool = False
    drop_after_lines: int | None = None
    times: int | None = 1


@dataclass(frozen=True)
class RequestRecord:
    """One request the emulator received.

    Attributes:
        operation: the call, as `operation_of` names it (None for an unknown path).
        method: the HTTP method.
        path: the path, without the query.
        at: ``time.monotonic()`` when it arrived.
        sandbox_id: the ``E2b-Sandbox-Id`` header, or the id in the path, when there is one.
        faulted: True when an injected fault hit it.
        headers: its headers, lower-cased names.
    """

    operation: str | None
    method: str
    path: str
    at: float
    sandbox_id: str | None
    faulted: bool
    headers: dict[str, str]


class _DroppedConnection(Exception):
    """Raised inside the app to make uvicorn close the connection mid-response."""


@dataclass
class _Context:
    id: str
    language: str
    cwd: str
    kernel: LocalKernelSandbox | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    cell: asyncio.Task[None] | None = None


@dataclass
class _Sandbox:
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
    contexts: dict[str, _Context] = field(default_factory=dict)
    killed: asyncio.Event = field(default_factory=asyncio.Event)

    def sandbox_json(self) -> dict[str, Any]:
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


class _State:
    """Everything the app knows; lives on the server's event loop."""

    def __init__(self, api_key: str, root: Path, kernel_config: LocalKernelConfig) -> None:
        self.api_key = api_key
        self.root = root
        self.kernel_config = kernel_config
        self.sandboxes: dict[str, _Sandbox] = {}
        self.faults: list[Fault] = []
        self.requests: list[RequestRecord] = []
        self.lock = threading.Lock()

    def take_fault(self, operation: str | None) -> Fault | None:
        with self.lock:
            for fault in self.faults:
                if fault.operation == operation:
                    if fault.times is not None:
                        fault.times -= 1
                        if fault.times <= 0:
                            self.faults.remove(fault)
                    return fault
        return None

    def live(self, sandbox_id: str | None) -> _Sandbox | None:
        sandbox = self.sandboxes.get(sandbox_id or "")
        if sandbox is None or sandbox.killed.is_set():
            return None
        return sandbox

    async def kill(self, sandbox: _Sandbox) -> None:
        self.sandboxes.pop(sandbox.sandbox_id, None)
        sandbox.killed.set()
        for context in list(sandbox.contexts.values()):
            await _stop_context(context)
        await asyncio.to_thread(shutil.rmtree, sandbox.root, True)

    async def reap(self) -> None:
        """Kill sandboxes past their lifetime, as E2B does."""
        while True:
            await asyncio.sleep(_REAP_EVERY_S)
            now = datetime.now(UTC)
            for sandbox in list(self.sandboxes.values()):
                if sandbox.end_at <= now:
                    logger.info("Sandbox %s expired", sandbox.sandbox_id)
                    await self.kill(sandbox)

    async def close(self) -> None:
        for sandbox in list(self.sandboxes.values()):
            await self.kill(sandbox)


async def _stop_context(context: _Context) -> None:
    if context.cell is not None:
        context.cell.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await context.cell
    if context.kernel is not None:
        await context.kernel.kill()


# --- tiny HTTP helpers -------------------------------------------------------------------


async def _read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            break
    return b"".join(chunks)


async def _respond(
    send: Send,
    status: int,
    body: bytes | str | Any = b"",
    *,
    content_type: str | None = None,
    headers: dict[str, str] | None = None,
) -> None:
    if isinstance(body, str):
        payload, content_type = body.encode(), content_type or "text/plain; charset=utf-8"
    elif isinstance(body, bytes):
        payload = body
    else:
        payload, content_type = json.dumps(body).encode(), "application/json"
    raw_headers = [(b"content-length", str(len(payload)).encode())]
    if content_type:
        raw_headers.append((b"content-type", content_type.encode()))
    for name, value in (headers or {}).items():
        raw_headers.append((name.lower().encode(), value.encode()))
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": payload})


async def _not_found_502(send: Send, sandbox_id: str | None) -> None:
    await _respond(send, 502, {"sandboxId": sandbox_id, "message": _NOT_FOUND_MESSAGE, "code": 502})


def _error_json(code: int, message: str) -> dict[str, Any]:
    return {"code": code, "message": message}


def _stat_entry(sandbox: _Sandbox, local: Path) -> dict[str, Any]:
    """An envd ``EntryInfo`` in proto3 JSON for a path on this machine."""
    info = local.lstat()
    is_link = local.is_symlink()
    target_type = "FILE_TYPE_FILE"
    with contextlib.suppress(OSError):
        if local.is_dir():
            target_type = "FILE_TYPE_DIRECTORY"
    entry: dict[str, Any] = {
        "name": local.name,
        "type": target_type,
        "path": sandbox.sandbox_path(local),
        "size": str(info.st_size),
        "mode": info.st_mode & 0o777,
        "permissions": "",
        "owner": "user",
        "group": "user",
        "modifiedTime": datetime.fromtimestamp(info.st_mtime, UTC)
        .isoformat()
        .replace("+00:00", "Z"),
        "isSymlink": is_link,
    }
    if is_link:
        entry["symlinkTarget"] = sandbox.sandbox_path(Path(os.path.realpath(local)))
    return entry


class _App:
    """The ASGI application."""

    def __init__(self, state: _State) -> None:
        self.state = state
        self._filesystem: Any = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        method, path = scope["method"], scope["path"]
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        operation = operation_of(method, path)
        sandbox_id = headers.get("e2b-sandbox-id")
        if sandbox_id is None and path.startswith(("/sandboxes/", "/v2/sandboxes/")):
            sandbox_id = path.split("/sandboxes/", 1)[1].split("/", 1)[0]
        fault = self.state.take_fault(operation)
        self.state.requests.append(
            RequestRecord(
                operation=operation,
                method=method,
                path=path,
                at=time.monotonic(),
                sandbox_id=sandbox_id,
                faulted=fault is not None,
                headers=headers,
            )
        )
        if fault is not None and fault.delay_s:
            await asyncio.sleep(fault.delay_s)
        if fault is not None and fault.status is not None and not fault.serve_first:
            await _respond(
                send,
                fault.status,
                _error_json(fault.status, f"injected fault: {fault.status}"),
                headers=_retry_after(fault),
            )
            return
        if operation is None:
            await _respond(send, 404, _error_json(404, f"no route {method} {path}"))
            return
        if fault is not None and fault.serve_first and fault.status is not None:
            # Serve for real, throw the answer away and report a failure instead.
            async def discard(message: Message) -> None:
                return None

            await self._route(operation, scope, receive, discard, headers, None)
            await _respond(
                send,
                fault.status,
                _error_json(fault.status, "injected fault after serving"),
                headers=_retry_after(fault),
            )
            return
        await self._route(operation, scope, receive, send, headers, fault)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        reaper: asyncio.Task[None] | None = None
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                reaper = asyncio.create_task(self.state.reap())
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if reaper is not None:
                    reaper.cancel()
                await self.state.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _route(
        self,
        operation: str,
        scope: Scope,
        receive: Receive,
        send: Send,
        headers: dict[str, str],
        fault: Fault | None,
    ) -> None:
        if operation in ("create", "list", "get_info", "kill", "set_timeout", "connect"):
            if headers.get("x-api-key") != self.state.api_key:
                await _respond(send, 401, _error_json(401, "Invalid API key"))
                return
            await self._control(operation, scope, receive, send, headers)
            return
        sandbox = self.state.live(headers.get("e2b-sandbox-id"))
        if sandbox is None:
            await _not_found_502(send, headers.get("e2b-sandbox-id"))
            return
        if operation == "health":
            await _respond(send, 204)
            return
        # The code interpreter's context calls carry no access token (SDK >= 2.10.5).
        needs_token = operation == "execute" or operation.startswith("files.")
        if needs_token and headers.get("x-access-token") != sandbox.access_token:
            await _respond(send, 401, _error_json(401, "invalid access token"))
            return
        if operation == "files.read":
            await self._read_file(sandbox, scope, send)
        elif operation == "files.write":
            await self._write_file(sandbox, scope, receive, send, headers)
        elif operation.startswith("files."):
            await self._filesystem_app()(scope, receive, send)
        elif operation == "execute":
            await self._execute(sandbox, receive, send, fault)
        else:
            await self._contexts(operation, sandbox, scope, receive, send)

    # --- control plane -------------------------------------------------------------------

    async def _control(
        self, operation: str, scope: Scope, receive: Receive, send: Send, headers: dict[str, str]
    ) -> None:
        body = await _read_body(receive)
        if operation == "create":
            await self._create(json.loads(body or b"{}"), headers, send)
            return
        if operation == "list":
            query = urllib.parse.parse_qs(scope["query_string"].decode())
            wanted = {
                urllib.parse.unquote(k): urllib.parse.unquote(v)
                for k, v in urllib.parse.parse_qsl(query.get("metadata", [""])[0])
            }
            found = [
                s.detail_json()
                for s in self.state.sandboxes.values()
                if not s.killed.is_set() and wanted.items() <= s.metadata.items()
            ]
            await _respond(send, 200, found)
            return
        sandbox_id = scope["path"].split("/sandboxes/", 1)[1].split("/", 1)[0]
        sandbox = self.state.live(sandbox_id)
        if sandbox is None:
            if operation == "connect":
                message = f"Paused sandbox {sandbox_id} not found"
            else:
                message = f"sandbox {sandbox_id} not found"
            await _respond(send, 404, _error_json(404, message))
            return
        if operation == "kill":
            await self.state.kill(sandbox)
            await _respond(send, 204)
        elif operation == "get_info":
            await _respond(send, 200, sandbox.detail_json())
        elif operation == "set_timeout":
            timeout_s = int(json.loads(body)["timeout"])
            sandbox.end_at = datetime.now(UTC) + timedelta(seconds=timeout_s)
            await _respond(send, 204)
        else:  # connect: the timeout only ever extends a running sandbox
            timeout_s = json.loads(body or b"{}").get("timeout")
            if timeout_s is not None:
                sandbox.end_at = max(
                    sandbox.end_at, datetime.now(UTC) + timedelta(seconds=int(timeout_s))
                )
            await _respond(send, 200, sandbox.sandbox_json())

    async def _create(self, body: dict[str, Any], headers: dict[str, str], send: Send) -> None:
        key = headers.get("idempotency-key")
        if key is not None:
            for existing in self.state.sandboxes.values():
                if existing.idempotency_key == key and not existing.killed.is_set():
                    await _respond(send, 201, existing.sandbox_json())
                    return
        sandbox_id = "i" + uuid.uuid4().hex[:19]
        now = datetime.now(UTC)
        root = self.state.root / sandbox_id
        (root / HOME.lstrip("/")).mkdir(parents=True)
        sandbox = _Sandbox(
            sandbox_id=sandbox_id,
            template_id=body.get("templateID") or "code-interpreter-v1",
            metadata=dict(body.get("metadata") or {}),
            envs=dict(body.get("envVars") or {}),
            allow_internet_access=bool(body.get("allow_internet_access", True)),
            started_at=now,
            end_at=now + timedelta(seconds=int(body.get("timeout") or DEFAULT_LIFETIME_S)),
            root=root,
            access_token=secrets.token_hex(16),
            idempotency_key=key,
        )
        self.state.sandboxes[sandbox_id] = sandbox
        await _respond(send, 201, sandbox.sandbox_json())

    # --- envd ----------------------------------------------------------------------------

    async def _read_file(self, sandbox: _Sandbox, scope: Scope, send: Send) -> None:
        query = urllib.parse.parse_qs(scope["query_string"].decode())
        path = query.get("path", [""])[0]
        local = sandbox.local_path(path)
        if not local.is_file() or not sandbox.inside(local):
            await _respond(send, 404, _error_json(404, f"path '{path}' does not exist"))
            return
        data = await asyncio.to_thread(local.read_bytes)
        await _respond(send, 200, data, content_type="application/octet-stream")

    async def _write_file(
        self, sandbox: _Sandbox, scope: Scope, receive: Receive, send: Send, headers: dict[str, str]
    ) -> None:
        query = urllib.parse.parse_qs(scope["query_string"].decode())
        body = await _read_body(receive)
        content_type = headers.get("content-type", "")
        files: list[tuple[str, bytes]] = []
        if content_type.startswith("multipart/form-data"):
            parsed = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
                b"Content-Type: " + content_type.encode() + b"\r\n\r\n" + body
            )
            for part in parsed.iter_parts():
                payload = part.get_payload(decode=True)
                name = query.get("path", [part.get_filename() or ""])[0]
                files.append((name, payload if isinstance(payload, bytes) else b""))
        else:
            files.append((query.get("path", [""])[0], body))
        written = []
        for path, data in files:
            local = sandbox.local_path(path)
            if not sandbox.inside(local.parent if not local.exists() else local):
                await _respond(send, 400, _error_json(400, f"path '{path}' is not allowed"))
                return
            local.parent.mkdir(parents=True, exist_ok=True)
            await asyncio.to_thread(local.write_bytes, data)
            written.append(
                {"name": local.name, "type": "file", "path": sandbox.sandbox_path(local)}
            )
        await _respond(send, 200, written)

    def _filesystem_app(self) -> Any:
        if self._filesystem is None:
            self._filesystem = FilesystemASGIApplication(_FilesystemService(self.state))
        return self._filesystem

    # --- code interpreter ----------------------------------------------------------------

    async def _contexts(
        self, operation: str, sandbox: _Sandbox, scope: Scope, receive: Receive, send: Send
    ) -> None:
        body = await _read_body(receive)
        if operation == "contexts.list":
            await _respond(
                send,
                200,
                [
                    {"id": c.id, "language": c.language, "cwd": c.cwd}
                    for c in sandbox.contexts.values()
                ],
            )
            return
        if operation == "contexts.create":
            request = json.loads(body or b"{}")
            language = request.get("language") or "python"
            if language != "python":
                await _respond(send, 500, f"the emulator runs only python, not {language}")
                return
            context = _Context(
                id=str(uuid.uuid4()), language=language, cwd=request.get("cwd") or HOME
            )
            try:
                await self._start_kernel(sandbox, context)
            except SandboxDiedError:
                await _respond(send, 500, "Failed to set working directory")
                return
            sandbox.contexts[context.id] = context
            await _respond(send, 200, {"id": context.id, "language": language, "cwd": context.cwd})
            return
        context_id = scope["path"].split("/")[2]
        existing = sandbox.contexts.get(context_id)
        if existing is None:
            await _respond(send, 404, f"Context {context_id} not found")
            return
        if operation == "contexts.remove":
            sandbox.contexts.pop(context_id, None)
            await _stop_context(existing)
        else:
            if existing.cell is not None:
                existing.cell.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await existing.cell
            async with existing.lock:
                assert existing.kernel is not None
                await existing.kernel.restart()
                await self._change_directory(sandbox, existing)
        await _respond(send, 200, b"null", content_type="application/json")

    async def _start_kernel(self, sandbox: _Sandbox, context: _Context) -> None:
        config = LocalKernelConfig(
            workdir_root=self.state.root / "_kernels",
            env=sandbox.envs,
            interrupt_grace_s=self.state.kernel_config.interrupt_grace_s,
            max_output_chars=None,
            startup_timeout_s=self.state.kernel_config.startup_timeout_s,
            # The kernel works in the emulated sandbox's folder on this machine, outside its
            # own working directory: a test double, not a boundary (see the README).
            isolation="none",
        )
        context.kernel = await LocalKernelSandbox.create(config)
        await self._change_directory(sandbox, context)

    async def _change_directory(self, sandbox: _Sandbox, context: _Context) -> None:
        # The real server, too, runs a cell that changes directory in a new kernel.
        assert context.kernel is not None
        local = sandbox.local_path(context.cwd)
        result = await context.kernel.run_cell(f"__import__('os').chdir({str(local)!r})")
        if result.status != "ok":
            raise SandboxDiedError(f"cannot change directory to {context.cwd}")

    async def _execute(
        self, sandbox: _Sandbox, receive: Receive, send: Send, fault: Fault | None
    ) -> None:
        request = json.loads(await _read_body(receive) or b"{}")
        context_id, language = request.get("context_id"), request.get("language")
        if context_id and language:
            await _respond(send, 400, "context_id and language are mutually exclusive")
            return
        if context_id:
            context = sandbox.contexts.get(context_id)
            if context is None:
                await _respond(send, 404, f"Context {context_id} not found")
                return
        else:
            context = await self._default_context(sandbox)
        disconnected = asyncio.Event()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            disconnected.set()

        watcher = asyncio.create_task(watch())
        try:
            await self._execute_in(sandbox, context, request["code"], send, fault, disconnected)
        finally:
            watcher.cancel()

    async def _default_context(self, sandbox: _Sandbox) -> _Context:
        for context in sandbox.contexts.values():
            if context.id.startswith("default-"):
                return context
        context = _Context(id=f"default-{uuid.uuid4()}", language="python", cwd=HOME)
        await self._start_kernel(sandbox, context)
        sandbox.contexts[context.id] = context
        return context

    async def _execute_in(
        self,
        sandbox: _Sandbox,
        context: _Context,
        code: str,
        send: Send,
        fault: Fault | None,
        disconnected: asyncio.Event,
    ) -> None:
        # Cells of one context run one at a time; a client that leaves while it waits is gone.
        acquire = asyncio.create_task(context.lock.acquire())
        left = asyncio.create_task(disconnected.wait())
        await asyncio.wait({acquire, left}, return_when=asyncio.FIRST_COMPLETED)
        left.cancel()
        if not acquire.done():
            acquire.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await acquire
            if not acquire.cancelled():
                context.lock.release()
            return
        if disconnected.is_set():
            context.lock.release()
            return
        queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        context.cell = asyncio.create_task(self._run_cell(sandbox, context, code, queue))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        lines_sent = 0

        async def send_line(line: dict[str, Any]) -> None:
            nonlocal lines_sent
            drop_at = None if fault is None else fault.drop_after_lines
            if drop_at is not None and lines_sent >= drop_at:
                raise _DroppedConnection("injected: connection dropped mid-execute")
            body = json.dumps(line).encode() + b"\n"
            await send({"type": "http.response.body", "body": body, "more_body": True})
            lines_sent += 1

        streamed_error = False
        while True:
            getter = asyncio.create_task(queue.get())
            waiters: set[asyncio.Future[Any]] = {
                getter,
                asyncio.create_task(disconnected.wait()),
                asyncio.create_task(sandbox.killed.wait()),
            }
            done, pending = await asyncio.wait(
                waiters, timeout=_KEEPALIVE_S, return_when=asyncio.FIRST_COMPLETED
            )
            for task in pending:
                task.cancel()
            if getter not in done:
                if sandbox.killed.is_set():
                    raise _DroppedConnection("sandbox killed mid-execute")
                if disconnected.is_set():
                    # As the real server does when its client goes away: interrupt the cell.
                    if context.kernel is not None and not context.cell.done():
                        await context.kernel.interrupt()
                    return
                await send_line({"type": "keepalive"})
                continue
            kind, value = getter.result()
            if kind == "output":
                streamed_error = streamed_error or value["output_type"] == "error"
                for line in execute_lines(value):
                    await send_line(line)
                continue
            if kind == "done":
                result: CellResult = value
                if result.status == "error" and not streamed_error and result.error:
                    await send_line(
                        {
                            "type": "error",
                            "name": result.error.ename,
                            "value": result.error.evalue,
                            "traceback": "\n".join(result.error.traceback),
                        }
                    )
                if result.execution_count is not None:
                    await send_line(
                        {"type": "number_of_executions", "execution_count": result.execution_count}
                    )
            elif kind == "died":
                await send_line(
                    {
                        "type": "error",
                        "name": "ContextRestarting",
                        "value": "Context was restarted",
                        "traceback": "",
                    }
                )
            await send_line({"type": "end_of_execution"})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return

    async def _run_cell(
        self, sandbox: _Sandbox, context: _Context, code: str, queue: asyncio.Queue[tuple[str, Any]]
    ) -> None:
        assert context.kernel is not None
        try:
            result = await context.kernel.run_cell(
                code, on_output=lambda output: queue.put_nowait(("output", output))
            )
            queue.put_nowait(("done", result))
        except SandboxDiedError:
            queue.put_nowait(("died", None))
            # Jupyter's restarter brings a dead kernel back, with its state lost.
            await context.kernel.restart()
            await self._change_directory(sandbox, context)
        finally:
            context.cell = None
            context.lock.release()


def _retry_after(fault: Fault) -> dict[str, str]:
    return {} if fault.retry_after_s is None else {"Retry-After": str(fault.retry_after_s)}


class _FilesystemService(Filesystem):
    """envd's Connect-RPC filesystem calls, on the folders of emulated sandboxes."""

    def __init__(self, state: _State) -> None:
        self.state = state

    def _sandbox(self, ctx: Any) -> _Sandbox:
        sandbox = self.state.live(ctx.request_headers.get("e2b-sandbox-id"))
        if sandbox is None:
            raise ConnectError(Code.UNAVAILABLE, _NOT_FOUND_MESSAGE)
        return sandbox

    def _existing(self, sandbox: _Sandbox, path: str) -> Path:
        local = sandbox.local_path(path)
        if not (local.exists() or local.is_symlink()):
            raise ConnectError(Code.NOT_FOUND, f"no such file or directory: {path}")
        return local

    def _entry(self, sandbox: _Sandbox, local: Path) -> Any:
        return _from_json(EntryInfo, _stat_entry(sandbox, local))

    async def stat(self, request: Any, ctx: Any) -> Any:
        sandbox = self._sandbox(ctx)
        return StatResponse(entry=self._entry(sandbox, self._existing(sandbox, request.path)))

    async def list_dir(self, request: Any, ctx: Any) -> Any:
        sandbox = self._sandbox(ctx)
        top = self._existing(sandbox, request.path)
        depth = max(int(request.depth), 1)
        entries = []
        for folder, names, files in os.walk(top):
            level = len(Path(folder).relative_to(top).parts) + 1
            for name in sorted(names + files):
                entries.append(self._entry(sandbox, Path(folder) / name))
            if level >= depth:
                names.clear()
        return ListDirResponse(entries=entries)

    async def make_dir(self, request: Any, ctx: Any) -> Any:
        sandbox = self._sandbox(ctx)
        local = sandbox.local_path(request.path)
        if local.exists():
            raise ConnectError(Code.ALREADY_EXISTS, f"{request.path} exists")
        local.mkdir(parents=True)
        return MakeDirResponse(entry=self._entry(sandbox, local))

    async def remove(self, request: Any, ctx: Any) -> Any:
        sandbox = self._sandbox(ctx)
        local = self._existing(sandbox, request.path)
        if local.is_dir() and not local.is_symlink():
            shutil.rmtree(local)
        else:
            local.unlink()
        return RemoveResponse()

    async def move(self, request: Any, ctx: Any) -> Any:
        sandbox = self._sandbox(ctx)
        source = self._existing(sandbox, request.source)
        target = sandbox.local_path(request.destination)
        target.parent.mkdir(parents=True, exist_ok=True)
        source.rename(target)
        return MoveResponse(entry=self._entry(sandbox, target))


def _from_json(message_class: Any, data: dict[str, Any]) -> Any:
    return message_class.from_json(json.dumps(data))


class E2BEmulator:
    """An offline E2B that the real SDK talks to, served by uvicorn on 127.0.0.1.

    Use it as a context manager, or call `start` and `stop`. Point the SDK at it with
    `settings` (or the `api_key` and `url` attributes).

    Args:
        api_key: the key the emulator accepts; a random one when None.
        root: folder holding the sandboxes' files; a fresh temporary folder when None
            (removed by `stop`).
        port: TCP port on 127.0.0.1; 0 for a free one.
        interrupt_grace_s: how long the emulated kernels wait between interrupt attempts.
        log_level: uvicorn's log level.
    """

    def __init__(
        self,
        *,
        api_key: str | None = None,
        root: Path | None = None,
        port: int = 0,
        interrupt_grace_s: float = 5.0,
        log_level: str = "warning",
    ) -> None:
        self.api_key = api_key or f"e2b_emulator_{secrets.token_hex(16)}"
        self._owns_root = root is None
        self.root = root or Path(tempfile.mkdtemp(prefix="prefect-sandbox-e2b-"))
        self._port = port
        self._log_level = log_level
        self._state = _State(
            self.api_key, self.root, LocalKernelConfig(interrupt_grace_s=interrupt_grace_s)
        )
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.url = ""

    @property
    def settings(self) -> dict[str, str]:
        """The SDK's environment variables that point it at this emulator."""
        return {"E2B_API_KEY": self.api_key, "E2B_API_URL": self.url, "E2B_SANDBOX_URL": self.url}

    @property
    def requests(self) -> list[RequestRecord]:
        """Every request received so far, oldest first."""
        with self._state.lock:
            return list(self._state.requests)

    def inject(self, *faults: Fault) -> None:
        """Add faults; each hits the next matching requests until spent."""
        with self._state.lock:
            self._state.faults.extend(faults)

    def clear_faults(self) -> None:
        """Remove every fault not yet spent."""
        with self._state.lock:
            self._state.faults.clear()

    def live_sandboxes(self, metadata: dict[str, str] | None = None) -> list[str]:
        """Ids of live sandboxes whose metadata includes ``metadata``."""
        wanted = dict(metadata or {})
        return sorted(
            s.sandbox_id
            for s in list(self._state.sandboxes.values())
            if not s.killed.is_set() and wanted.items() <= s.metadata.items()
        )

    def end_at(self, sandbox_id: str) -> datetime:
        """When the sandbox expires unless extended (UTC).

        Raises:
            KeyError: no live sandbox has that id.
        """
        return self._state.sandboxes[sandbox_id].end_at

    def expire(self, sandbox_id: str) -> None:
        """Make a sandbox expire now, as if its lifetime had run out; waits until it is gone.

        Raises:
            KeyError: no live sandbox has that id.
        """
        sandbox = self._state.sandboxes[sandbox_id]
        self._call(self._state.kill(sandbox)).result(timeout=30)

    def _call(self, coro: Awaitable[None]) -> Future[None]:
        assert self._loop is not None, "the emulator is not running"

        async def run() -> None:
            await coro

        return asyncio.run_coroutine_threadsafe(run(), self._loop)

    def _config(self) -> uvicorn.Server:
        config = uvicorn.Config(
            _App(self._state),
            log_level=self._log_level,
            lifespan="on",
            timeout_graceful_shutdown=5,
        )
        return uvicorn.Server(config)

    def _socket(self) -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self._port))
        host, port = sock.getsockname()
        self.url = f"http://{host}:{port}"
        return sock

    def start(self, startup_timeout_s: float = 30.0) -> E2BEmulator:
        """Serve in a background thread; returns once it accepts connections.

        Raises:
            RuntimeError: it did not start within ``startup_timeout_s``.
        """
        sock = self._socket()
        self._server = self._config()
        server = self._server

        def serve() -> None:
            async def main() -> None:
                self._loop = asyncio.get_running_loop()
                await server.serve(sockets=[sock])

            asyncio.run(main())

        self._thread = threading.Thread(target=serve, name="e2b-emulator", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + startup_timeout_s
        while not server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the E2B emulator did not start")
            time.sleep(0.02)
        return self

    def serve_forever(self, on_ready: Callable[[], None] | None = None) -> None:
        """Serve in this thread until interrupted (Ctrl-C).

        Args:
            on_ready: called once the port is bound, when `settings` and `url` are known.
        """
        sock = self._socket()
        self._server = self._config()
        if on_ready is not None:
            on_ready()
        try:
            self._server.run(sockets=[sock])
        finally:
            self._cleanup()

    def stop(self) -> None:
        """Kill every sandbox and its kernels, stop serving and remove the files."""
        if self._server is not None and self._thread is not None:
            self._server.should_exit = True
            self._thread.join(timeout=30)
        self._cleanup()

    def _cleanup(self) -> None:
        if self._owns_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> E2BEmulator:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
