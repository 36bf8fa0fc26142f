"""`LocalKernelSandbox`: an ipykernel on this machine, driven through jupyter_client.

This module launches, watches and ends the kernel process (by default under bubblewrap,
`kernel.isolation`); the cells and the working directory's files are `JupyterKernelSandbox`'s.
The kernel starts in a new session on IPC sockets unique to it (TCP ports clash when many start
at once), with no stdin and an allow-list of the host's environment, and dies with the process
that started it (ipykernel's parent poller, bwrap's ``--die-with-parent``, and a guard process,
kernel_side/kernel_guard.py, for its children; it also caps ``kernel.log``). Everything needed
to reach it again lives in its private runtime folder, so ``attach`` works from another process;
the host reaches its sockets only through links it pinned (`kernel.kernel_sockets`), and
rewrites its IPython folder's files at each restart without following links (a user's
``IPYTHONDIR`` replaces that folder). A warm pool (`kernel.warm_pool`) hands out kernels made
exactly as cold ones. Manual: docs/backends/local.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from jupyter_client.connect import write_connection_file
from jupyter_client.kernelspec import KernelSpec, KernelSpecManager, NoSuchKernel
from jupyter_client.launcher import launch_kernel

from prefect_sandbox.sandbox.backends import run_to_end_in_thread
from prefect_sandbox.sandbox.backends.kernel.cgroups import SandboxCgroup, make_cgroup
from prefect_sandbox.sandbox.backends.kernel.host import (
    new_runtime_dir,
    new_workdir,
    remove_folders,
    runtime_base,
)
from prefect_sandbox.sandbox.backends.kernel.isolation import (
    ISOLATION_LEVELS,
    SANDBOX_ENV,
    Isolation,
    bwrap_command,
    bwrap_sizes_tmpfs,
    check_bwrap,
    limited_command,
    sandbox_user,
    sandbox_view,
    seccomp_filter,
    staged_command,
)
from prefect_sandbox.sandbox.backends.kernel.jupyter import (
    STARTUP_FILE_NAME,
    JupyterKernelConfig,
    JupyterKernelSandbox,
    connection_file_of,
    write_ipython_startup,
)
from prefect_sandbox.sandbox.backends.kernel.uids import DEFAULT_UID_RANGE, claim_uid, release_uid
from prefect_sandbox.sandbox.backends.kernel.warm_pool import WarmPool, found_warm_pool, warm_pool
from prefect_sandbox.sandbox.base import KernelInfo, SandboxHandle, is_python_language
from prefect_sandbox.sandbox.errors import (
    SandboxError,
    SandboxNotFoundError,
)
from prefect_sandbox.sandbox.kernel_side import source
from prefect_sandbox.sandbox.labels import MARKER_LABEL, POOL_OWNER_LABEL
from prefect_sandbox.sandbox.paths import resolve_inside

__all__ = [
    "BACKEND_SLUG",
    "DEFAULT_MAX_PROCESSES",
    "DEFAULT_TMPFS_BYTES",
    "HOST_ENV_ALLOW_LIST",
    "KERNEL_LOG_BYTES",
    "LocalKernelConfig",
    "LocalKernelSandbox",
    "kill_orphaned_pool_kernels",
]

BACKEND_SLUG = "local"

HOST_ENV_ALLOW_LIST = ("PATH", "HOME", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR")
"""Host variables a kernel inherits; everything else it gets only from the user's settings."""

_REAP_WAIT_S = 10.0

DEFAULT_MAX_PROCESSES = 4096
"""Processes and threads a whole local sandbox may have at once, where it has a cgroup: far
above what a notebook starts (a kernel has about 10 threads; OpenBLAS one per core), far below
what stalls a host (a fork bomb)."""
DEFAULT_TMPFS_BYTES = 1 << 30
"""The most each of an isolated kernel's ``/tmp``, ``/dev/shm`` and ``HOME`` holds (they are
memory) when ``memory_limit_bytes`` is smaller or unset: 1 GiB, not half the host's RAM."""

logger = logging.getLogger(__name__)

# Kernels this process launched, so that it can reap them (no zombies) and read exit codes.
_launched: dict[str, subprocess.Popen[bytes]] = {}
# One guard per kernel (kernel_side/kernel_guard.py): it kills the kernel's whole process group
# if this process dies, and writes kernel.log up to KERNEL_LOG_BYTES.
_guards: dict[str, subprocess.Popen[bytes]] = {}
# Kernels and guards sent SIGKILL that had not exited when their kill stopped waiting (one outlived
# 10 s at load 12-14): kept so that the next launch reaps them, not waited for again.
_slow_to_exit: list[subprocess.Popen[bytes]] = []

