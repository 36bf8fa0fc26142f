"""`LocalKernelSandbox`: an ipykernel on this machine, driven through jupyter_client.

The kernel is launched with jupyter_client's launcher in a new process session, talks over IPC
sockets (unique per kernel, so many kernels never clash on TCP ports), starts in the sandbox's
working directory with no stdin and only an allow-list of the host's environment, and exits on
its own when the process that started it dies (ipykernel's parent poller, via ``JPY_PARENT_PID``,
or bwrap's ``--die-with-parent``; and a guard process for the kernel's children). By default
it runs under bubblewrap (`prefect_sandbox.sandbox.isolation`).

Everything needed to reach a kernel again lives in its runtime folder (connection file, pid,
labels), so ``attach(handle)`` works from another thread or another process on this machine.
The folder is private (mode 0700) and removed at kill; an isolated kernel sees of it only its
connection file (read-only), its sockets' folder and its IPython folder.
The folder also holds the kernel's own IPython folder (``IPYTHONDIR``), whose startup file bounds
the size of each ``stream`` message (`STREAM_MESSAGE_CHARS`); a user's ``IPYTHONDIR`` in the
configured env replaces it, and that bound with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from queue import Empty
from typing import Any, Literal

import zmq
from jupyter_client.asynchronous.client import AsyncKernelClient
from jupyter_client.connect import write_connection_file
from jupyter_client.kernelspec import KernelSpec, KernelSpecManager, NoSuchKernel
from jupyter_client.launcher import launch_kernel

from prefect_sandbox.sandbox.base import (
    CellError,
    CellResult,
    KernelInfo,
    OutputCallback,
    RemoteFile,
    Sandbox,
    SandboxConfig,
    SandboxHandle,
    checked_timeout_s,
    is_python_language,
)
from prefect_sandbox.sandbox.errors import (
    FileTransferError,
    SandboxDiedError,
    SandboxError,
    SandboxNotFoundError,
)
from prefect_sandbox.sandbox.isolation import (
    ISOLATION_LEVELS,
    SANDBOX_ENV,
    Isolation,
    bwrap_command,
    check_bwrap,
    limited_command,
    sandbox_view,
)
from prefect_sandbox.sandbox.outputs import (
    OUTPUT_MSG_TYPES,
    OutputCollector,
    merged_streams,
)
from prefect_sandbox.sandbox.paths import checked_relative_path, resolve_inside

__all__ = ["HOST_ENV_ALLOW_LIST", "LocalKernelConfig", "LocalKernelSandbox"]

BACKEND_SLUG = "local"

HOST_ENV_ALLOW_LIST = ("PATH", "HOME", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR")
"""Host variables a kernel inherits; everything else it gets only from the user's settings."""

_LIVENESS_POLL_S = 0.5
_SECOND_INTERRUPT_S = 1.0
_EXIT_WAIT_S = 5.0
_HANDSHAKE_POLL_S = 0.2
_REPLY_WAIT_S = 5.0
_REAP_WAIT_S = 10.0
_IDLE_LOST_S = 2.0
_HAND_OVER_OUTPUTS = 1000
_HAND_OVER_CHARS = 1 << 20

logger = logging.getLogger(__name__)

# Kernels this process launched, so that it can reap them (no zombies) and read exit codes.
_launched: dict[str, subprocess.Popen[bytes]] = {}
# One guard per kernel: it kills the kernel's whole process group if this process dies.
_guards: dict[str, subprocess.Popen[bytes]] = {}

# ipykernel's parent poller ends the kernel when its parent dies, but not the kernel's own
# children; this guard, in a session of its own, kills the whole group. Exits once it is gone.
_GUARD_CODE = """
import os, signal, sys, time
parent, group = int(sys.argv[1]), int(sys.argv[2])
while True:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        break
    if os.getppid() != parent:
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass
        break
    time.sleep(0.5)
"""

STREAM_MESSAGE_CHARS = 256 * 1024
"""Characters of stdout/stderr after which the kernel sends them as one ``stream`` message."""

