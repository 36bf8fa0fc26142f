"""Deployments end to end: a real `prefect server`, two process workers on one pool, `prefect
deploy --all` from deployments/prefect.yaml, `run_deployment`, cancellation (H25), secrets kept out
of records, and a sweep deployment whose branches spread over both workers."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any
from uuid import UUID

import psutil
import pytest
from prefect.client.orchestration import PrefectClient, get_client
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    FlowRunFilter,
    FlowRunFilterId,
    FlowRunFilterParentFlowRunId,
    LogFilter,
    LogFilterFlowRunId,
)
from prefect.client.schemas.objects import Artifact, FlowRun, StateType
from prefect.deployments import run_deployment
from prefect.settings import PREFECT_API_URL, temporary_settings
from prefect.states import Cancelling

from prefect_sandbox.blocks import LocalKernelBackend
from prefect_sandbox.flows.sweep import SWEEP_NAME
from prefect_sandbox.results import SweepResult
from prefect_sandbox.sandbox.backends.kernel.local import LocalKernelConfig, LocalKernelSandbox
from prefect_sandbox.sandbox.labels import FLOW_RUN_ID_LABEL
from prefect_sandbox.testing.prefect_server import PREFECT, PrefectServer
from prefect_sandbox.testing.s3 import MotoServer
from tests.conftest import ROOT

SECRET_KEY = "e2e-secret-Zq8xWv3Kp"
# Two workers on the one pool, two flow runs each at most. A sweep's own run holds a slot on one;
# of its 4 branches that one runs 1 at a time, so the other worker takes some.
WORKERS = ("worker-a", "worker-b")
WORKER_LIMIT = 2


class PrefectStack(PrefectServer):
    """`prefect server start` and process workers, in subprocesses, on 127.0.0.1."""

    def __init__(self, home: Path, input_roots: Path, database_url: str | None = None) -> None:
        self.workers: dict[str, subprocess.Popen[bytes]] = {}
        super().__init__(
            home,
            database_url,
            env={
                # The tests' own folders: where their runs' notebooks and inputs may come from,
                # and where they may store.
                "PREFECT_SANDBOX_INPUT_ROOTS": str(input_roots),
                "PREFECT_SANDBOX_OUTPUT_ROOTS": str(input_roots),
                # Workers poll every 2 s instead of 10: runs start sooner.
                "PREFECT_WORKER_QUERY_SECONDS": "2",
            },
        )

    def cli(self, *args: str, cwd: Path = ROOT) -> str:
        done = subprocess.run(
            [*PREFECT, *args], env=self.env, cwd=cwd, capture_output=True, text=True, timeout=180
        )
        assert done.returncode == 0, f"prefect {' '.join(args)}:\n{done.stdout}\n{done.stderr}"
        return done.stdout

    def start_worker(self, name: str, limit: int) -> None:
        """Start a process worker called `name` on the pool, running at most `limit` flow runs."""
        args = ["--pool", "sandbox-process", "--type", "process", "--name", name]
        self.workers[name] = self.start_process(
            name, ["worker", "start", *args, "--limit", str(limit)]
        )

    def wait_until_workers_are_idle(self, timeout_s: float = 120) -> None:
        """Wait until no worker has a flow run's process left: a worker frees a run's slot only
        when its process exits, which under load can be seconds after the run's final state."""
        deadline = time.monotonic() + timeout_s
        busy = self._busy_workers()
        while busy and time.monotonic() < deadline:
            time.sleep(0.5)
            busy = self._busy_workers()
        assert not busy, f"workers still running flow runs after {timeout_s} s: {busy}"

    def _busy_workers(self) -> list[str]:
        return [
            name for name, worker in self.workers.items() if psutil.Process(worker.pid).children()
        ]


