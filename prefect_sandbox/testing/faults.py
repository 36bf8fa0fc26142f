"""The faults both emulators inject, and the record of the requests they receive.

One vocabulary for the E2B and Daytona emulators. A `Fault` names the call it hits (each
emulator lists its names in ``OPERATIONS``; calls both vendors have share a name) and what goes
wrong: an HTTP status instead of an answer (with or without ``Retry-After``), or after the call
was served; a slow answer (``delay_s``); a dropped connection (``drop``); a WebSocket closed
before the code runs (``close_code``); an interrupt from outside the client some seconds into a
code execution (``interrupt_after_s``). Expiry is not a fault but an emulator call (``expire``);
rate limits and quotas are the emulators' ``limits`` option (`prefect_sandbox.testing.limits`).
`FaultBook` holds the faults waiting to hit and the `RequestRecord` of every request;
`serve_with_fault` plays one fault on one ASGI request, for both emulators. Manual:
docs/development.md.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = [
    "COMMON_OPERATIONS",
    "INTERRUPT_AFTER_S_KEY",
    "ErrorBody",
    "Fault",
    "FaultBook",
    "RequestRecord",
    "abort_connection",
    "serve_with_fault",
]

COMMON_OPERATIONS = frozenset(
    {
        "create",
        "delete",
        "list",
        "upload",
        "download",
        "list_files",
        "create_context",
        "delete_context",
        "run_code",
    }
)
"""Calls both vendors have, named alike in both emulators."""

INTERRUPT_AFTER_S_KEY = "prefect_sandbox.interrupt_after_s"
"""The ASGI scope key that tells an emulator's code execution when to interrupt its
interpreter (`Fault.interrupt_after_s`)."""

ErrorBody = Callable[[int], dict[str, Any]]
"""Makes the JSON body of an injected error answer from its HTTP status."""


@dataclass
class Fault:
    """A failure for the next calls of one operation.

    Attributes:
        operation: the call it hits (one of the emulator's ``OPERATIONS``).
        status: answer with this HTTP status (429, 500, 502, 503, 504...) instead of serving
            the call; a WebSocket upgrade is refused with it.
        retry_after_s: with ``status``, the ``Retry-After`` header, in seconds.
        after_call: with ``status``, serve the call first, then answer with the status.
        delay_s: seconds to wait before serving the call (a slow API).
        drop: serve the call (for code: start it), then drop the connection without an
            answer, as a connection reset after the request was sent.
        close_code: for a WebSocket call: take the request, then close with this code
            without running it. Daytona's daemon closes with 4008 when its interpreter says
            an execution was interrupted, and so before the code runs when the interrupt lands
            as the execution starts.
        interrupt_after_s: for ``run_code``: run the code and, this many seconds in,
            interrupt the interpreter from outside (a SIGINT to Daytona's interpreter process,
            Jupyter's interrupt to E2B's kernel), as another process or client would; the
            server answers as it does then (Daytona: close 4008 when the KeyboardInterrupt
            leaves the code, 1000 with an ``error`` frame when the code caught it).
        times: how many calls it hits; None for every one until cleared.

    Raises:
        ValueError: ``times`` is below 1, ``after_call`` comes without ``status``, or
            ``interrupt_after_s`` is negative or given for another call than ``run_code``.
    """

    operation: str
    status: int | None = None
    retry_after_s: float | None = None
    after_call: bool = False
    delay_s: float = 0.0
    drop: bool = False
    close_code: int | None = None
    interrupt_after_s: float | None = None
    times: int | None = 1

    def __post_init__(self) -> None:
        if self.times is not None and self.times < 1:
            raise ValueError(f"times must be at least 1 or None, not {self.times}")
        if self.after_call and self.status is None:
            raise ValueError("after_call needs a status to answer with")
        if self.interrupt_after_s is not None and (
            self.interrupt_after_s < 0 or self.operation != "run_code"
        ):
            raise ValueError("interrupt_after_s is zero or more seconds, for run_code only")


@dataclass(frozen=True)
class RequestRecord:
    """One request an emulator received.

    Attributes:
        operation: the call, one of the emulator's ``OPERATIONS`` (None for an unknown path).
        method: the HTTP method (``GET`` for a WebSocket).
        path: the path, without the query.
        at: ``time.monotonic()`` when it arrived.
        sandbox_id: the sandbox it concerns, when it names one.
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


class FaultBook:
    """Faults waiting to hit, and the requests seen; safe to use from any thread.

    Args:
        operations: the calls faults may name.
        websocket_operations: those served over a WebSocket (the only ones ``close_code``
            applies to).
    """

    def __init__(
        self, operations: Collection[str], websocket_operations: Collection[str] = ()
    ) -> None:
        self.operations = frozenset(operations)
        self.websocket_operations = frozenset(websocket_operations)
        self._lock = threading.Lock()
        self._faults: list[Fault] = []
        self._requests: list[RequestRecord] = []
        self.hits: list[str] = []
        """Operations a fault hit, in order."""

    def add(self, *faults: Fault) -> None:
        """Queue faults; faults of one operation hit in the order they were added.

        Raises:
            ValueError: a fault names an unknown operation, or a ``close_code`` for a call
                that is not a WebSocket.
        """
        for fault in faults:
            if fault.operation not in self.operations:
                raise ValueError(
                    f"unknown operation {fault.operation!r}; one of {sorted(self.operations)}"
                )
            if fault.close_code is not None and fault.operation not in self.websocket_operations:
                raise ValueError(f"close_code only applies to {sorted(self.websocket_operations)}")
        with self._lock:
            self._faults.extend(faults)

    def clear(self) -> None:
        """Drop every waiting fault."""
        with self._lock:
            self._faults.clear()

    def take(self, operation: str | None) -> Fault | None:
        """The fault hitting this call of ``operation``, if any (used up one time)."""
        with self._lock:
            for fault in self._faults:
                if fault.operation == operation:
                    if fault.times is not None:
                        fault.times -= 1
                        if fault.times == 0:
                            self._faults.remove(fault)
                    self.hits.append(operation)
                    return fault
        return None

    def record(
        self,
        scope: Scope,
        operation: str | None,
        sandbox_id: str | None,
        faulted: bool,
    ) -> None:
        """Note a request (see `RequestRecord`)."""
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        record = RequestRecord(
            operation=operation,
            method=scope.get("method", "GET"),
            path=scope["path"],
            at=time.monotonic(),
            sandbox_id=sandbox_id,
            faulted=faulted,
            headers=headers,
        )
        with self._lock:
            self._requests.append(record)

    @property
    def requests(self) -> list[RequestRecord]:
        """Every request recorded so far, oldest first."""
        with self._lock:
            return list(self._requests)


async def serve_with_fault(
    fault: Fault,
    app: ASGIApp,
    scope: Scope,
    receive: Receive,
    send: Send,
    *,
    error_body: ErrorBody,
) -> None:
    """Serve one request (HTTP, or a WebSocket whose connect message is still unread) as the
    fault says.

    Args:
        fault: what goes wrong.
        app: the app that serves the call when it is served.
        scope, receive, send: the request's ASGI triple.
        error_body: the JSON body of an answer with the fault's status.
    """
    websocket = scope["type"] == "websocket"
    await asyncio.sleep(fault.delay_s)
    if fault.status is not None and not fault.after_call:
        await _answer_status(fault, send, websocket, error_body)
        return
    if fault.close_code is not None:
        await receive()  # websocket.connect
        await send({"type": "websocket.accept"})
        await receive()  # the execution request, never run
        await send({"type": "websocket.close", "code": fault.close_code, "reason": ""})
        return
    if fault.drop and websocket:
        await app(scope, _drop_after_request(receive, send), send)
        return
    if fault.interrupt_after_s is not None:
        scope[INTERRUPT_AFTER_S_KEY] = fault.interrupt_after_s
    if fault.drop or fault.after_call:
        await app(scope, receive, _swallow)
        if fault.drop:
            abort_connection(send)
        else:
            await _answer_status(fault, send, websocket, error_body)
        return
    await app(scope, receive, send)


async def _answer_status(fault: Fault, send: Send, websocket: bool, error_body: ErrorBody) -> None:
    assert fault.status is not None
    payload = json.dumps(error_body(fault.status)).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(payload)).encode()),
    ]
    if fault.retry_after_s is not None:
        headers.append((b"retry-after", f"{fault.retry_after_s:g}".encode()))
    prefix = "websocket.http.response" if websocket else "http.response"
    await send({"type": f"{prefix}.start", "status": fault.status, "headers": headers})
    await send({"type": f"{prefix}.body", "body": payload})


async def _swallow(message: Message) -> None:
    """An ASGI send that discards the app's answer."""


def abort_connection(send: Send) -> None:
    """Drop the TCP connection under an ASGI ``send`` without answering (uvicorn only).

    Raises:
        RuntimeError: the server does not expose its transport.
    """
    protocol = getattr(send, "__self__", None)
    transport = getattr(protocol, "transport", None)
    if transport is None:
        raise RuntimeError("this server does not let the emulator drop a connection")
    transport.abort()


def _drop_after_request(receive: Receive, send: Send) -> Callable[[], Awaitable[Message]]:
    """A receive that drops the connection once the WebSocket request is in the app's hands."""

    async def wrapped() -> Message:
        message = await receive()
        if message["type"] == "websocket.receive":
            asyncio.get_running_loop().call_soon(abort_connection, send)
        return message

    return wrapped
