"""Sandbox sessions on Prefect's real API with real kernels: bad input, the sync twin, the tool
adapters, the model's text, and cancellation and SIGKILL leaving nothing alive."""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from uuid import UUID

import jsonschema
import nbformat
import psutil
import pytest
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    ArtifactFilterKey,
    FlowRunFilter,
    FlowRunFilterId,
    LogFilter,
    LogFilterFlowRunId,
)
from prefect.logging.handlers import APILogHandler
from prefect.states import Crashed

from prefect_sandbox import E2BBackend, E2BCredentials, LocalKernelBackend
from prefect_sandbox.flows import (
    CellRun,
    FixerError,
    SandboxSession,
    SyncSandboxSession,
    sandbox_session,
)
from prefect_sandbox.flows.tools import (
    anthropic_tool,
    dispatch_tool_call,
    dispatch_tool_call_sync,
    openai_tool,
)
from prefect_sandbox.sandbox.base import CellResult
from prefect_sandbox.sandbox.errors import (
    CellExecutionError,
    CellTimeoutError,
    SandboxNotFoundError,
)
from prefect_sandbox.sandbox.labels import FLOW_RUN_ID_LABEL
from prefect_sandbox.sandbox.model_text import NO_OUTPUT, cell_text
from prefect_sandbox.sandbox.outputs import error_output
from prefect_sandbox.testing.e2b import E2BEmulator
from tests.conftest import ROOT, kernel_processes, load_scaled
from tests.test_reaper import _reap, _sigkill, _start_victim, e2b_backend

pytestmark = pytest.mark.usefixtures("prefect_api")
EXAMPLE = ROOT / "examples" / "agent" / "co2_agent.py"
__all__ = ["e2b_backend"]  # a fixture, used by name


def _only_folder(out: Path) -> Path:
    (folder,) = out.iterdir()
    return folder


def _summary(out: Path) -> dict[str, Any]:
    return dict(json.loads((_only_folder(out) / "summary.json").read_text()))


def test_the_text_for_a_model_keeps_what_it_can_read_in_order_and_caps_it() -> None:
    started = datetime.now(UTC)
    result = CellResult(
        status="error",
        outputs=[
            {"output_type": "stream", "name": "stdout", "text": "10%\r100%\nline\n"},
            {"output_type": "stream", "name": "stderr", "text": "\x1b[31mwarned\x1b[0m\n"},
            {
                "output_type": "display_data",
                "data": {"image/png": "iVBORw0KGgo=", "text/plain": "<Figure>"},
                "metadata": {},
            },
            {
                "output_type": "execute_result",
                "data": {"text/plain": "42", "text/html": "<b>42</b>"},
                "metadata": {},
                "execution_count": 3,
            },
            error_output(
                "ValueError", "bad", ["\x1b[0;31mCell In[3], line 2\x1b[0m", "----> 2 f()"]
            ),
        ],
        started_at=started,
        duration_s=0.1,
    )
    assert cell_text(result, cell_index=4) == (
        "```stdout\n100%\nline\n```\n```stderr\nwarned\n```\n"
        "[figure inline-figures/cell-004-1.png]\n```result\n42\n```\n"
        "```error\nValueError: bad\nCell In[3], line 2\n----> 2 f()\n```"
    )
    assert "[figure: image/png]" in cell_text(result)
    long = CellResult(
        status="ok",
        outputs=[{"output_type": "stream", "name": "stdout", "text": "x" * 10_000 + "END"}],
        started_at=started,
        duration_s=0.1,
    )
    capped = cell_text(long, max_chars=500)
    assert len(capped) == 500 and capped.endswith("END\n```") and "left out here" in capped
    assert cell_text(CellResult(status="ok", started_at=started, duration_s=0.0)) == NO_OUTPUT
    with pytest.raises(ValueError, match="max_chars"):
        cell_text(long, max_chars=10)


def test_the_sync_session_has_the_async_sessions_signatures() -> None:
    for name in ("run_cell", "list_files", "download"):
        sync = inspect.signature(getattr(SyncSandboxSession, name))
        asynchronous = inspect.signature(getattr(SandboxSession, name))
        assert sync == asynchronous, name


