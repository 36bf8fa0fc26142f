"""The E2B backend against what E2B's code interpreter server does that other backends' do not:
an interrupt that lands late (its probes are aborted, then retried), and the template's extra
output parts. The real SDK against the emulator; the cross-backend cases are in
tests/contract/test_server_edges.py."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from prefect_sandbox.blocks.e2b import E2BBackend, E2BCredentials
from prefect_sandbox.sandbox.backends.e2b import E2BSandbox
from prefect_sandbox.sandbox.backends.kernel.local import LocalKernelConfig, LocalKernelSandbox
from prefect_sandbox.testing.e2b import E2BEmulator
from tests.conftest import stream_text

LABELS = {"prefect-sandbox": "true", "suite": "e2b-server"}


@pytest.fixture
def slow_interrupts() -> Iterator[E2BEmulator]:
    """An emulator whose interrupt lands 0.7 s after the client left: later than the backend's
    first wait (0.5 s), so its first probe reaches the kernel first and is aborted."""
    with E2BEmulator(interrupt_delay_s=0.7) as emulator:
        yield emulator


def _backend(emulator: E2BEmulator, **options: float) -> E2BBackend:
    credentials = E2BCredentials(
        api_key=emulator.api_key, api_url=emulator.url, sandbox_url=emulator.url
    )
    return E2BBackend(credentials=credentials, lifetime_s=120, **options)


@pytest.fixture
async def late_box(slow_interrupts: E2BEmulator) -> AsyncIterator[E2BSandbox]:
    sandbox = await _backend(slow_interrupts, interrupt_grace_s=5.0).create(LABELS)
    try:
        yield sandbox
    finally:
        await sandbox.kill()


async def test_an_aborted_probe_is_sent_again_and_the_state_is_kept(
    slow_interrupts: E2BEmulator, late_box: E2BSandbox
) -> None:
    await late_box.run_cell("x = 41")
    for attempt in range(3):
        sent = len([r for r in slow_interrupts.requests if r.operation == "run_code"])
        stopped = await late_box.run_cell("import time\nwhile True: time.sleep(0.1)", timeout_s=1)
        after = await late_box.run_cell("print(x + 1)")
        executions = len([r for r in slow_interrupts.requests if r.operation == "run_code"])
        assert (stopped.status, stopped.interrupted, stopped.state_lost) == (
            "timeout",
            True,
            False,
        ), attempt
        # No stray interrupt from a closed probe reaches the next cell.
        assert (after.status, stream_text(after.outputs)) == ("ok", "42\n"), attempt
        assert stopped.execution_count == after.execution_count - 1  # type: ignore[operator]
        # The cell, an aborted probe, the probe that ran, the next cell.
        assert executions - sent >= 4, attempt


async def test_the_templates_json_part_of_a_dict_or_list_reaches_the_outputs(
    e2b_emulator: E2BEmulator,
) -> None:
    sandbox = await _backend(e2b_emulator).create(LABELS)
    try:
        result = await sandbox.run_cell("display([1, 2])\n{'a': 1}")
        frame = await sandbox.run_cell("import pandas as pd\npd.DataFrame({'a': [1, 2]})")
    finally:
        await sandbox.kill()
    # The template's e2b/data part (an object, not nbformat's text) is left out.
    assert sorted(frame.outputs[0]["data"]) == ["text/html", "text/plain"]
    shown, value = result.outputs
    assert shown["data"] == {"text/plain": "[1, 2]", "application/json": [1, 2]}
    assert value["data"] == {"text/plain": "{'a': 1}", "application/json": {"a": 1}}
    assert value["metadata"] == {"application/json": {"expanded": True}}
    assert value["execution_count"] == result.execution_count == 1


async def test_the_cell_after_an_interrupt_from_outside_is_not_aborted(
    e2b_emulator: E2BEmulator,
) -> None:
    await _interrupt_from_outside_then_a_cell(e2b_emulator)


async def test_the_cell_after_a_late_interrupt_from_outside_is_not_aborted(
    slow_interrupts: E2BEmulator,
) -> None:
    # Beside two CPU burners the server's interrupt landed past the 0.5 s the next cell used
    # to wait, and that cell queued behind the stopped one, was aborted and never answered.
    await _interrupt_from_outside_then_a_cell(slow_interrupts)


async def _interrupt_from_outside_then_a_cell(emulator: E2BEmulator) -> None:
    sandbox = await _backend(emulator).create(LABELS)
    try:
        started = asyncio.Event()
        cell = asyncio.create_task(
            sandbox.run_cell(
                "x = 1\nimport time\nprint('started', flush=True)\nwhile True: time.sleep(0.1)",
                on_output=lambda _: started.set(),
            )
        )
        await asyncio.wait_for(started.wait(), 30)
        await sandbox.interrupt()
        stopped = await cell
        assert stopped.error is not None and stopped.error.ename == "KeyboardInterrupt"
        # Sent at once, it would reach the kernel before the server's interrupt and be aborted.
        after = await asyncio.wait_for(sandbox.run_cell("print(x)"), 30)
        assert (after.status, stream_text(after.outputs)) == ("ok", "1\n")
        assert after.execution_count == 2
    finally:
        await sandbox.kill()


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_PROMPT = re.compile(r"In ?\[\d+\]")


def _tracebacks(outputs: list[dict[str, Any]]) -> list[list[str]]:
    """The error outputs' name, value and traceback lines, colours and prompt numbers masked."""
    return [
        [output["ename"], output["evalue"]]
        + [_PROMPT.sub("In[N]", _ANSI.sub("", line)) for line in output["traceback"]]
        for output in outputs
        if output["output_type"] == "error"
    ]


async def test_an_errors_traceback_lines_survive_the_reply_overtaking_them(
    e2b_emulator: E2BEmulator,
) -> None:
    """The server may pass on the error that the execute_reply carries before the iopub
    messages sent ahead of it, our hook's among them (the emulator reads the shell socket
    first when both are ready): each of 60 errors still has the name, value and lines that a
    local kernel gives, including one raised while formatting the value, whose reply says
    ``NoneType: None``."""
    cells = [
        "def broken(:\n    pass",
        "def inner():\n    raise ValueError('bad')\ninner()",
        "class Unprintable:\n    def __repr__(self):\n        raise KeyError('no repr')\n"
        "Unprintable()",
    ]
    local = await LocalKernelSandbox.create(LocalKernelConfig())
    try:
        expected = [_tracebacks((await local.run_cell(cell)).outputs) for cell in cells]
    finally:
        await local.kill()
    assert all(len(tracebacks) == 1 for tracebacks in expected)
    sandbox = await _backend(e2b_emulator).create(LABELS)
    try:
        for attempt in range(20):
            for cell, want in zip(cells, expected, strict=True):
                result = await sandbox.run_cell(cell)
                assert _tracebacks(result.outputs) == want, (attempt, cell)
    finally:
        await sandbox.kill()
