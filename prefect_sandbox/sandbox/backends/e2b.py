"""`E2BSandbox`: an E2B cloud sandbox, driven through the ``e2b-code-interpreter`` SDK.

Cells run in one code context made at creation; its id travels in the handle. The SDK is
imported only when used. Hard-won facts, told in full in the manual: the SDK's ``run_code``
deadline fires at about twice the value, so we keep our own; E2B has no interrupt call, and its
server lets a context go before the interrupt lands, so after a timeout probes
(kernel_side/forget_cell.py) are sent ``interrupt_settle_s`` apart, doubling, and only when none
answers within ``interrupt_grace_s`` is the context restarted (``state_lost``); the server
prepends env-var lines to the first execution on each connection, taken by a priming cell
(kernel_side/e2b_priming.py) that leaves no trace; display hooks (kernel_side/e2b_display.py)
carry what the server drops under `DISPLAY_CONTROL_MIME`; an execute is never replayed; the
lifetime is renewed around and during each cell. Manual: docs/backends/e2b.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import posixpath
import re
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path, PurePosixPath
from types import ModuleType
from typing import Any, TypeVar

from prefect_sandbox.sandbox.backends import (
    cancel_and_wait,
    import_extra,
    kill_after_failed_setup,
    translated,
)
from prefect_sandbox.sandbox.backends.native_threads import wait_for_quiet_threads_at_exit
from prefect_sandbox.sandbox.base import (
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
from prefect_sandbox.sandbox.kernel_side import run_code
from prefect_sandbox.sandbox.outputs import COMM_MSG_TYPES, CellOutputs, error_content
from prefect_sandbox.sandbox.paths import (
    check_size,
    checked_relative_path,
    checked_upload_source,
    is_inside,
    listed_files,
    matching_files,
)
from prefect_sandbox.sandbox.retries import async_retrying

__all__ = [
    "BACKEND_SLUG",
    "DEFAULT_INTERRUPT_SETTLE_S",
    "DEFAULT_WORKDIR",
    "DISPLAY_CONTROL_MIME",
    "EXIT_MSG_TYPE",
    "OUTCOME_MSG_TYPE",
    "TRACEBACK_MSG_TYPE",
    "E2BConfig",
    "E2BSandbox",
    "import_sdk",
    "mime_bundle",
    "result_content",
    "translate_error",
]

BACKEND_SLUG = "e2b"
DEFAULT_WORKDIR = "/home/user/work"
DEFAULT_INTERRUPT_SETTLE_S = 0.5
"""Seconds from closing a timed-out cell's stream to the probe (E2B's interrupt lands in
between: measured 0.05 s too soon, 0.5 s late enough)."""
EXTRA_HINT = "pip install 'prefect-sandbox[e2b]'"

# Error names the code interpreter server reports when it lost the cell, not user code.
_KERNEL_RESTARTED = "ContextRestarting"
_SERVER_LOST_CELL = frozenset({"UnexpectedEndOfExecution", "WebSocketError", "ExecutionAborted"})
# How the SDK words a sandbox that is gone, in exceptions with no better type.
_GONE_PHRASES = ("was not found", "sandbox was killed")
# What the code interpreter SDK appends to the body of any 502 (e2b_code_interpreter's
# models.format_exception), as a TimeoutException: a guess, never passed on as the cause.
_SDK_502_GUESS = ": This error is likely due to sandbox timeout."
_OWN_CELL_TIMEOUT_S = 60  # our own cells: priming, listing files
# Where E2B's Jupyter server starts (and restarts) kernels: its root folder.
_JUPYTER_ROOT = "/home/user"

DISPLAY_CONTROL_MIME = "application/vnd.prefect-sandbox.display+json"
"""The key our kernel hooks add to a display's bundle: what E2B would otherwise lose of it."""
TRACEBACK_MSG_TYPE = "prefect_sandbox_traceback"
"""What `result_content` calls the traceback lines our hooks send ahead of an error."""
EXIT_MSG_TYPE = "prefect_sandbox_exit"
"""What `result_content` calls our hooks' word that the cell called ``exit()``."""
OUTCOME_MSG_TYPE = "prefect_sandbox_outcome"
"""What `result_content` calls our hooks' word of how the cell ended, as ipykernel's
``execute_reply`` says it (``{"status": "ok"}`` or ``{"status": "error", "ename", "evalue"}``)."""
_DISPLAY_HOOKS_FILE = "00-prefect-sandbox-display.py"
_HOOKS_FAILED = "prefect-sandbox: display hooks not installed:"


@functools.cache
def _display_hooks_code() -> str:
    """The display hooks' startup file (kernel_side/e2b_display.py), and the fork guard: E2B's
    server ends a cell at any idle status, a fork's too."""
    hooks = run_code("e2b_display", "main", {"key": DISPLAY_CONTROL_MIME})
    return hooks + run_code("fork_guard", "main")


def _priming_code(args: dict[str, Any]) -> str:
    """A priming cell (kernel_side/e2b_priming.py, then forget_cell.py): it takes the lines E2B
    puts before the first execution on a connection, does what ``args`` say and leaves no
    trace."""
    return run_code("e2b_priming", "main", args) + run_code("forget_cell", "main")


def _install_hooks_args() -> dict[str, Any]:
    """A priming cell's arguments that write the display hooks into the kernel's IPython
    startup folder (for later restarts) and apply them now; a failure is printed to stderr."""
    return {
        "hooks": {
            "file": _DISPLAY_HOOKS_FILE,
            "code": _display_hooks_code(),
            "failed": _HOOKS_FAILED,
        }
    }


