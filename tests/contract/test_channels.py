"""Contract: a cell cannot reach the channels a backend talks to its kernel through (its
stdout, stdin, command pipe, result formatting): each case ends as on the local kernel
(found case C10 and its kind)."""

from __future__ import annotations

import pytest

from prefect_sandbox.sandbox.base import Sandbox
from tests.conftest import stream_text
from tests.contract.conftest import cannot


async def test_c10_a_cell_that_replaces_sys_stdout_still_fails(sandbox: Sandbox) -> None:
    result = await sandbox.run_cell(
        "import sys, io\n"
        "sys.stdout = io.StringIO()  # silence a chatty library, never restored\n"
        "import json\n"
        'settings = json.loads("{not valid json")'
    )
    assert result.status == "error"
    assert result.error is not None and result.error.ename == "JSONDecodeError"
    # The replacement stays, as in a kernel: later prints go to it, and nothing is lost.
    after = await sandbox.run_cell("print('quiet')\nsys.stdout.getvalue()")
    assert after.status == "ok" and stream_text(after.outputs) == ""
    results = [o for o in after.outputs if o["output_type"] == "execute_result"]
    assert [r["data"]["text/plain"] for r in results] == ["'quiet\\n'"]
    restored = await sandbox.run_cell("sys.stdout = sys.__stdout__\nprint('loud')")
    assert restored.status == "ok"


async def test_a_cell_whose_stdout_is_closed_still_reports(sandbox: Sandbox) -> None:
    result = await sandbox.run_cell("import sys, io\nsys.stdout = io.StringIO()\n1 / 0")
    assert result.error is not None and result.error.ename == "ZeroDivisionError"
    error = await sandbox.run_cell("sys.stderr = io.StringIO()\nraise KeyError('k')")
    assert error.error is not None and error.error.ename == "KeyError"
    value = await sandbox.run_cell("40 + 2")
    results = [o for o in value.outputs if o["output_type"] == "execute_result"]
    assert [r["data"]["text/plain"] for r in results] == ["42"]


@pytest.mark.shares_sandbox
async def test_reading_stdin_finds_its_end_and_eats_no_command(sandbox: Sandbox) -> None:
    await sandbox.run_cell("kept = 'state'")
    for read in ("sys.stdin.readline()", "sys.stdin.read()", "os.read(0, 100)"):
        result = await sandbox.run_cell(f"import os, sys\n{read}", timeout_s=20)
        assert result.status == "ok", (read, result.error)
        results = [o for o in result.outputs if o["output_type"] == "execute_result"]
        assert [r["data"]["text/plain"] for r in results] in (["''"], ["b''"]), read
    child = await sandbox.run_cell(
        "import subprocess\nsubprocess.run(['cat'], capture_output=True, timeout=10).stdout",
        timeout_s=20,
    )
    results = [o for o in child.outputs if o["output_type"] == "execute_result"]
    assert [r["data"]["text/plain"] for r in results] == ["b''"]
    after = await sandbox.run_cell("print(kept)")
    assert stream_text(after.outputs) == "state\n" and not after.state_lost


@pytest.mark.shares_sandbox
async def test_a_value_whose_repr_raises_fails_the_cell(sandbox: Sandbox) -> None:
    result = await sandbox.run_cell(
        "class Unprintable:\n"
        "    def __repr__(self):\n"
        "        raise ValueError('no repr here')\n"
        "Unprintable()"
    )
    assert result.status == "error"
    assert result.error is not None
    assert (result.error.ename, result.error.evalue) == ("ValueError", "no repr here")
    assert "__repr__" in "\n".join(result.error.traceback)
    assert not [o for o in result.outputs if o["output_type"] == "execute_result"]
    after = await sandbox.run_cell("print('next')")
    assert after.status == "ok" and stream_text(after.outputs) == "next\n"


@pytest.mark.shares_sandbox
async def test_a_display_whose_repr_raises_shows_the_error_and_goes_on(sandbox: Sandbox) -> None:
    result = await sandbox.run_cell(
        "class Unprintable:\n"
        "    def __repr__(self):\n"
        "        raise ValueError('no repr here')\n"
        "display(Unprintable())\n"
        "print('after')"
    )
    errors = [o for o in result.outputs if o["output_type"] == "error"]
    assert [(o["ename"], o["evalue"]) for o in errors] == [("ValueError", "no repr here")]
    assert stream_text(result.outputs) == "after\n"
    raised = await sandbox.run_cell("display(Unprintable())\nraise KeyError('k')")
    assert raised.status == "error"
    if cannot(sandbox, "shown_error"):
        return
    assert result.status == "ok"
    assert raised.error is not None and raised.error.ename == "KeyError"
