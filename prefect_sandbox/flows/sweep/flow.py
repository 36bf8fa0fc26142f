"""The sweep flow, `asweep_notebook` / `sweep_notebook`: its parameters checked, its mode
decided, its branches launched and collected, ``sweep.json`` and its table stored.
Manual: docs/how-to/sweeps.md.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast
from uuid import UUID

import anyio
from prefect import flow, get_run_logger
from prefect.artifacts import acreate_table_artifact
from prefect.client.schemas.objects import FlowRun
from prefect.context import FlowRunContext
from prefect.states import Cancelled
from prefect_aws import S3Bucket

from prefect_sandbox.blocks import BackendBlock
from prefect_sandbox.flows.errors import SweepFailedError
from prefect_sandbox.flows.limits import sweep_limit
from prefect_sandbox.flows.pipeline_run import empty_for_this_attempt, timed_out_reason
from prefect_sandbox.flows.policy import check_deployment_run
from prefect_sandbox.flows.stopping import cancelled_from_api, sync_twin
from prefect_sandbox.flows.sweep.collection import collect, failure_message, run_branches
from prefect_sandbox.flows.sweep.deployment import checked_deployment
from prefect_sandbox.flows.sweep.grid import expand_grid
from prefect_sandbox.flows.sweep.launchers import (
    BranchLauncher,
    DaskLauncher,
    DeploymentLauncher,
    SubflowLauncher,
    cancel_branches,
)
from prefect_sandbox.flows.sweep.model import SWEEP_NAME, Branch, BranchOptions, Mode, sweep_mode
from prefect_sandbox.flows.sweep.table import sweep_table
from prefect_sandbox.markdown_text import table_cell
from prefect_sandbox.options import SweepOptions, check_options
from prefect_sandbox.results import BranchResult, SweepResult
from prefect_sandbox.sandbox.notebook import read_notebook, split_stages
from prefect_sandbox.settings import PrefectSandboxSettings
from prefect_sandbox.tasks.scopes import shielded
from prefect_sandbox.tasks.storage import S3_BLOCK_PREFIX, ArtifactStore, resolve_storage

if TYPE_CHECKING:
    from prefect_sandbox.flows.dask import SandboxDaskTaskRunner

__all__ = ["asweep_notebook", "sweep_notebook"]

_MODE_TEXT: dict[Mode, str] = {
    "subflow": "subflows",
    "dask": "tasks on Dask ({task_runner})",
    "deployment": "runs of deployment {deployment!r}",
}


@dataclass
class _Plan:
    """What the sweep's parameters decide, checked before any branch starts."""

    parameter_sets: list[dict[str, Any]]
    mode: Mode
    deployment: str | None
    """The deployment's full name, ``run-notebook/NAME`` (deployment mode)."""
    runner: SandboxDaskTaskRunner | None
    """The Dask task runner, not started (Dask mode)."""
    artifacts: list[str] | None
    """The artifacts each branch collects, the metrics file among them."""


async def _checked_parameters(
    notebook: str,
    grid: Any,
    inputs: list[str] | None,
    artifacts: list[str] | None,
    storage: S3Bucket | str | None,
    cell_timeout_s: float | None,
    max_live_sandboxes: int | None,
    deployment: str | None,
    metrics_artifact: str | None,
    task_runner: str | None,
    stage_heading_level: int,
) -> _Plan:
    """Every rule on the sweep's parameters (`prefect_sandbox.options.SweepOptions`, then the
    grid, the notebook or the deployment), checked before any branch starts (the flow's
    docstring lists the errors raised)."""
    await check_deployment_run()
    check_options(
        SweepOptions,
        notebook=notebook,
        inputs=inputs,
        artifacts=artifacts,
        storage=storage,
        cell_timeout_s=cell_timeout_s,
        max_live_sandboxes=max_live_sandboxes,
        deployment=deployment,
        task_runner=task_runner,
        metrics_artifact=metrics_artifact,
    )
    parameter_sets = expand_grid(grid)
    runner = None
    if task_runner is not None:
        from prefect_sandbox.flows.dask import dask_task_runner

        runner = dask_task_runner(task_runner)
    if deployment is None:
        split_stages(read_notebook(Path(notebook)), stage_heading_level)
    else:
        deployment = await checked_deployment(deployment)
    if metrics_artifact and metrics_artifact not in (artifacts or []):
        artifacts = [*(artifacts or []), metrics_artifact]
    mode = sweep_mode(deployment, task_runner)
    return _Plan(parameter_sets, mode, deployment, runner, artifacts)


