"""The sweep flow: `asweep_notebook` / `sweep_notebook` run one notebook once per parameter set.

Each parameter set of the grid is a *branch*: one flow run of ``run-notebook``
(`arun_notebook`), with its own sandbox, its own folder and its own ``summary.json``. Branches
run concurrently; one that fails does not stop the others. When all have ended, the sweep reads
each branch's ``summary.json`` and metrics file back from storage (never from the sandbox, which
is gone), stores ``sweep.json`` and publishes a table artifact (key ``sweep-summary``).

Three modes:

- **Subflows** (the default, ``deployment`` empty): branches are subflows in the sweep's own
  process and event loop. Cheap: no worker, no process start, no result round trip; right when
  the sandboxes do the heavy work (E2B, Daytona, Docker) or the machine has the cores for
  local kernels.
- **Deployment runs** (``deployment="NAME"`` of a ``run-notebook`` deployment): each branch is a
  `prefect.deployments.arun_deployment` child run that the deployment's work pool hands to any
  of its workers, so branches spread over many processes and machines. Right when one machine
  cannot hold the branches' kernels, or when branches need the workers' environment. The
  sweep waits for each child run and reads its results back from storage, which must then be
  one every worker and the sweep can reach (S3, or a shared folder); blocks sent to the
  workers (``backend``, an `S3Bucket` ``storage``) must be saved ones, sent by reference.
- **Tasks on Dask** (``task_runner="dask"`` or ``"dask:ADDRESS"``): each branch is a task on
  a Dask cluster's worker processes (a `LocalCluster` the sweep starts, or a running one), its
  flow run a subflow of that task. Branches spread over processes without a work pool or
  deployment; the sweep gets each branch's state back from Dask. Right when the sweep's one
  process (its event loop, its GIL) is the limit, or a Dask cluster is at hand. See
  `prefect_sandbox.flows.dask` for how workers reach the API.

The cap on sandboxes alive at once is the backend's global concurrency limit, held by each
branch from its sandbox's creation to its kill, whatever mode: the sweep schedules nothing
itself. Storage layout, in both modes::

    local folder OUT:   OUT/<sweep-run-folder>/sweep.json
                        OUT/<sweep-run-folder>/<branch-run-folder>/summary.json, ...
    S3 (bucket folder F):
                        F/sweep-notebook/<sweep-run-folder>/sweep.json
                        F/sweep-notebook/<sweep-run-folder>/run-notebook/<branch-run-folder>/...

where a run folder is a flow-run name's slug and 8 hex digits of its id, and a branch's flow
run is named ``<sweep-run-name>-<index>``. (In deployment mode with an `S3Bucket` block, a saved
block cannot be handed a sub-folder, so branches are stored where ``run-notebook`` stores
under that block, ``F/run-notebook/<branch-run-folder>/``; ``sweep.json`` lists each location.)

Cancelling the sweep's task (the CLI does so on SIGINT and SIGTERM) cancels every branch: a
subflow kills its sandbox and stores what it made; a deployment run is set Cancelling, so its
worker stops it and its hooks kill its sandbox; a Dask task that has not started is dropped,
and one that runs, which Dask cannot stop, has its sandbox killed, so its cell ends and it
stores what it made (ending Failed). The sweep then stores ``sweep.json`` and ends
Cancelled. The sweep's own cancellation and crash hooks cancel branches still running.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import math
import os
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast
from uuid import UUID

import yaml
from prefect import flow, get_run_logger, task
from prefect.artifacts import acreate_table_artifact
from prefect.blocks.core import Block
from prefect.cache_policies import NO_CACHE
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterName,
    FlowRunFilterParentFlowRunId,
)
from prefect.client.schemas.objects import FlowRun, State, StateType
from prefect.context import FlowRunContext
from prefect.deployments import arun_deployment
from prefect.flows import Flow
from prefect.states import Cancelled, Cancelling
from prefect_aws import S3Bucket

from prefect_sandbox.blocks import BackendBlock
from prefect_sandbox.blocks.base import SandboxBackend
from prefect_sandbox.flows.errors import GridError, SweepFailedError
from prefect_sandbox.flows.hooks import (
    backend_from_parameter,
    default_backend,
    kill_labelled_sandboxes,
)
from prefect_sandbox.flows.pipeline import (
    SUMMARY_NAME,
    arun_notebook,
    sync_twin,
    uncancel_current_task,
)
from prefect_sandbox.flows.policy import check_deployment_run
from prefect_sandbox.flows.report import table_cell
from prefect_sandbox.results import BranchResult, PipelineResult, SweepResult
from prefect_sandbox.sandbox.base import checked_timeout_s
from prefect_sandbox.sandbox.errors import SandboxError
from prefect_sandbox.sandbox.notebook import (
    parameter_name_problem,
    python_literal,
    read_notebook,
    split_stages,
)
from prefect_sandbox.sandbox.outputs import cap_text
from prefect_sandbox.sandbox.paths import checked_relative_path
from prefect_sandbox.settings import PrefectSandboxSettings
from prefect_sandbox.tasks.storage import S3_BLOCK_PREFIX, ArtifactStore, resolve_storage

if TYPE_CHECKING:
    from prefect_dask.task_runners import PrefectDaskFuture

    from prefect_sandbox.flows.dask import SandboxDaskTaskRunner

__all__ = [
    "MAX_BRANCHES",
    "SWEEP_NAME",
    "asweep_notebook",
    "cancel_branches",
    "expand_grid",
    "metrics_of",
    "read_grid",
    "read_parameters_file",
    "sweep_notebook",
    "sweep_table",
]

SWEEP_NAME = "sweep.json"
MAX_BRANCHES = 10_000
"""Parameter sets a grid may expand to at most (a cartesian product grows fast)."""
METRICS_KEPT = 50
"""Metrics kept per branch in ``sweep.json`` at most."""
METRICS_MAX_BYTES = 1 << 20
"""A stored metrics file larger than this is not read (it is a notebook's output: untrusted)."""
METRIC_TEXT_CHARS = 100
"""Characters of a metric's name, or of its value when a string, kept at most."""
METRIC_COLUMNS = 8
"""Metrics shown as columns of the table artifact at most (all are in ``sweep.json``)."""
TABLE_ROWS_SHOWN = 500
"""Branches listed in the table artifact at most (all are in ``sweep.json``)."""
FAILED_NAMED = 10
"""Failed branches named in the sweep's error at most."""
DEPLOYMENT_POLL_S = 2.0
"""Seconds between two reads of a deployment run's state."""
CANCEL_WAIT_S = 60.0
"""Seconds a cancelled sweep waits for its deployment runs (or Dask tasks) to end before it
records them."""
DASK_POLL_S = 0.2
"""Seconds between two looks at whether a branch's Dask task has ended."""
RUN_NOTEBOOK = "run-notebook"

Metric = float | int | bool | str | None


class _GridCheck:
    """Checks one grid's names and values, naming ``source`` (its file) in each error."""

    def __init__(self, source: str) -> None:
        self.source = source

    def error(self, where: str, problem: str) -> GridError:
        return GridError(f"{self.source}: {where}{problem}", source=self.source)

    def name(self, name: object, where: str) -> str:
        problem = parameter_name_problem(name)
        if problem:
            raise self.error(where, f"parameter name {name!r} {problem}")
        return cast(str, name)

    def value(self, value: Any, where: str) -> None:
        try:
            python_literal(value)
        except SandboxError as exc:
            raise self.error(where, str(exc)) from None


def expand_grid(grid: Any, source: str = "grid") -> list[dict[str, Any]]:
    """The parameter sets a grid stands for, checked before anything runs.

    Args:
        grid: a list of parameter sets (each a mapping of name to value), run as given; or a
            mapping of name to a list of values, run as their cartesian product (the first
            name varies slowest). Values are those `arun_notebook` injects: None, bools,
            numbers, strings, dates, and lists, tuples and dicts of those.
        source: what to call the grid in errors, e.g. its file's path.

    Returns:
        The parameter sets, in order: 1 to `MAX_BRANCHES` of them.

    Raises:
        GridError: the grid is neither form, is empty, expands past `MAX_BRANCHES`, or an
            entry, name or value is invalid (the message names ``source``, the entry by its
            0-based index or the parameter, and the problem).
    """
    check = _GridCheck(source)
    if isinstance(grid, Mapping):
        return _product(grid, check)
    if not isinstance(grid, list | tuple):
        raise check.error(
            "",
            "a grid is a list of parameter sets or a mapping of name to a list of values, "
            f"not {type(grid).__name__}",
        )
    if not grid:
        raise check.error("", "the grid has no parameter set")
    if len(grid) > MAX_BRANCHES:
        raise check.error("", f"{len(grid)} parameter sets; at most {MAX_BRANCHES} run")
    sets = []
    for index, entry in enumerate(grid):
        where = f"entry {index}: "
        if not isinstance(entry, Mapping):
            raise check.error(
                where, f"a parameter set is a mapping of name to value, not {type(entry).__name__}"
            )
        for name, value in entry.items():
            check.value(value, f"{where}parameter {check.name(name, where)!r}: ")
        sets.append(dict(entry))
    return sets


def _product(grid: Mapping[Any, Any], check: _GridCheck) -> list[dict[str, Any]]:
    if not grid:
        raise check.error("", "the grid names no parameter")
    for name, values in grid.items():
        where = f"parameter {check.name(name, '')!r}: "
        if not isinstance(values, list | tuple):
            raise check.error(
                where,
                f"a mapping grid gives each name a list of values, not {type(values).__name__}",
            )
        if not values:
            raise check.error(where, "no values")
        for index, value in enumerate(values):
            check.value(value, f"{where}value {index}: ")
    count = math.prod(len(values) for values in grid.values())
    if count > MAX_BRANCHES:
        raise check.error("", f"the product has {count} parameter sets; at most {MAX_BRANCHES} run")
    names = list(grid)
    return [dict(zip(names, values, strict=True)) for values in itertools.product(*grid.values())]


def read_grid(path: str | Path) -> list[dict[str, Any]]:
    """Read a grid file (``.json``, or ``.yaml`` / ``.yml`` read with YAML's safe loader) and
    expand it with `expand_grid`.

    Args:
        path: the file.

    Returns:
        The parameter sets, in order.

    Raises:
        GridError: the file has another suffix, cannot be read, is not valid JSON or YAML
            (with the line and column), holds a value that contains itself (a YAML alias
            inside its anchor), or holds an invalid grid (names the file and entry).
    """
    source = str(path)
    data = _read_data_file(path, _GridCheck(source), "grid")
    return expand_grid(data, source)


def read_parameters_file(path: str | Path) -> dict[str, Any]:
    """Read a parameters file: a mapping of parameter name to value, in ``.json``, or ``.yaml``
    / ``.yml`` read with YAML's safe loader (the CLI's ``-f``, as papermill's).

    Args:
        path: the file.

    Returns:
        The parameters, in file order.

    Raises:
        GridError: the file has another suffix, cannot be read, is not valid JSON or YAML, is
            not a mapping, or holds a bad name or a value with no Python literal (names the
            file and parameter).
    """
    check = _GridCheck(str(path))
    data = _read_data_file(path, check, "parameters")
    if not isinstance(data, dict):
        raise check.error("", "a parameters file holds a mapping of name to value")
    for name, value in data.items():
        check.value(value, f"{check.name(name, '')}: ")
    return data


def _read_data_file(path: str | Path, check: _GridCheck, what: str) -> Any:
    """The data in a ``.json``, ``.yaml`` or ``.yml`` file; errors name the file (and the
    line and column), ``what`` says what kind of file it should be."""
    suffix = Path(path).suffix.lower()
    if suffix not in (".json", ".yaml", ".yml"):
        raise check.error("", f"a {what} file's name ends in .json, .yaml or .yml")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise check.error("", f"cannot be read: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise check.error("", f"is not UTF-8 text: {exc.reason} at byte {exc.start}") from None
    try:
        data = json.loads(text) if suffix == ".json" else yaml.safe_load(text)
    except json.JSONDecodeError as exc:
        where = f"line {exc.lineno}, column {exc.colno}: "
        raise check.error(where, f"not valid JSON: {exc.msg}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise check.error(where, f"not valid YAML: {problem}") from None
    if _contains_itself(data):
        raise check.error("", "a value contains itself (a YAML alias inside its own anchor)")
    return data


def _contains_itself(data: Any) -> bool:
    """Whether a list or dict in ``data`` contains itself, as YAML's aliases can make one.

    Walked without recursion, each container once, so a deep or alias-heavy file costs no
    more than its distinct containers.
    """
    done: set[int] = set()
    on_path: set[int] = set()
    stack: list[tuple[Any, bool]] = [(data, False)]
    while stack:
        value, leaving = stack.pop()
        if leaving:
            on_path.discard(id(value))
            done.add(id(value))
            continue
        if not isinstance(value, list | dict) or id(value) in done:
            continue
        if id(value) in on_path:
            return True
        on_path.add(id(value))
        stack.append((value, True))
        stack.extend(
            (child, False) for child in (value.values() if isinstance(value, dict) else value)
        )
    return False


def metrics_of(data: bytes) -> tuple[dict[str, Metric], str | None]:
    """The key metrics in a branch's stored metrics file: its top-level numbers, booleans,
    nulls and strings, in order, at most `METRICS_KEPT`, names and strings cut at
    `METRIC_TEXT_CHARS` characters.

    Args:
        data: the file's content (a notebook wrote it: anything).

    Returns:
        The metrics, and why there are none when the file is no JSON object (else None).
    """
    try:
        value = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        return {}, f"not JSON: {cap_text(str(exc), 200)}"
    if not isinstance(value, dict):
        return {}, f"a JSON {type(value).__name__}, not an object"
    kept: dict[str, Metric] = {}
    for name, item in value.items():
        if len(kept) == METRICS_KEPT:
            break
        if isinstance(item, str):
            item = item[:METRIC_TEXT_CHARS]
        elif item is not None and not isinstance(item, bool | int | float):
            continue
        kept[name[:METRIC_TEXT_CHARS]] = item
    return kept, None


_FIXED_COLUMNS = ("branch", "flow run", "status", "parameters", "location", "error")


def _metric_text(value: Metric) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def _parameters_text(parameters: Mapping[str, Any]) -> str:
    return ", ".join(
        f"{name}={json.dumps(value, default=str)}" for name, value in parameters.items()
    )


def sweep_table(result: SweepResult) -> list[dict[str, str]]:
    """Rows of the sweep's table artifact: one per branch (at most `TABLE_ROWS_SHOWN`, then
    one row saying how many more there are), with its parameters, status, flow run, the first
    `METRIC_COLUMNS` metric names seen as columns, its location and error.

    Every text a branch could choose (parameters, metric names and values, errors, names) is
    escaped and cut as `table_cell` does.

    Returns:
        Rows, each a mapping of column name to text.
    """
    names: list[str] = []
    for branch in result.branches:
        names += [name for name in branch.metrics if name not in names]
    columns = {
        name: table_cell(f"metric {name}" if name in _FIXED_COLUMNS else name)
        for name in names[:METRIC_COLUMNS]
    }
    rows = []
    for branch in result.branches[:TABLE_ROWS_SHOWN]:
        row = {
            "branch": str(branch.index),
            "flow run": table_cell(branch.flow_run_name or ""),
            "status": branch.status,
            "parameters": table_cell(_parameters_text(branch.parameters)),
        }
        for name, column in columns.items():
            value = branch.metrics.get(name, "")
            row[column] = table_cell(_metric_text(value)) if name in branch.metrics else ""
        row["location"] = table_cell(branch.output_dir or "")
        row["error"] = table_cell(branch.error or "")
        rows.append(row)
    rest = len(result.branches) - TABLE_ROWS_SHOWN
    if rest > 0:
        rows.append({"branch": f"… and {rest} more branch(es), all listed in {SWEEP_NAME}"})
    return rows


@dataclass
class _Branch:
    """One branch while it runs: what its launcher learnt of its flow run."""

    index: int
    parameters: dict[str, Any]
    name: str
    flow_run_id: UUID | None = None
    state: State[Any] | None = None
    error: str | None = None
    """An error raised outside the branch's flow run (e.g. the deployment is unknown)."""


Launcher = Callable[[_Branch], Awaitable[None]]
"""Runs one branch to its end, setting its ``flow_run_id`` and final ``state``; cancelled, it
has the branch stop (sandbox killed) before it returns or re-raises."""


@dataclass
class _Options:
    """The `arun_notebook` arguments every branch shares."""

    notebook: str
    inputs: list[str] | None
    artifacts: list[str] | None
    backend: SandboxBackend | None
    storage: S3Bucket | str
    cell_timeout_s: float | None


async def _run_notebook(options: _Options, name: str, parameters: dict[str, Any]) -> State[Any]:
    """One branch's ``run-notebook`` flow run, as a subflow of what calls it; its final state."""
    run = arun_notebook.with_options(flow_run_name=name)
    return await run(
        notebook=options.notebook,
        inputs=options.inputs,
        artifacts=options.artifacts,
        parameters=parameters,
        backend=cast(BackendBlock | None, options.backend),
        storage=options.storage,
        cell_timeout_s=options.cell_timeout_s,
        return_state=True,
    )


def _subflow_launcher(options: _Options) -> Launcher:
    async def launch(branch: _Branch) -> None:
        state = await _run_notebook(options, branch.name, branch.parameters)
        branch.flow_run_id = state.state_details.flow_run_id
        branch.state = state

    return launch


@task(name="sweep-branch", task_run_name="{name}", cache_policy=NO_CACHE)
async def _dask_branch(name: str, options: _Options, parameters: dict[str, Any]) -> dict[str, Any]:
    """One branch on a Dask worker: its ``run-notebook`` flow run, a subflow of this task.

    Returns:
        ``{"state": <the flow run's final state>}`` (a state returned bare would become the
        task's own).
    """
    return {"state": await _run_notebook(options, name, parameters)}


def _absolute_paths(options: _Options) -> _Options:
    """``options`` with relative local paths (notebook, inputs, storage folder) made absolute:
    a Dask worker process has a working directory of its own."""

    def absolute(path: str) -> str:
        return path if path.startswith("s3://") else os.path.abspath(path)

    storage = options.storage
    return dataclasses.replace(
        options,
        notebook=absolute(options.notebook),
        inputs=None if options.inputs is None else [absolute(path) for path in options.inputs],
        storage=absolute(storage) if isinstance(storage, str) else storage,
    )


def _dask_launcher(runner: SandboxDaskTaskRunner, options: _Options, sweep_id: UUID) -> Launcher:
    options = _absolute_paths(options)

    async def launch(branch: _Branch) -> None:
        future = runner.submit(
            _dask_branch,
            {"name": branch.name, "options": options, "parameters": branch.parameters},
        )
        try:
            outcome = await _dask_outcome(future)
        except asyncio.CancelledError:
            uncancel_current_task()
            # Dask cannot stop a running task: kill the branch's sandbox, so that its run
            # stops at its cell and stores what it made, and wait for it. A task that has not
            # made its flow run yet is dropped (if it just started, the sweep's hook kills).
            if not await _kill_branch_sandboxes(branch.name, sweep_id, options.backend):
                future.wrapped_future.cancel()
            try:
                outcome = await asyncio.wait_for(_dask_outcome(future), CANCEL_WAIT_S)
            except Exception:  # dropped, or still running: the branch counts as cancelled
                return
        branch.state = cast(State[Any], outcome["state"])
        branch.flow_run_id = branch.state.state_details.flow_run_id

    return launch


async def _dask_outcome(future: PrefectDaskFuture[Any]) -> dict[str, Any]:
    """What `_dask_branch` returned, once its Dask task has ended; polled every `DASK_POLL_S`
    (a thread per waiting branch would fill the event loop's default executor)."""
    while not future.wrapped_future.done():
        await asyncio.sleep(DASK_POLL_S)
    return cast(dict[str, Any], await asyncio.to_thread(future.result))


async def _kill_branch_sandboxes(name: str, sweep_id: UUID, backend: SandboxBackend | None) -> bool:
    """Kill the sandboxes of the sweep's branch flow run named ``name``, if it was made.

    Returns:
        Whether that flow run was made.
    """
    async with get_client() as client:
        runs = await client.read_flow_runs(
            flow_run_filter=FlowRunFilter(
                name=FlowRunFilterName(any_=[name]),
                parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[sweep_id]),
            )
        )
    backend = backend or await default_backend()
    for run in runs:
        await kill_labelled_sandboxes(backend, str(run.id), "the sweep was cancelled")
    return bool(runs)


def _block_reference(block: Block, what: str) -> dict[str, Any]:
    """A saved block as a deployment run's parameter: a reference, so its secrets travel in
    no parameter and the worker loads it.

    Raises:
        ValueError: the block is not saved.
    """
    if block._block_document_id is None:
        raise ValueError(
            f"{what} must be a saved block to be sent to a deployment's runs: save it, "
            f"or give its name"
        )
    return {"$ref": {"block_document_id": str(block._block_document_id)}}


def _deployment_launcher(deployment: str, options: _Options) -> Launcher:
    shared: dict[str, Any] = {"notebook": options.notebook}
    for name in ("inputs", "artifacts", "cell_timeout_s"):
        if getattr(options, name) is not None:
            shared[name] = getattr(options, name)
    if options.backend is not None:
        shared["backend"] = _block_reference(options.backend, "backend")
    storage = options.storage
    shared["storage"] = (
        _block_reference(storage, "storage") if isinstance(storage, Block) else storage
    )

    async def launch(branch: _Branch) -> None:
        creating = asyncio.ensure_future(
            arun_deployment(
                deployment,
                parameters={**shared, "parameters": branch.parameters},
                flow_run_name=branch.name,
                timeout=0,
            )
        )
        try:
            flow_run = await asyncio.shield(creating)
            branch.flow_run_id = flow_run.id
            branch.state = await _final_state(flow_run.id, None)
            return
        except asyncio.CancelledError:
            uncancel_current_task()
        # Cancelled: a run being made is made all the same, then cancelled, so none outlives
        # the sweep unseen.
        flow_run = await creating
        branch.flow_run_id = flow_run.id
        branch.state = await _cancel_deployment_run(flow_run.id)

    return launch


async def _final_state(flow_run_id: UUID, within_s: float | None) -> State[Any] | None:
    """The flow run's state once final, polled every `DEPLOYMENT_POLL_S`; after ``within_s``
    seconds (None: no limit), its state then."""
    deadline = None if within_s is None else time.monotonic() + within_s
    async with get_client() as client:
        while True:
            state = (await client.read_flow_run(flow_run_id)).state
            if state is not None and state.is_final():
                return state
            if deadline is not None and time.monotonic() >= deadline:
                return state
            await asyncio.sleep(DEPLOYMENT_POLL_S)


async def _request_cancel(flow_run: FlowRun, why: str) -> None:
    """Cancel a deployment run: one not started yet at once; a running one through its worker,
    whose cancellation kills its sandbox (the run's own hook)."""
    state = flow_run.state
    if state is not None and state.is_final():
        return
    not_started = state is None or state.type in (StateType.SCHEDULED, StateType.PENDING)
    async with get_client() as client:
        await client.set_flow_run_state(
            flow_run.id, Cancelled(message=why) if not_started else Cancelling(message=why)
        )


async def _cancel_deployment_run(flow_run_id: UUID) -> State[Any] | None:
    """Cancel a deployment run and wait up to `CANCEL_WAIT_S` for it to end.

    Returns:
        Its state then.
    """
    async with get_client() as client:
        flow_run = await client.read_flow_run(flow_run_id)
    await _request_cancel(flow_run, "the sweep was cancelled")
    return await _final_state(flow_run_id, CANCEL_WAIT_S)


async def cancel_branches(flow: Flow[Any, Any], flow_run: FlowRun, state: State[Any]) -> None:
    """Stop a cancelled or crashed sweep's branches that still run (a flow-run state hook):
    deployment runs are cancelled, subflows' sandboxes killed by their flow-run labels.

    It may run in another process that sees only the flow-run record, as the pipeline's hooks.
    """
    async with get_client() as client:
        children = await client.read_flow_runs(
            flow_run_filter=FlowRunFilter(
                parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run.id])
            )
        )
    why = f"sweep {flow_run.name!r} ended {state.name or state.type.value}"
    backend: SandboxBackend | None = None
    for child in children:
        if child.state is not None and child.state.is_final():
            continue
        if child.deployment_id is not None:
            await _request_cancel(child, why)
            continue
        backend = backend or await backend_from_parameter(flow_run.parameters.get("backend"))
        await kill_labelled_sandboxes(backend, str(child.id), why)


