"""Runs stopped from outside, against a real `prefect server`: a CLI run and a script run
cancelled through the API mid-cell end Cancelled with what they made stored; the crash and
cancellation hooks of a CLI run on ``--backend e2b`` without a saved block reach its sandbox."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator
from pathlib import Path
from uuid import UUID

import nbformat
import pytest
from prefect.client.orchestration import PrefectClient, get_client
from prefect.client.schemas.objects import FlowRun, StateType
from prefect.settings import PREFECT_API_URL, temporary_settings
from prefect.states import Cancelling, Crashed

from prefect_sandbox.cli import EXIT_CANCELLED
from prefect_sandbox.flows import arun_notebook
from prefect_sandbox.flows.hooks import MASKED_SECRET, kill_run_sandboxes
from prefect_sandbox.sandbox.labels import FLOW_RUN_ID_LABEL
from prefect_sandbox.testing.e2b import E2BEmulator
from tests.conftest import ROOT
from tests.test_deployments import PrefectStack

pytestmark = pytest.mark.timeout(600)


@pytest.fixture
async def client(server: PrefectStack) -> AsyncIterator[PrefectClient]:
    """A client of the module's `prefect server`."""
    with temporary_settings({PREFECT_API_URL: server.url}):
        async with get_client() as prefect:
            yield prefect


def _sleeping_notebook(path: Path) -> Path:
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [
        nbformat.v4.new_markdown_cell("# Work"),
        nbformat.v4.new_code_cell("open('made.txt', 'w').write('made'); print('started')"),
        nbformat.v4.new_code_cell("import time\nprint('sleeping', flush=True)\ntime.sleep(600)"),
        nbformat.v4.new_markdown_cell("# Never"),
        nbformat.v4.new_code_cell("print('never')"),
    ]
    nbformat.write(notebook, path)
    return path


