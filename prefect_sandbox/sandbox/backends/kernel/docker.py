"""`DockerSandbox`: an ipykernel in a Docker container of its own, driven through jupyter_client.

Needs the docker SDK (the ``docker`` extra) and a daemon on this machine: the kernel's IPC
sockets and working directory are bind mounts of host folders. Each container has no network by
default, a read-only root, a fresh ``/tmp``, no capabilities, ``no-new-privileges``, a non-root
user and limits; it sees the image, ``/work`` and its kernel folder, and the configured
environment. tini is PID 1, so a kernel killed by signal N exits the container with 128+N. The
host keeps its own connection file with the sockets as links it pinned, never by their names in
the folder the container may replace. Files go in through ``put_archive`` (which resolves paths
inside the container) and come out through the bind mount as a local kernel's do
(`kernel.workdir`). Containers carry the sandbox's labels, so `list_handles` finds them; one
outlives the process that made it (kill it, or let a reaper). Manual: docs/backends/docker.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import tarfile
import tempfile
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path, PurePosixPath
from typing import IO, TYPE_CHECKING, Any

from jupyter_client.connect import write_connection_file

from prefect_sandbox.sandbox.backends import import_extra, run_to_end_in_thread, translated
from prefect_sandbox.sandbox.backends.kernel.host import (
    new_runtime_dir,
    new_workdir,
    remove_folders,
)
from prefect_sandbox.sandbox.backends.kernel.jupyter import (
    JupyterKernelConfig,
    JupyterKernelSandbox,
    connection_file_of,
    write_ipython_startup,
)
from prefect_sandbox.sandbox.backends.kernel.uids import DEFAULT_UID_RANGE, claim_uid, release_uid
from prefect_sandbox.sandbox.base import KernelInfo, SandboxHandle
from prefect_sandbox.sandbox.errors import (
    FileTransferError,
    SandboxError,
    SandboxNotFoundError,
    SandboxUnavailableError,
)
from prefect_sandbox.sandbox.paths import checked_relative_path, resolve_inside

if TYPE_CHECKING:
    import docker
    from docker.models.containers import Container

__all__ = [
    "BACKEND_SLUG",
    "CONTAINER_WORKDIR",
    "DockerSandbox",
    "DockerSandboxConfig",
    "import_sdk",
]

BACKEND_SLUG = "docker"
CONTAINER_WORKDIR = "/work"
"""The sandbox's working directory inside its container."""
_KERNEL_DIR = "/run/prefect-sandbox"
# Docker labels of our own, beside the sandbox's labels.
_BACKEND_LABEL = "prefect-sandbox.backend"
_HANDLE_LABEL = "prefect-sandbox.handle"
_STOP_WAIT_S = 10
# A liveness check is a daemon round trip (~3 ms); run_cell checks again whenever the kernel
# goes quiet, so one real check per this many seconds loses no death.
_ALIVE_RECHECK_S = 0.25
# Go's os.FileMode bits, as Docker's archive stat reports them.

logger = logging.getLogger(__name__)


def import_sdk() -> Any:
    """Import the docker SDK.

    Raises:
        BackendNotInstalledError: it is not installed; the message names the extra to install.
    """
    return import_extra("docker", extra="docker", backend="Docker")


