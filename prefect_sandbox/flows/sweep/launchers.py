"""How a sweep runs its branches: one `BranchLauncher` per mode (subflow, Dask, deployment),
and the one path that stops a branch's flow run still running, whatever its mode
(`stop_branch_run`), taken by a launcher cancelled mid-branch and by the sweep's cancellation
and crash hook (`cancel_branches`). Manual: docs/how-to/sweeps.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, cast
from uuid import UUID

import httpx
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterName,
    FlowRunFilterParentFlowRunId,
)
from prefect.client.schemas.objects import FlowRun, State
from prefect.deployments import arun_deployment
from prefect.flows import Flow
from prefect.states import Crashed

from prefect_sandbox.blocks.base import SandboxBackend
from prefect_sandbox.flows.hooks import default_backend, hook_backend, kill_labelled_sandboxes
from prefect_sandbox.flows.limits import also_holding, on_slot
from prefect_sandbox.flows.pipeline import arun_notebook
from prefect_sandbox.flows.pipeline_run import SUMMARY_NAME
from prefect_sandbox.flows.stopping import uncancel_current_task
from prefect_sandbox.flows.sweep.deployment import (
    deployment_arguments,
    final_state,
    request_cancel,
)
from prefect_sandbox.flows.sweep.model import RUN_NOTEBOOK, Branch, BranchOptions, Mode
from prefect_sandbox.results import PipelineResult
from prefect_sandbox.sandbox.retries import retry_delay_s
from prefect_sandbox.tasks.storage import resolve_storage

if TYPE_CHECKING:
    from prefect_dask.task_runners import PrefectDaskFuture

    from prefect_sandbox.flows.dask import SandboxDaskTaskRunner

__all__ = [
    "BRANCHES_STARTING",
    "BRANCH_START_ATTEMPTS",
    "CANCEL_WAIT_S",
    "BranchLauncher",
    "DaskLauncher",
    "DeploymentLauncher",
    "SubflowLauncher",
    "cancel_branches",
    "end_after_worker_death",
    "stop_branch_run",
]

CANCEL_WAIT_S = 60.0
"""Seconds a cancelled sweep waits for its deployment runs (or Dask tasks) to end before it
records them."""
DASK_POLL_S = 0.2
"""Seconds between two looks at whether a branch's Dask task has ended."""
CANCELLED_WHY = "the sweep was cancelled"
BRANCH_START_ATTEMPTS = 4
"""Tries in all at making a subflow branch's flow run (`SubflowLauncher.launch`)."""
BRANCHES_STARTING = 8
"""Subflow branches starting at once at most: from asking for their flow run to holding their
slots (a branch waiting for a slot of a full cap counts)."""
WORKER_DIED = (
    "the Dask worker process running it died mid-run (killed, or out of memory); it was not "
    "run again, since a notebook's cells may not be run twice"
)

BackendSource = Callable[[], Awaitable[SandboxBackend | None]]
"""Gives the backend whose sandboxes a branch's flow run holds (asked only when needed), or
None when it cannot be told (an error was logged: nothing is killed)."""


async def stop_branch_run(flow_run: FlowRun, why: str, backend: BackendSource) -> None:
    """Stop a branch's flow run that still runs, knowing only its record.

    A deployment run (it has a deployment) is cancelled through the API: at once if it has not
    started, else set Cancelling, so that its worker stops it and its own hook kills its
    sandbox. A subflow, in this process or on a Dask worker (which cannot stop a running task),
    has its sandboxes killed by their flow-run label: its cell ends, and it stores what it made.

    Args:
        flow_run: the branch's flow run as read from the API.
        why: what stopped it, for the logs and the state's message.
        backend: the sweep's branches' backend (not asked for a deployment run).
    """
    if flow_run.state is not None and flow_run.state.is_final():
        return
    if flow_run.deployment_id is not None:
        await request_cancel(flow_run, why)
    elif (found := await backend()) is not None:
        await kill_labelled_sandboxes(found, str(flow_run.id), why)


