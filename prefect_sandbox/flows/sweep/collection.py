"""Running a sweep's branches side by side, and reading back what each left in storage.

Manual: docs/how-to/sweeps.md.
"""

from __future__ import annotations

import asyncio
from typing import Literal

from prefect import get_run_logger
from prefect.client.schemas.objects import StateType
from prefect_aws import S3Bucket

from prefect_sandbox.flows.metrics import read_metrics
from prefect_sandbox.flows.pipeline_run import SUMMARY_NAME
from prefect_sandbox.flows.stopping import uncancel_current_task
from prefect_sandbox.flows.sweep.launchers import BranchLauncher
from prefect_sandbox.flows.sweep.model import RUN_NOTEBOOK, SWEEP_NAME, Branch
from prefect_sandbox.results import BranchResult, PipelineResult
from prefect_sandbox.sandbox.errors import SandboxError
from prefect_sandbox.sandbox.outputs import cap_text
from prefect_sandbox.tasks.scopes import shielded
from prefect_sandbox.tasks.storage import resolve_storage

__all__ = ["FAILED_NAMED", "collect", "failure_message", "run_branches"]

FAILED_NAMED = 10
"""Failed branches named in the sweep's error at most."""

BranchStatus = Literal["completed", "failed", "cancelled", "crashed", "not_run"]
_STATUS: dict[StateType, BranchStatus] = {
    StateType.COMPLETED: "completed",
    StateType.FAILED: "failed",
    StateType.CRASHED: "crashed",
}


async def run_branches(branches: list[Branch], launcher: BranchLauncher) -> bool:
    """Run every branch concurrently to its end; an error in one is recorded on it.

    Returns:
        Whether the sweep was cancelled meanwhile (every branch was then cancelled, and this
        waited for each to stop).
    """

    async def guarded(branch: Branch) -> None:
        try:
            await launcher.run(branch)
        except Exception as exc:
            branch.error = cap_text(f"{type(exc).__name__}: {exc}", 500)

    tasks = [asyncio.create_task(guarded(branch)) for branch in branches]
    try:
        await asyncio.wait(tasks)
    except asyncio.CancelledError:
        uncancel_current_task()
        for task in tasks:
            task.cancel()
        # A passed deadline cancels every await in its scope: this one must see them end.
        with shielded():
            await asyncio.wait(tasks)
        return True
    return False


async def collect(
    branches: list[Branch], storage: S3Bucket | str, metrics_artifact: str | None
) -> list[BranchResult]:
    """What each branch left (`collect_branch`), read in threads side by side."""
    return list(
        await asyncio.gather(
            *(
                asyncio.to_thread(collect_branch, branch, storage, metrics_artifact)
                for branch in branches
            )
        )
    )


def collect_branch(
    branch: Branch, storage: S3Bucket | str, metrics_artifact: str | None
) -> BranchResult:
    """What a branch left: its ``summary.json`` and metrics, read back from storage.

    Blocking (storage I/O): run it in a thread.
    """
    state = branch.state
    status: BranchStatus = "not_run" if branch.error else "cancelled"
    if state is not None:
        status = _STATUS.get(state.type, "cancelled")
    result = BranchResult(
        index=branch.index,
        parameters=branch.parameters,
        status=status,
        error=branch.error or (state.message if state and status != "completed" else None),
    )
    if branch.flow_run_id is None:
        return result
    result.flow_run_id, result.flow_run_name = str(branch.flow_run_id), branch.name
    store = resolve_storage(storage, RUN_NOTEBOOK, branch.name, str(branch.flow_run_id))
    result.output_dir = store.output_dir
    try:
        summary = PipelineResult.model_validate_json(store.read(SUMMARY_NAME))
    except (SandboxError, ValueError):
        return result  # it stopped before storing one: its state says why
    result.summary_stored = True
    result.error = summary.error or result.error
    stored = {artifact.path: artifact for artifact in summary.artifacts}
    artifact = stored.get(metrics_artifact or "")
    if artifact is None:
        return result
    try:
        result.metrics, problem = read_metrics(
            artifact.size_bytes, lambda: store.read(artifact.path)
        )
    except SandboxError as exc:
        problem = str(exc)
    if problem:
        get_run_logger().warning(
            "Branch %s: no metrics from %r: %s", branch.name, artifact.path, problem
        )
    return result


def failure_message(failed: list[BranchResult], total: int, where: str) -> str:
    """The sweep's error: how many branches did not complete, the first `FAILED_NAMED` named
    with why and where their partial results are, and where ``sweep.json`` is."""
    named = []
    for branch in failed[:FAILED_NAMED]:
        name = branch.flow_run_name or f"entry {branch.index}"
        partial = f"; partial results in {branch.output_dir}" if branch.summary_stored else ""
        named.append(f"{name} ({branch.status}: {cap_text(branch.error or '', 200)}{partial})")
    more = f", and {len(failed) - FAILED_NAMED} more" if len(failed) > FAILED_NAMED else ""
    return (
        f"{len(failed)} of {total} branch(es) did not complete: {', '.join(named)}{more}; "
        f"{SWEEP_NAME} in {where}"
    )