@dataclass(frozen=True, kw_only=True)
class DockerSandboxConfig(JupyterKernelConfig):
    """Settings of Docker sandboxes (besides those of `JupyterKernelConfig`).

    Attributes:
        image: the image to run; it must start a kernel with ``python -m ipykernel_launcher``
            (``python`` on its ``PATH`` with ipykernel installed).
        docker_host: the daemon's address (``unix:///var/run/docker.sock``); None for the
            ``DOCKER_HOST`` variable or the default socket. It must be on this machine.
        cpus: CPUs the container may use (``1.5`` is one and a half); None for no limit.
        memory_limit_bytes: memory of the container, ``/tmp`` included; past it the kernel
            is killed (reported as `SandboxDiedError`). None for no limit.
        pids_limit: processes and threads the container may run at once; None for no limit.
        network_mode: Docker's network mode: ``"none"`` (no network at all), ``"bridge"``, a
            network's name, ...
        env: the only environment variables the kernel gets, besides ``HOME=/tmp`` and those
            the image sets.
        workdir_root: a host folder under which each sandbox's working directory is made
            (bind-mounted at ``/work``); None for a fresh temporary directory.
        uid_range: the host uids (first, last) containers started by a root process run as,
            one each, never two live sandboxes the same (`kernel.uids`).
    """

    image: str
    docker_host: str | None = None
    cpus: float | None = None
    memory_limit_bytes: int | None = 2 << 30
    pids_limit: int | None = 512
    network_mode: str = "none"
    env: Mapping[str, str] = field(default_factory=dict)
    workdir_root: Path | None = None
    uid_range: tuple[int, int] = DEFAULT_UID_RANGE

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.image:
            raise ValueError("image must name a Docker image")
        self._check_positive("cpus", "memory_limit_bytes", "pids_limit")


def _container_user(config: DockerSandboxConfig, sandbox_id: str, runtime_dir: Path) -> int:
    """The container's uid (and gid): ours, or one of its own when we are root (see
    `kernel.uids`: no two live sandboxes share one)."""
    if os.geteuid() == 0:
        return claim_uid(config.uid_range, sandbox_id, runtime_dir)
    return os.getuid()


def _client(config: DockerSandboxConfig) -> docker.DockerClient:
    """A client of the configured daemon (blocking: it asks the daemon's API version).

    Raises:
        SandboxUnavailableError: no daemon answers there.
    """
    sdk = import_sdk()
    with _translated("connect"):
        if config.docker_host:
            return sdk.DockerClient(base_url=config.docker_host)  # type: ignore[no-any-return]
        return sdk.from_env()  # type: ignore[no-any-return]


def _translated(
    operation: str, sandbox_id: str | None = None, *, image: str | None = None
) -> contextlib.AbstractContextManager[None]:
    """Raise `_api_error`'s mapping of what the block raises (see `translated`)."""
    return translated(partial(_api_error, operation=operation, sandbox_id=sandbox_id, image=image))


def _api_error(
    exc: Exception, operation: str, sandbox_id: str | None, image: str | None = None
) -> SandboxError | None:
    """Translate a docker SDK or transport error (the one translation point); None for any
    other exception (a bug, not Docker's failure). ``image``: the image being run."""
    import requests  # the docker SDK's transport, and so installed with it

    sdk = import_sdk()
    if not isinstance(exc, sdk.errors.DockerException | requests.RequestException):
        return None
    if operation == "connect":
        return SandboxUnavailableError(
            f"no Docker daemon answers ({exc}); start dockerd or set docker_host",
            operation=operation,
        )
    if isinstance(exc, sdk.errors.ImageNotFound) and image is not None:
        return SandboxError(
            f"Docker image {image!r} is not on this machine's daemon (docker pull it, or "
            "build it; the test image: python -m prefect_sandbox.testing.docker)",
            sandbox_id=sandbox_id,
        )
    if isinstance(exc, sdk.errors.NotFound):
        return SandboxNotFoundError(
            f"sandbox {sandbox_id} is gone (its container was removed)", sandbox_id=sandbox_id
        )
    status = getattr(getattr(exc, "response", None), "status_code", None)
    if isinstance(exc, sdk.errors.APIError) and status is not None and status < 500:
        return SandboxError(f"Docker refused {operation}: {exc}", sandbox_id=sandbox_id)
    return SandboxUnavailableError(
        f"Docker failed during {operation}: {exc}",
        status_code=status,
        operation=operation,
        sandbox_id=sandbox_id,
    )


