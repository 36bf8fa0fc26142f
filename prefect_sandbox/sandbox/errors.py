"""The error tree of prefect-sandbox; each error keeps its structured fields through pickling (see
`SandboxError`, and docs/concepts.md)::

    SandboxError
    ├── CellExecutionError        user code raised (ename, evalue, traceback, stage, cell_index)
    ├── CellTimeoutError          a cell ran past its deadline (also a TimeoutError)
    ├── SandboxDiedError          the sandbox process ended; its state is lost
    ├── SandboxNotFoundError      the sandbox expired or was killed (stage, cell_index)
    ├── SandboxUnavailableError   transient backend trouble (operation, status_code)
    ├── SandboxAuthError          credentials refused
    ├── UnsafePathError           a path that leaves the working directory (also a ValueError)
    ├── FileTransferError         an upload or download failed
    ├── NotebookError             a notebook or stage list that cannot be run (also a ValueError)
    └── BackendNotInstalledError  a backend's extra is not installed (also an ImportError)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

__all__ = [
    "BackendNotInstalledError",
    "CellExecutionError",
    "CellTimeoutError",
    "FileTransferError",
    "ForeignError",
    "NotebookError",
    "SandboxAuthError",
    "SandboxDiedError",
    "SandboxError",
    "SandboxNotFoundError",
    "SandboxUnavailableError",
    "UnsafePathError",
    "portable_chain",
]


def _rebuild(cls: type[SandboxError], args: tuple[Any, ...]) -> SandboxError:
    # Without __init__: pickle then restores every attribute, whatever the class's signature.
    error = cls.__new__(cls, *args)
    error.args = args  # OSError's __new__ (TimeoutError's base) leaves args to __init__
    return error


class SandboxError(Exception):
    """Root of every error this package raises.

    Every error keeps its structured fields through pickling, since Prefect's task runners
    pickle exceptions between threads and processes. ``stage``, ``cell_index`` and
    ``partial_result`` are for the layers above, which know of stages. A backend's error leaves
    it with its ``__cause__``/``__context__`` chain made portable (`portable_chain`): Dask pickles
    that chain too, and a vendor's exception in it is replaced by a `ForeignError`.

    Args:
        message: a sentence for people.
        sandbox_id: the sandbox concerned, when known.
        stage: see the attribute.
        cell_index: see the attribute.
    """

    stage: str | None = None
    """The stage that was running, when a pipeline's cell was (set by the layer above)."""
    cell_index: int | None = None
    """0-based index, in its notebook's ``cells``, of the cell that was running or is at fault."""
    partial_result: object | None = None
    """What the layer that raised this made before it, for its caller to keep (the tasks
    layer's ``run_stage`` puts the stage's cells so far here: a ``StageResult``)."""

    def __init__(
        self,
        message: str,
        *,
        sandbox_id: str | None = None,
        stage: str | None = None,
        cell_index: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.sandbox_id = sandbox_id
        self.stage = stage
        self.cell_index = cell_index

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.args), vars(self))

    def __str__(self) -> str:
        return self.message


class CellExecutionError(SandboxError):
    """User code in a cell raised an exception.

    Args:
        message: a sentence naming the stage, the cell and the exception.
        ename: the exception's class name, as the kernel reported it (e.g. ``"ValueError"``).
        evalue: the exception's message, capped as in ``CellError`` (the notebook has it all).
        traceback: the traceback lines, ANSI codes removed and capped as in ``CellError``; they
            name the cell's failing source line.
        stage: the stage the cell belongs to, when run as part of a pipeline.
        cell_index: 0-based index of the cell in its notebook's ``cells`` list.
    """

    def __init__(
        self,
        message: str,
        *,
        ename: str = "",
        evalue: str = "",
        traceback: list[str] | None = None,
        stage: str | None = None,
        cell_index: int | None = None,
        sandbox_id: str | None = None,
    ) -> None:
        super().__init__(message, sandbox_id=sandbox_id, stage=stage, cell_index=cell_index)
        self.ename = ename
        self.evalue = evalue
        self.traceback = traceback or []


class CellTimeoutError(SandboxError, TimeoutError):
    """A cell ran past its deadline.

    Args:
        message: a sentence naming the cell, the timeout and what was done about it.
        timeout_s: the deadline that passed, in seconds.
        stage: the stage the cell belongs to.
        cell_index: 0-based index of the cell in its notebook's ``cells`` list.
        interrupted: True when an interrupt stopped the cell and the kernel went idle.
        state_lost: True when the kernel had to be restarted, losing variables and imports.
    """

    def __init__(
        self,
        message: str,
        *,
        timeout_s: float | None = None,
        stage: str | None = None,
        cell_index: int | None = None,
        interrupted: bool = False,
        state_lost: bool = False,
        sandbox_id: str | None = None,
    ) -> None:
        super().__init__(message, sandbox_id=sandbox_id, stage=stage, cell_index=cell_index)
        self.timeout_s = timeout_s
        self.interrupted = interrupted
        self.state_lost = state_lost


class _CellLostError(SandboxError):
    """The sandbox went away while in use: what `SandboxDiedError` and `SandboxNotFoundError`
    share (the running cell's ``outputs``; the arguments are as in theirs)."""

    def __init__(
        self,
        message: str,
        *,
        stage: str | None = None,
        cell_index: int | None = None,
        sandbox_id: str | None = None,
        outputs: list[dict[str, Any]] | None = None,
    ) -> None:
        super().__init__(message, sandbox_id=sandbox_id, stage=stage, cell_index=cell_index)
        self.outputs = outputs or []


