"""Contract: cells run with state, outputs arrive as nbformat outputs, user errors are data."""

from __future__ import annotations

import asyncio
import base64
import json
import struct
import textwrap
from pathlib import Path

import pytest

from prefect_sandbox.sandbox.base import Sandbox
from tests.conftest import stream_text
from tests.contract.conftest import cannot


@pytest.mark.shares_sandbox
async def test_state_persists_across_cells(sandbox: Sandbox) -> None:
    await sandbox.run_cell("import math\nradius = 2")
    result = await sandbox.run_cell("print(round(math.pi * radius**2, 3))")
    assert result.status == "ok"
    assert stream_text(result.outputs) == "12.566\n"


@pytest.mark.shares_sandbox
async def test_outputs_of_each_type_arrive_in_order(sandbox: Sandbox) -> None:
    seen: list[str] = []
    code = textwrap.dedent(
        """
        import sys
        from IPython.display import display, HTML
        print("out 1")
        print("out 2")
        sys.stdout.flush()
        print("err", file=sys.stderr)
        sys.stderr.flush()
        display(HTML("<b>bold</b>"))
        {"answer": 42}
        """
    )
    result = await sandbox.run_cell(code, on_output=lambda o: seen.append(o["output_type"]))
    kinds = [o["output_type"] for o in result.outputs]
    assert kinds == ["stream", "stream", "display_data", "execute_result"]
    assert result.outputs[0] == {
        "output_type": "stream",
        "name": "stdout",
        "text": "out 1\nout 2\n",
    }
    assert result.outputs[1] == {"output_type": "stream", "name": "stderr", "text": "err\n"}
    assert result.outputs[2]["data"]["text/html"] == "<b>bold</b>"
    assert result.outputs[3]["data"]["text/plain"] == "{'answer': 42}"
    assert result.outputs[3]["execution_count"] == result.execution_count
    assert seen[-2:] == ["display_data", "execute_result"]
    assert seen.count("stream") >= 2


@pytest.mark.shares_sandbox
async def test_user_exceptions_are_data(sandbox: Sandbox) -> None:
    error = await sandbox.run_cell("raise ValueError('bad value')")
    assert error.status == "error"
    assert error.error is not None
    assert (error.error.ename, error.error.evalue) == ("ValueError", "bad value")
    assert error.outputs[-1]["output_type"] == "error"
    assert error.outputs[-1]["traceback"]
    # KeyboardInterrupt and SystemExit raised by user code are ordinary cell errors.
    interrupt = await sandbox.run_cell("raise KeyboardInterrupt")
    assert interrupt.status == "error" and not interrupt.interrupted
    assert interrupt.error is not None and interrupt.error.ename == "KeyboardInterrupt"
    system_exit = await sandbox.run_cell("raise SystemExit(3)")
    assert system_exit.status == "error"
    assert system_exit.error is not None and system_exit.error.ename == "SystemExit"
    assert stream_text((await sandbox.run_cell("print('alive')")).outputs) == "alive\n"


@pytest.mark.shares_sandbox
async def test_h20_compile_errors_and_reply_only_errors(sandbox: Sandbox) -> None:
    assert (await sandbox.run_cell("x = 1")).status == "ok"
    syntax = await sandbox.run_cell("def f(:\n    pass")
    assert syntax.error is not None and syntax.error.ename == "SyntaxError"
    assert "line 1" in syntax.error.evalue
    # H20's c3 ("    y = 2") runs in IPython, whose leading_indent transformer dedents a cell
    # before compiling; a body that really is mis-indented is an IndentationError.
    assert (await sandbox.run_cell("    y = 2")).status == "ok"
    indent = await sandbox.run_cell("if x:\ny = 3")
    assert indent.error is not None and indent.error.ename == "IndentationError"
    # ipykernel reports %not_a_magic's UsageError in execute_reply, with no iopub error message.
    magic = await sandbox.run_cell("%not_a_magic")
    assert magic.status == "error"
    assert magic.error is not None and magic.error.ename == "UsageError"
    errors = [o["ename"] for o in magic.outputs if o["output_type"] == "error"]
    assert errors == [magic.error.ename]
    after = await sandbox.run_cell("print(x)")
    assert stream_text(after.outputs) == "1\n"