KERNEL_LOG_BYTES = 1 << 20
"""The most a sandbox's ``kernel.log`` (what its processes write to fds 1 and 2) holds."""


@dataclass(frozen=True, kw_only=True)
class LocalKernelConfig(JupyterKernelConfig):
    """Settings of local kernel sandboxes (besides those of `JupyterKernelConfig`).

    Attributes:
        kernel_name: the Jupyter kernelspec to launch (``python3`` is this Python's ipykernel).
        workdir_root: a folder under which each sandbox gets its own working directory; None
            for a fresh temporary directory.
        env: variables the kernel gets besides `HOST_ENV_ALLOW_LIST`.
        memory_limit_bytes: the memory EACH process of the sandbox may allocate (``RLIMIT_DATA``:
            heap and private writable mappings), the kernel and every process it starts alike,
            not a total; past it allocations fail (``MemoryError``). With bubblewrap, also the
            most each of its ``/tmp``, ``HOME`` and ``/dev/shm`` holds. A kernel needs some
            100 MiB to start; one that dies of too little says so. None for no limit.
        cpu_time_limit_s: the CPU seconds EACH process of the sandbox may use
            (``RLIMIT_CPU``), not a total: past it that process gets ``SIGXCPU`` and dies
            (the kernel: the sandbox dies). None for no limit.
        isolation: ``"bubblewrap"`` runs the kernel under ``bwrap`` (see
            `kernel.isolation`): it sees only its working directory
            (writable), ``/usr`` and its Python environment (read-only), a fresh ``/tmp`` and
            ``HOME``, its own processes, and no network but loopback. ``"none"`` runs it as a
            plain process of this user, able to read what this user can.
        network: with bubblewrap, whether the kernel shares this machine's network (the
            host's ports and the internet); without, it has only its own loopback.
        bwrap_path: the ``bwrap`` program, a path or a name on ``PATH``.
        warm_pool_size: how many started, never-used kernels of these settings this process
            keeps ready, so that `LocalKernelSandbox.create` returns in milliseconds; 0 for
            none (every create starts a kernel). The pool starts at the first create, which
            is a cold start, and refills in the background after each create.
        uid_range: the host uids (first, last) sandboxes isolated by a root process take
            one each of, never two live sandboxes the same (`kernel.uids`).
        max_processes: processes and threads the whole sandbox may have at once (its cgroup's
            ``pids.max``, where this process may make cgroups: it is root); None for no cap.
        cpu_limit: CPUs' worth of time the whole sandbox may use at once (its cgroup's CPU
            quota: 0.5 is half a core), where it has a cgroup; None for no cap.

    With a cgroup (`kernel.cgroups`), ``memory_limit_bytes`` also bounds the
    whole sandbox, its tmpfs included. The handle's ``limits`` says how each limit applied.
    """

    kernel_name: str = "python3"
    workdir_root: Path | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    memory_limit_bytes: int | None = None
    cpu_time_limit_s: int | None = None
    isolation: Isolation = "bubblewrap"
    network: bool = False
    bwrap_path: str = "bwrap"
    warm_pool_size: int = 0
    uid_range: tuple[int, int] = DEFAULT_UID_RANGE
    max_processes: int | None = DEFAULT_MAX_PROCESSES
    cpu_limit: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_positive("memory_limit_bytes", "cpu_time_limit_s")
        if self.warm_pool_size < 0:
            raise ValueError(f"warm_pool_size must be 0 or more, not {self.warm_pool_size}")
        if self.isolation not in ISOLATION_LEVELS:
            raise ValueError(f"isolation must be one of {ISOLATION_LEVELS}, not {self.isolation!r}")


