"""Keeping file paths inside a sandbox's working directory, and safe folder names for runs.
Pure functions, no I/O but `resolve`."""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath

from prefect_sandbox.sandbox.errors import FileTransferError, UnsafePathError

__all__ = [
    "checked_relative_path",
    "checked_upload_source",
    "path_segment",
    "resolve_inside",
    "run_folder_name",
]

SEGMENT_MAX_CHARS = 64
_NOT_SEGMENT_CHARS = re.compile(r"[^\w.-]+")


def checked_upload_source(src: Path, dest: str) -> None:
    """Check that a local file to upload to ``dest`` exists and is a regular file.

    Raises:
        FileTransferError: it is not (names ``src``; ``path`` is ``dest``).
    """
    if not src.is_file():
        raise FileTransferError(f"upload source {str(src)!r} is not a file", path=dest)


def checked_relative_path(path: str) -> PurePosixPath:
    """Check that ``path`` is relative and never climbs with ``..``.

    Args:
        path: a POSIX path as a user wrote it, relative to the working directory.

    Returns:
        The path, normalised (``./a//b`` becomes ``a/b``); names are kept byte for byte.

    Raises:
        UnsafePathError: the path is empty, absolute, or has a ``..`` part.
    """
    pure = PurePosixPath(path)
    if not path or pure.is_absolute() or path.startswith("~"):
        raise UnsafePathError(f"path {path!r} must be relative to the working directory", path=path)
    if ".." in pure.parts:
        raise UnsafePathError(f"path {path!r} leaves the working directory", path=path)
    if pure == PurePosixPath("."):
        raise UnsafePathError(f"path {path!r} names the working directory itself", path=path)
    return pure


def resolve_inside(root: Path, path: str) -> Path:
    """Resolve ``path`` under ``root``, following symlinks, and refuse anything that leaves it.

    Args:
        root: the working directory on this machine.
        path: a relative POSIX path.

    Returns:
        The absolute path on this machine, symlinks resolved.

    Raises:
        UnsafePathError: the path is absolute, climbs with ``..``, or resolves (through a
            symlink) outside ``root``.
    """
    relative = checked_relative_path(path)
    real_root = root.resolve()
    resolved = (real_root / relative).resolve()
    if not resolved.is_relative_to(real_root):
        raise UnsafePathError(
            f"path {path!r} resolves outside the working directory (through a symlink)", path=path
        )
    return resolved


def path_segment(text: str) -> str:
    """A slug of ``text`` that is one safe path segment (a folder name or an S3 key part).

    Runs of characters other than letters, digits, ``_``, ``.`` and ``-`` (any script) become
    one ``-``; leading and trailing dots and dashes go, so the result is never ``.`` or ``..``;
    it is cut at `SEGMENT_MAX_CHARS` characters.

    Args:
        text: any text, e.g. a flow-run name such as ``"../x"`` or ``"nightly report"``.

    Returns:
        The slug, e.g. ``"x"`` or ``"nightly-report"``; empty when nothing of ``text`` is left.
    """
    return _NOT_SEGMENT_CHARS.sub("-", text).strip(".-")[:SEGMENT_MAX_CHARS].rstrip(".-")


def run_folder_name(flow_run_name: str, flow_run_id: str) -> str:
    """The one path segment a flow run's files are stored under: its name's slug and short id.

    Two runs with the same name get different folders; a name with ``/``, ``..`` or an
    absolute path stays one segment inside the storage folder.

    Args:
        flow_run_name: the flow run's name, as Prefect or the user made it.
        flow_run_id: the flow run's UUID as a string.

    Returns:
        ``"<slug of the name>-<8 hex digits of the id>"``, e.g. ``"happy-cat-1f2e3d4c"``; the
        8 hex digits alone when the name has no usable character.
    """
    # The id's last digits: Prefect makes uuid7 ids too, whose first digits are a timestamp.
    short_id = flow_run_id.replace("-", "")[-8:]
    slug = path_segment(flow_run_name)
    return f"{slug}-{short_id}" if slug else short_id