def _back_to_workdir_args(workdir: str) -> dict[str, Any]:
    """A priming cell's arguments that return a restarted kernel to the working directory (by
    its path from Jupyter's root where it is not found as is: an emulator's folders are
    elsewhere)."""
    return {"workdir": workdir, "from_root": posixpath.relpath(workdir, _JUPYTER_ROOT)}


_LIST_DEPTH_ALL = 64
# envd's Go server cannot marshal a name that is not UTF-8, so a ListDir that meets one fails
# whole ("marshal message: proto: field filesystem.EntryInfo.name contains invalid UTF-8").
_NOT_UTF8_LISTING = "invalid UTF-8"
_MAX_SYMLINK_HOPS = 40
_STATUS_PREFIX = re.compile(r"^(\d{3})\b")

logger = logging.getLogger(__name__)

T = TypeVar("T")

_MIME_OF_FIELD = {
    "text": "text/plain",
    "html": "text/html",
    "markdown": "text/markdown",
    "svg": "image/svg+xml",
    "png": "image/png",
    "jpeg": "image/jpeg",
    "pdf": "application/pdf",
    "latex": "text/latex",
    "json": "application/json",
    "javascript": "application/javascript",
}


def import_sdk() -> ModuleType:
    """Import ``e2b_code_interpreter``, and make the interpreter's exit wait for the SDK's
    native threads (`wait_for_quiet_threads_at_exit`).

    Raises:
        BackendNotInstalledError: the ``e2b`` extra is not installed (the message says how to
            install it).
    """
    sdk = import_extra("e2b_code_interpreter", extra="e2b", backend="E2B")
    wait_for_quiet_threads_at_exit()
    return sdk


@dataclass(frozen=True, kw_only=True)
class E2BConfig(SandboxConfig):
    """Settings of E2B sandboxes (besides those of `SandboxConfig`).

    Attributes:
        client_factory: makes an ``e2b_code_interpreter.E2B`` client holding the credentials;
            None for the SDK's environment variables (``E2B_API_KEY``, ``E2B_DOMAIN``, ...).
        template: the sandbox template; None for the SDK's default, ``code-interpreter-v1``.
        lifetime_s: seconds the sandbox lives past the last extension; set at creation and
            renewed before and during each cell.
        env: environment variables of the whole sandbox (the SDK's ``envs``).
        metadata: metadata besides the labels (flow run id and name, our marker).
        allow_internet_access: False to cut the sandbox off the internet; None for the default.
        workdir: the working directory inside the sandbox; made if missing.
        request_retries: retries of an idempotent file or context call that met a transient
            error, and of a create that got no answer (retries after the first try, as
            Prefect's ``retries``).
        retry_backoff_s: the first wait between those retries, doubled each time (see
            `prefect_sandbox.sandbox.retries`).
        interrupt_settle_s: seconds from closing a timed-out cell's stream to the probe that
            checks the kernel is idle; a probe unanswered that long again is closed and sent
            again after twice the wait (docs/backends/e2b.md, "How it runs cells").
    """

    client_factory: Callable[[], Any] | None = None
    template: str | None = None
    lifetime_s: int = 600
    env: Mapping[str, str] = field(default_factory=dict)
    metadata: Mapping[str, str] = field(default_factory=dict)
    allow_internet_access: bool | None = None
    workdir: str = DEFAULT_WORKDIR
    request_retries: int = 3
    retry_backoff_s: float = 0.5
    interrupt_settle_s: float = DEFAULT_INTERRUPT_SETTLE_S

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_positive("lifetime_s", "retry_backoff_s", "interrupt_settle_s")
        if self.request_retries < 0:
            raise ValueError(f"request_retries must be zero or more, not {self.request_retries}")
        if not PurePosixPath(self.workdir).is_absolute():
            raise ValueError(f"workdir must be an absolute path, not {self.workdir!r}")

    def new_client(self) -> Any:
        """An ``e2b_code_interpreter.E2B`` client, from ``client_factory`` or the environment.

        Raises:
            BackendNotInstalledError: the ``e2b`` extra is not installed.
        """
        if self.client_factory is not None:
            return self.client_factory()
        return import_sdk().E2B()


# --- pure conversions -------------------------------------------------------------------


def mime_bundle(result: Any) -> dict[str, Any]:
    """The MIME bundle of an SDK ``Result`` (``text/plain``, ``image/png`` base64, ...).

    Fields with no standard MIME type (``chart``, ``data``) are left out; ``extra`` keys are
    MIME types the server had no field for and are kept as they are.
    """
    bundle: dict[str, Any] = {}
    for name, mime in _MIME_OF_FIELD.items():
        value = getattr(result, name, None)
        if value is not None:
            bundle[mime] = value
    bundle.update(getattr(result, "extra", None) or {})
    return bundle


