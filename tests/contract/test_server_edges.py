"""Contract (issue 19): what a vendor's server does around a cell never shows in the cell.

E2B's code interpreter releases a context before its interrupt lands (a cell sent at once is
aborted, and its stream never ends), puts environment lines before the first execution on each
connection (at create and at every restart), and passes nothing on of ``exit()``. On every
backend: a timed-out cell that stops keeps the state, every time; the first cell after create
or restart is the user's own (a cell magic works, errors name the user's lines, it is ``In[1]``);
a cell that calls ``exit()`` fails itself, even as a notebook's last cell (in test_fidelity).
"""

from __future__ import annotations

import pytest

from prefect_sandbox.sandbox.base import CellResult, Sandbox
from tests.conftest import STOPPING_GRACE_S, stream_text
from tests.contract.conftest import cannot


async def _timed_out_cells_keep_the_state(sandbox: Sandbox, times: int) -> None:
    """``times`` cells in a row time out and stop; each time the next cell finds the state."""
    await sandbox.run_cell("x = 41")
    for attempt in range(times):
        stopped = await sandbox.run_cell("import time\nwhile True: time.sleep(0.1)", timeout_s=2)
        assert (stopped.status, stopped.interrupted, stopped.state_lost) == (
            "timeout",
            True,
            False,
        ), attempt
        after = await sandbox.run_cell("print(x + 1)")
        assert (after.status, stream_text(after.outputs), after.state_lost) == (
            "ok",
            "42\n",
            False,
        ), attempt
        if after.execution_count is not None:
            # The timed-out cell kept its number and the next one follows it, as in Jupyter.
            assert stopped.execution_count == after.execution_count - 1, attempt


@pytest.mark.interrupt_grace(STOPPING_GRACE_S)
async def test_a_timed_out_cell_that_stops_keeps_the_state(sandbox: Sandbox) -> None:
    await _timed_out_cells_keep_the_state(sandbox, times=1)


@pytest.mark.slow
@pytest.mark.interrupt_grace(STOPPING_GRACE_S)
async def test_a_timed_out_cell_that_stops_keeps_the_state_ten_times_in_a_row(
    sandbox: Sandbox,
) -> None:
    # The suite's twin above races once on every submission; ./dev.sh bench races ten times.
    await _timed_out_cells_keep_the_state(sandbox, times=10)


def _ran_as_typed(result: CellResult, printed: str) -> None:
    assert (result.status, stream_text(result.outputs)) == ("ok", printed)


async def test_the_first_cell_after_create_and_after_restart_is_the_users(
    sandbox: Sandbox,
) -> None:
    for _ in range(2):
        # A cell magic works only on a cell's first line.
        if not cannot(sandbox, "ipython_shell"):
            first = await sandbox.run_cell("%%capture cap\nprint('captured')")
            _ran_as_typed(first, "")
            inputs = await sandbox.run_cell("print(cap.stdout, end='')\nprint(len(In), _i)")
            _ran_as_typed(inputs, "captured\n3 %%capture cap\nprint('captured')\n")
            assert (first.execution_count, inputs.execution_count) == (1, 2)
        written = await sandbox.run_cell("%%writefile first.txt\nwritten")
        assert written.status == "ok", written.outputs
        read = await sandbox.run_cell("print(open('first.txt').read(), end='')")
        _ran_as_typed(read, "written\n")
        # Nothing of the server's is left in the namespace.
        names = await sandbox.run_cell("print('os' in globals())")
        _ran_as_typed(names, "False\n")
        await sandbox.restart()


async def test_a_syntax_error_in_the_first_cell_names_line_1(sandbox: Sandbox) -> None:
    for _ in range(2):
        result = await sandbox.run_cell("def broken(:\n    pass")
        assert result.status == "error" and result.error is not None
        assert result.error.ename == "SyntaxError"
        where = "\n".join(result.error.traceback)
        assert "line 1" in where and "line 2" not in where, where
        raised = await sandbox.run_cell("a = 1\nraise ValueError('second line')")
        assert raised.error is not None
        assert "line 2" in "\n".join(raised.error.traceback)
        await sandbox.restart()