@pytest.mark.shares_sandbox
async def test_ipython_syntax_magics_shell_commands_and_top_level_await(sandbox: Sandbox) -> None:
    cells = {
        "%env PREFECT_SANDBOX_MAGIC=1": "env: PREFECT_SANDBOX_MAGIC=1\n",
        "!echo from a shell": "from a shell\n",
        "import asyncio\nawait asyncio.sleep(0)\nprint('awaited')": "awaited\n",
    }
    for code, printed in cells.items():
        result = await sandbox.run_cell(code)
        assert result.status == "ok", code
        assert stream_text(result.outputs) == printed
    assert stream_text((await sandbox.run_cell("print('alive')")).outputs) == "alive\n"


@pytest.mark.shares_sandbox
async def test_h08_stdin_is_refused_at_once(sandbox: Sandbox) -> None:
    for code in ["name = input('Name: ')", "import getpass; pw = getpass.getpass()"]:
        result = await sandbox.run_cell(code, timeout_s=5)
        assert result.duration_s < 2.0
        assert result.error is not None and result.error.ename == "StdinNotImplementedError"
    cat = await sandbox.run_cell(
        "import subprocess; print(subprocess.run(['cat'], capture_output=True).returncode)",
        timeout_s=5,
    )
    assert cat.duration_s < 2.0
    assert stream_text(cat.outputs) == "0\n"
    assert stream_text((await sandbox.run_cell("print('ok')")).outputs) == "ok\n"


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


@pytest.mark.shares_sandbox
async def test_h10_figure_without_show_is_one_png(sandbox: Sandbox) -> None:
    first = await sandbox.run_cell(
        "import matplotlib.pyplot as plt; fig, ax = plt.subplots(); "
        "ax.plot([1, 2, 3], [3, 1, 2]); ax.set_title('no-show')"
    )
    images = [o for o in first.outputs if "image/png" in o.get("data", {})]
    assert len(images) == 1
    width, height = _png_size(base64.b64decode(images[0]["data"]["image/png"]))
    assert width > 0 and height > 0
    second = await sandbox.run_cell("print('x')")
    assert not [o for o in second.outputs if "image/png" in o.get("data", {})]


@pytest.mark.shares_sandbox
async def test_h12_dataframe_display_then_result(sandbox: Sandbox) -> None:
    result = await sandbox.run_cell(
        "import pandas as pd\n"
        "df = pd.DataFrame({'k': ['a', 'b', 'a'], 'v': [1, 2, 3]}).groupby('k').sum()\n"
        "display(df)\n"
        "df"
    )
    assert [o["output_type"] for o in result.outputs] == ["display_data", "execute_result"]
    assert result.outputs[1]["execution_count"] == result.execution_count is not None
    for output in result.outputs:
        assert "<table" in output["data"]["text/html"]
        assert "&lt;table" not in output["data"]["text/html"]
        lines = output["data"]["text/plain"].splitlines()
        assert [line.split() for line in lines[-2:]] == [["a", "4"], ["b", "2"]]


@pytest.mark.shares_sandbox
async def test_carriage_return_progress_is_collapsed(sandbox: Sandbox) -> None:
    result = await sandbox.run_cell(
        "import sys, time\n"
        "for i in range(5):\n"
        "    sys.stdout.write(f'\\rprogress {i * 25}%'); sys.stdout.flush(); time.sleep(0.05)\n"
        "print(' done')"
    )
    assert stream_text(result.outputs) == "progress 100% done\n"


@pytest.mark.shares_sandbox
async def test_undecodable_output_becomes_replacement_characters(sandbox: Sandbox) -> None:
    result = await sandbox.run_cell(
        "import os, time\n"
        "os.write(1, b'bad \\xff\\xfe bytes\\n'); time.sleep(0.2)\n"
        "print('lone \\udcff surrogate')"
    )
    assert result.status == "ok"
    text = stream_text(result.outputs)
    if cannot(sandbox, "fd_output"):
        assert "bad" not in text
    else:
        assert "bad \ufffd\ufffd bytes\n" in text
    assert "lone \ufffd surrogate\n" in text
    json.dumps(result.outputs, ensure_ascii=False).encode("utf-8")


START_RELEASED_THREAD = (
    "import os, threading, time\n"
    "def later(text):\n"
    "    while not os.path.exists('release_printer'):\n"
    "        time.sleep(0.02)\n"
    "    print(text, flush=True)\n"
    "threading.Thread(target=later, args=({text!r},)).start()\n"
    "print('started')"
)
"""A cell that starts a thread printing ``text`` once a file ``release_printer`` appears in the
sandbox's working folder (`release_printer`): uploaded after the cell ended, it prints while no
cell runs however slowly that cell ended (a fixed 0.2 s delay printed into the cell under load)."""


