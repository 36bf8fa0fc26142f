"""A pipeline's local staging folder, and the removal of those a killed process left.

A run stages its downloaded inputs, artifacts and notebook in a temporary folder, removed on
every way out the process can still act on (return, exception, cancellation, SIGINT and SIGTERM
through the CLI, interpreter exit). A SIGKILLed process cannot: its folder stays. The folder's
name carries its owner's pid namespace, pid and start time
(``prefect-sandbox-staging-ns<pidns>-<pid>-<start>-...``; the ``ns`` keeps an earlier version,
which read ``<pid>-<start>`` there, from misreading it), so `remove_orphaned_staging_dirs` (the
reaper and each new run call it) removes only folders whose owner is gone: a pid reused by
another process does not match the start time, and a folder made in another pid namespace (a
container sharing the folder) is never judged. Manual: docs/how-to/reaper.md.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = ["STAGING_PREFIX", "orphaned_staging_dirs", "remove_orphaned_staging_dirs", "staging_dir"]

STAGING_PREFIX = "prefect-sandbox-staging-"

logger = logging.getLogger(__name__)


def _start_ticks(pid: int) -> int | None:
    """When the process started, in clock ticks since boot (/proc); None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # Fields after the command's closing parenthesis; the start time is field 22 of the line.
    return int(stat.rsplit(")", 1)[1].split()[19])


def _pid_namespace() -> int | None:
    """The inode of this process's pid namespace; None without /proc."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def _owner_tag() -> str:
    pid = os.getpid()
    return f"ns{_pid_namespace() or 0}-{pid}-{_start_ticks(pid) or 0}"


@contextlib.contextmanager
def staging_dir() -> Iterator[Path]:
    """A new staging folder owned by this process, removed when the block is left.

    Yields:
        Its path, in the system's temporary folder.
    """
    with tempfile.TemporaryDirectory(
        prefix=f"{STAGING_PREFIX}{_owner_tag()}-", ignore_cleanup_errors=True
    ) as path:
        yield Path(path)


def orphaned_staging_dirs(root: Path | None = None) -> list[Path]:
    """Staging folders in ``root`` whose owning process is gone.

    Args:
        root: where to look; None for the system's temporary folder.

    Returns:
        The folders, sorted; those of live processes, of other users, or with names this
        version did not make are left out.
    """
    namespace = _pid_namespace()
    if namespace is None or _start_ticks(os.getpid()) is None:
        return []  # no /proc: whether an owner is alive cannot be told
    found = []
    base = Path(root or tempfile.gettempdir())
    for path in base.glob(f"{STAGING_PREFIX}ns{namespace}-*"):
        pid, _, rest = path.name.removeprefix(f"{STAGING_PREFIX}ns{namespace}-").partition("-")
        start, _, _ = rest.partition("-")
        if not (pid.isdigit() and start.isdigit()):
            continue
        try:
            info = path.lstat()
        except FileNotFoundError:
            continue  # its owner removed it since the listing
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            continue
        if _start_ticks(int(pid)) != int(start):
            found.append(path)
    return sorted(found)


def remove_orphaned_staging_dirs(root: Path | None = None) -> list[Path]:
    """Remove the staging folders whose owning process is gone (see `orphaned_staging_dirs`).

    Returns:
        The folders removed; one that could not be is logged as a warning and left out.
    """
    removed = []
    for path in orphaned_staging_dirs(root):
        try:
            shutil.rmtree(path)
        except OSError as exc:
            logger.warning("Staging folder %s of a process that is gone not removed: %s", path, exc)
            continue
        removed.append(path)
    if removed:
        logger.info("Removed %d staging folder(s) of processes that are gone", len(removed))
    return removed