def test_the_tool_schemas_are_valid_json_schema_in_each_vendors_shape() -> None:
    openai, anthropic = openai_tool(), anthropic_tool()
    assert openai["type"] == "function"
    assert openai["function"]["name"] == anthropic["name"] == "execute_python"
    for schema in (openai["function"]["parameters"], anthropic["input_schema"]):
        jsonschema.Draft202012Validator.check_schema(schema)
        validator = jsonschema.Draft202012Validator(schema)
        assert validator.is_valid({"code": "print(1)"})
        assert not validator.is_valid({})
        assert not validator.is_valid({"code": 1})
        assert not validator.is_valid({"code": "1", "other": 2})
    # Strict mode: every property required, no others (OpenAI's rule for strict tools).
    parameters = openai["function"]["parameters"]
    assert openai["function"]["strict"] is True
    assert set(parameters["required"]) == set(parameters["properties"])
    # Each call gives a fresh copy: an agent that edits one changes no other.
    openai["function"]["parameters"]["properties"].clear()
    assert openai_tool()["function"]["parameters"]["properties"]


async def test_bad_input_gets_clear_errors_and_a_raising_fixer_still_stores_and_kills(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    kept: list[SandboxSession] = []

    def same(code: str, report: CellRun) -> str:
        return code

    def wrong_type(code: str, report: CellRun) -> Any:
        return 3

    async def broken(code: str, report: CellRun) -> str:
        raise ConnectionError("the model is unreachable")

    @flow
    async def agent() -> None:
        async with sandbox_session(backend=LocalKernelBackend(), storage=str(out)) as session:
            kept.append(session)
            await session.run_cell("x = 1")
            with pytest.raises(TypeError, match="code must be Python source as a str, not bytes"):
                await session.run_cell(b"x = 2")  # type: ignore[arg-type]
            with pytest.raises(ValueError, match="max_attempts must be an int of at least 1"):
                await session.run_cell("x = 2", max_attempts=0)
            with pytest.raises(ValueError, match="timeout_s must be a positive number"):
                await session.run_cell("x = 2", timeout_s=0)
            with pytest.raises(FixerError, match=r"step 2 .*returned the code that just failed"):
                await session.run_cell("1/0", fix=same, max_attempts=2)
            with pytest.raises(FixerError, match="returned a int"):
                await session.run_cell("1/0", fix=wrong_type, max_attempts=2)
            gave_up = await session.run_cell("1/0", fix=lambda code, report: None, max_attempts=3)
            assert (gave_up.status, gave_up.attempt) == ("error", 1)
            with pytest.raises(
                CellExecutionError, match="stage 'cell-5', cell 4: ZeroDivisionError"
            ):
                await session.run_cell("1/0", raise_on_error=True)
            await session.run_cell("undefined_name", fix=broken, max_attempts=2)

    state = await agent(return_state=True)
    assert state.is_failed()
    with pytest.raises(FixerError) as info:
        await state.result()
    assert info.value.step == 6 and info.value.attempt == 1
    assert isinstance(info.value.__cause__, ConnectionError)

    summary = _summary(out)
    assert summary["status"] == "failed"
    assert "step 6 (run-cell-6), attempt 1: the fixer raised ConnectionError" in summary["error"]
    assert [s["cell_count"] for s in summary["stages"]] == [1, 1, 1, 1, 1, 1]
    notebook = nbformat.read(_only_folder(out) / "executed.ipynb", as_version=4)
    assert "ConnectionError" in notebook.cells[-1].metadata["prefect_sandbox"]["fix_error"]
    listed = await LocalKernelBackend().list_sandboxes({FLOW_RUN_ID_LABEL: summary["flow_run_id"]})
    assert listed == []
    with pytest.raises(RuntimeError, match="this sandbox session has ended"):
        await kept[0].run_cell("x = 3")
    with pytest.raises(RuntimeError, match="inside a Prefect flow run"):
        async with sandbox_session(storage=str(out)):
            pass
    with pytest.raises(ValueError, match="cell_timeout_s"):
        sandbox_session(cell_timeout_s=-5)


def test_a_sync_flow_runs_a_session_the_tool_dispatcher_and_a_fixer_that_probes_it(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    probes: list[str] = []

    @flow
    def agent() -> list[str]:
        with sandbox_session(backend=LocalKernelBackend(), storage=str(out)) as session:

            def fixer(code: str, report: CellRun) -> str:
                # Its own step, run while the failed one waits for the fix (no deadlock).
                probes.append(session.run_cell("x").text)
                return "y = x + 2\ny"

            first = session.run_cell("x = 41")
            answer = dispatch_tool_call_sync(session, '{"code": "x + 1"}')
            fixed = session.run_cell("y = x +", fix=fixer)  # fix= alone: 3 attempts
            return [first.status, answer, fixed.text, str(fixed.attempt)]

    assert agent() == ["ok", "```result\n42\n```", "```result\n43\n```", "2"]
    assert probes == ["```result\n41\n```"]
    summary = _summary(out)
    assert summary["status"] == "completed"
    assert [(s["name"], s["cell_count"]) for s in summary["stages"]] == [
        ("cell-1", 1),
        ("cell-2", 1),
        ("cell-3", 2),
        ("cell-4", 1),
    ]
    notebook = nbformat.read(_only_folder(out) / "executed.ipynb", as_version=4)
    facts = [(c.source, c.metadata["prefect_sandbox"]["step"]) for c in notebook.cells]
    assert facts == [
        ("x = 41", 1),
        ("x + 1", 2),
        ("y = x +", 3),
        ("x", 4),
        ("y = x + 2\ny", 3),
    ]


async def test_an_async_fixer_gets_its_probes_result_and_fix_alone_gives_three_attempts(
    tmp_path: Path,
) -> None:
    seen: list[tuple[int, str]] = []

    @flow
    async def agent() -> CellRun:
        async with sandbox_session(backend=LocalKernelBackend(), storage=str(tmp_path)) as session:

            async def fixer(code: str, report: CellRun) -> str:
                probe = await session.run_cell("print(sorted(globals()['data']))")
                seen.append((report.attempt, probe.text))
                return f"{code}  # attempt {report.attempt + 1}"

            await session.run_cell("data = {'b': 2, 'a': 1}")
            return await session.run_cell("data['c']", fix=fixer)

    last = await agent()
    assert (last.status, last.attempt) == ("error", 3)
    assert seen == [(1, "```stdout\n['a', 'b']\n```"), (2, "```stdout\n['a', 'b']\n```")]


def test_a_sync_session_raises_a_cells_timeout_when_asked_and_runs_on(tmp_path: Path) -> None:
    @flow
    def agent() -> str:
        with sandbox_session(backend=LocalKernelBackend(), storage=str(tmp_path)) as session:
            with pytest.raises(CellTimeoutError, match="stage 'cell-1', cell 0"):
                session.run_cell("import time; time.sleep(60)", timeout_s=1, raise_on_error=True)
            return session.run_cell("print('after')").text

    assert agent() == "```stdout\nafter\n```"


def test_a_sync_flow_that_raises_still_stores_and_kills_and_its_error_leaves_as_it_is(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"

    @flow
    def agent() -> None:
        with sandbox_session(backend=LocalKernelBackend(), storage=str(out)) as session:
            session.run_cell("x = 1")
            raise LookupError("the agent gave up")

    with pytest.raises(LookupError, match="the agent gave up"):
        agent()
    summary = _summary(out)
    assert summary["status"] == "failed"
    assert summary["error"] == "the flow's code raised LookupError: the agent gave up"
    assert summary["sandbox_killed_at"] is not None
    assert (
        asyncio.run(
            LocalKernelBackend().list_sandboxes({FLOW_RUN_ID_LABEL: summary["flow_run_id"]})
        )
        == []
    )


_SESSION_TIMEOUT_S = 20
"""A session flow's timeout on a quiet machine: room for its kernel to start (`load_scaled`)."""


@pytest.mark.parametrize("kind", ["async", "sync"])
def test_a_session_flow_past_its_timeout_stores_everything_and_ends_timed_out(
    tmp_path: Path, kind: str
) -> None:
    out = tmp_path / "out"
    sleeper = "import time\nprint('sleeping', flush=True)\ntime.sleep(600)"
    before = {p.pid for p in kernel_processes()}
    timeout_s = load_scaled(_SESSION_TIMEOUT_S)

    @flow(timeout_seconds=timeout_s)
    async def async_agent() -> None:
        async with sandbox_session(storage=str(out), artifacts=["*.txt"]) as session:
            await session.run_cell("open('kept.txt', 'w').write('kept')")
            await session.run_cell(sleeper)

    @flow(timeout_seconds=timeout_s)
    def sync_agent() -> None:
        with sandbox_session(storage=str(out), artifacts=["*.txt"]) as session:
            session.run_cell("open('kept.txt', 'w').write('kept')")
            session.run_cell(sleeper)

    if kind == "async":
        state = asyncio.run(async_agent(return_state=True))
    else:
        state = sync_agent(return_state=True)
    assert state.name == "TimedOut", state
    summary = _summary(out)
    assert summary["status"] == "failed"
    assert summary["error"].startswith(
        f"timed out (the flow run's timeout_seconds, {float(timeout_s)} s) during "
        "stage 'cell-2', cell 1"
    )
    assert [s["status"] for s in summary["stages"]] == ["ok", "failed"]
    assert {a["path"] for a in summary["artifacts"]} == {"kept.txt", "executed.ipynb"}
    assert summary["sandbox_killed_at"] is not None
    notebook = nbformat.read(_only_folder(out) / "executed.ipynb", as_version=4)
    assert [o.get("text", o.get("ename")) for o in notebook.cells[1].outputs] == [
        "sleeping\n",
        "KeyboardInterrupt",  # the cell was interrupted before the sandbox was killed
        "RunTimedOut",
    ]
    assert notebook.cells[1].outputs[-1]["evalue"].endswith("; the cell was interrupted")
    assert {p.pid for p in kernel_processes()} <= before


async def test_sessions_of_one_flow_run_keep_their_own_files_and_a_retry_starts_afresh(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    attempts: list[int] = []

    async def write(session: SandboxSession, name: str, attempt: int) -> None:
        await session.run_cell(f"open({name!r}, 'w').write('attempt {attempt}')")

    @flow(retries=1)
    async def agent() -> None:
        attempts.append(len(attempts) + 1)
        attempt = attempts[-1]
        backend = LocalKernelBackend()
        async with sandbox_session(backend=backend, storage=str(out), artifacts=["*.txt"]) as a:
            await write(a, "plan.txt", attempt)
            async with sandbox_session(
                backend=backend, storage=str(out), artifacts=["*.txt"]
            ) as nested:
                await write(nested, "nested.txt", attempt)
        async with sandbox_session(backend=backend, storage=str(out), artifacts=["*.txt"]) as c:
            await write(c, f"third-{attempt}.txt", attempt)
        if attempt == 1:
            raise RuntimeError("retry me")

    await agent()
    folders = sorted(out.iterdir())
    suffixes = [folder.name.rpartition("-session-")[2] for folder in folders]
    assert len(folders) == 3 and suffixes[1:] == ["2", "3"], folders
    stored = [sorted(p.name for p in folder.iterdir()) for folder in folders]
    assert stored == [
        ["executed.ipynb", "plan.txt", "summary.json"],
        ["executed.ipynb", "nested.txt", "summary.json"],
        ["executed.ipynb", "summary.json", "third-2.txt"],
    ]
    assert (folders[0] / "plan.txt").read_text() == "attempt 2"
    summary = json.loads((folders[0] / "summary.json").read_text())
    # The run's own artifacts: the suite's API holds many more than one page of them.
    ours = ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[summary["flow_run_id"]]))
    async with get_client() as client:
        keys = {a.key for a in await client.read_artifacts(artifact_filter=ours) if a.key}
    assert {"session-summary", "session-summary-session-2", "session-summary-session-3"} <= keys


async def test_an_idle_e2b_session_is_kept_alive_up_to_its_max_idle_s(
    e2b_emulator: E2BEmulator, tmp_path: Path
) -> None:
    lifetime_s = 3
    credentials = E2BCredentials(
        api_key=e2b_emulator.api_key, api_url=e2b_emulator.url, sandbox_url=e2b_emulator.url
    )
    backend = E2BBackend(credentials=credentials, lifetime_s=lifetime_s)

    async def idle(past: datetime) -> None:
        # The idle time itself is what is tested: the emulator expires what is not renewed.
        while datetime.now(UTC) < past:
            await asyncio.sleep(0.2)

    @flow
    async def agent(max_idle_s: float | None) -> tuple[str, datetime, datetime | None]:
        async with sandbox_session(
            backend=backend, storage=str(tmp_path / str(max_idle_s)), max_idle_s=max_idle_s
        ) as session:
            await session.run_cell("x = 41")
            idle_from = datetime.now(UTC)
            await idle(idle_from + timedelta(seconds=2 * lifetime_s))
            live = session.handle.sandbox_id in e2b_emulator.sandbox_ids()
            end_at = e2b_emulator.end_at(session.handle.sandbox_id) if live else None
            return (await session.run_cell("print(x + 1)")).text, idle_from, end_at

    answer, idle_from, end_at = await agent(None)
    assert answer == "```stdout\n42\n```"
    assert end_at and end_at > idle_from + timedelta(seconds=lifetime_s)  # renewed while idle
    with pytest.raises(SandboxNotFoundError):
        await agent(0.5)  # renewals stop after half a second idle: it expires


async def test_the_dispatcher_names_the_exception_and_line_and_answers_bad_arguments(
    tmp_path: Path,
) -> None:
    @flow
    async def agent() -> list[str]:
        async with sandbox_session(
            backend=LocalKernelBackend(), storage=str(tmp_path / "out")
        ) as session:
            return [
                await dispatch_tool_call(session, '{"code": "x = 1\\ny = undefined_name"}'),
                await dispatch_tool_call(session, {"code": "print(x)"}),
                await dispatch_tool_call(session, "{not json"),
                await dispatch_tool_call(session, {"source": "x"}),
            ]

    state = await agent(return_state=True)
    error, anthropic, not_json, no_code = await state.result()
    # Each call is a task run named like the conversation, its output in the run log.
    await APILogHandler.aflush()
    flow_run_id = state.state_details.flow_run_id
    async with get_client() as client:
        runs = await client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
        )
        logs = await client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
        artifacts = await client.read_artifacts(
            artifact_filter=ArtifactFilter(
                key=ArtifactFilterKey(any_=["session-summary"]),
                flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]),
            )
        )
    (summary,) = artifacts
    assert "| cell-2 | ok |" in str(summary.data) and ": completed" in str(summary.data)
    names = {run.name for run in runs}
    assert {"run-cell-1", "run-cell-2"} <= names and "run-cell-3" not in names
    messages = [log.message for log in logs]
    assert "[cell-2 cell 1] 1" in messages
    assert any(m.startswith("[cell-1 cell 0] NameError") for m in messages)
    assert error.startswith("```error\nNameError: name 'undefined_name' is not defined")
    assert "line 2" in error and "----> 2 y = undefined_name" in error
    assert "\x1b" not in error
    assert anthropic == "```stdout\n1\n```"
    assert not_json.startswith("Error: the arguments are not valid JSON")
    assert no_code == 'Error: the arguments must have "code", the Python code as a string'