# ipykernel sends buffered stdout/stderr every 0.2 s, so a fast cell's 100 MB of prints reach
# us as ONE 100 MB message, held whole in memory by jupyter_client. IPython runs this startup
# file in every kernel of the sandbox (restarts too): a write that fills the buffer past the
# limit waits for it to be sent, which bounds each message. It leaves no name behind.
_STARTUP_CODE = f"""
def _prefect_sandbox_bound_stream_messages(limit={STREAM_MESSAGE_CHARS}):
    import sys

    for stream in (sys.stdout, sys.stderr):
        if not hasattr(stream, "pub_thread"):
            continue  # not ipykernel's OutStream
        unsent = [0]

        def write(text, _write=stream.write, _stream=stream, _unsent=unsent):
            count = _write(text)
            _unsent[0] += len(text)
            if _unsent[0] >= limit:
                _unsent[0] = 0
                _stream.flush()
            return count

        stream.write = write


_prefect_sandbox_bound_stream_messages()
del _prefect_sandbox_bound_stream_messages
"""


@dataclass(frozen=True, kw_only=True)
class LocalKernelConfig(SandboxConfig):
    """Settings of local kernel sandboxes (besides those of `SandboxConfig`).

    Attributes:
        kernel_name: the Jupyter kernelspec to launch (``python3`` is this Python's ipykernel).
        workdir_root: a folder under which each sandbox gets its own working directory; None
            for a fresh temporary directory.
        env: variables the kernel gets besides `HOST_ENV_ALLOW_LIST`.
        startup_timeout_s: seconds a kernel may take to start and answer.
        memory_limit_bytes: address-space limit (``RLIMIT_AS``) of the kernel and its children;
            None for none. Past it allocations fail with ``MemoryError``.
        cpu_time_limit_s: CPU-time limit (``RLIMIT_CPU``) of the kernel process, in seconds
            since its start; past it the kernel gets ``SIGXCPU`` and dies. None for none.
        isolation: ``"bubblewrap"`` runs the kernel under ``bwrap`` (see
            `prefect_sandbox.sandbox.isolation`): it sees only its working directory
            (writable), ``/usr`` and its Python environment (read-only), a fresh ``/tmp`` and
            ``HOME``, its own processes, and no network but loopback. ``"none"`` runs it as a
            plain process of this user, able to read what this user can.
        network: with bubblewrap, whether the kernel shares this machine's network (the
            host's ports and the internet); without, it has only its own loopback.
        bwrap_path: the ``bwrap`` program, a path or a name on ``PATH``.
    """

    kernel_name: str = "python3"
    workdir_root: Path | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    startup_timeout_s: float = 60.0
    memory_limit_bytes: int | None = None
    cpu_time_limit_s: int | None = None
    isolation: Isolation = "bubblewrap"
    network: bool = False
    bwrap_path: str = "bwrap"

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_positive("startup_timeout_s", "memory_limit_bytes", "cpu_time_limit_s")
        if self.isolation not in ISOLATION_LEVELS:
            raise ValueError(f"isolation must be one of {ISOLATION_LEVELS}, not {self.isolation!r}")


def _asked_to_exit(reply: dict[str, Any]) -> bool:
    """Whether IPython's ``exit()`` ran: ipykernel adds an ``ask_exit`` payload to the reply."""
    return any(
        item.get("source") == "ask_exit" and not item.get("keepkernel")
        for item in reply.get("payload", [])
    )


def _runtime_base() -> Path:
    # Short, so IPC socket paths stay under the 107-byte limit of Unix sockets.
    base = Path(tempfile.gettempdir()) / f"prefect-sandbox-{os.getuid()}"
    base.mkdir(mode=0o700, exist_ok=True)
    return base


