"""Contract: a process that holds the kernel's sockets (a forked copy of it) never costs a cell
what it printed, nor the run its outputs (found case C09)."""

from __future__ import annotations

import psutil

from prefect_sandbox.sandbox.base import Sandbox
from tests.conftest import stream_text

# C09: the child falls through the cell as a second copy of the kernel; the parent waits for it.
FORK_CELL = (
    "import os\n"
    'value = "parent"\n'
    "child = os.fork()\n"
    "if child == 0:\n"
    '    value = "child"\n'
    '    print("child says", value, flush=True)\n'
    "else:\n"
    "    os.wait()\n"
    '    print("parent done waiting")'
)
EXITING_FORK_CELL = (
    "import os, sys\n"
    "child = os.fork()\n"
    "if child == 0:\n"
    '    print("in child", flush=True)\n'
    "    sys.exit(0)\n"
    "_, status = os.waitpid(child, 0)\n"
    'print("parent saw child exit", status)'
)


async def forked_child(sandbox: Sandbox) -> psutil.Process:
    """Run `FORK_CELL` into its timeout; the child it left, for a sandbox on this machine
    whose processes share our process IDs."""
    result = await sandbox.run_cell(FORK_CELL, timeout_s=2.0)
    assert result.status == "timeout" and not result.state_lost
    pid = await sandbox.run_cell("print(child)")
    return psutil.Process(int(stream_text(pid.outputs)))


async def _ends_as_the_kernels_cell(sandbox: Sandbox, code: str, printed: str) -> None:
    result = await sandbox.run_cell(code, timeout_s=3.0)
    # The parent blocks on its child, so the cell times out; the child never ends it early.
    assert result.status == "timeout", result
    assert result.interrupted or result.state_lost
    assert printed in stream_text(result.outputs)
    assert "parent" not in stream_text(result.outputs)
    after = await sandbox.run_cell('print("next cell:", value, child > 0)')
    if result.state_lost:
        # The interrupt did not land in time (a busy machine) and the kernel was restarted:
        # it answers the next cell, with none of the state.
        assert after.error is not None and after.error.ename == "NameError", after
    else:
        assert after.status == "ok"
        assert stream_text(after.outputs) == "next cell: parent True\n"


async def test_c09_a_forked_child_keeps_what_it_printed(sandbox: Sandbox) -> None:
    await _ends_as_the_kernels_cell(sandbox, FORK_CELL, "child says child\n")


async def test_c09_a_forked_child_that_calls_sys_exit(sandbox: Sandbox) -> None:
    await sandbox.run_cell('value = "parent"')
    await _ends_as_the_kernels_cell(sandbox, EXITING_FORK_CELL, "in child\n")


async def test_a_forked_child_stops_where_its_cell_ends(sandbox: Sandbox) -> None:
    """The child that ran off the end of its cell neither answers for the kernel nor spins:
    it is stopped, and the kernel goes on running cells."""
    result = await sandbox.run_cell(FORK_CELL, timeout_s=2.0)
    assert result.status == "timeout"
    if result.state_lost:
        return
    state = await sandbox.run_cell(
        "import time\n"
        "for _ in range(100):\n"
        "    with open(f'/proc/{child}/stat') as stat:\n"
        "        state = stat.read().rsplit(')', 1)[1].split()[0]\n"
        "    if state == 'T':\n"
        "        break\n"
        "    time.sleep(0.05)\n"
        "print(state)"
    )
    assert stream_text(state.outputs) == "T\n"
    for number in range(3):
        again = await sandbox.run_cell(f"print({number})")
        assert stream_text(again.outputs) == f"{number}\n"
