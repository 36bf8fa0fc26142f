"""A code context's connection to its kernel, kept as E2B's code interpreter server keeps it.

The real server (e2b-dev/code-interpreter, ``template/server/messaging.py``) holds one Jupyter
websocket per context and turns the kernel's messages into ``/execute`` lines by rules this
module reproduces, timing and ordering included, over jupyter_client's shell and iopub channels:
env-var lines before the first execution on each connection; an execution ended at the kernel's
``idle`` and what comes after dropped; an ``aborted`` reply that ends nothing; the context's
lock released when the client leaves, before the interrupt lands (``interrupt_delay_s``);
tracebacks joined with ``""``, only the first error, displays as ``result`` lines, updates,
clears and payloads dropped; ``ContextRestarting`` on a kernel restart and
``UnexpectedEndOfExecution`` on a closed connection. The rules in full: docs/development.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import zmq.asyncio
from jupyter_client.asynchronous.client import AsyncKernelClient

from prefect_sandbox.sandbox.errors import SandboxDiedError
from prefect_sandbox.testing.e2b.wire import result_fields

__all__ = ["KEEPALIVE_S", "KernelChannel", "env_code", "first_indent"]

logger = logging.getLogger(__name__)

KEEPALIVE_S = 5.0
"""Seconds of silence after which the server sends a ``keepalive`` line."""

NUDGE_INTERVAL_S = 0.5
"""Seconds between a (re)connection's ``kernel_info`` requests until iopub answers one."""

NUDGE_TIMEOUT_S = 60.0
"""Seconds a (re)connection waits for the kernel's iopub before the kernel counts as dead."""

_END = None


def env_code(env_vars: Mapping[str, str]) -> str:
    """The lines the real server uses to set environment variables in a Python kernel.

    Quoted as the real server quotes them (with no escaping).
    """
    return "\n".join(f"import os; os.environ['{k}'] = '{v}'" for k, v in env_vars.items())


def _unset_code(env_vars: Mapping[str, str], global_env: Mapping[str, str]) -> str:
    # A variable envd also has goes back to envd's value; any other is removed.
    return "\n".join(
        f"import os; os.environ['{k}'] = '{global_env[k]}'"
        if k in global_env
        else f"import os; del os.environ['{k}']"
        for k in env_vars
    )


def first_indent(code: str) -> str:
    """The indentation of the first non-blank line of ``code``."""
    for line in code.split("\n"):
        if line.strip():
            return line[: len(line) - len(line.lstrip())]
    return ""


def _indented(code: str, indent: str) -> str:
    if not indent:
        return code
    return "\n".join(indent + line if line.strip() else line for line in code.split("\n"))


def _error_line(name: str, value: str, traceback: str = "") -> dict[str, Any]:
    return {"type": "error", "name": name, "value": value, "traceback": traceback}


@dataclass
class _Execution:
    queue: asyncio.Queue[dict[str, Any] | None] = field(default_factory=asyncio.Queue)
    background: bool = False
    input_accepted: bool = False
    errored: bool = False
    ended: bool = False
    held_reply: dict[str, Any] | None = None