def _process_state(pid: int) -> str | None:
    """The process's state letter from /proc (``Z`` for a zombie), or None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return stat.rsplit(")", 1)[1].split()[0]


class LocalKernelSandbox(JupyterKernelSandbox):
    """A sandbox that is an ipykernel process on this machine.

    Make one with `create`, reach it again with `attach`. Not safe to share one instance
    between event loops; attach once per loop instead.
    """

    _config: LocalKernelConfig

    def __init__(self, handle: SandboxHandle, config: LocalKernelConfig) -> None:
        self._pid = _read_pid(handle)
        # True from a launch until the kernel first answers: a death then is a failed start.
        self._starting = False
        runtime_dir = Path(handle.connection["runtime_dir"])
        super().__init__(
            handle,
            config,
            connection_file_of(handle),
            Path(handle.workdir),
            kernel_sockets=runtime_dir / "ipc" / "k",
            socket_owner=_kernel_user(handle, config)[0],
        )

    @classmethod
    async def create(
        cls, config: LocalKernelConfig, labels: Mapping[str, str] | None = None
    ) -> LocalKernelSandbox:
        """Start a kernel in a new working directory and wait until it answers.

        With ``config.warm_pool_size``, take a ready kernel of the same settings from this
        process's warm pool instead (it gets ``labels`` in place of the pool's), and refill
        the pool in the background; start one only when none is ready. Without, take the
        kernel `start_ahead` started for the same settings, if there is one.

        Args:
            config: the sandbox settings.
            labels: labels to find the sandbox by later (flow run id and name, ...).

        Returns:
            The live sandbox.

        Raises:
            SandboxError: the kernelspec is unknown, or its language is not Python.
            SandboxDiedError: the kernel exited during start-up, or did not answer within
                ``startup_timeout_s``.
            SandboxUnavailableError: bubblewrap cannot run here, or TMPDIR is too long for the
                kernel's IPC socket paths.
        """
        if not config.warm_pool_size:
            started = await _kernel_started_ahead(config)
            if started is not None:
                sandbox = await cls._handed_out_or_none(started, config, labels)
                if sandbox is not None:
                    logger.debug("Took kernel %s, started ahead", sandbox.handle.sandbox_id)
                    return sandbox
            return await cls._start(config, labels)
        pool = _warm_pool(cls, config)
        while (handle := pool.take()) is not None:
            sandbox = await cls._handed_out_or_none(handle, config, labels)
            if sandbox is not None:
                pool.refill()
                return sandbox
        # The first create, or one that drained the pool: a cold start, then the refill, so
        # that the two do not compete for the CPU.
        sandbox = await cls._start(config, labels)
        pool.refill()
        return sandbox

    @classmethod
    async def fill_warm_pool(cls, config: LocalKernelConfig, timeout_s: float) -> int:
        """Fill this process's warm pool for ``config`` now, rather than at the first create.

        Args:
            config: the sandbox settings; ``warm_pool_size`` is how many kernels to start.
            timeout_s: the longest wait, in seconds; kernels not started by then keep
                starting in the background.

        Returns:
            How many ready kernels the pool holds. Fewer than ``warm_pool_size`` if the
            timeout passed or a kernel failed to start (logged as a warning; the next
            `create` starts one itself, and raises what stops it).

        Raises:
            ValueError: ``config.warm_pool_size`` is 0.
        """
        if not config.warm_pool_size:
            raise ValueError("warm_pool_size is 0: there is no warm pool to fill")
        pool = _warm_pool(cls, config)
        pool.refill()
        await asyncio.to_thread(pool.wait_full, timeout_s)
        return len(pool.idle)

    @classmethod
    def start_ahead(cls, config: LocalKernelConfig) -> None:
        """Start one kernel of ``config`` in a background thread, for this process's next
        `create` of the same settings: a warm pool of one that is not refilled.

        For a process that knows it will create one sandbox and has other work first (the
        command line imports Prefect and creates the flow run meanwhile). That `create` waits
        for the kernel if it is still starting; with other settings, or if it failed to start,
        `create` starts one as without it. Unused, it is ended at the process's exit. A call
        while one of the same settings is ready or starting does nothing; so does one with
        ``config.warm_pool_size`` set (the warm pool serves instead).
        """
        if not config.warm_pool_size:
            _warm_pool(cls, config, ahead=True).refill()

    @classmethod
    async def _handed_out_or_none(
        cls, handle: SandboxHandle, config: LocalKernelConfig, labels: Mapping[str, str] | None
    ) -> LocalKernelSandbox | None:
        """`_hand_out`, or None (logged; the kernel ended) if the kernel fails as it is."""
        try:
            return await cls._hand_out(handle, config, labels)
        except Exception:
            logger.warning(
                "Kernel %s, started before it was asked for, failed as it was handed out "
                "(ended); not using it",
                handle.sandbox_id,
                exc_info=True,
            )
            return None

    @classmethod
    async def _hand_out(
        cls, handle: SandboxHandle, config: LocalKernelConfig, labels: Mapping[str, str] | None
    ) -> LocalKernelSandbox:
        """A pooled kernel, relabelled for its taker and connected from this event loop."""
        handle = handle.model_copy(update={"labels": dict(labels or {})})
        sandbox: LocalKernelSandbox | None = None
        try:
            # Labelled first: from here on the run's hooks and the reaper find it by its labels.
            _write_handle(handle)
            sandbox = cls(handle, config)
            await sandbox._handshake()
        except BaseException:
            await _end_unstarted(handle, sandbox)
            raise
        return sandbox

    @classmethod
    async def _start(
        cls, config: LocalKernelConfig, labels: Mapping[str, str] | None
    ) -> LocalKernelSandbox:
        """Start a kernel (see `create`), whatever the warm pool holds."""
        sandbox_id = f"local-{uuid.uuid4().hex[:12]}"
        runtime_dir = new_runtime_dir(sandbox_id)
        # The sockets get a folder of their own: an isolated kernel may write there, but not
        # beside them (where the pid and handle files, which this side trusts, live).
        (runtime_dir / "ipc").mkdir(mode=0o700)
        workdir = new_workdir(sandbox_id, config.workdir_root)
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
        sandbox: LocalKernelSandbox | None = None
        try:
            if config.isolation == "bubblewrap" and os.geteuid() == 0:
                handle.connection["uid"] = await asyncio.to_thread(
                    claim_uid, config.uid_range, sandbox_id, runtime_dir
                )
            cgroup = await asyncio.to_thread(
                make_cgroup,
                sandbox_id,
                memory_limit_bytes=config.memory_limit_bytes,
                max_processes=config.max_processes,
                cpu_limit=config.cpu_limit,
            )
            if cgroup is not None:
                folders = [str(folder) for folder in cgroup.folders]
                handle.connection["cgroup"] = {"folders": folders, "version": cgroup.version}
            handle.limits = _limits(config, cgroup)
            _write_handle(handle)
            _write_connection_files(runtime_dir, config.kernel_name)
            spec = await run_to_end_in_thread(_launch, handle, config)
            sandbox = cls(handle, config)
            sandbox._starting = True
            await sandbox._handshake()
            sandbox._starting = False
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
            await _end_unstarted(handle, sandbox)
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
        cls._check_connection_file(handle)
        return cls(handle, config)

    @classmethod
    async def list_handles(
        cls, config: LocalKernelConfig, labels: Mapping[str, str] | None = None
    ) -> list[SandboxHandle]:
        """Handles of this machine's live local sandboxes whose labels include ``labels``.

        Warm pools' idle kernels are listed too: they carry the marker and
        ``prefect-sandbox-pool-owner`` labels, and no flow run's, until they are handed out.

        Args:
            config: the sandbox settings (unused: every local sandbox is found the same way).
            labels: labels every returned sandbox carries; None or empty for all.

        Returns:
            Handles sorted by sandbox id.
        """
        return _registered_handles(labels or {})

    async def upload(self, src: Path, dest: str) -> None:
        """Copy a local file into the working directory (see `Sandbox.upload`); the file and
        the folders made for it are the kernel's user's, as the files the kernel makes."""
        target = resolve_inside(self._workdir, dest)
        made = [folder for folder in target.parents if not folder.exists()]
        await super().upload(src, dest)
        _hand_over([*reversed(made), target], self._handle, self._config)

    async def interrupt(self) -> None:
        """Send SIGINT to the kernel's process group, as Jupyter does for ``signal`` mode."""
        try:
            os.killpg(self._pid, signal.SIGINT)
        except ProcessLookupError:
            await self._check_alive()

    async def restart(self) -> None:
        """Kill the kernel and start a new one on the same sockets and working directory.

        The kill (which waits for the old kernel to end) and the launch run in a thread.
        """
        await self.close()
        await run_to_end_in_thread(self._relaunch)
        self._starting = True
        await self._reconnect()
        self._starting = False

    def _relaunch(self) -> None:
        """Kill the kernel, wait until it is gone, and launch a new one (blocking)."""
        _kill_process_group(self._handle.sandbox_id, self._pid)
        self._clear_sockets()
        _launch(self._handle, self._config)
        self._pid = _read_pid(self._handle)

    async def kill(self) -> bool:
        """Kill the kernel and its children, and remove its files. Idempotent.

        Returns:
            True if this call ended the sandbox, False if it was already gone.
        """
        await self.close()
        return await asyncio.to_thread(_destroy, self._handle)

    async def _check_alive(self, reason: str | None = None) -> None:
        """Raise `SandboxDiedError` if the kernel process has ended; ``reason`` says why.

        Never blocks: a non-waiting ``waitpid``, or a read of ``/proc``.
        """
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
        cause = self._start_failure() if self._starting else None
        cgroup = _sandbox_cgroup(self._handle)
        if signum == signal.SIGKILL and cgroup is not None and cgroup.out_of_memory():
            out_of_memory = (
                "the sandbox used all of its memory "
                f"(memory_limit_bytes={self._config.memory_limit_bytes}, for all its processes "
                "and its /tmp, /dev/shm and HOME together) and Linux's OOM killer ended it"
            )
            cause = f"{cause}: {out_of_memory}" if cause else out_of_memory
        raise self._kernel_died(exit_code=exit_code, signal=signum, cause=cause, reason=reason)

    def _start_failure(self) -> str:
        """Why a kernel died before it first answered: its log's last line, and the memory
        limit when one is set (too little of it kills a kernel as it starts)."""
        log = Path(self._handle.connection["runtime_dir"]) / "kernel.log"
        try:
            with log.open("rb") as file:
                file.seek(max(0, log.stat().st_size - 4096))
                lines = file.read().decode(errors="replace").strip().splitlines()
        except FileNotFoundError:
            lines = []
        cause = "at start-up"
        if lines:
            cause += f", its last words {lines[-1].strip()[:300]!r}"
        limit = self._config.memory_limit_bytes
        if limit is not None:
            cause += f" (memory_limit_bytes={limit} may be too little to start a kernel)"
        return cause