@pytest.fixture(scope="module")
def stack(server: PrefectStack) -> Iterator[PrefectStack]:
    """The session's `prefect server` with this module's work pool, blocks, deployments and
    two process workers; the workers stop with the module."""
    stack = server
    try:
        stack.cli("work-pool", "create", "sandbox-process", "--type", "process")
        stack.cli("block", "register", "-m", "prefect_sandbox")
        stack.cli("block", "register", "-m", "prefect_aws")
        stack.cli("--no-prompt", "deploy", "--all", cwd=ROOT / "deployments")
        for name in WORKERS:
            stack.start_worker(name, WORKER_LIMIT)
        yield stack
    finally:
        stack.stop_started()
        stack.workers.clear()


@pytest.fixture
async def client(stack: PrefectStack) -> AsyncIterator[PrefectClient]:
    with temporary_settings({PREFECT_API_URL: stack.url}):
        async with get_client() as prefect:
            yield prefect


async def _s3_bucket_ref(client: PrefectClient, moto: MotoServer) -> dict[str, Any]:
    """Save an S3Bucket block (with a secret key) on the server; return the UI's $ref form."""
    from prefect_aws import AwsClientParameters, AwsCredentials, S3Bucket

    bucket_name = "e2e-results"
    moto.client().create_bucket(Bucket=bucket_name)
    bucket = S3Bucket(
        bucket_name=bucket_name,
        credentials=AwsCredentials(
            aws_access_key_id="testing",
            aws_secret_access_key=SECRET_KEY,
            region_name="us-east-1",
            aws_client_parameters=AwsClientParameters(endpoint_url=moto.endpoint),
        ),
    )
    document_id = await bucket.save("e2e-results", overwrite=True, client=client)
    return {"$ref": {"block_document_id": str(document_id)}}


async def _completed_run(
    stack: PrefectStack,
    client: PrefectClient,
    deployment: str,
    parameters: dict[str, Any],
    timeout_s: float,
) -> tuple[FlowRun, list[Artifact]]:
    """Run a deployment on the stack's workers; check it completed; return it and its artifacts."""
    with temporary_settings({PREFECT_API_URL: stack.url}):
        flow_run = await run_deployment(deployment, parameters=parameters, timeout=timeout_s)
    assert flow_run.state is not None
    assert flow_run.state.type == StateType.COMPLETED, flow_run.state
    artifacts = await client.read_artifacts(
        artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run.id]))
    )
    return flow_run, artifacts


@pytest.mark.timeout(600)
async def test_co2_deployment_runs_to_completion_with_blocks_by_reference(
    stack: PrefectStack, client: PrefectClient, moto: MotoServer
) -> None:
    storage_ref = await _s3_bucket_ref(client, moto)
    flow_run, artifacts = await _completed_run(
        stack, client, "run-notebook/co2-forecast", {"storage": storage_ref}, timeout_s=300
    )
    by_key = {a.key: a for a in artifacts if a.key}
    assert {"pipeline-summary", "stored-artifacts"} <= set(by_key)
    summary = str(by_key["pipeline-summary"].data)
    for stage in ["load", "explore", "model", "evaluate", "forecast"]:
        assert f"| {stage} | ok |" in summary
    assert "figures/forecast.png" in summary
    table = json.loads(str(by_key["stored-artifacts"].data))
    assert any(row["key"].endswith("/metrics.json") for row in table)
    progress = [a for a in artifacts if a.type == "progress"]
    assert [float(str(a.data)) for a in progress] == [100.0]

    def mae_logged(message: str) -> bool:
        return message.startswith("[evaluate cell") and "MAE" in message

    messages = await _messages_once_logged(client, flow_run.id, mae_logged, 60)
    assert any(mae_logged(m) for m in messages), messages

    metrics_key = next(row["key"] for row in table if row["key"].endswith("/metrics.json"))
    bucket_name, _, key = metrics_key[len("s3://") :].partition("/")
    body = moto.client().get_object(Bucket=bucket_name, Key=key)["Body"].read()
    assert json.loads(body)["mae_ppm"] < 2

    # No deployment or flow-run record on the server holds the key.
    records = [d.model_dump_json() for d in await client.read_deployments()]
    records += [r.model_dump_json() for r in await client.read_flow_runs()]
    assert not [record for record in records if SECRET_KEY in record]


