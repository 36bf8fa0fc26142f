"""The pipeline flows and the CLI on the Daytona backend: the real SDK against the emulator,
Prefect's real ephemeral API."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from prefect_sandbox import DaytonaBackend, DaytonaCredentials
from prefect_sandbox.flows import PipelineFailedError, amodeling_pipeline, arun_notebook
from prefect_sandbox.sandbox.errors import CellTimeoutError
from prefect_sandbox.testing.daytona import DaytonaEmulator
from tests.conftest import ROOT

pytestmark = pytest.mark.usefixtures("prefect_api")

EXAMPLE = ROOT / "examples" / "co2"
ARTIFACTS = ["figures/*.png", "forecast.csv", "metrics.json"]


def _run_id(output_dir: str | None) -> str:
    summary = json.loads((Path(output_dir or "") / "summary.json").read_text())
    return str(summary["flow_run_id"])


async def test_no_sandbox_is_left_after_ok_failed_and_timed_out_pipelines(
    daytona_env: DaytonaEmulator, tmp_path: Path
) -> None:
    backend = DaytonaBackend(interrupt_grace_s=1.0)
    ok = await amodeling_pipeline(
        stages={"only": ["x = 41", "print(x + 1)"]}, backend=backend, storage=str(tmp_path)
    )
    cells = nbformat.read(Path(ok.output_dir) / "executed.ipynb", as_version=4).cells
    assert cells[1].outputs[0]["text"] == "42\n"
    run_ids = [ok.flow_run_id]
    with pytest.raises(PipelineFailedError) as failed:
        await amodeling_pipeline(
            stages={"fail": ["raise RuntimeError('no')"]}, backend=backend, storage=str(tmp_path)
        )
    run_ids.append(_run_id(failed.value.output_dir))
    with pytest.raises(PipelineFailedError) as timed_out:
        await amodeling_pipeline(
            stages={"spin": ["while True: pass"]},
            backend=backend,
            storage=str(tmp_path),
            cell_timeout_s=0.5,
        )
    assert isinstance(timed_out.value.__cause__, CellTimeoutError)
    run_ids.append(_run_id(timed_out.value.output_dir))
    for run_id in run_ids:
        assert daytona_env.sandbox_ids({"prefect-flow-run-id": run_id}) == []


async def test_the_api_key_never_shows_in_logs_notebooks_or_errors(
    daytona_env: DaytonaEmulator, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogHandler

    secret = daytona_env.api_key
    backend = DaytonaBackend(
        credentials=DaytonaCredentials(
            api_key=secret, api_url=daytona_env.api_url, target=daytona_env.target
        )
    )
    caplog.set_level(logging.DEBUG)
    with pytest.raises(PipelineFailedError) as info:
        await amodeling_pipeline(
            stages={
                "look": [
                    # Code in the sandbox cannot find the key either.
                    "import os; print(sorted(os.environ.items()))",
                    "raise ValueError('stop here')",
                ]
            },
            backend=backend,
            storage=str(tmp_path),
        )
    error = info.value
    texts = [str(error), repr(error), str(error.__cause__), repr(error.__cause__)]
    texts.append(pickle.dumps(error).decode("latin-1"))
    texts.append(caplog.text)
    await APILogHandler.aflush()
    run_id = _run_id(error.output_dir)
    async with get_client() as client:
        logs = await client.read_logs(
            log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id]))
        )
        # The backend block is a flow parameter: Prefect stores it with the run.
        flow_run = await client.read_flow_run(run_id)
    assert logs
    texts.extend(log.message for log in logs)
    texts.append(flow_run.model_dump_json())
    texts.extend(path.read_text() for path in Path(error.output_dir or "").rglob("*"))
    notebook = nbformat.read(Path(error.output_dir or "") / "executed.ipynb", as_version=4)
    assert "DAYTONA_API_KEY" not in notebook.cells[0].outputs[0]["text"]
    for text in texts:
        assert secret not in text


def _cli(*args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    from prefect.settings import PREFECT_API_URL

    return subprocess.run(
        [sys.executable, "-m", "prefect_sandbox.cli", *args],
        env={**env, "PREFECT_API_URL": str(PREFECT_API_URL.value())},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _code_outputs(notebook_path: Path) -> list[list[dict[str, object]]]:
    notebook = nbformat.read(notebook_path, as_version=4)
    nbformat.validate(notebook)
    return [cell.outputs for cell in notebook.cells if cell.cell_type == "code"]


async def test_main_job_on_daytona_gives_the_local_metrics_and_figures(
    daytona_env: DaytonaEmulator, tmp_path: Path
) -> None:
    local = await arun_notebook(
        notebook=str(EXAMPLE / "forecast.ipynb"),
        inputs=[str(EXAMPLE / "co2.csv")],
        artifacts=ARTIFACTS,
        storage=str(tmp_path / "local"),
    )
    args = ["run", str(EXAMPLE / "forecast.ipynb"), "--input", str(EXAMPLE / "co2.csv")]
    for pattern in ARTIFACTS:
        args += ["--artifact", pattern]
    done = _cli(*args, "--out", "OUT", "--backend", "daytona", env=dict(os.environ), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    (remote_dir,) = (tmp_path / "OUT").iterdir()
    local_dir = Path(local.output_dir)
    figures = sorted(p.name for p in (local_dir / "figures").glob("*.png"))
    assert len(figures) >= 2
    assert sorted(p.name for p in (remote_dir / "figures").glob("*.png")) == figures
    for name in ["metrics.json", "forecast.csv", *(f"figures/{f}" for f in figures)]:
        assert hashlib.sha256((remote_dir / name).read_bytes()).hexdigest() == (
            hashlib.sha256((local_dir / name).read_bytes()).hexdigest()
        ), name
    assert 0 < json.loads((remote_dir / "metrics.json").read_text())["mae_ppm"] < 2
    # Printed text, tables and results: the same executed notebook.
    assert _code_outputs(remote_dir / "executed.ipynb") == _code_outputs(
        local_dir / "executed.ipynb"
    )
    summary = json.loads((remote_dir / "summary.json").read_text())
    assert all(stage["status"] == "ok" for stage in summary["stages"])
    assert daytona_env.sandbox_ids({"prefect-flow-run-id": summary["flow_run_id"]}) == []


async def test_cli_takes_credentials_from_a_saved_block(
    daytona_env: DaytonaEmulator, tmp_path: Path
) -> None:
    credentials = DaytonaCredentials(
        api_key=daytona_env.api_key, api_url=daytona_env.api_url, target=daytona_env.target
    )
    await DaytonaBackend(credentials=credentials).save("test-daytona-cli", overwrite=True)
    loaded = await DaytonaBackend.load("test-daytona-cli")
    assert loaded.credentials is not None
    assert loaded.credentials.api_key.get_secret_value() == daytona_env.api_key
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell("print(6 * 7)")]
    nbformat.write(notebook, tmp_path / "tiny.ipynb")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DAYTONA_")}
    done = _cli(
        "run",
        "tiny.ipynb",
        "--backend",
        "daytona",
        "--backend-block",
        "test-daytona-cli",
        "--out",
        "OUT",
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (run_dir,) = (tmp_path / "OUT").iterdir()
    assert _code_outputs(run_dir / "executed.ipynb")[0][0]["text"] == "42\n"
    assert daytona_env.api_key not in done.stdout + done.stderr
    missing = _cli("run", "tiny.ipynb", "--backend-block", "no-such-block", env=env, cwd=tmp_path)
    assert missing.returncode == 2
    assert "no-such-block" in missing.stderr.strip().splitlines()[-1]
