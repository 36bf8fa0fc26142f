"""The stage tasks on a Dask cluster of worker processes (prefect-dask's task runner).

Handles and backend blocks cross processes; a stage on one worker process sees what a stage on
another defined; nothing live is pickled; workers report to the flow process's Prefect API and
get no secret from Prefect's context. One cluster of two single-thread worker processes serves
the whole module.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import faulthandler
import json
import os
import pickle
import signal
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from uuid import UUID

import cloudpickle
import dask
import psutil
import pytest
from distributed import Client, LocalCluster
from distributed.core import Status
from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, FlowRunFilterName
from prefect.client.schemas.objects import StateType
from prefect.context import FlowRunContext, serialize_context
from prefect.exceptions import CancelledRun
from prefect.runtime import flow_run

import prefect_sandbox.tasks
from prefect_sandbox import (
    DaytonaBackend,
    DaytonaCredentials,
    E2BBackend,
    E2BCredentials,
    LocalKernelBackend,
)
from prefect_sandbox.blocks.base import SandboxBackend
from prefect_sandbox.flows.dask import (
    BRANCHES_PER_WORKER,
    SandboxDaskTaskRunner,
    dask_task_runner,
)
from prefect_sandbox.flows.errors import SweepFailedError
from prefect_sandbox.flows.sweep import asweep_notebook
from prefect_sandbox.results import StageResult
from prefect_sandbox.sandbox.base import SandboxHandle
from prefect_sandbox.sandbox.errors import SandboxNotFoundError
from prefect_sandbox.sandbox.labels import FLOW_RUN_ID_LABEL, flow_run_labels
from prefect_sandbox.sandbox.notebook import CellSpec, StageSpec
from prefect_sandbox.tasks.sandbox import (
    create_sandbox,
    download_artifacts,
    kill_sandbox,
    run_stage,
    upload_inputs,
)
from prefect_sandbox.testing.daytona import DaytonaEmulator
from prefect_sandbox.testing.e2b import E2BEmulator
from tests.conftest import (
    ROOT,
    SUBPROCESS_TEST_TIMEOUT_S,
    max_alive_at_once,
    python_stdout,
    stream_text,
)
from tests.test_flows import _cli
from tests.test_sweep import _notebook, branch_run_states, cancel_sweep_through_the_api

pytestmark = pytest.mark.usefixtures("prefect_api")

SECRET = "e2b_dask_secret_0123456789"
"""An API key that no sandbox sees: the secrets test checks where it travels."""


class Workers:
    """The module's cluster: its client, its scheduler's address and each worker's address and
    pid."""

    def __init__(self, client: Client, pids: dict[str, int]) -> None:
        self.client = client
        self.address = client.scheduler.address
        self.pids = pids


WORKER_START_S = 120
"""How long the module's worker processes may take to start and reach the scheduler: Dask's
default 30 s ran out once at load 5 ("Cluster closed without starting up"; 25 s at load 6)."""

NANNY_RESTART_S = 60
"""How long a nanny may take to bring back the worker a test killed before the cluster starts
again whole."""


class Cluster:
    """Two single-thread worker processes and a client of theirs; the client is not Dask's
    default, so a sweep with ``task_runner="dask"`` starts its own cluster rather than queueing
    behind these workers."""

    def __init__(self) -> None:
        self._start()

    def _start(self) -> None:
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(
            dask.config.set({"distributed.comm.timeouts.connect": f"{WORKER_START_S}s"})
        )
        self._local = self._stack.enter_context(
            LocalCluster(
                n_workers=2,
                threads_per_worker=1,
                processes=True,
                dashboard_address=None,
                scheduler_kwargs={"dashboard_address": ":0"},
            )
        )
        self.client = self._stack.enter_context(
            Client(self._local, set_as_default=False, timeout=WORKER_START_S)
        )

    def ready(self) -> Client:
        """The client, once both workers run. A nanny restarting the worker a test killed may
        close, or hang, instead (beside two CPU burners: it closed as the new worker registered,
        once before this check and once during the wait, and the next test's set-up waited
        120 s for it); after `NANNY_RESTART_S` without both workers the cluster starts again
        whole, once."""
        deadline = time.monotonic() + NANNY_RESTART_S
        started_again = False
        while self._running_workers() < 2:
            nanny_closed = any(
                nanny.status == Status.closed for nanny in self._local.workers.values()
            )
            if nanny_closed or time.monotonic() > deadline:
                if started_again:
                    raise TimeoutError("the module's cluster has not 2 workers after a restart")
                print(
                    f"the module's cluster lost a worker (a nanny closed: {nanny_closed}); "
                    "starting it again",
                    file=sys.stderr,
                )
                self.close()
                self._start()
                started_again = True
                deadline = time.monotonic() + WORKER_START_S
            time.sleep(0.2)
        self._register_stack_dumps()
        return self.client

    def stalled_workers(self) -> list[str]:
        """The workers whose last heartbeat reached the scheduler over `STALLED_AFTER_S` ago."""
        workers = self.client.scheduler_info()["workers"]
        now = time.time()
        return [a for a, w in workers.items() if now - w["last_seen"] > STALLED_AFTER_S]

    def _running_workers(self) -> int:
        workers = self.client.scheduler_info()["workers"].values()
        return sum(worker["status"] == Status.running.name for worker in workers)

    def _register_stack_dumps(self) -> None:
        """Each worker process writes its threads' stacks to its stderr on SIGUSR1, even with
        its event loop blocked (a worker once sent no heartbeat for 568 s mid-task). Done at
        each `ready`: a worker a nanny restarted is a new process."""
        self.client.run(faulthandler.register, signal.SIGUSR1, all_threads=True)

    def close(self) -> None:
        """Stop the client, the workers and the scheduler."""
        self._stack.close()


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """The module's `Cluster`."""
    started = Cluster()
    yield started
    started.close()


