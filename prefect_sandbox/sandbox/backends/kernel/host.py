"""Folders on this machine that the sandboxes whose kernels it reaches keep: local kernels'
(`local`) and Docker containers' (`docker`), whose working directory and kernel folder are
bind mounts of host folders.

Each sandbox has a private runtime folder (connection files, sockets, pid, labels) under
`runtime_base`, and a working directory that it owns unless the caller gave one.
Manual: docs/backends/local.md.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from prefect_sandbox.sandbox.errors import SandboxUnavailableError

__all__ = [
    "UNIX_SOCKET_PATH_MAX_BYTES",
    "new_runtime_dir",
    "new_workdir",
    "remove_folders",
    "runtime_base",
]

UNIX_SOCKET_PATH_MAX_BYTES = 107
"""Linux's ``sun_path`` holds 108 bytes with the terminating NUL (unix(7)); zmq refuses longer."""
# The longest socket path under a runtime folder: the host's pinned links, a two-digit port.
_LONGEST_SOCKET = Path("sock") / "k-99"


def runtime_base() -> Path:
    """The folder (mode 0700, made if missing) that holds this user's sandboxes' runtime
    folders: short, so IPC socket paths stay under the 107-byte limit of Unix sockets."""
    base = Path(tempfile.gettempdir()) / f"prefect-sandbox-{os.getuid()}"
    base.mkdir(mode=0o700, exist_ok=True)
    return base


def new_runtime_dir(sandbox_id: str) -> Path:
    """A new runtime folder for a kernel's connection file and IPC sockets (mode 0700).

    Raises:
        SandboxUnavailableError: its kernel sockets' paths would pass the Unix socket limit
            (a long TMPDIR); the message names TMPDIR, the paths' length and the limit.
    """
    runtime_dir = runtime_base() / sandbox_id
    longest = len(os.fsencode(runtime_dir / _LONGEST_SOCKET))
    if longest > UNIX_SOCKET_PATH_MAX_BYTES:
        temp = tempfile.gettempdir()
        room = UNIX_SOCKET_PATH_MAX_BYTES - (longest - len(os.fsencode(temp)))
        raise SandboxUnavailableError(
            f"the temporary folder (TMPDIR={temp}, {len(os.fsencode(temp))} bytes) is too long "
            f"for a local kernel's IPC sockets: their paths under it reach {longest} bytes, "
            f"over the {UNIX_SOCKET_PATH_MAX_BYTES}-byte limit of Unix socket paths; set TMPDIR "
            f"to a folder of at most {room} bytes (e.g. /tmp)",
            operation="create",
        )
    runtime_dir.mkdir(mode=0o700)
    return runtime_dir


def new_workdir(sandbox_id: str, workdir_root: Path | None) -> Path:
    """A new working directory for a sandbox: under ``workdir_root`` (made if missing), else
    in the temporary folder."""
    if workdir_root is not None:
        workdir_root.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f"{sandbox_id}-", dir=workdir_root))
    return Path(tempfile.mkdtemp(prefix=f"prefect-sandbox-{sandbox_id}-"))


def remove_folders(runtime_dir: Path, owned_workdir: Path | None) -> None:
    """Remove a sandbox's runtime folder and, when it owns one, its working directory; what
    is already gone is no error."""
    shutil.rmtree(runtime_dir, ignore_errors=True)
    if owned_workdir is not None:
        shutil.rmtree(owned_workdir, ignore_errors=True)