def _kernel_pid(session: SandboxSession) -> int:
    return int((Path(session.handle.connection["runtime_dir"]) / "kernel.pid").read_text())


async def test_cancelling_the_flow_mid_cell_kills_the_sandbox_and_stores_the_cells(
    tmp_path: Path,
) -> None:
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    pids: list[int] = []

    @flow
    async def agent() -> None:
        async with sandbox_session(
            backend=LocalKernelBackend(workdir_root=str(work)), storage=str(out)
        ) as session:
            pids.append(_kernel_pid(session))
            await session.run_cell("x = 1")
            await session.run_cell(
                "import time\nopen('sleeping.marker', 'w').write('1')\ntime.sleep(120)"
            )

    running = asyncio.create_task(agent())
    async with asyncio.timeout(120):
        while not list(work.rglob("sleeping.marker")):
            await asyncio.sleep(0.05)
    running.cancel()
    with pytest.raises(BaseException) as info:
        await running
    assert type(info.value).__name__ in {"CancelledError", "CancelledRun"}

    summary = _summary(out)
    assert summary["status"] == "cancelled"
    assert [s["status"] for s in summary["stages"]] == ["ok", "cancelled"]
    assert summary["sandbox_killed_at"] is not None
    notebook = nbformat.read(_only_folder(out) / "executed.ipynb", as_version=4)
    assert notebook.cells[1].outputs[-1]["ename"] == "RunCancelled"
    backend = LocalKernelBackend(workdir_root=str(work))
    assert await backend.list_sandboxes({FLOW_RUN_ID_LABEL: summary["flow_run_id"]}) == []
    assert not psutil.pid_exists(pids[0]) or psutil.Process(pids[0]).status() == "zombie"