def _write_connection_files(runtime_dir: Path, kernel_name: str) -> None:
    """The kernel's connection file (``kernel.json``: its sockets in ``ipc/``) and the host's
    (``connection.json``: the same key and ports, the sockets pinned in ``sock/``)."""
    kernel_file, _ = write_connection_file(
        fname=str(runtime_dir / "kernel.json"),
        ip=str(runtime_dir / "ipc" / "k"),
        key=secrets.token_hex(16).encode(),
        transport="ipc",
        kernel_name=kernel_name,
    )
    info = json.loads(Path(kernel_file).read_text())
    info["ip"] = str(runtime_dir / "sock" / "k")
    ports = {name: value for name, value in info.items() if name.endswith("_port")}
    write_connection_file(
        fname=str(runtime_dir / "connection.json"),
        ip=info["ip"],
        key=info["key"].encode(),
        transport="ipc",
        kernel_name=kernel_name,
        **ports,
    )


def _tmpfs_size_bytes(config: LocalKernelConfig) -> int:
    """The most each of an isolated kernel's ``/tmp``, ``/dev/shm`` and ``HOME`` holds."""
    if config.memory_limit_bytes is None:
        return DEFAULT_TMPFS_BYTES
    return min(config.memory_limit_bytes, DEFAULT_TMPFS_BYTES)