async def _sweep_storage(
    storage: S3Bucket | str | None, flow_name: str, flow_run: FlowRun
) -> tuple[S3Bucket | str, ArtifactStore]:
    """The storage as given (a saved `S3Bucket` loaded: the branches' locations are worked out
    from it, and in deployment mode it is sent to the workers as a reference) and the sweep's
    own store in it, made ready."""
    if storage is None:
        storage = PrefectSandboxSettings().storage
    if isinstance(storage, str) and storage.startswith(S3_BLOCK_PREFIX):
        storage = cast(S3Bucket, await S3Bucket.aload(storage[len(S3_BLOCK_PREFIX) :]))
    store = resolve_storage(storage, flow_name, flow_run.name, str(flow_run.id))
    store.prepare()
    # A retried sweep runs every branch again, as new flow runs: its folder holds what this
    # attempt's branches store, which `sweep.json` lists, and nothing else.
    await empty_for_this_attempt(store, flow_run)
    return storage, store


def _branch_storage(storage: S3Bucket | str, store: ArtifactStore, mode: Mode) -> S3Bucket | str:
    """Where the branches store their folders: inside the sweep's (see the package's layout).

    In deployment mode a folder or ``s3://`` URI travels to the workers as text; a saved
    `S3Bucket` block as itself (a reference), since it cannot carry another folder.
    """
    if mode != "deployment":
        return store.nested_storage()
    return storage if isinstance(storage, S3Bucket) else store.output_dir


def _launcher(plan: _Plan, options: BranchOptions, sweep_id: UUID) -> BranchLauncher:
    """The launcher of the plan's mode."""
    if plan.runner is not None:
        return DaskLauncher(options, plan.runner, sweep_id)
    if plan.deployment is not None:
        return DeploymentLauncher(options, plan.deployment)
    return SubflowLauncher(options, sweep_id)


def _branches(plan: _Plan, flow_run: FlowRun) -> list[Branch]:
    """One branch per parameter set, named ``<sweep-run-name>-<index>`` (indexes padded)."""
    width = len(str(len(plan.parameter_sets) - 1))
    return [
        Branch(index, parameters, f"{flow_run.name}-{index:0{width}d}")
        for index, parameters in enumerate(plan.parameter_sets)
    ]


async def _store(result: SweepResult, store: ArtifactStore) -> None:
    """Store ``sweep.json`` and publish the table artifact ``sweep-summary``."""
    with tempfile.TemporaryDirectory(prefix="prefect-sandbox-sweep-") as staging:
        path = Path(staging) / SWEEP_NAME
        path.write_text(result.model_dump_json(indent=2))
        await asyncio.to_thread(store.store, path, SWEEP_NAME)
    await acreate_table_artifact(
        key="sweep-summary",
        table=sweep_table(result),
        description=f"Sweep of {len(result.branches)} parameter set(s); {SWEEP_NAME} in "
        f"{table_cell(store.output_dir)}",
    )


def _status(
    timed_out: bool, cancelled: bool, failed: list[BranchResult]
) -> Literal["completed", "failed", "cancelled"]:
    """The sweep's status: a timeout fails it, whatever stopped the branches after."""
    if timed_out:
        return "failed"
    if cancelled:
        return "cancelled"
    return "failed" if failed else "completed"