async def release_printer(sandbox: Sandbox, tmp_path: Path) -> None:
    """Upload the file `START_RELEASED_THREAD`'s thread waits for."""
    trigger = tmp_path / "release_printer"
    trigger.write_text("")
    await sandbox.upload(trigger, "release_printer")


START_WAITING_THREAD = (
    "import threading\n"
    "release = threading.Event()\n"
    "def later(text):\n"
    "    release.wait()\n"
    "    print(text, flush=True)\n"
    "printer = threading.Thread(target=later, args=({text!r},))\n"
    "printer.start()\n"
    "print('started')"
)
"""A cell that starts a thread printing ``text`` once a later cell begins with `RELEASE_THREAD`:
printed during that cell however late it starts (a fixed delay raced the next cell under load)."""

RELEASE_THREAD = "release.set(); printer.join()\n"


async def test_background_thread_output_is_recorded_once(sandbox: Sandbox, tmp_path: Path) -> None:
    # Printed while no cell runs: kept as the first cell's late output.
    first = await sandbox.run_cell(START_RELEASED_THREAD.format(text="between cells"))
    assert stream_text(first.outputs) == "started\n"
    await release_printer(sandbox, tmp_path)
    if cannot(sandbox, "late_output"):
        await asyncio.sleep(0.8)  # nothing to wait for: the output is not kept
    else:
        async with asyncio.timeout(30):
            while not (late := await sandbox.take_late_outputs()):
                await asyncio.sleep(0.05)
        assert list(late) == [first.msg_id]
        assert stream_text(late[first.msg_id]) == "between cells\n"
    second = await sandbox.run_cell("print('cell two')")
    assert stream_text(second.outputs) == "cell two\n"
    assert await sandbox.take_late_outputs() == {}
    # Printed while a later cell runs: the kernel tags it with that cell, where it is kept.
    await sandbox.run_cell(START_WAITING_THREAD.format(text="during next"))
    third = await sandbox.run_cell(RELEASE_THREAD + "print('cell four')")
    assert stream_text(third.outputs) == "during next\ncell four\n"
    assert await sandbox.take_late_outputs() == {}


@pytest.mark.shares_sandbox
async def test_msg_id_is_the_cells_execute_request_or_none(sandbox: Sandbox) -> None:
    first = await sandbox.run_cell("1")
    second = await sandbox.run_cell("2")
    if cannot(sandbox, "msg_id"):
        assert first.msg_id is None and second.msg_id is None
    else:
        assert first.msg_id and second.msg_id and first.msg_id != second.msg_id


@pytest.mark.shares_sandbox
async def test_notebook_syntax_that_public_notebooks_use(sandbox: Sandbox) -> None:
    """Top-level ``await`` with a value, ``%matplotlib inline``, ``x = !cmd``, ``%%writefile``
    and an unknown magic give what IPython gives, state kept throughout."""
    awaited = await sandbox.run_cell(
        "import asyncio\n"
        "async def answer():\n"
        "    await asyncio.sleep(0.01)\n"
        "    return 42\n"
        "r = await answer()\n"
        "r"
    )
    assert awaited.status == "ok"
    assert [o["data"]["text/plain"] for o in awaited.outputs] == ["42"]
    again = await sandbox.run_cell("await answer() + r")
    assert [o["data"]["text/plain"] for o in again.outputs] == ["84"]
    inline = await sandbox.run_cell(
        "%matplotlib inline\nimport matplotlib.pyplot as plt\nplt.plot([1, 2]);"
    )
    assert inline.status == "ok", inline.error
    assert [o["output_type"] for o in inline.outputs] == ["display_data"]
    assert "image/png" in inline.outputs[0]["data"]
    lines = await sandbox.run_cell("lines = !printf 'one\\ntwo\\n'\nlist(lines)")
    assert [o["data"]["text/plain"] for o in lines.outputs] == ["['one', 'two']"]
    written = await sandbox.run_cell("%%writefile notes.txt\nhello\n")
    assert stream_text(written.outputs) == "Writing notes.txt\n"
    read = await sandbox.run_cell("open('notes.txt').read()")
    assert [o["data"]["text/plain"] for o in read.outputs] == ["'hello\\n'"]
    unknown = await sandbox.run_cell("%timeit_not_a_magic 1")
    if cannot(sandbox, "reply_only_error") and unknown.error is None:
        assert "UsageError: Line magic function" in stream_text(unknown.outputs, "stderr")
    else:
        assert unknown.error is not None and unknown.error.ename == "UsageError"