class SandboxDiedError(_CellLostError):
    """The sandbox's process ended while in use; its state is lost.

    Args:
        message: a sentence naming the sandbox and, when known, the cell.
        exit_code: the process's exit status, when it exited.
        signal: the number of the signal that ended it, when one did.
        stage: the stage that was running.
        cell_index: 0-based index of the cell that was running.
        outputs: the nbformat outputs the running cell made before the end, when
            ``Sandbox.run_cell`` raised it.
    """

    state_lost = True

    def __init__(
        self,
        message: str,
        *,
        exit_code: int | None = None,
        signal: int | None = None,
        stage: str | None = None,
        cell_index: int | None = None,
        sandbox_id: str | None = None,
        outputs: list[dict[str, Any]] | None = None,
    ) -> None:
        super().__init__(
            message, stage=stage, cell_index=cell_index, sandbox_id=sandbox_id, outputs=outputs
        )
        self.exit_code = exit_code
        self.signal = signal


class SandboxNotFoundError(_CellLostError):
    """The sandbox expired or was killed; a new one is never made silently in its place.

    Args:
        message: a sentence naming the sandbox and, when in one, the cell.
        stage: the stage that was running, when in a pipeline.
        cell_index: 0-based index of the cell that was running, when in a cell.
        outputs: the nbformat outputs the running cell made before the sandbox went away,
            when ``Sandbox.run_cell`` raised it.
    """


class SandboxUnavailableError(SandboxError):
    """The backend is briefly unable to serve a call (429, 5xx, a dropped connection).

    Args:
        message: a sentence naming the call and what went wrong.
        status_code: the HTTP status the backend answered with; None for a transport failure.
        operation: the backend call that failed (e.g. ``"create"``, ``"upload"``).
        retry_after_s: seconds the backend asked to wait before trying again, when it said.
    """

    def __init__(
        self,
        message: str,
        *,
        status_code: int | None = None,
        operation: str | None = None,
        retry_after_s: float | None = None,
        sandbox_id: str | None = None,
    ) -> None:
        super().__init__(message, sandbox_id=sandbox_id)
        self.status_code = status_code
        self.operation = operation
        self.retry_after_s = retry_after_s


class SandboxAuthError(SandboxError):
    """The backend refused the credentials."""


class UnsafePathError(SandboxError, ValueError):
    """A path leaves the sandbox's working directory.

    Args:
        message: a sentence naming the path.
        path: the path as it was given.
    """

    def __init__(self, message: str, *, path: str = "", sandbox_id: str | None = None) -> None:
        super().__init__(message, sandbox_id=sandbox_id)
        self.path = path


class FileTransferError(SandboxError):
    """An upload to or a download from the sandbox failed.

    Args:
        message: a sentence naming the file.
        path: the file's path inside the sandbox.
    """

    def __init__(self, message: str, *, path: str = "", sandbox_id: str | None = None) -> None:
        super().__init__(message, sandbox_id=sandbox_id)
        self.path = path


class NotebookError(SandboxError, ValueError):
    """A notebook, stage list or parameter that cannot be run.

    Args:
        message: a sentence naming the notebook, cell or parameter at fault.
        cell_index: 0-based index of the offending cell, when one is at fault.
    """

    def __init__(
        self, message: str, *, cell_index: int | None = None, sandbox_id: str | None = None
    ) -> None:
        super().__init__(message, sandbox_id=sandbox_id, cell_index=cell_index)


class BackendNotInstalledError(SandboxError, ImportError):
    """A backend needs an optional extra that is not installed.

    Args:
        message: a sentence naming the backend and the command that installs the extra.
        extra: the extra to install (``"e2b"``, ``"daytona"``).
    """

    def __init__(self, message: str, *, extra: str = "", sandbox_id: str | None = None) -> None:
        super().__init__(message, sandbox_id=sandbox_id)
        self.extra = extra


class ForeignError(Exception):
    """Stands in for an exception that is not ours (a vendor SDK's, its transport's) in the
    ``__cause__``/``__context__`` chain of a `SandboxError` (see `portable_chain`).

    It keeps the original's type name and message, its traceback and its own chain (made
    portable too), so a traceback reads as before; not the original's other attributes. Its one
    argument, the message, is ``"<module>.<qualname>: <the original's str()>"``.
    """


def _portable(exc: BaseException, done: dict[int, BaseException]) -> BaseException:
    if id(exc) in done:
        return done[id(exc)]
    suppress_context = exc.__suppress_context__
    if isinstance(exc, SandboxError | ForeignError):
        portable = exc
    else:
        name = f"{type(exc).__module__}.{type(exc).__qualname__}"
        portable = ForeignError(f"{name}: {exc}").with_traceback(exc.__traceback__)
    done[id(exc)] = portable
    if exc.__cause__ is not None:
        portable.__cause__ = _portable(exc.__cause__, done)
    if exc.__context__ is not None:
        portable.__context__ = _portable(exc.__context__, done)
    # Setting __cause__ sets it; the original's choice is what a traceback shows.
    portable.__suppress_context__ = suppress_context
    return portable


@contextlib.contextmanager
def portable_chain() -> Iterator[None]:
    """Make the chain of a `SandboxError` raised in the block portable, then let it go on.

    Dask ships a task's exception with tblib's pickling, which ``import distributed`` installs
    for every exception class then defined: it pickles ``__cause__``, ``__context__`` and the
    traceback along with the error. A vendor's exception there may not pickle (Daytona's
    ``UnauthorizedException`` holds aiohttp's ``CIMultiDictProxy`` of response headers), and
    then Dask sends a bare ``Exception(repr(error))`` in its place; it may also hold what must
    not travel (request headers with an API key). So each exception in the chain that is not
    ours is replaced, in place, by a `ForeignError`. Other exceptions pass untouched.
    """
    try:
        yield
    except SandboxError as error:
        # A bare raise keeps the context we set; raising the error anew would reset it.
        _portable(error, {})
        raise