STALLED_AFTER_S = 30
"""A worker whose heartbeat is older than this is stalled: its event loop is blocked (Dask's
heartbeats are a second or so apart; the scheduler itself restarts one only after 300 s)."""


@pytest.fixture
def workers(cluster: Cluster) -> Iterator[Workers]:
    """The module's cluster, idle: a test that ends with tasks still on a single-thread worker
    (one timed out, or a branch Dask cannot stop), or with a stalled worker, has its workers'
    stacks written to stderr (the test's report) and its workers restarted, or every later
    test's tasks would queue behind them. A worker an earlier test killed is back first (its
    nanny restarts it under a new address)."""
    client = cluster.ready()
    pids: dict[str, int] = client.run(os.getpid)
    yield Workers(client, pids)
    if gone := {address: pid for address, pid in pids.items() if not psutil.pid_exists(pid)}:
        # A worker that died unasked strands what was pinned to it; what Dask knows of why.
        print(f"workers gone: {gone}; Dask's events: {client.get_events()}", file=sys.stderr)
    # A client that left (a CLI's sweep, stopped) takes its tasks with it: a worker stalled
    # in one shows only by its heartbeat (a quiet run at 094d22f: one stopped for 503 s after
    # a branch's fetch-artifacts, and the next test's set-up waited on it).
    if any(client.processing().values()) or cluster.stalled_workers():
        # Where the left tasks stand, for the report of the test that left them: faulthandler
        # answers where the worker's event loop cannot (call_stack would wait on a stalled one).
        for pid in pids.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGUSR1)
        time.sleep(1.0)  # the dumps are written by the workers, not by this process
        client.restart(timeout=WORKER_START_S)


STAGE_WAIT_S = 120
"""How long `staged` waits for each task: one pinned to a worker that died would wait for ever
(its replacement has another address)."""


def _stage(name: str, index: int, source: str) -> StageSpec:
    return StageSpec(name=name, cells=[CellSpec(index=index, source=source)])


