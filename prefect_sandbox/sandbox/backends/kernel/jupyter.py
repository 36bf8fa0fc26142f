"""`JupyterKernelSandbox`: a kernel reached through a Jupyter connection file on this machine.

This is the half of a kernel backend that talks Jupyter's protocol with jupyter_client: the
start-up handshake, each cell's ``execute_request``, its iopub messages and ``execute_reply``,
and output that earlier cells' threads print later. It assumes nothing about where the kernel
process runs: a subclass launches it, watches it and ends it (`LocalKernelSandbox` on this
machine; a container backend whose connection file and working directory are bind-mounted
folders works the same way).

Kernels write the ``stream`` messages we read; `write_ipython_startup` installs a startup file
that bounds their size (`STREAM_MESSAGE_CHARS`) and keeps a process forked by a cell from
answering for the kernel, for a launcher to put in the kernel's ``IPYTHONDIR``.
Manual: docs/backends/local.md.
"""

from __future__ import annotations

import abc
import asyncio
import functools
import hmac
import logging
import os
import shutil
import stat
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from queue import Empty
from typing import Any, cast

import zmq
from jupyter_client.asynchronous.client import AsyncKernelClient
from jupyter_client.session import Session

from prefect_sandbox.sandbox.backends.kernel.kernel_sockets import (
    check_pinned,
    clear_sockets,
    pin_sockets,
)
from prefect_sandbox.sandbox.backends.kernel.workdir import copy_out, list_workdir
from prefect_sandbox.sandbox.base import (
    CellError,
    CellReply,
    RemoteFile,
    RunningCell,
    Sandbox,
    SandboxConfig,
    SandboxHandle,
)
from prefect_sandbox.sandbox.errors import SandboxDiedError, SandboxError, SandboxNotFoundError
from prefect_sandbox.sandbox.kernel_side import run_code
from prefect_sandbox.sandbox.outputs import (
    COMM_MSG_TYPES,
    OUTPUT_MSG_TYPES,
    CellOutputs,
    OutputCollector,
)
from prefect_sandbox.sandbox.paths import checked_upload_source, resolve_inside

__all__ = [
    "STARTUP_FILE_NAME",
    "STREAM_MESSAGE_CHARS",
    "JupyterKernelConfig",
    "JupyterKernelSandbox",
    "connection_file_of",
    "write_ipython_startup",
]

_LIVENESS_POLL_S = 0.5
_EXIT_WAIT_S = 30.0
_HANDSHAKE_POLL_S = 0.2
_REPLY_WAIT_S = 5.0
# ipykernel publishes the idle status through its IOPub thread, its reply from the main thread:
# on a loaded machine (60 kernels on 2 cores) the idle came over 2 s after the reply with no
# output lost. nbclient waits 4 s (iopub_timeout); we wait longer before calling it lost.
_IDLE_LOST_S = 10.0
# JSON writes a character in at most 6 bytes ("\uXXXX"): an iopub message of more than 6 bytes
# a character of the output cap (or of a stream message, whichever is more) holds more output
# than a cell keeps, so it is counted, never decoded.
_JSON_BYTES_PER_CHAR = 6
_HEADER_BYTES = 64 * 1024
"""Bytes of a header (or parent header) at most that an over-large message is read for."""

logger = logging.getLogger(__name__)

STARTUP_FILE_NAME = "00-prefect-sandbox.py"
"""Our startup file's name in ``profile_default/startup`` (see `write_ipython_startup`)."""

STREAM_MESSAGE_CHARS = 256 * 1024
"""Characters of stdout/stderr after which the kernel sends them as one ``stream`` message."""

# The history is kept in memory, as nbclient and papermill keep theirs: IPython's SQLite file
# costs a commit per cell (~1 ms of a 4 ms trivial cell here), and a sandbox's history is never
# read after it ends. IPython runs its config file with get_config() in its namespace.
_HISTORY_IN_MEMORY = 'get_config().HistoryManager.hist_file = ":memory:"\n'


@functools.cache
def _startup_code() -> str:
    """Our startup file: bounded ``stream`` messages and the fork guard (kernel_side/)."""
    bound = run_code("stream_bound", "main", {"limit": STREAM_MESSAGE_CHARS})
    return bound + run_code("fork_guard", "main")