async def cancel_branches(flow: Flow[Any, Any], flow_run: FlowRun, state: State[Any]) -> None:
    """Stop a cancelled or crashed sweep's branches that still run (a flow-run state hook),
    each by `stop_branch_run`.

    It may run in another process that sees only the flow-run record, as the pipeline's hooks;
    the branches' backend is found from the sweep's ``backend`` parameter (`hook_backend`:
    never guessed), once, when a branch needs it.
    """
    async with get_client() as client:
        children = await client.read_flow_runs(
            flow_run_filter=FlowRunFilter(
                parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run.id])
            )
        )
    found: list[SandboxBackend | None] = []

    async def backend() -> SandboxBackend | None:
        if not found:
            found.append(await hook_backend(flow_run))
        return found[0]

    why = f"sweep {flow_run.name!r} ended {state.name or state.type.value}"
    for child in children:
        await stop_branch_run(child, why, backend)


class BranchLauncher(ABC):
    """Runs a sweep's branches in one mode.

    `run` launches one branch and waits for its end; cancelled meanwhile, it has the branch
    stop (its sandbox killed, what it made stored) and records how it ended.
    """

    mode: ClassVar[Mode]

    def __init__(self, options: BranchOptions) -> None:
        self.options = options

    def started(self) -> contextlib.AbstractAsyncContextManager[object]:
        """Within: what the launcher needs running (a Dask cluster); nothing by default."""
        return contextlib.nullcontext()

    async def run(self, branch: Branch) -> None:
        """Run ``branch`` to its end, setting its ``flow_run_id`` and final ``state``."""
        try:
            await self.launch(branch)
        except asyncio.CancelledError:
            uncancel_current_task()
            await self.cancel(branch)

    @abstractmethod
    async def launch(self, branch: Branch) -> None:
        """Start ``branch``'s flow run and wait for its end, recording it on ``branch``."""

    @abstractmethod
    async def cancel(self, branch: Branch) -> None:
        """Stop ``branch``, whose `launch` was cancelled, and record how it ended (waiting at
        most `CANCEL_WAIT_S` for a run in another process)."""

    async def backend(self) -> SandboxBackend:
        """The branches' backend block (the default one when the sweep was given none)."""
        return self.options.backend or await default_backend()


async def _run_notebook(options: BranchOptions, name: str, parameters: dict[str, Any]) -> State:
    """One branch's ``run-notebook`` flow run, as a subflow of what calls it, holding a slot of
    the sweep's limit too while its sandbox lives; its final state."""
    run = arun_notebook.with_options(flow_run_name=name)
    with also_holding(options.sweep_limit):
        return await run(**options.arguments(), parameters=parameters, return_state=True)


class SubflowLauncher(BranchLauncher):
    """Branches as subflows in the sweep's process and event loop, `BRANCHES_STARTING` at most
    starting at once: a branch starts (its flow run made, its slots taken) only when one
    before it holds its slots or has ended. On SQLite every branch asking at once made 150
    flow runs race for one writer (24% of the server's answers 503, its client waiting 2, 4,
    8... s each): 7.5 min before the first sandbox."""

    mode = "subflow"

    def __init__(self, options: BranchOptions, sweep_id: UUID) -> None:
        super().__init__(options)
        self.sweep_id = sweep_id
        self.starting = asyncio.Semaphore(BRANCHES_STARTING)

    async def launch(self, branch: Branch) -> None:
        """Run ``branch``; when the API fails to make its flow run (a 5xx or 429 that
        outlasted Prefect's client retries, before any flow run of the branch exists: nothing
        ran), start it again after a back-off, `BRANCH_START_ATTEMPTS` times in all."""
        for attempt in range(1, BRANCH_START_ATTEMPTS + 1):
            try:
                await self._start(branch)
                return
            except httpx.HTTPStatusError as exc:
                code = exc.response.status_code
                if (
                    attempt == BRANCH_START_ATTEMPTS
                    or not (code == 429 or code >= 500)
                    or await _branch_runs(branch.name, self.sweep_id)
                ):
                    raise
                delay_s = retry_delay_s(None, attempt, first_delay_s=2.0)
                get_run_logger().warning(
                    "Branch %s: its flow run could not be made (%s %s); starting it again "
                    "in %.0f s",
                    branch.name,
                    code,
                    exc.request.url.path,
                    delay_s,
                )
                await asyncio.sleep(delay_s)

    async def _start(self, branch: Branch) -> None:
        """Run ``branch`` once it may start (see the class)."""
        await self.starting.acquire()
        started = False

        def slot_taken() -> None:
            nonlocal started
            if not started:
                started = True
                self.starting.release()

        try:
            with on_slot(slot_taken):
                branch.ended(await _run_notebook(self.options, branch.name, branch.parameters))
        finally:
            slot_taken()

    async def cancel(self, branch: Branch) -> None:
        """Nothing left to do: the subflow, cancelled with its task, killed its sandbox and
        stored what it made."""


