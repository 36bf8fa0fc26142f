"""`DaytonaSandbox`: a Daytona sandbox driven through the daytona SDK's async client.

Cells run in one stateful interpreter context (``code_interpreter.run_code``); as Daytona's
interpreter streams only stdout, stderr and errors, a runner installed in the context
(kernel_side/daytona_runner.py) reports the rest as marker records that this module turns back
into nbformat outputs. Files move through the SDK's bulk file API, paths checked against the
working directory with symlinks resolved inside the sandbox (kernel_side/resolve_paths.py).
Deadlines are ours: SIGINT to the interpreter (``process.exec``), a second after the grace, then
the context is made again (state lost). Vendor errors map to our tree in `translate_error`;
calls safe to repeat are retried on 429 and 5xx, an execute never is. The SDK is imported lazily
(the ``daytona`` extra). Manual: docs/backends/daytona.md.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import math
import posixpath
import re
import shlex
import time
import types
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from prefect_sandbox.sandbox._compat import keep_sigint_from_socketio
from prefect_sandbox.sandbox.backends import (
    cancel_and_wait,
    import_extra,
    kill_after_failed_setup,
    translated,
    translated_async,
)
from prefect_sandbox.sandbox.base import (
    SECOND_INTERRUPT_S,
    CellError,
    CellReply,
    KernelInfo,
    RemoteFile,
    RunningCell,
    Sandbox,
    SandboxConfig,
    SandboxHandle,
)
from prefect_sandbox.sandbox.errors import (
    FileTransferError,
    SandboxAuthError,
    SandboxDiedError,
    SandboxError,
    SandboxNotFoundError,
    SandboxUnavailableError,
    UnsafePathError,
)
from prefect_sandbox.sandbox.kernel_side import python_str, source
from prefect_sandbox.sandbox.kernel_side.daytona_runner import (
    MARKER_END,
    MARKER_START,
    NAMESPACE_KEY,
    RUNNER_FILENAME,
)
from prefect_sandbox.sandbox.outputs import CellOutputs, error_content
from prefect_sandbox.sandbox.paths import (
    check_size,
    checked_relative_path,
    checked_upload_source,
    is_inside,
    listed_files,
)
from prefect_sandbox.sandbox.retries import async_retrying

if TYPE_CHECKING:
    from daytona import AsyncDaytona, AsyncSandbox
    from daytona.common.code_interpreter import ExecutionError, OutputMessage
    from daytona_toolbox_api_client_async import InterpreterContext

__all__ = [
    "BACKEND_SLUG",
    "CREATE_TOKEN_LABEL",
    "DaytonaSandbox",
    "DaytonaSandboxConfig",
    "MarkerSplitter",
    "close_of",
    "import_sdk",
    "record_content",
    "translate_error",
]

BACKEND_SLUG = "daytona"
CREATE_TOKEN_LABEL = "prefect-sandbox-create-token"
"""A label unique to each create call, to find a sandbox a failed create left behind."""
WORKDIR_NAME = "work"
"""The working directory: this folder of the sandbox's own work directory."""

_SERVER_TIMEOUT_MARGIN_S = 10
_EXEC_TIMEOUT_S = 60
_BOOTSTRAP_TIMEOUT_S = 120
_CLOSE = re.compile(r"(?:Failed to run code: )?(?P<reason>.*?)\s*\(close code (?P<code>\d+)\)\s*$")
_TIMEOUT_CLOSE = 4008
"""The daemon's close once its worker reported the execution ``interrupted`` (a
KeyboardInterrupt left the code) or its own deadline killed the worker; the SDK raises
`DaytonaTimeoutError` ("Execution timed out") for either."""
_SLOW_CONSUMER = "slow consumer"
"""A close 1008's reason when the daemon dropped a client that read its frames too slowly (256
frames queued): the execution goes on without it."""
_QUOTA = re.compile(r"Total \w+ limit exceeded\. Maximum allowed: [^\n]*")
"""Daytona's refusal of a create past the organization's quota (CPU, memory, disk, GPU)."""
_GONE_STATES = frozenset({"destroyed", "destroying", "error", "build_failed"})
_STOPPED_STATES = frozenset({"stopped", "archived", "stopping", "archiving"})

logger = logging.getLogger(__name__)

T = TypeVar("T")

_LOST_RECORD = MARKER_START + json.dumps({"kind": "lost"}) + MARKER_END


def import_sdk() -> types.ModuleType:
    """Import the daytona SDK, its socket.io client kept from taking SIGINT over
    (`keep_sigint_from_socketio`).

    Raises:
        BackendNotInstalledError: it is not installed; the message names the extra to install.
    """
    sdk = import_extra("daytona", extra="daytona", backend="Daytona")
    keep_sigint_from_socketio()
    return sdk


def _bootstrap_code() -> str:
    return (
        f"{NAMESPACE_KEY} = __import__('types').ModuleType('_prefect_sandbox_runner')\n"
        f"exec(compile({python_str(source('daytona_runner'))}, {python_str(RUNNER_FILENAME)}, "
        "'exec'), "
        f"{NAMESPACE_KEY}.__dict__)\n"
        f"{NAMESPACE_KEY} = {NAMESPACE_KEY}.install(globals())\n"
    )


def _cell_code(source: str) -> str:
    """The code sent for a cell: run it through the runner, or say the runner is gone."""
    encoded = base64.b64encode(source.encode("utf-8")).decode("ascii")
    return (
        f"if {python_str(NAMESPACE_KEY)} in globals():\n"
        f"    {NAMESPACE_KEY}.run({python_str(encoded)})\n"
        f"else:\n"
        f"    print({python_str(_LOST_RECORD)}, end='', flush=True)\n"
    )


