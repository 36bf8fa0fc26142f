"""The E2B emulator's ASGI app: the REST control plane, envd and the code interpreter.

Wire formats are those of e2b 2.63.0 / e2b-code-interpreter 2.11.5 (see `wire.ROUTES`): the
control plane checks ``X-API-KEY``; envd's files and ``/execute`` check the sandbox's
``X-Access-Token``; a call for a sandbox that is gone gets 502 ``The sandbox was not found``
from envd and the code interpreter and 404 from the control plane. envd's Connect-RPC
filesystem calls are served by the server stubs the SDK ships. An outer gate records each
request and plays injected faults (`prefect_sandbox.testing.faults`).
Manual: docs/backends/e2b.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.parser
import email.policy
import json
import math
import os
import shutil
import urllib.parse
from collections.abc import AsyncGenerator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

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
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Match, Route, Router
from starlette.types import ASGIApp, Receive, Scope, Send

from prefect_sandbox.sandbox.errors import SandboxError
from prefect_sandbox.sandbox.paths import is_utf8
from prefect_sandbox.testing.e2b.state import (
    NOT_FOUND_MESSAGE,
    ContextNotFoundError,
    EmulatedContext,
    EmulatedSandbox,
    RestartRefusedError,
    UnsupportedLanguageError,
    World,
)
from prefect_sandbox.testing.e2b.wire import ROUTES
from prefect_sandbox.testing.faults import INTERRUPT_AFTER_S_KEY, FaultBook, serve_with_fault
from prefect_sandbox.testing.limits import E2B_QUOTA_MESSAGE, RateLimits

__all__ = ["build_app"]

# What connect-go answers when protobuf-go refuses to marshal a string that is not UTF-8.
_NOT_UTF8_MESSAGE = "marshal message: proto: field filesystem.EntryInfo.name contains invalid UTF-8"


class _DroppedConnection(Exception):
    """Raised inside the app to make uvicorn close the connection mid-response."""


def _error_json(status: int, message: str | None = None) -> dict[str, Any]:
    return {"code": status, "message": message or f"injected fault: {status}"}


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(_error_json(status, message), status_code=status)


def _gone(sandbox_id: str | None) -> JSONResponse:
    body = {"sandboxId": sandbox_id, "message": NOT_FOUND_MESSAGE, "code": 502}
    return JSONResponse(body, status_code=502)


def _sandbox_of(world: World, request: Request, *, needs_token: bool) -> EmulatedSandbox | Response:
    """The live sandbox a sandbox call is for, or the answer that refuses it: 502 for a sandbox
    that is gone, 401 for a wrong ``X-Access-Token`` where one is needed."""
    sandbox_id = request.headers.get("e2b-sandbox-id")
    sandbox = world.live(sandbox_id)
    if sandbox is None:
        return _gone(sandbox_id)
    if needs_token and request.headers.get("x-access-token") != sandbox.access_token:
        return _error(401, "invalid access token")
    return sandbox


def build_app(world: World, *, api_key: str, faults: FaultBook, limits: RateLimits) -> ASGIApp:
    """The emulator's ASGI app.

    Args:
        world: the emulated sandboxes.
        api_key: the only API key the control plane accepts.
        faults: faults to inject; requests are recorded there.
        limits: the rate limits and quota to enforce (E2B's limiter, `Gcra`).
    """
    routes = _E2BApi(world, api_key, limits).routes()
    return _Gate(Router(routes=routes), routes, faults, limits)


class _E2BApi:
    """The emulator's handlers over one `World`: the control plane (``/sandboxes``), each
    sandbox's envd (files, health) and its code interpreter (contexts, ``/execute``)."""

    def __init__(self, world: World, api_key: str, limits: RateLimits) -> None:
        self.world = world
        self.api_key = api_key
        self.limits = limits

    def unauthorized(self, request: Request) -> Response | None:
        if request.headers.get("x-api-key") != self.api_key:
            return _error(401, "Invalid API key")
        return None

    async def json_body(self, request: Request) -> dict[str, Any]:
        body = await request.body()
        parsed = json.loads(body or b"{}")
        return parsed if isinstance(parsed, dict) else {}

    # --- control plane -------------------------------------------------------------------

    async def create(self, request: Request) -> Response:
        refused = self.unauthorized(request)
        if refused is not None:
            return refused
        body = await self.json_body(request)
        key = request.headers.get("idempotency-key")
        quota = self.limits.limits.max_live_sandboxes
        if self.world.made_for(key) is None and self.limits.over_quota(len(self.world.sandboxes)):
            message = E2B_QUOTA_MESSAGE.format(quota=quota)
            return JSONResponse(_error_json(429, message), status_code=429)
        sandbox = self.world.create(body, key)
        return JSONResponse(sandbox.sandbox_json(), status_code=201)

    async def list_sandboxes(self, request: Request) -> Response:
        refused = self.unauthorized(request)
        if refused is not None:
            return refused
        wanted = dict(urllib.parse.parse_qsl(request.query_params.get("metadata", "")))
        return JSONResponse([s.detail_json() for s in self.world.listed(wanted)])

    async def sandbox_call(
        self, request: Request, missing: str = "sandbox {} not found"
    ) -> EmulatedSandbox | Response:
        """The live sandbox a control-plane call names, or the answer that refuses it."""
        refused = self.unauthorized(request)
        if refused is not None:
            return refused
        sandbox_id = request.path_params["sid"]
        sandbox = self.world.live(sandbox_id)
        if sandbox is None:
            return _error(404, missing.format(sandbox_id))
        return sandbox

    async def get_info(self, request: Request) -> Response:
        sandbox = await self.sandbox_call(request)
        if isinstance(sandbox, Response):
            return sandbox
        return JSONResponse(sandbox.detail_json())

    async def delete(self, request: Request) -> Response:
        sandbox = await self.sandbox_call(request)
        if isinstance(sandbox, Response):
            return sandbox
        await self.world.kill(sandbox)
        return Response(status_code=204)

    async def set_timeout(self, request: Request) -> Response:
        sandbox = await self.sandbox_call(request)
        if isinstance(sandbox, Response):
            return sandbox
        self.world.set_lifetime(
            sandbox, int((await self.json_body(request))["timeout"]), only_extend=False
        )
        return Response(status_code=204)

    async def connect(self, request: Request) -> Response:
        sandbox = await self.sandbox_call(request, "Paused sandbox {} not found")
        if isinstance(sandbox, Response):
            return sandbox
        timeout_s = (await self.json_body(request)).get("timeout")
        if timeout_s is not None:
            self.world.set_lifetime(sandbox, int(timeout_s), only_extend=True)
        return JSONResponse(sandbox.sandbox_json())

    # --- envd ----------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        sandbox = _sandbox_of(self.world, request, needs_token=False)
        return sandbox if isinstance(sandbox, Response) else Response(status_code=204)

    async def envs(self, request: Request) -> Response:
        sandbox = _sandbox_of(self.world, request, needs_token=True)
        return sandbox if isinstance(sandbox, Response) else JSONResponse(sandbox.envd_envs())

    async def download(self, request: Request) -> Response:
        sandbox = _sandbox_of(self.world, request, needs_token=True)
        if isinstance(sandbox, Response):
            return sandbox
        path = request.query_params.get("path", "")
        local = sandbox.local_path(path)
        if not local.is_file() or not sandbox.inside(local):
            return _error(404, f"path '{path}' does not exist")
        data = await asyncio.to_thread(local.read_bytes)
        return Response(data, media_type="application/octet-stream")

    async def upload(self, request: Request) -> Response:
        sandbox = _sandbox_of(self.world, request, needs_token=True)
        if isinstance(sandbox, Response):
            return sandbox
        body = await request.body()
        query_path = request.query_params.get("path")
        content_type = request.headers.get("content-type", "")
        files: list[tuple[str, bytes]] = []
        if content_type.startswith("multipart/form-data"):
            parsed = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
                b"Content-Type: " + content_type.encode() + b"\r\n\r\n" + body
            )
            for part in parsed.iter_parts():
                payload = part.get_payload(decode=True)
                name = query_path or part.get_filename() or ""
                files.append((name, payload if isinstance(payload, bytes) else b""))
        else:
            files.append((query_path or "", body))
        written = []
        for path, data in files:
            local = sandbox.local_path(path)
            if not sandbox.inside(local.parent if not local.exists() else local):
                return _error(400, f"path '{path}' is not allowed")
            local.parent.mkdir(parents=True, exist_ok=True)
            await asyncio.to_thread(local.write_bytes, data)
            path = sandbox.sandbox_path(local)
            written.append({"name": local.name, "type": "file", "path": path})
        return JSONResponse(written)

    # --- code interpreter ----------------------------------------------------------------

    async def create_context(self, request: Request) -> Response:
        sandbox = _sandbox_of(self.world, request, needs_token=False)
        if isinstance(sandbox, Response):
            return sandbox
        body = await self.json_body(request)
        try:
            context = await self.world.create_context(
                sandbox, body.get("language"), body.get("cwd")
            )
        except UnsupportedLanguageError as exc:
            return PlainTextResponse(str(exc), status_code=500)
        except Exception:
            return PlainTextResponse("Failed to set working directory", status_code=500)
        return JSONResponse(context.model())

    async def list_contexts(self, request: Request) -> Response:
        sandbox = _sandbox_of(self.world, request, needs_token=False)
        if isinstance(sandbox, Response):
            return sandbox
        return JSONResponse([context.model() for context in sandbox.contexts.values()])

    async def context_call(
        self, request: Request
    ) -> tuple[EmulatedSandbox, EmulatedContext] | Response:
        sandbox = _sandbox_of(self.world, request, needs_token=False)
        if isinstance(sandbox, Response):
            return sandbox
        try:
            return sandbox, self.world.context(sandbox, request.path_params["cid"])
        except ContextNotFoundError as exc:
            return PlainTextResponse(str(exc), status_code=404)

    async def restart_context(self, request: Request) -> Response:
        found = await self.context_call(request)
        if isinstance(found, Response):
            return found
        try:
            await self.world.restart_context(*found)
        except RestartRefusedError as exc:
            return PlainTextResponse(str(exc), status_code=500)
        return JSONResponse(None)

    async def delete_context(self, request: Request) -> Response:
        found = await self.context_call(request)
        if isinstance(found, Response):
            return found
        await self.world.remove_context(*found)
        return JSONResponse(None)

    def routes(self) -> list[Route]:
        """Each operation of `wire.ROUTES` with its handler."""
        filesystem = _FilesystemCalls(
            self.world, FilesystemASGIApplication(_FilesystemService(self.world))
        )
        endpoints: dict[str, Any] = {
            "create": self.create,
            "list": self.list_sandboxes,
            "get_info": self.get_info,
            "delete": self.delete,
            "set_timeout": self.set_timeout,
            "connect": self.connect,
            "health": self.health,
            "envs": self.envs,
            "download": self.download,
            "upload": self.upload,
            "stat": filesystem,
            "list_files": filesystem,
            "make_dir": filesystem,
            "remove": filesystem,
            "move": filesystem,
            "run_code": _Execute(self.world),
            "create_context": self.create_context,
            "list_contexts": self.list_contexts,
            "restart_context": self.restart_context,
            "delete_context": self.delete_context,
        }
        routes = [
            Route(path, endpoints[name], methods=[method], name=name)
            for method, path, name in ROUTES
        ]
        return routes