def _process_state(pid: int) -> str | None:
    """The process's state letter from /proc (``Z`` for a zombie), or None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return stat.rsplit(")", 1)[1].split()[0]


class LocalKernelSandbox(Sandbox):
    """A sandbox that is an ipykernel process on this machine.

    Make one with `create`, reach it again with `attach`. Not safe to share one instance
    between event loops; attach once per loop instead.
    """

    def __init__(
        self, handle: SandboxHandle, config: LocalKernelConfig, client: AsyncKernelClient
    ) -> None:
        self._handle = handle
        self._config = config
        self._client = client
        self._runtime_dir = Path(handle.connection["runtime_dir"])
        self._workdir = Path(handle.workdir)
        self._pid = self._read_pid()
        self._ready = False
        self._late: dict[str, OutputCollector] = {}

    @property
    def handle(self) -> SandboxHandle:
        """The address of this sandbox (see `SandboxHandle`)."""
        return self._handle

    @classmethod
    async def create(
        cls, config: LocalKernelConfig, labels: Mapping[str, str] | None = None
    ) -> LocalKernelSandbox:
        """Start a kernel in a new working directory and wait until it answers.

        Args:
            config: the sandbox settings.
            labels: labels to find the sandbox by later (flow run id and name, ...).

        Returns:
            The live sandbox.

        Raises:
            SandboxError: the kernelspec is unknown, or its language is not Python.
            SandboxDiedError: the kernel exited during start-up.
            SandboxUnavailableError: it did not answer within ``startup_timeout_s``.
        """
        sandbox_id = f"local-{uuid.uuid4().hex[:12]}"
        runtime_dir = _runtime_base() / sandbox_id
        runtime_dir.mkdir(mode=0o700)
        # The sockets get a folder of their own: an isolated kernel may write there, but not
        # beside them (where the pid and handle files, which this side trusts, live).
        (runtime_dir / "ipc").mkdir(mode=0o700)
        if config.workdir_root is not None:
            config.workdir_root.mkdir(parents=True, exist_ok=True)
            workdir = Path(tempfile.mkdtemp(prefix=f"{sandbox_id}-", dir=config.workdir_root))
        else:
            workdir = Path(tempfile.mkdtemp(prefix=f"prefect-sandbox-{sandbox_id}-"))
        handle = SandboxHandle(
            backend=BACKEND_SLUG,
            sandbox_id=sandbox_id,
            workdir=str(workdir),
            labels=dict(labels or {}),
            connection={
                "runtime_dir": str(runtime_dir),
                "owns_workdir": True,
                "kernel_name": config.kernel_name,
            },
        )
        (runtime_dir / "handle.json").write_text(handle.model_dump_json())
        write_connection_file(
            fname=str(runtime_dir / "connection.json"),
            ip=str(runtime_dir / "ipc" / "k"),
            key=secrets.token_hex(16).encode(),
            transport="ipc",
            kernel_name=config.kernel_name,
        )
        try:
            spec = _launch(handle, config)
            sandbox = cls(handle, config, _new_client(runtime_dir))
            await sandbox._handshake()
            kernelspec = {
                "name": config.kernel_name,
                "display_name": spec.display_name,
                "language": spec.language,
            }
            language_info = await sandbox._language_info()
            sandbox._handle = handle.model_copy(
                update={"kernel": KernelInfo(kernelspec=kernelspec, language_info=language_info)}
            )
        except BaseException:
            await asyncio.to_thread(_destroy, handle)
            raise
        return sandbox

    @classmethod
    async def attach(cls, handle: SandboxHandle, config: LocalKernelConfig) -> LocalKernelSandbox:
        """Reach a running sandbox again, from this or another thread or process.

        Args:
            handle: the sandbox's handle.
            config: the sandbox settings (used if the kernel must be restarted).

        Returns:
            A live sandbox with the kernel's state intact. File calls work even if the kernel
            has died; the first `run_cell` waits for the kernel to answer.

        Raises:
            SandboxNotFoundError: the sandbox was killed.
        """
        runtime_dir = Path(handle.connection["runtime_dir"])
        if not (runtime_dir / "connection.json").exists():
            raise SandboxNotFoundError(
                f"sandbox {handle.sandbox_id} is gone (killed, or never made on this machine)",
                sandbox_id=handle.sandbox_id,
            )
        return cls(handle, config, _new_client(runtime_dir))

    @classmethod
    async def list_handles(
        cls, config: LocalKernelConfig, labels: Mapping[str, str] | None = None
    ) -> list[SandboxHandle]:
        """Handles of this machine's live local sandboxes whose labels include ``labels``.

        Args:
            config: the sandbox settings (unused: every local sandbox is found the same way).
            labels: labels every returned sandbox carries; None or empty for all.

        Returns:
            Handles sorted by sandbox id.
        """
        wanted = dict(labels or {})
        handles = []
        for handle_file in sorted(_runtime_base().glob("*/handle.json")):
            handle = SandboxHandle.model_validate_json(handle_file.read_text())
            if wanted.items() <= handle.labels.items():
                handles.append(handle)
        return handles

    async def run_cell(
        self,
        code: str,
        *,
        timeout_s: float | None = None,
        on_output: OutputCallback | None = None,
    ) -> CellResult:
        """Run one cell (see `Sandbox.run_cell`).

        On the deadline the kernel gets SIGINT; if it is still busy ``interrupt_grace_s``
        later, a second SIGINT; if that fails too, the kernel is restarted and the result says
        ``state_lost``. A cell that ends the kernel (``exit()``, ``os._exit``, a crash, the OOM
        killer) raises `SandboxDiedError` as soon as the process is seen gone.
        """
        timeout_s = checked_timeout_s(timeout_s)
        self._check_alive()
        if not self._ready:
            await self._handshake()
        started_at = datetime.now(UTC)
        start = time.monotonic()
        deadline = None if timeout_s is None else start + timeout_s
        msg_id = self._client.execute(
            code, store_history=True, allow_stdin=False, stop_on_error=False
        )
        collector = OutputCollector(self._config.max_output_bytes)
        interrupts = 0
        state_lost = False
        reply_msg: dict[str, Any] | None = None
        # Outputs already read but not yet handed to on_output: a slow callback (one log
        # record per output) must not make us fall behind a kernel that prints fast.
        unsent: list[dict[str, Any]] = []
        unsent_chars = 0
        last_message_at = time.monotonic()
        while True:
            if deadline is not None and time.monotonic() >= deadline:
                reply_msg = reply_msg or await self._poll_execute_reply(msg_id)
                if reply_msg is not None:
                    # The cell ended in time; only its output is still on its way to us.
                    deadline = None
                    continue
                if interrupts == 2:
                    logger.warning(
                        "Sandbox %s: cell still busy after two interrupts; restarting the kernel",
                        self._handle.sandbox_id,
                    )
                    await self.restart()
                    state_lost = True
                    break
                interrupts += 1
                await self.interrupt()
                wait_s = self._config.interrupt_grace_s if interrupts == 1 else _SECOND_INTERRUPT_S
                deadline = time.monotonic() + wait_s
            wait_s = _LIVENESS_POLL_S
            if deadline is not None:
                wait_s = min(wait_s, max(deadline - time.monotonic(), 0.0))
            try:
                msg = await self._client.get_iopub_msg(timeout=0 if unsent else wait_s)
            except Empty:
                if unsent:
                    _hand_over(unsent, on_output)
                    unsent_chars = 0
                    continue
                self._check_alive()
                reply_msg = reply_msg or await self._poll_execute_reply(msg_id)
                if reply_msg is not None and time.monotonic() - last_message_at > _IDLE_LOST_S:
                    logger.warning(
                        "Sandbox %s: the kernel replied but its idle status never came; "
                        "some output of the cell may be missing",
                        self._handle.sandbox_id,
                    )
                    break
                continue
            last_message_at = time.monotonic()
            if msg["parent_header"].get("msg_id") != msg_id:
                self._keep_late_output(msg)
                continue
            msg_type = msg["header"]["msg_type"]
            content = msg["content"]
            if msg_type == "status" and content["execution_state"] == "idle":
                break
            output = collector.add(msg_type, content)
            if output is not None and on_output is not None:
                unsent.append(output)
                unsent_chars += len(output.get("text", ""))
                if unsent_chars >= _HAND_OVER_CHARS or len(unsent) >= _HAND_OVER_OUTPUTS:
                    _hand_over(unsent, on_output)
                    unsent_chars = 0
        if unsent:
            _hand_over(unsent, on_output)
        if state_lost:
            reply: dict[str, Any] = {}
        else:
            reply = (reply_msg or await self._shell_reply(msg_id, "execute_reply"))["content"]
        duration_s = time.monotonic() - start
        if _asked_to_exit(reply):
            await self._wait_for_exit()
        status: Literal["ok", "error", "timeout"]
        error = None
        if interrupts:
            status = "timeout"
            how = (
                "the kernel was restarted, state lost"
                if state_lost
                else f"interrupted{' on the second try' if interrupts == 2 else ''}"
            )
            evalue = f"cell exceeded its {timeout_s} s timeout; {how}"
            if state_lost or not collector.has_error():
                collector.append_error("CellTimeoutError", evalue, [])
            error = CellError(ename="CellTimeoutError", evalue=evalue)
        elif reply.get("status") == "ok":
            status = "ok"
        else:
            status = "error"
            if not collector.has_error():
                collector.append_error(
                    reply.get("ename", "UnknownError"),
                    reply.get("evalue", f"execute_reply status {reply.get('status')!r}"),
                    reply.get("traceback", []),
                )
        outputs = collector.outputs
        if status == "error":
            last = [o for o in outputs if o["output_type"] == "error"][-1]
            error = CellError(
                ename=last["ename"], evalue=last["evalue"], traceback=last["traceback"]
            )
        return CellResult(
            status=status,
            execution_count=reply.get("execution_count"),
            outputs=outputs,
            error=error,
            started_at=started_at,
            duration_s=duration_s,
            interrupted=bool(interrupts) and not state_lost,
            state_lost=state_lost,
            msg_id=msg_id,
            output_bytes=collector.total_bytes,
            omitted_bytes=collector.omitted_bytes,
        )

    def _keep_late_output(self, msg: dict[str, Any]) -> None:
        """Keep output that an earlier cell's background thread printed after that cell ended."""
        parent_id = msg["parent_header"].get("msg_id")
        msg_type = msg["header"]["msg_type"]
        if parent_id and msg_type in OUTPUT_MSG_TYPES:
            collector = self._late.setdefault(
                parent_id, OutputCollector(self._config.max_output_bytes)
            )
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
                msg = await self._client.get_iopub_msg(timeout=0)
            except Empty:
                break
            self._keep_late_output(msg)
        late = {msg_id: collector.outputs for msg_id, collector in self._late.items()}
        self._late.clear()
        return late

    async def _wait_for_exit(self) -> None:
        """The cell called ``exit()``: wait for the kernel to end, then report it."""
        deadline = time.monotonic() + _EXIT_WAIT_S
        while time.monotonic() < deadline:
            self._check_alive("the cell called exit()")
            await asyncio.sleep(0.02)

    async def _poll_execute_reply(self, msg_id: str) -> dict[str, Any] | None:
        """The cell's ``execute_reply`` if it has arrived, without waiting; else None."""
        while True:
            try:
                reply: dict[str, Any] = await self._client.get_shell_msg(timeout=0)
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
                self._check_alive()
                if time.monotonic() >= deadline:
                    raise SandboxError(
                        f"sandbox {self._handle.sandbox_id}: kernel sent no {kind} within "
                        f"{_REPLY_WAIT_S} s",
                        sandbox_id=self._handle.sandbox_id,
                    ) from None
                continue
            if reply["parent_header"].get("msg_id") == msg_id:
                return reply

    async def upload(self, src: Path, dest: str) -> None:
        """Copy a local file into the working directory (see `Sandbox.upload`)."""
        target = resolve_inside(self._workdir, dest)
        if not src.is_file():
            raise FileTransferError(f"upload source {str(src)!r} is not a file", path=dest)
        target.parent.mkdir(parents=True, exist_ok=True)
        await asyncio.to_thread(shutil.copyfile, src, target)

    async def download(self, src: str, dest: Path) -> int:
        """Copy a file out of the working directory (see `Sandbox.download`)."""
        source = resolve_inside(self._workdir, src)
        if not source.is_file():
            raise FileTransferError(
                f"file {src!r} is not in sandbox {self._handle.sandbox_id}",
                path=src,
                sandbox_id=self._handle.sandbox_id,
            )
        dest.parent.mkdir(parents=True, exist_ok=True)
        await asyncio.to_thread(shutil.copyfile, source, dest)
        return dest.stat().st_size

    async def list_files(self, pattern: str = "**/*") -> list[RemoteFile]:
        """List files matching a glob (see `Sandbox.list_files`).

        Symlinks are listed as found, even ones that point outside; `download` refuses those.
        """
        checked_relative_path(pattern)
        files = []
        for path in self._workdir.glob(pattern):
            if path.is_file():
                relative = path.relative_to(self._workdir).as_posix()
                files.append(RemoteFile(path=relative, size_bytes=path.lstat().st_size))
        return sorted(files, key=lambda remote: remote.path)

    async def interrupt(self) -> None:
        """Send SIGINT to the kernel's process group, as Jupyter does for ``signal`` mode."""
        try:
            os.killpg(self._pid, signal.SIGINT)
        except ProcessLookupError:
            self._check_alive()

    async def restart(self) -> None:
        """Kill the kernel and start a new one on the same sockets and working directory."""
        await self.close()
        _kill_process_group(self._handle.sandbox_id, self._pid)
        _launch(self._handle, self._config)
        self._pid = self._read_pid()
        self._client = _new_client(self._runtime_dir)
        self._ready = False
        await self._handshake()

    async def kill(self) -> bool:
        """Kill the kernel and its children, and remove its files. Idempotent.

        Returns:
            True if this call ended the sandbox, False if it was already gone.
        """
        await self.close()
        return await asyncio.to_thread(_destroy, self._handle)

    async def close(self) -> None:
        """Close this process's sockets to the kernel; the kernel keeps running."""
        if self._client.channels_running:
            self._client.stop_channels()

    def _read_pid(self) -> int:
        try:
            return int((self._runtime_dir / "kernel.pid").read_text())
        except (FileNotFoundError, ValueError):
            raise SandboxNotFoundError(
                f"sandbox {self._handle.sandbox_id} is gone (killed)",
                sandbox_id=self._handle.sandbox_id,
            ) from None

    def _check_alive(self, reason: str | None = None) -> None:
        """Raise `SandboxDiedError` if the kernel process has ended; ``reason`` says why."""
        process = _launched.get(self._handle.sandbox_id)
        if process is not None:
            returncode = process.poll()
            if returncode is None:
                return
            exit_code = returncode if returncode >= 0 else None
            signum = -returncode if returncode < 0 else None
            if self._config.isolation == "bubblewrap" and returncode > 128:
                # bwrap exits with 128 + N when the kernel died of signal N, as shells do.
                exit_code, signum = None, returncode - 128
        elif _process_state(self._pid) not in (None, "Z"):
            return
        else:
            exit_code = signum = None
        how = f"signal {signum}" if signum else f"exit code {exit_code}"
        if reason:
            how = f"{reason}, {how}"
        raise SandboxDiedError(
            f"kernel of sandbox {self._handle.sandbox_id} died ({how}); its state is lost",
            exit_code=exit_code,
            signal=signum,
            sandbox_id=self._handle.sandbox_id,
        )

    async def _handshake(self) -> None:
        """Wait until the kernel answers and our iopub subscription receives its messages."""
        deadline = time.monotonic() + self._config.startup_timeout_s
        while time.monotonic() < deadline:
            self._check_alive()
            msg_id = self._client.kernel_info()
            try:
                while True:
                    msg = await self._client.get_iopub_msg(timeout=_HANDSHAKE_POLL_S)
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


