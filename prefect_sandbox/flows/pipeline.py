"""The pipeline flows: `arun_notebook` / `run_notebook` and `amodeling_pipeline` /
`modeling_pipeline`.

Each makes one sandbox for the flow run, uploads the inputs, runs the stages in order, downloads
the artifacts, stores them with the executed notebook and ``summary.json``, and kills the sandbox
in a ``finally``. A failed stage stops the pipeline; what came before is still stored and the
flow run ends Failed with a `PipelineFailedError` naming the stage, cell and exception.

The flows are async (a sync Prefect flow pays about 1 s joining its heartbeat thread); the
sync twins run them from plain Python.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import shutil
import tempfile
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

from nbformat import NotebookNode
from prefect import flow, get_run_logger
from prefect.artifacts import (
    acreate_markdown_artifact,
    acreate_progress_artifact,
    aupdate_progress_artifact,
)
from prefect.context import FlowRunContext
from prefect.flows import Flow
from prefect.utilities.asyncutils import run_coro_as_sync
from prefect_aws import S3Bucket

from prefect_sandbox.blocks import BackendBlock
from prefect_sandbox.blocks.base import SandboxBackend
from prefect_sandbox.blocks.local import LocalKernelBackend
from prefect_sandbox.flows.hooks import kill_run_sandboxes
from prefect_sandbox.flows.report import escape_markdown, summary_markdown
from prefect_sandbox.results import PipelineResult, StageResult, StageSummary, StoredArtifact
from prefect_sandbox.sandbox.base import checked_timeout_s
from prefect_sandbox.sandbox.errors import (
    FileTransferError,
    PipelineFailedError,
    SandboxError,
    SandboxNotFoundError,
)
from prefect_sandbox.sandbox.labels import flow_run_labels
from prefect_sandbox.sandbox.notebook import (
    ExecutedNotebook,
    StageSpec,
    inject_parameters,
    inline_figures,
    notebook_from_stages,
    read_notebook,
    split_stages,
    undeclared_parameters,
)
from prefect_sandbox.sandbox.paths import resolve_inside
from prefect_sandbox.tasks.sandbox import (
    create_sandbox,
    download_artifacts,
    kill_sandbox,
    run_stage,
    upload_inputs,
)
from prefect_sandbox.tasks.storage import ArtifactStore, resolve_storage, store_artifacts

__all__ = [
    "DEFAULT_OUTPUT_DIR",
    "EXECUTED_NOTEBOOK_NAME",
    "SUMMARY_NAME",
    "amodeling_pipeline",
    "arun_notebook",
    "modeling_pipeline",
    "run_notebook",
]

DEFAULT_OUTPUT_DIR = "prefect-sandbox-output"
EXECUTED_NOTEBOOK_NAME = "executed.ipynb"
SUMMARY_NAME = "summary.json"
INLINE_FIGURES_BYTES = 2 << 20
"""Bytes of PNGs at most that the run summary embeds when the store has no URL to show them."""
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

P = ParamSpec("P")
R = TypeVar("R")


def _summaries(stages: list[StageSpec], results: list[StageResult]) -> list[StageSummary]:
    by_name = {result.name: result for result in results}
    summaries = []
    for stage in stages:
        result = by_name.get(stage.name)
        if result is None:
            summaries.append(
                StageSummary(
                    name=stage.name, status="not_run", cell_count=len(stage.cells), duration_s=0.0
                )
            )
            continue
        summaries.append(
            StageSummary(
                name=stage.name,
                status=result.status,
                cell_count=len(stage.cells),
                duration_s=round(result.duration_s, 6),
                failed_cell_index=result.failed_cell_index,
                ename=result.error.ename if result.error else None,
                evalue=result.error.evalue if result.error else None,
            )
        )
    return summaries


def _write_notebook_files(
    executed: ExecutedNotebook, stage_results: list[StageResult], staging: Path
) -> list[str]:
    """Record every cell's result, write the notebook and its inline figures into ``staging``.

    Returns:
        The written files' relative paths.
    """
    cell_of_msg: dict[str | None, int] = {}
    for stage_result in stage_results:
        for record in stage_result.cells:
            executed.record(record.index, stage_result.name, record.result)
            cell_of_msg[record.result.msg_id] = record.index
    for stage_result in stage_results:
        for msg_id, outputs in stage_result.late_outputs.items():
            if msg_id in cell_of_msg:
                executed.add_outputs(cell_of_msg[msg_id], outputs)
    logger = get_run_logger()
    for warning in executed.write(staging / EXECUTED_NOTEBOOK_NAME):
        logger.warning("Executed notebook: %s", warning)
    figures, warnings = inline_figures(executed.notebook)
    for warning in warnings:
        logger.warning("Inline figure skipped: %s", warning)
    written = []
    for path, image in figures:
        (staging / path).parent.mkdir(parents=True, exist_ok=True)
        (staging / path).write_bytes(image)
        written.append(path)
    return [*written, EXECUTED_NOTEBOOK_NAME]


async def _run_pipeline(
    source: NotebookNode,
    stages: list[StageSpec],
    *,
    inputs: list[str],
    artifacts: list[str],
    backend: SandboxBackend,
    storage: S3Bucket | str,
    cell_timeout_s: float | None,
) -> PipelineResult:
    context = FlowRunContext.get()
    assert context is not None and context.flow_run is not None and context.flow is not None, (
        "must run inside a flow"
    )
    flow_run = context.flow_run
    logger = get_run_logger()
    start = time.monotonic()
    store = resolve_storage(storage, context.flow.name, flow_run.name, str(flow_run.id))
    store.prepare()
    executed = ExecutedNotebook(source)
    executed.set_metadata(flow_run_id=str(flow_run.id), flow_run_name=flow_run.name)
    stage_results: list[StageResult] = []
    failure: SandboxError | None = None
    downloaded: list[str] = []
    stored: list[StoredArtifact] = []
    figures: dict[str, str | None] = {}
    progress_id = await acreate_progress_artifact(
        progress=0.0, description=f"0 of {len(stages)} stage(s) done"
    )
    staging = Path(tempfile.mkdtemp(prefix="prefect-sandbox-staging-"))
    try:
        try:
            handle = await create_sandbox(backend, flow_run_labels(str(flow_run.id), flow_run.name))
            executed.set_metadata(backend=handle.backend, sandbox_id=handle.sandbox_id)
            if handle.kernel is not None:
                executed.set_kernel(handle.kernel)
            try:
                try:
                    if inputs:
                        await upload_inputs(backend, handle, inputs, str(staging / "inputs"), store)
                    for done, stage in enumerate(stages, start=1):
                        try:
                            stage_results.append(
                                await run_stage(backend, handle, stage, cell_timeout_s)
                            )
                        except SandboxError as exc:
                            if exc.stage_result is not None:
                                stage_results.append(exc.stage_result)
                            raise
                        await aupdate_progress_artifact(
                            progress_id,
                            progress=100.0 * done / len(stages),
                            description=f"{done} of {len(stages)} stage(s) done: "
                            f"{escape_markdown(stage.name)}",
                        )
                except SandboxError as exc:
                    failure = exc
                # A sandbox that expired or was killed has no files left to collect.
                if artifacts and not isinstance(failure, SandboxNotFoundError):
                    downloaded = await download_artifacts(
                        backend, handle, artifacts, str(staging / "outputs")
                    )
            finally:
                await kill_sandbox(backend, handle)
        finally:
            outputs = staging / "outputs"
            outputs.mkdir(exist_ok=True)
            written = _write_notebook_files(executed, stage_results, outputs)
            stored, storage_failures = await store_artifacts(
                str(outputs), [*downloaded, *written], store
            )
            figures = await asyncio.to_thread(_figure_urls, stored, store, outputs)
        if storage_failures and failure is None:
            failure = FileTransferError(
                f"{len(storage_failures)} artifact(s) could not be stored in "
                f"{store.location}: {'; '.join(storage_failures)}"
            )
        error = str(failure) if failure else None
        result = PipelineResult(
            flow_run_id=str(flow_run.id),
            flow_run_name=flow_run.name,
            status="failed" if failure else "completed",
            stages=_summaries(stages, stage_results),
            artifacts=stored,
            output_dir=store.location,
            duration_s=round(time.monotonic() - start, 6),
            error=error,
        )
        (outputs / SUMMARY_NAME).write_text(result.model_dump_json(indent=2))
        await asyncio.to_thread(store.store, outputs / SUMMARY_NAME, SUMMARY_NAME)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    await acreate_markdown_artifact(
        key="pipeline-summary",
        markdown=summary_markdown(result, figures),
        description="Pipeline summary",
    )
    logger.info("Stored %d file(s) and %s in %s", len(stored), SUMMARY_NAME, store.location)
    if failure is not None:
        raise PipelineFailedError(
            error or "pipeline failed",
            stage=getattr(failure, "stage", None),
            cell_index=getattr(failure, "cell_index", None),
            output_dir=store.location,
            sandbox_id=handle.sandbox_id,
        ) from failure
    return result


def _figure_urls(
    stored: list[StoredArtifact], store: ArtifactStore, staged: Path
) -> dict[str, str | None]:
    """Each stored PNG's path to a URL the Prefect UI can show it from, or None.

    The store's own URL when it has one (S3: presigned); otherwise a ``data:`` URI of the staged
    copy, while the PNGs embedded so far stay within `INLINE_FIGURES_BYTES`.
    """
    urls: dict[str, str | None] = {}
    budget = INLINE_FIGURES_BYTES
    for artifact in stored:
        if not artifact.path.lower().endswith(".png"):
            continue
        url = store.view_url(artifact)
        if url is None and artifact.bytes <= budget:
            data = resolve_inside(staged, artifact.path).read_bytes()
            if data.startswith(_PNG_SIGNATURE):
                url = f"data:image/png;base64,{base64.b64encode(data).decode()}"
                budget -= artifact.bytes
        urls[artifact.path] = url
    return urls


@flow(
    name="run-notebook",
    on_cancellation=[kill_run_sandboxes],
    on_crashed=[kill_run_sandboxes],
)
async def arun_notebook(
    notebook: str,
    inputs: list[str] | None = None,
    artifacts: list[str] | None = None,
    parameters: dict[str, Any] | None = None,
    backend: BackendBlock | None = None,
    storage: S3Bucket | str = DEFAULT_OUTPUT_DIR,
    cell_timeout_s: float | None = None,
) -> PipelineResult:
    """Run a notebook stage by stage in one sandbox and store what it made.

    Stages are the cells tagged ``stage:{name}`` or, untagged, one per top-level markdown
    heading. The artifacts keep their relative paths in ``storage``, beside ``executed.ipynb``,
    the inline figures (``inline-figures/``) and ``summary.json``.

    Args:
        notebook: Path of the .ipynb to run, on the machine that runs the flow.
        inputs: Local files or folders to upload into the sandbox first; a file lands under
            its name, a folder under its name with its tree.
        artifacts: Glob patterns, relative to the sandbox's working directory, of files to
            collect and store afterwards, e.g. figures/*.png.
        parameters: Values injected, papermill-style, after the cell tagged 'parameters'.
        backend: The sandbox backend block; a local Jupyter kernel when empty.
        storage: Where files are stored: an S3Bucket block (keys
            {bucket_folder}/{flow-name}/{run-folder}/{path}), "s3-bucket/{name}" for a
            saved one, "s3://bucket/prefix" with credentials from the AWS environment, or a
            local folder (files in {folder}/{run-folder}/). {run-folder} is the flow-run
            name's slug and 8 hex digits of its id, e.g. happy-cat-1f2e3d4c.
        cell_timeout_s: Seconds each cell may run, -1 for no limit; the backend's default
            when empty.

    Returns:
        The run's `PipelineResult`.

    Raises:
        ValueError: ``cell_timeout_s`` is zero, negative other than -1, NaN or infinite
            (before any sandbox starts).
        NotebookError: the notebook or a parameter is invalid (names the cell or parameter).
        PipelineFailedError: a stage failed; the partial notebook and artifacts were stored.
    """
    checked_timeout_s(cell_timeout_s, "cell_timeout_s")
    original = read_notebook(Path(notebook))
    source = inject_parameters(original, parameters or {})
    unknown = undeclared_parameters(original, parameters or {})
    if unknown:
        get_run_logger().warning(
            "Parameter(s) %s are not assigned in the notebook's cell tagged 'parameters' "
            "(or it has none); injected anyway",
            ", ".join(unknown),
        )
    return await _run_pipeline(
        source,
        split_stages(source),
        inputs=inputs or [],
        artifacts=artifacts or [],
        backend=backend or LocalKernelBackend(),
        storage=storage,
        cell_timeout_s=cell_timeout_s,
    )


@flow(
    name="modeling-pipeline",
    on_cancellation=[kill_run_sandboxes],
    on_crashed=[kill_run_sandboxes],
)
async def amodeling_pipeline(
    stages: dict[str, list[str]],
    inputs: list[str] | None = None,
    artifacts: list[str] | None = None,
    backend: BackendBlock | None = None,
    storage: S3Bucket | str = DEFAULT_OUTPUT_DIR,
    cell_timeout_s: float | None = None,
) -> PipelineResult:
    """Run stages of code cells in one sandbox and store what they made.

    Like `arun_notebook`, for cells given as strings; the executed notebook holds one code cell
    per source, tagged with its stage.

    Args:
        stages: Stage name to the source of each of its cells, in running order.
        inputs: Local files or folders to upload into the sandbox first; a file lands under
            its name, a folder under its name with its tree.
        artifacts: Glob patterns, relative to the sandbox's working directory, of files to
            collect and store afterwards, e.g. figures/*.png.
        backend: The sandbox backend block; a local Jupyter kernel when empty.
        storage: Where files are stored: an S3Bucket block (keys
            {bucket_folder}/{flow-name}/{run-folder}/{path}), "s3-bucket/{name}" for a
            saved one, "s3://bucket/prefix" with credentials from the AWS environment, or a
            local folder (files in {folder}/{run-folder}/). {run-folder} is the flow-run
            name's slug and 8 hex digits of its id, e.g. happy-cat-1f2e3d4c.
        cell_timeout_s: Seconds each cell may run, -1 for no limit; the backend's default
            when empty.

    Returns:
        The run's `PipelineResult`.

    Raises:
        ValueError: ``cell_timeout_s`` is zero, negative other than -1, NaN or infinite
            (before any sandbox starts).
        NotebookError: a stage is empty or unnamed.
        PipelineFailedError: a stage failed; the partial notebook and artifacts were stored.
    """
    checked_timeout_s(cell_timeout_s, "cell_timeout_s")
    source = notebook_from_stages(stages)
    return await _run_pipeline(
        source,
        split_stages(source),
        inputs=inputs or [],
        artifacts=artifacts or [],
        backend=backend or LocalKernelBackend(),
        storage=storage,
        cell_timeout_s=cell_timeout_s,
    )


def sync_twin(async_flow: Flow[P, Coroutine[Any, Any, R]]) -> Callable[P, R]:
    """Derive the blocking twin of an async flow, for plain Python callers.

    Returns:
        A function with the flow's signature that runs the flow and returns its result.
    """

    @functools.wraps(async_flow.fn)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        return run_coro_as_sync(async_flow(*args, **kwargs))

    return run


run_notebook = sync_twin(arun_notebook)
modeling_pipeline = sync_twin(amodeling_pipeline)