@flow(name="dask-stages")
def staged(
    backend: SandboxBackend, input_file: str, staging_dir: str, first: str, second: str
) -> dict[str, Any]:
    """Create, upload and define on worker ``first``; use, download and kill on ``second``."""
    labels = flow_run_labels(str(flow_run.id), str(flow_run.name))
    with dask.annotate(workers=[first]):
        handle = create_sandbox.submit(backend, labels).result(timeout=STAGE_WAIT_S)
        uploaded = upload_inputs.submit(backend, handle, [input_file], staging_dir).result(
            timeout=STAGE_WAIT_S
        )
        define = run_stage.submit(
            backend,
            handle,
            _stage("define", 0, "word = open('word.txt').read().strip()\nimport os"),
        )
        define.result(timeout=STAGE_WAIT_S)
    with dask.annotate(workers=[second]):
        use = run_stage.submit(
            backend,
            handle,
            _stage("use", 1, "print(word * 2)\nopen('out.txt', 'w').write(word.upper())"),
        )
        used: StageResult = use.result(timeout=STAGE_WAIT_S)
        downloaded = download_artifacts.submit(backend, handle, ["out.txt"], staging_dir).result(
            timeout=STAGE_WAIT_S
        )
        killed = kill_sandbox.submit(backend, handle).result(timeout=STAGE_WAIT_S)
    ran_on = {
        name: [
            worker
            for holders in future.wrapped_future.client.who_has([future.wrapped_future]).values()
            for worker in holders
        ]
        for name, future in (("define", define), ("use", use))
    }
    return {
        "handle": handle,
        "uploaded": uploaded,
        "used": used,
        "downloaded": downloaded,
        "killed": killed,
        "ran_on": ran_on,
    }


@flow(name="dask-create-and-kill")
def _create_and_kill(backend: SandboxBackend, worker: str) -> bool:
    with dask.annotate(workers=[worker]):
        handle = create_sandbox.submit(backend, {}).result(timeout=STAGE_WAIT_S)
        killed: bool = kill_sandbox.submit(backend, handle).result(timeout=STAGE_WAIT_S)
    return killed


async def _run_staged(backend: SandboxBackend, workers: Workers, tmp_path: Path) -> dict[str, Any]:
    (tmp_path / "word.txt").write_text("dask\n")
    first, second = sorted(workers.pids)
    runner = SandboxDaskTaskRunner(address=workers.address)
    result: dict[str, Any] = await asyncio.to_thread(
        staged.with_options(task_runner=runner),
        backend,
        str(tmp_path / "word.txt"),
        str(tmp_path / "staging"),
        first,
        second,
    )
    # Each stage ran where it was sent, on two different processes.
    assert result["ran_on"] == {"define": [first], "use": [second]}
    assert len({workers.pids[first], workers.pids[second], os.getpid()}) == 3
    assert result["uploaded"] == ["word.txt"]
    # The second process's stage saw the first's variable: the sandbox persisted.
    used = result["used"]
    assert used.status == "ok"
    assert stream_text(used.cells[0].result.outputs) == "daskdask\n"
    assert result["downloaded"] == ["out.txt"]
    assert (tmp_path / "staging" / "out.txt").read_text() == "DASK"
    assert result["killed"] is True
    return result