def _sandbox_cgroup(handle: SandboxHandle) -> SandboxCgroup | None:
    """The sandbox's cgroup as its handle records it; None if it has none."""
    recorded = handle.connection.get("cgroup")
    if recorded is None:
        return None
    return SandboxCgroup(tuple(Path(f) for f in recorded["folders"]), recorded["version"])


def _limits(config: LocalKernelConfig, cgroup: SandboxCgroup | None) -> dict[str, str]:
    """How each of the config's limits applies: to the whole sandbox through its cgroup, else
    to each process (rlimits), else not at all."""
    applied = dict(cgroup.applied) if cgroup is not None else {}
    if config.memory_limit_bytes is not None:
        each = f"each process (RLIMIT_DATA): {config.memory_limit_bytes} bytes"
        applied["memory"] = f"{applied['memory']}; {each}" if "memory" in applied else each
    if config.max_processes is not None and "processes" not in applied:
        applied["processes"] = "not applied: no cgroup here (the flow is not root, or no pids"
        applied["processes"] += " controller)"
    if config.cpu_limit is not None and "cpu" not in applied:
        applied["cpu"] = "not applied: no cgroup here (the flow is not root, or no cpu controller)"
    if config.cpu_time_limit_s is not None:
        applied["cpu_time"] = f"each process (RLIMIT_CPU): {config.cpu_time_limit_s} s"
    if config.isolation == "bubblewrap":
        applied["tmpfs"] = f"each of /tmp, /dev/shm, HOME: {_tmpfs_size_bytes(config)} bytes"
    return applied


def _kernel_user(handle: SandboxHandle, config: LocalKernelConfig) -> tuple[int, int]:
    """The host uid and gid the kernel runs as: the sandbox's own uid (and group) when this
    process is root and isolates it, else this process's."""
    if config.isolation != "bubblewrap":
        return os.getuid(), os.getgid()
    uid = handle.connection.get("uid")
    return (uid, uid) if uid is not None else sandbox_user()


def _write_handle(handle: SandboxHandle) -> None:
    """Record the handle in its runtime folder, replacing the file whole (listings read it)."""
    handle_file = Path(handle.connection["runtime_dir"]) / "handle.json"
    partial = handle_file.with_suffix(".json.partial")
    partial.write_text(handle.model_dump_json(exclude={"kernel"}))
    partial.replace(handle_file)


def _registered_handles(labels: Mapping[str, str]) -> list[SandboxHandle]:
    """Handles of this machine's local sandboxes whose labels include ``labels``, by id."""
    handles = []
    for handle_file in sorted(runtime_base().glob("*/handle.json")):
        try:
            handle = SandboxHandle.model_validate_json(handle_file.read_text())
        except (FileNotFoundError, ValueError):
            # Killed since the glob (its folder removed), or its handle half written by a
            # `create` under way: neither is a live sandbox to list yet.
            continue
        if labels.items() <= handle.labels.items():
            handles.append(handle)
    return handles


