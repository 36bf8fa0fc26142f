"""Contract: timeouts really stop the work, and say whether state survived."""

from __future__ import annotations

import asyncio
import time

import pytest

from prefect_sandbox.blocks.base import SandboxBackend
from prefect_sandbox.sandbox.base import Sandbox
from tests.conftest import STOPPING_GRACE_S, stream_text
from tests.contract.conftest import GRACE_S, cannot

RESTART_BUDGET_S = 30.0


@pytest.mark.interrupt_grace(STOPPING_GRACE_S)
async def test_h01_infinite_loop_is_interrupted_and_state_survives(sandbox: Sandbox) -> None:
    await sandbox.run_cell("x = 41")
    start = time.monotonic()
    result = await sandbox.run_cell("while True: pass", timeout_s=1.0)
    elapsed = time.monotonic() - start
    assert result.status == "timeout"
    assert result.interrupted and not result.state_lost
    assert 1.0 <= elapsed < 1.0 + STOPPING_GRACE_S
    assert result.error is not None and result.error.ename == "CellTimeoutError"
    assert "1.0 s" in result.error.evalue and "interrupted" in result.error.evalue
    stopped_by = "CellTimeoutError" if cannot(sandbox, "interrupt_output") else "KeyboardInterrupt"
    assert [o["ename"] for o in result.outputs if o["output_type"] == "error"] == [stopped_by]
    start = time.monotonic()
    after = await sandbox.run_cell("print(x + 1)")
    assert time.monotonic() - start < 2.0
    assert stream_text(after.outputs) == "42\n"
    assert after.status == "ok" and not after.state_lost


async def test_half_a_second_means_half_a_second(sandbox: Sandbox) -> None:
    start = time.monotonic()
    result = await sandbox.run_cell("import time; time.sleep(30)", timeout_s=0.5)
    assert result.status == "timeout" and result.interrupted
    assert 0.5 <= time.monotonic() - start < 1.5


async def test_code_that_ignores_sigint_is_stopped_by_a_restart(sandbox: Sandbox) -> None:
    await sandbox.run_cell("x = 1")
    code = (
        "import signal, time\n"
        "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        "while True: time.sleep(0.01)"
    )
    start = time.monotonic()
    result = await sandbox.run_cell(code, timeout_s=0.5)
    assert time.monotonic() - start < 0.5 + GRACE_S + 1.0 + RESTART_BUDGET_S
    assert result.status == "timeout"
    assert result.state_lost and not result.interrupted
    assert result.error is not None and "restarted" in result.error.evalue
    assert result.outputs[-1]["ename"] == "CellTimeoutError"
    after = await sandbox.run_cell("print('x' in globals())")
    assert stream_text(after.outputs) == "False\n"


async def test_code_that_swallows_keyboard_interrupt_is_still_stopped(sandbox: Sandbox) -> None:
    code = (
        "import time\n"
        "while True:\n"
        "    try:\n"
        "        time.sleep(0.01)\n"
        "    except KeyboardInterrupt:\n"
        "        pass"
    )
    start = time.monotonic()
    result = await sandbox.run_cell(code, timeout_s=0.5)
    assert time.monotonic() - start < 0.5 + GRACE_S + 1.0 + RESTART_BUDGET_S
    assert result.status == "timeout" and result.state_lost
    assert stream_text((await sandbox.run_cell("print('fresh')")).outputs) == "fresh\n"


async def test_output_never_lands_in_the_next_cell_after_a_timeout(sandbox: Sandbox) -> None:
    result = await sandbox.run_cell(
        "import time\nfor i in range(100):\n    print('tick', i, flush=True)\n    time.sleep(0.02)",
        timeout_s=0.5,
    )
    assert result.status == "timeout"
    after = await sandbox.run_cell("print('next')")
    assert after.outputs == [{"output_type": "stream", "name": "stdout", "text": "next\n"}]


async def test_invalid_timeout_is_a_value_error(sandbox: Sandbox) -> None:
    for bad in (0, -0.5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="timeout_s"):
            await sandbox.run_cell("1", timeout_s=bad)
    # nbclient's convention: -1 is no deadline.
    result = await sandbox.run_cell("print('no deadline')", timeout_s=-1)
    assert (result.status, result.outputs[0]["text"]) == ("ok", "no deadline\n")


@pytest.mark.interrupt_grace(STOPPING_GRACE_S)
async def test_timeout_in_a_worker_thread(backend: SandboxBackend, sandbox: Sandbox) -> None:
    def in_thread() -> tuple[str, float]:
        async def go() -> tuple[str, float]:
            other = await backend.attach(sandbox.handle)
            try:
                start = time.monotonic()
                result = await other.run_cell("while True: pass", timeout_s=0.5)
                return result.status, time.monotonic() - start
            finally:
                await other.close()

        return asyncio.run(go())

    status, elapsed = await asyncio.to_thread(in_thread)
    assert status == "timeout"
    assert 0.5 <= elapsed < 0.5 + STOPPING_GRACE_S


async def test_an_awaiting_cell_stops_at_its_deadline_and_stays_stopped(sandbox: Sandbox) -> None:
    """What a timed-out cell awaited never resumes in a later cell's turn (ipykernel cannot
    interrupt an await, so local kernels restart; Daytona's runner cancels it)."""
    result = await sandbox.run_cell(
        "import asyncio\nawait asyncio.sleep(2.5)\nprint('late')", timeout_s=1.0
    )
    assert result.status == "timeout" and (result.interrupted or result.state_lost)
    after = await sandbox.run_cell("import asyncio\nawait asyncio.sleep(3)\nprint('next')")
    assert after.status == "ok" and stream_text(after.outputs) == "next\n"