def result_content(bundle: dict[str, Any], *, is_main_result: bool) -> tuple[str, dict[str, Any]]:
    """The Jupyter message type and content of an SDK ``Result``'s MIME bundle.

    A bundle that our display hooks marked (`DISPLAY_CONTROL_MIME`) gets back what E2B drops:
    its display id, metadata and exact ``text/plain``; an update is ``update_display_data``
    and a ``clear_output`` call is ``clear_output``. The name, value and traceback lines of an
    error the kernel shows come as `TRACEBACK_MSG_TYPE` (``{"ename", "evalue", "traceback"}``),
    since E2B joins the lines without a separator and may pass on the execute_reply's error
    instead, an ``exit()`` call as `EXIT_MSG_TYPE`, how the cell ended (its reply's status,
    which E2B may drop) as `OUTCOME_MSG_TYPE`, and a widget's ``comm_open`` or ``comm_msg``
    (which E2B drops) as that message's content with its ``buffers`` base64.

    Args:
        bundle: the result's MIME bundle (`mime_bundle`).
        is_main_result: True for the value of the cell's last expression.

    Returns:
        ``(msg_type, content)`` for `OutputCollector.add`.
    """
    data = dict(bundle)
    control = data.pop(DISPLAY_CONTROL_MIME, None)
    if not isinstance(control, dict):
        control = {}
    if control.get("clear"):
        return "clear_output", {"wait": bool(control.get("wait"))}
    if control.get("exit"):
        return EXIT_MSG_TYPE, {}
    if "outcome" in control:
        shown = {name: str(control[name]) for name in ("ename", "evalue") if name in control}
        return OUTCOME_MSG_TYPE, {"status": str(control["outcome"]), **shown}
    if control.get("comm") in COMM_MSG_TYPES:
        comm = {
            "comm_id": control.get("comm_id"),
            "data": {"state": control.get("state"), "buffer_paths": control.get("buffer_paths")},
            "buffers": list(control.get("buffers") or []),
        }
        return str(control["comm"]), comm
    if "traceback" in control:
        shown = {name: str(control[name]) for name in ("ename", "evalue") if name in control}
        return TRACEBACK_MSG_TYPE, {**shown, "traceback": list(control["traceback"])}
    if "text/plain" in control:
        data["text/plain"] = control["text/plain"]
    content: dict[str, Any] = {"data": data, "metadata": control.get("metadata") or {}}
    if is_main_result:
        return "execute_result", {**content, "execution_count": None}
    if control.get("display_id"):
        content["transient"] = {"display_id": control["display_id"]}
    return ("update_display_data" if control.get("update") else "display_data"), content


def _status_of(exc: BaseException) -> int | None:
    status = getattr(exc, "status_code", None)
    if isinstance(status, int):
        return status
    found = _STATUS_PREFIX.match(str(exc))
    return int(found.group(1)) if found else None


def _implied_status(exc: BaseException, errors: ModuleType) -> int | None:
    """The HTTP status an SDK exception stands for when it carries none.

    The SDK turns envd's error answers into exceptions without their status: a 429 into
    `RateLimitException`, a 503 into `ServiceBusyException`, and a 502 of envd or the proxy in
    front of it into `SandboxUnreachableException` with no transport error as its cause (one
    built from a failed connection has that error as ``__cause__``).
    """
    if isinstance(exc, errors.RateLimitException):
        return 429
    if isinstance(exc, errors.ServiceBusyException):
        return 503
    if isinstance(exc, errors.SandboxUnreachableException) and exc.__cause__ is None:
        return 502
    return None


def _status_and_text(exc: BaseException, errors: ModuleType) -> tuple[int | None, str]:
    """The HTTP status ``exc`` stands for (`_implied_status` when it carries none) and its
    text, a 502's without the SDK's guess at its cause (`_SDK_502_GUESS`)."""
    text = str(exc)
    if isinstance(exc, errors.TimeoutException) and _SDK_502_GUESS in text:
        return 502, f"Bad Gateway: {text.partition(_SDK_502_GUESS)[0].strip() or 'no body'}"
    status = _status_of(exc)
    return (_implied_status(exc, errors) if status is None else status), text


def translate_error(
    exc: BaseException,
    *,
    operation: str,
    sandbox_id: str | None = None,
    path: str | None = None,
    in_cell: bool = False,
) -> SandboxError | None:
    """Map an exception from the E2B SDK or its transport onto our error tree.

    The one place where E2B's exceptions, and the raw ``httpx`` errors the SDK lets escape,
    become ours. Pure: nothing is raised or logged here.

    Args:
        exc: what the SDK raised.
        operation: our name for the call (``"create"``, ``"run_cell"``, ``"download"``...).
        sandbox_id: the sandbox concerned, when known.
        path: the file concerned, for file calls.
        in_cell: True when the call ran a cell.

    Returns:
        The error to raise from ``exc``, or None when ``exc`` is not the SDK's or transport's
        (a bug to let through unchanged).
    """
    import httpx
    from e2b import exceptions as e2b_errors

    where = f"sandbox {sandbox_id}" if sandbox_id else "E2B"
    during = " while running a cell" if in_cell else ""
    status, text = _status_and_text(exc, e2b_errors)
    if isinstance(exc, e2b_errors.AuthenticationException):
        return SandboxAuthError(
            f"{where}: E2B refused the credentials ({operation}); check the API key",
            sandbox_id=sandbox_id,
        )
    if isinstance(exc, e2b_errors.FileNotFoundException):
        return FileTransferError(
            f"{where}: file {path!r} does not exist ({operation})",
            path=path or "",
            sandbox_id=sandbox_id,
        )
    gone = isinstance(
        exc, e2b_errors.SandboxNotFoundException | e2b_errors.SandboxNotRunningException
    ) or (
        isinstance(exc, e2b_errors.TimeoutException)
        and any(phrase in text for phrase in _GONE_PHRASES)
    )
    if gone:
        return SandboxNotFoundError(
            f"sandbox {sandbox_id} is gone (expired or killed){during}; "
            f"it is never replaced silently ({operation})",
            sandbox_id=sandbox_id,
        )
    transient: tuple[type[BaseException], ...] = (
        e2b_errors.RateLimitException,
        e2b_errors.ServiceBusyException,
        e2b_errors.TimeoutException,
        httpx.HTTPError,
        json.JSONDecodeError,
    )
    if isinstance(exc, transient) or (
        isinstance(exc, e2b_errors.SandboxException)
        and status is not None
        and (status == 429 or status >= 500)
    ):
        kind = (
            "HTTPError" if status == 502 and text.startswith("Bad Gateway") else type(exc).__name__
        )
        code = f" (HTTP {status})" if status is not None else ""
        return SandboxUnavailableError(
            f"{where}: {operation} failed{during}{code}: {kind}: {text}",
            operation=operation,
            status_code=status,
            sandbox_id=sandbox_id,
        )
    if isinstance(exc, e2b_errors.SandboxException):
        return SandboxError(f"{where}: {operation} failed{during}: {text}", sandbox_id=sandbox_id)
    return None