def _pool_key(config: LocalKernelConfig) -> tuple[object, ...]:
    """What a pooled kernel shares with every config it may be handed out for.

    Every setting, and what of this process the kernel was started with: the host variables it
    inherits and the temp dir its folders are in.
    """
    settings = []
    for setting in dataclasses.fields(config):
        value = getattr(config, setting.name)
        if isinstance(value, Mapping):
            value = tuple(sorted(value.items()))
        settings.append((setting.name, value))
    host_env = tuple((name, os.environ.get(name)) for name in HOST_ENV_ALLOW_LIST)
    return (tuple(settings), host_env, tempfile.gettempdir())


def _warm_pool(
    cls: type[LocalKernelSandbox], config: LocalKernelConfig, *, ahead: bool = False
) -> WarmPool:
    """This process's warm pool of kernels for ``config``; ``ahead``: its pool of one for
    `LocalKernelSandbox.start_ahead`, kept apart (`_ahead_key`)."""

    def start() -> SandboxHandle:
        return asyncio.run(_start_pooled(cls, config))

    def make() -> WarmPool:
        size = 1 if ahead else config.warm_pool_size
        return WarmPool(size, start=start, destroy=_destroy, alive=_kernel_alive)

    pool, _ = warm_pool(_ahead_key(config) if ahead else _pool_key(config), make)
    return pool


def _ahead_key(config: LocalKernelConfig) -> tuple[object, ...]:
    return ("started ahead", _pool_key(config))


async def _kernel_started_ahead(config: LocalKernelConfig) -> SandboxHandle | None:
    """The kernel `LocalKernelSandbox.start_ahead` started for ``config``, once it has started
    (waiting up to ``startup_timeout_s``); None if there is none, or it failed to start."""
    pool = found_warm_pool(_ahead_key(config))
    if pool is None:
        return None
    await asyncio.to_thread(pool.wait_full, config.startup_timeout_s)
    return pool.take()


async def _start_pooled(cls: type[LocalKernelSandbox], config: LocalKernelConfig) -> SandboxHandle:
    """Start a kernel for a warm pool (in the pool's thread): labelled as this process's."""
    _kill_orphans_once()
    labels = {MARKER_LABEL: "true", POOL_OWNER_LABEL: str(os.getpid())}
    sandbox = await cls._start(config, labels)
    # Its sockets belong to this thread's event loop; its taker connects its own.
    await sandbox.close()
    return sandbox.handle


async def _end_unstarted(handle: SandboxHandle, sandbox: LocalKernelSandbox | None) -> None:
    """End a kernel whose start or hand-out failed, closing the sockets ``sandbox`` opened to it.

    Left open, its client's sockets are closed only by the garbage collector, which warns
    (unclosed zmq sockets and context) wherever that happens to run.
    """
    if sandbox is not None:
        await sandbox.close()
    await asyncio.to_thread(_destroy, handle)


def _kernel_alive(handle: SandboxHandle) -> bool:
    """Whether the sandbox's kernel process is running (not exited, not a zombie)."""
    process = _launched.get(handle.sandbox_id)
    if process is not None:
        return process.poll() is None
    try:
        pid = _read_pid(handle)
    except SandboxNotFoundError:
        return False
    return _process_state(pid) not in (None, "Z")


def kill_orphaned_pool_kernels() -> list[SandboxHandle]:
    """End the idle warm-pool kernels on this machine whose owning process is gone.

    A pool's kernels die with the process that owns it (as every local kernel does), but a
    process killed by SIGKILL leaves their folders behind, labelled with its pid. Each process
    calls this once, when it first fills a warm pool (the reaper considers only sandboxes
    labelled with a flow run id, so it leaves these alone).

    Returns:
        The handles of the kernels it ended.
    """
    ended = []
    for handle in _registered_handles({MARKER_LABEL: "true"}):
        owner = handle.labels.get(POOL_OWNER_LABEL)
        if owner is None or not owner.isdigit() or int(owner) == os.getpid():
            continue
        if _process_state(int(owner)) in (None, "Z") and _destroy(handle):
            ended.append(handle)
    return ended


@functools.cache
def _kill_orphans_once() -> None:
    """`kill_orphaned_pool_kernels`, once per process."""
    orphans = kill_orphaned_pool_kernels()
    if orphans:
        logger.info("Ended %d warm-pool kernel(s) of processes that are gone", len(orphans))