class _Gate:
    """Outer ASGI layer: records each request and plays the fault that hits it."""

    def __init__(
        self, app: ASGIApp, routes: list[Route], faults: FaultBook, limits: RateLimits
    ) -> None:
        self.app = app
        self.routes = routes
        self.faults = faults
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        operation, params = None, {}
        for route in self.routes:
            match, child = route.matches(scope)
            if match == Match.FULL:
                operation, params = route.name, child["path_params"]
                break
        headers = dict(scope["headers"])
        raw_id = headers.get(b"e2b-sandbox-id")
        sandbox_id = raw_id.decode("latin-1") if raw_id is not None else params.get("sid")
        wait_s = self.limits.wait_s(operation)
        fault = self.faults.take(operation) if wait_s is None else None
        self.faults.record(scope, operation, sandbox_id, fault is not None)
        if wait_s is not None:
            await _rate_limited(send, wait_s, self.limits.limits.rates[operation or ""].calls)
        elif fault is None:
            await self.app(scope, receive, send)
        else:
            await serve_with_fault(fault, self.app, scope, receive, send, error_body=_error_json)


async def _rate_limited(send: Send, wait_s: float, burst: int) -> None:
    """E2B's answer to a call past its route's rate limit (``middleware/ratelimit``): the wait
    in whole seconds, 1 at least, truncated as Go's ``int()`` does."""
    payload = json.dumps(_error_json(429, "Rate limit exceeded")).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(payload)).encode()),
        (b"ratelimit-limit", str(burst).encode()),
        (b"ratelimit-remaining", b"0"),
        (b"ratelimit-reset", str(math.ceil(wait_s)).encode()),
        (b"retry-after", str(max(int(wait_s), 1)).encode()),
    ]
    await send({"type": "http.response.start", "status": 429, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


class _FilesystemCalls:
    """envd's Connect-RPC filesystem calls: the sandbox checks, then the SDK's server stub."""

    def __init__(self, world: World, rpc: ASGIApp) -> None:
        self.world = world
        self.rpc = rpc

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sandbox = _sandbox_of(self.world, Request(scope, receive), needs_token=True)
        if isinstance(sandbox, Response):
            await sandbox(scope, receive, send)
        else:
            await self.rpc(scope, receive, send)


class _Execute:
    """``POST /execute``: runs a cell on its context's connection and streams its lines.

    The lines are the connection's (`KernelChannel.execute`), then ``end_of_execution``. A client
    that leaves closes the execution (the connection then interrupts the kernel, late); a
    sandbox killed mid-cell drops the connection.
    """

    def __init__(self, world: World) -> None:
        self.world = world

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        sandbox = _sandbox_of(self.world, request, needs_token=True)
        if isinstance(sandbox, Response):
            await sandbox(scope, receive, send)
            return
        body = json.loads(await request.body() or b"{}")
        context = await self._context(sandbox, body)
        if isinstance(context, Response):
            await context(scope, receive, send)
            return
        if context.channel is None:
            await PlainTextResponse("Context is restarting", status_code=500)(scope, receive, send)
            return
        lines = context.channel.execute(body["code"], body.get("env_vars") or {})
        streaming = asyncio.create_task(self._stream(lines, send))
        left = asyncio.create_task(self._disconnected(receive))
        killed = asyncio.create_task(sandbox.killed.wait())
        outside = asyncio.create_task(self._interrupt_after(context, scope))
        try:
            done, _ = await asyncio.wait(
                {streaming, left, killed}, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            for task in (streaming, left, killed, outside):
                task.cancel()
            await asyncio.wait({streaming, left, killed, outside})
            await lines.aclose()
        if streaming in done:
            streaming.result()
        elif killed in done:
            raise _DroppedConnection("sandbox killed mid-execute")

    @staticmethod
    async def _interrupt_after(context: EmulatedContext, scope: Scope) -> None:
        """Interrupt the context's kernel from outside when an injected fault says to
        (`Fault.interrupt_after_s`), as Jupyter's interrupt from another client would."""
        after_s = scope.get(INTERRUPT_AFTER_S_KEY)
        if after_s is None:
            return
        await asyncio.sleep(after_s)
        if context.kernel is not None:
            with contextlib.suppress(SandboxError):  # it died meanwhile
                await context.kernel.interrupt()

    @staticmethod
    async def _disconnected(receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    @staticmethod
    async def _stream(lines: AsyncGenerator[dict[str, Any]], send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        async for line in lines:
            body = json.dumps(line).encode() + b"\n"
            await send({"type": "http.response.body", "body": body, "more_body": True})
        end = b'{"type": "end_of_execution"}\n'
        await send({"type": "http.response.body", "body": end, "more_body": False})

    async def _context(
        self, sandbox: EmulatedSandbox, body: dict[str, Any]
    ) -> EmulatedContext | Response:
        context_id, language = body.get("context_id"), body.get("language")
        if context_id and language:
            return PlainTextResponse(
                "context_id and language are mutually exclusive", status_code=400
            )
        try:
            if context_id:
                return self.world.context(sandbox, context_id)
            return await self.world.default_context(sandbox, language)
        except ContextNotFoundError as exc:
            return PlainTextResponse(str(exc), status_code=404)
        except UnsupportedLanguageError as exc:
            return PlainTextResponse(str(exc), status_code=500)


class _FilesystemService(Filesystem):
    """envd's Connect-RPC filesystem calls, on the folders of emulated sandboxes."""

    def __init__(self, world: World) -> None:
        self.world = world

    def _sandbox(self, ctx: Any) -> EmulatedSandbox:
        sandbox = self.world.live(ctx.request_headers.get("e2b-sandbox-id"))
        if sandbox is None:
            raise ConnectError(Code.UNAVAILABLE, NOT_FOUND_MESSAGE)
        return sandbox

    def _existing(self, sandbox: EmulatedSandbox, path: str) -> Path:
        local = sandbox.local_path(path)
        if not (local.exists() or local.is_symlink()):
            raise ConnectError(Code.NOT_FOUND, f"no such file or directory: {path}")
        return local

    def _entry(self, sandbox: EmulatedSandbox, local: Path) -> Any:
        return EntryInfo.from_json(json.dumps(_stat_entry(sandbox, local)))

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
                if not is_utf8(name):
                    # envd (Go) puts the name's bytes in a proto3 string, which connect-go's
                    # marshalling refuses: the whole listing fails.
                    raise ConnectError(Code.INTERNAL, _NOT_UTF8_MESSAGE)
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


def _stat_entry(sandbox: EmulatedSandbox, local: Path) -> dict[str, Any]:
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
