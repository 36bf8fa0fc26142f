"""Reaching a kernel's IPC sockets only through links this side made and checked.

A kernel binds its sockets in a folder it may write (``ipc/k-1``, ...), so a cell can replace
them with symbolic links to any socket of the host, which a client connecting by that name
(and zmq reconnects by name, again and again) would then reach. So the host never connects
there. Once the kernel has bound its sockets, `pin_sockets` hard-links each socket we use
into a folder only the host writes, WITHOUT following links (a planted link stays a link),
and `check_pinned` accepts a pinned name only if it is a socket owned by the sandbox's user:
what the kernel made, never a file of the cell's choosing. Clients connect to the pinned names
alone (the connection file the host reads names that folder). Manual: docs/backends/local.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import stat
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from prefect_sandbox.sandbox.errors import SandboxDiedError, UnsafePathError

__all__ = ["PINNED_CHANNELS", "check_pinned", "clear_sockets", "pin_sockets"]

PINNED_CHANNELS = ("shell", "iopub")
"""The channels this package's clients open (no stdin, heartbeat or control)."""

_POLL_S = 0.01

logger = logging.getLogger(__name__)


def _socket_names(prefix: Path, connection: Mapping[str, Any]) -> list[Path]:
    """The socket paths of `PINNED_CHANNELS` for a kernel whose IPC prefix is ``prefix``."""
    return [Path(f"{prefix}-{connection[f'{channel}_port']}") for channel in PINNED_CHANNELS]


def _check_socket(path: Path, owner_uid: int, sandbox_id: str, named: Path) -> None:
    """Accept ``path`` only as a socket owned by ``owner_uid``; else remove it and refuse,
    naming the file as ``named`` (where the kernel made it)."""
    info = path.lstat()
    if stat.S_ISSOCK(info.st_mode) and info.st_uid == owner_uid:
        return
    path.unlink()
    kind = "a symbolic link" if stat.S_ISLNK(info.st_mode) else "not the kernel's socket"
    message = (
        f"sandbox {sandbox_id}: refused to connect to {named} ({kind}: "
        f"{stat.filemode(info.st_mode)}, uid {info.st_uid}); the kernel's socket was replaced "
        "from inside the sandbox"
    )
    logger.warning("%s", message)
    raise UnsafePathError(message, path=str(path), sandbox_id=sandbox_id)


def check_pinned(
    pinned_prefix: Path, connection: Mapping[str, Any], owner_uid: int, sandbox_id: str
) -> None:
    """Check that each pinned socket is a socket the sandbox's user made.

    Args:
        pinned_prefix: the IPC prefix in the host's own folder (``.../sock/k``).
        connection: the connection info (its ``*_port`` fields).
        owner_uid: the host uid the kernel runs as.
        sandbox_id: the sandbox, for messages.

    Raises:
        FileNotFoundError: one is not pinned (yet).
        UnsafePathError: one is something else (a link, a file), or another user's; it is
            removed, and a warning names it.
    """
    for path in _socket_names(pinned_prefix, connection):
        _check_socket(path, owner_uid, sandbox_id, path)


async def pin_sockets(
    kernel_prefix: Path,
    pinned_prefix: Path,
    connection: Mapping[str, Any],
    *,
    owner_uid: int,
    sandbox_id: str,
    check_alive: Callable[[], Awaitable[None]],
    timeout_s: float,
) -> None:
    """Wait for the kernel to bind its sockets, then pin them, each checked before it takes its
    pinned name (so a client retrying that name never meets an unchecked file).

    Args:
        kernel_prefix: the kernel's IPC prefix, as a host path (``.../ipc/k``).
        pinned_prefix: the IPC prefix in the host's own folder.
        connection: the connection info (its ``*_port`` fields).
        owner_uid: the host uid the kernel runs as.
        sandbox_id: the sandbox, for messages.
        check_alive: raises `SandboxDiedError` once the kernel has ended.
        timeout_s: the longest wait for the sockets, in seconds.

    Raises:
        SandboxDiedError: the kernel ended, or made no sockets within ``timeout_s``.
        UnsafePathError: what the kernel left there is not its socket (see `check_pinned`).
    """
    pinned_prefix.parent.mkdir(mode=0o700, exist_ok=True)
    deadline = time.monotonic() + timeout_s
    for source, pinned in zip(
        _socket_names(kernel_prefix, connection),
        _socket_names(pinned_prefix, connection),
        strict=True,
    ):
        candidate = pinned.with_name(f"{pinned.name}.new")
        while True:
            await check_alive()
            with contextlib.suppress(FileNotFoundError):
                candidate.unlink()
            try:
                os.link(source, candidate, follow_symlinks=False)
                break
            except FileNotFoundError:
                if time.monotonic() >= deadline:
                    raise SandboxDiedError(
                        f"kernel of sandbox {sandbox_id} made no socket {source.name} within "
                        f"{timeout_s} s",
                        sandbox_id=sandbox_id,
                    ) from None
                await asyncio.sleep(_POLL_S)
        _check_socket(candidate, owner_uid, sandbox_id, source)
        candidate.replace(pinned)


def clear_sockets(prefixes: Iterable[Path], connection: Mapping[str, Any]) -> None:
    """Remove the kernel's sockets and their pinned links, while no kernel runs (a restart):
    the next kernel's must not be taken for old ones. Removing never follows a link."""
    for prefix in prefixes:
        for path in _socket_names(prefix, connection):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