def _read_pid(handle: SandboxHandle) -> int:
    """The kernel's pid, from the sandbox's runtime folder.

    Raises:
        SandboxNotFoundError: the folder is gone (the sandbox was killed).
    """
    try:
        return int((Path(handle.connection["runtime_dir"]) / "kernel.pid").read_text())
    except (FileNotFoundError, ValueError):
        raise SandboxNotFoundError(
            f"sandbox {handle.sandbox_id} is gone (killed)", sandbox_id=handle.sandbox_id
        ) from None


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


def _python_kernel_spec(kernel_name: str) -> KernelSpec:
    """The kernelspec named ``kernel_name``.

    Raises:
        SandboxError: no kernelspec has that name, or its language is not Python.
    """
    try:
        spec = KernelSpecManager().get_kernel_spec(kernel_name)
    except NoSuchKernel:
        raise SandboxError(
            f"no Jupyter kernel named {kernel_name!r} (setting kernel_name)"
        ) from None
    if not is_python_language(spec.language):
        raise SandboxError(
            f"Jupyter kernel {kernel_name!r} runs {spec.language!r}, not Python "
            "(setting kernel_name)"
        )
    return spec


def _bubblewrapped(
    cmd: list[str], handle: SandboxHandle, config: LocalKernelConfig, ipython: list[Path]
) -> tuple[list[str], list[int]]:
    """``cmd`` run inside bubblewrap's view of the sandbox's folders (under seccomp where
    the host has the filter), its folders handed to the kernel's user.

    Returns:
        The command, and the descriptors its process must inherit (the seccomp program's).
    """
    runtime_dir = Path(handle.connection["runtime_dir"])
    bwrap = check_bwrap(config.bwrap_path)
    writable = [Path(handle.workdir), runtime_dir / "ipc", runtime_dir / "ipython"]
    _hand_over([runtime_dir / "kernel.json", *writable, *ipython], handle, config)
    view = sandbox_view(
        cmd[0],
        read_only=[runtime_dir / "kernel.json"],
        writable=writable,
        network=config.network,
        tmpfs_size_bytes=_tmpfs_size_bytes(config) if bwrap_sizes_tmpfs(bwrap) else None,
    )
    passed: list[int] = []
    program = seccomp_filter()
    if program is not None:
        passed.append(os.memfd_create("prefect-sandbox-seccomp", 0))
        os.write(passed[0], program)
        os.lseek(passed[0], 0, os.SEEK_SET)
    seccomp_fd = passed[0] if passed else None
    argv = bwrap_command(bwrap, view, cmd, seccomp_fd=seccomp_fd)
    return staged_command(argv, _kernel_user(handle, config)), passed