class KernelChannel:
    """One context's connection to its kernel (the server's ``ContextWebSocket``).

    Args:
        connection_file: the kernel's connection file.
        interrupt: sends SIGINT to the kernel (Jupyter's interrupt).
        envd_envs: envd's ``GET /envs`` answer, asked before the first execution.
        interrupt_delay_s: seconds from a client leaving to its interrupt reaching the kernel.
        reply_after_idle: pass each ``execute_reply`` on after its execution's ``idle``, as
            the real server gets them now and then (two channels over one websocket): the
            execution has ended, so an error in the reply is dropped.
    """

    def __init__(
        self,
        connection_file: Path,
        *,
        interrupt: Callable[[], Any],
        envd_envs: Callable[[], dict[str, str]],
        interrupt_delay_s: float,
        reply_after_idle: bool = False,
    ) -> None:
        self._reply_after_idle = reply_after_idle
        self._interrupt = interrupt
        self._envd_envs = envd_envs
        self._interrupt_delay_s = interrupt_delay_s
        self._client = AsyncKernelClient(connection_file=os.fspath(connection_file))
        self._client.load_connection_file()
        self._client.start_channels(stdin=False, hb=False, control=False)
        self._executions: dict[str, _Execution] = {}
        self._nudges: dict[str, asyncio.Event] = {}
        self._lock = asyncio.Lock()
        self._global_env: dict[str, str] | None = None
        self._cleanup: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[Any]] = set()
        self._readers = [asyncio.create_task(self._read())]

    async def close(self) -> None:
        """Close the connection: running executions end with ``UnexpectedEndOfExecution``."""
        for task in [*self._readers, *self._background]:
            task.cancel()
        if self._cleanup is not None:
            self._cleanup.cancel()
        tasks: list[asyncio.Task[Any]] = [*self._readers, *self._background]
        if self._cleanup is not None:
            tasks.append(self._cleanup)
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._client.stop_channels()
        for execution in self._executions.values():
            execution.queue.put_nowait(
                _error_line(
                    "UnexpectedEndOfExecution",
                    "Connection to the execution was closed before the execution was finished",
                )
            )
            execution.queue.put_nowait(_END)

    async def nudge(self, timeout_s: float = NUDGE_TIMEOUT_S) -> None:
        """Wait until the kernel's iopub messages reach this connection, as Jupyter Server
        does on each (re)connection (``nudge``: ``kernel_info`` requests until one's status
        arrives on iopub). A subscriber that has not joined yet misses what is published, and
        an execution ends only on its ``idle`` status.

        Raises:
            SandboxDiedError: no status came within ``timeout_s`` seconds.
        """
        deadline = asyncio.get_running_loop().time() + timeout_s
        while asyncio.get_running_loop().time() < deadline:
            msg_id: str = self._client.kernel_info()
            seen = self._nudges[msg_id] = asyncio.Event()
            try:
                await asyncio.wait_for(seen.wait(), timeout=NUDGE_INTERVAL_S)
                return
            except TimeoutError:
                continue
            finally:
                self._nudges.pop(msg_id, None)
        raise SandboxDiedError(f"kernel's iopub did not answer within {timeout_s} s")

    def kernel_restarting(self) -> None:
        """What the server does on a ``restarting`` status: end every running execution."""
        for execution in self._executions.values():
            execution.queue.put_nowait(_error_line("ContextRestarting", "Context was restarted"))
            execution.queue.put_nowait(_END)

    # --- executions ----------------------------------------------------------------------

    async def run_background(self, code: str) -> list[dict[str, Any]]:
        """Run the server's own code (``silent``: no execution count, no history).

        Returns:
            The lines it made (errors included).
        """
        msg_id = self._send(code, background=True)
        try:
            return [line async for line in self._lines(msg_id) if line["type"] != "keepalive"]
        finally:
            self._executions.pop(msg_id, None)

    async def execute(
        self, code: str, env_vars: Mapping[str, str]
    ) -> AsyncGenerator[dict[str, Any]]:
        """Run a user's execution; yields its ``/execute`` lines (without the final
        ``end_of_execution``, which the response adds).

        Closing the generator (the client left) releases the context at once and interrupts
        the kernel ``interrupt_delay_s`` later.
        """
        async with self._lock:
            if self._cleanup is not None and not self._cleanup.done():
                with contextlib.suppress(Exception):
                    await self._cleanup
            self._cleanup = None
            prefix = ""
            if self._global_env is None:
                self._global_env = self._envd_envs()
                prefix = env_code(self._global_env)
            own = env_code(env_vars) if env_vars else ""
            if prefix or own:
                env_lines = _indented(prefix + "\n" + own, first_indent(code))
                code = f"{env_lines}\n{code}"
            msg_id = self._send(code, background=False)
            try:
                async for line in self._lines(msg_id):
                    yield line
            except (asyncio.CancelledError, GeneratorExit):
                logger.info("Client left execution %s; interrupting the kernel", msg_id)
                task = asyncio.create_task(self._interrupt_later())
                self._background.add(task)
                task.add_done_callback(self._background.discard)
                raise
            finally:
                self._executions.pop(msg_id, None)
            if env_vars:
                self._cleanup = asyncio.create_task(self._unset(dict(env_vars)))

    async def _unset(self, env_vars: dict[str, str]) -> None:
        code = _unset_code(env_vars, self._global_env or {})
        if code:
            await self.run_background(code)

    async def _interrupt_later(self) -> None:
        await asyncio.sleep(self._interrupt_delay_s)
        with contextlib.suppress(Exception):
            await self._interrupt()

    def _send(self, code: str, *, background: bool) -> str:
        msg_id: str = self._client.execute(
            code,
            silent=background,
            store_history=True,
            user_expressions={},
            allow_stdin=False,
            stop_on_error=True,
        )
        self._executions[msg_id] = _Execution(background=background)
        return msg_id

    async def _lines(self, msg_id: str) -> AsyncIterator[dict[str, Any]]:
        queue = self._executions[msg_id].queue
        while True:
            try:
                line = await asyncio.wait_for(queue.get(), timeout=KEEPALIVE_S)
            except TimeoutError:
                yield {"type": "keepalive"}
                continue
            if line is _END:
                return
            yield line

    # --- the kernel's messages -----------------------------------------------------------

    async def _read(self) -> None:
        """Pass on the kernel's messages in the order it sent them, as they reach the server
        over one websocket: of two sockets ready at once, the shell's (a reply) goes first, as
        the kernel sends a reply before the ``idle`` that follows it."""
        shell, iopub = self._client.shell_channel, self._client.iopub_channel
        poller = zmq.asyncio.Poller()
        for channel in (shell, iopub):
            poller.register(channel.socket, zmq.POLLIN)
        while True:
            ready = dict(await poller.poll())
            for channel in (shell, iopub):
                if channel.socket not in ready:
                    continue
                message = await channel.get_msg()
                try:
                    self._process(message)
                except Exception:
                    logger.exception("E2B emulator: kernel message not handled: %r", message)

    def _process(self, message: dict[str, Any]) -> None:
        parent_id = message["parent_header"].get("msg_id", "")
        if message["msg_type"] == "status" and parent_id in self._nudges:
            self._nudges[parent_id].set()
        execution = self._executions.get(parent_id)
        if execution is None:
            return
        msg_type, content = message["msg_type"], message["content"]
        put = execution.queue.put_nowait
        if msg_type == "error":
            if not execution.errored:
                execution.errored = True
                put(_error_line(content["ename"], content["evalue"], "".join(content["traceback"])))
        elif msg_type == "stream":
            date = message["header"]["date"]
            timestamp = date.isoformat() if isinstance(date, datetime) else str(date)
            put({"type": content["name"], "text": content["text"], "timestamp": timestamp})
        elif msg_type in ("display_data", "execute_result"):
            put(result_fields(dict(content["data"]), is_main_result=msg_type == "execute_result"))
        elif msg_type == "status":
            state = content["execution_state"]
            if state == "busy" and execution.background:
                execution.input_accepted = True
            if state == "idle" and execution.input_accepted:
                put(_END)
                execution.ended = True
                if execution.held_reply is not None:
                    self._process(execution.held_reply)  # lands after the end: never read
        elif (
            msg_type == "execute_reply"
            and self._reply_after_idle
            and not execution.ended
            and execution.held_reply is None
        ):
            execution.held_reply = message
        elif msg_type == "execute_reply":
            status = content["status"]
            if status == "error" and not execution.errored:
                execution.errored = True
                put(
                    _error_line(
                        content.get("ename", ""),
                        content.get("evalue", ""),
                        "".join(content.get("traceback", [])),
                    )
                )
            elif status == "abort":  # never what ipykernel says ("aborted"), as on the server
                put(_error_line("ExecutionAborted", "Execution was aborted"))
                put(_END)
        elif msg_type == "execute_input":
            put({"type": "number_of_executions", "execution_count": content["execution_count"]})
            execution.input_accepted = True