async def _run_branches(branches: list[_Branch], launch: Launcher) -> bool:
    """Run every branch concurrently to its end; an error in one is recorded on it.

    Returns:
        Whether the sweep was cancelled meanwhile (every branch was then cancelled, and this
        waited for each to stop).
    """

    async def guarded(branch: _Branch) -> None:
        try:
            await launch(branch)
        except Exception as exc:
            branch.error = cap_text(f"{type(exc).__name__}: {exc}", 500)

    tasks = [asyncio.create_task(guarded(branch)) for branch in branches]
    try:
        await asyncio.wait(tasks)
    except asyncio.CancelledError:
        uncancel_current_task()
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks)
        return True
    return False


BranchStatus = Literal["completed", "failed", "cancelled", "crashed", "not_run"]
_STATUS: dict[StateType, BranchStatus] = {
    StateType.COMPLETED: "completed",
    StateType.FAILED: "failed",
    StateType.CRASHED: "crashed",
}


def _collect(
    branch: _Branch, storage: S3Bucket | str, metrics_artifact: str | None
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
    result.output_dir = store.location
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
    problem: str | None = f"{artifact.bytes} bytes, over {METRICS_MAX_BYTES}"
    if artifact.bytes <= METRICS_MAX_BYTES:
        try:
            result.metrics, problem = metrics_of(store.read(artifact.path))
        except SandboxError as exc:
            problem = str(exc)
    if problem:
        get_run_logger().warning(
            "Branch %s: no metrics from %r: %s", branch.name, artifact.path, problem
        )
    return result


def _failure_message(failed: list[BranchResult], total: int, where: str) -> str:
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


def _branch_storage(
    storage: S3Bucket | str, store: ArtifactStore, deployment: bool
) -> S3Bucket | str:
    """Where the branches store their folders: inside the sweep's (see the module's layout).

    In deployment mode a folder or ``s3://`` URI travels to the workers as text; a saved
    `S3Bucket` block as itself (a reference), since it cannot carry another folder.
    """
    if not deployment:
        return store.nested_storage()
    return storage if isinstance(storage, S3Bucket) else store.location


async def _branch_backend(
    backend: SandboxBackend | None, max_sandboxes: int | None
) -> SandboxBackend | None:
    """The backend the branches get: ``backend``, or a copy whose ``max_live_sandboxes`` is
    ``max_sandboxes`` (the sweep's default backend's, when none is given)."""
    if max_sandboxes is None:
        return backend
    base = backend or await default_backend()
    return base.model_copy(update={"max_live_sandboxes": max_sandboxes})


def _task_runner(spec: str | None, deployment: str | None) -> SandboxDaskTaskRunner | None:
    """The Dask task runner ``spec`` names (see `dask_task_runner`), or None for none.

    Raises:
        ValueError: ``spec`` is no task runner, or is given with a deployment.
        BackendNotInstalledError: the ``dask`` extra is not installed.
    """
    if spec is None:
        return None
    if deployment is not None:
        raise ValueError(
            "task_runner and deployment exclude each other: a deployment's runs go to its "
            "work pool's workers"
        )
    from prefect_sandbox.flows.dask import dask_task_runner

    return dask_task_runner(spec)


def _started(runner: SandboxDaskTaskRunner | None) -> contextlib.AbstractAsyncContextManager[Any]:
    """Within: ``runner`` started (see `prefect_sandbox.flows.dask.started`); nothing if None."""
    if runner is None:
        return contextlib.nullcontext()
    from prefect_sandbox.flows.dask import started

    return started(runner)


async def _checked_deployment(deployment: str) -> str:
    """The deployment's full name, ``run-notebook/NAME``, once the API knows it.

    Raises:
        ValueError: it is of another flow, or the API knows no such deployment.
    """
    from prefect.exceptions import ObjectNotFound

    flow_name, slash, name = deployment.rpartition("/")
    if slash and flow_name != RUN_NOTEBOOK:
        raise ValueError(
            f"deployment {deployment!r} is of flow {flow_name!r}; a sweep's branches run "
            f"{RUN_NOTEBOOK!r}"
        )
    full = f"{RUN_NOTEBOOK}/{name}"
    async with get_client() as client:
        try:
            await client.read_deployment_by_name(full)
        except ObjectNotFound:
            raise ValueError(f"no deployment {full!r} is known to the Prefect API") from None
    return full


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
    max_sandboxes: int | None = None,
    deployment: str | None = None,
    metrics_artifact: str | None = "metrics.json",
    task_runner: str | None = None,
) -> SweepResult:
    """Run a notebook once per parameter set, each run in its own sandbox, concurrently.

    Each branch is a ``run-notebook`` flow run (see `arun_notebook`) named
    ``<sweep-run-name>-<index>``, stored in its own folder with its own ``summary.json``; the
    sweep stores ``sweep.json`` (a `SweepResult`) beside them and a table artifact
    ``sweep-summary``. The module's docstring has the storage layout.

    Branches run as subflows in this process (``deployment`` empty: cheap, one process), or as
    runs of a ``run-notebook`` deployment on its work pool's workers (many processes and
    machines; storage must be shared, blocks saved).

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
        max_sandboxes: Sandboxes of the backend alive at once at most, over all branches (and
            every other run of that backend): sets ``max_live_sandboxes`` on a copy of the
            backend the branches get. Subflow mode only: deployment runs take the cap of the
            saved backend block they use.
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

    Returns:
        The `SweepResult`: every branch with its parameters, status, flow run, location,
        metrics and error.

    Raises:
        ParameterRefusedError: in a deployment run, its own parameters give ``backend`` by
            value, a path outside ``PREFECT_SANDBOX_INPUT_ROOTS`` (as `arun_notebook`) or a
            Dask cluster's address as ``task_runner``.
        ValueError: ``cell_timeout_s``, ``max_sandboxes`` or ``task_runner`` is no valid value
            (or ``max_sandboxes`` or ``task_runner`` is given with ``deployment``),
            ``metrics_artifact`` leaves the
            working directory (`UnsafePathError`), the deployment is unknown or of another
            flow, or a block to send to a deployment is not saved (before any branch starts).
        GridError: the grid is invalid (names the entry).
        NotebookError: the notebook is invalid (subflow mode, before any branch starts).
        SweepFailedError: a branch failed, was cancelled or crashed; every branch ran to its
            end and ``sweep.json`` was stored (the message names each such branch and where
            its partial results are).
        prefect.exceptions.CancelledRun: the sweep's task was cancelled; every branch was
            stopped and ``sweep.json`` stored.
    """
    start = time.monotonic()
    await check_deployment_run()
    checked_timeout_s(cell_timeout_s, "cell_timeout_s")
    if max_sandboxes is not None and max_sandboxes < 1:
        raise ValueError(f"max_sandboxes must be 1 or more; got {max_sandboxes}")
    if metrics_artifact:
        checked_relative_path(metrics_artifact)
    parameter_sets = expand_grid(grid)
    runner = _task_runner(task_runner, deployment)
    if deployment is None:
        split_stages(read_notebook(Path(notebook)))
    elif max_sandboxes is not None:
        raise ValueError(
            "max_sandboxes is not sent to a deployment's runs (their backend is a saved block): "
            "set max_live_sandboxes on that block"
        )
    else:
        deployment = await _checked_deployment(deployment)
    context = FlowRunContext.get()
    assert context is not None and context.flow_run is not None and context.flow is not None, (
        "must run inside a flow"
    )
    flow_run = context.flow_run
    if storage is None:
        storage = PrefectSandboxSettings().storage
    if isinstance(storage, str) and storage.startswith(S3_BLOCK_PREFIX):
        # Loaded once: the branches' locations are worked out from it, and in deployment
        # mode it is sent to the workers as a reference.
        storage = cast(S3Bucket, await S3Bucket.aload(storage[len(S3_BLOCK_PREFIX) :]))
    store = resolve_storage(storage, context.flow.name, flow_run.name, str(flow_run.id))
    store.prepare()
    branch_storage = _branch_storage(storage, store, deployment is not None)
    if metrics_artifact and metrics_artifact not in (artifacts or []):
        artifacts = [*(artifacts or []), metrics_artifact]
    options = _Options(
        notebook=notebook,
        inputs=inputs,
        artifacts=artifacts,
        backend=await _branch_backend(backend, max_sandboxes),
        storage=branch_storage,
        cell_timeout_s=cell_timeout_s,
    )
    if runner is not None:
        launch = _dask_launcher(runner, options, flow_run.id)
    elif deployment is None:
        launch = _subflow_launcher(options)
    else:
        launch = _deployment_launcher(deployment, options)
    width = len(str(len(parameter_sets) - 1))
    branches = [
        _Branch(index, parameters, f"{flow_run.name}-{index:0{width}d}")
        for index, parameters in enumerate(parameter_sets)
    ]
    logger = get_run_logger()
    logger.info(
        "Sweeping %d parameter set(s) as %s",
        len(branches),
        f"runs of deployment {deployment!r}"
        if deployment
        else f"tasks on Dask ({task_runner})"
        if runner
        else "subflows",
    )
    async with _started(runner):
        cancelled = await _run_branches(branches, launch)
    results = await asyncio.gather(
        *(
            asyncio.to_thread(_collect, branch, branch_storage, metrics_artifact)
            for branch in branches
        )
    )
    failed = [branch for branch in results if branch.status != "completed"]
    error = _failure_message(failed, len(results), store.location) if failed else None
    result = SweepResult(
        flow_run_id=str(flow_run.id),
        flow_run_name=flow_run.name,
        status="cancelled" if cancelled else "failed" if failed else "completed",
        mode="deployment" if deployment else "dask" if runner else "subflow",
        notebook=notebook,
        output_dir=store.location,
        metrics_artifact=metrics_artifact or None,
        duration_s=round(time.monotonic() - start, 6),
        branches=list(results),
        error=error,
    )
    with tempfile.TemporaryDirectory(prefix="prefect-sandbox-sweep-") as staging:
        path = Path(staging) / SWEEP_NAME
        path.write_text(result.model_dump_json(indent=2))
        await asyncio.to_thread(store.store, path, SWEEP_NAME)
    await acreate_table_artifact(
        key="sweep-summary",
        table=sweep_table(result),
        description=f"Sweep of {len(results)} parameter set(s); {SWEEP_NAME} in "
        f"{table_cell(store.location)}",
    )
    logger.info(
        "%d of %d branch(es) completed; %s in %s",
        len(results) - len(failed),
        len(results),
        SWEEP_NAME,
        store.location,
    )
    if cancelled:
        message = f"sweep {flow_run.name!r} cancelled; {SWEEP_NAME} in {store.location}"
        return cast(SweepResult, Cancelled(message=message))
    if failed:
        raise SweepFailedError(
            error or "",
            failed=[branch.flow_run_name or f"entry {branch.index}" for branch in failed],
            output_dir=store.location,
        )
    return result


sweep_notebook = sync_twin(asweep_notebook)
