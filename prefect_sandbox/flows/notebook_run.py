"""The pipeline flows' body, and ``run-notebook`` as the CLI runs it.

`checked_run` is the path every pipeline flow of `prefect_sandbox.flows.pipeline` takes, and
`run_notebook_flow` that of ``run-notebook``. `arun_notebook_text_storage` is a second flow
object named ``run-notebook`` over the same body whose ``storage`` is text (a folder, an
``s3://`` URI or ``s3-bucket/NAME``) rather than ``S3Bucket | str``: Prefect resolves a flow's
parameter types as it is defined, so the public flow imports prefect-aws (and boto3), about 0.5 s,
for its block selector in the UI; the CLI, which passes a block only for an ``s3://`` ``--out``,
runs this one otherwise and imports prefect-aws only for S3 storage or inputs. Manual:
docs/concepts.md.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from nbformat import NotebookNode
from prefect import flow, get_run_logger
from prefect.client.schemas.objects import FlowRun
from prefect.states import Cancelled, Completed

from prefect_sandbox.blocks import BackendBlock
from prefect_sandbox.blocks.base import SandboxBackend
from prefect_sandbox.flows.errors import PipelineFailedError
from prefect_sandbox.flows.hooks import kill_run_sandboxes
from prefect_sandbox.flows.pipeline_run import (
    PipelineRun,
    ProgressArtifact,
    new_run,
    warnings_note,
)
from prefect_sandbox.flows.policy import check_deployment_run
from prefect_sandbox.options import RunOptions, check_options
from prefect_sandbox.results import PipelineResult
from prefect_sandbox.sandbox.errors import SandboxError
from prefect_sandbox.sandbox.notebook import (
    StageSpec,
    inject_parameters,
    read_notebook,
    split_stages,
    undeclared_parameters,
)

if TYPE_CHECKING:
    from prefect_aws import S3Bucket

__all__ = ["arun_notebook_text_storage", "checked_run", "run_notebook_flow"]


async def checked_run(
    notebook: str | None,
    make_source: Callable[[], NotebookNode],
    inputs: list[str] | None,
    artifacts: list[str] | None,
    backend: SandboxBackend | None,
    storage: S3Bucket | str | None,
    cell_timeout_s: float | None,
    parameters: dict[str, Any] | None = None,
    stage_heading_level: int = 1,
) -> PipelineResult:
    """The pipeline flows' common path, given their parameters: refuse a deployment run's or a
    bad parameter (before any sandbox starts), make the notebook with ``make_source``, then run
    it with `_run_pipeline` (`prefect_sandbox.flows.arun_notebook`'s docstring lists the errors
    raised)."""
    await check_deployment_run()
    check_options(
        RunOptions,
        notebook=notebook,
        inputs=inputs,
        artifacts=artifacts,
        storage=storage,
        cell_timeout_s=cell_timeout_s,
    )
    source = make_source()
    return await _run_pipeline(
        source,
        split_stages(source, stage_heading_level),
        inputs=inputs or [],
        artifacts=artifacts or [],
        backend=backend,
        storage=storage,
        cell_timeout_s=cell_timeout_s,
        parameters=parameters,
    )


async def _run_pipeline(
    source: NotebookNode,
    stages: list[StageSpec],
    *,
    inputs: list[str],
    artifacts: list[str],
    backend: SandboxBackend | None,
    storage: S3Bucket | str | None,
    cell_timeout_s: float | None,
    parameters: dict[str, Any] | None = None,
) -> PipelineResult:
    run, flow_run = await new_run(source, stages, backend, storage, "a pipeline")
    run.progress = ProgressArtifact(len(stages))
    async with run.running(
        flow_run,
        inputs=inputs,
        artifacts=artifacts,
        summary=("pipeline-summary", "Pipeline summary"),
        parameters=parameters,
    ) as handle:
        if handle is not None:
            await run.execute(handle, cell_timeout_s)
    return _ended(run, flow_run)


def _ended(run: PipelineRun, flow_run: FlowRun) -> PipelineResult:
    """The pipeline's end, from its run's outcome: its result (a Completed state naming the
    warnings, when there are some), a Cancelled state, or `PipelineFailedError` (also on a
    timeout: Prefect's scope turns it into its TimedOut state); an exception of another kind
    that left the stages is raised as it is."""
    outcome, result = run.outcome, run.result
    assert result is not None, "running stores the result on every way out"
    if outcome.cancelled:
        message = (
            f"flow run {flow_run.name!r} {result.error}; partial results in "
            f"{run.store.output_dir}{warnings_note(result.warnings)}"
        )
        # Prefect makes a State the flow returns its final state; the caller gets CancelledRun.
        return cast(PipelineResult, Cancelled(message=message))
    if outcome.raised is not None and not isinstance(
        outcome.raised, SandboxError | asyncio.CancelledError
    ):
        raise outcome.raised
    if outcome.failure is not None or outcome.timed_out:
        stopped = next((r for r in run.stage_results if r.status != "ok"), None)
        failure = outcome.failure
        raise PipelineFailedError(
            f"{result.error or 'pipeline failed'}{warnings_note(result.warnings)}",
            stage=getattr(failure, "stage", None) or (stopped.name if stopped else None),
            cell_index=getattr(failure, "cell_index", None)
            if failure
            else stopped.failed_cell_index
            if stopped
            else None,
            output_dir=run.store.output_dir,
            sandbox_id=run.sandbox_id,
            result=result,
        ) from failure
    if result.warnings:
        # The state's message names each file not fetched; the caller still gets the result.
        message = f"completed{warnings_note(result.warnings)}"
        return cast(PipelineResult, Completed(message=message, data=result))
    return result


async def run_notebook_flow(
    notebook: str,
    inputs: list[str] | None,
    artifacts: list[str] | None,
    parameters: dict[str, Any] | None,
    backend: SandboxBackend | None,
    storage: S3Bucket | str | None,
    cell_timeout_s: float | None,
    stage_heading_level: int,
) -> PipelineResult:
    """``run-notebook``'s body, given its parameters (`prefect_sandbox.flows.arun_notebook`
    documents them, what it returns and raises): the notebook read, the parameters injected
    (a warning names each one the notebook's ``parameters`` cell does not assign), then
    `checked_run`."""

    def make_source() -> NotebookNode:
        original = read_notebook(Path(notebook))
        source = inject_parameters(original, parameters or {})
        unknown = undeclared_parameters(original, parameters or {})
        if unknown:
            get_run_logger().warning(
                "Parameter(s) %s are not assigned in the notebook's cell tagged 'parameters' "
                "(or it has none); injected anyway",
                ", ".join(unknown),
            )
        return source

    return await checked_run(
        notebook,
        make_source,
        inputs,
        artifacts,
        backend,
        storage,
        cell_timeout_s,
        parameters,
        stage_heading_level,
    )


@flow(
    name="run-notebook",
    on_cancellation=[kill_run_sandboxes],
    on_crashed=[kill_run_sandboxes],
)
async def arun_notebook_text_storage(
    notebook: str,
    inputs: list[str] | None = None,
    artifacts: list[str] | None = None,
    parameters: dict[str, Any] | None = None,
    backend: BackendBlock | None = None,
    storage: str | None = None,
    cell_timeout_s: float | None = None,
    stage_heading_level: int = 1,
) -> PipelineResult:
    """`prefect_sandbox.flows.arun_notebook` with ``storage`` as text: a folder, an ``s3://``
    URI or ``s3-bucket/NAME`` (the CLI's flow; see the module's docstring). Its parameters,
    result and errors are ``arun_notebook``'s."""
    return await run_notebook_flow(
        notebook,
        inputs,
        artifacts,
        parameters,
        backend,
        storage,
        cell_timeout_s,
        stage_heading_level,
    )
