"""Reading a sandbox's working directory from this machine, where its cells can still write.

A kernel on this machine (local, or a container with a bind-mounted folder) may swap any file
of its working directory for a link, a FIFO or a device while the host lists or copies it, in a
loop from a thread. So nothing here acts on a path by name: every name is opened relative to
the folder opened before it (``openat``) with ``O_NOFOLLOW``, a link is read (``readlinkat``)
and resolved by hand within the working directory, and what was opened is checked with
``fstat`` before a byte is read. What a swap can change is which file inside the working
directory is read; never that a file outside it is.

Refused, each with an error naming the file: a link that leads out of the working directory
(`UnsafePathError`); anything but a regular file, a file over the size cap, and a sparse file,
whose holes were never written by the cell but would be stored as bytes
(`FileTransferError`). Manual: docs/backends/local.md.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

from prefect_sandbox.sandbox.base import RemoteFile
from prefect_sandbox.sandbox.errors import FileTransferError, UnsafePathError
from prefect_sandbox.sandbox.paths import (
    check_size,
    checked_relative_path,
    matching_files,
    shown_path,
)

__all__ = ["MAX_LINK_HOPS", "copy_out", "list_workdir"]

MAX_LINK_HOPS = 40
"""Links followed at most in one path, as Linux's own limit."""

_COPY_CHUNK_BYTES = 1 << 20
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_KINDS = {
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
    stat.S_IFDIR: "a folder",
}


def _open_root(root: Path) -> int:
    """The working directory, opened without following a link in its last part."""
    try:
        return os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
            raise FileNotFoundError(errno.ENOENT, "working directory is gone", str(root)) from exc
        raise


def _walk(folder: bytes, fd: int) -> Iterator[tuple[bytes, os.stat_result]]:
    """Every entry but folders below ``fd``, as (path relative to the root, its ``lstat``).

    Folders are opened with ``O_DIRECTORY | O_NOFOLLOW``: a link is never descended, and a
    FIFO or a device is never opened.
    """
    with os.scandir(fd) as entries:
        names = sorted(entry.name for entry in entries)
    for name in names:
        encoded = os.fsencode(name)
        relative = encoded if not folder else folder + b"/" + encoded
        try:
            info = os.stat(encoded, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            continue  # removed since the listing
        if not stat.S_ISDIR(info.st_mode):
            yield relative, info
            continue
        try:
            child = os.open(encoded, _DIR_FLAGS, dir_fd=fd)
        except OSError:
            continue  # swapped for something else, or removed, since the stat
        try:
            yield from _walk(relative, child)
        finally:
            os.close(child)


def _identity(
    root_fd: int, path: str, info: os.stat_result, sandbox_root: PurePosixPath
) -> str | None:
    """``"DEV:INODE"`` of the file ``path`` leads to, a link resolved inside the root as
    `copy_out` resolves it; None for a link that leads out or nowhere."""
    if not stat.S_ISLNK(info.st_mode):
        return f"{info.st_dev}:{info.st_ino}"
    try:
        found = _open_beneath(root_fd, path, sandbox_root)
    except (OSError, UnsafePathError):
        return None
    try:
        target = os.fstat(found)
    finally:
        os.close(found)
    return f"{target.st_dev}:{target.st_ino}"


def list_workdir(root: Path, pattern: str, sandbox_root: PurePosixPath) -> list[RemoteFile]:
    """The entries of a working directory on this machine that a glob matches.

    Every entry that is not a folder is listed (links and special files too, so that
    `copy_out` can refuse them by name); a folder that is a link is never entered, so no name
    beyond it is seen. Names that are not UTF-8 come as `os.fsdecode` gives them (with
    surrogate escapes). The match follows `matching_files`.

    Args:
        root: the working directory's path on this machine.
        pattern: a glob relative to it.
        sandbox_root: the working directory's path as the sandbox's own links name it.

    Returns:
        The matching entries, sorted by path; sizes are their ``lstat`` sizes in bytes, and
        each entry's identity the inode it leads to (`RemoteFile.identity`).

    Raises:
        UnsafePathError: the pattern is absolute or climbs with ``..``.
    """
    checked_relative_path(pattern)
    try:
        root_fd = _open_root(root)
    except FileNotFoundError:
        return []  # the cells removed it: nothing matches, as on other backends
    try:
        try:
            listing_fd = os.open(".", _DIR_FLAGS, dir_fd=root_fd)
        except OSError:
            return []
        try:
            found = {os.fsdecode(path): info for path, info in _walk(b"", listing_fd)}
        finally:
            os.close(listing_fd)
        return [
            RemoteFile(
                path=path,
                size_bytes=found[path].st_size,
                identity=_identity(root_fd, path, found[path], sandbox_root),
            )
            for path in matching_files(pattern, found)
        ]
    finally:
        os.close(root_fd)


def _link_parts(target: bytes, sandbox_root: PurePosixPath, path: str) -> tuple[list[bytes], bool]:
    """A link's target as parts to resolve, and whether from the root (an absolute target).

    Raises:
        UnsafePathError: an absolute target outside the working directory as the sandbox sees
            it (``sandbox_root``).
    """
    if not target.startswith(b"/"):
        return target.split(b"/"), False
    absolute = PurePosixPath(os.fsdecode(target))
    if not absolute.is_relative_to(sandbox_root):
        raise _outside(path)
    return [os.fsencode(part) for part in absolute.relative_to(sandbox_root).parts], True


def _outside(path: str) -> UnsafePathError:
    return UnsafePathError(
        f"path {shown_path(path)!r} resolves outside the working directory (through a symlink)",
        path=path,
    )


def _open_beneath(root_fd: int, path: str, sandbox_root: PurePosixPath) -> int:
    """Open ``path`` under ``root_fd`` as an ``O_PATH`` descriptor of what it names, links
    resolved by hand inside the root, never followed by the kernel.

    Raises:
        UnsafePathError: a link leads outside, or there are more than `MAX_LINK_HOPS`.
        FileNotFoundError: a part is missing, or a part before the last is not a folder.
    """
    pending = [os.fsencode(part) for part in checked_relative_path(path).parts]
    folders = [os.dup(root_fd)]  # the folders opened so far, the root first
    hops = 0
    try:
        while pending:
            name = pending.pop(0)
            if name in (b"", b"."):
                continue
            if name == b"..":
                if len(folders) == 1:
                    raise _outside(path)
                os.close(folders.pop())
                continue
            fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=folders[-1])
            mode = os.fstat(fd).st_mode
            if stat.S_ISLNK(mode):
                hops += 1
                try:
                    if hops > MAX_LINK_HOPS:
                        raise UnsafePathError(
                            f"path {shown_path(path)!r} has too many levels of symlinks",
                            path=path,
                        )
                    target = os.readlink(b"", dir_fd=fd)
                finally:
                    os.close(fd)
                parts, from_root = _link_parts(target, sandbox_root, path)
                if from_root:
                    for folder in folders[1:]:
                        os.close(folder)
                    del folders[1:]
                pending[:0] = parts
            elif stat.S_ISDIR(mode) and pending:
                folders.append(fd)
            elif pending:
                os.close(fd)
                raise FileNotFoundError(errno.ENOTDIR, "not a folder", path)
            else:
                return fd
        raise FileNotFoundError(errno.EISDIR, "names the working directory", path)
    finally:
        for folder in folders:
            os.close(folder)


