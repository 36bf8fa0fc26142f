"""What tasks and flows return: plain pydantic models, JSON-able, free of Prefect.

Manual: docs/reference/api.md.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, Field

from prefect_sandbox.sandbox.base import CellError, CellResult

__all__ = [
    "BranchResult",
    "CellRecord",
    "PipelineResult",
    "StageResult",
    "StageSummary",
    "StoredArtifact",
    "SweepResult",
]


class CellRecord(BaseModel):
    """One executed cell: where it sits in the notebook and what it produced."""

    index: int
    result: CellResult


class StageResult(BaseModel):
    """What running one stage produced.

    Attributes:
        name: the stage's name.
        status: ``"ok"``; ``"failed"`` when a cell failed, ``"cancelled"`` when the run was
            cancelled during a cell (the cells after it did not run).
        cells: the cells that ran, in order, the failing one included.
        duration_s: seconds the stage took.
        failed_cell_index: the failing cell's number: its 0-based index in the notebook as
            written (markdown cells counted, a parameters cell injected by the run not); None
            when that injected cell failed.
        error: the failing cell's exception.
        late_outputs: output printed by background threads of earlier cells (this stage's or
            an earlier one's) after those cells ended, by the cell's ``CellResult.msg_id``.
    """

    name: str
    status: Literal["ok", "failed", "cancelled"]
    cells: list[CellRecord] = Field(default_factory=list)
    duration_s: float = 0.0
    failed_cell_index: int | None = None
    error: CellError | None = None
    late_outputs: dict[str, list[dict[str, Any]]] = Field(default_factory=dict)


class StoredArtifact(BaseModel):
    """A file stored by a flow (an artifact: a file a run stores, not a Prefect artifact).

    Attributes:
        path: POSIX path relative to the sandbox's working directory (or the notebook's name).
        size_bytes: its size in bytes.
        sha256: hex SHA-256 of its content.
        location: where it was stored (a local path, or an ``s3://`` URI).
    """

    path: str
    size_bytes: int
    sha256: str
    location: str


class StageSummary(BaseModel):
    """A stage's line in ``summary.json``.

    Attributes:
        name: the stage's name.
        status: ``"ok"``, ``"failed"``, ``"cancelled"``, or ``"not_run"`` (an earlier stage
            failed or the run stopped before it).
        cell_count: its code cells.
        duration_s: seconds it ran.
        failed_cell_index: the failing cell's number, as `StageResult.failed_cell_index`.
        failed_line: the 1-based line of that cell's code its error points at; None when the
            traceback names none.
        failed_code: that line's code, stripped (at most 200 characters).
        ename: the error's class name.
        evalue: the error's message.
    """

    name: str
    status: Literal["ok", "failed", "cancelled", "not_run"]
    cell_count: int
    duration_s: float
    failed_cell_index: int | None = None
    failed_line: int | None = None
    failed_code: str | None = None
    ename: str | None = None
    evalue: str | None = None


class PipelineResult(BaseModel):
    """What a pipeline flow returns, and what it writes as ``summary.json``.

    Attributes:
        flow_run_id: the flow run's id.
        flow_run_name: the flow run's name (its files' folder is named from it and its id).
        attempt: the flow run's attempt, Prefect's ``run_count``: 2 or more when the flow run
            was retried (``retries``, the UI's Retry, ``PREFECT_FLOWS_DEFAULT_RETRIES``). Each
            attempt runs in a fresh sandbox, and empties the run's folder before it stores.
        status: ``"completed"``, ``"failed"``, or ``"cancelled"`` (its task was cancelled, e.g.
            by the CLI on SIGINT or SIGTERM).
        stages: one summary per stage, in order, including stages that never ran.
        artifacts: the stored files, the executed notebook included.
        output_dir: the folder (or URI) they were stored under.
        duration_s: seconds the pipeline took, sandbox start and kill included.
        error: one line naming the failing stage, cell and exception, when it failed; where it
            was cancelled, when it was.
        sandbox_id: the backend's id of the run's sandbox; None if none was made.
        sandbox_created_at: UTC time just before the sandbox was asked for (after any wait
            for a slot of the backend's live-sandbox limit); None if it never was.
        sandbox_killed_at: UTC time just after its kill returned (after a create that failed
            or was cancelled: after what it started was cleaned up); None if the kill failed
            or no sandbox was asked for. With ``sandbox_created_at`` it brackets the sandbox's
            whole life (``summary.json`` has both as ISO 8601 strings).
        sandbox_limits: how each resource limit applied to the run's sandbox, as its backend
            reports it (`SandboxHandle.limits`): to the whole sandbox, to each process, or not.
        parameters: the parameters injected into the notebook (empty when none were).
        metrics: the top-level numbers, booleans, nulls and short strings of the stored
            ``metrics.json``, read as a sweep reads its branches' (the first 50); empty when
            the run stored none.
        setup_attempts: how many sandboxes were made to get one set up: 1 as a rule, more
            when a transient failure before the first cell made the run kill one and make a
            fresh one (setting ``setup_attempts``); 0 when none was asked for.
        warnings: what the run could not do without failing: each artifact that could not be
            listed or downloaded, named with the reason.
    """

    flow_run_id: str
    flow_run_name: str
    attempt: int = 1
    status: Literal["completed", "failed", "cancelled"]
    stages: list[StageSummary]
    artifacts: list[StoredArtifact]
    output_dir: str
    duration_s: float
    error: str | None = None
    sandbox_id: str | None = None
    sandbox_created_at: datetime | None = None
    sandbox_killed_at: datetime | None = None
    sandbox_limits: dict[str, str] = Field(default_factory=dict)
    parameters: dict[str, Any] = Field(default_factory=dict)
    metrics: dict[str, float | int | bool | str | None] = Field(default_factory=dict)
    setup_attempts: int = 0
    warnings: list[str] = Field(default_factory=list)


class BranchResult(BaseModel):
    """One branch of a sweep: one parameter set, one flow run of ``run-notebook``.

    Attributes:
        index: the parameter set's 0-based position in the expanded grid.
        parameters: the parameters the notebook ran with.
        status: ``"completed"``, ``"failed"``, ``"cancelled"``, ``"crashed"`` (the flow run's
            final state), or ``"not_run"`` (no flow run was made).
        flow_run_id: the branch's flow run id, once it was made.
        flow_run_name: its name (its folder is named from it and its id).
        output_dir: the folder (or ``s3://`` URI) its files and ``summary.json`` are under.
        summary_stored: whether its ``summary.json`` was read back from there.
        metrics: the top-level numbers, booleans and short strings of the branch's stored
            metrics artifact (the first 50); empty when it stored none.
        error: one line: why it failed, was cancelled or crashed.
    """

    index: int
    parameters: dict[str, Any]
    status: Literal["completed", "failed", "cancelled", "crashed", "not_run"]
    flow_run_id: str | None = None
    flow_run_name: str | None = None
    output_dir: str | None = None
    summary_stored: bool = False
    metrics: dict[str, float | int | bool | str | None] = Field(default_factory=dict)
    error: str | None = None


class SweepResult(BaseModel):
    """What the sweep flow returns, and what it writes as ``sweep.json``.

    Attributes:
        flow_run_id: the sweep's flow run id.
        flow_run_name: the sweep's flow run name.
        status: ``"completed"`` when every branch completed, ``"failed"`` when one did not,
            ``"cancelled"`` when the sweep was.
        mode: ``"subflow"`` (branches ran in the sweep's process), ``"dask"`` (as tasks on a
            Dask cluster's workers) or ``"deployment"``
            (branches ran as flow runs of a deployment, on its work pool's workers).
        notebook: the notebook's path, as given.
        output_dir: where ``sweep.json`` is stored (with the branches' folders, see the flow).
        metrics_artifact: the stored file each branch's metrics were read from.
        duration_s: seconds the sweep took.
        branches: one per parameter set, in grid order.
        error: one line naming the branches that did not complete, when one did not.
    """

    flow_run_id: str
    flow_run_name: str
    status: Literal["completed", "failed", "cancelled"]
    mode: Literal["subflow", "dask", "deployment"]
    notebook: str
    output_dir: str
    metrics_artifact: str | None
    duration_s: float
    branches: list[BranchResult]
    error: str | None = None
