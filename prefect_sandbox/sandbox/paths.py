"""Keeping file paths inside a sandbox's working directory, and safe folder names for runs.
Pure functions, no I/O but `resolve`. Manual: docs/concepts.md.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
from collections.abc import Iterable
from fnmatch import fnmatchcase
from pathlib import Path, PurePath, PurePosixPath

from prefect_sandbox.sandbox.base import RemoteFile
from prefect_sandbox.sandbox.errors import FileTransferError, UnsafePathError

__all__ = [
    "DEFAULT_MAX_ARTIFACT_BYTES",
    "DEFAULT_MAX_TOTAL_ARTIFACT_BYTES",
    "check_size",
    "checked_relative_path",
    "checked_upload_source",
    "glob_match",
    "is_inside",
    "is_utf8",
    "listed_files",
    "matching_files",
    "path_segment",
    "resolve_inside",
    "run_folder_name",
    "shown_path",
]

DEFAULT_MAX_ARTIFACT_BYTES = 1 << 30
"""The largest file collected as an artifact when setting ``max_artifact_bytes`` is not given:
1 GiB."""
DEFAULT_MAX_TOTAL_ARTIFACT_BYTES = 4 << 30
"""The most bytes one run collects as artifacts when setting ``max_total_artifact_bytes`` is
not given: 4 GiB."""
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


def is_inside(path: str | PurePath, root: str | PurePath) -> bool:
    """Whether the absolute POSIX path ``path`` is ``root`` or lies below it.

    Judged on the text alone, after ``.``, ``..`` and repeated slashes are normalised away
    (a leading ``//``, which `posixpath.normpath` keeps, is taken as ``/``, as Linux does);
    links are not followed: resolve them first (``realpath``) where they count.

    Args:
        path: an absolute path, on this machine or in a sandbox.
        root: the absolute path of the folder it must stay in.
    """

    def normal(text: str | PurePath) -> PurePosixPath:
        return PurePosixPath(posixpath.normpath("/" + str(text).lstrip("/")))

    return normal(path).is_relative_to(normal(root))


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
    if not is_inside(resolved, real_root):
        raise UnsafePathError(
            f"path {path!r} resolves outside the working directory (through a symlink)", path=path
        )
    return resolved


def glob_match(pattern: str, path: str) -> bool:
    """Whether a relative POSIX path matches a glob as `pathlib.Path.glob` matches it.

    ``*``, ``?`` and ``[...]`` match within one name; ``**`` matches zero or more folders.
    """

    def match(parts: list[str], names: list[str]) -> bool:
        if not parts:
            return not names
        if parts[0] == "**":
            return any(match(parts[1:], names[i:]) for i in range(len(names) + 1))
        return bool(names) and fnmatchcase(names[0], parts[0]) and match(parts[1:], names[1:])

    return match(pattern.split("/"), path.split("/"))


def matching_files(pattern: str, paths: Iterable[str]) -> list[str]:
    """The paths an artifact pattern names: the one file it spells out, else its glob matches.

    A pattern that is, character for character (after `checked_relative_path`'s
    normalising), the path of an existing file names that file alone, even when it holds
    ``*``, ``?`` or ``[``: ``data[1].csv`` is the file of that name, not ``data1.csv``. Any
    other pattern is a glob (`glob_match`).

    Args:
        pattern: a relative glob, e.g. ``figures/*.png``.
        paths: relative POSIX paths of the files there are.

    Returns:
        The matching paths, sorted.
    """
    literal = checked_relative_path(pattern).as_posix()
    candidates = set(paths)
    if literal in candidates:
        return [literal]
    return sorted(path for path in candidates if glob_match(literal, path))


def listed_files(listing: str, pattern: str) -> list[RemoteFile]:
    """The entries of kernel_side/listing.py's printed JSON that ``pattern`` matches
    (`matching_files`)."""
    found = {path: (size, identity) for path, size, identity in json.loads(listing)}
    return [
        RemoteFile(path=path, size_bytes=found[path][0], identity=found[path][1])
        for path in matching_files(pattern, found)
    ]


def is_utf8(path: str) -> bool:
    """Whether a path's name is text: no surrogate escapes of bytes that are not UTF-8.

    `os.fsdecode` gives a name such as ``b"r\\xe9sum\\xe9.csv"`` (Latin-1) as
    ``"r\\udce9sum\\udce9.csv"``; such a ``str`` cannot be encoded as UTF-8 (JSON, S3
    keys, HTTP).
    """
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_size(path: str, size_bytes: int, max_bytes: int | None) -> None:
    """Refuse a file to collect that is larger than the cap.

    Args:
        path: the file, relative to the working directory.
        size_bytes: its size, or the bytes received of it so far.
        max_bytes: the cap (setting ``max_artifact_bytes``); None for none.

    Raises:
        FileTransferError: ``size_bytes`` is over ``max_bytes`` (names the file and the setting).
    """
    if max_bytes is not None and size_bytes > max_bytes:
        raise FileTransferError(
            f"{shown_path(path)!r} is not collected: it is over the cap of {max_bytes} bytes "
            f"({size_bytes} bytes or more; setting max_artifact_bytes)",
            path=path,
        )


def shown_path(path: str) -> str:
    """A path as text to show people and logs: bytes that are not UTF-8 as ``\\xNN``."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


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