async def _wait_for_state(
    client: PrefectClient, flow_run_id: UUID, wanted: set[StateType], timeout_s: float
) -> StateType:
    deadline = time.monotonic() + timeout_s
    while True:
        flow_run = await client.read_flow_run(flow_run_id)
        assert flow_run.state is not None
        if flow_run.state.type in wanted or time.monotonic() > deadline:
            return flow_run.state.type
        await asyncio.sleep(0.5)


async def _messages_once_logged(
    client: PrefectClient, flow_run_id: UUID, wanted: Callable[[str], bool], timeout_s: float
) -> list[str]:
    """A flow run's log messages, read until one is ``wanted`` or ``timeout_s`` (seconds) pass.

    A worker's flow-run process sends its last log records as it exits, after the run's final
    state, so a read made as soon as the state is final can miss them.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        logs = await client.read_logs(
            log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id]))
        )
        messages = [log.message for log in logs]
        if any(wanted(m) for m in messages) or time.monotonic() > deadline:
            return messages
        await asyncio.sleep(0.5)


@pytest.mark.timeout(400)
async def test_h25_cancelling_mid_cell_kills_the_sandbox(
    stack: PrefectStack, client: PrefectClient
) -> None:
    with temporary_settings({PREFECT_API_URL: stack.url}):
        flow_run = await run_deployment(
            "modeling-pipeline/modeling-pipeline",
            parameters={
                "stages": {"wait": ["import time; print('sleeping', flush=True); time.sleep(600)"]}
            },
            timeout=0,
        )
    label = {FLOW_RUN_ID_LABEL: str(flow_run.id)}
    deadline = time.monotonic() + 180
    while True:
        handles = await LocalKernelSandbox.list_handles(LocalKernelConfig(), label)
        pid_file = Path(handles[0].connection["runtime_dir"]) / "kernel.pid" if handles else None
        if pid_file is not None and pid_file.exists():
            break
        assert time.monotonic() < deadline, "the run's sandbox never started"
        await asyncio.sleep(0.5)
    kernel = psutil.Process(int(pid_file.read_text()))

    # Mid-cell: the cell's first line has reached the run's logs (they are sent as they come).
    def cell_started(message: str) -> bool:
        return message.startswith("[wait cell") and "sleeping" in message

    left_s = deadline - time.monotonic()
    messages = await _messages_once_logged(client, flow_run.id, cell_started, left_s)
    assert any(cell_started(m) for m in messages), "the run's cell never started"
    assert await _wait_for_state(client, flow_run.id, {StateType.RUNNING}, 5) == StateType.RUNNING

    cancel_at = time.monotonic()
    await client.set_flow_run_state(flow_run.id, Cancelling(), force=True)
    final = await _wait_for_state(client, flow_run.id, {StateType.CANCELLED}, 30)
    assert final == StateType.CANCELLED
    while time.monotonic() - cancel_at < 30 and (
        await LocalKernelSandbox.list_handles(LocalKernelConfig(), label) or kernel.is_running()
    ):
        await asyncio.sleep(0.5)
    assert await LocalKernelSandbox.list_handles(LocalKernelConfig(), label) == []
    assert not kernel.is_running() or kernel.status() == psutil.STATUS_ZOMBIE


@pytest.mark.timeout(300)
async def test_the_reaper_deployment_runs_every_10_minutes_once_switched_on(
    stack: PrefectStack, client: PrefectClient
) -> None:
    deployment = await client.read_deployment_by_name("reap-sandboxes/reap-sandboxes")
    [schedule] = deployment.schedules
    assert schedule.schedule.model_dump(include={"interval"}) == {"interval": timedelta(minutes=10)}
    assert schedule.active is False
    # As deployments/README.md says to switch it on (and off again).
    stack.cli("deployment", "schedule", "resume", "reap-sandboxes/reap-sandboxes", str(schedule.id))
    deployment = await client.read_deployment_by_name("reap-sandboxes/reap-sandboxes")
    assert [s.active for s in deployment.schedules] == [True]
    stack.cli("deployment", "schedule", "pause", "reap-sandboxes/reap-sandboxes", str(schedule.id))

    _, artifacts = await _completed_run(
        stack, client, "reap-sandboxes/reap-sandboxes", {"dry_run": True}, timeout_s=240
    )
    assert [a.key for a in artifacts if a.type == "table"] == ["reaped-sandboxes"]


def _square_notebook(path: Path) -> Path:
    """A two-cell notebook: parameter `x`, then metrics.json with x squared."""
    import nbformat

    source = "import json\njson.dump({'square': x * x}, open('metrics.json', 'w'))"
    notebook = nbformat.v4.new_notebook(
        cells=[
            nbformat.v4.new_code_cell("x = 0", metadata={"tags": ["parameters"]}),
            nbformat.v4.new_code_cell(source),
        ]
    )
    nbformat.write(notebook, path)
    return path


@pytest.mark.timeout(400)
async def test_sweep_deployment_spreads_its_branches_over_both_workers(
    stack: PrefectStack, client: PrefectClient, tmp_path: Path
) -> None:
    notebook = _square_notebook(tmp_path / "square.ipynb")
    out = tmp_path / "out"  # one folder the sweep and both workers reach
    # A run of an earlier test still exiting would hold a slot, and one worker could be full.
    stack.wait_until_workers_are_idle()
    parameters = {
        "notebook": str(notebook),
        "grid": {"x": [1, 2, 3, 4]},
        "artifacts": ["metrics.json"],
        "storage": str(out),
    }
    sweep_run, _ = await _completed_run(
        stack, client, "sweep-notebook/sweep-notebook", parameters, timeout_s=300
    )

    [sweep_file] = out.glob(f"*/{SWEEP_NAME}")
    sweep = SweepResult.model_validate_json(sweep_file.read_text())
    assert (sweep.status, sweep.mode) == ("completed", "deployment")
    assert [b.parameters for b in sweep.branches] == [{"x": x} for x in [1, 2, 3, 4]]
    assert [b.status for b in sweep.branches] == ["completed"] * 4
    assert all(Path(b.output_dir or "", "summary.json").is_file() for b in sweep.branches)
    assert [b.metrics for b in sweep.branches] == [{"square": x * x} for x in [1, 2, 3, 4]]
    # Each branch is a child run of the run-notebook deployment; each worker ran some of them.
    children = await client.read_flow_runs(
        flow_run_filter=FlowRunFilter(
            parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[sweep_run.id])
        )
    )
    assert {str(run.id) for run in children} == {b.flow_run_id for b in sweep.branches}
    # Made one at a time, in the grid's order (at once, they came out of order, seconds apart).
    made = {run.created: str(run.id) for run in children if run.created is not None}
    assert [made[time] for time in sorted(made)] == [b.flow_run_id for b in sweep.branches]
    deployment = await client.read_deployment_by_name("run-notebook/run-notebook")
    assert {run.deployment_id for run in children} == {deployment.id}
    assert {run.labels.get("prefect.worker.name") for run in children} == set(WORKERS)


@pytest.mark.timeout(600)
async def test_a_sweep_deployment_cancelled_through_the_api_cancels_its_branch_runs(
    stack: PrefectStack, client: PrefectClient, tmp_path: Path
) -> None:
    import nbformat

    notebook = tmp_path / "sleep.ipynb"
    nbformat.write(
        nbformat.v4.new_notebook(
            cells=[
                nbformat.v4.new_code_cell("x = 0", metadata={"tags": ["parameters"]}),
                nbformat.v4.new_code_cell("import time\ntime.sleep(x)"),
            ]
        ),
        notebook,
    )
    parameters = {"notebook": str(notebook), "grid": {"x": [600, 601]}, "storage": str(tmp_path)}
    with temporary_settings({PREFECT_API_URL: stack.url}):
        sweep = await run_deployment(
            "sweep-notebook/sweep-notebook", parameters=parameters, timeout=0
        )
    # Both branches' kernels alive, each in a run of the run-notebook deployment.
    deadline = time.monotonic() + 300
    while True:
        children = await client.read_flow_runs(
            flow_run_filter=FlowRunFilter(
                parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[sweep.id])
            )
        )
        labels = [{FLOW_RUN_ID_LABEL: str(child.id)} for child in children]
        handles = [
            await LocalKernelSandbox.list_handles(LocalKernelConfig(), label) for label in labels
        ]
        if len(children) == 2 and all(
            found and Path(found[0].connection["runtime_dir"], "kernel.pid").exists()
            for found in handles
        ):
            break
        assert time.monotonic() < deadline, "the branches' kernels never started"
        await asyncio.sleep(0.5)

    await client.set_flow_run_state(sweep.id, Cancelling(), force=True)
    assert await _wait_for_state(client, sweep.id, {StateType.CANCELLED}, 120) == (
        StateType.CANCELLED
    )
    for child in children:
        assert child.deployment_id is not None
        final = await _wait_for_state(client, child.id, {StateType.CANCELLED}, 120)
        assert final == StateType.CANCELLED
    deadline = time.monotonic() + 60
    while any(
        [await LocalKernelSandbox.list_handles(LocalKernelConfig(), label) for label in labels]
    ):
        assert time.monotonic() < deadline, "a branch's sandbox outlived its cancelled run"
        await asyncio.sleep(0.5)


@pytest.mark.timeout(400)
async def test_a_run_cannot_weaken_its_isolation_or_read_host_paths_through_its_parameters(
    stack: PrefectStack, client: PrefectClient, tmp_path: Path
) -> None:
    # As someone who may start runs but not save blocks would try it: a backend by value,
    # a reference with fields beside it, host folders as inputs (one through a link inside the
    # allowed root), the isolation setting through job variables, a sweep sent to a Dask
    # cluster of the run's choosing, storage by value or outside the allowed roots. Each is
    # refused before any sandbox starts; a saved block by reference runs.
    etc = tmp_path / "etc"
    etc.symlink_to("/etc")
    saved = await LocalKernelBackend(env={"RUN_MARK": "saved-block"}).save(
        "policy-saved", overwrite=True, client=client
    )
    reference = {"$ref": {"block_document_id": str(saved)}}
    probe = {"stages": {"probe": ["import os; print(os.environ.get('RUN_MARK'))"]}}
    pipeline, sweep = "modeling-pipeline/modeling-pipeline", "sweep-notebook/sweep-notebook"
    to_dask = {
        "notebook": str(_square_notebook(tmp_path / "square.ipynb")),
        "grid": {"x": [1]},
        "task_runner": "dask:tcp://127.0.0.1:9",
    }
    # An S3Bucket by value at an endpoint of the run's choosing: the worker would sign its
    # uploads there with its own AWS keys.
    bucket_by_value = {
        "bucket_name": "collected",
        "credentials": {"aws_client_parameters": {"endpoint_url": "http://127.0.0.1:9"}},
    }
    attempts: list[tuple[str, dict[str, Any], dict[str, Any], list[str]]] = [
        (pipeline, {**probe, "backend": {"isolation": "none"}}, {}, ["backend"]),
        (pipeline, {**probe, "backend": {"network": True}}, {}, ["backend"]),
        (pipeline, {**probe, "backend": {**reference, "isolation": "none"}}, {}, ["backend"]),
        (
            pipeline,
            {**probe, "inputs": [str(etc), str(Path.home() / ".ssh")]},
            {},
            ["inputs[0]", "inputs[1]"],
        ),
        (
            pipeline,
            probe,
            {"env": {"PREFECT_SANDBOX_ISOLATION": "none"}},
            ["PREFECT_SANDBOX_ISOLATION"],
        ),
        (sweep, to_dask, {}, ["task_runner"]),
        (pipeline, {**probe, "storage": bucket_by_value}, {}, ["storage"]),
        (pipeline, {**probe, "storage": "/var/tmp/elsewhere"}, {}, ["storage"]),
    ]
    with temporary_settings({PREFECT_API_URL: stack.url}):
        runs = [
            await run_deployment(
                deployment, parameters=parameters, job_variables=job_variables, timeout=0
            )
            for deployment, parameters, job_variables, _ in attempts
        ]
        allowed = await run_deployment(
            "modeling-pipeline/modeling-pipeline",
            parameters={**probe, "backend": reference, "storage": str(tmp_path)},
            timeout=0,
        )
    final = {StateType.COMPLETED, StateType.FAILED, StateType.CRASHED, StateType.CANCELLED}
    for flow_run, (_, _, _, refused) in zip(runs, attempts, strict=True):
        assert await _wait_for_state(client, flow_run.id, final, 240) == StateType.FAILED
        state = (await client.read_flow_run(flow_run.id)).state
        assert state is not None and state.message is not None
        assert "ParameterRefusedError: deployment run refused before any sandbox" in state.message
        assert all(name in state.message for name in refused), state.message
        task_runs = await client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run.id]))
        )
        assert task_runs == [], [t.name for t in task_runs]
    assert await _wait_for_state(client, allowed.id, final, 240) == StateType.COMPLETED

    def probe_logged(message: str) -> bool:
        return message.startswith("[probe cell 0]") and "saved-block" in message

    messages = await _messages_once_logged(client, allowed.id, probe_logged, 60)
    assert any(probe_logged(m) for m in messages), messages


@pytest.mark.timeout(400)
async def test_a_notebook_deployment_has_its_parameters_typed_and_the_server_refuses_a_wrong_type(
    stack: PrefectStack, client: PrefectClient, tmp_path: Path
) -> None:
    import sys

    import nbformat
    from prefect.exceptions import PrefectHTTPStatusError

    notebook = tmp_path / "typed.ipynb"
    parameters_cell = 'n: int = 2  # how many squares\nlabel = "run"\nwhen = "1996-12-31"'
    body = "import json\njson.dump({'n': n, 'label': label}, open('metrics.json', 'w'))"
    nbformat.write(
        nbformat.v4.new_notebook(
            cells=[
                nbformat.v4.new_code_cell(parameters_cell, metadata={"tags": ["parameters"]}),
                nbformat.v4.new_code_cell(body),
            ]
        ),
        notebook,
    )
    command = [sys.executable, "-m", "prefect_sandbox.cli", "deploy", str(notebook)]
    options = ["--pool", "sandbox-process", "--artifact", "metrics.json", "--out", str(tmp_path)]
    deploy = subprocess.run(
        [*command, *options],
        env=stack.env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert deploy.returncode == 0, deploy.stderr
    assert "Deployed run-notebook/typed" in deploy.stdout
    assert "n, label, when" in deploy.stdout

    deployment = await client.read_deployment_by_name("run-notebook/typed")
    fields = deployment.parameter_openapi_schema["properties"]
    assert fields["notebook"]["default"] == str(notebook)
    typed = fields["parameters"]["properties"]
    assert typed["n"] == {
        "title": "n",
        "position": 0,
        "type": "integer",
        "default": 2,
        "description": "how many squares",
    }
    assert (typed["label"]["type"], typed["label"]["default"]) == ("string", "run")
    assert typed["when"]["default"] == "1996-12-31"
    # The generic deployment keeps its free-form dict.
    generic = await client.read_deployment_by_name("run-notebook/run-notebook")
    assert "properties" not in str(generic.parameter_openapi_schema["properties"]["parameters"])

    with pytest.raises(PrefectHTTPStatusError) as refused:
        await client.create_flow_run_from_deployment(
            deployment.id, parameters={"parameters": {"n": "three"}}
        )
    assert refused.value.response.status_code == 409
    assert "parameters.n" in refused.value.response.text
    assert "is not of type 'integer'" in refused.value.response.text

    stack.wait_until_workers_are_idle()
    await _completed_run(
        stack, client, "run-notebook/typed", {"parameters": {"n": 5}}, timeout_s=300
    )
    [metrics] = tmp_path.glob("*/metrics.json")
    assert json.loads(metrics.read_text()) == {"n": 5, "label": "run"}
