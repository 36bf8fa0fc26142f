"""Every way out of a run, for a pipeline and for a sandbox session (issue 32): each ends in its
final state, stores ``summary.json`` with the status that state means, and leaves no sandbox.

The ways run here, in this process, on real kernels and Prefect's real API: a failing cell
(Failed), the flow's task cancelled (Cancelled), the flow run set Cancelling through the API
(Cancelled), and a signal (Cancelled): SIGTERM to a pipeline's sync twin, SIGINT to a script's
``asyncio.run`` of a session flow. A passed ``timeout_seconds`` (TimedOut, status ``failed``) is
tested where one flow timeout serves many cases: for a pipeline, tests/test_flows.py's
``test_c04_a_flow_timeout_mid_cell_stores_everything_and_ends_timed_out``; for a session,
test_session.py's ``test_a_session_flow_past_its_timeout_stores_everything_and_ends_timed_out``.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from uuid import UUID, uuid4

import pytest
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
from prefect.client.schemas.objects import State, StateType
from prefect.states import Cancelling

from prefect_sandbox import LocalKernelBackend
from prefect_sandbox.flows import amodeling_pipeline, modeling_pipeline, sandbox_session
from prefect_sandbox.sandbox.labels import FLOW_RUN_ID_LABEL
from tests.conftest import kernel_processes

pytestmark = [pytest.mark.usefixtures("prefect_api"), pytest.mark.timeout(300)]

MADE = "open('made.txt', 'w').write('made')"
SLEEPER = "import time\nopen('sleeping.marker', 'w').write('1')\ntime.sleep(120)"
FAILING = "1/0"

WAYS = {
    # way: (the second cell, the flow run's final state, summary.json's status)
    "error": (FAILING, StateType.FAILED, "failed"),
    "cancel": (SLEEPER, StateType.CANCELLED, "cancelled"),
    "api-cancel": (SLEEPER, StateType.CANCELLED, "cancelled"),
    "signal": (SLEEPER, StateType.CANCELLED, "cancelled"),
}


class Case:
    """One way out of one kind of run: its folders, its flow run's unique name."""

    def __init__(self, tmp_path: Path, way: str) -> None:
        self.way = way
        self.work, self.out = tmp_path / "work", tmp_path / "out"
        self.work.mkdir()
        self.name = f"way-out-{way}-{uuid4().hex[:8]}"
        self.backend = LocalKernelBackend(workdir_root=str(self.work))
        self.second_cell = WAYS[way][0]

    def sleeping(self) -> bool:
        return bool(list(self.work.rglob("sleeping.marker")))

    async def flow_run_id(self) -> UUID:
        async with get_client() as client:
            (found,) = await client.read_flow_runs(
                flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[self.name]))
            )
        return found.id

    async def stop_from_outside(self) -> None:
        """Once the second cell sleeps: the way's own stop (none for an error)."""
        if self.way == "error":
            return
        async with asyncio.timeout(180):
            while not self.sleeping():
                await asyncio.sleep(0.05)
        if self.way == "api-cancel":
            async with get_client() as client:
                await client.set_flow_run_state(await self.flow_run_id(), Cancelling())

    async def check(self) -> None:
        """The final state, summary.json and no sandbox left."""
        _, state_type, status = WAYS[self.way]
        (summary_path,) = self.out.glob("*/summary.json")
        summary = json.loads(summary_path.read_text())
        assert summary["status"] == status, summary
        async with get_client() as client:
            flow_run = await client.read_flow_run(UUID(summary["flow_run_id"]))
        assert flow_run.state is not None and flow_run.state.type == state_type, flow_run.state
        assert summary["sandbox_killed_at"] is not None
        assert [s["status"] for s in summary["stages"]][-1] == (
            "failed" if status == "failed" else "cancelled"
        )
        assert (summary_path.parent / "made.txt").read_text() == "made"
        assert await self.backend.list_sandboxes({FLOW_RUN_ID_LABEL: str(flow_run.id)}) == []


def _pipeline(case: Case) -> Any:
    return amodeling_pipeline.with_options(flow_run_name=case.name)(
        stages={"work": [MADE, case.second_cell]},
        artifacts=["made.txt"],
        backend=case.backend,
        storage=str(case.out),
        return_state=True,
    )


def _session_flow(case: Case) -> Any:
    @flow(name="way-out-session", flow_run_name=case.name)
    async def agent() -> None:
        async with sandbox_session(
            backend=case.backend, storage=str(case.out), artifacts=["made.txt"]
        ) as session:
            await session.run_cell(MADE)
            await session.run_cell(case.second_cell, raise_on_error=True)

    return agent


RUNS: dict[str, Callable[[Case], Any]] = {
    "pipeline": _pipeline,
    "session": lambda case: _session_flow(case)(return_state=True),
}


@pytest.mark.parametrize("way", ["error", "cancel", "api-cancel"])
@pytest.mark.parametrize("kind", ["pipeline", "session"])
async def test_a_run_left_by_an_error_a_cancel_or_the_apis_cancelling(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, way: str
) -> None:
    monkeypatch.setenv("PREFECT_SANDBOX_CANCEL_POLL_S", "0.5")
    case = Case(tmp_path, way)
    before = {p.pid for p in kernel_processes()}
    running = asyncio.create_task(RUNS[kind](case))
    await case.stop_from_outside()
    if way == "cancel":
        running.cancel()
    try:
        state = await running
    except BaseException as exc:  # a cancelled session's flow re-raises as Prefect does
        assert way != "error" and type(exc).__name__ in {"CancelledError", "CancelledRun"}, exc
    else:
        assert isinstance(state, State)
    await case.check()
    assert {p.pid for p in kernel_processes()} <= before


def _signal_when_sleeping(case: Case, signum: int) -> threading.Thread:
    """A thread that sends ``signum`` to this process once the case's second cell sleeps."""

    def send() -> None:
        deadline = time.monotonic() + 180
        while not case.sleeping() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signum)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    return sender


def test_a_pipelines_sync_twin_stopped_by_sigterm(tmp_path: Path) -> None:
    case = Case(tmp_path, "signal")
    # The twin takes SIGTERM only where it has its default action (`sync_twin`), as in a
    # script; the test session's own handler is put back after.
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        sender = _signal_when_sleeping(case, signal.SIGTERM)
        with pytest.raises(SystemExit) as info:
            modeling_pipeline(
                stages={"work": [MADE, SLEEPER]},
                artifacts=["made.txt"],
                backend=case.backend,
                storage=str(case.out),
            )
        sender.join()
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert info.value.code == 128 + signal.SIGTERM
    asyncio.run(case.check())


def test_a_session_flow_run_by_asyncio_run_stopped_by_sigint(tmp_path: Path) -> None:
    # asyncio.run turns SIGINT into a cancellation of its task where it has Python's handler.
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    case = Case(tmp_path, "signal")
    sender = _signal_when_sleeping(case, signal.SIGINT)
    with pytest.raises(BaseException) as info:
        asyncio.run(_session_flow(case)())
    sender.join()
    assert type(info.value).__name__ == "CancelledRun", info.value
    asyncio.run(case.check())