class Started:
    """A process running the notebook, waited on until its sleeping cell has printed."""

    def __init__(self, args: list[str], env: dict[str, str], tmp_path: Path) -> None:
        self.stderr_path = tmp_path / "stderr.txt"
        with self.stderr_path.open("wb") as stderr:
            self.process = subprocess.Popen(
                args, env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=stderr,
                start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + 240
        # The run logger shows the cell's output on stderr as it comes.
        while "sleeping" not in self.stderr_path.read_text():
            assert self.process.poll() is None, self.stderr_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "the sleeping cell never started"
            time.sleep(0.2)

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def _e2b_env(emulator: E2BEmulator) -> dict[str, str]:
    return {
        "E2B_API_KEY": emulator.api_key,
        "E2B_API_URL": emulator.url,
        "E2B_SANDBOX_URL": emulator.url,
    }


async def test_the_crash_hook_of_a_cli_e2b_run_without_a_saved_block_kills_its_sandbox(
    server: PrefectStack,
    client: PrefectClient,
    e2b_emulator: E2BEmulator,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    before = set(e2b_emulator.sandbox_ids())
    env = {**server.env, **_e2b_env(e2b_emulator), "PYTHONPATH": str(ROOT)}
    notebook = _sleeping_notebook(tmp_path / "wait.ipynb")
    args = [sys.executable, "-m", "prefect_sandbox.cli", "run", str(notebook), "--backend", "e2b"]
    run = Started([*args, "--out", str(tmp_path / "out")], env, tmp_path)
    # Killed as SIGKILL kills: its own clean-up never runs, the sandbox is left alive.
    run.stop()
    (sandbox_id,) = set(e2b_emulator.sandbox_ids()) - before
    (flow_run,) = [
        found
        for found in await client.read_flow_runs()
        if e2b_emulator.sandbox_ids({FLOW_RUN_ID_LABEL: str(found.id)}) == [sandbox_id]
    ]
    # The API's copy of the parameters has the key masked: it cannot be used as it is.
    credentials = flow_run.parameters["backend"]["credentials"]
    assert credentials["api_key"] == MASKED_SECRET
    # The hook runs elsewhere (a runner, the reaper) with the environment the CLI had.
    for name, value in _e2b_env(e2b_emulator).items():
        monkeypatch.setenv(name, value)
    await kill_run_sandboxes(arun_notebook, flow_run, Crashed())
    assert e2b_emulator.sandbox_ids({FLOW_RUN_ID_LABEL: str(UUID(str(flow_run.id)))}) == []
    assert sandbox_id not in e2b_emulator.sandbox_ids()


def _polling_env(server: PrefectStack, **extra: str) -> dict[str, str]:
    """The environment of a run against ``server`` that reads its state every second."""
    return {
        **server.env,
        **extra,
        "PYTHONPATH": str(ROOT),
        "PREFECT_SANDBOX_CANCEL_POLL_S": "1",
    }


async def _flow_run_of(client: PrefectClient, notebook: Path) -> FlowRun:
    (found,) = [
        run
        for run in await client.read_flow_runs()
        if run.parameters.get("notebook") == str(notebook)
    ]
    return found


async def _cancel_through_the_api(client: PrefectClient, run: Started, notebook: Path) -> FlowRun:
    """Set the run's flow run Cancelling, as the UI's Cancel button does; wait for its end."""
    flow_run = await _flow_run_of(client, notebook)
    await client.set_flow_run_state(flow_run.id, Cancelling())
    try:
        run.process.wait(timeout=180)
    finally:
        run.stop()
    return await client.read_flow_run(flow_run.id)


def _check_cancelled(flow_run: FlowRun, out: Path) -> dict[str, object]:
    """The flow run ended Cancelled; its summary, notebook and artifact were stored."""
    assert flow_run.state is not None and flow_run.state.type == StateType.CANCELLED
    (run_dir,) = out.iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "cancelled"
    assert summary["flow_run_id"] == str(flow_run.id)
    assert [(s["name"], s["status"]) for s in summary["stages"]] == [
        ("work", "cancelled"),
        ("never", "not_run"),
    ]
    assert summary["sandbox_killed_at"] is not None
    assert (run_dir / "made.txt").read_text() == "made"
    cells = nbformat.read(run_dir / "executed.ipynb", as_version=4).cells
    assert cells[1].outputs[0]["text"] == "started\n"
    assert cells[2].outputs[0]["text"] == "sleeping\n"
    assert cells[2].outputs[-1]["ename"] == "RunCancelled"
    assert cells[4].outputs == []
    return summary


async def test_a_cli_run_cancelled_through_the_api_mid_cell_ends_cancelled_with_its_results(
    server: PrefectStack, client: PrefectClient, e2b_emulator: E2BEmulator, tmp_path: Path
) -> None:
    env = _polling_env(server, **_e2b_env(e2b_emulator))
    notebook = _sleeping_notebook(tmp_path / "wait.ipynb")
    out = tmp_path / "out"
    args = [sys.executable, "-m", "prefect_sandbox.cli", "run", str(notebook), "--backend", "e2b"]
    run = Started([*args, "--artifact", "made.txt", "--out", str(out)], env, tmp_path)
    flow_run = await _cancel_through_the_api(client, run, notebook)
    stderr = run.stderr_path.read_text()
    assert run.process.returncode == EXIT_CANCELLED, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("prefect-sandbox: cancelled through the Prefect API or UI: "), last
    assert "cancelled during stage 'work', cell 2" in last
    summary = _check_cancelled(flow_run, out)
    assert e2b_emulator.sandbox_ids({FLOW_RUN_ID_LABEL: str(flow_run.id)}) == []
    # No kill, by the run or a hook, met a refused key.
    assert "refused the credentials" not in stderr
    assert summary["sandbox_id"] not in e2b_emulator.sandbox_ids()


async def test_a_script_run_cancelled_through_the_api_mid_cell_ends_cancelled_with_its_results(
    server: PrefectStack, client: PrefectClient, tmp_path: Path, short_tmp: Path
) -> None:
    env = _polling_env(server, TMPDIR=str(short_tmp))
    notebook = _sleeping_notebook(tmp_path / "wait.ipynb")
    out = tmp_path / "out"
    script = tmp_path / "script.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys

            from prefect.exceptions import CancelledRun

            from prefect_sandbox.flows import run_notebook

            try:
                run_notebook({str(notebook)!r}, artifacts=["made.txt"], storage={str(out)!r})
            except CancelledRun as exc:
                print("CancelledRun:", exc, file=sys.stderr)
            """
        )
    )
    run = Started([sys.executable, str(script)], env, tmp_path)
    flow_run = await _cancel_through_the_api(client, run, notebook)
    stderr = run.stderr_path.read_text()
    assert run.process.returncode == 0, stderr[-3000:]
    assert "CancelledRun: flow run " in stderr
    _check_cancelled(flow_run, out)
    # The kernel and its folder went with the sandbox; nothing is left under TMPDIR.
    assert [p.name for p in short_tmp.rglob("*") if not p.is_dir()] == []


async def test_a_session_flow_cancelled_through_the_api_mid_cell_ends_cancelled_cleanly(
    server: PrefectStack, client: PrefectClient, tmp_path: Path, short_tmp: Path
) -> None:
    env = _polling_env(server, TMPDIR=str(short_tmp))
    out = tmp_path / "out"
    script = tmp_path / "script.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import asyncio, sys

            from prefect import flow
            from prefect.exceptions import CancelledRun

            from prefect_sandbox.flows import sandbox_session

            @flow(name="session-agent")
            async def agent() -> None:
                async with sandbox_session(storage={str(out)!r}) as session:
                    await session.run_cell("open('made.txt', 'w').write('made')")
                    await session.run_cell("import time; print('sleeping'); time.sleep(600)")

            try:
                asyncio.run(agent())
            except CancelledRun as exc:
                print("CancelledRun:", exc, file=sys.stderr)
            """
        )
    )
    run = Started([sys.executable, str(script)], env, tmp_path)
    flow_id = (await client.read_flow_by_name("session-agent")).id
    (flow_run,) = [r for r in await client.read_flow_runs() if r.flow_id == flow_id]
    await client.set_flow_run_state(flow_run.id, Cancelling())
    try:
        run.process.wait(timeout=180)
    finally:
        run.stop()
    stderr = run.stderr_path.read_text()
    assert run.process.returncode == 0, stderr[-3000:]
    # No traceback of the script's own (the interrupted cell's is its output, prefixed).
    assert "CancelledError" not in stderr, stderr[-3000:]
    assert not [line for line in stderr.splitlines() if line.startswith("Traceback")]
    assert "CancelledRun: sandbox session cancelled" in stderr
    ended = await client.read_flow_run(flow_run.id)
    assert ended.state is not None and ended.state.type == StateType.CANCELLED, ended.state
    (summary_path,) = out.glob("*/summary.json")
    summary = json.loads(summary_path.read_text())
    assert summary["status"] == "cancelled" and summary["sandbox_killed_at"] is not None