class MarkerSplitter:
    """Splits an interpreter's stdout into plain text and the runner's marker records.

    Text is passed on as soon as it cannot be the start of a record; a record split across
    chunks is held until its end arrives.

    Args:
        max_record_chars: a record longer than this is not one (a cell printed the start
            marker on its own); it is passed on as text.
    """

    def __init__(self, max_record_chars: int = 256 << 20) -> None:
        self._pending = ""
        self._max_record_chars = max_record_chars

    def feed(self, text: str) -> list[str | dict[str, Any]]:
        """Take the next chunk of stdout.

        Returns:
            Text (str) and records (dict) in the order they were written.
        """
        if not self._pending and MARKER_START[0] not in text:
            return [text] if text else []
        self._pending += text
        items: list[str | dict[str, Any]] = []
        while self._pending:
            start = self._pending.find(MARKER_START)
            if start < 0:
                keep = _prefix_overlap(self._pending, MARKER_START)
                self._take_text(items, len(self._pending) - keep)
                break
            self._take_text(items, start)
            end = self._pending.find(MARKER_END, len(MARKER_START))
            if end < 0:
                if len(self._pending) > self._max_record_chars:
                    self._take_text(items, len(MARKER_START))
                    continue
                break
            raw = self._pending[len(MARKER_START) : end]
            try:
                record = json.loads(raw)
            except json.JSONDecodeError:
                self._take_text(items, end + len(MARKER_END))
                continue
            items.append(record)
            self._pending = self._pending[end + len(MARKER_END) :]
        return items

    def finish(self) -> list[str | dict[str, Any]]:
        """The text still held back, once no more stdout will come."""
        rest, self._pending = self._pending, ""
        return [rest] if rest else []

    def _take_text(self, items: list[str | dict[str, Any]], length: int) -> None:
        if length > 0:
            items.append(self._pending[:length])
            self._pending = self._pending[length:]