async def _retrying(
    config: E2BConfig,
    operation: str,
    call: Callable[[], Awaitable[T]],
    *,
    sandbox_id: str | None,
    path: str | None = None,
    in_cell: bool = False,
    unanswered_only: bool = False,
) -> T:
    """Run an idempotent call, retrying transient errors ``config.request_retries`` times with
    `async_retrying`'s backoff from ``config.retry_backoff_s``; errors translated as
    `_translated` does. ``unanswered_only``: retry only a call that got no answer (a transport
    error: the SDK retries the HTTP statuses it deems transient itself)."""

    def transient(error: BaseException) -> bool:
        return isinstance(error, SandboxUnavailableError) and not (
            unanswered_only and error.status_code is not None
        )

    retrying = async_retrying(
        attempts=config.request_retries + 1,
        retry_if=transient,
        first_delay_s=config.retry_backoff_s,
        what=f"E2B {operation}",
    )
    async for attempt in retrying:
        with attempt, _translated(operation, sandbox_id=sandbox_id, path=path, in_cell=in_cell):
            return await call()
    raise AssertionError("unreachable: tenacity reraises")


def _translated(
    operation: str,
    *,
    sandbox_id: str | None = None,
    path: str | None = None,
    in_cell: bool = False,
) -> contextlib.AbstractContextManager[None]:
    """Raise `translate_error`'s mapping of what the block raises (see `translated`)."""
    return translated(
        partial(
            translate_error, operation=operation, sandbox_id=sandbox_id, path=path, in_cell=in_cell
        )
    )


