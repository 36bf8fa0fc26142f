"""Contract (H03): a kernel that dies is reported at once as SandboxDiedError, never waited out."""

from __future__ import annotations

import signal
import time

import pytest

from prefect_sandbox.sandbox.base import Sandbox
from prefect_sandbox.sandbox.errors import SandboxDiedError
from tests.conftest import stream_text
from tests.contract.conftest import cannot


@pytest.mark.parametrize(
    ("code", "exit_code", "signum"),
    [
        ("import os; os._exit(1)", 1, None),
        ("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)", None, signal.SIGSEGV),
        ("exit()", 0, None),
    ],
    ids=["os._exit", "segfault", "exit()"],
)
async def test_h03_kernel_death_is_detected_within_seconds(
    sandbox: Sandbox, code: str, exit_code: int | None, signum: int | None
) -> None:
    before = await sandbox.run_cell("print('before')")
    assert stream_text(before.outputs) == "before\n"
    start = time.monotonic()
    with pytest.raises(SandboxDiedError) as info:
        await sandbox.run_cell(code, timeout_s=60)
    assert time.monotonic() - start < 10
    assert info.value.state_lost is True
    # exit() is seen everywhere, even where a kernel's exit status is not.
    seen = not cannot(sandbox, "exit_status") or code == "exit()"
    expected = (exit_code, signum) if seen else (None, None)
    assert (info.value.exit_code, info.value.signal) == expected
    assert sandbox.handle.sandbox_id in str(info.value)
    start = time.monotonic()
    with pytest.raises(SandboxDiedError):
        await sandbox.run_cell("print('after')", timeout_s=60)
    assert time.monotonic() - start < 2


async def test_restart_after_death_gives_a_fresh_kernel(sandbox: Sandbox) -> None:
    await sandbox.run_cell("x = 1")
    with pytest.raises(SandboxDiedError):
        await sandbox.run_cell("import os; os._exit(2)")
    await sandbox.restart()
    result = await sandbox.run_cell("print('x' in globals())")
    assert stream_text(result.outputs) == "False\n"
