"""What a run stores and logs of its cells' outputs: bad outputs, old notebooks, skipped cells,
huge errors (issue 12, found cases B05, B07, B14, B17). Real flows on real local kernels."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import nbformat
import pytest

from prefect_sandbox.flows import arun_notebook

pytestmark = pytest.mark.usefixtures("prefect_api")


def _notebook(path: Path, *sources: str, tags: dict[int, list[str]] | None = None) -> Path:
    notebook = nbformat.v4.new_notebook()
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3"}
    notebook.cells = [nbformat.v4.new_code_cell(source) for source in sources]
    for index, cell_tags in (tags or {}).items():
        notebook.cells[index].metadata["tags"] = cell_tags
    nbformat.write(notebook, path)
    return path


async def _run_logs(flow_run_id: str) -> list[Any]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogHandler

    await APILogHandler.aflush()
    async with get_client() as client:
        return await client.read_logs(
            log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id]))
        )


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
    warnings = [log.message for log in await _run_logs(result.flow_run_id) if log.level == 30]
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