def write_ipython_startup(ipython_dir: Path) -> list[Path]:
    """Put our kernel config and startup file in a kernel's ``IPYTHONDIR``.

    The config file lifts the iopub send limit (no output is dropped for a slow reader); the
    startup file bounds the size of each ``stream`` message (`STREAM_MESSAGE_CHARS`), and
    makes a process forked by a cell send outputs only and stop where its copy of the cell
    ends (else it sends the cell's idle status, and spins as a kernel nothing can reach). The
    kernel may write that folder, so nothing in it is followed or written through: each
    folder is opened from its parent without following links, each file is removed and made
    anew (never writing into a link, or a hard link, the kernel left there), and a link or
    other file found where our folder or file goes is removed and reported. What else the
    folder holds (history, the user's own startup files) stays.

    Args:
        ipython_dir: the folder; made if missing.

    Returns:
        The paths where something other than a folder or a regular file stood (a link planted
        from inside the sandbox), each removed; empty when there was none.
    """
    ipython_dir.mkdir(parents=True, exist_ok=True)
    replaced: list[Path] = []
    folder = os.open(ipython_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        profile = _own_folder(folder, ipython_dir / "profile_default", replaced)
        try:
            startup = _own_folder(profile, ipython_dir / "profile_default" / "startup", replaced)
            try:
                startup_file = ipython_dir / "profile_default" / "startup" / STARTUP_FILE_NAME
                _own_file(startup, startup_file, _startup_code(), replaced)
            finally:
                os.close(startup)
            config_file = ipython_dir / "profile_default" / "ipython_kernel_config.py"
            _own_file(
                profile, config_file, _HISTORY_IN_MEMORY + run_code("zmq_config", "main"), replaced
            )
        finally:
            os.close(profile)
    finally:
        os.close(folder)
    return replaced


def _remove_entry(parent: int, path: Path) -> None:
    """Remove ``path``, an entry of the folder ``parent`` is open on, never following a link."""
    if stat.S_ISDIR(os.stat(path.name, dir_fd=parent, follow_symlinks=False).st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path.name, dir_fd=parent)


def _own_folder(parent: int, path: Path, replaced: list[Path]) -> int:
    """Open the folder ``path`` (an entry of ``parent``) without following links, making it if
    need be; anything else standing there is removed first and recorded in ``replaced``."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
    try:
        return os.open(path.name, flags, dir_fd=parent)
    except FileNotFoundError:
        pass
    except OSError:  # a link (ELOOP) or a file (ENOTDIR)
        replaced.append(path)
        _remove_entry(parent, path)
    os.mkdir(path.name, 0o755, dir_fd=parent)
    return os.open(path.name, flags, dir_fd=parent)


def _own_file(parent: int, path: Path, text: str, replaced: list[Path]) -> None:
    """Write the file ``path`` (an entry of ``parent``) anew (see `write_ipython_startup`)."""
    try:
        mode = os.stat(path.name, dir_fd=parent, follow_symlinks=False).st_mode
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISREG(mode):
            replaced.append(path)
        _remove_entry(parent, path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
    with open(os.open(path.name, flags, 0o644, dir_fd=parent), "w", encoding="utf-8") as file:
        file.write(text)


def connection_file_of(handle: SandboxHandle) -> Path:
    """The host's copy of a sandbox's kernel connection file: ``connection.json`` in the
    ``runtime_dir`` its handle's ``connection`` names (local and Docker sandboxes)."""
    return Path(handle.connection["runtime_dir"]) / "connection.json"


@dataclass(frozen=True, kw_only=True)
class JupyterKernelConfig(SandboxConfig):
    """Settings of kernels reached through a connection file (besides `SandboxConfig`'s).

    Attributes:
        startup_timeout_s: seconds a kernel may take to start and answer.
    """

    startup_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_positive("startup_timeout_s")


def _asked_to_exit(reply: dict[str, Any]) -> bool:
    """Whether IPython's ``exit()`` ran: ipykernel adds an ``ask_exit`` payload to the reply."""
    return any(
        item.get("source") == "ask_exit" and not item.get("keepkernel")
        for item in reply.get("payload", [])
    )


def _new_client(connection_file: Path) -> AsyncKernelClient:
    client = AsyncKernelClient()
    # Past 1,000 queued messages zmq DROPS iopub messages for a slow reader (one that logs each
    # output), the closing idle status among them. Unlimited: our side queues them all instead.
    client.context.setsockopt(zmq.RCVHWM, 0)
    try:
        client.load_connection_file(str(connection_file))
        client.start_channels(shell=True, iopub=True, stdin=False, hb=False, control=False)
    except BaseException:
        # The context (and any socket opened in it) is ours: the garbage collector would
        # destroy it with a ResourceWarning (a connection file removed, a kernel gone).
        client.context.destroy(linger=0)
        raise
    return client


class JupyterKernelSandbox(Sandbox):
    """A sandbox whose kernel is reached through a Jupyter connection file on this machine.

    A subclass owns the kernel process: it provides the factories (`Sandbox.create`,
    `Sandbox.attach`, `Sandbox.list_handles`), `_check_alive`, `interrupt`, `restart` (which
    ends with `_reconnect`) and `kill`. This class drives the kernel and the working directory,
    which is a folder on this machine.

    The kernel's IPC sockets are reached only through links pinned in a folder of the host's
    (`kernel.kernel_sockets`): ``connection_file`` names that
    folder, and `_handshake` pins the sockets there first if need be. A subclass that starts
    a kernel again on the same sockets calls `_clear_sockets` while none runs.

    Args:
        handle: the sandbox's handle.
        config: its settings.
        connection_file: the host's connection file, naming the pinned sockets.
        workdir: the working directory, as a path on this machine.
        kernel_sockets: the IPC prefix the kernel binds, as a path on this machine.
        socket_owner: the host uid the kernel runs as (its sockets are that user's).
    """

    _config: JupyterKernelConfig

    def __init__(
        self,
        handle: SandboxHandle,
        config: JupyterKernelConfig,
        connection_file: Path,
        workdir: Path,
        *,
        kernel_sockets: Path,
        socket_owner: int,
    ) -> None:
        self._handle = handle
        self._config = config
        self._connection_file = connection_file
        self._workdir = workdir
        self._kernel_sockets = kernel_sockets
        self._socket_owner = socket_owner
        self._client = _new_client(connection_file)
        self._ready = False
        self._exit_called = False
        self._late: dict[str, OutputCollector] = {}
        cap = config.max_output_chars
        self._iopub_bytes_bound = (
            None if cap is None else _JSON_BYTES_PER_CHAR * max(cap, STREAM_MESSAGE_CHARS)
        )

    @property
    def handle(self) -> SandboxHandle:
        """The address of this sandbox (see `SandboxHandle`)."""
        return self._handle

    @abc.abstractmethod
    async def _check_alive(self, reason: str | None = None) -> None:
        """Raise `SandboxDiedError` if the kernel process has ended; ``reason`` says why.

        A check that asks a daemon or waits on anything runs in a thread: the event loop it
        is awaited on also reads other sandboxes' output (a sweep's branches share one).
        """

    @staticmethod
    def _check_connection_file(handle: SandboxHandle) -> None:
        """Refuse to attach to a sandbox whose connection file (`connection_file_of`) is gone.

        Raises:
            SandboxNotFoundError: it was killed, or never made on this machine.
        """
        if not connection_file_of(handle).exists():
            raise SandboxNotFoundError(
                f"sandbox {handle.sandbox_id} is gone (killed, or never made on this machine)",
                sandbox_id=handle.sandbox_id,
            )

    def _kernel_died(
        self,
        *,
        exit_code: int | None,
        signal: int | None,
        cause: str | None = None,
        reason: str | None = None,
    ) -> SandboxDiedError:
        """The error for a kernel process that ended, for `_check_alive` to raise.

        Args:
            exit_code: its exit status, when it exited.
            signal: the signal that ended it, when one did.
            cause: what the launcher knows ended it (e.g. out of memory).
            reason: what the caller knows led to it (e.g. the cell called ``exit()``).
        """
        how = f"signal {signal}" if signal else f"exit code {exit_code}"
        for before in (cause, reason):
            if before:
                how = f"{before}, {how}"
        return SandboxDiedError(
            f"kernel of sandbox {self._handle.sandbox_id} died ({how}); its state is lost",
            exit_code=exit_code,
            signal=signal,
            sandbox_id=self._handle.sandbox_id,
        )

    # --- cells -----------------------------------------------------------------------------

    async def _prepare_cell(self) -> None:
        await self._check_alive()
        if self._exit_called:
            raise self._still_ending()
        if not self._ready:
            await self._handshake()

    async def _start_cell(
        self, code: str, outputs: CellOutputs, timeout_s: float | None
    ) -> RunningCell:
        msg_id = self._client.execute(
            code, store_history=True, allow_stdin=False, stop_on_error=False
        )
        return _KernelCell(self, msg_id, outputs)

    async def _next_iopub(self, timeout_s: float) -> dict[str, Any]:
        """The next iopub message, as jupyter_client's ``get_iopub_msg`` gives it, but with
        host memory bounded: a message whose header, metadata, content and buffers pass 6
        bytes a character of the output cap (`_JSON_BYTES_PER_CHAR`) is not decoded; it comes
        with ``content`` None and its size in ``unread_bytes``, for the cell to count as
        omitted. An ``error`` is decoded whatever its size (errors are never dropped).

        Raises:
            Empty: none arrived within ``timeout_s`` seconds.
            ValueError: the message's signature is wrong (as jupyter_client).
        """
        channel = self._client.iopub_channel
        socket = channel.socket
        assert socket is not None
        if not await socket.poll(int(timeout_s * 1000)):
            raise Empty
        session: Session = channel.session
        # Frames stay zmq's: nothing of an over-large message is copied but its headers.
        _, received = session.feed_identities(await socket.recv_multipart(copy=False), copy=False)
        frames = cast(list[zmq.Frame], received)
        size = sum(len(frame) for frame in frames[1:])
        bound = self._iopub_bytes_bound
        if bound is None or size <= bound or len(frames) < 5:
            return session.deserialize(frames, copy=False)
        header, parent = (
            session.unpack(frame.bytes) if len(frame) <= _HEADER_BYTES else {}
            for frame in frames[1:3]
        )
        if header.get("msg_type") == "error":
            return session.deserialize(frames, copy=False)
        if session.auth is not None and not hmac.compare_digest(
            frames[0].bytes, session.sign([frame.buffer for frame in frames[1:5]])
        ):
            raise ValueError("Invalid Signature on an iopub message")
        return {
            "header": header,
            "parent_header": parent,
            "msg_type": header.get("msg_type"),
            "content": None,
            "unread_bytes": size,
        }

    def _keep_late_output(self, msg: dict[str, Any]) -> None:
        """Keep output that an earlier cell's background thread printed after that cell ended."""
        parent_id = msg["parent_header"].get("msg_id")
        msg_type = msg["header"].get("msg_type", "")
        if parent_id and msg_type in OUTPUT_MSG_TYPES:
            collector = self._late.setdefault(
                parent_id, OutputCollector(self._config.max_output_chars)
            )
            if msg["content"] is None:
                collector.omit_unread(msg_type, msg["unread_bytes"])
            else:
                collector.add(msg_type, msg["content"])

    async def take_late_outputs(self) -> dict[str, list[dict[str, Any]]]:
        """Output printed by earlier cells' background threads after those cells ended.

        Drains what the kernel has sent so far without waiting.

        Returns:
            The earlier cell's ``CellResult.msg_id`` to its late outputs, in order; each id
            appears once, so every late output is reported exactly once.
        """
        while True:
            try:
                msg = await self._next_iopub(0)
            except Empty:
                break
            self._keep_late_output(msg)
        late = {msg_id: collector.outputs for msg_id, collector in self._late.items()}
        self._late.clear()
        return late

    async def _wait_for_exit(self) -> None:
        """The cell called ``exit()``: wait for the kernel to end, then report it.

        A kernel still running `_EXIT_WAIT_S` seconds later (a machine under load) is reported
        as ended all the same: its event loop has stopped, so it takes no more cells, and only
        `restart` gives a kernel again.

        Raises:
            SandboxDiedError: always, with the exit status once the process has ended.
        """
        self._exit_called = True
        deadline = time.monotonic() + _EXIT_WAIT_S
        while time.monotonic() < deadline:
            await self._check_alive("the cell called exit()")
            await asyncio.sleep(0.02)
        raise self._still_ending()

    def _still_ending(self) -> SandboxDiedError:
        return SandboxDiedError(
            f"kernel of sandbox {self._handle.sandbox_id} died (the cell called exit(), and "
            f"its process had not ended {_EXIT_WAIT_S:g} s later); its state is lost",
            sandbox_id=self._handle.sandbox_id,
        )

    async def _poll_execute_reply(self, msg_id: str) -> dict[str, Any] | None:
        """The cell's ``execute_reply`` if it has arrived, without waiting; else None."""
        return await self._wait_execute_reply(msg_id, 0)

    async def _wait_execute_reply(
        self, msg_id: str, timeout_s: float = _LIVENESS_POLL_S
    ) -> dict[str, Any] | None:
        """The cell's ``execute_reply`` if it arrives within ``timeout_s`` seconds; else None.

        The kernel sends it on another socket than its idle status, so it may reach us later.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                reply: dict[str, Any] = await self._client.get_shell_msg(
                    timeout=max(deadline - time.monotonic(), 0.0)
                )
            except Empty:
                return None
            if reply["parent_header"].get("msg_id") == msg_id:
                return reply

    async def _language_info(self) -> dict[str, Any]:
        """The kernel's ``language_info``, from its answer to a kernel_info request."""
        reply = await self._shell_reply(self._client.kernel_info(), "kernel_info_reply")
        return dict(reply["content"].get("language_info") or {})

    async def _shell_reply(self, msg_id: str, kind: str) -> dict[str, Any]:
        """The reply (of type ``kind``) to request ``msg_id``, within `_REPLY_WAIT_S`."""
        deadline = time.monotonic() + _REPLY_WAIT_S
        while True:
            try:
                reply: dict[str, Any] = await self._client.get_shell_msg(timeout=_LIVENESS_POLL_S)
            except Empty:
                await self._check_alive()
                if time.monotonic() >= deadline:
                    raise SandboxError(
                        f"sandbox {self._handle.sandbox_id}: kernel sent no {kind} within "
                        f"{_REPLY_WAIT_S} s",
                        sandbox_id=self._handle.sandbox_id,
                    ) from None
                continue
            if reply["parent_header"].get("msg_id") == msg_id:
                return reply

    async def _pin_sockets(self) -> None:
        """Pin the kernel's sockets (see `kernel_sockets`) unless they are already pinned.

        Raises:
            SandboxDiedError: the kernel ended, or made no sockets in time.
            UnsafePathError: a socket was replaced from inside the sandbox.
        """
        connection = self._client.get_connection_info()
        pinned = Path(str(connection["ip"]))
        try:
            check_pinned(pinned, connection, self._socket_owner, self._handle.sandbox_id)
            return
        except FileNotFoundError:
            pass
        await pin_sockets(
            self._kernel_sockets,
            pinned,
            connection,
            owner_uid=self._socket_owner,
            sandbox_id=self._handle.sandbox_id,
            check_alive=self._check_alive,
            timeout_s=self._config.startup_timeout_s,
        )
        # The client's first connects found no socket; zmq would retry only in 100 ms.
        await self.close()
        self._client = _new_client(self._connection_file)

    def _clear_sockets(self) -> None:
        """Remove the kernel's sockets and their pinned links: call while no kernel runs."""
        connection = self._client.get_connection_info()
        clear_sockets([self._kernel_sockets, Path(str(connection["ip"]))], connection)

    async def _handshake(self) -> None:
        """Wait until the kernel answers and our iopub subscription receives its messages."""
        deadline = time.monotonic() + self._config.startup_timeout_s
        await self._pin_sockets()
        while time.monotonic() < deadline:
            await self._check_alive()
            msg_id = self._client.kernel_info()
            try:
                while True:
                    msg = await self._next_iopub(_HANDSHAKE_POLL_S)
                    if msg["parent_header"].get("msg_id") == msg_id:
                        self._ready = True
                        return
            except Empty:
                continue
        raise SandboxDiedError(
            f"kernel of sandbox {self._handle.sandbox_id} did not answer within "
            f"{self._config.startup_timeout_s} s",
            sandbox_id=self._handle.sandbox_id,
        )

    async def _reconnect(self) -> None:
        """Connect afresh to a kernel started again on the same connection file."""
        await self.close()
        self._client = _new_client(self._connection_file)
        self._ready = False
        self._exit_called = False
        await self._handshake()

    async def close(self) -> None:
        """Close this process's sockets to the kernel; the kernel keeps running."""
        if self._client.channels_running:
            self._client.stop_channels()

    # --- files -----------------------------------------------------------------------------

    async def upload(self, src: Path, dest: str) -> None:
        """Copy a local file into the working directory (see `Sandbox.upload`)."""
        target = resolve_inside(self._workdir, dest)
        checked_upload_source(src, dest)
        target.parent.mkdir(parents=True, exist_ok=True)
        await asyncio.to_thread(shutil.copyfile, src, target)

    async def download(self, src: str, dest: Path, *, max_bytes: int | None = None) -> int:
        """Copy a file out of the working directory (see `Sandbox.download`).

        The kernel may be changing the folder meanwhile: no link is followed by name and what
        is opened is checked before it is read (`kernel.workdir.copy_out`).
        A link is resolved by hand, inside the working directory only.
        """
        return await asyncio.to_thread(
            copy_out,
            self._workdir,
            src,
            dest,
            sandbox_root=PurePosixPath(self._handle.workdir),
            max_bytes=max_bytes,
        )

    async def list_files(self, pattern: str = "**/*") -> list[RemoteFile]:
        """List what a pattern matches (see `Sandbox.list_files` and `matching_files`).

        Links and special files are listed as found, so that `download` refuses them by name;
        a folder that is a link is never entered.
        """
        return await asyncio.to_thread(
            list_workdir, self._workdir, pattern, PurePosixPath(self._handle.workdir)
        )


class _KernelCell(RunningCell):
    """A cell sent as an ``execute_request``: its iopub messages until the kernel goes idle,
    then its ``execute_reply``. Messages of earlier cells are kept as late output."""

    def __init__(self, sandbox: JupyterKernelSandbox, msg_id: str, outputs: CellOutputs) -> None:
        self._sandbox = sandbox
        self._msg_id = msg_id
        self._outputs = outputs
        self._reply: dict[str, Any] | None = None
        self._idle_seen = False
        self._last_message_at = time.monotonic()

    async def wait(self, deadline: float | None) -> bool:
        sandbox = self._sandbox
        while True:
            if deadline is not None and time.monotonic() >= deadline:
                self._reply = self._reply or await sandbox._poll_execute_reply(self._msg_id)
                if self._reply is None:
                    return False
                # The cell ended in time; only its output is still on its way to us.
                deadline = None
            wait_s = _LIVENESS_POLL_S
            if deadline is not None:
                wait_s = min(wait_s, max(deadline - time.monotonic(), 0.0))
            try:
                # Outputs held for a slow callback are handed over whenever the queue is empty.
                timeout_s = 0 if self._outputs.held else wait_s
                msg = await sandbox._next_iopub(timeout_s)
            except Empty:
                if self._outputs.held:
                    self._outputs.flush()
                    continue
                await sandbox._check_alive()
                self._reply = self._reply or await sandbox._poll_execute_reply(self._msg_id)
                if self._reply is not None and self._idle_seen:
                    return True
                idle_s = time.monotonic() - self._last_message_at
                if self._reply is not None and idle_s > _IDLE_LOST_S:
                    logger.warning(
                        "Sandbox %s: the kernel replied but sent no idle status within %.0f s "
                        "of its last message; some output of the cell may be missing",
                        sandbox.handle.sandbox_id,
                        _IDLE_LOST_S,
                    )
                    return True
                continue
            self._last_message_at = time.monotonic()
            if msg["parent_header"].get("msg_id") != self._msg_id:
                sandbox._keep_late_output(msg)
                continue
            msg_type = msg["header"].get("msg_type", "")
            content = msg["content"]
            if content is None:
                self._outputs.omit_unread(msg_type, msg["unread_bytes"])
                continue
            if msg_type == "status" and content["execution_state"] == "idle":
                # A process that holds the kernel's sockets (a forked copy of it) can send the
                # cell's idle while the kernel still runs it: the cell ends with its reply.
                self._idle_seen = True
                self._reply = self._reply or await sandbox._wait_execute_reply(self._msg_id)
                if self._reply is not None:
                    return True
                continue
            if msg_type in COMM_MSG_TYPES:
                self._outputs.add_comm(content, msg.get("buffers") or [])
            self._outputs.add(msg_type, content, hold=True)

    async def interrupt(self, attempt: int) -> None:
        await self._sandbox.interrupt()

    async def abandon(self) -> None:
        """Nothing waits in the background: reading happens only inside `wait`."""

    async def finish(self, *, state_lost: bool) -> CellReply:
        if state_lost:
            return CellReply(msg_id=self._msg_id)
        sandbox = self._sandbox
        message = self._reply or await sandbox._shell_reply(self._msg_id, "execute_reply")
        reply = message["content"]
        if _asked_to_exit(reply):
            await sandbox._wait_for_exit()
        raised = reply.get("status") != "ok"
        error = None
        if raised:
            error = CellError(
                ename=reply.get("ename", "UnknownError"),
                evalue=reply.get("evalue", f"execute_reply status {reply.get('status')!r}"),
                traceback=reply.get("traceback", []),
            )
        return CellReply(
            execution_count=reply.get("execution_count"),
            raised=raised,
            error=error,
            msg_id=self._msg_id,
        )
