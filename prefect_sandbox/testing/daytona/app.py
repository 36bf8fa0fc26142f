"""The emulator's ASGI app: Daytona's control-plane REST API and the sandbox toolbox API.

Wire formats follow what the daytona SDK 0.226.1 sends and expects: the control plane under
``/api`` (create answers 200 with the full sandbox), the toolbox under
``/toolbox/{sandbox_id}`` (the sandboxes' ``toolboxProxyUrl``), the interpreter WebSocket with
its frames and close codes, and the bulk file transfer's multipart bodies. An outer gate checks
the API key, records sandbox activity and injects faults. Manual: docs/backends/daytona.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import posixpath
import shutil
import stat
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from http import HTTPStatus
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Match, Route, WebSocketRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from starlette.websockets import WebSocket, WebSocketDisconnect

from prefect_sandbox.testing.daytona.state import (
    DEFAULT_CONTEXT,
    DEFAULT_EXEC_TIMEOUT_S,
    DEFAULT_RUN_TIMEOUT_S,
    EmulatedSandbox,
    World,
)
from prefect_sandbox.testing.faults import (
    COMMON_OPERATIONS,
    INTERRUPT_AFTER_S_KEY,
    FaultBook,
    serve_with_fault,
)
from prefect_sandbox.testing.limits import DAYTONA_QUOTA_MESSAGE, RateLimits

__all__ = ["OPERATIONS", "WEBSOCKET_OPERATIONS", "build_app"]

OPERATIONS = COMMON_OPERATIONS | {
    # control plane
    "get",
    "start",
    "stop",
    "refresh_activity",
    # toolbox
    "work_dir",
    "home_dir",
    "create_folder",
    "exec",
    "list_contexts",
    "delete_file",
    "file_info",
}
"""The calls a `Fault` can name: our names of the emulated endpoints (the routes' names)."""
WEBSOCKET_OPERATIONS = frozenset({"run_code"})

DOWNLOAD_BOUNDARY = "DAYTONA-FILE-BOUNDARY"
_COPY_CHUNK_BYTES = 1 << 20
# Control-plane calls that count as activity; every toolbox call does.
_ACTIVITY = frozenset({"refresh_activity"})
_LIFECYCLE = frozenset({"delete", "start", "stop"})
"""Calls Daytona's ``sandbox-lifecycle`` throttler counts."""


def _api_error(status: int, message: str) -> JSONResponse:
    """The control plane's (NestJS) error envelope."""
    body = {"statusCode": status, "message": message, "error": HTTPStatus(status).phrase}
    return JSONResponse(body, status_code=status)


def _daemon_error(
    request: Request | WebSocket, status: int, message: str, code: str
) -> JSONResponse:
    """The toolbox daemon's error envelope."""
    body = {
        "statusCode": status,
        "message": message,
        "code": code,
        "source": "DAYTONA_DAEMON",
        "path": request.url.path,
        "method": request.scope.get("method", "GET"),
        "timestamp": datetime.now(UTC).isoformat(),
    }
    return JSONResponse(body, status_code=status)


def _frame(kind: str, text: str = "", **fields: str) -> str:
    """An interpreter frame: the daemon always sends all five keys."""
    frame = {"type": kind, "text": text, "name": "", "value": "", "traceback": ""}
    frame.update(fields)
    return json.dumps(frame, ensure_ascii=False)


def build_app(
    world: World, *, api_key: str, target: str, faults: FaultBook, limits: RateLimits
) -> ASGIApp:
    """The emulator's ASGI app.

    Args:
        world: the emulated sandboxes.
        api_key: the only API key accepted (``Authorization: Bearer <key>``).
        target: the region sandboxes get when the create request names none.
        faults: faults to inject.
        limits: the rate limits and quota to enforce (Daytona's limiter, `FixedWindow`).
    """
    routes = _DaytonaApi(world, target, limits).routes()
    return _Gate(Starlette(routes=routes), routes, world, api_key, faults, limits)


class _DaytonaApi:
    """The emulator's handlers over one `World`: the control plane (``/api/sandbox``) and each
    sandbox's toolbox (``/toolbox/{sid}``), which Daytona's proxy serves."""

    def __init__(self, world: World, target: str, limits: RateLimits) -> None:
        self.world = world
        self.target = target
        self.limits = limits

    def sandbox_or_none(self, request: Request | WebSocket) -> EmulatedSandbox | None:
        return self.world.find(request.path_params["sid"])

    def missing(self, request: Request) -> Response:
        sandbox_id = request.path_params["sid"]
        return _api_error(404, f"Sandbox with ID or name {sandbox_id} not found")

    def toolbox_problem(self, request: Request | WebSocket) -> Response | None:
        """The proxy's answer when the sandbox is not there to serve toolbox calls."""
        sandbox = self.sandbox_or_none(request)
        if sandbox is None:
            return _daemon_error(request, 404, "sandbox not found", "SANDBOX_NOT_FOUND")
        if sandbox.state != "started":
            return _daemon_error(
                request, 400, f"sandbox is {sandbox.state}: is the Sandbox started?", "BAD_REQUEST"
            )
        return None

    def started(self, request: Request | WebSocket) -> EmulatedSandbox:
        sandbox = self.sandbox_or_none(request)
        assert sandbox is not None
        return sandbox

    async def json_body(self, request: Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except json.JSONDecodeError:
            return {}
        return body if isinstance(body, dict) else {}

    # -- control plane ----------------------------------------------------------------------

    async def create(self, request: Request) -> Response:
        body = await self.json_body(request)
        # Daytona's quota is on CPUs, counted over started sandboxes (1 each by default).
        cpus = sum(s.cpu for s in self.world.sandboxes.values() if s.state == "started")
        if self.limits.over_quota(cpus + int(body.get("cpu") or 1) - 1):
            quota = self.limits.limits.max_live_sandboxes
            return _api_error(400, DAYTONA_QUOTA_MESSAGE.format(quota=quota))
        return JSONResponse(self.world.create(body, self.target).model())

    async def list_sandboxes(self, request: Request) -> Response:
        try:
            wanted = json.loads(request.query_params.get("labels") or "{}")
        except json.JSONDecodeError:
            return _api_error(400, "labels must be a JSON object")
        items = [
            sandbox.model()
            for sandbox in self.world.sandboxes.values()
            if wanted.items() <= sandbox.labels.items()
        ]
        return JSONResponse({"items": items, "nextCursor": None})

    async def get(self, request: Request) -> Response:
        sandbox = self.sandbox_or_none(request)
        if sandbox is None:
            return self.missing(request)
        return JSONResponse(sandbox.model())

    async def delete(self, request: Request) -> Response:
        sandbox = self.sandbox_or_none(request)
        if sandbox is None:
            return self.missing(request)
        await self.world.delete(sandbox.id)
        return JSONResponse(sandbox.model())

    async def start(self, request: Request) -> Response:
        sandbox = self.sandbox_or_none(request)
        if sandbox is None:
            return self.missing(request)
        sandbox.state, sandbox.stopped_at = "started", None
        sandbox.touch()
        return JSONResponse(sandbox.model())

    async def stop(self, request: Request) -> Response:
        sandbox = self.sandbox_or_none(request)
        if sandbox is None:
            return self.missing(request)
        await sandbox.stop()
        return JSONResponse(sandbox.model())

    async def refresh_activity(self, request: Request) -> Response:
        sandbox = self.sandbox_or_none(request)
        if sandbox is None:
            return self.missing(request)
        return Response(status_code=201)

    # -- toolbox ----------------------------------------------------------------------------

    async def work_dir(self, request: Request) -> Response:
        return self.toolbox_problem(request) or JSONResponse(
            {"dir": str(self.started(request).home)}
        )

    async def create_folder(self, request: Request) -> Response:
        problem = self.toolbox_problem(request)
        if problem is not None:
            return problem
        path = self.world.inside(self.started(request), request.query_params.get("path", ""))
        if path is None:
            return _daemon_error(request, 403, "path outside the sandbox", "FILE_ACCESS_DENIED")
        path.mkdir(parents=True, exist_ok=True)
        return Response(status_code=201)

    async def execute_command(self, request: Request) -> Response:
        problem = self.toolbox_problem(request)
        if problem is not None:
            return problem
        sandbox = self.started(request)
        body = await self.json_body(request)
        cwd = self.world.inside(sandbox, body.get("cwd") or str(sandbox.home))
        if cwd is None or not cwd.is_dir():
            return _daemon_error(request, 400, "invalid working directory", "INVALID_FILE_PATH")
        outcome = await self.world.run_command(
            sandbox,
            str(body.get("command", "")),
            cwd,
            float(body.get("timeout") or DEFAULT_EXEC_TIMEOUT_S),
        )
        if outcome is None:
            return _daemon_error(
                request, 408, "command execution timeout", "PROCESS_EXECUTION_TIMEOUT"
            )
        exit_code, output = outcome
        return JSONResponse({"exitCode": exit_code, "result": output})

    async def create_context(self, request: Request) -> Response:
        problem = self.toolbox_problem(request)
        if problem is not None:
            return problem
        sandbox = self.started(request)
        body = await self.json_body(request)
        if body.get("language") not in (None, "python"):
            message = f"unsupported language: {body['language']} (only 'python' is supported)"
            return _daemon_error(request, 400, message, "BAD_REQUEST")
        shown = str(body["cwd"]) if body.get("cwd") else None
        cwd = None if shown is None else self.world.inside(sandbox, shown)
        if shown is not None and cwd is None:
            return _daemon_error(request, 403, "path outside the sandbox", "FILE_ACCESS_DENIED")
        try:
            context = await sandbox.create_context(cwd, shown)
        except OSError as exc:
            # The daemon starts the interpreter in the folder: a missing one fails the start.
            message = f"failed to start context: {exc.strerror}"
            return _daemon_error(request, 500, message, "INTERNAL_SERVER_ERROR")
        return JSONResponse(context.model())

    async def list_contexts(self, request: Request) -> Response:
        problem = self.toolbox_problem(request)
        if problem is not None:
            return problem
        contexts = [
            context.model()
            for context in self.started(request).contexts.values()
            if context.id != DEFAULT_CONTEXT
        ]
        return JSONResponse({"contexts": contexts})

    async def delete_context(self, request: Request) -> Response:
        problem = self.toolbox_problem(request)
        if problem is not None:
            return problem
        context_id = request.path_params["cid"]
        if context_id == DEFAULT_CONTEXT:
            return _daemon_error(request, 400, "cannot delete the default context", "BAD_REQUEST")
        context = self.started(request).contexts.pop(context_id, None)
        if context is None:
            return _daemon_error(request, 404, "context not found", "PROCESS_NOT_FOUND")
        await context.close(gently=True)
        return JSONResponse({"message": "Context deleted"})

    async def upload(self, request: Request) -> Response:
        problem = self.toolbox_problem(request)
        if problem is not None:
            return problem
        sandbox = self.started(request)
        form = await request.form(max_files=100_000, max_fields=100_000)
        paths: dict[str, str] = {}
        files: dict[str, UploadFile] = {}
        for key, value in form.multi_items():
            index, _, kind = key.removeprefix("files[").partition("].")
            if kind == "path" and isinstance(value, str):
                paths[index] = value
            elif kind == "file" and isinstance(value, UploadFile):
                files[index] = value
        written = []
        try:
            for index, raw_path in paths.items():
                target = self.world.inside(sandbox, raw_path)
                if target is None or index not in files:
                    return JSONResponse(
                        {"errors": [f"{raw_path}: invalid path or no file"]}, status_code=400
                    )
                target.parent.mkdir(parents=True, exist_ok=True)
                await asyncio.to_thread(_save, files[index], target)
                written.append({"path": raw_path, "bytes": target.stat().st_size})
        finally:
            await form.close()
        return JSONResponse({"files": written})

    async def list_files(self, request: Request) -> Response:
        problem = self.toolbox_problem(request)
        if problem is not None:
            return problem
        given = request.query_params.get("path") or "."
        folder = self.world.inside(self.started(request), given)
        if folder is None:
            return _daemon_error(request, 403, "path outside the sandbox", "FILE_ACCESS_DENIED")
        if not folder.is_dir():
            return _daemon_error(request, 404, f"no such directory: {given}", "FILE_NOT_FOUND")
        depth = max(int(request.query_params.get("depth") or 1), 1)
        return JSONResponse(_file_infos(folder, given, depth))

    async def file_info(self, request: Request) -> Response:
        problem = self.toolbox_problem(request)
        if problem is not None:
            return problem
        given = request.query_params.get("path", "")
        path = self.world.inside(self.started(request), given)
        if path is None or not path.exists():
            return _daemon_error(request, 404, f"no such file: {given}", "FILE_NOT_FOUND")
        return JSONResponse(_file_info(path, given))

    async def delete_file(self, request: Request) -> Response:
        problem = self.toolbox_problem(request)
        if problem is not None:
            return problem
        given = request.query_params.get("path", "")
        if not given:
            return _daemon_error(request, 400, "path is required", "BAD_REQUEST")
        path = self.world.inside(self.started(request), given)
        if path is None:
            return _daemon_error(request, 403, "path outside the sandbox", "FILE_ACCESS_DENIED")
        if not (path.exists() or path.is_symlink()):
            return _daemon_error(request, 404, f"no such file: {given}", "FILE_NOT_FOUND")
        recursive = request.query_params.get("recursive") == "true"
        if path.is_dir() and not recursive:
            message = "cannot delete directory without recursive flag"
            return _daemon_error(request, 400, message, "BAD_REQUEST")
        if path.is_dir() and not path.is_symlink():
            await asyncio.to_thread(shutil.rmtree, path)
        else:
            path.unlink()
        return Response(status_code=204)

    async def download(self, request: Request) -> Response:
        problem = self.toolbox_problem(request)
        if problem is not None:
            return problem
        sandbox = self.started(request)
        paths = (await self.json_body(request)).get("paths") or []
        if not isinstance(paths, list) or not paths:
            return JSONResponse({"error": 'request body must be {"paths": [...]}'}, 400)
        resolved = [(str(raw), self.world.inside(sandbox, str(raw))) for raw in paths]
        return StreamingResponse(
            _multipart_files(resolved),
            media_type=f"multipart/form-data; boundary={DOWNLOAD_BOUNDARY}",
        )

    async def run_code(self, websocket: WebSocket) -> None:
        problem = self.toolbox_problem(websocket)
        if problem is not None:
            await websocket.send_denial_response(problem)
            return
        sandbox = self.started(websocket)
        await websocket.accept()
        try:
            request = json.loads(await websocket.receive_text())
        except (WebSocketDisconnect, json.JSONDecodeError):
            return
        if not request.get("code"):
            await websocket.close(1008, "code is required")
            return
        context = sandbox.context(request.get("contextId"))
        if context is None:
            await websocket.close(1008, "context not found")
            return
        frames: asyncio.Queue[str | None] = asyncio.Queue()
        sender = asyncio.create_task(_send_frames(websocket, frames))
        timeout = request.get("timeout")
        timeout_s = DEFAULT_RUN_TIMEOUT_S if timeout is None else (float(timeout) or None)
        outcome = await context.execute(
            str(request["code"]),
            request.get("envs"),
            timeout_s,
            lambda chunk: frames.put_nowait(json.dumps(chunk, ensure_ascii=False)),
            interrupt_after_s=websocket.scope.get(INTERRUPT_AFTER_S_KEY),
        )
        if outcome.control is not None:
            frames.put_nowait(_frame("control", outcome.control))
        frames.put_nowait(None)
        await sender
        with contextlib.suppress(WebSocketDisconnect, RuntimeError):
            await websocket.close(outcome.close_code, outcome.close_reason)

    def routes(self) -> list[BaseRoute]:
        """Each handler's route, as Daytona's API and toolbox daemon name them."""
        sandbox = "/api/sandbox/{sid}"
        toolbox = "/toolbox/{sid}"
        contexts = f"{toolbox}/process/interpreter/context"
        table: list[tuple[str, str, Callable[[Request], Awaitable[Response]], str]] = [
            ("POST", "/api/sandbox", self.create, "create"),
            ("GET", "/api/sandbox", self.list_sandboxes, "list"),
            ("GET", sandbox, self.get, "get"),
            ("DELETE", sandbox, self.delete, "delete"),
            ("POST", f"{sandbox}/start", self.start, "start"),
            ("POST", f"{sandbox}/stop", self.stop, "stop"),
            ("POST", f"{sandbox}/last-activity", self.refresh_activity, "refresh_activity"),
            ("GET", f"{toolbox}/work-dir", self.work_dir, "work_dir"),
            ("GET", f"{toolbox}/user-home-dir", self.work_dir, "home_dir"),
            ("POST", f"{toolbox}/files/folder", self.create_folder, "create_folder"),
            ("POST", f"{toolbox}/process/execute", self.execute_command, "exec"),
            ("POST", contexts, self.create_context, "create_context"),
            ("GET", contexts, self.list_contexts, "list_contexts"),
            ("DELETE", f"{contexts}/{{cid}}", self.delete_context, "delete_context"),
            ("POST", f"{toolbox}/files/bulk-upload", self.upload, "upload"),
            ("POST", f"{toolbox}/files/bulk-download", self.download, "download"),
            ("GET", f"{toolbox}/files", self.list_files, "list_files"),
            ("DELETE", f"{toolbox}/files", self.delete_file, "delete_file"),
            ("GET", f"{toolbox}/files/info", self.file_info, "file_info"),
        ]
        routes: list[BaseRoute] = [
            Route(path, handler, methods=[method], name=name)
            for method, path, handler, name in table
        ]
        interpreter = f"{toolbox}/process/interpreter/execute"
        return [*routes, WebSocketRoute(interpreter, self.run_code, name="run_code")]


def _file_info(path: Path, shown: str) -> dict[str, Any]:
    """A file's ``FileInfo`` as the daemon gives it (symlinks followed)."""
    info = path.stat()
    modified = datetime.fromtimestamp(info.st_mtime, UTC).isoformat().replace("+00:00", "Z")
    return {
        "name": path.name,
        "path": shown,
        "isDir": stat.S_ISDIR(info.st_mode),
        "size": info.st_size,
        "mode": stat.filemode(info.st_mode),
        "permissions": f"{stat.S_IMODE(info.st_mode):04o}",
        "owner": str(info.st_uid),
        "group": str(info.st_gid),
        "modTime": modified,
        "modifiedAt": modified,
    }


def _file_infos(folder: Path, shown: str, depth: int) -> list[dict[str, Any]]:
    """The entries of a folder, ``depth`` levels down; entries that cannot be read are left
    out, as the daemon leaves them out."""
    infos = []
    for entry in sorted(folder.iterdir()):
        entry_shown = posixpath.join(shown, entry.name)
        try:
            infos.append(_file_info(entry, entry_shown))
        except OSError:
            continue
        if depth > 1 and entry.is_dir() and not entry.is_symlink():
            infos.extend(_file_infos(entry, entry_shown, depth - 1))
    return infos


def _save(upload: UploadFile, target: Path) -> None:
    upload.file.seek(0)
    with target.open("wb") as out:
        shutil.copyfileobj(upload.file, out, _COPY_CHUNK_BYTES)


async def _multipart_files(paths: list[tuple[str, Path | None]]) -> AsyncIterator[bytes]:
    """The bulk-download body: one part per requested path, a file or an error."""
    for raw, path in paths:
        # filename* keeps the requested path byte for byte, which the SDK matches on.
        filename = urllib.parse.quote(raw, safe="")
        if path is None or not path.is_file():
            error = {
                "message": f"file not found: {raw}",
                "statusCode": 404,
                "code": "FILE_NOT_FOUND",
                "source": "DAYTONA_DAEMON",
            }
            yield (
                f"--{DOWNLOAD_BOUNDARY}\r\n"
                f"Content-Disposition: form-data; name=\"error\"; filename*=utf-8''{filename}\r\n"
                "Content-Type: application/json\r\n\r\n"
                f"{json.dumps(error)}\r\n"
            ).encode()
            continue
        yield (
            f"--{DOWNLOAD_BOUNDARY}\r\n"
            f"Content-Disposition: form-data; name=\"file\"; filename*=utf-8''{filename}\r\n"
            "Content-Type: application/octet-stream\r\n\r\n"
        ).encode()
        with path.open("rb") as source:
            while chunk := await asyncio.to_thread(source.read, _COPY_CHUNK_BYTES):
                yield chunk
        yield b"\r\n"
    yield f"--{DOWNLOAD_BOUNDARY}--\r\n".encode()


async def _send_frames(websocket: WebSocket, frames: asyncio.Queue[str | None]) -> None:
    """Send frames until the end marker; once the client is gone, drop the rest."""
    connected = True
    while (frame := await frames.get()) is not None:
        if not connected:
            continue
        try:
            await websocket.send_text(frame)
        except (WebSocketDisconnect, RuntimeError):
            connected = False


async def _send_json(
    send: Send,
    status: int,
    body: dict[str, Any],
    websocket: bool,
    headers: dict[str, str] | None = None,
) -> None:
    prefix = "websocket.http.response" if websocket else "http.response"
    payload = json.dumps(body).encode()
    extra = [(name.encode(), value.encode()) for name, value in (headers or {}).items()]
    await send(
        {
            "type": f"{prefix}.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(payload)).encode()),
                *extra,
            ],
        }
    )
    await send({"type": f"{prefix}.body", "body": payload})


def _throttler(operation: str) -> str:
    """The name of Daytona's throttler that counts ``operation`` (its API's guards)."""
    if operation == "create":
        return "sandbox-create"
    return "sandbox-lifecycle" if operation in _LIFECYCLE else "authenticated"


async def _throttled(
    send: Send, operation: str, wait_s: float, calls: int, websocket: bool
) -> None:
    """Daytona's answer past a throttler's limit (NestJS's ``ThrottlerGuard``): the wait in
    whole seconds in ``Retry-After-<throttler>`` (plain ``Retry-After`` is only a throttler
    named ``default``'s)."""
    name = _throttler(operation)
    seconds = str(max(math.ceil(wait_s), 1))
    headers = {
        f"retry-after-{name}": seconds,
        f"x-ratelimit-limit-{name}": str(calls),
        f"x-ratelimit-remaining-{name}": "0",
        f"x-ratelimit-reset-{name}": seconds,
    }
    body = {
        "statusCode": 429,
        "message": "ThrottlerException: Too Many Requests",
        "error": "Too Many Requests",
    }
    await _send_json(send, 429, body, websocket, headers)


class _Gate:
    """Outer ASGI layer: API key, sandbox activity, request records and injected faults."""

    def __init__(
        self,
        app: ASGIApp,
        routes: list[BaseRoute],
        world: World,
        api_key: str,
        faults: FaultBook,
        limits: RateLimits,
    ) -> None:
        self.app = app
        self.routes = routes
        self.world = world
        self.authorization = f"Bearer {api_key}".encode()
        self.faults = faults
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        websocket = scope["type"] == "websocket"
        if websocket:
            await receive()  # websocket.connect
        if "/socket.io" in scope["path"]:
            # The SDK's event stream: a 404 makes it fall back to polling.
            await _send_json(send, 404, {"statusCode": 404, "message": "Not Found"}, websocket)
            return
        if dict(scope["headers"]).get(b"authorization") != self.authorization:
            await _send_json(
                send,
                401,
                {"statusCode": 401, "message": "Invalid API key", "error": "Unauthorized"},
                websocket,
            )
            return
        operation, sandbox_id = self._route_of(scope)
        if operation is not None and (wait_s := self.limits.wait_s(operation)) is not None:
            self.faults.record(scope, operation, sandbox_id, False)
            calls = self.limits.limits.rates[operation].calls
            await _throttled(send, operation, wait_s, calls, websocket)
            return
        sandbox = self.world.find(sandbox_id) if sandbox_id else None
        active = sandbox is not None and (
            scope["path"].startswith("/toolbox/") or operation in _ACTIVITY
        )
        # An HTTP request is activity until it ends; an execution only when it starts, as
        # Daytona documents no more (it may stop a sandbox whose only activity is a long cell).
        busy = active and not websocket
        if sandbox is not None and active:
            sandbox.touch(busy=busy)
        fault = self.faults.take(operation) if operation else None
        self.faults.record(scope, operation, sandbox_id, fault is not None)
        if websocket:
            receive = _replay_connect(receive)
        try:
            if fault is None:
                await self.app(scope, receive, send)
            else:
                await serve_with_fault(
                    fault, self.app, scope, receive, send, error_body=_injected_error
                )
        finally:
            if sandbox is not None and busy:
                sandbox.untouch()

    def _route_of(self, scope: Scope) -> tuple[str | None, str | None]:
        for route in self.routes:
            match, child = route.matches(scope)
            if match == Match.FULL:
                return getattr(route, "name", None), child["path_params"].get("sid")
        return None, None


def _injected_error(status: int) -> dict[str, Any]:
    """The control plane's error envelope for an injected status."""
    phrase = HTTPStatus(status).phrase
    return {"statusCode": status, "message": f"injected fault: {phrase}", "error": phrase}


def _replay_connect(receive: Receive) -> Receive:
    """Give the app the ``websocket.connect`` message the gate already read."""
    replayed = False

    async def wrapped() -> Message:
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "websocket.connect"}
        return await receive()

    return wrapped
