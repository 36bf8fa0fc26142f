"""Keeping file paths inside a sandbox's working directory. Pure functions, no I/O but `resolve`."""

from __future__ import annotations

from pathlib import Path, PurePosixPath

from prefect_sandbox.sandbox.errors import UnsafePathError

__all__ = ["checked_relative_path", "resolve_inside"]


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