def _new_client(runtime_dir: Path) -> AsyncKernelClient:
    client = AsyncKernelClient()
    # Past 1,000 queued messages zmq DROPS iopub messages for a slow reader (one that logs each
    # output), the closing idle status among them. Unlimited: our side queues them all instead.
    client.context.setsockopt(zmq.RCVHWM, 0)
    client.load_connection_file(str(runtime_dir / "connection.json"))
    client.start_channels(shell=True, iopub=True, stdin=False, hb=False, control=False)
    return client


def _hand_over(unsent: list[dict[str, Any]], on_output: OutputCallback | None) -> None:
    """Give ``on_output`` the outputs read so far, back-to-back stream text merged, and clear."""
    assert on_output is not None
    for output in merged_streams(unsent):
        on_output(output)
    unsent.clear()


def _kernel_env(
    spec_env: Mapping[str, str], config: LocalKernelConfig, runtime_dir: Path
) -> dict[str, str]:
    env = {name: os.environ[name] for name in HOST_ENV_ALLOW_LIST if name in os.environ}
    # IPython's own folder per sandbox: no cell's history (`%history -g`) or the host user's
    # startup scripts cross from one sandbox to another.
    env["IPYTHONDIR"] = str(runtime_dir / "ipython")
    if config.isolation == "bubblewrap":
        env.update(SANDBOX_ENV)
    env.update(spec_env)
    env.update(config.env)
    return env


