"""Contract (issue 12): outputs match Jupyter's, and a cell's error reads well wherever it is
copied, on every backend."""

from __future__ import annotations

from prefect_sandbox.sandbox.base import Sandbox
from prefect_sandbox.sandbox.outputs import ERROR_TEXT_CHARS, TRACEBACK_CHARS


async def test_b17_error_text_is_capped_and_names_the_failing_line(sandbox: Sandbox) -> None:
    line = "raise ValueError('bad row: ' + 'E' * 100_000 + ' :end')"
    result = await sandbox.run_cell(f"x = 1\n{line}", timeout_s=60)
    assert result.status == "error" and result.error is not None
    (output,) = [o for o in result.outputs if o["output_type"] == "error"]
    assert output["evalue"] == "bad row: " + "E" * 100_000 + " :end"
    evalue = result.error.evalue
    assert len(evalue) <= ERROR_TEXT_CHARS
    assert evalue.startswith("bad row: EEE") and evalue.endswith("EEE :end")
    assert f"[{len(output['evalue'])} characters," in evalue
    traceback = "\n".join(result.error.traceback)
    assert len(traceback) <= TRACEBACK_CHARS
    assert line in traceback and "\x1b" not in traceback
