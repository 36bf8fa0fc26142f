"""Contract (H05): huge output completes, is capped with a marker, and keeps its last line."""

from __future__ import annotations

import re

from prefect_sandbox.sandbox.base import Sandbox
from prefect_sandbox.sandbox.outputs import DEFAULT_MAX_OUTPUT_CHARS
from tests.conftest import stream_text

MIB = 1 << 20


async def test_h05_hundred_megabytes_of_stdout(sandbox: Sandbox) -> None:
    code = "import sys\nfor _ in range(100): sys.stdout.write('x' * 2**20 + '\\n')\nprint('END')"
    result = await sandbox.run_cell(code, timeout_s=60)
    assert result.status == "ok"
    text = stream_text(result.outputs)
    assert len(text) <= DEFAULT_MAX_OUTPUT_CHARS + 200
    assert text.endswith("END\n")
    assert result.output_chars == 100 * (MIB + 1) + 4
    marker = re.search(
        r"\[output truncated: (\d+) characters in all, (\d+) characters omitted\]", text
    )
    assert marker is not None
    assert int(marker.group(1)) == result.output_chars
    assert int(marker.group(2)) == result.omitted_chars > 99 * MIB
    assert text.startswith("x" * 1000)
    after = await sandbox.run_cell("print('next')")
    assert stream_text(after.outputs) == "next\n"


async def test_h11_outputs_under_the_cap_are_all_kept(sandbox: Sandbox) -> None:
    figures = await sandbox.run_cell(
        "from IPython.display import display\n"
        "for i in range(30):\n"
        "    display({'image/png': 'A' * 24000, 'text/plain': f'fig {i}'}, raw=True)",
        timeout_s=60,
    )
    assert [o["data"]["text/plain"] for o in figures.outputs] == [f"fig {i}" for i in range(30)]
    assert figures.omitted_chars == 0
    text = await sandbox.run_cell("print('x' * 700_000)\nprint('END')", timeout_s=60)
    assert stream_text(text.outputs) == "x" * 700_000 + "\nEND\n"
    assert text.omitted_chars == 0
