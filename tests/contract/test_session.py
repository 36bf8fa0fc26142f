"""A scripted agent in a sandbox session, on every backend: cells decided as the flow goes, one
failing and fixed on its second attempt, one timing out and fixed; what it made is stored, its
sandbox killed, its flow run Completed. A call its caller abandons stops its cell."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any
from uuid import UUID

import nbformat
import pytest
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

from prefect_sandbox.blocks.base import SandboxBackend
from prefect_sandbox.flows import CellRun, SandboxSession, sandbox_session
from prefect_sandbox.flows.tools import dispatch_tool_call
from prefect_sandbox.sandbox.labels import FLOW_RUN_ID_LABEL
from tests.conftest import STOPPING_GRACE_S

pytestmark = [pytest.mark.usefixtures("prefect_api"), pytest.mark.timeout(300)]

LOAD = "import csv\nrows = list(csv.DictReader(open('data.csv')))\nprint(len(rows), 'rows')"
BUGGY = "values = [float(row['valu']) for row in rows]\nprint(sum(values))"
FIXED = "values = [float(row['value']) for row in rows]\nprint(sum(values))"
SLOW = "import time\ntime.sleep(120)"
QUICK = "mean = sum(values) / len(values)\nprint('mean', mean)"
FIGURE = (
    "import json, os\n"
    "import matplotlib\n"
    "matplotlib.use('Agg')\n"
    "import matplotlib.pyplot as plt\n"
    "os.makedirs('figures', exist_ok=True)\n"
    "plt.plot(values)\n"
    "plt.savefig('figures/values.png')\n"
    "json.dump({'mean': mean, 'n': len(values)}, open('metrics.json', 'w'))\n"
    "print('saved')"
)


@pytest.mark.interrupt_grace(STOPPING_GRACE_S)
async def test_a_scripted_agent_fixes_an_error_and_a_timeout_and_everything_is_stored(
    backend: SandboxBackend, tmp_path: Path
) -> None:
    data = tmp_path / "data.csv"
    data.write_text("value\n1\n2\n3\n6\n")
    reports: list[CellRun] = []

    def fixer(code: str, report: CellRun) -> str | None:
        reports.append(report)
        return {BUGGY: FIXED, SLOW: QUICK}.get(code)

    @flow(name="scripted-agent")
    async def agent() -> list[dict[str, Any]]:
        async with sandbox_session(
            backend=backend,
            inputs=[str(data)],
            artifacts=["figures/*.png", "metrics.json"],
            storage=str(tmp_path / "out"),
        ) as session:
            steps = [
                await session.run_cell(LOAD),
                await session.run_cell(BUGGY, fix=fixer, max_attempts=3),
                await session.run_cell(SLOW, timeout_s=2, fix=fixer, max_attempts=2),
                await session.run_cell(FIGURE),
            ]
        return [step.model_dump(include={"step", "attempt", "status", "text"}) for step in steps]

    state = await agent(return_state=True)
    assert state.is_completed(), state
    steps = await state.result()
    assert [(s["step"], s["attempt"], s["status"]) for s in steps] == [
        (1, 1, "ok"),
        (2, 2, "ok"),
        (3, 2, "ok"),
        (4, 1, "ok"),
    ]
    assert [s["text"] for s in steps[:3]] == [
        f"```stdout\n{text}\n```" for text in ("4 rows", "12.0", "mean 3.0")
    ]
    # E2B's server also shows the open figure after the cell, named as the flow stores it.
    saved = "```stdout\nsaved\n```"
    assert steps[3]["text"] in (saved, f"[figure inline-figures/cell-005-1.png]\n{saved}")
    # The fixer read the error's name, message and failing line, then the timeout.
    assert [r.status for r in reports] == ["error", "timeout"]
    assert "```error\nKeyError: 'valu'" in reports[0].text
    assert "row['valu']" in reports[0].text and "\x1b" not in reports[0].text
    assert "CellTimeoutError" in reports[1].text

    (folder,) = (tmp_path / "out").iterdir()
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert [(s["name"], s["status"], s["cell_count"]) for s in summary["stages"]] == [
        ("cell-1", "ok", 1),
        ("cell-2", "ok", 2),
        ("cell-3", "ok", 2),
        ("cell-4", "ok", 1),
    ]
    stored = {a["path"] for a in summary["artifacts"]}
    assert {"figures/values.png", "metrics.json", "executed.ipynb"} <= stored
    assert (folder / "figures" / "values.png").read_bytes().startswith(b"\x89PNG")
    assert json.loads((folder / "metrics.json").read_text()) == {"mean": 3.0, "n": 4}

    notebook = nbformat.read(folder / "executed.ipynb", as_version=4)
    nbformat.validate(notebook)
    facts = [cell.metadata["prefect_sandbox"] for cell in notebook.cells]
    assert [(f["step"], f["attempt"], f["status"]) for f in facts] == [
        (1, 1, "ok"),
        (2, 1, "error"),
        (2, 2, "ok"),
        (3, 1, "timeout"),
        (3, 2, "ok"),
        (4, 1, "ok"),
    ]
    assert [cell.source for cell in notebook.cells] == [LOAD, BUGGY, FIXED, SLOW, QUICK, FIGURE]
    assert notebook.cells[1].outputs[-1]["ename"] == "KeyError"

    run_id = summary["flow_run_id"]
    async with get_client() as client:
        runs = await client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[UUID(run_id)]))
        )
    assert sorted(run.name for run in runs if run.name.startswith("run-cell")) == [
        "run-cell-1",
        "run-cell-2",
        "run-cell-2-attempt-2",
        "run-cell-3",
        "run-cell-3-attempt-2",
        "run-cell-4",
    ]
    assert await backend.list_sandboxes({FLOW_RUN_ID_LABEL: run_id}) == []
    assert summary["sandbox_killed_at"] is not None


SLEEPS_THEN_SET = (
    "import time\n"
    "print('sleeping', flush=True)\n"
    "time.sleep(0.5)  # for the output to reach the client before the marker\n"
    "open('started.marker', 'w').close()\n"
    "for _ in range(120):\n"
    "    time.sleep(0.1)\n"
    "x = 2"
)
STUBBORN = (
    "import time\n"
    "open('stubborn.marker', 'w').close()\n"
    "for _ in range(600):\n"
    "    try:\n"
    "        time.sleep(0.1)\n"
    "    except KeyboardInterrupt:\n"
    "        pass"
)


async def _abandon(session: SandboxSession, code: str, marker: str) -> None:
    """Start ``code``, and cancel its call once it has made ``marker``, as ``asyncio.wait_for``
    does when its time is up."""
    call = asyncio.create_task(session.run_cell(code))
    while not await session.list_files(marker):
        await asyncio.sleep(0.05)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call


@pytest.mark.interrupt_grace(STOPPING_GRACE_S)
async def test_an_abandoned_call_stops_its_cell_and_the_next_call_runs_on_the_old_state(
    backend: SandboxBackend, tmp_path: Path
) -> None:
    @flow(name="abandoning-agent")
    async def agent() -> tuple[CellRun, float, CellRun]:
        async with sandbox_session(backend=backend, storage=str(tmp_path / "out")) as session:
            await session.run_cell("x = 1")
            await _abandon(session, SLEEPS_THEN_SET, "started.marker")
            cancelled_at = time.monotonic()
            after = await session.run_cell("print(x)")
            seconds = time.monotonic() - cancelled_at
            # One that ignores its interrupts gets its kernel restarted, as on a timeout.
            await _abandon(session, STUBBORN, "stubborn.marker")
            return after, seconds, await session.run_cell("x")

    after, seconds, lost = await agent()
    print(f"{backend.backend_slug}: the next call took {seconds:.2f} s after the cancel")
    assert after.cell.outputs == [{"output_type": "stream", "name": "stdout", "text": "1\n"}]
    assert lost.cell.error is not None and lost.cell.error.ename == "NameError"
    (folder,) = (tmp_path / "out").iterdir()
    notebook = nbformat.read(folder / "executed.ipynb", as_version=4)
    abandoned, stubborn = notebook.cells[1], notebook.cells[3]
    assert abandoned.metadata["prefect_sandbox"]["status"] == "error"
    assert abandoned.outputs[0]["text"] == "sleeping\n"
    assert abandoned.outputs[-1]["ename"] == stubborn.outputs[-1]["ename"] == "RunCancelled"
    assert abandoned.outputs[-1]["evalue"].endswith("; the cell was interrupted")
    assert stubborn.outputs[-1]["evalue"].endswith("its kernel was restarted (state lost)")
    summary = json.loads((folder / "summary.json").read_text())
    assert [s["status"] for s in summary["stages"]] == [
        "ok",
        "cancelled",
        "ok",
        "cancelled",
        "failed",
    ]


async def test_a_session_outlives_its_kernel_and_restarts_on_request(
    backend: SandboxBackend, tmp_path: Path
) -> None:
    @flow(name="dying-agent")
    async def agent() -> tuple[str, str, str, CellRun, CellRun]:
        async with sandbox_session(backend=backend, storage=str(tmp_path / "out")) as session:
            await session.run_cell("x = 1\nopen('kept.txt', 'w').write('kept')")
            died = await dispatch_tool_call(session, {"code": "import os\nos._exit(3)"})
            crashed = await dispatch_tool_call(
                session, {"code": "import ctypes\nctypes.string_at(0)"}
            )
            after = await dispatch_tool_call(session, {"code": "print(open('kept.txt').read())"})
            await session.run_cell("y = 1")
            await session.restart()
            return died, crashed, after, await session.run_cell("x"), await session.run_cell("y")

    died, crashed, after, x, y = await agent()
    for text in (died, crashed):  # os._exit, then a segfault
        assert "SandboxDiedError" in text and "variables and imports are gone" in text
    assert "kept" in after
    assert x.status == y.status == "error"
    assert [r.cell.error.ename for r in (x, y) if r.cell.error] == ["NameError", "NameError"]
