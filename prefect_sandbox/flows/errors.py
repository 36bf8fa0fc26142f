"""The Prefect face's own errors: a pipeline flow that stopped, a reaper that could not sweep.

::

    SandboxError                  (prefect_sandbox.sandbox.errors: the core's tree)
    ├── PipelineFailedError       a flow's pipeline stopped; names the stage and cell
    └── ReapFailedError           the reaper could not list a backend or kill a sandbox

It is raised ``from`` the error that stopped the pipeline (a stage's `CellExecutionError`,
`CellTimeoutError`, `SandboxDiedError`, ... or a `FileTransferError` from storing), which stays
its ``__cause__``.
"""

from __future__ import annotations

from prefect_sandbox.sandbox.errors import SandboxError

__all__ = ["PipelineFailedError", "ReapFailedError"]


class PipelineFailedError(SandboxError):
    """A pipeline stopped at a failing stage; what it produced before was stored.

    Args:
        message: one line: stage, cell index and the exception.
        stage: the stage that failed; None when storing failed after every stage ran.
        cell_index: 0-based index of the failing cell in the notebook.
        output_dir: where the partial notebook, artifacts and summary were stored.
        sandbox_id: the run's sandbox, when one was made.
    """

    def __init__(
        self,
        message: str,
        *,
        stage: str | None = None,
        cell_index: int | None = None,
        output_dir: str | None = None,
        sandbox_id: str | None = None,
    ) -> None:
        super().__init__(message, sandbox_id=sandbox_id)
        self.stage = stage
        self.cell_index = cell_index
        self.output_dir = output_dir


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