@task(name="sweep-branch", task_run_name="{name}", cache_policy=NO_CACHE, retries=0)
async def _dask_branch(
    name: str, options: BranchOptions, parameters: dict[str, Any], sweep_id: UUID
) -> dict[str, Any]:
    """One branch on a Dask worker: its ``run-notebook`` flow run, a subflow of this task.

    Returns:
        ``{"state": <the flow run's final state>}`` (a state returned bare would become the
        task's own); ``{"worker_died": True}`` without running anything when a flow run of
        this branch exists already: Dask runs a task again elsewhere when the worker running
        it died, and a notebook's cells are not run twice (`DaskLauncher` ends that run).
    """
    if await _branch_runs(name, sweep_id):
        return {"worker_died": True}
    return {"state": await _run_notebook(options, name, parameters)}


async def _branch_runs(name: str, sweep_id: UUID) -> list[FlowRun]:
    """The flow runs of the sweep's branch ``name`` (one, unless a worker died)."""
    async with get_client() as client:
        return await client.read_flow_runs(
            flow_run_filter=FlowRunFilter(
                name=FlowRunFilterName(any_=[name]),
                parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[sweep_id]),
            )
        )


class DaskLauncher(BranchLauncher):
    """Branches as tasks on a Dask cluster's workers, each flow run a subflow of its task."""

    mode = "dask"

    def __init__(
        self, options: BranchOptions, runner: SandboxDaskTaskRunner, sweep_id: UUID
    ) -> None:
        super().__init__(options.with_absolute_paths())
        self.runner = runner
        self.sweep_id = sweep_id
        self.futures: dict[int, PrefectDaskFuture[Any]] = {}

    def started(self) -> contextlib.AbstractAsyncContextManager[object]:
        from prefect_sandbox.flows.dask import started

        return started(self.runner)

    async def launch(self, branch: Branch) -> None:
        """Run ``branch`` as a Dask task. When the worker running it dies, this process, which
        outlives it, does what the run's own clean-up would (`end_after_worker_death`)."""
        future = self.runner.submit(
            _dask_branch,
            {
                "name": branch.name,
                "options": self.options,
                "parameters": branch.parameters,
                "sweep_id": self.sweep_id,
            },
        )
        self.futures[branch.index] = future
        from distributed import KilledWorker  # the dask extra, which this mode has

        try:
            outcome = await _dask_outcome(future)
        except KilledWorker:  # Dask gave up on it: every worker that took it died
            outcome = {"worker_died": True}
        if "state" in outcome:
            branch.ended(cast(State[Any], outcome["state"]))
            return
        for run in await _branch_runs(branch.name, self.sweep_id):
            branch.flow_run_id = run.id
            branch.state = await end_after_worker_death(run, self.options, self.backend)

    async def cancel(self, branch: Branch) -> None:
        """Dask cannot stop a running task: the branch's sandbox is killed, so that its run
        stops at its cell and stores what it made (ending Failed). A task that has not made its
        flow run yet is dropped (if it just started, the sweep's hook stops it)."""
        future = self.futures[branch.index]
        runs = await _branch_runs(branch.name, self.sweep_id)
        for run in runs:
            await stop_branch_run(run, CANCELLED_WHY, self.backend)
        if not runs:
            future.wrapped_future.cancel()
        try:
            outcome = await asyncio.wait_for(_dask_outcome(future), CANCEL_WAIT_S)
        except Exception:  # dropped, or still running: the branch counts as cancelled
            return
        branch.ended(cast(State[Any], outcome["state"]))


