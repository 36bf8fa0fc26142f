"""Contract (H05): huge output completes, is capped with a marker, and keeps its last line."""

from __future__ import annotations

import re

from prefect_sandbox.sandbox.base import Sandbox
from prefect_sandbox.sandbox.outputs import DEFAULT_MAX_OUTPUT_BYTES
from tests.conftest import stream_text

MIB = 1 << 20


async def test_h05_hundred_megabytes_of_stdout(sandbox: Sandbox) -> None:
    code = "import sys\nfor _ in range(100): sys.stdout.write('x' * 2**20 + '\\n')\nprint('END')"
    result = await sandbox.run_cell(code, timeout_s=60)
    assert result.status == "ok"
    text = stream_text(result.outputs)
    assert len(text) <= DEFAULT_MAX_OUTPUT_BYTES + 200
    assert text.endswith("END\n")
    assert result.output_bytes == 100 * (MIB + 1) + 4
    marker = re.search(r"\[output truncated: (\d+) bytes in all, (\d+) bytes omitted\]", text)
    assert marker is not None
    assert int(marker.group(1)) == result.output_bytes
    assert int(marker.group(2)) == result.omitted_bytes > 99 * MIB
    assert text.startswith("x" * 1000)
    after = await sandbox.run_cell("print('next')")
    assert stream_text(after.outputs) == "next\n"