def _outcome(result: SweepResult, failed: list[BranchResult]) -> SweepResult:
    """What the flow returns (``result``) or raises, once ``sweep.json`` is stored."""
    completed = len(result.branches) - len(failed)
    get_run_logger().info(
        "%d of %d branch(es) completed; %s in %s",
        completed,
        len(result.branches),
        SWEEP_NAME,
        result.output_dir,
    )
    if result.status == "cancelled":
        message = f"sweep {result.flow_run_name!r} cancelled; {SWEEP_NAME} in {result.output_dir}"
        # Prefect makes a State the flow returns its final state; the caller gets CancelledRun.
        return cast(SweepResult, Cancelled(message=message))
    if failed:
        raise SweepFailedError(
            result.error or "",
            failed=[branch.flow_run_name or f"entry {branch.index}" for branch in failed],
            output_dir=result.output_dir,
        )
    return result


@flow(
    name="sweep-notebook",
    on_cancellation=[cancel_branches],
    on_crashed=[cancel_branches],
)
async def asweep_notebook(
    notebook: str,
    grid: list[dict[str, Any]] | dict[str, list[Any]],
    inputs: list[str] | None = None,
    artifacts: list[str] | None = None,
    backend: BackendBlock | None = None,
    storage: S3Bucket | str | None = None,
    cell_timeout_s: float | None = None,
    max_live_sandboxes: int | None = None,
    deployment: str | None = None,
    metrics_artifact: str | None = "metrics.json",
    task_runner: str | None = None,
    stage_heading_level: int = 1,
) -> SweepResult:
    """Run a notebook once per parameter set, each run in its own sandbox, concurrently.

    Each branch is a ``run-notebook`` flow run (see `arun_notebook`) named
    ``<sweep-run-name>-<index>``, stored in its own folder with its own ``summary.json``; the
    sweep stores ``sweep.json`` (a `SweepResult`) beside them and a table artifact
    ``sweep-summary``. The modes and the storage layout: docs/how-to/sweeps.md.

    Args:
        notebook: Path of the .ipynb to run; in deployment mode, a path the workers can read.
        grid: A list of parameter sets (name to value), or a mapping of name to a list of
            values, run as their cartesian product; see `expand_grid`.
        inputs: Files or folders uploaded into each branch's sandbox (see `arun_notebook`).
        artifacts: Glob patterns of files each branch collects and stores, e.g. metrics.json.
        backend: The sandbox backend block; when empty, each branch's default (see
            `arun_notebook`; in deployment mode, the deployment's). A saved block in
            deployment mode.
        storage: Where the sweep and its branches store files (see `arun_notebook`); when
            empty, PREFECT_SANDBOX_STORAGE, else the folder prefect-sandbox-output.
        cell_timeout_s: Seconds each cell may run, -1 for no limit; the backend's when empty.
        max_live_sandboxes: The sweep's sandboxes alive at once at most: its branches hold a slot
            of a limit of the sweep's own, ``prefect-sandbox:sweep:<flow run id>``, deleted
            when they have ended (as well as their backend's limit, when the backend block has
            ``max_live_sandboxes``). Subflow and Dask modes only: deployment runs take the cap
            of the saved backend block they use.
        deployment: A ``run-notebook`` deployment's name (``NAME`` or ``run-notebook/NAME``)
            to run the branches as its flow runs; empty: branches are subflows.
        metrics_artifact: The file (a JSON object, relative to the sandbox's working
            directory) each branch's key metrics are read from once stored; it is collected
            with ``artifacts``. Empty for none.
        task_runner: ``"dask"`` runs each branch as a task on a Dask `LocalCluster` of worker
            processes that the sweep starts and closes; ``"dask:ADDRESS"`` on the cluster
            whose scheduler is at ADDRESS (its workers must read the notebook and inputs, and
            reach the storage and, beyond this machine, a Prefect server; see
            `prefect_sandbox.flows.dask`). Empty: branches are subflows in this process.
        stage_heading_level: The branches' stage heading level (see `arun_notebook`).

    Returns:
        The `SweepResult`: every branch with its parameters, status, flow run, location,
        metrics and error.

    Raises:
        ParameterRefusedError: a deployment run's own parameters break a rule of
            `prefect_sandbox.flows.policy`.
        ValueError: a parameter breaks a rule of `prefect_sandbox.options.SweepOptions`
            (`UnsafePathError` for a path that climbs), the deployment is unknown or of another
            flow, or a block to send to a deployment is not saved (before any branch starts).
        GridError: the grid is invalid (names the entry).
        NotebookError: the notebook or ``stage_heading_level`` is invalid (subflow and Dask
            modes, before any branch starts).
        SweepFailedError: a branch failed, was cancelled or crashed; every branch ran to its
            end and ``sweep.json`` was stored (the message names each such branch and where
            its partial results are).
        prefect.exceptions.CancelledRun: the sweep's task was cancelled, or its flow run set
            Cancelling through the API or UI (`cancelled_from_api`, within
            ``PREFECT_SANDBOX_CANCEL_POLL_S``); every branch was stopped and ``sweep.json``
            stored.
    """
    start = time.monotonic()
    plan = await _checked_parameters(
        notebook, grid, inputs, artifacts, storage, cell_timeout_s, max_live_sandboxes,
        deployment, metrics_artifact, task_runner, stage_heading_level,
    )  # fmt: skip
    context = FlowRunContext.get()
    assert context is not None and context.flow_run is not None and context.flow is not None
    flow_run = context.flow_run
    storage, store = await _sweep_storage(storage, context.flow.name, flow_run)
    branches = _branches(plan, flow_run)
    how = _MODE_TEXT[plan.mode].format(task_runner=task_runner, deployment=plan.deployment)
    get_run_logger().info("Sweeping %d parameter set(s) as %s", len(branches), how)
    # The flow run's timeout_seconds stops the branches alone: waiting for them to store what
    # they made, and storing sweep.json, run shielded from it (Prefect still ends it TimedOut).
    deadline = anyio.current_effective_deadline()
    with shielded():
        async with sweep_limit(flow_run.id, max_live_sandboxes) as limit:
            options = BranchOptions(
                notebook=notebook,
                inputs=inputs,
                artifacts=plan.artifacts,
                backend=backend,
                storage=_branch_storage(storage, store, plan.mode),
                cell_timeout_s=cell_timeout_s,
                sweep_limit=limit,
                stage_heading_level=stage_heading_level,
            )
            launcher = _launcher(plan, options, flow_run.id)
            poll_s = PrefectSandboxSettings().cancel_poll_s
            async with launcher.started(), cancelled_from_api(flow_run.id, poll_s=poll_s):
                with anyio.CancelScope(deadline=deadline) as timeout:
                    cancelled = await run_branches(branches, launcher)
        results = await collect(branches, options.storage, metrics_artifact)
        failed = [branch for branch in results if branch.status != "completed"]
        error = failure_message(failed, len(results), store.output_dir) if failed else None
        if timeout.cancel_called:
            timed_out = timed_out_reason(context.flow.timeout_seconds)
            error = f"{timed_out}; {error}" if error else timed_out
        result = SweepResult(
            flow_run_id=str(flow_run.id),
            flow_run_name=flow_run.name,
            status=_status(timeout.cancel_called, cancelled, failed),
            mode=plan.mode,
            notebook=notebook,
            output_dir=store.output_dir,
            metrics_artifact=metrics_artifact or None,
            duration_s=round(time.monotonic() - start, 6),
            branches=results,
            error=error,
        )
        await _store(result, store)
    return _outcome(result, failed)


sweep_notebook = sync_twin(asweep_notebook)