def _launch(handle: SandboxHandle, config: LocalKernelConfig) -> KernelSpec:
    """Start the kernel process for ``handle`` and record its pid.

    Returns:
        The kernelspec it was started from.

    Raises:
        SandboxError: no kernelspec has that name, or its language is not Python.
    """
    _forget_killed_elsewhere()
    runtime_dir = Path(handle.connection["runtime_dir"])
    ipython = _write_ipython_folder(handle)
    spec = _python_kernel_spec(config.kernel_name)
    cmd = [arg.replace("{connection_file}", str(runtime_dir / "kernel.json")) for arg in spec.argv]
    # As jupyter_client's KernelManager does: a bare "python" means this interpreter.
    if cmd and cmd[0] in {"python", f"python{sys.version_info[0]}"}:
        cmd[0] = sys.executable
    # Descriptors the kernel's process gets (the seccomp program), closed here once it has them.
    passed: list[int] = []
    if config.isolation == "bubblewrap":
        cmd, passed = _bubblewrapped(cmd, handle, config, ipython)
    cmd = limited_command(
        cmd,
        memory_limit_bytes=config.memory_limit_bytes,
        cpu_time_limit_s=config.cpu_time_limit_s,
        cgroup_folders=handle.connection.get("cgroup", {}).get("folders", ()),
    )
    output, into_log = os.pipe()
    try:
        # From a thread that lives as long as this process: bwrap's --die-with-parent ends
        # the kernel when the THREAD that started it ends (Linux's parent-death signal).
        started = _launcher().submit(
            launch_kernel,
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=into_log,
            stderr=into_log,
            env=_kernel_env(spec.env, config, runtime_dir),
            cwd=handle.workdir,
            pass_fds=tuple(passed),
        )
        process = started.result()
        _launched[handle.sandbox_id] = process
        (runtime_dir / "kernel.pid").write_text(str(process.pid))
        guard = {
            "parent": os.getpid(),
            "group": process.pid,
            "log": str(runtime_dir / "kernel.log"),
            "log_bytes": KERNEL_LOG_BYTES,
        }
        _guards[handle.sandbox_id] = subprocess.Popen(
            [
                sys.executable,
                "-I",
                "-S",
                "-c",
                source("kernel_guard"),
                json.dumps(guard, ensure_ascii=False),
            ],
            stdin=output,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
    finally:
        for descriptor in (output, into_log, *passed):
            os.close(descriptor)
    return spec


def _hand_over(paths: list[Path], handle: SandboxHandle, config: LocalKernelConfig) -> None:
    """Make ``paths`` the kernel's user's, not following links (a no-op unless that user is
    another than ours: this process is root); nothing inside a folder is touched."""
    uid, gid = _kernel_user(handle, config)
    if uid == os.getuid():
        return
    for path in paths:
        os.chown(path, uid, gid, follow_symlinks=False)


def _write_ipython_folder(handle: SandboxHandle) -> list[Path]:
    """Write our config and startup file in the kernel's IPython folder (`_launch`).

    The kernel may write that folder, so `write_ipython_startup` follows no link there; each
    link it finds in place of our folders or files (planted from inside the sandbox before a
    restart) is removed and named in a warning. What else the folder holds stays.

    Returns:
        The folders and files written, to hand over to the kernel's user.
    """
    folder = Path(handle.connection["runtime_dir"]) / "ipython"
    for path in write_ipython_startup(folder):
        logger.warning(
            "Sandbox %s: %s was replaced from inside the sandbox (a link or another file): "
            "removed, not written through",
            handle.sandbox_id,
            path,
        )
    profile = folder / "profile_default"
    return [
        folder,
        profile,
        profile / "startup",
        profile / "startup" / STARTUP_FILE_NAME,
        profile / "ipython_kernel_config.py",
    ]


def _forget_killed_elsewhere() -> None:
    """Reap the kernels this process launched that another process killed (a stage task on
    another Dask worker, say), and stop their guards: until then each stays a zombie, and its
    guard, which sees a zombie's group as alive, keeps running."""
    for sandbox_id, process in list(_launched.items()):
        if process.poll() is not None and not (runtime_base() / sandbox_id).exists():
            # Launches run in threads: another one may have forgotten it meanwhile.
            _launched.pop(sandbox_id, None)
            guard = _guards.pop(sandbox_id, None)
            if guard is not None:
                guard.kill()
                _wait_after_kill(guard, f"guard of sandbox {sandbox_id}")
    _slow_to_exit[:] = [process for process in _slow_to_exit if process.poll() is None]


def _wait_after_kill(process: subprocess.Popen[bytes], what: str) -> None:
    """Wait up to 10 s for ``process``, sent SIGKILL, to exit. Past that it is logged and kept
    for the next launch to reap: a kill goes on to the sandbox's cgroup and uid rather than fail."""
    try:
        process.wait(timeout=_REAP_WAIT_S)
    except subprocess.TimeoutExpired:
        logger.warning(
            "The %s (pid %d) had not exited %.0f s after SIGKILL; going on",
            what,
            process.pid,
            _REAP_WAIT_S,
        )
        _slow_to_exit.append(process)


@functools.cache
def _launcher() -> ThreadPoolExecutor:
    """The one thread that starts kernels; it lives until this process exits."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefect-sandbox-launcher")


def _destroy(handle: SandboxHandle) -> bool:
    """Kill the sandbox's kernel, if any, remove its folders and release its uid (every
    process left of that uid killed first); False if already gone."""
    runtime_dir = Path(handle.connection["runtime_dir"])
    uid = handle.connection.get("uid")
    if not runtime_dir.exists():
        cgroup = _sandbox_cgroup(handle)
        if cgroup is not None:
            cgroup.kill_and_remove()
        if uid is not None:
            release_uid(uid, handle.sandbox_id)
        return False
    try:
        pid = int((runtime_dir / "kernel.pid").read_text())
    except FileNotFoundError:
        pass
    else:
        _kill_process_group(handle.sandbox_id, pid)
    cgroup = _sandbox_cgroup(handle)
    if cgroup is not None:
        cgroup.kill_and_remove()
    if uid is not None:
        release_uid(uid, handle.sandbox_id)
    owned = Path(handle.workdir) if handle.connection.get("owns_workdir") else None
    remove_folders(runtime_dir, owned)
    return True


def _kill_process_group(sandbox_id: str, pid: int) -> None:
    """SIGKILL the kernel's process group and wait until the kernel is gone."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    guard = _guards.pop(sandbox_id, None)
    if guard is not None:
        guard.kill()
        _wait_after_kill(guard, f"guard of sandbox {sandbox_id}")
    process = _launched.pop(sandbox_id, None)
    if process is not None:
        _wait_after_kill(process, f"kernel of sandbox {sandbox_id}")
        return
    deadline = time.monotonic() + _REAP_WAIT_S
    while _process_state(pid) not in (None, "Z") and time.monotonic() < deadline:
        time.sleep(0.01)
