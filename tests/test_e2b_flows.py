"""The pipeline flows and the CLI on the E2B backend: the real SDK against the emulator, on
Prefect's real ephemeral API. No sandbox outlives its flow run; the API key leaks nowhere."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import nbformat
import pytest
from prefect import flow
from prefect.client.orchestration import get_client

from prefect_sandbox import E2BBackend, E2BCredentials
from prefect_sandbox.flows import PipelineFailedError, amodeling_pipeline, arun_notebook
from prefect_sandbox.results import StageResult
from prefect_sandbox.sandbox.base import SandboxHandle
from prefect_sandbox.sandbox.errors import (
    CellTimeoutError,
    SandboxNotFoundError,
    SandboxUnavailableError,
)
from prefect_sandbox.sandbox.notebook import CellSpec, StageSpec
from prefect_sandbox.tasks.sandbox import run_stage
from prefect_sandbox.testing.e2b import E2BEmulator, Fault
from tests.conftest import ROOT, max_alive_at_once

pytestmark = pytest.mark.usefixtures("prefect_api")


def _backend(emulator: E2BEmulator, test_id: str, **options: float) -> E2BBackend:
    credentials = E2BCredentials(
        api_key=emulator.api_key, api_url=emulator.url, sandbox_url=emulator.url
    )
    return E2BBackend(
        credentials=credentials, metadata={"test-id": test_id}, interrupt_grace_s=2.0, **options
    )


async def test_no_sandbox_outlives_a_successful_failed_or_timed_out_pipeline(
    e2b_emulator: E2BEmulator, tmp_path: Path
) -> None:
    test_id = uuid.uuid4().hex
    backend = _backend(e2b_emulator, test_id)
    ok = await amodeling_pipeline(
        stages={"one": ["x = 1"], "two": ["print(x + 1)"]},
        backend=backend,
        storage=str(tmp_path),
    )
    assert ok.status == "completed"
    assert e2b_emulator.sandbox_ids({"test-id": test_id}) == []
    with pytest.raises(PipelineFailedError) as failed:
        await amodeling_pipeline(
            stages={"one": ["raise ValueError('bad')"]}, backend=backend, storage=str(tmp_path)
        )
    assert failed.value.stage == "one"
    assert e2b_emulator.sandbox_ids({"test-id": test_id}) == []
    with pytest.raises(PipelineFailedError) as timed_out:
        await amodeling_pipeline(
            stages={"one": ["while True: pass"]},
            backend=backend,
            storage=str(tmp_path),
            cell_timeout_s=1.0,
        )
    assert isinstance(timed_out.value.__cause__, CellTimeoutError)
    assert e2b_emulator.sandbox_ids({"test-id": test_id}) == []


async def test_capped_runs_share_the_e2b_limit_one_sandbox_at_a_time(
    e2b_emulator: E2BEmulator, tmp_path: Path
) -> None:
    test_id = uuid.uuid4().hex
    backend = _backend(e2b_emulator, test_id, max_live_sandboxes=1)
    results = await asyncio.gather(
        *(
            amodeling_pipeline(
                stages={"one": ["import time; time.sleep(0.5)"]},
                backend=backend,
                storage=str(tmp_path),
            )
            for _ in range(2)
        )
    )
    summaries = [json.loads((Path(r.output_dir) / "summary.json").read_text()) for r in results]
    assert [s["status"] for s in summaries] == ["completed"] * 2
    assert max_alive_at_once(summaries) == 1
    assert e2b_emulator.sandbox_ids({"test-id": test_id}) == []
    async with get_client() as client:
        limit = await client.read_global_concurrency_limit_by_name("prefect-sandbox:e2b")
    assert (limit.limit, limit.active_slots) == (1, 0)


async def test_a_removed_working_directory_still_gives_a_stored_summary(
    e2b_emulator: E2BEmulator, tmp_path: Path
) -> None:
    result = await amodeling_pipeline(
        stages={"one": ["import os, shutil\nshutil.rmtree(os.getcwd())"]},
        artifacts=["*.png"],
        backend=_backend(e2b_emulator, uuid.uuid4().hex),
        storage=str(tmp_path),
    )
    assert result.status == "completed"
    summary = json.loads((Path(result.output_dir) / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert [artifact["path"] for artifact in summary["artifacts"]] == ["executed.ipynb"]


async def test_artifacts_that_cannot_be_listed_fail_the_run_after_storing_its_summary(
    e2b_emulator: E2BEmulator, tmp_path: Path
) -> None:
    e2b_emulator.inject(Fault("list_files", status=500, times=None))
    try:
        with pytest.raises(PipelineFailedError) as info:
            await amodeling_pipeline(
                stages={"one": ["x = 1"]},
                artifacts=["*.png"],
                backend=_backend(e2b_emulator, uuid.uuid4().hex),
                storage=str(tmp_path),
            )
    finally:
        e2b_emulator.clear_faults()
    assert info.value.output_dir is not None
    summary = json.loads((Path(info.value.output_dir) / "summary.json").read_text())
    assert summary["status"] == "failed"
    assert "list_files" in summary["error"]
    assert [stage["status"] for stage in summary["stages"]] == ["ok"]


async def test_sandbox_expiring_mid_pipeline_names_the_sandbox_stage_and_cell(
    e2b_emulator: E2BEmulator, tmp_path: Path
) -> None:
    test_id = uuid.uuid4().hex
    backend = _backend(e2b_emulator, test_id)

    def expire_when_the_cell_runs() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            live = e2b_emulator.sandbox_ids({"test-id": test_id})
            running = [
                r
                for r in e2b_emulator.requests
                if r.operation == "run_code" and r.sandbox_id in live
            ]
            if len(running) >= 2:
                time.sleep(0.5)
                e2b_emulator.expire(live[0])
                return
            time.sleep(0.05)

    killer = threading.Thread(target=expire_when_the_cell_runs)
    killer.start()
    try:
        with pytest.raises(PipelineFailedError) as info:
            await amodeling_pipeline(
                stages={"first": ["x = 1"], "second": ["import time; time.sleep(30)"]},
                backend=backend,
                storage=str(tmp_path),
            )
    finally:
        killer.join()
    cause = info.value.__cause__
    assert isinstance(cause, SandboxNotFoundError)
    assert (cause.stage, cause.cell_index) == ("second", 1)
    assert cause.sandbox_id is not None and cause.sandbox_id in str(cause)
    assert "cell 1" in str(info.value)
    out = Path(info.value.output_dir or "")
    notebook = nbformat.read(out / "executed.ipynb", as_version=4)
    nbformat.validate(notebook)


async def test_api_key_appears_in_no_log_notebook_error_or_handle(
    e2b_emulator: E2BEmulator, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    backend = _backend(e2b_emulator, uuid.uuid4().hex)
    key = e2b_emulator.api_key
    caplog.set_level(logging.DEBUG)
    with pytest.raises(PipelineFailedError) as info:
        await amodeling_pipeline(
            stages={
                # E2B's own variables (envd's /envs) describe the sandbox, never the caller.
                "env": [
                    "import os\n"
                    "own = {'E2B_SANDBOX', 'E2B_SANDBOX_ID', 'E2B_TEMPLATE_ID'}\n"
                    "print(sorted(k for k in os.environ if 'E2B' in k and k not in own))"
                ],
                "fail": ["raise RuntimeError('boom')"],
            },
            backend=backend,
            storage=str(tmp_path),
        )
    out = Path(info.value.output_dir or "")
    stored = "".join(p.read_text() for p in out.rglob("*") if p.is_file())
    assert "boom" in stored and "[]" in stored  # the kernel saw none of the caller's E2B variables
    assert key not in stored
    assert key not in str(info.value) and key not in repr(info.value.__cause__)
    assert key not in caplog.text
    assert key not in repr(backend) and key not in backend.model_dump_json()


async def test_e2b_backend_block_saves_and_loads_with_its_secret(e2b_emulator: E2BEmulator) -> None:
    backend = _backend(e2b_emulator, "saved", lifetime_s=120)
    await backend.save("test-e2b", overwrite=True)
    loaded = await E2BBackend.aload("test-e2b")
    assert loaded.lifetime_s == 120 and loaded.metadata == {"test-id": "saved"}
    assert loaded.credentials.api_key.get_secret_value() == e2b_emulator.api_key


def _api_env() -> dict[str, str]:
    from prefect.settings import PREFECT_API_URL

    env = dict(os.environ)
    env["PREFECT_API_URL"] = str(PREFECT_API_URL.value())
    return env


async def test_main_job_co2_forecast_with_backend_e2b_matches_local(
    e2b_emulator: E2BEmulator, tmp_path: Path
) -> None:
    example = ROOT / "examples" / "co2"
    artifacts = ["figures/*.png", "forecast.csv", "metrics.json"]
    env = {**_api_env(), **e2b_emulator.env()}
    before = set(e2b_emulator.sandbox_ids())
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "prefect_sandbox.cli",
            "run",
            str(example / "forecast.ipynb"),
            "--backend",
            "e2b",
            "--input",
            str(example / "co2.csv"),
            *[arg for pattern in artifacts for arg in ("--artifact", pattern)],
            "--out",
            "OUT",
        ],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert e2b_emulator.api_key not in done.stdout + done.stderr
    assert set(e2b_emulator.sandbox_ids()) <= before
    (e2b_dir,) = (tmp_path / "OUT").iterdir()
    local = await arun_notebook(
        notebook=str(example / "forecast.ipynb"),
        inputs=[str(example / "co2.csv")],
        artifacts=artifacts,
        storage=str(tmp_path / "LOCAL"),
    )
    local_dir = Path(local.output_dir)
    e2b_metrics = json.loads((e2b_dir / "metrics.json").read_text())
    assert e2b_metrics == json.loads((local_dir / "metrics.json").read_text())
    assert 0 < e2b_metrics["mae_ppm"] < 2
    assert (e2b_dir / "forecast.csv").read_text() == (local_dir / "forecast.csv").read_text()
    e2b_figures = sorted(p.name for p in (e2b_dir / "figures").glob("*.png"))
    assert len(e2b_figures) >= 2
    assert e2b_figures == sorted(p.name for p in (local_dir / "figures").glob("*.png"))
    notebook = nbformat.read(e2b_dir / "executed.ipynb", as_version=4)
    nbformat.validate(notebook)
    assert e2b_emulator.api_key not in (e2b_dir / "executed.ipynb").read_text()
    summary = json.loads((e2b_dir / "summary.json").read_text())
    assert all(s["status"] == "ok" for s in summary["stages"])


def test_cli_backend_e2b_without_credentials_is_a_usage_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from prefect_sandbox.cli import main

    monkeypatch.delenv("E2B_API_KEY", raising=False)
    notebook = ROOT / "examples" / "co2" / "forecast.ipynb"
    assert main(["run", str(notebook), "--backend", "e2b", "--out", str(tmp_path)]) == 2
    assert "E2B_API_KEY" in capsys.readouterr().err


def test_emulator_runs_in_the_foreground_and_prints_the_sdk_settings() -> None:
    from e2b_code_interpreter import Sandbox

    with subprocess.Popen(
        [sys.executable, "-m", "prefect_sandbox.testing.e2b"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    ) as process:
        try:
            assert process.stdout is not None
            settings = dict(process.stdout.readline().strip().split("=", 1) for _ in range(3))
            assert set(settings) == {"E2B_API_KEY", "E2B_API_URL", "E2B_SANDBOX_URL"}
            assert settings["E2B_API_URL"].startswith("http://127.0.0.1:")
            sandbox = Sandbox.create(
                api_key=settings["E2B_API_KEY"],
                api_url=settings["E2B_API_URL"],
                sandbox_url=settings["E2B_SANDBOX_URL"],
            )
            sandbox.files.write("hello.txt", "hi")
            assert sandbox.files.read("hello.txt") == "hi"
            assert sandbox.kill() is True
        finally:
            process.terminate()
    assert process.returncode is not None


async def test_hooks_in_the_runs_own_process_use_the_key_it_was_given_not_the_masked_copy(
    e2b_emulator: E2BEmulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    from prefect import flow
    from prefect.context import FlowRunContext

    from prefect_sandbox.flows.hooks import MASKED_SECRET, run_backend

    # Given inline, not from the environment: only the run's own parameters hold the key.
    monkeypatch.delenv("E2B_API_KEY", raising=False)

    @flow
    async def probe(backend: E2BBackend) -> tuple[str, str]:
        context = FlowRunContext.get()
        assert context is not None and context.flow_run is not None
        async with get_client() as client:
            api_copy = await client.read_flow_run(context.flow_run.id)
        found = await run_backend(api_copy)
        assert isinstance(found, E2BBackend)
        masked = api_copy.parameters["backend"]["credentials"]["api_key"]
        return masked, found.credentials.api_key.get_secret_value()

    masked, key = await probe(_backend(e2b_emulator, uuid.uuid4().hex))
    assert (masked, key) == (MASKED_SECRET, e2b_emulator.api_key)


@pytest.mark.parametrize(
    ("first_cell", "ename"),
    [
        ("raise ValueError('bad')", "ValueError"),
        ("while True: pass", "CellTimeoutError"),
        ("import os; os._exit(1)", None),
    ],
    ids=["raises", "times out", "kills its kernel"],
)
async def test_a_run_failing_on_its_first_cell_shows_that_stage_failed_and_the_rest_not_run(
    e2b_emulator: E2BEmulator, tmp_path: Path, first_cell: str, ename: str | None
) -> None:
    with pytest.raises(PipelineFailedError) as failed:
        await amodeling_pipeline(
            stages={"first": [first_cell, "print('never')"], "second": ["print('never')"]},
            backend=_backend(e2b_emulator, uuid.uuid4().hex),
            storage=str(tmp_path),
            cell_timeout_s=1.0,
        )
    assert (failed.value.stage, failed.value.cell_index) == ("first", 0)
    (summary_path,) = tmp_path.glob("*/summary.json")
    stages = json.loads(summary_path.read_text())["stages"]
    assert [(s["name"], s["status"], s["failed_cell_index"]) for s in stages] == [
        ("first", "failed", 0),
        ("second", "not_run", None),
    ]
    if ename is not None:
        assert stages[0]["ename"] == ename


async def test_a_run_whose_sandbox_cannot_be_reached_for_its_first_cell_shows_where_it_stopped(
    e2b_emulator: E2BEmulator, tmp_path: Path
) -> None:
    test_id = uuid.uuid4().hex
    # The stages use the connection the create made (no attach): the first cell's own first
    # call, the lifetime's extension, answers 500 at each try; the create before it is served.
    e2b_emulator.inject(Fault("set_timeout", status=500, times=None))
    try:
        with pytest.raises(PipelineFailedError) as failed:
            await amodeling_pipeline(
                stages={"first": ["x = 1"], "second": ["print(x)"]},
                backend=_backend(e2b_emulator, test_id),
                storage=str(tmp_path),
            )
    finally:
        e2b_emulator.clear_faults()
    assert (failed.value.stage, failed.value.cell_index) == ("first", 0)
    (run_dir,) = tmp_path.iterdir()
    stages = json.loads((run_dir / "summary.json").read_text())["stages"]
    assert [(s["name"], s["status"], s["failed_cell_index"]) for s in stages] == [
        ("first", "failed", 0),
        ("second", "not_run", None),
    ]
    assert stages[0]["ename"] == "SandboxUnavailableError"
    # The notebook shows it at the cell that was to run.
    cells = nbformat.read(run_dir / "executed.ipynb", as_version=4).cells
    assert [o["ename"] for o in cells[0].outputs] == ["SandboxUnavailableError"]
    assert e2b_emulator.sandbox_ids({"test-id": test_id}) == []


async def test_a_stage_given_a_handle_it_cannot_attach_to_is_lost_in_its_first_cell(
    e2b_emulator: E2BEmulator,
) -> None:
    # A stage task run with a handle alone (another process, a Dask worker) attaches first.
    test_id = uuid.uuid4().hex
    backend = _backend(e2b_emulator, test_id)
    stage = StageSpec(name="first", cells=[CellSpec(index=0, source="x = 1")])

    @flow
    async def one_stage(handle: SandboxHandle) -> None:
        await run_stage(backend, handle, stage)

    sandbox = await backend.create({"test-id": test_id})
    # The stage's attach (the SDK's connect) answers 500 at each of its 4 tries (3 retries).
    e2b_emulator.inject(Fault("connect", status=500, times=4))
    try:
        with pytest.raises(SandboxUnavailableError) as lost:
            await one_stage(sandbox.handle)
    finally:
        e2b_emulator.clear_faults()
        await sandbox.kill()
    assert (lost.value.stage, lost.value.cell_index) == ("first", 0)
    partial = lost.value.partial_result
    assert isinstance(partial, StageResult)
    assert (partial.status, partial.failed_cell_index) == ("failed", 0)
    assert [o["ename"] for o in partial.cells[0].result.outputs] == ["SandboxUnavailableError"]
