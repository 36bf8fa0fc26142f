"""The Prefect face's own errors, each raised ``from`` the error that stopped the run (its
``__cause__``). Manual: docs/concepts.md.

::

    SandboxError                  (prefect_sandbox.sandbox.errors: the core's tree)
    ├── PipelineFailedError       a flow's pipeline stopped; names the stage and cell
    ├── SessionFailedError        a sandbox session's files could not all be stored
    ├── FixerError                a session's fixer raised or returned no new code
    ├── ReapFailedError           the reaper could not list a backend or kill a sandbox
    ├── SweepFailedError          a sweep's branch did not complete; names each such branch
    ├── GridError (ValueError)    a sweep's grid of parameters is malformed; names the entry
    └── ParameterRefusedError (PermissionError)   a deployment run's parameters would weaken
                                  its isolation or read host paths; names each
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prefect_sandbox.sandbox.errors import SandboxError

if TYPE_CHECKING:
    from prefect_sandbox.results import PipelineResult

__all__ = [
    "FixerError",
    "GridError",
    "ParameterRefusedError",
    "PipelineFailedError",
    "ReapFailedError",
    "SessionFailedError",
    "SweepFailedError",
]


class PipelineFailedError(SandboxError):
    """A pipeline stopped at a failing stage; what it produced before was stored.

    Args:
        message: one line: stage, cell index and the exception.
        stage: the stage that failed; None when the sandbox could not be made, or storing
            failed after every stage ran.
        cell_index: 0-based index of the failing cell in the notebook.
        output_dir: where the partial notebook, artifacts and summary were stored.
        sandbox_id: the run's sandbox, when one was made.
        result: what ``summary.json`` says (stages, stored files, metrics), when it was
            written.
    """

    def __init__(
        self,
        message: str,
        *,
        stage: str | None = None,
        cell_index: int | None = None,
        output_dir: str | None = None,
        sandbox_id: str | None = None,
        result: PipelineResult | None = None,
    ) -> None:
        super().__init__(message, sandbox_id=sandbox_id)
        self.stage = stage
        self.cell_index = cell_index
        self.output_dir = output_dir
        self.result = result


class SessionFailedError(SandboxError):
    """A sandbox session ended, its sandbox killed, but what it made could not all be
    collected or stored (``summary.json`` says what).

    Args:
        message: one line naming what failed.
        output_dir: where the notebook, artifacts and summary were stored.
        sandbox_id: the session's sandbox, when one was made.
    """

    def __init__(
        self, message: str, *, output_dir: str | None = None, sandbox_id: str | None = None
    ) -> None:
        super().__init__(message, sandbox_id=sandbox_id)
        self.output_dir = output_dir


class FixerError(SandboxError):
    """A session's fixer raised, returned code that is not a string, or returned the code
    that just failed; the attempts so far are in the notebook.

    Args:
        message: one line naming the step, the attempt and what the fixer did.
        step: the session's step (1-based: ``run-cell-3`` is step 3).
        attempt: the attempt whose failure the fixer was asked to fix (1-based).
    """

    def __init__(self, message: str, *, step: int, attempt: int) -> None:
        super().__init__(message)
        self.step = step
        self.attempt = attempt


class ReapFailedError(SandboxError):
    """The reaper swept what it could, but a backend could not be listed or a sandbox killed.

    Args:
        message: one line naming what failed.
        failed: the sandboxes it could not kill, by id, and ``"listing <backend>"`` for each
            backend it could not list.
    """

    def __init__(self, message: str, *, failed: list[str]) -> None:
        super().__init__(message)
        self.failed = failed


class SweepFailedError(SandboxError):
    """A sweep's branch failed, was cancelled or crashed; the others ran to their end.

    Args:
        message: one line naming each branch that did not complete, why, and where its
            partial results are.
        failed: those branches' flow-run names (or ``"entry N"`` when no run was made).
        output_dir: where ``sweep.json`` was stored.
    """

    def __init__(
        self, message: str, *, failed: list[str] | None = None, output_dir: str | None = None
    ) -> None:
        super().__init__(message)
        self.failed = failed or []
        self.output_dir = output_dir


class GridError(SandboxError, ValueError):
    """A sweep's grid of parameter sets is malformed; nothing was run.

    Args:
        message: one line naming the grid's source (its file), the entry and the problem.
        source: the grid's file, or ``"grid"`` when it was given as a value.
    """

    def __init__(self, message: str, *, source: str = "grid") -> None:
        super().__init__(message)
        self.source = source


class ParameterRefusedError(SandboxError, PermissionError):
    """A deployment run's parameters or job variables try to set what only whoever saves
    blocks and deployments may: a backend by value, a path outside the allowed roots, a
    ``PREFECT_SANDBOX_*`` variable. Raised before any sandbox starts; nothing ran.

    Args:
        message: one line naming each refused parameter and why.
        refused: the refused parameters' names (``job_variables.env.NAME`` for a variable).
    """

    def __init__(self, message: str, *, refused: list[str]) -> None:
        super().__init__(message)
        self.refused = refused
