"""What tasks and flows return: plain pydantic models, JSON-able, free of Prefect."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, Field

from prefect_sandbox.sandbox.base import CellError, CellResult

__all__ = ["CellRecord", "PipelineResult", "StageResult", "StageSummary", "StoredArtifact"]


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
        failed_cell_index: 0-based notebook index of the failing cell.
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
    """A file stored by a flow.

    Attributes:
        path: POSIX path relative to the sandbox's working directory (or the notebook's name).
        bytes: its size in bytes.
        sha256: hex SHA-256 of its content.
        location: where it was stored (a local path, or later an ``s3://`` URI).
    """

    path: str
    bytes: int
    sha256: str
    location: str


class StageSummary(BaseModel):
    """A stage's line in ``summary.json``."""

    name: str
    status: Literal["ok", "failed", "cancelled", "not_run"]
    cell_count: int
    duration_s: float
    failed_cell_index: int | None = None
    ename: str | None = None
    evalue: str | None = None


class PipelineResult(BaseModel):
    """What a pipeline flow returns, and what it writes as ``summary.json``.

    Attributes:
        flow_run_id: the flow run's id.
        flow_run_name: the flow run's name (its files' folder is named from it and its id).
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
    """

    flow_run_id: str
    flow_run_name: str
    status: Literal["completed", "failed", "cancelled"]
    stages: list[StageSummary]
    artifacts: list[StoredArtifact]
    output_dir: str
    duration_s: float
    error: str | None = None
    sandbox_id: str | None = None
    sandbox_created_at: datetime | None = None
    sandbox_killed_at: datetime | None = None