class DockerSandbox(JupyterKernelSandbox):
    """A sandbox that is an ipykernel in a Docker container.

    Make one with `create`, reach it again with `attach` (from any thread or process on this
    machine). Cells run over `JupyterKernelSandbox`'s transport, as a local kernel's do; this
    class starts, checks, interrupts and removes the container, and puts files in through
    Docker's archive API (they come out through the bind mount, as a local kernel's do).
    """

    _config: DockerSandboxConfig

    def __init__(
        self, handle: SandboxHandle, config: DockerSandboxConfig, container: Container
    ) -> None:
        self._container = container
        self._alive_at = 0.0
        self._host_workdir = Path(handle.connection["host_workdir"])
        # The host's copy of the connection file: the same key, the sockets pinned beside it.
        runtime_dir = Path(handle.connection["runtime_dir"])
        super().__init__(
            handle,
            config,
            connection_file_of(handle),
            self._host_workdir,
            kernel_sockets=runtime_dir / "kernel" / "k",
            socket_owner=int(handle.connection["user"].split(":")[0]),
        )

    @classmethod
    async def create(
        cls, config: DockerSandboxConfig, labels: Mapping[str, str] | None = None
    ) -> DockerSandbox:
        """Start a container with a kernel and wait until the kernel answers.

        Args:
            config: the sandbox settings.
            labels: labels to find the sandbox by later (flow run id and name, ...).

        Returns:
            The live sandbox.

        Raises:
            BackendNotInstalledError: the docker SDK is not installed.
            SandboxUnavailableError: no Docker daemon answers, or it failed.
            SandboxError: Docker refused the settings (an unknown image, network, ...).
            SandboxDiedError: the kernel exited during start-up, or did not answer within
                ``startup_timeout_s``.
        """
        sandbox_id = f"docker-{uuid.uuid4().hex[:12]}"
        runtime_dir = new_runtime_dir(sandbox_id)
        host_workdir = new_workdir(sandbox_id, config.workdir_root)
        uid = await asyncio.to_thread(_container_user, config, sandbox_id, runtime_dir)
        gid = uid if os.geteuid() == 0 else os.getgid()
        handle = SandboxHandle(
            backend=BACKEND_SLUG,
            sandbox_id=sandbox_id,
            workdir=CONTAINER_WORKDIR,
            labels=dict(labels or {}),
            connection={
                "container": f"prefect-sandbox-{sandbox_id}",
                "runtime_dir": str(runtime_dir),
                "host_workdir": str(host_workdir),
                "owns_workdir": True,
                "user": f"{uid}:{gid}",
                "owns_uid": os.geteuid() == 0,
            },
        )
        sandbox: DockerSandbox | None = None
        try:
            await asyncio.to_thread(_prepare_folders, runtime_dir, host_workdir, uid, gid)
            docker_client = await asyncio.to_thread(_client, config)
            try:
                with _translated("create", sandbox_id, image=config.image):
                    container = await run_to_end_in_thread(
                        _run_container, docker_client, handle, config, runtime_dir, host_workdir
                    )
            except BaseException:
                docker_client.close()
                raise
            sandbox = cls(handle, config, container)
            await sandbox._handshake()
            kernelspec = {
                "name": "python3",
                "display_name": f"Python 3 (Docker {config.image})",
                "language": "python",
            }
            # Asked of the kernel itself, as for a local kernel: its kernel_info reply.
            language_info = await sandbox._language_info()
            sandbox._handle = handle.model_copy(
                update={"kernel": KernelInfo(kernelspec=kernelspec, language_info=language_info)}
            )
        except BaseException:
            # Its client's sockets, left open, would be closed (with a warning) by the GC.
            if sandbox is not None:
                await sandbox.close()
            try:
                await asyncio.to_thread(_destroy, handle, config)
            except SandboxError as cleanup:
                logger.warning("Sandbox %s: clean-up after a failed start: %s", sandbox_id, cleanup)
            raise
        return sandbox

    @classmethod
    async def attach(cls, handle: SandboxHandle, config: DockerSandboxConfig) -> DockerSandbox:
        """Reach a sandbox again, from this or another thread or process on this machine.

        Args:
            handle: the sandbox's handle.
            config: the sandbox settings (the daemon's address, the cell settings).

        Returns:
            The sandbox, its kernel state intact. File calls work even if the kernel has died.

        Raises:
            SandboxNotFoundError: the sandbox was killed (its container or folders are gone).
            SandboxUnavailableError: no Docker daemon answers.
        """
        cls._check_connection_file(handle)
        docker_client = await asyncio.to_thread(_client, config)
        try:
            with _translated("attach", handle.sandbox_id):
                container = await asyncio.to_thread(
                    docker_client.containers.get, handle.connection["container"]
                )
        except BaseException:
            docker_client.close()
            raise
        return cls(handle, config, container)

    @classmethod
    async def list_handles(
        cls, config: DockerSandboxConfig, labels: Mapping[str, str] | None = None
    ) -> list[SandboxHandle]:
        """Handles of the daemon's sandbox containers whose labels include ``labels``.

        Containers whose kernel has ended are listed too, until they are killed.

        Args:
            config: where the daemon is.
            labels: labels every returned sandbox carries; None or empty for all.

        Returns:
            Handles sorted by sandbox id.

        Raises:
            SandboxUnavailableError: no Docker daemon answers, or it failed.
        """
        filters = [f"{_BACKEND_LABEL}={BACKEND_SLUG}"]
        filters += [f"{name}={value}" for name, value in (labels or {}).items()]
        docker_client = await asyncio.to_thread(_client, config)
        try:
            with _translated("list"):
                # docker-py inspects each listed container; one killed meanwhile (another
                # process's sandbox) would fail the whole list with NotFound.
                containers = await asyncio.to_thread(
                    docker_client.containers.list,
                    all=True,
                    filters={"label": filters},
                    ignore_removed=True,
                )
        finally:
            docker_client.close()
        handles = [
            SandboxHandle.model_validate_json(container.labels[_HANDLE_LABEL])
            for container in containers
            if _HANDLE_LABEL in container.labels
        ]
        return sorted(handles, key=lambda handle: handle.sandbox_id)

    async def upload(self, src: Path, dest: str) -> None:
        """Copy a local file into the working directory (see `Sandbox.upload`).

        Goes through Docker's archive API, so the container's own view of the path is used.
        """
        relative = checked_relative_path(dest)
        # Refuse what the host can already see leaves the folder (a symlink to "/etc"); the
        # archive API resolves the rest inside the container.
        resolve_inside(self._host_workdir, dest)
        if not src.is_file():
            raise FileTransferError(f"upload source {str(src)!r} is not a file", path=dest)
        uid, gid = (int(part) for part in self._handle.connection["user"].split(":"))
        done = await asyncio.to_thread(self._put_file, src, dest, relative, uid, gid)
        if not done:
            raise FileTransferError(
                f"Docker did not write {dest!r} into sandbox {self._handle.sandbox_id}",
                path=dest,
                sandbox_id=self._handle.sandbox_id,
            )

    def _put_file(self, src: Path, dest: str, relative: PurePosixPath, uid: int, gid: int) -> bool:
        """Put ``src`` at ``relative`` (``dest`` as given) in the working directory (blocking),
        errors translated by `_file_error`."""
        with translated(partial(self._file_error, operation="upload", path=dest)):
            return self._put_archive(src, relative, uid, gid)

    def _put_archive(self, src: Path, relative: PurePosixPath, uid: int, gid: int) -> bool:
        # The tar goes through a temporary file, so a large upload is streamed, not held.
        with tempfile.TemporaryFile() as archive:
            _write_tar(archive, src, relative, uid, gid)
            archive.seek(0)
            return self._container.put_archive(CONTAINER_WORKDIR, archive)

    def _file_error(self, exc: Exception, operation: str, path: str) -> SandboxError:
        """Translate an error of a file call (blocking: it may ask the daemon whether the
        container is still there)."""
        sdk = import_sdk()
        if isinstance(exc, sdk.errors.NotFound):
            if not self._container_exists():
                return SandboxNotFoundError(
                    f"sandbox {self._handle.sandbox_id} is gone (its container was removed)",
                    sandbox_id=self._handle.sandbox_id,
                )
            return FileTransferError(
                f"file {path!r} is not in sandbox {self._handle.sandbox_id}",
                path=path,
                sandbox_id=self._handle.sandbox_id,
            )
        if isinstance(exc, sdk.errors.APIError) and exc.is_client_error():
            return FileTransferError(
                f"{operation} of {path!r} refused in sandbox {self._handle.sandbox_id}: {exc}",
                path=path,
                sandbox_id=self._handle.sandbox_id,
            )
        mapped = _api_error(exc, operation, self._handle.sandbox_id)
        if mapped is not None:
            return mapped
        # A local file that cannot be written, or a broken archive.
        return FileTransferError(
            f"{operation} of {path!r} failed in sandbox {self._handle.sandbox_id}: {exc}",
            path=path,
            sandbox_id=self._handle.sandbox_id,
        )

    def _container_exists(self) -> bool:
        sdk = import_sdk()
        try:
            self._container.reload()
        except sdk.errors.NotFound:
            return False
        return True

    async def interrupt(self) -> None:
        """Send SIGINT to the kernel (through the container's init), as Jupyter does."""
        try:
            with _translated("interrupt", self._handle.sandbox_id):
                await asyncio.to_thread(self._container.kill, signal="SIGINT")
        except SandboxError:
            self._alive_at = 0.0  # it may have died since the last check: look now
            await self._check_alive()
            raise

    async def restart(self) -> None:
        """Restart the container: a fresh kernel, the same working directory and handle."""
        await self.close()
        with _translated("restart", self._handle.sandbox_id):
            await run_to_end_in_thread(_stop_container, self._container)
            # Stopped, it writes nothing: its old sockets go, not to be taken for new ones.
            self._clear_sockets()
            await run_to_end_in_thread(self._container.start)
        self._alive_at = 0.0
        await self._reconnect()

    async def kill(self) -> bool:
        """Remove the container and the sandbox's folders. Idempotent.

        Returns:
            True if this call ended the sandbox, False if it was already gone.
        """
        await self.close()
        with _translated("kill", self._handle.sandbox_id):
            return await run_to_end_in_thread(_destroy, self._handle, self._config)

    async def _check_alive(self, reason: str | None = None) -> None:
        """Raise `SandboxDiedError` if the container has stopped; ``reason`` says why.

        The daemon is asked in a thread, at most once per `_ALIVE_RECHECK_S`.
        """
        if time.monotonic() - self._alive_at < _ALIVE_RECHECK_S:
            return
        with _translated("inspect", self._handle.sandbox_id):
            await asyncio.to_thread(self._container.reload)
        state = (self._container.attrs or {}).get("State", {})
        if state.get("Running"):
            self._alive_at = time.monotonic()
            return
        code = int(state.get("ExitCode", 0))
        # Docker's init exits with 128+N when the kernel dies of signal N.
        exit_code, signum = (None, code - 128) if code > 128 else (code, None)
        cause = None
        if state.get("OOMKilled"):
            cause = f"out of memory (limit {self._config.memory_limit_bytes} bytes)"
        raise self._kernel_died(exit_code=exit_code, signal=signum, cause=cause, reason=reason)