def _refusal(path: str, reason: str) -> FileTransferError:
    return FileTransferError(f"{shown_path(path)!r} is not collected: {reason}", path=path)


def copy_out(
    root: Path,
    path: str,
    dest: Path,
    *,
    sandbox_root: PurePosixPath,
    max_bytes: int | None,
) -> int:
    """Copy one regular file out of a working directory that a sandbox may be changing.

    Args:
        root: the working directory's path on this machine.
        path: the file, relative to it (surrogate escapes stand for bytes that are not UTF-8).
        dest: the local file to write (a path of this machine's choosing, not the sandbox's).
        sandbox_root: the working directory's path as the sandbox's own links name it
            (``/work`` in a container; the same path for a local kernel).
        max_bytes: the largest file copied, in bytes; None for no cap.

    Returns:
        The bytes copied: the file's size when it was opened (bytes it gained later are left).

    Raises:
        UnsafePathError: ``path`` leaves the working directory, through a link included.
        FileTransferError: it is missing, is not a regular file (a folder, a FIFO, a device,
            a socket), is larger than ``max_bytes``, or is sparse (names it and why).
    """
    try:
        root_fd = _open_root(root)
    except FileNotFoundError:
        raise _refusal(path, "it is not in the working directory") from None
    try:
        try:
            found = _open_beneath(root_fd, path, sandbox_root)
        except (FileNotFoundError, NotADirectoryError) as exc:
            raise _refusal(path, "it is not in the working directory") from exc
        except OSError as exc:
            raise _refusal(path, exc.strerror or str(exc)) from exc
    finally:
        os.close(root_fd)
    try:
        info = os.fstat(found)
        if not stat.S_ISREG(info.st_mode):
            kind = _KINDS.get(stat.S_IFMT(info.st_mode), "not a regular file")
            raise _refusal(path, f"it is {kind}, not a regular file")
        # Reopened through the descriptor itself: the same inode, whatever the name is now.
        reader = os.open(f"/proc/self/fd/{found}", os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY)
    finally:
        os.close(found)
    try:
        opened = os.fstat(reader)
        if (opened.st_dev, opened.st_ino) != (info.st_dev, info.st_ino):
            raise _refusal(path, "it changed while it was opened")
        _check_not_sparse(reader, info.st_size, path)
        check_size(path, info.st_size, max_bytes)
        dest.parent.mkdir(parents=True, exist_ok=True)
        return _copy(reader, dest, info.st_size)
    finally:
        os.close(reader)


def _check_not_sparse(fd: int, size: int, path: str) -> None:
    """Refuse a file with a hole: its size is not bytes the cell wrote, yet a copy would be."""
    with contextlib.suppress(OSError):  # a file system that cannot tell has no holes to us
        hole = os.lseek(fd, 0, os.SEEK_HOLE)
        os.lseek(fd, 0, os.SEEK_SET)
        if hole < size:
            raise _refusal(
                path,
                f"it is sparse (a hole at byte {hole} of its {size}): only bytes written are "
                "collected",
            )


def _copy(reader: int, dest: Path, size: int) -> int:
    """Copy at most ``size`` bytes from ``reader`` to ``dest``; the count copied."""
    copied = 0
    with open(dest, "wb") as out:
        while copied < size:
            chunk = os.read(reader, min(_COPY_CHUNK_BYTES, size - copied))
            if not chunk:
                break
            out.write(chunk)
            copied += len(chunk)
    return copied