class E2BSandbox(Sandbox):
    """A sandbox that is an E2B cloud sandbox, with one persistent code context.

    Make one with `create`, reach it again with `attach`. Not safe to share one instance
    between event loops; attach once per loop instead.
    """

    _config: E2BConfig
    # Closing the execute stream is the one interrupt E2B has; a second would find no stream.
    _interrupts_before_restart = 1

    def __init__(self, sdk_sandbox: Any, config: E2BConfig, handle: SandboxHandle) -> None:
        self._sdk = sdk_sandbox
        self._config = config
        self._handle = handle
        self._context: Any = None
        self._dead = False
        self._last_count: int | None = None
        self._running: asyncio.Task[Any] | None = None
        self._interrupted = False

    @property
    def handle(self) -> SandboxHandle:
        """The address of this sandbox (see `SandboxHandle`); it holds no API key."""
        return self._handle

    @property
    def _id(self) -> str:
        return self._handle.sandbox_id

    @classmethod
    async def create(cls, config: E2BConfig, labels: Mapping[str, str] | None = None) -> E2BSandbox:
        """Make a sandbox, its working directory and its code context (see `Sandbox.create`).

        Args:
            config: the sandbox settings; its client factory holds the credentials.
            labels: labels stored as the sandbox's metadata (flow run id and name, marker).

        Returns:
            The live sandbox.

        Raises:
            BackendNotInstalledError: the ``e2b`` extra is not installed.
            SandboxAuthError: the API key was refused.
            SandboxUnavailableError: E2B stayed busy or unreachable through the SDK's retries.
            SandboxError: E2B refused the request (a bad template, a limit).
        """
        client = config.new_client()
        metadata = {**config.metadata, **(labels or {})}
        # One key for every try: a create sent again after a lost answer, or after a pooled
        # connection was reset under it (neither of which the SDK retries), returns the sandbox
        # the first made, if it made one.
        idempotency_key = uuid.uuid4().hex
        sdk_sandbox = await _retrying(
            config,
            "create",
            lambda: client.AsyncSandbox.create(
                template=config.template,
                timeout=config.lifetime_s,
                metadata=metadata,
                envs=dict(config.env),
                allow_internet_access=config.allow_internet_access,
                idempotency_key=idempotency_key,
            ),
            sandbox_id=None,
            unanswered_only=True,
        )
        handle = SandboxHandle(
            backend=BACKEND_SLUG,
            sandbox_id=sdk_sandbox.sandbox_id,
            workdir=config.workdir,
            labels=dict(labels or {}),
            # E2B's code interpreter runs a Jupyter python3 kernel; its version is not asked.
            kernel=KernelInfo.python("Python 3 (E2B)"),
        )
        sandbox = cls(sdk_sandbox, config, handle)
        try:
            await sandbox._make_context()
        except BaseException:
            await kill_after_failed_setup(
                sandbox.kill,
                backend="E2B",
                sandbox_id=sandbox._id,
                left_for=f"it expires within {config.lifetime_s} s, or the reaper kills it",
            )
            raise
        logger.info("E2B sandbox %s created", handle.sandbox_id)
        return sandbox

    async def _make_context(self) -> None:
        # Starting a kernel can take a short lifetime's worth: keep it extended meanwhile.
        keep_alive = asyncio.create_task(self._keep_alive())
        try:
            await self._retrying("create", lambda: self._sdk.files.make_dir(self._config.workdir))
            # Not retried: a context made by a try whose answer was lost would be a second one.
            with _translated("create", sandbox_id=self._id):
                self._context = await self._sdk.create_code_context(
                    cwd=self._config.workdir, language="python"
                )
            self._handle = self._handle.model_copy(
                update={"connection": {"context_id": self._context.id}}
            )
            await self._prime(_install_hooks_args(), operation="create")
        finally:
            await cancel_and_wait(keep_alive)

    async def _prime(self, args: dict[str, Any], *, operation: str) -> None:
        """Run the first execution on a new connection to the kernel (at creation, after each
        restart): it takes the lines E2B puts before that execution, does what ``args`` say
        (`_priming_code`), and leaves no trace in the history or the execution count.

        Raises:
            SandboxDiedError: the kernel ended or restarted during it.
            SandboxNotFoundError, SandboxUnavailableError: as for the SDK call.
        """
        with _translated(operation, sandbox_id=self._id):
            execution = await self._sdk.run_code(
                _priming_code(args),
                context=self._context,
                timeout=_OWN_CELL_TIMEOUT_S,
            )
        failed = [line for line in execution.logs.stderr if line.startswith(_HOOKS_FAILED)]
        if failed:
            logger.warning(
                "Sandbox %s: %s; display ids, updates, clear_output and exit() are not seen",
                self._id,
                failed[0].strip(),
            )
        if execution.error is not None:
            self._dead = True
            raise self._died(f"priming its kernel failed: {execution.error.name}")

    @classmethod
    async def attach(cls, handle: SandboxHandle, config: E2BConfig) -> E2BSandbox:
        """Reach a sandbox again by its id, from any task, thread or process.

        Connecting extends the sandbox's lifetime to ``lifetime_s`` from now, if that is later.
        A transient failure (5xx, a dropped connection) is retried ``request_retries`` times.

        Raises:
            SandboxNotFoundError: the sandbox was killed or expired.
            BackendNotInstalledError, SandboxAuthError, SandboxUnavailableError: as for
                `create` (unavailable: after the retries).
        """
        client = config.new_client()
        # Connecting is idempotent (it only extends the lifetime); a kill starts with it, so a
        # transient failure here must not leave a sandbox alive.
        sdk_sandbox = await _retrying(
            config,
            "attach",
            lambda: client.AsyncSandbox.connect(handle.sandbox_id, timeout=config.lifetime_s),
            sandbox_id=handle.sandbox_id,
        )
        return cls(sdk_sandbox, config, handle)

    @classmethod
    async def list_handles(
        cls, config: E2BConfig, labels: Mapping[str, str] | None = None
    ) -> list[SandboxHandle]:
        """Handles of running or paused sandboxes whose metadata includes ``labels``.

        Returns:
            Handles sorted by sandbox id; their code context is found again when first used.

        Raises:
            BackendNotInstalledError, SandboxAuthError, SandboxUnavailableError: as for
                `create`.
        """
        sdk = import_sdk()
        client = config.new_client()
        handles = []
        with _translated("list"):
            paginator = client.AsyncSandbox.list(
                query=sdk.SandboxQuery(metadata=dict(labels or {}))
            )
            while paginator.has_next:
                for info in await paginator.next_items():
                    handles.append(
                        SandboxHandle(
                            backend=BACKEND_SLUG,
                            sandbox_id=info.sandbox_id,
                            workdir=config.workdir,
                            labels=dict(info.metadata or {}),
                        )
                    )
        return sorted(handles, key=lambda handle: handle.sandbox_id)

    # --- cells ---------------------------------------------------------------------------

    async def _code_context(self) -> Any:
        if self._context is not None:
            return self._context
        context_id = self._handle.connection.get("context_id")
        contexts = await self._retrying(
            "run_cell", lambda: self._sdk.list_code_contexts(), in_cell=True
        )
        for context in contexts:
            if context.id == context_id or (
                context_id is None and context.cwd == self._handle.workdir
            ):
                self._context = context
                return context
        raise SandboxDiedError(
            f"sandbox {self._id}: its code context is gone; its state is lost",
            sandbox_id=self._id,
        )

    async def _extend_lifetime(self, *, in_cell: bool) -> None:
        with _translated("extend_lifetime", sandbox_id=self._id, in_cell=in_cell):
            await self._sdk.set_timeout(self._config.lifetime_s)

    def keep_alive_period_s(self) -> float:
        """Half of ``lifetime_s``: `keep_alive` then renews it before it ends."""
        return self._config.lifetime_s / 2

    async def keep_alive(self) -> None:
        """Set the lifetime to ``lifetime_s`` from now (the SDK's ``set_timeout``, E2B's
        ``POST /sandboxes/{id}/timeout``, which sets the end from now, shorter or longer).

        Raises:
            SandboxNotFoundError: the sandbox expired or was killed.
            SandboxUnavailableError: E2B could not be reached.
        """
        await self._extend_lifetime(in_cell=False)

    async def _keep_alive(self) -> None:
        """Extend the lifetime every half lifetime while a cell runs."""
        while True:
            await asyncio.sleep(self._config.lifetime_s / 2)
            try:
                await self._extend_lifetime(in_cell=True)
            except SandboxUnavailableError as exc:
                logger.warning("Sandbox %s: lifetime not extended: %s", self._id, exc)

    async def _prepare_cell(self) -> None:
        self._check_alive()
        if self._interrupted:
            # E2B interrupts late: a cell sent before it lands would be aborted, never answered.
            # Probes tell when it has (beside two CPU burners it landed past a fixed 0.5 s); one
            # still unanswered after the grace leaves the cell to its own deadline.
            self._interrupted = False
            with (
                _translated("run_cell", sandbox_id=self._id, in_cell=True),
                contextlib.suppress(TimeoutError),
            ):
                async with asyncio.timeout(self._config.interrupt_grace_s):
                    await _probe_until_idle(self, await self._code_context())
        await self._extend_lifetime(in_cell=True)

    async def _start_cell(
        self, code: str, outputs: CellOutputs, timeout_s: float | None
    ) -> RunningCell:
        return _E2BCell(self, await self._code_context(), code, outputs)

    def _check_count(self, execution_count: int | None) -> None:
        """A counter that went back means the kernel restarted unseen between two cells."""
        last, self._last_count = self._last_count, execution_count
        if last is not None and execution_count is not None and execution_count <= last:
            self._dead = True
            raise self._died("its kernel restarted since the previous cell")

    def _check_alive(self) -> None:
        if self._dead:
            raise self._died("its kernel died earlier; call restart()")

    def _died(self, how: str) -> SandboxDiedError:
        return SandboxDiedError(
            f"kernel of sandbox {self._id} died ({how}); its state is lost",
            sandbox_id=self._id,
        )

    async def take_late_outputs(self) -> dict[str, list[dict[str, Any]]]:
        """Always empty: E2B's code interpreter drops output that no running cell owns."""
        return {}

    # --- files ---------------------------------------------------------------------------

    async def _retrying(
        self,
        operation: str,
        call: Callable[[], Awaitable[T]],
        *,
        path: str | None = None,
        in_cell: bool = False,
    ) -> T:
        """Run an idempotent call, retrying transient errors (see `_retrying`)."""
        return await _retrying(
            self._config, operation, call, sandbox_id=self._id, path=path, in_cell=in_cell
        )

    def _remote(self, relative: PurePosixPath) -> str:
        return str(PurePosixPath(self._handle.workdir) / relative)

    async def _check_inside(self, path: str, relative: PurePosixPath) -> None:
        """Refuse a path that leaves the working directory through a symlink."""
        workdir = PurePosixPath(self._handle.workdir)
        for depth in range(1, len(relative.parts) + 1):
            remote = str(workdir.joinpath(*relative.parts[:depth]))
            for _ in range(_MAX_SYMLINK_HOPS):
                try:
                    info = await self._retrying(
                        "stat", partial(self._sdk.files.get_info, remote), path=path
                    )
                except FileTransferError:
                    return  # nothing there yet, so nothing below it either
                target = info.symlink_target
                if target is None:
                    break
                resolved = PurePosixPath(remote).parent / target
                if not is_inside(resolved, workdir):
                    raise UnsafePathError(
                        f"path {path!r} resolves outside the working directory (through a symlink)",
                        path=path,
                        sandbox_id=self._id,
                    )
                remote = str(resolved)

    async def upload(self, src: Path, dest: str) -> None:
        """Copy a local file into the working directory (see `Sandbox.upload`).

        Raises:
            UnsafePathError: ``dest`` leaves the working directory.
            FileTransferError: ``src`` is not a file.
            SandboxUnavailableError: E2B stayed unreachable through the retries.
        """
        relative = checked_relative_path(dest)
        checked_upload_source(src, dest)
        await self._check_inside(dest, relative)
        remote = self._remote(relative)

        async def write() -> None:
            with src.open("rb") as data:
                await self._sdk.files.write(remote, data)

        await self._retrying("upload", write, path=dest)

    async def download(self, src: str, dest: Path, *, max_bytes: int | None = None) -> int:
        """Copy a file out of the working directory (see `Sandbox.download`).

        Raises:
            UnsafePathError: ``src`` leaves the working directory (a symlink included).
            FileTransferError: the file is missing, or larger than ``max_bytes`` (the part
                received is left in ``dest``).
            SandboxUnavailableError: E2B stayed unreachable through the retries.
        """
        relative = checked_relative_path(src)
        await self._check_inside(src, relative)
        remote = self._remote(relative)
        dest.parent.mkdir(parents=True, exist_ok=True)

        async def read() -> int:
            size = 0
            stream = await self._sdk.files.read(remote, format="stream")
            async with stream:
                with dest.open("wb") as target:
                    async for chunk in stream:
                        size += len(chunk)
                        check_size(src, size, max_bytes)
                        target.write(chunk)
            return size

        return await self._retrying("download", read, path=src)

    async def list_files(self, pattern: str = "**/*") -> list[RemoteFile]:
        """List files matching a pattern (see `Sandbox.list_files` and `matching_files`).

        Symlinks are listed as found, even ones that point outside; `download` refuses those.
        A name that is not UTF-8 fails envd's listing whole; the folder is then listed by code
        in a code context of its own, and such a name comes with surrogate escapes.
        """
        sdk = import_sdk()
        checked = checked_relative_path(pattern)
        depth = _LIST_DEPTH_ALL if "**" in checked.parts else len(checked.parts)
        workdir = PurePosixPath(self._handle.workdir)
        try:
            entries = await self._retrying(
                "list_files", lambda: self._sdk.files.list(str(workdir), depth=depth)
            )
        except FileTransferError:
            # The cells removed the working directory: nothing matches, as on other backends.
            return []
        except SandboxError as exc:
            if _NOT_UTF8_LISTING not in str(exc):
                raise
            return listed_files(await self._list_by_code(), str(checked))
        # envd's entries carry no inode: a file is known by its path, a link by its target's
        # (envd resolves it), so links to one file are one file; hard links are not told apart.
        found = {}
        for entry in entries:
            if entry.type in (sdk.FileType.FILE, sdk.FileType.SYMLINK):
                path = PurePosixPath(entry.path).relative_to(workdir).as_posix()
                identity = entry.symlink_target or entry.path
                found[path] = RemoteFile(path=path, size_bytes=entry.size, identity=identity)
        return [found[path] for path in matching_files(str(checked), found)]

    async def _list_by_code(self) -> str:
        """Every file and link under the working directory, listed by a code context made for
        it (so the cells' context keeps its execution count and names) and removed after."""
        with _translated("list_files", sandbox_id=self._id):
            context = await self._sdk.create_code_context(
                cwd=self._handle.workdir, language="python"
            )
            try:
                # Relative: the context starts in the working directory.
                execution = await self._sdk.run_code(
                    run_code("listing", "main", {"root": "."}),
                    context=context,
                    timeout=_OWN_CELL_TIMEOUT_S,
                )
            finally:
                await self._sdk.remove_code_context(context)
        if execution.error is not None:
            raise SandboxError(
                f"sandbox {self._id}: listing its files failed: {execution.error.name}: "
                f"{execution.error.value}",
                sandbox_id=self._id,
            )
        return "".join(execution.logs.stdout)

    # --- lifecycle -----------------------------------------------------------------------

    async def interrupt(self) -> None:
        """Interrupt the cell this object is running, by closing its execute stream.

        E2B has no interrupt call: the code interpreter interrupts a cell whose client left,
        late; the next cell is sent once a probe runs (``interrupt_settle_s`` after this call,
        doubling), or ``interrupt_grace_s`` after it when none has. A cell run through another
        attachment is not reached.
        """
        if self._running is not None:
            self._running.cancel()
            self._interrupted = True

    async def restart(self) -> None:
        """Restart the code context: same sandbox and files, variables and imports lost.

        The new kernel is primed (docs/backends/e2b.md): back in the working directory,
        the next cell is ``In[1]``, with nothing of the server's before it.

        Raises:
            SandboxNotFoundError: the sandbox expired or was killed.
            SandboxUnavailableError: E2B stayed unreachable through the retries.
            SandboxDiedError: the new kernel ended while being primed.
        """
        context = await self._code_context()
        await self._retrying("restart", lambda: self._sdk.restart_code_context(context))
        self._dead = False
        self._last_count = None
        await self._prime(_back_to_workdir_args(self._handle.workdir), operation="restart")

    async def kill(self) -> bool:
        """Kill the sandbox. Idempotent; transient failures are retried as file calls are.

        Returns:
            True if this call ended it, False if it was already gone (a retry after a kill
            whose answer was lost finds it gone).

        Raises:
            SandboxAuthError: as for `create`.
            SandboxUnavailableError: E2B stayed unreachable through the retries.
        """
        killed: bool = await self._retrying("kill", self._sdk.kill)
        if killed:
            logger.info("E2B sandbox %s killed", self._id)
        return killed

    async def close(self) -> None:
        """Nothing to release: the SDK's connections are pooled per event loop."""