async def end_after_worker_death(
    flow_run: FlowRun, options: BranchOptions, backend: BackendSource
) -> State[Any]:
    """End a branch's flow run whose Dask worker died mid-run (`WORKER_DIED`) as its own
    clean-up would have: its sandboxes killed (by their flow-run label), ``summary.json``
    stored in its folder (status failed, the reason; no stage is known to have finished),
    and its flow run set Crashed. Done by the sweep's process, which outlived the worker.

    Returns:
        The flow run's final state (as it was, when it had one already).
    """
    if flow_run.state is not None and flow_run.state.is_final():
        return flow_run.state
    found = await backend()
    killed = await kill_labelled_sandboxes(found, str(flow_run.id), WORKER_DIED) if found else []
    store = resolve_storage(options.storage, RUN_NOTEBOOK, flow_run.name, str(flow_run.id))
    summary = PipelineResult(
        flow_run_id=str(flow_run.id),
        flow_run_name=flow_run.name,
        attempt=flow_run.run_count or 1,
        status="failed",
        stages=[],
        artifacts=[],
        output_dir=store.output_dir,
        duration_s=round(flow_run.estimated_run_time.total_seconds(), 6),
        error=WORKER_DIED,
        sandbox_id=killed[0] if killed else None,
        sandbox_killed_at=datetime.now(UTC) if killed else None,
        parameters=flow_run.parameters.get("parameters") or {},
    )
    with tempfile.TemporaryDirectory(prefix="prefect-sandbox-branch-") as staging:
        path = Path(staging) / SUMMARY_NAME
        path.write_text(summary.model_dump_json(indent=2))
        await asyncio.to_thread(store.prepare)
        await asyncio.to_thread(store.store, path, SUMMARY_NAME)
    state: State[Any] = Crashed(message=f"{WORKER_DIED}; {SUMMARY_NAME} in {store.output_dir}")
    async with get_client() as client:
        await client.set_flow_run_state(flow_run.id, state, force=True)
    get_run_logger().warning("Branch %s: %s", flow_run.name, state.message)
    return state


async def _dask_outcome(future: PrefectDaskFuture[Any]) -> dict[str, Any]:
    """What `_dask_branch` returned, once its Dask task has ended; polled every `DASK_POLL_S`
    (a thread per waiting branch would fill the event loop's default executor)."""
    while not future.wrapped_future.done():
        await asyncio.sleep(DASK_POLL_S)
    return cast(dict[str, Any], await asyncio.to_thread(future.result))


class DeploymentLauncher(BranchLauncher):
    """Branches as flow runs of a ``run-notebook`` deployment, on its work pool's workers."""

    mode = "deployment"

    def __init__(self, options: BranchOptions, deployment: str) -> None:
        super().__init__(options)
        self.deployment = deployment
        self.arguments = deployment_arguments(options)
        self.creating: dict[int, asyncio.Future[FlowRun]] = {}
        # On SQLite, Prefect's server answers a write that meets another with 503 ("database
        # is locked"), retried by its client after 2, 4, 8... s: four branch runs asked for at
        # once were made over 14 s, out of order. Made in turn, in grid order: under a second.
        self.one_creation_at_a_time = asyncio.Lock()

    async def launch(self, branch: Branch) -> None:
        creating = asyncio.ensure_future(self._create(branch))
        self.creating[branch.index] = creating
        flow_run = await asyncio.shield(creating)
        branch.flow_run_id = flow_run.id
        branch.state = await final_state(flow_run.id, None)

    async def _create(self, branch: Branch) -> FlowRun:
        async with self.one_creation_at_a_time:
            return await arun_deployment(
                self.deployment,
                parameters={**self.arguments, "parameters": branch.parameters},
                flow_run_name=branch.name,
                timeout=0,
            )

    async def cancel(self, branch: Branch) -> None:
        """A run being made is made all the same, then cancelled, so none outlives the sweep
        unseen."""
        flow_run = await self.creating[branch.index]
        branch.flow_run_id = flow_run.id
        async with get_client() as client:
            flow_run = await client.read_flow_run(flow_run.id)
        await stop_branch_run(flow_run, CANCELLED_WHY, self.backend)
        branch.state = await final_state(flow_run.id, CANCEL_WAIT_S)