@pytest.mark.timeout(SUBPROCESS_TEST_TIMEOUT_S)
async def test_stages_on_two_worker_processes_share_one_local_sandbox(
    workers: Workers, tmp_path: Path
) -> None:
    backend = LocalKernelBackend(interrupt_grace_s=2.0)
    result = await _run_staged(backend, workers, tmp_path)
    handle: SandboxHandle = result["handle"]
    # Killed from the second worker: its files are gone and no kernel of it is left running.
    # The kernel (or its bwrap) is the process given its connection file; its guard, whose
    # command line names the kernel's log (and whose source mentions ipykernel), waits for the
    # next launch below.
    assert not Path(handle.connection["runtime_dir"]).exists()
    assert not Path(handle.workdir).exists()
    connection_file = str(Path(handle.connection["runtime_dir"]) / "kernel.json")
    assert [
        child
        for child in psutil.Process().children(recursive=True)
        if child.status() != psutil.STATUS_ZOMBIE and connection_file in child.cmdline()
    ] == []
    with pytest.raises(SandboxNotFoundError):
        await backend.attach(handle)
    # The worker that launched the kernel reaps it, and stops its guard, at its next launch.
    first = sorted(workers.pids)[0]
    runner = SandboxDaskTaskRunner(address=workers.address)
    await asyncio.to_thread(_create_and_kill.with_options(task_runner=runner), backend, first)
    assert psutil.Process(workers.pids[first]).children(recursive=True) == []
    assert await backend.list_sandboxes({FLOW_RUN_ID_LABEL: handle.labels[FLOW_RUN_ID_LABEL]}) == []


@pytest.mark.timeout(SUBPROCESS_TEST_TIMEOUT_S)
async def test_stages_on_two_worker_processes_share_one_e2b_sandbox(
    workers: Workers, e2b_emulator: E2BEmulator, tmp_path: Path
) -> None:
    test_id = uuid.uuid4().hex
    backend = _e2b_backend(e2b_emulator, test_id)
    result = await _run_staged(backend, workers, tmp_path)
    assert e2b_emulator.sandbox_ids({"test-id": test_id}) == []
    assert e2b_emulator.api_key not in result["handle"].model_dump_json()


def _e2b_backend(emulator: E2BEmulator, test_id: str) -> E2BBackend:
    credentials = E2BCredentials(
        api_key=emulator.api_key, api_url=emulator.url, sandbox_url=emulator.url
    )
    return E2BBackend(credentials=credentials, metadata={"test-id": test_id})


async def test_a_live_sandbox_refuses_pickling_and_its_handle_and_block_cross(
    e2b_emulator: E2BEmulator,
) -> None:
    backend = _e2b_backend(e2b_emulator, uuid.uuid4().hex)
    secret = e2b_emulator.api_key.encode()
    sandbox = await backend.create({})
    try:
        for dump in (pickle.dumps, cloudpickle.dumps, copy.copy, copy.deepcopy):
            with pytest.raises(TypeError, match=r"live E2BSandbox .* pass its handle"):
                dump(sandbox)
        # The handle holds no key; the block, after making a sandbox, holds it once: in its
        # SecretStr (no client or config of it was kept).
        assert pickle.dumps(sandbox.handle).count(secret) == 0
        blob = cloudpickle.dumps(backend)
        assert blob.count(secret) == 1
        again = pickle.loads(blob)
        attached = await again.attach(pickle.loads(pickle.dumps(sandbox.handle)))
        try:
            assert (await attached.run_cell("6 * 7")).outputs[0]["data"]["text/plain"] == "42"
        finally:
            await attached.close()
    finally:
        await sandbox.kill()


async def test_a_live_local_sandbox_refuses_pickling() -> None:
    sandbox = await LocalKernelBackend().create({})
    try:
        with pytest.raises(
            TypeError, match=r"live LocalKernelSandbox .*`backend\.attach\(handle\)`"
        ):
            pickle.dumps(sandbox)
    finally:
        await sandbox.kill()


@pytest.mark.parametrize("name", prefect_sandbox.tasks.__all__)
def test_each_task_pickles_as_dask_sends_it(name: str) -> None:
    # A task's function is no module attribute (the Task is), so cloudpickle sends it by
    # value, with every module global it names: one that does not pickle (a ContextVar, a
    # lock) breaks every Dask run.
    function = getattr(prefect_sandbox.tasks, name).fn
    assert cloudpickle.loads(cloudpickle.dumps(function)).__name__ == function.__name__