def _prefix_overlap(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``marker``."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


def record_content(record: Mapping[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """The Jupyter message type and content of a runner record that is an output.

    Returns:
        ``(msg_type, content)`` for `OutputCollector.add` (``update`` and ``clear`` records
        give ``update_display_data`` and ``clear_output``); None for records that are not
        outputs (``start``, ``ready``, ``exit``, ``lost``).
    """
    kind = record.get("kind")
    if kind in ("display", "update"):
        content = {"data": record["data"], "metadata": record.get("metadata", {})}
        if record.get("display_id"):
            content["transient"] = {"display_id": record["display_id"]}
        return "display_data" if kind == "display" else "update_display_data", content
    if kind == "clear":
        return "clear_output", {"wait": bool(record.get("wait"))}
    if kind == "result":
        return "execute_result", {
            "data": record["data"],
            "metadata": record.get("metadata", {}),
            "execution_count": record["count"],
        }
    if kind == "error":
        return "error", {
            "ename": record["ename"],
            "evalue": record["evalue"],
            "traceback": list(record["traceback"]),
        }
    return None


def close_of(exc: BaseException) -> tuple[int, str] | None:
    """The WebSocket close code and reason an SDK connection error names.

    The SDK raises ``DaytonaConnectionError("Failed to run code: <reason> (close code N)")``
    for every close but 1000 and 4008. Daytona's daemon closes with 1001 ``"worker process
    ended"`` (the interpreter process exited) or ``"context shutdown"`` (the context was
    deleted), 1008 ``"context not found: ID"``, ``"context is not active"`` or
    ``"slow consumer"``, 1002 (a request it could not read) and 1011 (no default context).

    Returns:
        ``(code, reason)``; the reason is the SDK's ``"WebSocket connection closed
        unexpectedly"`` when the close frame gave none. None when ``exc`` names no close.
    """
    match = _CLOSE.search(str(exc))
    return (int(match["code"]), match["reason"]) if match else None


def _status_of(exc: BaseException) -> int | None:
    """The HTTP status an SDK error or any exception in its cause chain carries."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        status = getattr(current, "status_code", None) or getattr(current, "status", None)
        if isinstance(status, int):
            return status
        current = current.__cause__ or current.__context__
    return None


def _retry_after_of(exc: BaseException) -> float | None:
    """Seconds from a ``Retry-After`` header of an SDK error in the chain, if it gives them.

    Daytona's API names the header after the throttler that refused the call
    (``Retry-After-sandbox-create``, NestJS's throttler), so those count too.
    """
    current: BaseException | None = exc
    while current is not None:
        headers = getattr(current, "headers", None) or {}
        for name, value in dict(headers).items():
            lowered = str(name).lower()
            if lowered == "retry-after" or lowered.startswith("retry-after-"):
                try:
                    return max(float(value), 0.0)
                except (TypeError, ValueError):
                    return None
        current = current.__cause__
    return None


def _is_sdk_or_transport_error(exc: BaseException) -> bool:
    """Whether ``exc`` comes from the SDK, its generated API clients or their transport."""
    import aiohttp
    import httpx
    from daytona_api_client_async.exceptions import OpenApiException as ApiError
    from daytona_toolbox_api_client_async.exceptions import OpenApiException as ToolboxError

    sdk = import_sdk()
    return isinstance(
        exc,
        sdk.DaytonaError
        | ApiError
        | ToolboxError
        | aiohttp.ClientError
        | httpx.HTTPError
        | OSError
        | TimeoutError,
    )


def translate_error(
    exc: BaseException,
    *,
    operation: str,
    sandbox_id: str | None = None,
    path: str | None = None,
    in_cell: bool = False,
) -> SandboxError | None:
    """Map an exception from the daytona SDK (or its transport) to our error tree.

    The one place where Daytona's exceptions become ours. The SDK raises `DaytonaError`
    subclasses, but some failures reach us as a plain `DaytonaError` whose status sits only on
    a cause (a raw toolbox ``ApiException``, an aiohttp response error); the status is read
    from the whole cause chain. Pure: nothing is raised or logged here.

    Args:
        exc: what the SDK raised.
        operation: our name for the call (``"create"``, ``"upload"``, ...).
        sandbox_id: the sandbox concerned, when known.
        path: the file concerned, for file calls: then 404 is a `FileTransferError`.
        in_cell: True when the call ran a cell (which is then never run again).

    Returns:
        `SandboxAuthError` (401, 403), `SandboxUnavailableError` (429, 5xx, timeouts,
        dropped connections), `SandboxNotFoundError` (404, 410 on sandbox calls),
        `FileTransferError` (other failures of file calls) or `SandboxError`; None when
        ``exc`` is not the SDK's or its transport's (a bug, to let through unchanged).
    """
    if not _is_sdk_or_transport_error(exc):
        return None
    sdk = import_sdk()
    status = _status_of(exc)
    where = f" (sandbox {sandbox_id})" if sandbox_id else ""
    message = f"Daytona {operation} failed{where}: {exc}"
    quota = _QUOTA.search(str(exc)) if status in (400, 403) else None
    if quota is not None:
        # Daytona's organization quota (403 from older APIs, 400 now), not the credentials.
        return SandboxError(
            f"Daytona refused a new sandbox{where}: the organization's quota is reached "
            f"({quota[0]}); set the backend block's max_live_sandboxes under it, so that "
            "runs wait for a slot",
            sandbox_id=sandbox_id,
        )
    if status in (401, 403) or isinstance(exc, sdk.DaytonaAuthenticationError):
        return SandboxAuthError(
            f"Daytona refused the credentials for {operation}{where}: {exc}",
            sandbox_id=sandbox_id,
        )
    if status in (404, 410) or isinstance(exc, sdk.DaytonaNotFoundError):
        if path is not None:
            return FileTransferError(message, path=path, sandbox_id=sandbox_id)
        return SandboxNotFoundError(message, sandbox_id=sandbox_id)
    if (
        status in (408, 429)
        or (status is not None and status >= 500)
        or (
            status is None and isinstance(exc, sdk.DaytonaConnectionError | sdk.DaytonaTimeoutError)
        )
        or isinstance(exc, OSError | TimeoutError)
    ):
        if in_cell:
            message = f"{message}; the cell may have run, so it is not run again"
        return SandboxUnavailableError(
            message,
            status_code=status,
            operation=operation,
            retry_after_s=_retry_after_of(exc),
            sandbox_id=sandbox_id,
        )
    if path is not None:
        return FileTransferError(message, path=path, sandbox_id=sandbox_id)
    return SandboxError(message, sandbox_id=sandbox_id)


@dataclass(frozen=True, kw_only=True)
class DaytonaSandboxConfig(SandboxConfig):
    """Settings of Daytona sandboxes (besides those of `SandboxConfig`).

    Attributes:
        client_factory: makes a connected ``AsyncDaytona`` client; the default reads the SDK's
            environment variables (``DAYTONA_API_KEY``, ``DAYTONA_API_URL``,
            ``DAYTONA_TARGET``).
        snapshot: the snapshot to start from; None for Daytona's default.
        image: a container image to build the sandbox from instead of a snapshot.
        env: environment variables of the sandbox.
        labels: labels every sandbox gets, besides the flow run's.
        auto_stop_interval_min: minutes of inactivity before Daytona stops the sandbox (and
            its interpreter state is lost); 0 never. Kept alive while a cell runs.
        auto_delete_interval_min: minutes after a stop before Daytona deletes the sandbox;
            0 at once, None never.
        max_lifetime_s: seconds after creation when Daytona deletes the sandbox whatever it is
            doing (never renewed, unlike E2B's ``lifetime_s``); rounded up to whole minutes,
            which Daytona counts in. None for no limit.
        network_block_all: block all network access of the sandbox.
        network_allow_list: comma-separated CIDRs the sandbox may reach.
        cpu, memory_gib, disk_gib, gpu: resources; only with ``image``.
        create_timeout_s: seconds a create may take, including the sandbox's start.
        activity_refresh_s: seconds between keep-alive calls while a cell runs; None for a
            quarter of the auto-stop interval.
        request_retries: retries of a call that may be repeated, on 429 and 5xx answers
            (after the first try, as Prefect's ``retries`` and E2B's ``request_retries``).
    """

    client_factory: Callable[[], AsyncDaytona] | None = None
    snapshot: str | None = None
    image: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    labels: Mapping[str, str] = field(default_factory=dict)
    auto_stop_interval_min: int = 15
    auto_delete_interval_min: int | None = 0
    max_lifetime_s: int | None = None
    network_block_all: bool = False
    network_allow_list: str | None = None
    cpu: int | None = None
    memory_gib: int | None = None
    disk_gib: int | None = None
    gpu: int | None = None
    create_timeout_s: float = 120.0
    activity_refresh_s: float | None = None
    request_retries: int = 3

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.snapshot and self.image:
            raise ValueError("give a snapshot or an image, not both")
        resources = (self.cpu, self.memory_gib, self.disk_gib, self.gpu)
        if not self.image and any(value is not None for value in resources):
            raise ValueError("cpu, memory_gib, disk_gib and gpu can only be set with an image")
        self._check_positive("create_timeout_s", "activity_refresh_s", "max_lifetime_s")
        if self.request_retries < 0:
            raise ValueError(f"request_retries must be zero or more, not {self.request_retries}")
        if self.auto_stop_interval_min < 0:
            raise ValueError("auto_stop_interval_min must be 0 or more")
        if self.auto_delete_interval_min is not None and self.auto_delete_interval_min < 0:
            raise ValueError("auto_delete_interval_min must be 0 or more, or None")

    def new_client(self) -> AsyncDaytona:
        """A new SDK client; close it when done.

        Raises:
            SandboxAuthError: no credentials were given or found in the environment.
        """
        sdk = import_sdk()
        with translated(partial(translate_error, operation="connect")):
            if self.client_factory is not None:
                return self.client_factory()
            client: AsyncDaytona = sdk.AsyncDaytona()
        return client

    def refresh_period_s(self) -> float | None:
        """Seconds between keep-alive calls while a cell runs; None when auto-stop is off."""
        if self.auto_stop_interval_min == 0:
            return None
        if self.activity_refresh_s is not None:
            return self.activity_refresh_s
        return self.auto_stop_interval_min * 60 / 4

    def create_params(self, labels: Mapping[str, str]) -> Any:
        """The SDK's create parameters for a sandbox carrying ``labels``."""
        sdk = import_sdk()
        common: dict[str, Any] = {
            "language": "python",
            "env_vars": dict(self.env),
            "labels": dict(labels),
            "auto_stop_interval": self.auto_stop_interval_min,
            "auto_delete_interval": (
                -1 if self.auto_delete_interval_min is None else self.auto_delete_interval_min
            ),
            "ttl_minutes": (
                None if self.max_lifetime_s is None else math.ceil(self.max_lifetime_s / 60)
            ),
            "network_block_all": self.network_block_all,
            "network_allow_list": self.network_allow_list,
        }
        if self.image:
            resources = None
            if any(v is not None for v in (self.cpu, self.memory_gib, self.disk_gib, self.gpu)):
                resources = sdk.Resources(
                    cpu=self.cpu, memory=self.memory_gib, disk=self.disk_gib, gpu=self.gpu
                )
            return sdk.CreateSandboxFromImageParams(image=self.image, resources=resources, **common)
        return sdk.CreateSandboxFromSnapshotParams(snapshot=self.snapshot, **common)


class _CellRun:
    """One cell's stdout and stderr as they stream in: stdout split into text and records."""

    def __init__(self, outputs: CellOutputs) -> None:
        self.outputs = outputs
        self.splitter = MarkerSplitter()
        self.count: int | None = None
        self.pid: int | None = None
        self.exit_code: int | None = None
        self.lost = False
        # Whether user code raised: False when the only errors were ones a display showed.
        self.raised: bool | None = None

    def stdout(self, message: OutputMessage) -> None:
        self._take(self.splitter.feed(message.output))

    def stderr(self, message: OutputMessage) -> None:
        self.outputs.add("stream", {"name": "stderr", "text": message.output})

    def daemon_error(self, error: ExecutionError) -> None:
        self.raised = True
        self.outputs.add("error", error_content(error.name, error.value, error.traceback))

    def finish(self) -> None:
        self._take(self.splitter.finish())

    def _take(self, items: list[str | dict[str, Any]]) -> None:
        for item in items:
            if isinstance(item, str):
                self.outputs.add("stream", {"name": "stdout", "text": item})
                continue
            kind = item.get("kind")
            if kind == "start":
                self.count, self.pid = item["count"], item["pid"]
            elif kind == "exit":
                self.exit_code = item["code"]
            elif kind == "lost":
                self.lost = True
            elif kind == "error":
                self.raised = self.raised or not item.get("shown")
            content = record_content(item)
            if content is not None:
                self.outputs.add(*content)


class DaytonaSandbox(Sandbox):
    """A sandbox that is a Daytona sandbox; cells run in one interpreter context of it.

    Make one with `create`, reach it again with `attach`. Holds one SDK client, bound to the
    event loop it was made on: attach once per loop.
    """

    _config: DaytonaSandboxConfig

    def __init__(
        self,
        handle: SandboxHandle,
        config: DaytonaSandboxConfig,
        client: AsyncDaytona,
        remote: AsyncSandbox,
        context: InterpreterContext | None,
    ) -> None:
        self._handle = handle
        self._config = config
        self._client = client
        self._remote = remote
        self._context = context
        self._workdir = handle.workdir
        self._ended: str | None = None if context is not None else "no interpreter is running"
        self._worker_pid: int | None = None

    @property
    def handle(self) -> SandboxHandle:
        """The address of this sandbox (see `SandboxHandle`); it holds no API key."""
        return self._handle

    @classmethod
    async def create(
        cls, config: DaytonaSandboxConfig, labels: Mapping[str, str] | None = None
    ) -> DaytonaSandbox:
        """Create a Daytona sandbox, make its working directory and start its interpreter.

        A create answered with 429 is retried after the ``Retry-After`` the API gives; one
        answered with 5xx or a dropped connection is retried after deleting any sandbox the
        failed try left behind (found by a label unique to the call). If anything fails after
        the sandbox exists, it is deleted before the error is raised.

        Args:
            config: the sandbox settings.
            labels: labels to find the sandbox by later (flow run id and name, our marker).

        Returns:
            The live sandbox.

        Raises:
            SandboxAuthError: the API key was refused.
            SandboxUnavailableError: Daytona kept failing (``status_code``, ``operation``).
            SandboxError: Daytona refused the settings, or the interpreter did not start.
        """
        all_labels = {**config.labels, **(labels or {}), CREATE_TOKEN_LABEL: uuid.uuid4().hex}
        client = config.new_client()
        try:
            remote = await _create_remote(client, config, all_labels)
        except BaseException:
            await _close(client)
            raise
        sandbox_id = remote.id
        try:
            home = await _call(
                "get_work_dir", sandbox_id, config, remote.get_work_dir, idempotent=True
            )
            workdir = posixpath.join(home, WORKDIR_NAME)
            await _call(
                "create_folder",
                sandbox_id,
                config,
                lambda: remote.fs.create_folder(workdir, "755"),
                idempotent=True,
            )
            handle = SandboxHandle(
                backend=BACKEND_SLUG,
                sandbox_id=sandbox_id,
                workdir=workdir,
                labels=all_labels,
                # A Python interpreter context with our runner; its version is not asked.
                kernel=KernelInfo.python("Python 3 (Daytona)"),
            )
            sandbox = cls(handle, config, client, remote, None)
            await sandbox._start_interpreter()
        except BaseException:
            await kill_after_failed_setup(
                lambda: _call("delete", sandbox_id, config, remote.delete, idempotent=True),
                backend="Daytona",
                sandbox_id=sandbox_id,
                left_for="its auto-stop stops it, or the reaper deletes it",
            )
            await _close(client)
            raise
        return sandbox

    @classmethod
    async def attach(cls, handle: SandboxHandle, config: DaytonaSandboxConfig) -> DaytonaSandbox:
        """Reach a sandbox again, from this or another thread, process or machine.

        A stopped sandbox (auto-stop) is started again; its files are kept but its interpreter
        state is not, so `run_cell` raises `SandboxDiedError` until `restart`.

        Args:
            handle: the sandbox's handle.
            config: the sandbox settings (they hold the credentials).

        Returns:
            A live sandbox, its interpreter state intact when it had any.

        Raises:
            SandboxNotFoundError: the sandbox was deleted or expired.
            SandboxAuthError: the API key was refused.
        """
        client = config.new_client()
        try:
            remote = await _call(
                "get", handle.sandbox_id, config, lambda: client.get(handle.sandbox_id), True
            )
            state = str(getattr(remote.state, "value", remote.state))
            if state in _GONE_STATES:
                raise SandboxNotFoundError(
                    f"sandbox {handle.sandbox_id} is gone (state {state})",
                    sandbox_id=handle.sandbox_id,
                )
            if state in _STOPPED_STATES:
                await _call(
                    "start",
                    handle.sandbox_id,
                    config,
                    lambda: remote.start(timeout=config.create_timeout_s),
                    idempotent=True,
                )
            workdir = handle.workdir or posixpath.join(
                await _call("get_work_dir", remote.id, config, remote.get_work_dir, True),
                WORKDIR_NAME,
            )
            contexts = await _call(
                "list_contexts",
                remote.id,
                config,
                remote.code_interpreter.list_contexts,
                idempotent=True,
            )
        except BaseException:
            await _close(client)
            raise
        ours = sorted(
            (c for c in contexts if c.cwd == workdir and c.active),
            key=lambda c: c.created_at,
        )
        handle = handle.model_copy(update={"workdir": workdir})
        return cls(handle, config, client, remote, ours[-1] if ours else None)

    @classmethod
    async def list_handles(
        cls, config: DaytonaSandboxConfig, labels: Mapping[str, str] | None = None
    ) -> list[SandboxHandle]:
        """Handles of live sandboxes whose labels include ``labels``.

        Their ``workdir`` is empty; `attach` fills it in.

        Raises:
            SandboxAuthError: the API key was refused.
            SandboxUnavailableError: Daytona kept failing.
        """
        sdk = import_sdk()
        query = sdk.ListSandboxesQuery(labels=dict(labels or {}))
        client = config.new_client()

        async def listing() -> list[SandboxHandle]:
            handles = []
            async for remote in client.list(query):
                state = str(getattr(remote.state, "value", remote.state))
                if state not in _GONE_STATES:
                    handles.append(
                        SandboxHandle(
                            backend=BACKEND_SLUG,
                            sandbox_id=remote.id,
                            workdir="",
                            labels=dict(remote.labels),
                        )
                    )
            return sorted(handles, key=lambda handle: handle.sandbox_id)

        try:
            return await _call("list", None, config, listing, idempotent=True)
        finally:
            await _close(client)

    async def _prepare_cell(self) -> None:
        if self._ended is not None or self._context is None:
            raise self._died(self._ended or "no interpreter is running")

    async def _start_cell(
        self, code: str, outputs: CellOutputs, timeout_s: float | None
    ) -> RunningCell:
        return _DaytonaCell(self, code, outputs, timeout_s)

    async def take_late_outputs(self) -> dict[str, list[dict[str, Any]]]:
        """Always empty: Daytona's interpreter drops what threads print between cells.

        Output a thread prints while a later cell runs lands in that cell's result.
        """
        return {}

    async def upload(self, src: Path, dest: str) -> None:
        """Copy a local file into the working directory (see `Sandbox.upload`).

        Raises:
            UnsafePathError: ``dest`` leaves the working directory, a symlinked folder included.
            FileTransferError: ``src`` is not a file, or the upload failed.
            SandboxNotFoundError: the sandbox is gone.
        """
        remote_path = posixpath.join(self._workdir, checked_relative_path(dest).as_posix())
        checked_upload_source(src, dest)
        await self._resolve_inside({dest: remote_path})
        sdk = import_sdk()
        upload = sdk.FileUpload(source=str(src), destination=remote_path)
        await self._file_call(
            "upload", dest, lambda: self._remote.fs.upload_files([upload]), idempotent=True
        )

    async def download(self, src: str, dest: Path, *, max_bytes: int | None = None) -> int:
        """Copy a file out of the working directory (see `Sandbox.download`).

        Raises:
            UnsafePathError: ``src`` leaves the working directory, through a symlink included.
            FileTransferError: the file is missing, the download failed, or the file is
                larger than ``max_bytes`` (checked once it is here: it is left in ``dest``).
            SandboxNotFoundError: the sandbox is gone.
        """
        remote_path = posixpath.join(self._workdir, checked_relative_path(src).as_posix())
        (is_file,) = await self._resolve_inside({src: remote_path})
        if not is_file:
            raise self._missing_file(src)
        dest.parent.mkdir(parents=True, exist_ok=True)
        await self._file_call(
            "download",
            src,
            lambda: self._remote.fs.download_file(remote_path, str(dest)),
            idempotent=True,
        )
        size = dest.stat().st_size
        check_size(src, size, max_bytes)
        return size

    async def list_files(self, pattern: str = "**/*") -> list[RemoteFile]:
        """List files matching a pattern (see `Sandbox.list_files` and `matching_files`).

        Listed by code in the sandbox (kernel_side/listing.py), so that a name that is not UTF-8
        comes too (with surrogate escapes). Symlinks are listed as found, even ones that point
        outside; `download` refuses those.
        """
        checked_relative_path(pattern)
        return listed_files(await self._python("listing", {"root": self._workdir}), pattern)

    async def interrupt(self) -> None:
        """Send SIGINT to the interpreter process, as Jupyter's stop button does.

        Does nothing until this object has seen a cell start (it learns the process id then).
        """
        await self._signal_interrupt(self._worker_pid)

    async def restart(self) -> None:
        """Delete the interpreter context and start a new one: files kept, state lost."""
        await self._end_interpreter()
        await self._start_interpreter()

    async def kill(self) -> bool:
        """Delete the sandbox. Idempotent.

        Returns:
            True if this call deleted it, False if it was already gone.

        Raises:
            SandboxAuthError: the API key was refused.
            SandboxUnavailableError: Daytona kept failing.
        """
        try:
            await self._sandbox_call("delete", self._remote.delete, idempotent=True)
        except SandboxNotFoundError:
            return False
        finally:
            await self.close()
        return True

    async def close(self) -> None:
        """Close this object's SDK client; the sandbox keeps running."""
        await _close(self._client)

    async def _start_interpreter(self) -> None:
        """Make our interpreter context and install the runner in it."""
        self._context = await self._sandbox_call(
            "create_context",
            lambda: self._remote.code_interpreter.create_context(cwd=self._workdir),
            idempotent=False,
        )
        cell = _CellRun(CellOutputs(None, None))
        async with translated_async(partial(self._run_failure, in_cell=False)):
            await self._remote.code_interpreter.run_code(
                _bootstrap_code(),
                context=self._context,
                on_stdout=cell.stdout,
                on_stderr=cell.stderr,
                on_error=cell.daemon_error,
                timeout=_BOOTSTRAP_TIMEOUT_S,
            )
        cell.finish()
        if cell.outputs.collector.has_error():
            errors = [o for o in cell.outputs.collector.outputs if o["output_type"] == "error"]
            raise SandboxError(
                f"sandbox {self._handle.sandbox_id}: the interpreter did not start: "
                f"{errors[-1]['ename']}: {errors[-1]['evalue']}",
                sandbox_id=self._handle.sandbox_id,
            )
        self._ended = None

    async def _end_interpreter(self) -> None:
        """Delete our interpreter context, ending its process; gone already is fine."""
        context, self._context = self._context, None
        self._worker_pid = None
        if context is None:
            return
        with contextlib.suppress(SandboxNotFoundError):
            await self._sandbox_call(
                "delete_context",
                lambda: self._remote.code_interpreter.delete_context(context),
                idempotent=True,
            )

    def keep_alive_period_s(self) -> float | None:
        """`DaytonaConfig.refresh_period_s`: a quarter of the auto-stop interval, unless set;
        None when auto-stop is off."""
        return self._config.refresh_period_s()

    async def keep_alive(self) -> None:
        """Tell Daytona the sandbox is active (the SDK's ``refresh_activity``), which restarts
        its auto-stop clock; ``max_lifetime_s`` is never renewed.

        Raises:
            SandboxNotFoundError: the sandbox was deleted.
            SandboxUnavailableError: Daytona could not be reached.
        """
        await self._sandbox_call("refresh_activity", self._remote.refresh_activity, idempotent=True)

    def _keep_alive(self) -> asyncio.Task[None] | None:
        """While a cell runs, tell Daytona the sandbox is active, so auto-stop never hits."""
        period_s = self._config.refresh_period_s()
        if period_s is None:
            return None
        sdk = import_sdk()

        async def refresh() -> None:
            while True:
                await asyncio.sleep(period_s)
                try:
                    await self._remote.refresh_activity()
                except sdk.DaytonaError as exc:
                    logger.warning(
                        "Sandbox %s: keep-alive call failed: %s", self._handle.sandbox_id, exc
                    )

        return asyncio.create_task(refresh())

    async def _signal_interrupt(self, pid: int | None) -> None:
        if pid is None:
            logger.warning(
                "Sandbox %s: cannot interrupt, the interpreter's process id is not known yet",
                self._handle.sandbox_id,
            )
            return
        # Not retried: a repeated SIGINT could land in the next cell.
        await self._sandbox_call(
            "interrupt",
            lambda: self._remote.process.exec(f"kill -INT {pid}", timeout=_EXEC_TIMEOUT_S),
            idempotent=False,
        )

    async def _run_failure(self, exc: Exception, *, in_cell: bool) -> SandboxError | None:
        """What a failed ``run_code`` means: the sandbox or interpreter ended, or the link.

        Args:
            exc: what ``run_code`` raised.
            in_cell: True for a user's cell, False for installing the runner.

        Returns:
            The error to raise from ``exc``; None when ``exc`` is a bug, to let through.
        """
        operation = "run_cell" if in_cell else "start_interpreter"
        error = translate_error(
            exc, operation=operation, sandbox_id=self._handle.sandbox_id, in_cell=in_cell
        )
        if error is None:
            return None
        gone = await self._check_gone()
        if gone is not None:
            return gone
        close = close_of(exc)
        if close is None or close[0] not in (1001, 1008):
            return error
        code, reason = close
        if reason == _SLOW_CONSUMER:
            # The daemon dropped this client, not the execution: the cell may run on.
            return SandboxUnavailableError(
                f"Daytona dropped the cell's output stream (close {code} {reason!r}: its "
                "output came faster than it was read); the cell may still run, so it is not "
                "run again",
                operation=operation,
                sandbox_id=self._handle.sandbox_id,
            )
        # 1001: the interpreter process ended, or its context was deleted; 1008: it is gone.
        self._ended = f"Daytona closed the execution with {code} {reason!r}"
        return self._died(self._ended)

    async def _check_gone(self) -> SandboxError | None:
        """`SandboxNotFoundError` if the sandbox is gone, `SandboxDiedError` if it stopped."""
        try:
            await self._sandbox_call("get", self._remote.refresh_data, idempotent=True)
        except SandboxNotFoundError as exc:
            return exc
        state = str(getattr(self._remote.state, "value", self._remote.state))
        if state in _GONE_STATES:
            return SandboxNotFoundError(
                f"sandbox {self._handle.sandbox_id} is gone (state {state})",
                sandbox_id=self._handle.sandbox_id,
            )
        if state in _STOPPED_STATES:
            self._ended = f"the sandbox was stopped (state {state}), by auto-stop or by hand"
            return self._died(self._ended)
        return None

    def _died(self, reason: str, exit_code: int | None = None) -> SandboxDiedError:
        return SandboxDiedError(
            f"interpreter of sandbox {self._handle.sandbox_id} ended ({reason}); its state is "
            "lost; restart() starts a fresh one",
            exit_code=exit_code,
            sandbox_id=self._handle.sandbox_id,
        )

    async def _python(self, script: str, args: object) -> str:
        """Run the script kernel_side/``script``.py in the sandbox with ``args`` as its JSON
        argument, and return what it printed."""
        argument = json.dumps(args, ensure_ascii=False)
        command = shlex.join(["python3", "-I", "-c", source(script), argument])

        async def run() -> str:
            response = await self._remote.process.exec(command, timeout=_EXEC_TIMEOUT_S)
            if response.exit_code != 0:
                raise SandboxError(
                    f"sandbox {self._handle.sandbox_id}: helper script failed "
                    f"(exit code {response.exit_code}): {response.result[-2000:]}",
                    sandbox_id=self._handle.sandbox_id,
                )
            return str(response.result)

        return await self._sandbox_call("exec", run, idempotent=True)

    async def _resolve_inside(self, paths: Mapping[str, str]) -> list[bool]:
        """Check that each path, symlinks resolved, stays in the working directory.

        Args:
            paths: the path as the user gave it to its absolute path in the sandbox.

        Returns:
            Whether each is an existing regular file.

        Raises:
            UnsafePathError: one leaves the working directory.
        """
        output = await self._python("resolve_paths", [self._workdir, *paths.values()])
        root, rows = json.loads(output)
        checked = []
        for given, (real, is_file) in zip(paths, rows, strict=True):
            if not is_inside(real, root):
                raise UnsafePathError(
                    f"path {given!r} resolves outside the working directory (through a symlink)",
                    path=given,
                    sandbox_id=self._handle.sandbox_id,
                )
            checked.append(bool(is_file))
        return checked

    async def _sandbox_call(
        self, operation: str, call: Callable[[], Awaitable[T]], *, idempotent: bool
    ) -> T:
        return await _call(operation, self._handle.sandbox_id, self._config, call, idempotent)

    async def _file_call(
        self, operation: str, path: str, call: Callable[[], Awaitable[T]], *, idempotent: bool
    ) -> T:
        try:
            return await _call(
                operation, self._handle.sandbox_id, self._config, call, idempotent, path=path
            )
        except FileTransferError:
            gone = await self._check_gone()
            if gone is not None:
                raise gone from None
            raise


async def _call(
    operation: str,
    sandbox_id: str | None,
    config: DaytonaSandboxConfig,
    call: Callable[[], Awaitable[T]],
    idempotent: bool,
    *,
    path: str | None = None,
) -> T:
    """Make an SDK call, translating its errors; repeat it on 429 (or 5xx when idempotent).

    Raises:
        SandboxError: the translated error of the last try (see `translate_error`).
    """

    def transient(error: BaseException) -> bool:
        return isinstance(error, SandboxUnavailableError) and (
            idempotent or error.status_code == 429
        )

    retrying = async_retrying(
        attempts=config.request_retries + 1, retry_if=transient, what=f"Daytona {operation}"
    )
    async for attempt in retrying:
        with (
            attempt,
            translated(
                partial(translate_error, operation=operation, sandbox_id=sandbox_id, path=path)
            ),
        ):
            return await call()
    raise AssertionError("unreachable: tenacity reraises")


async def _create_remote(
    client: AsyncDaytona, config: DaytonaSandboxConfig, labels: dict[str, str]
) -> AsyncSandbox:
    """Create the sandbox; a try that fails with 5xx may have made one, so delete it first."""
    sdk = import_sdk()
    token = labels[CREATE_TOKEN_LABEL]
    retrying = async_retrying(
        attempts=config.request_retries + 1,
        retry_if=lambda error: isinstance(error, SandboxUnavailableError),
        what="Daytona create",
    )

    async def create_failure(exc: Exception) -> SandboxError | None:
        error = translate_error(exc, operation="create")
        if isinstance(exc, sdk.DaytonaTimeoutError) or (
            isinstance(error, SandboxUnavailableError) and error.status_code != 429
        ):
            await _delete_by_label(client, config, token)
        return error

    async for attempt in retrying:
        with attempt:
            async with translated_async(create_failure):
                remote: AsyncSandbox = await client.create(
                    config.create_params(labels), timeout=config.create_timeout_s
                )
                return remote
    raise AssertionError("unreachable: tenacity reraises")


async def _delete_by_label(client: AsyncDaytona, config: DaytonaSandboxConfig, token: str) -> None:
    """Delete the sandbox a failed create left behind, if it made one."""
    sdk = import_sdk()
    query = sdk.ListSandboxesQuery(labels={CREATE_TOKEN_LABEL: token})

    async def orphans() -> list[AsyncSandbox]:
        return [remote async for remote in client.list(query)]

    for orphan in await _call("list", None, config, orphans, idempotent=True):
        logger.warning("Deleting sandbox %s left behind by a failed create", orphan.id)
        with contextlib.suppress(SandboxNotFoundError):
            await _call("delete", orphan.id, config, orphan.delete, idempotent=True)


async def _close(client: AsyncDaytona) -> None:
    await client.close()  # type: ignore[no-untyped-call]


class _DaytonaCell(RunningCell):
    """A cell as one ``run_code`` of the interpreter context, through the runner.

    Interrupts are SIGINTs to the interpreter process (its pid comes in the cell's first
    record). The daemon gets a deadline of its own, past ours and the grace periods, as a
    backstop; the sandbox is kept from auto-stopping while the cell runs.
    """

    def __init__(
        self, sandbox: DaytonaSandbox, code: str, outputs: CellOutputs, timeout_s: float | None
    ) -> None:
        self._sandbox = sandbox
        self._run = _CellRun(outputs)
        self._interrupted = False
        self._timeout_s = timeout_s
        server_timeout_s = 0
        if timeout_s is not None:
            server_timeout_s = _SERVER_TIMEOUT_MARGIN_S + math.ceil(
                timeout_s + sandbox._config.interrupt_grace_s + SECOND_INTERRUPT_S
            )
        self._server_timeout_s = server_timeout_s
        self._sent_at = time.monotonic()
        self._execution: asyncio.Task[Any] = asyncio.create_task(
            sandbox._remote.code_interpreter.run_code(
                _cell_code(code),
                context=sandbox._context,
                on_stdout=self._run.stdout,
                on_stderr=self._run.stderr,
                on_error=self._run.daemon_error,
                timeout=server_timeout_s,
            )
        )
        self._keep_alive = sandbox._keep_alive()

    async def wait(self, deadline: float | None) -> bool:
        timeout_s = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        done, _ = await asyncio.wait({self._execution}, timeout=timeout_s)
        return bool(done)

    async def interrupt(self, attempt: int) -> None:
        self._interrupted = True
        await self._sandbox._signal_interrupt(self._run.pid)

    async def abandon(self) -> None:
        for task in (self._keep_alive, self._execution):
            if task is not None:
                await cancel_and_wait(task)

    async def finish(self, *, state_lost: bool) -> CellReply:
        sandbox = self._sandbox
        if self._keep_alive is not None:
            await cancel_and_wait(self._keep_alive)
        self._run.finish()
        if state_lost:
            return CellReply()
        closed_4008 = False
        async with translated_async(partial(sandbox._run_failure, in_cell=True)):
            try:
                self._execution.result()
            except Exception as exc:
                sdk = import_sdk()
                closed_4008 = isinstance(exc, sdk.DaytonaTimeoutError) and not isinstance(
                    exc, sdk.DaytonaConnectionError
                )
                if not closed_4008:
                    raise
        if closed_4008 and not self._interrupted:
            after_s = time.monotonic() - self._sent_at
            if 0 < self._server_timeout_s <= after_s:
                # The daemon's own deadline (our backstop) ended the cell and may have killed
                # the interpreter.
                await sandbox.restart()
                return CellReply(execution_count=self._run.count, state_lost=True)
            return CellReply(
                execution_count=self._run.count,
                raised=True,
                error=self._interrupted_from_outside(after_s),
            )
        if self._run.pid is not None:
            sandbox._worker_pid = self._run.pid
        if self._run.lost:
            sandbox._ended = "its interpreter was restarted behind our back"
            raise sandbox._died(sandbox._ended)
        if self._run.exit_code is not None:
            await sandbox._end_interpreter()
            sandbox._ended = "the cell called exit()"
            raise sandbox._died(sandbox._ended, exit_code=self._run.exit_code)
        return CellReply(execution_count=self._run.count, raised=self._run.raised)

    def _interrupted_from_outside(self, after_s: float) -> CellError:
        """The error of a cell that Daytona closed with 4008 before any deadline and without
        our interrupt: its interpreter reported the execution ``interrupted``, a SIGINT (or
        the SIGTERM of a context being deleted) from outside this run reached it. The SDK
        calls every 4008 "Execution timed out"; this one was not."""
        deadline = "no timeout" if self._timeout_s is None else f"its {self._timeout_s} s timeout"
        return CellError(
            ename="KeyboardInterrupt",
            evalue=(
                f"the interpreter was interrupted from outside the run {after_s:.1f} s into "
                f"the cell, well before {deadline}: Daytona ended the execution with close "
                f"code {_TIMEOUT_CLOSE} (the interpreter reported it interrupted)"
            ),
        )