async def _probe_until_idle(sandbox: E2BSandbox, context: Any) -> Any:
    """Send probes in ``context`` until one runs; returns its ``Execution``.

    Each waits for the interrupt of the last closed stream to have landed. One unanswered
    for as long as that wait was aborted by ipykernel (it came before the interrupt) or
    queued behind a cell still running: it is closed, which interrupts again, and the next
    waits twice as long. One that a late interrupt hit (``KeyboardInterrupt``) found the
    kernel idle; another follows it. Runs until cancelled.
    """
    settle_s = sandbox._config.interrupt_settle_s
    while True:
        await asyncio.sleep(settle_s)
        probe = asyncio.create_task(
            sandbox._sdk.run_code(run_code("forget_cell", "main"), context=context, timeout=0)
        )
        try:
            done, _ = await asyncio.wait({probe}, timeout=settle_s)
        finally:
            if not probe.done():
                await cancel_and_wait(probe)
        if done:
            execution = probe.result()
            if execution.error is None or execution.error.name != "KeyboardInterrupt":
                return execution
        settle_s *= 2


class _E2BCell(RunningCell):
    """A cell as one ``/execute`` stream of the code interpreter.

    Interrupting it closes the stream, which makes the server interrupt the cell; probe cells
    then tell whether the kernel went idle within the grace period (see the module's
    docstring). The lifetime is kept extended while the cell runs.
    """

    def __init__(self, sandbox: E2BSandbox, context: Any, code: str, outputs: CellOutputs) -> None:
        self._sandbox = sandbox
        self._context = context
        self._outputs = outputs
        self._restarted: list[str] = []
        self._exited = False
        self._outcome: dict[str, str] | None = None
        self._probe: asyncio.Task[Any] | None = None

        # Errors the kernel showed, each waiting for the server's error line (it passes on only
        # the first of an execution's: the others are added as they were shown, at the end).
        self._shown_errors: list[dict[str, Any]] = []
        shown_errors = self._shown_errors
        # The server passes on the first error it reads, and may read the execute_reply's before
        # the iopub messages sent ahead of it, our hook's among them: that error waits for the
        # hook's name, value and lines (a reply's own can be ``NoneType: None``, as ipykernel
        # reports an error raised while formatting the cell's value).
        self._pending_errors: list[dict[str, Any]] = []

        def on_error(error: Any) -> None:
            if error.name == _KERNEL_RESTARTED or error.name in _SERVER_LOST_CELL:
                self._restarted.append(error.name)
                return
            content = error_content(error.name, error.value, error.traceback)
            if shown_errors:
                outputs.add("error", {**content, **shown_errors.pop(0)})
            else:
                self._pending_errors.append(content)

        def on_result(result: Any) -> None:
            msg_type, content = result_content(
                mime_bundle(result), is_main_result=result.is_main_result
            )
            if msg_type == TRACEBACK_MSG_TYPE:
                if self._pending_errors:
                    self._pending_errors[-1].update(content)
                    self._add_pending_errors()
                else:
                    shown_errors.append(content)
            elif msg_type == EXIT_MSG_TYPE:
                self._exited = True
            elif msg_type == OUTCOME_MSG_TYPE:
                self._outcome = content
            elif msg_type in COMM_MSG_TYPES:
                outputs.add_comm(content, content["buffers"])
            else:
                outputs.add(msg_type, content)

        self._execution: asyncio.Task[Any] = asyncio.create_task(
            sandbox._sdk.run_code(
                code,
                context=context,
                on_stdout=lambda m: outputs.add("stream", {"name": "stdout", "text": m.line}),
                on_stderr=lambda m: outputs.add("stream", {"name": "stderr", "text": m.line}),
                on_result=on_result,
                on_error=on_error,
                timeout=0,  # no SDK deadline: ours is run_cell's
            )
        )
        sandbox._running = self._execution
        self._keep_alive = asyncio.create_task(sandbox._keep_alive())

    def _add_pending_errors(self) -> None:
        """Add the error still waiting for its traceback lines, with the lines it has, and the
        errors shown that the server passed on no line for."""
        while self._pending_errors:
            self._outputs.add("error", self._pending_errors.pop(0))
        while self._shown_errors:
            self._outputs.add("error", self._shown_errors.pop(0))

    async def wait(self, deadline: float | None) -> bool:
        task = self._probe or self._execution
        timeout_s = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
        return bool(done)

    async def interrupt(self, attempt: int) -> None:
        self._execution.cancel()
        await asyncio.wait({self._execution})
        self._probe = asyncio.create_task(_probe_until_idle(self._sandbox, self._context))

    async def abandon(self) -> None:
        self._sandbox._running = None
        for task in (self._keep_alive, self._execution, self._probe):
            if task is not None:
                await cancel_and_wait(task)
        self._add_pending_errors()

    async def finish(self, *, state_lost: bool) -> CellReply:
        sandbox = self._sandbox
        sandbox._running = None
        self._add_pending_errors()
        await cancel_and_wait(self._keep_alive)
        if state_lost:
            return CellReply()
        execution = None
        if not self._execution.cancelled():
            with _translated("run_cell", sandbox_id=sandbox._id, in_cell=True):
                execution = self._execution.result()
        if self._exited:
            sandbox._dead = True
            raise SandboxDiedError(
                f"kernel of sandbox {sandbox._id} died (the cell called exit()); its state is lost",
                exit_code=0,
                sandbox_id=sandbox._id,
            )
        if self._probe is not None:
            with _translated("run_cell", sandbox_id=sandbox._id, in_cell=True):
                probe = self._probe.result()
            if probe.error is not None:
                self._restarted.append(probe.error.name)
        if self._restarted:
            sandbox._dead = True
            raise sandbox._died(
                "its kernel died and was restarted"
                if self._restarted[0] == _KERNEL_RESTARTED
                else f"the code interpreter lost the cell ({self._restarted[0]})"
            )
        if self._probe is not None:
            # Interrupted at the deadline: the probe took the cell's next number, and gave it back.
            count = self._probe.result().execution_count
            execution_count = None if count is None else count - 1
            sandbox._check_count(execution_count)
            return CellReply(execution_count=execution_count)
        execution_count = execution.execution_count if execution is not None else None
        sandbox._check_count(execution_count)
        if execution is None:
            # The stream was closed by `E2BSandbox.interrupt` from outside, not by a deadline.
            return CellReply(error=CellError(ename="KeyboardInterrupt", evalue="interrupted"))
        if self._outcome is None:  # no hooks in the kernel: judged by the errors that came
            return CellReply(execution_count=execution_count)
        # What the reply said, which the server may have dropped (it stops at the idle status)
        # or stood in for by an error the kernel only showed (a display's failing formatter).
        raised = self._outcome["status"] != "ok"
        error = None
        if raised:
            error = CellError(
                ename=self._outcome.get("ename", "UnknownError"),
                evalue=self._outcome.get("evalue", "the cell failed"),
            )
        return CellReply(execution_count=execution_count, raised=raised, error=error)