def _launch(handle: SandboxHandle, config: LocalKernelConfig) -> KernelSpec:
    """Start the kernel process for ``handle`` and record its pid.

    Returns:
        The kernelspec it was started from.

    Raises:
        SandboxError: no kernelspec has that name, or its language is not Python.
    """
    runtime_dir = Path(handle.connection["runtime_dir"])
    startup = runtime_dir / "ipython" / "profile_default" / "startup" / "00-prefect-sandbox.py"
    startup.parent.mkdir(parents=True, exist_ok=True)
    startup.write_text(_STARTUP_CODE)
    try:
        spec = KernelSpecManager().get_kernel_spec(config.kernel_name)
    except NoSuchKernel:
        raise SandboxError(
            f"no Jupyter kernel named {config.kernel_name!r} (setting kernel_name)"
        ) from None
    if not is_python_language(spec.language):
        raise SandboxError(
            f"Jupyter kernel {config.kernel_name!r} runs {spec.language!r}, not Python "
            "(setting kernel_name)"
        )
    connection_file = str(runtime_dir / "connection.json")
    cmd = [arg.replace("{connection_file}", connection_file) for arg in spec.argv]
    # As jupyter_client's KernelManager does: a bare "python" means this interpreter.
    if cmd and cmd[0] in {"python", f"python{sys.version_info[0]}"}:
        cmd[0] = sys.executable
    if config.isolation == "bubblewrap":
        bwrap = check_bwrap(config.bwrap_path)
        view = sandbox_view(
            cmd[0],
            read_only=[runtime_dir / "connection.json"],
            writable=[Path(handle.workdir), runtime_dir / "ipc", runtime_dir / "ipython"],
            network=config.network,
        )
        cmd = bwrap_command(bwrap, view, cmd)
    cmd = limited_command(
        cmd,
        memory_limit_bytes=config.memory_limit_bytes,
        cpu_time_limit_s=config.cpu_time_limit_s,
    )
    with open(runtime_dir / "kernel.log", "ab") as log:
        # From a thread that lives as long as this process: bwrap's --die-with-parent ends
        # the kernel when the THREAD that started it ends (Linux's parent-death signal).
        started = _launcher().submit(
            launch_kernel,
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log.fileno(),
            stderr=log.fileno(),
            env=_kernel_env(spec.env, config, runtime_dir),
            cwd=handle.workdir,
        )
        process = started.result()
    _launched[handle.sandbox_id] = process
    (runtime_dir / "kernel.pid").write_text(str(process.pid))
    _guards[handle.sandbox_id] = subprocess.Popen(
        [sys.executable, "-I", "-S", "-c", _GUARD_CODE, str(os.getpid()), str(process.pid)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    return spec


@functools.cache
def _launcher() -> ThreadPoolExecutor:
    """The one thread that starts kernels; it lives until this process exits."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefect-sandbox-launcher")


def _destroy(handle: SandboxHandle) -> bool:
    """Kill the sandbox's kernel, if any, and remove its folders; False if already gone."""
    runtime_dir = Path(handle.connection["runtime_dir"])
    if not runtime_dir.exists():
        return False
    try:
        pid = int((runtime_dir / "kernel.pid").read_text())
    except FileNotFoundError:
        pass
    else:
        _kill_process_group(handle.sandbox_id, pid)
    shutil.rmtree(runtime_dir, ignore_errors=True)
    if handle.connection.get("owns_workdir"):
        shutil.rmtree(handle.workdir, ignore_errors=True)
    return True


def _kill_process_group(sandbox_id: str, pid: int) -> None:
    """SIGKILL the kernel's process group and wait until the kernel is gone."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    guard = _guards.pop(sandbox_id, None)
    if guard is not None:
        guard.kill()
        guard.wait(timeout=_REAP_WAIT_S)
    process = _launched.pop(sandbox_id, None)
    if process is not None:
        process.wait(timeout=_REAP_WAIT_S)
        return
    deadline = time.monotonic() + _REAP_WAIT_S
    while _process_state(pid) not in (None, "Z") and time.monotonic() < deadline:
        time.sleep(0.01)