def _write_tar(out: IO[bytes], src: Path, relative: PurePosixPath, uid: int, gid: int) -> None:
    """Write a tar of ``src`` at ``relative``, with its parent folders, owned by ``uid:gid``."""
    with tarfile.open(fileobj=out, mode="w") as archive:
        for parent in reversed(relative.parents[:-1]):
            folder = tarfile.TarInfo(parent.as_posix())
            folder.type = tarfile.DIRTYPE
            folder.mode = 0o755
            folder.uid, folder.gid = uid, gid
            folder.mtime = int(time.time())
            archive.addfile(folder)
        info = archive.gettarinfo(str(src), arcname=relative.as_posix())
        info.uid, info.gid = uid, gid
        info.uname = info.gname = ""
        info.mode = 0o644
        with open(src, "rb") as data:
            archive.addfile(info, data)


def _prepare_folders(runtime_dir: Path, host_workdir: Path, uid: int, gid: int) -> None:
    """Write the kernel's folder (connection file, IPython startup) and hand it to its user."""
    kernel_dir = runtime_dir / "kernel"
    kernel_dir.mkdir(mode=0o700)
    key = secrets.token_hex(16).encode()
    # The kernel's view (container paths); the host keeps its own copy of the same key.
    write_connection_file(
        fname=str(kernel_dir / "connection.json"),
        ip=f"{_KERNEL_DIR}/k",
        key=key,
        transport="ipc",
    )
    # The host reaches the sockets only through links it pins in its own folder.
    write_connection_file(
        fname=str(runtime_dir / "connection.json"),
        ip=str(runtime_dir / "sock" / "k"),
        key=key,
        transport="ipc",
    )
    write_ipython_startup(kernel_dir / "ipython")
    host_workdir.chmod(0o700)
    if (uid, gid) != (os.getuid(), os.getgid()):
        for folder in (kernel_dir, host_workdir):
            for path in [folder, *folder.rglob("*")]:
                os.chown(path, uid, gid)


