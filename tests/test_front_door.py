"""The way into a run, through the CLI and the flows: parameters, stages, kernels, timeouts.

Real kernels, Prefect's real ephemeral API, the CLI as a subprocess.
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
import uuid
from pathlib import Path

import nbformat
import pytest

from prefect_sandbox.flows import amodeling_pipeline, arun_notebook
from prefect_sandbox.sandbox.errors import NotebookError
from tests.conftest import cli_usage_error, stream_text

pytestmark = pytest.mark.usefixtures("prefect_api")


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    from prefect.settings import PREFECT_API_URL

    return subprocess.run(
        [sys.executable, "-m", "prefect_sandbox.cli", *args],
        env={**os.environ, "PREFECT_API_URL": str(PREFECT_API_URL.value())},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _write(path: Path, *cells: nbformat.NotebookNode, **metadata: object) -> Path:
    notebook = nbformat.v4.new_notebook(metadata=metadata)
    notebook.cells = list(cells)
    nbformat.write(notebook, path)
    return path


def _parameters_notebook(path: Path, defaults: str, body: str) -> Path:
    return _write(
        path,
        nbformat.v4.new_code_cell(defaults, metadata={"tags": ["parameters"]}),
        nbformat.v4.new_code_cell(body),
    )


def _executed(run_dir: Path) -> nbformat.NotebookNode:
    notebook = nbformat.read(run_dir / "executed.ipynb", as_version=4)
    nbformat.validate(notebook)
    return notebook


async def _task_run_names(tag: str) -> list[str]:
    """Names of the task runs of the flow run tagged ``tag``."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterTags,
        TaskRunFilter,
        TaskRunFilterFlowRunId,
    )

    async with get_client() as client:
        (flow_run,) = await client.read_flow_runs(
            flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[tag]))
        )
        task_runs = await client.read_task_runs(
            task_run_filter=TaskRunFilter(flow_run_id=TaskRunFilterFlowRunId(any_=[flow_run.id]))
        )
    return sorted(task_run.name for task_run in task_runs)


