"""The pipeline flows: `arun_notebook` / `run_notebook` and `amodeling_pipeline` /
`modeling_pipeline`.

Each makes one sandbox for its flow run, uploads the inputs, runs the stages in order, downloads
the artifacts, stores them with the executed notebook and ``summary.json``, and kills the
sandbox. The run's life (staging, the cap's slot, the sandbox, every way out, the summary) is
`PipelineRun.running`; these flows hold only their stages. Whatever way the run ends (a failed
stage, a cancel, a signal, ``timeout_seconds``), what was made is stored while the sandbox is
killed; a flow retry runs the whole pipeline again in a fresh sandbox. Their body is
`prefect_sandbox.flows.notebook_run`'s, which also holds the CLI's ``run-notebook``, whose
``storage`` is text so that a run to a folder imports no prefect-aws. The flows are async (a
sync Prefect flow pays about 1 s joining its heartbeat thread); the sync twins run them from
plain Python and, on a script's main thread, take SIGTERM as the CLI does
(``SystemExit(143)`` after the run ends Cancelled). Manual: docs/concepts.md.
"""

from __future__ import annotations

from typing import Any

from prefect import flow
from prefect_aws import S3Bucket

from prefect_sandbox.blocks import BackendBlock
from prefect_sandbox.flows.hooks import kill_run_sandboxes
from prefect_sandbox.flows.notebook_run import checked_run, run_notebook_flow
from prefect_sandbox.flows.pipeline_run import (
    EXECUTED_NOTEBOOK_NAME,
    METRICS_NAME,
    RESERVED_NAMES,
    SUMMARY_NAME,
    own_names_kept,
)
from prefect_sandbox.flows.stopping import sync_twin
from prefect_sandbox.results import PipelineResult
from prefect_sandbox.sandbox.notebook import notebook_from_stages

__all__ = [
    "EXECUTED_NOTEBOOK_NAME",
    "METRICS_NAME",
    "RESERVED_NAMES",
    "SUMMARY_NAME",
    "amodeling_pipeline",
    "arun_notebook",
    "modeling_pipeline",
    "own_names_kept",
    "run_notebook",
]


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
    storage: S3Bucket | str | None = None,
    cell_timeout_s: float | None = None,
    stage_heading_level: int = 1,
) -> PipelineResult:
    """Run a notebook stage by stage in one sandbox and store what it made.

    Stages are the cells tagged ``stage:{name}`` or, untagged, one per markdown heading of
    level ``stage_heading_level`` or above (``# `` headings by default). The artifacts keep
    their relative paths in ``storage``, beside ``executed.ipynb``, the inline figures
    (``inline-figures/``) and ``summary.json``; an artifact with one of those names is stored
    as ``sandbox-<name>`` (`own_names_kept`), with a warning.

    Args:
        notebook: Path of the .ipynb to run, on the machine that runs the flow.
        inputs: Local files or folders to upload into the sandbox first; a file lands under
            its name, a folder under its name with its tree.
        artifacts: Glob patterns, relative to the sandbox's working directory, of files to
            collect and store afterwards, e.g. figures/*.png.
        parameters: Values injected, papermill-style, after the cell tagged 'parameters'.
        backend: The sandbox backend block; when empty, the saved block named by
            PREFECT_SANDBOX_BACKEND_BLOCK, else a local Jupyter kernel.
        storage: Where files are stored: an S3Bucket block (keys
            {bucket_folder}/{flow-name}/{run-folder}/{path}), "s3-bucket/{name}" for a
            saved one, "s3://bucket/prefix" with credentials from the AWS environment, or a
            local folder (files in {folder}/{run-folder}/). {run-folder} is the flow-run
            name's slug and 8 hex digits of its id, e.g. happy-cat-1f2e3d4c. When empty,
            PREFECT_SANDBOX_STORAGE, else the folder prefect-sandbox-output.
        cell_timeout_s: Seconds each cell may run, -1 for no limit; the backend block's
            cell_timeout_s when empty.
        stage_heading_level: In a notebook without stage tags, the deepest markdown heading
            level that opens a stage: 1 for '# ' headings only, 2 for '## ' ones too, up to 6.

    Returns:
        The run's `PipelineResult`.

    Raises:
        ParameterRefusedError: a deployment run's own parameters break a rule of
            `prefect_sandbox.flows.policy` (before any sandbox starts).
        ValueError: a parameter breaks a rule of `prefect_sandbox.options.RunOptions` (before
            any sandbox starts; `UnsafePathError` for a path that climbs).
        NotebookError: the notebook or a parameter is invalid (names the cell or parameter),
            or ``stage_heading_level`` is not 1 to 6.
        PipelineFailedError: a stage failed, or the sandbox could not be made; the partial
            notebook, artifacts and summary.json were stored.
        prefect.exceptions.CancelledRun: the flow's task was cancelled; the run ended Cancelled
            after storing what it made (the message says where it stopped and where the files
            are).
    """

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
    storage: S3Bucket | str | None = None,
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
        backend: The sandbox backend block; when empty, the saved block named by
            PREFECT_SANDBOX_BACKEND_BLOCK, else a local Jupyter kernel.
        storage: Where files are stored: an S3Bucket block (keys
            {bucket_folder}/{flow-name}/{run-folder}/{path}), "s3-bucket/{name}" for a
            saved one, "s3://bucket/prefix" with credentials from the AWS environment, or a
            local folder (files in {folder}/{run-folder}/). {run-folder} is the flow-run
            name's slug and 8 hex digits of its id, e.g. happy-cat-1f2e3d4c. When empty,
            PREFECT_SANDBOX_STORAGE, else the folder prefect-sandbox-output.
        cell_timeout_s: Seconds each cell may run, -1 for no limit; the backend block's
            cell_timeout_s when empty.

    Returns:
        The run's `PipelineResult`.

    Raises:
        ParameterRefusedError: a deployment run's own parameters break a rule of
            `prefect_sandbox.flows.policy` (before any sandbox starts).
        ValueError: a parameter breaks a rule of `prefect_sandbox.options.RunOptions` (before
            any sandbox starts; `UnsafePathError` for a path that climbs).
        NotebookError: a stage is empty or unnamed.
        PipelineFailedError, prefect.exceptions.CancelledRun: as `arun_notebook`.
    """
    return await checked_run(
        None,
        lambda: notebook_from_stages(stages),
        inputs,
        artifacts,
        backend,
        storage,
        cell_timeout_s,
    )


run_notebook = sync_twin(arun_notebook)
modeling_pipeline = sync_twin(amodeling_pipeline)