def _run_container(
    client: docker.DockerClient,
    handle: SandboxHandle,
    config: DockerSandboxConfig,
    runtime_dir: Path,
    host_workdir: Path,
) -> Container:
    labels = {
        **handle.labels,
        _BACKEND_LABEL: BACKEND_SLUG,
        _HANDLE_LABEL: handle.model_dump_json(),
    }
    environment = {
        "HOME": "/tmp",
        "IPYTHONDIR": f"{_KERNEL_DIR}/ipython",
        **config.env,
    }
    return client.containers.run(
        config.image,
        ["python", "-m", "ipykernel_launcher", "-f", f"{_KERNEL_DIR}/connection.json"],
        name=handle.connection["container"],
        detach=True,
        init=True,
        user=handle.connection["user"],
        working_dir=CONTAINER_WORKDIR,
        environment=environment,
        labels=labels,
        network_mode=config.network_mode,
        read_only=True,
        tmpfs={"/tmp": "rw,nosuid,nodev,mode=1777"},
        volumes={
            str(host_workdir): {"bind": CONTAINER_WORKDIR, "mode": "rw"},
            str(runtime_dir / "kernel"): {"bind": _KERNEL_DIR, "mode": "rw"},
        },
        cap_drop=["ALL"],
        security_opt=["no-new-privileges"],
        mem_limit=config.memory_limit_bytes,
        # Equal to the memory limit: no swap on top of it.
        memswap_limit=config.memory_limit_bytes,
        nano_cpus=None if config.cpus is None else int(config.cpus * 1e9),
        pids_limit=config.pids_limit,
        stdin_open=False,
    )


def _stop_container(container: Container) -> None:
    sdk = import_sdk()
    with contextlib.suppress(sdk.errors.APIError):  # 409: it is not running
        container.kill()
    container.wait(timeout=_STOP_WAIT_S)


def _destroy(handle: SandboxHandle, config: DockerSandboxConfig) -> bool:
    """Remove the sandbox's container and folders; False if all were already gone."""
    sdk = import_sdk()
    runtime_dir = Path(handle.connection["runtime_dir"])
    existed = runtime_dir.exists()
    client = _client(config)
    try:
        container = client.containers.get(handle.connection["container"])
        container.remove(force=True)
        existed = True
    except sdk.errors.NotFound:
        pass
    finally:
        client.close()
    if handle.connection.get("owns_uid"):
        release_uid(int(handle.connection["user"].split(":")[0]), handle.sandbox_id)
    owned = handle.connection.get("owns_workdir")
    remove_folders(runtime_dir, Path(handle.connection["host_workdir"]) if owned else None)
    return existed