def test_b01_nan_parameter_from_the_cli_is_a_float(tmp_path: Path) -> None:
    source = _parameters_notebook(
        tmp_path / "b01.ipynb",
        "x = 0.0",
        'import math\nprint("isnan", math.isnan(x), "isinf", math.isinf(x))',
    )
    done = _cli("run", str(source), "-p", "x=nan", "--out", "out", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    (run_dir,) = (tmp_path / "out").iterdir()
    cells = _executed(run_dir).cells
    assert cells[1].source.splitlines()[-1] == "x = float('nan')"
    assert stream_text(cells[2].outputs) == "isnan True isinf False\n"


def test_b04_keyword_parameter_name_is_refused_by_the_cli(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = _parameters_notebook(tmp_path / "b04.ipynb", "alpha = 1.0", 'print("ran")')
    out = str(tmp_path / "out")
    assert cli_usage_error(capsys, "run", str(source), "-p", "lambda=0.5", "--out", out) == (
        2,
        "prefect-sandbox: parameter name 'lambda' (in 'lambda=0.5') is a Python keyword\n",
    )
    assert not (tmp_path / "out").exists()


async def test_b02_a_date_is_injected_as_its_iso_string(tmp_path: Path) -> None:
    import numpy as np

    source = _parameters_notebook(
        tmp_path / "b02.ipynb",
        'start = "2000-01-01"\nrate = 0.1',
        "print(type(start).__name__, start)\nprint(type(rate).__name__, rate)",
    )
    result = await arun_notebook(
        notebook=str(source),
        parameters={"start": datetime.date(2019, 1, 1), "rate": np.float64(0.25)},
        storage=str(tmp_path / "out"),
    )
    assert result.status == "completed"
    cells = _executed(Path(result.output_dir)).cells
    assert stream_text(cells[2].outputs) == "str 2019-01-01\nfloat 0.25\n"


async def test_b02_a_value_with_no_literal_is_refused_before_a_sandbox_starts(
    tmp_path: Path,
) -> None:
    from prefect import tags

    source = _parameters_notebook(tmp_path / "b02.ipynb", "start = None", "print(start)")
    tag = f"refused-{uuid.uuid4().hex[:8]}"
    with tags(tag), pytest.raises(NotebookError) as info:
        await arun_notebook(
            notebook=str(source), parameters={"start": object()}, storage=str(tmp_path / "out")
        )
    assert str(info.value).startswith(
        "parameter 'start': a value of type object has no Python literal form"
    )
    assert await _task_run_names(tag) == []


async def test_b09_non_ascii_headings_make_one_task_per_stage(tmp_path: Path) -> None:
    from prefect import tags

    headings = ["数据加载", "模型训练", "结果"]
    cells = []
    for heading, code in zip(headings, ["x = 1", "y = x + 1", "print(y)"], strict=True):
        cells += [nbformat.v4.new_markdown_cell(f"# {heading}"), nbformat.v4.new_code_cell(code)]
    source = _write(tmp_path / "b09.ipynb", *cells)
    tag = f"b09-{uuid.uuid4().hex[:8]}"
    with tags(tag):
        result = await arun_notebook(notebook=str(source), storage=str(tmp_path / "out"))
    assert [(stage.name, stage.cell_count) for stage in result.stages] == [
        (heading, 1) for heading in headings
    ]
    stage_tasks = [name for name in await _task_run_names(tag) if name.startswith("run-stage")]
    assert stage_tasks == sorted(f"run-stage-{heading}" for heading in headings)
    assert stream_text(_executed(Path(result.output_dir)).cells[5].outputs) == "2\n"


def test_a_notebook_for_another_language_is_refused_by_the_cli(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    r_spec = {"name": "ir", "display_name": "R", "language": "R"}
    source = _write(tmp_path / "r.ipynb", nbformat.v4.new_code_cell("x <- 1"), kernelspec=r_spec)
    assert cli_usage_error(capsys, "run", "r.ipynb", "--out", "out") == (
        2,
        f"prefect-sandbox: notebook {source.name!r} is written for kernel 'ir' in 'R'; "
        "prefect-sandbox runs Python notebooks only\n",
    )
    assert not (tmp_path / "out").exists()


async def test_the_executed_notebook_names_the_kernel_that_ran_it(tmp_path: Path) -> None:
    old = {"name": "python3", "display_name": "Python 3.6 (old)", "language": "python"}
    source = _write(
        tmp_path / "old.ipynb",
        nbformat.v4.new_code_cell("import sys; print(sys.version_info[0])"),
        kernelspec=old,
        language_info={"name": "python", "version": "3.6.0"},
    )
    result = await arun_notebook(notebook=str(source), storage=str(tmp_path / "out"))
    metadata = _executed(Path(result.output_dir)).metadata
    assert metadata["language_info"]["version"] == platform.python_version()
    assert metadata["language_info"]["name"] == "python"
    assert metadata["kernelspec"]["language"] == "python"
    assert metadata["kernelspec"]["display_name"] != old["display_name"]
    with pytest.raises(NotebookError, match="prefect-sandbox runs Python notebooks only"):
        await arun_notebook(
            notebook=str(
                _write(
                    tmp_path / "julia.ipynb",
                    nbformat.v4.new_code_cell("x = 1"),
                    language_info={"name": "julia"},
                )
            ),
            storage=str(tmp_path / "out"),
        )


@pytest.mark.parametrize("bad", ["nan", "0", "-2", "inf"])
def test_b13_a_cell_timeout_that_is_no_duration_is_refused_by_the_cli(
    tmp_path: Path, bad: str, capsys: pytest.CaptureFixture[str]
) -> None:
    source = _write(tmp_path / "nb.ipynb", nbformat.v4.new_code_cell("x = 1"))
    out = str(tmp_path / "out")
    assert cli_usage_error(capsys, "run", str(source), "--cell-timeout", bad, "--out", out) == (
        2,
        "prefect-sandbox: --cell-timeout must be a positive number of seconds, "
        f"or -1 for no timeout; got {float(bad):g}\n",
    )
    assert not (tmp_path / "out").exists()


async def test_b13_cell_timeout_minus_one_is_no_timeout_and_zero_is_refused_up_front(
    tmp_path: Path,
) -> None:
    from prefect import tags

    result = await amodeling_pipeline(
        stages={"s": ["print('hello')"]}, storage=str(tmp_path / "out"), cell_timeout_s=-1
    )
    assert result.status == "completed"
    cells = _executed(Path(result.output_dir)).cells
    assert stream_text(cells[0].outputs) == "hello\n"
    source = _write(tmp_path / "nb.ipynb", nbformat.v4.new_code_cell("x = 1"))
    for bad in (0, -3, float("nan")):
        tag = f"b13-{uuid.uuid4().hex[:8]}"
        with tags(tag), pytest.raises(ValueError) as info:
            await amodeling_pipeline(
                stages={"s": ["print('hello')"]}, storage=str(tmp_path / "bad"), cell_timeout_s=bad
            )
        assert str(info.value).startswith("cell_timeout_s must be a positive number of seconds")
        assert await _task_run_names(tag) == []
        with pytest.raises(ValueError, match="cell_timeout_s must be a positive number"):
            await arun_notebook(
                notebook=str(source), storage=str(tmp_path / "bad"), cell_timeout_s=bad
            )
    assert not (tmp_path / "bad").exists()