@task(cache_policy=NO_CACHE)
def _what_the_worker_sees(backend: E2BBackend) -> dict[str, Any]:
    context = FlowRunContext.get()
    assert context is not None
    return {
        "flow_parameters": json.dumps(context.parameters, default=str),
        "own_key": backend.credentials.api_key.get_secret_value(),
    }


@flow(name="dask-secrets")
def _secrets_flow(backend: E2BBackend) -> dict[str, Any]:
    shipped = cloudpickle.dumps(serialize_context())
    seen: dict[str, Any] = _what_the_worker_sees.submit(backend).result()
    return {**seen, "prefect_reveals": shipped.count(SECRET.encode())}


@pytest.mark.timeout(SUBPROCESS_TEST_TIMEOUT_S)
async def test_workers_get_the_flow_runs_parameters_with_secrets_masked(workers: Workers) -> None:
    backend = E2BBackend(credentials=E2BCredentials(api_key=SECRET))
    runner = SandboxDaskTaskRunner(address=workers.address)
    seen = await asyncio.to_thread(_secrets_flow.with_options(task_runner=runner), backend)
    # Prefect's own context dump reveals the key; what the worker got does not hold it.
    assert seen["prefect_reveals"] >= 1
    assert SECRET not in seen["flow_parameters"]
    assert "**********" in seen["flow_parameters"]
    # The task's own argument is the block itself, its key intact in its SecretStr.
    assert seen["own_key"] == SECRET


_TEMPORARY_API_SCRIPT = """
import json, os, sys
import psutil
from prefect import flow, task
from prefect.settings import PREFECT_API_URL
from prefect_sandbox.flows.dask import SandboxDaskTaskRunner, temporary_server_url

@task
def where():
    servers = [
        " ".join(p.cmdline()) for p in psutil.Process().children(recursive=True)
        if "uvicorn" in " ".join(p.cmdline())
    ]
    return {"pid": os.getpid(), "api_url": PREFECT_API_URL.value(), "servers": servers}

@flow(task_runner=SandboxDaskTaskRunner(address=sys.argv[1]))
def on_dask():
    return where.submit().result()

seen = on_dask()
print(json.dumps({**seen, "flow_api_url": temporary_server_url()}))
"""


@pytest.mark.timeout(SUBPROCESS_TEST_TIMEOUT_S)
def test_workers_report_to_the_flow_processs_temporary_api_server(
    workers: Workers, tmp_path: Path
) -> None:
    script = tmp_path / "on_dask.py"
    script.write_text(_TEMPORARY_API_SCRIPT)
    env = {name: value for name, value in os.environ.items() if not name.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(tmp_path / "home"), PREFECT_SERVER_ANALYTICS_ENABLED="false")
    stdout = python_stdout(str(script), workers.address, env=env, timeout_s=100)
    seen = json.loads(stdout.strip().splitlines()[-1])
    assert seen["pid"] in workers.pids.values()
    assert seen["flow_api_url"].startswith("http://127.0.0.1:")
    assert seen["api_url"] == seen["flow_api_url"]
    assert seen["servers"] == []


CO2 = ROOT / "examples" / "co2"


async def _check_branches_ran_as_the_sweeps_tasks(result: Any) -> None:
    """The branches ran as the sweep's tasks (on the cluster's workers), each flow run a
    subflow of the sweep (so its hooks find them)."""
    sweep_id = uuid.UUID(result.flow_run_id)
    async with get_client() as client:
        task_runs = await client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[sweep_id]))
        )
        branch_tasks = {
            run.name: run for run in task_runs if run.task_key.startswith("_dask_branch")
        }
        assert sorted(branch_tasks) == sorted(str(b.flow_run_name) for b in result.branches)
        assert all(run.state_type == StateType.COMPLETED for run in branch_tasks.values())
        for branch in result.branches:
            run = await client.read_flow_run(uuid.UUID(str(branch.flow_run_id)))
            assert run.parent_task_run_id is not None
            parent = await client.read_task_run(run.parent_task_run_id)
            assert parent.flow_run_id == sweep_id


