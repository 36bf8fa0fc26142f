"""Runs stopped from outside, against a real `prefect server`: the crash and cancellation hooks
of a CLI run on ``--backend e2b`` without a saved block still reach its sandbox."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from uuid import UUID

import nbformat
import pytest
from prefect.client.orchestration import PrefectClient, get_client
from prefect.settings import PREFECT_API_URL, temporary_settings
from prefect.states import Crashed

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