_SESSION_VICTIM = """
import asyncio, json, os
from prefect import flow
from prefect_sandbox import E2BBackend, E2BCredentials
from prefect_sandbox.flows import sandbox_session

spec = json.loads(os.environ["REAPER_TEST_VICTIM"])
credentials = E2BCredentials(api_key=spec["api_key"], api_url=spec["url"], sandbox_url=spec["url"])
backend = E2BBackend(credentials=credentials, metadata={"test-id": spec["test_id"]})

@flow(flow_run_name=spec["name"])
async def agent():
    async with sandbox_session(backend=backend, storage=spec["storage"]) as session:
        await session.run_cell("x = 1")
        await session.run_cell(
            "print('victim-cell-running', flush=True)\\nimport time\\ntime.sleep(600)"
        )

asyncio.run(agent())
"""


@pytest.mark.timeout(300)
async def test_a_sigkilled_session_flow_leaves_its_sandbox_to_the_reaper(
    e2b_emulator: Any, e2b_backend: tuple[E2BBackend, dict[str, str]], tmp_path: Path
) -> None:
    backend, spec = e2b_backend
    spec = {**spec, "storage": str(tmp_path / "out")}
    scope = {"test-id": spec["test_id"]}
    victim = await _start_victim(backend, spec, tmp_path / "victim.log", script=_SESSION_VICTIM)
    _sigkill(victim)
    # No hook ran: the sandbox is alive at the vendor, labelled with its run.
    assert e2b_emulator.sandbox_ids(scope) == [victim.handle.sandbox_id]
    async with get_client() as client:
        await client.set_flow_run_state(UUID(victim.flow_run_id), Crashed(), force=True)
    reaped, rows = await _reap(backends=[backend], labels=scope)
    assert [(e.sandbox_id, e.why, e.killed) for e in reaped] == [
        (victim.handle.sandbox_id, "flow run Crashed", True)
    ]
    assert [row["result"] for row in rows] == ["killed"]
    assert e2b_emulator.sandbox_ids(scope) == []