@pytest.mark.timeout(SUBPROCESS_TEST_TIMEOUT_S)
async def test_a_sweep_on_a_local_dask_cluster_keeps_max_live_sandboxes_alive_at_most(
    tmp_path: Path,
) -> None:
    """The short form of the twelve-branch CO2 sweep below (in ``slow``): each branch's cell
    waits until two branches have started (a rendezvous in a host folder, so unisolated
    kernels), so the cap of two is reached, and one more would show."""
    meet = tmp_path / "meet"
    meet.mkdir()
    source = _notebook(
        tmp_path / "nb.ipynb",
        "import json, os, time\n"
        f"meet = {str(meet)!r}\n"
        "open(os.path.join(meet, str(x)), 'w').close()\n"
        "deadline = time.monotonic() + 120\n"
        "while len(os.listdir(meet)) < 2 and time.monotonic() < deadline:\n"
        "    time.sleep(0.05)\n"
        "json.dump({'double': x * 2}, open('metrics.json', 'w'))",
    )
    grid = [{"x": x} for x in range(1, 5)]
    result = await asweep_notebook(
        notebook=str(source),
        grid=grid,
        backend=LocalKernelBackend(isolation="none"),
        storage=str(tmp_path / "out"),
        max_live_sandboxes=2,
        task_runner="dask",
    )
    assert result.mode == "dask"
    assert result.status == "completed", result.error
    assert [branch.parameters for branch in result.branches] == grid
    assert [branch.metrics for branch in result.branches] == [
        {"double": 2 * x} for x in (1, 2, 3, 4)
    ]
    folders = [Path(str(branch.output_dir)) for branch in result.branches]
    summaries = [json.loads((folder / "summary.json").read_text()) for folder in folders]
    assert [summary["status"] for summary in summaries] == ["completed"] * 4
    assert max_alive_at_once(summaries) == 2
    await _check_branches_ran_as_the_sweeps_tasks(result)


@pytest.mark.slow
@pytest.mark.timeout(400)
async def test_a_sweep_of_twelve_on_a_local_dask_cluster_keeps_three_sandboxes_alive_at_most(
    tmp_path: Path,
) -> None:
    grid = [{"train_end": f"{year}-12-31"} for year in range(1985, 1997)]
    result = await asweep_notebook(
        notebook=str(CO2 / "forecast.ipynb"),
        grid=grid,
        inputs=[str(CO2 / "co2.csv")],
        backend=LocalKernelBackend(),
        storage=str(tmp_path),
        max_live_sandboxes=3,
        task_runner="dask",
    )
    assert result.mode == "dask"
    assert result.status == "completed", result.error
    assert [branch.parameters for branch in result.branches] == grid
    sweep_dir = Path(result.output_dir)
    assert json.loads((sweep_dir / "sweep.json").read_text())["status"] == "completed"
    folders = [Path(str(branch.output_dir)) for branch in result.branches]
    assert len(set(folders)) == 12
    assert all(folder.parent == sweep_dir for folder in folders)
    summaries = [json.loads((folder / "summary.json").read_text()) for folder in folders]
    assert [summary["status"] for summary in summaries] == ["completed"] * 12
    # Each branch fitted on its own training period.
    assert [branch.metrics["train_end"] for branch in result.branches] == [
        entry["train_end"] for entry in grid
    ]
    assert 1 < max_alive_at_once(summaries) <= 3
    await _check_branches_ran_as_the_sweeps_tasks(result)


def test_task_runner_values_name_a_local_cluster_or_a_scheduler() -> None:
    local = dask_task_runner("dask")
    assert local.cluster_class is LocalCluster
    assert local.cluster_kwargs["processes"] is True
    assert local.cluster_kwargs["threads_per_worker"] == BRANCHES_PER_WORKER
    assert dask_task_runner("dask:tcp://127.0.0.1:8786").address == "tcp://127.0.0.1:8786"
    for bad in ("ray", "dask:", "daskx", "Dask"):
        with pytest.raises(ValueError, match="'dask' or 'dask:ADDRESS'"):
            dask_task_runner(bad)