async def test_the_co2_agent_example_fixes_its_bug_and_stores_a_figure_and_metrics(
    tmp_path: Path,
) -> None:
    spec = importlib.util.spec_from_file_location("co2_agent", EXAMPLE)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    out = tmp_path / "out"
    found = await example.co2_agent(out=str(out), backend=LocalKernelBackend())
    assert found["steps"] == [(1, 1, "ok"), (2, 2, "ok"), (3, 1, "ok"), (4, 1, "ok")]
    assert found["last"] == "saved figures/co2_agent.png"
    assert example.report(found, "out").splitlines() == [
        "The agent ran 4 step(s):",
        "  step 1: ok",
        "  step 2: ok, fixed after 1 failed attempt(s)",
        "  step 3: ok",
        "  step 4: ok",
        "Its last cell printed: saved figures/co2_agent.png",
        "Files (executed.ipynb, figures, metrics.json, summary.json) are in out/",
    ]
    folder = _only_folder(out)
    metrics = json.loads((folder / "metrics.json").read_text())
    assert metrics["holdout_months"] == 60 and 0 < metrics["holdout_rmse_ppm"] < 2
    assert (folder / "figures" / "co2_agent.png").read_bytes().startswith(b"\x89PNG")
    notebook = nbformat.read(folder / "executed.ipynb", as_version=4)
    buggy, fixed = notebook.cells[1], notebook.cells[2]
    assert buggy.outputs[-1]["ename"] == "KeyError" and "['ppm']" in buggy.source
    assert "['co2']" in fixed.source
    assert [c.metadata["prefect_sandbox"]["attempt"] for c in notebook.cells] == [1, 1, 2, 1, 1]