@pytest.mark.timeout(SUBPROCESS_TEST_TIMEOUT_S)
def test_cli_sweep_runs_branches_on_a_dask_scheduler(workers: Workers, tmp_path: Path) -> None:
    _notebook(
        tmp_path / "nb.ipynb",
        "import json\njson.dump({'double': x * 2}, open('metrics.json', 'w'))",
    )
    (tmp_path / "grid.json").write_text(json.dumps({"x": [1, 2]}))
    done = _cli(
        "sweep", "nb.ipynb", "--grid", "grid.json", "--out", "out",
        "--task-runner", f"dask:{workers.address}",
        cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    sweep = json.loads(next((tmp_path / "out").glob("*/sweep.json")).read_text())
    assert sweep["mode"] == "dask"
    assert [branch["metrics"] for branch in sweep["branches"]] == [{"double": 2}, {"double": 4}]
    refused = _cli(
        "sweep", "nb.ipynb", "--grid", "grid.json", "--task-runner", "ray", cwd=tmp_path
    )  # fmt: skip
    assert refused.returncode == 2
    assert "--task-runner: task runner 'ray' is not 'dask' or 'dask:ADDRESS'" in refused.stderr


@pytest.mark.timeout(400)
@pytest.mark.parametrize("how", ["task", "api"])
async def test_a_cancelled_dask_sweep_kills_the_sandboxes_its_running_branches_hold(
    workers: Workers, tmp_path: Path, how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cancelled as the CLI does (its task), or through the API (its flow run set
    Cancelling, which the sweep notices itself)."""
    monkeypatch.setenv("PREFECT_SANDBOX_CANCEL_POLL_S", "0.5")
    _notebook(
        tmp_path / "nb.ipynb", "import time\nopen('sleeping.marker', 'w').write('1')\ntime.sleep(x)"
    )
    work = tmp_path / "work"
    sweep = asyncio.create_task(
        asweep_notebook(
            notebook=str(tmp_path / "nb.ipynb"),
            grid={"x": [300, 301]},
            backend=LocalKernelBackend(workdir_root=str(work)),
            storage=str(tmp_path / "out"),
            task_runner=f"dask:{workers.address}",
        )
    )
    deadline = time.monotonic() + 90
    while len(list(work.rglob("sleeping.marker"))) < 2:
        assert not sweep.done(), sweep.exception() if sweep.done() else None
        assert time.monotonic() < deadline, "the branches' cells never started"
        await asyncio.sleep(0.2)
    started = time.monotonic()
    if how == "task":
        sweep.cancel()
    else:
        sweep_id = await cancel_sweep_through_the_api(tmp_path / "nb.ipynb")
    with pytest.raises((CancelledRun, asyncio.CancelledError)):
        await sweep
    # Dask cannot stop a running task: the branches' sandboxes were killed, so their cells
    # ended at once, each branch stored what it made, and no kernel is left.
    assert time.monotonic() - started < 60
    (sweep_dir,) = (tmp_path / "out").iterdir()
    stored = json.loads((sweep_dir / "sweep.json").read_text())
    assert stored["status"] == "cancelled"
    assert stored["mode"] == "dask"
    for branch in stored["branches"]:
        summary = json.loads((Path(branch["output_dir"]) / "summary.json").read_text())
        assert summary["stages"][0]["status"] == "failed"
    assert list(work.iterdir()) == []
    if how == "api":
        # The sweep ends Cancelled; its branches, whose cells ended when their sandboxes
        # were killed, Failed.
        assert await branch_run_states(sweep_id) == ["CANCELLED", "FAILED", "FAILED"]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("vendor", ["e2b", "daytona", "local"])
async def test_a_branch_whose_worker_dies_is_ended_by_the_sweep_not_run_again(
    workers: Workers, tmp_path: Path, vendor: str, request: pytest.FixtureRequest
) -> None:
    """SIGKILL of the Dask worker running a branch mid-cell: Dask would run the branch again
    on another worker (its cells twice, its first flow run left Running with its sandbox
    alive); the sweep's process, which outlives the worker, ends that run instead. A remote
    sandbox outlives the worker and is killed; a local kernel dies with it."""
    test_id = uuid.uuid4().hex
    sandboxes, creates, backend = _vendor_under_test(vendor, test_id, tmp_path, request)
    _notebook(tmp_path / "nb.ipynb", "import time\nprint('sleeping', flush=True)\ntime.sleep(x)")
    before = creates() or 0
    sweep = asyncio.create_task(
        asweep_notebook(
            notebook=str(tmp_path / "nb.ipynb"),
            grid=[{"x": 120}],
            backend=backend,
            storage=str(tmp_path / "out"),
            task_runner=f"dask:{workers.address}",
        )
    )
    async with asyncio.timeout(120):
        while not sandboxes():
            await asyncio.sleep(0.1)
    await asyncio.sleep(1.0)  # into the cell
    async with asyncio.timeout(60):
        while len(running := _busy_workers(workers.client)) != 1:
            await asyncio.sleep(0.1)
    os.kill(workers.pids[running[0]], signal.SIGKILL)
    with pytest.raises(SweepFailedError, match="Dask worker process running it died"):
        await sweep
    (sweep_dir,) = (tmp_path / "out").iterdir()
    (branch,) = json.loads((sweep_dir / "sweep.json").read_text())["branches"]
    assert branch["status"] == "crashed" and "not run again" in branch["error"]
    summary = json.loads((Path(branch["output_dir"]) / "summary.json").read_text())
    assert summary["status"] == "failed" and "Dask worker" in summary["error"]
    if vendor != "local":  # the remote sandbox outlived the worker, and was killed
        assert summary["sandbox_id"] is not None and summary["sandbox_killed_at"] is not None
    assert sandboxes() == []
    assert creates() in (before + 1, None)  # the branch did not run again
    async with get_client() as client:
        run = await client.read_flow_run(UUID(branch["flow_run_id"]))
        runs = await client.read_flow_runs(
            flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[run.name]))
        )
    assert run.state is not None and run.state.type == StateType.CRASHED
    assert [other.id for other in runs] == [run.id]


def _busy_workers(client: Client) -> list[str]:
    """The addresses of the workers holding tasks now."""
    return [address for address, keys in client.processing().items() if keys]


def _vendor_under_test(
    vendor: str, test_id: str, tmp_path: Path, request: pytest.FixtureRequest
) -> tuple[Callable[[], list[str]], Callable[[], int | None], SandboxBackend]:
    """How to list one test's live sandboxes, count the creates asked for (None: a local
    kernel, made by no request), and its backend."""
    if vendor == "e2b":
        e2b: E2BEmulator = request.getfixturevalue("e2b_emulator")
        return (
            lambda: e2b.sandbox_ids({"test-id": test_id}),
            lambda: sum(1 for r in e2b.requests if r.operation == "create"),
            _e2b_backend(e2b, test_id),
        )
    if vendor == "daytona":
        daytona: DaytonaEmulator = request.getfixturevalue("daytona_env")
        credentials = DaytonaCredentials(
            api_key=daytona.api_key, api_url=daytona.api_url, target=daytona.target
        )
        return (
            lambda: daytona.sandbox_ids({"test-id": test_id}),
            lambda: sum(1 for r in daytona.requests if r.operation == "create"),
            DaytonaBackend(credentials=credentials, labels={"test-id": test_id}),
        )
    work = tmp_path / "work"
    work.mkdir()
    return (
        lambda: [path.name for path in work.iterdir()],
        lambda: None,
        LocalKernelBackend(workdir_root=str(work)),
    )
