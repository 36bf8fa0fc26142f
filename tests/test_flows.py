"""The pipeline flows, tasks, blocks and CLI on Prefect's real ephemeral API and real kernels."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import inspect
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import nbformat
import pytest

from prefect_sandbox import LocalKernelBackend
from prefect_sandbox.flows import (
    PipelineFailedError,
    amodeling_pipeline,
    arun_notebook,
    modeling_pipeline,
    run_notebook,
)
from prefect_sandbox.sandbox.backends.kernel.local import LocalKernelConfig, LocalKernelSandbox
from prefect_sandbox.sandbox.errors import CellTimeoutError, NotebookError, SandboxDiedError
from tests.conftest import (
    ROOT,
    STOPPING_GRACE_S,
    SUBPROCESS_TEST_TIMEOUT_S,
    cli_usage_error,
    flow_run_logs,
    kernel_processes,
    run_past_a_flow_timeout,
    stream_text,
)

pytestmark = pytest.mark.usefixtures("prefect_api")


def _api_env() -> dict[str, str]:
    """This process's environment pointed at the session's Prefect API."""
    from prefect.settings import PREFECT_API_URL

    env = dict(os.environ)
    env["PREFECT_API_URL"] = str(PREFECT_API_URL.value())
    return env


def _cells(notebook_path: Path) -> list[nbformat.NotebookNode]:
    notebook = nbformat.read(notebook_path, as_version=4)
    nbformat.validate(notebook)
    return list(notebook.cells)


async def test_state_persists_across_stage_tasks(tmp_path: Path) -> None:
    result = await amodeling_pipeline(
        stages={
            "define": ["import statistics\nvalues = [3, 1, 2]"],
            "use": ["print(statistics.median(values))", "values.append(10)"],
            "check": ["print(len(values))"],
        },
        storage=str(tmp_path),
    )
    assert result.status == "completed"
    assert [(s.name, s.status, s.cell_count) for s in result.stages] == [
        ("define", "ok", 1),
        ("use", "ok", 2),
        ("check", "ok", 1),
    ]
    cells = _cells(Path(result.output_dir) / "executed.ipynb")
    assert cells[1].outputs[0]["text"] == "2\n"
    assert cells[3].outputs[0]["text"] == "4\n"
    assert [c.metadata["prefect_sandbox"]["stage"] for c in cells] == [
        "define",
        "use",
        "use",
        "check",
    ]
    assert all(c.metadata["prefect_sandbox"]["duration_s"] >= 0 for c in cells)
    assert [c.execution_count for c in cells] == [1, 2, 3, 4]
    summary = json.loads((Path(result.output_dir) / "summary.json").read_text())
    assert summary["status"] == "completed"
    # Each stage's task run waits for the one before, so Prefect draws them as a chain.
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        FlowRunFilter,
        FlowRunFilterId,
    )

    async with get_client() as client:
        task_runs = await client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[result.flow_run_id]))
        )
        artifacts = await client.read_artifacts(
            artifact_filter=ArtifactFilter(
                flow_run_id=ArtifactFilterFlowRunId(any_=[result.flow_run_id])
            )
        )
    # The progress artifact's posts go beside the stages; all are in before the run ends.
    progress = [a for a in artifacts if a.type == "progress"]
    assert [(float(str(a.data)), a.description) for a in progress] == [
        (100.0, "3 of 3 stage(s) done: check")
    ]
    stages = {run.name: run for run in task_runs if run.name.startswith("run-stage-")}
    define, use, check = (stages[f"run-stage-{name}"] for name in ("define", "use", "check"))
    assert define.task_inputs.get("wait_for", []) == []
    assert [link.id for link in use.task_inputs["wait_for"]] == [define.id]
    assert [link.id for link in check.task_inputs["wait_for"]] == [use.id]
    assert (
        await LocalKernelSandbox.list_handles(
            LocalKernelConfig(), {"prefect-flow-run-id": result.flow_run_id}
        )
        == []
    )


async def test_a_run_splits_on_the_stage_heading_level_it_is_given(tmp_path: Path) -> None:
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [
        nbformat.v4.new_markdown_cell("## Prepare"),
        nbformat.v4.new_code_cell("rows = 5"),
        nbformat.v4.new_markdown_cell("## Report"),
        nbformat.v4.new_code_cell("print(rows)"),
    ]
    path = tmp_path / "sections.ipynb"
    nbformat.write(notebook, path)
    result = await arun_notebook(str(path), storage=str(tmp_path), stage_heading_level=2)
    assert [(s.name, s.status, s.cell_count) for s in result.stages] == [
        ("prepare", "ok", 1),
        ("report", "ok", 1),
    ]


def _staged_notebook(path: Path) -> Path:
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [
        nbformat.v4.new_markdown_cell("# Prepare"),
        nbformat.v4.new_code_cell("rows = 5"),
        nbformat.v4.new_code_cell(
            "open('early.txt', 'w').write('made before')\nprint('prepared', rows)"
        ),
        nbformat.v4.new_markdown_cell("# Fit"),
        nbformat.v4.new_code_cell(
            "print('fitting')\nraise RuntimeError(f'no convergence after {rows} rows')"
        ),
        nbformat.v4.new_code_cell("print('never runs')"),
        nbformat.v4.new_markdown_cell("# Report"),
        nbformat.v4.new_code_cell("print('report')"),
    ]
    notebook.cells[1].metadata["tags"] = ["parameters"]
    nbformat.write(notebook, path)
    return path


async def test_failing_stage_stores_partial_notebook_and_artifacts(tmp_path: Path) -> None:
    source = _staged_notebook(tmp_path / "staged.ipynb")
    before = {p.pid for p in kernel_processes()}
    with pytest.raises(PipelineFailedError) as info:
        await arun_notebook(
            notebook=str(source),
            artifacts=["*.txt"],
            parameters={"rows": 12},
            storage=str(tmp_path / "out"),
        )
    error = info.value
    # The injected parameters cell sits at index 2 of the executed notebook, so the failing
    # cell is its index 5 there; it is named by its index in the notebook as written: 4.
    assert (error.stage, error.cell_index) == ("fit", 4)
    assert "RuntimeError: no convergence after 12 rows" in str(error)
    assert "'fit'" in str(error) and "cell 4" in str(error)
    out = Path(error.output_dir or "")
    assert (out / "early.txt").read_text() == "made before"
    cells = _cells(out / "executed.ipynb")
    assert [c.cell_type for c in cells].count("markdown") == 3
    assert "injected-parameters" in cells[2].metadata["tags"]
    assert cells[3].outputs[0]["text"] == "prepared 12\n"
    assert [o["output_type"] for o in cells[5].outputs] == ["stream", "error"]
    assert cells[5].outputs[1]["ename"] == "RuntimeError"
    assert cells[6].outputs == [] and cells[6].execution_count is None
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "failed"
    assert [(s["name"], s["status"]) for s in summary["stages"]] == [
        ("prepare", "ok"),
        ("fit", "failed"),
        ("report", "not_run"),
    ]
    failed = summary["stages"][1]
    assert (failed["failed_cell_index"], failed["failed_line"], failed["failed_code"]) == (
        4,
        2,
        "raise RuntimeError(f'no convergence after {rows} rows')",
    )
    assert failed["ename"] == "RuntimeError"
    stored = {a["path"]: a for a in summary["artifacts"]}
    assert set(stored) == {"early.txt", "executed.ipynb"}
    assert stored["early.txt"]["sha256"] == hashlib.sha256(b"made before").hexdigest()
    assert stored["early.txt"]["size_bytes"] == len(b"made before")
    assert {p.pid for p in kernel_processes()} == before


async def test_h01_timeout_in_a_pipeline_names_the_cell(tmp_path: Path) -> None:
    with pytest.raises(PipelineFailedError) as info:
        await amodeling_pipeline(
            stages={"loop": ["x = 41", "while True: pass", "print(x + 1)"]},
            storage=str(tmp_path),
            cell_timeout_s=1.0,
            backend=LocalKernelBackend(interrupt_grace_s=3.0),
        )
    cause = info.value.__cause__
    assert isinstance(cause, CellTimeoutError)
    assert (cause.cell_index, cause.timeout_s, cause.interrupted, cause.state_lost) == (
        1,
        1.0,
        True,
        False,
    )
    cells = _cells(Path(info.value.output_dir or "") / "executed.ipynb")
    assert cells[1].outputs[-1]["output_type"] == "error"
    assert {o.get("ename") for o in cells[1].outputs} & {"KeyboardInterrupt", "CellTimeoutError"}
    assert cells[1].metadata["prefect_sandbox"]["status"] == "timeout"


async def test_a_kernel_dying_mid_stage_is_a_new_error_raised_from_the_backends(
    tmp_path: Path,
) -> None:
    with pytest.raises(PipelineFailedError) as info:
        await amodeling_pipeline(
            stages={
                "ok": ["x = 1"],
                "die": ["print('going')", "import os; os._exit(3)", "print('never')"],
            },
            storage=str(tmp_path),
        )
    died = info.value.__cause__
    assert isinstance(died, SandboxDiedError)
    assert (died.stage, died.cell_index) == ("die", 2)
    # The backend's own error is the cause, untouched: the stage's is a new one.
    original = died.__cause__
    assert isinstance(original, SandboxDiedError) and original is not died
    assert original.stage is None and original.cell_index is None
    assert str(died) == f"stage 'die', cell 2: {original}"
    assert (died.exit_code, died.signal, died.sandbox_id) == (
        original.exit_code,
        original.signal,
        original.sandbox_id,
    )
    assert (info.value.stage, info.value.cell_index) == ("die", 2)
    # What the failing stage ran before the death is stored.
    out = Path(info.value.output_dir or "")
    cells = _cells(out / "executed.ipynb")
    assert cells[1].outputs[0]["text"] == "going\n"
    summary = json.loads((out / "summary.json").read_text())
    assert [(s["status"], s["failed_cell_index"]) for s in summary["stages"]] == [
        ("ok", None),
        ("failed", 2),
    ]


async def test_h10_inline_figure_is_stored_once_as_png(tmp_path: Path) -> None:
    result = await amodeling_pipeline(
        stages={
            "plot": [
                "import matplotlib.pyplot as plt; fig, ax = plt.subplots(); "
                "ax.plot([1, 2, 3], [3, 1, 2]); ax.set_title('no-show')",
                "print('x')",
            ]
        },
        storage=str(tmp_path),
    )
    pngs = [a for a in result.artifacts if a.path.endswith(".png")]
    assert [a.path for a in pngs] == ["inline-figures/cell-000-1.png"]
    assert Path(pngs[0].location).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


async def test_summary_shows_local_figures_inline_within_a_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    from prefect_sandbox.flows import pipeline_run

    draw = (
        "import os, matplotlib.pyplot as plt; os.makedirs('figures'); plt.plot([1, 2]); "
        "plt.savefig('figures/a.png'); plt.savefig('figures/b.png'); plt.close('all'); "
        "open('figures/c.png', 'w').write('not a png')"
    )
    first = await amodeling_pipeline(
        stages={"draw": [draw]}, artifacts=["figures/*.png"], storage=str(tmp_path / "probe")
    )
    png_bytes = next(a.size_bytes for a in first.artifacts if a.path == "figures/a.png")
    # Room for one of the two PNGs only.
    monkeypatch.setattr(pipeline_run, "INLINE_FIGURES_BYTES", png_bytes)
    result = await amodeling_pipeline(
        stages={"draw": [draw]}, artifacts=["figures/*.png"], storage=str(tmp_path / "out")
    )
    async with get_client() as client:
        artifacts = await client.read_artifacts(
            artifact_filter=ArtifactFilter(
                flow_run_id=ArtifactFilterFlowRunId(any_=[result.flow_run_id])
            )
        )
    summary = next(str(a.data) for a in artifacts if a.key == "pipeline-summary")
    stored = {a.path: a for a in result.artifacts}
    inline = Path(stored["figures/a.png"].location).read_bytes()
    assert f"![figures/a.png](data:image/png;base64,{base64.b64encode(inline).decode()})" in (
        summary
    )
    assert f"- `figures/b.png`: `{stored['figures/b.png'].location}`" in summary
    assert f"- `figures/c.png`: `{stored['figures/c.png'].location}`" in summary
    assert summary.count("data:image/png") == 1


async def test_h22_odd_names_round_trip_and_escapes_are_refused(tmp_path: Path) -> None:
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    names = ["my data (v2).csv", "données_年.csv"]
    for name in names:
        (inputs / name).write_text(f"a,b\n1,{name}\n", encoding="utf-8")
    home = tmp_path / "home"
    result = await amodeling_pipeline(
        stages={
            "write": [
                "open('résumé plot.png', 'wb').write(b'\\x89PNG\\r\\n\\x1a\\n' + bytes(100)); "
                "open('../escape.txt', 'w').write('x'); "
                "import os; os.symlink('/etc/passwd', 'link.txt')",
                "import os; print(sorted(os.listdir('.')))",
            ]
        },
        inputs=[str(inputs / name) for name in names],
        artifacts=["*"],
        backend=LocalKernelBackend(workdir_root=str(home)),
        storage=str(tmp_path / "out"),
    )
    stored = {a.path: a for a in result.artifacts}
    assert set(stored) == {*names, "résumé plot.png", "executed.ipynb"}
    for name in names:
        assert stored[name].sha256 == hashlib.sha256((inputs / name).read_bytes()).hexdigest()
    assert stored["résumé plot.png"].size_bytes == 108
    listing = _cells(Path(result.output_dir) / "executed.ipynb")[1].outputs[0]["text"]
    assert all(repr(name) in listing for name in [*names, "résumé plot.png", "link.txt"])
    out_files = {
        p.relative_to(tmp_path / "out").as_posix()
        for p in (tmp_path / "out").rglob("*")
        if p.is_file()
    }
    run = Path(result.output_dir).name
    assert out_files == {
        f"{run}/{p}" for p in [*names, "résumé plot.png", "executed.ipynb", "summary.json"]
    }
    assert not (tmp_path / "escape.txt").exists()


async def test_an_artifact_pattern_that_climbs_is_refused_before_a_sandbox_starts(
    tmp_path: Path,
) -> None:
    home = tmp_path / "home"
    with pytest.raises(ValueError, match=r"'\.\./\.\./evil\.txt' leaves the working directory"):
        await amodeling_pipeline(
            stages={"write": ["open('x', 'w').write('x')"]},
            artifacts=["*", "../../evil.txt"],
            backend=LocalKernelBackend(workdir_root=str(home)),
            storage=str(tmp_path / "out"),
        )
    assert not home.exists() or not any(home.iterdir())
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


async def test_b12_each_run_stores_in_its_own_folder_inside_storage(tmp_path: Path) -> None:
    storage = tmp_path / "out" / "inner"
    same = amodeling_pipeline.with_options(flow_run_name="nightly-report")
    first = await same(
        stages={"s": ["open('a.txt','w').write('run1'); open('b.txt','w').write('run1')"]},
        artifacts=["*.txt"],
        storage=str(storage),
    )
    second = await same(
        stages={"s": ["open('a.txt','w').write('run2')"]}, artifacts=["*.txt"], storage=str(storage)
    )
    assert first.flow_run_name == second.flow_run_name == "nightly-report"
    assert first.output_dir != second.output_dir
    for result, files in [(first, {"a.txt", "b.txt"}), (second, {"a.txt"})]:
        folder = Path(result.output_dir)
        assert folder.parent == storage and folder.name.startswith("nightly-report-")
        assert {p.name for p in folder.iterdir()} == {*files, "executed.ipynb", "summary.json"}
        assert (folder / "a.txt").read_text() == ("run1" if result is first else "run2")
        assert json.loads((folder / "summary.json").read_text())["flow_run_id"] == (
            result.flow_run_id
        )
    for name in ["../escaped", "/abs/escaped", "..", "a/../../b"]:
        odd = await amodeling_pipeline.with_options(flow_run_name=name)(
            stages={"s": ["print(1)"]}, storage=str(storage)
        )
        assert Path(odd.output_dir).parent == storage, name
    assert {p.name for p in (tmp_path / "out").iterdir()} == {"inner"}
    assert not Path("/abs/escaped").exists()


async def test_links_that_leave_an_input_folder_are_skipped_with_a_warning(
    tmp_path: Path,
) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogHandler

    outside = tmp_path / "outside"
    (outside / "etc").mkdir(parents=True)
    (outside / "etc" / "passwd").write_text("root:x:0:0")
    (outside / "id_rsa").write_text("PRIVATE KEY")
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    (data / "a.csv").write_text("a\n1\n")
    (data / "sub" / "b.txt").write_text("bee")
    (data / "alias.csv").symlink_to(data / "a.csv")
    (data / "etc").symlink_to(outside / "etc")
    (data / "sub" / "key").symlink_to(outside / "id_rsa")
    (data / "sub" / "loop").symlink_to(data)
    (data / "broken").symlink_to(tmp_path / "nowhere")
    result = await amodeling_pipeline(
        stages={
            "list": [
                "import os\n"
                "print(sorted(os.path.join(d, f) for d, _, fs in os.walk('.') for f in fs))"
            ]
        },
        inputs=[str(data)],
        storage=str(tmp_path / "out"),
    )
    listing = _cells(Path(result.output_dir) / "executed.ipynb")[0].outputs[0]["text"]
    uploaded = ["./data/a.csv", "./data/alias.csv", "./data/sub/b.txt"]
    assert listing.strip() == repr(uploaded)
    await APILogHandler.aflush()
    async with get_client() as client:
        logs = await client.read_logs(
            log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[result.flow_run_id]))
        )
    warnings = [log.message for log in logs if log.message.startswith("Input link skipped")]
    for link, why in [
        ("etc", "a link that leaves"),
        ("sub/key", "a link that leaves"),
        ("sub/loop", "a link to a folder"),
        ("broken", "a link that leaves"),
    ]:
        assert any(f"{str(data / link)!r} ({why}" in w for w in warnings), (link, warnings)
    assert len(warnings) == 4


async def test_bad_notebook_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.ipynb"
    bad.write_text("{not json")
    with pytest.raises(NotebookError, match=r"bad\.ipynb"):
        await arun_notebook(notebook=str(bad), storage=str(tmp_path))
    with pytest.raises(NotebookError, match="parameter"):
        await arun_notebook(
            notebook=str(_staged_notebook(tmp_path / "ok.ipynb")),
            parameters={"not an identifier": 1},
            storage=str(tmp_path),
        )


def test_sync_twins_match_and_run_from_plain_python(tmp_path: Path) -> None:
    assert inspect.signature(run_notebook) == inspect.signature(arun_notebook.fn)
    assert inspect.signature(modeling_pipeline) == inspect.signature(amodeling_pipeline.fn)
    result = modeling_pipeline(stages={"only": ["print(6 * 7)"]}, storage=str(tmp_path))
    assert result.status == "completed"
    cells = _cells(Path(result.output_dir) / "executed.ipynb")
    assert cells[0].outputs[0]["text"] == "42\n"


def test_blocks_register_through_the_entry_point() -> None:
    from importlib.metadata import entry_points

    assert [
        e.value for e in entry_points(group="prefect.collections") if e.name == "prefect_sandbox"
    ] == ["prefect_sandbox"]
    done = subprocess.run(
        [sys.executable, "-m", "prefect", "block", "register", "-m", "prefect_sandbox"],
        env=_api_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "Successfully registered 6 blocks" in done.stdout

    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        names = {
            slug: client.read_block_type_by_slug(slug).name
            for slug in (
                "local-kernel-sandbox",
                "e2b-sandbox",
                "e2b-credentials",
                "daytona-sandbox",
                "daytona-credentials",
                "docker-sandbox",
            )
        }
    assert names == {
        "local-kernel-sandbox": "Local Kernel Sandbox",
        "e2b-sandbox": "E2B Sandbox",
        "e2b-credentials": "E2B Credentials",
        "daytona-sandbox": "Daytona Sandbox",
        "daytona-credentials": "Daytona Credentials",
        "docker-sandbox": "Docker Sandbox",
    }


async def test_backend_block_saves_and_loads(tmp_path: Path) -> None:
    backend = LocalKernelBackend(env={"SEED": "1"}, cell_timeout_s=30)
    await backend.save("test-local", overwrite=True)
    loaded = await LocalKernelBackend.load("test-local")
    assert (loaded.env, loaded.cell_timeout_s) == ({"SEED": "1"}, 30)


def _cli(
    *args: str, cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "prefect_sandbox.cli", *args],
        env={**_api_env(), **(env or {})},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_main_job_co2_forecast_through_the_cli(tmp_path: Path) -> None:
    example = ROOT / "examples" / "co2"
    before = {p.pid for p in kernel_processes()}
    done = _cli(
        "run",
        str(example / "forecast.ipynb"),
        "--input",
        str(example / "co2.csv"),
        "--artifact",
        "figures/*.png",
        "--artifact",
        "forecast.csv",
        "--artifact",
        "metrics.json",
        "--out",
        "OUT",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (run_dir,) = (tmp_path / "OUT").iterdir()
    cells = _cells(run_dir / "executed.ipynb")
    assert all(c.execution_count for c in cells if c.cell_type == "code")
    assert len(list((run_dir / "figures").glob("*.png"))) >= 2
    assert (run_dir / "forecast.csv").read_text().startswith("date,co2_ppm,lower_95,upper_95")
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert 0 < metrics["mae_ppm"] < 2
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [s["name"] for s in summary["stages"]] == [
        "load",
        "explore",
        "model",
        "evaluate",
        "forecast",
    ]
    assert all(s["status"] == "ok" for s in summary["stages"])
    for artifact in summary["artifacts"]:
        data = (run_dir / artifact["path"]).read_bytes()
        assert (len(data), hashlib.sha256(data).hexdigest()) == (
            artifact["size_bytes"],
            artifact["sha256"],
        )
    assert {p.pid for p in kernel_processes()} == before


@pytest.mark.timeout(SUBPROCESS_TEST_TIMEOUT_S)
def test_cli_failure_exits_1_with_a_one_line_reason(tmp_path: Path) -> None:
    source = _staged_notebook(tmp_path / "staged.ipynb")
    done = _cli("run", str(source), "-p", "rows=3", "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("prefect-sandbox: pipeline failed: stage 'fit', cell 4: RuntimeError")
    assert str(tmp_path / "out") in last
    missing = _cli("run", "missing.ipynb", cwd=tmp_path)
    assert missing.returncode == 2
    assert missing.stderr.strip() == "prefect-sandbox: notebook 'missing.ipynb' is not a file"


def test_cli_usage_errors_exit_2_with_a_one_line_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    source = _staged_notebook(tmp_path / "staged.ipynb")
    usage_cases = [
        (
            ["-p", "bad"],
            "parameter 'bad' must look like NAME=VALUE (or NAME VALUE, as papermill's)",
        ),
        (["-p", "1x=3"], "parameter name '1x' (in '1x=3') is not a Python identifier"),
        (["--input", "no/such.csv"], "--input 'no/such.csv' does not exist"),
        (["--out", str(source)], f"--out {str(source)!r} is not a folder"),
        (
            ["--cell-timeout", "0"],
            "--cell-timeout must be a positive number of seconds, or -1 for no timeout; got 0",
        ),
        (["--artifact", "../x"], "--artifact path '../x' leaves the working directory"),
        (
            ["--artifact", "/etc/passwd"],
            "--artifact path '/etc/passwd' must be relative to the working directory",
        ),
    ]
    for extra, message in usage_cases:
        status, stderr = cli_usage_error(capsys, "run", str(source), *extra)
        assert (status, stderr.strip()) == (2, f"prefect-sandbox: {message}")
    (tmp_path / "notes.ipynb").write_text("just some text")
    status, stderr = cli_usage_error(capsys, "run", "notes.ipynb")
    assert status == 2
    assert stderr.startswith("prefect-sandbox: notebook 'notes.ipynb' is not a valid notebook")
    split = nbformat.v4.new_notebook()
    split.cells = [
        nbformat.v4.new_code_cell("a = 1", metadata={"tags": ["stage:A"]}),
        nbformat.v4.new_code_cell("b = 1", metadata={"tags": ["stage:B"]}),
        nbformat.v4.new_code_cell("c = 1", metadata={"tags": ["stage:A"]}),
    ]
    nbformat.write(split, tmp_path / "split.ipynb")
    status, stderr = cli_usage_error(capsys, "run", "split.ipynb")
    assert status == 2
    assert "whose cells are not consecutive" in stderr.strip().splitlines()[-1]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "notes.ipynb",
        "split.ipynb",
        "staged.ipynb",
    ]


@pytest.mark.timeout(SUBPROCESS_TEST_TIMEOUT_S)
def test_cli_failure_reason_is_last_even_with_prefects_temporary_server(tmp_path: Path) -> None:
    source = _staged_notebook(tmp_path / "staged.ipynb")
    env = {name: value for name, value in os.environ.items() if not name.startswith("PREFECT_")}
    env["PREFECT_HOME"] = str(tmp_path / "prefect-home")
    env["PREFECT_SANDBOX_LOCAL_SERVER"] = "never"  # Prefect's temporary server, not the kept one
    done = subprocess.run(
        [sys.executable, "-m", "prefect_sandbox.cli", "run", str(source), "-p", "rows=3"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1
    assert "Stopping temporary server" in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("prefect-sandbox: pipeline failed: stage 'fit', cell 4: RuntimeError")


async def test_timeout_in_a_task_on_the_thread_pool_runner(tmp_path: Path) -> None:
    from prefect import flow
    from prefect.task_runners import ThreadPoolTaskRunner

    from prefect_sandbox.sandbox.notebook import CellSpec, StageSpec
    from prefect_sandbox.tasks import create_sandbox, kill_sandbox, run_stage

    backend = LocalKernelBackend(interrupt_grace_s=STOPPING_GRACE_S)
    stage = StageSpec(name="spin", cells=[CellSpec(index=0, source="while True: pass")])

    @flow(task_runner=ThreadPoolTaskRunner(max_workers=2))
    def threaded() -> tuple[BaseException | None, float]:
        import time

        # Async tasks submitted from a sync flow run on the runner's worker threads.
        handle = create_sandbox.submit(backend, {"suite": "thread-pool"}).result()
        try:
            start = time.monotonic()
            future = run_stage.submit(backend, handle, stage, cell_timeout_s=0.5)
            try:
                future.result()
            except CellTimeoutError as exc:
                return exc, time.monotonic() - start
            return None, time.monotonic() - start
        finally:
            kill_sandbox.submit(backend, handle).result()

    error, elapsed = threaded()
    assert isinstance(error, CellTimeoutError)
    assert (error.stage, error.cell_index, error.timeout_s) == ("spin", 0, 0.5)
    assert error.interrupted and not error.state_lost
    assert elapsed < 0.5 + STOPPING_GRACE_S + 5.0


async def test_huge_output_is_capped_in_notebook_and_logs(tmp_path: Path) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    cap = 64 * 1024
    result = await amodeling_pipeline(
        stages={"flood": ["for i in range(2000): print(f'line {i} ' + 'y' * 1000)"]},
        backend=LocalKernelBackend(max_output_chars=cap),
        storage=str(tmp_path),
    )
    cell = _cells(Path(result.output_dir) / "executed.ipynb")[0]
    text = "".join(o["text"] for o in cell.outputs if o["output_type"] == "stream")
    assert len(text) < cap + 200
    assert "output truncated" in text and text.endswith("line 1999 " + "y" * 1000 + "\n")
    from prefect.logging.handlers import APILogHandler

    await APILogHandler.aflush()
    async with get_client() as client:
        logs = await client.read_logs(
            log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[result.flow_run_id]))
        )
    cell_logs = [log.message for log in logs if log.message.startswith("[flood cell 0]")]
    assert sum(len(message) for message in cell_logs) < 2 * cap
    assert any("is not logged" in message for message in cell_logs)


_LEDGER_CELL = (
    "with open('ledger.txt', 'a') as f:\n"
    "    f.write('charge\\n')\n"
    "print('charges so far:', open('ledger.txt').read().count('charge'))"
)


def test_c02_prefects_global_task_retries_never_run_a_stage_again(tmp_path: Path) -> None:
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [
        nbformat.v4.new_code_cell(_LEDGER_CELL),
        nbformat.v4.new_code_cell("raise RuntimeError('payment API said no')"),
    ]
    nbformat.write(notebook, tmp_path / "input.ipynb")
    retries = {
        "PREFECT_TASKS_DEFAULT_RETRIES": "2",
        "PREFECT_TASKS_DEFAULT_RETRY_DELAY_SECONDS": "1",
    }
    done = _cli(
        "run", "input.ipynb", "--artifact", "ledger.txt", "--out", "out", cwd=tmp_path, env=retries
    )
    assert done.returncode == 1, done.stderr[-3000:]
    log = done.stdout + done.stderr
    assert log.count("charges so far: 1") == 1 and "charges so far: 2" not in log
    assert "Retry 1/2" not in log and "AwaitingRetry" not in log
    assert "RuntimeError: payment API said no" in done.stderr.strip().splitlines()[-1]
    (run_dir,) = (tmp_path / "out").iterdir()
    assert (run_dir / "ledger.txt").read_text() == "charge\n"


def test_no_task_of_the_package_takes_prefects_global_retry_default() -> None:
    # Prefect reads PREFECT_TASKS_DEFAULT_RETRIES when a task is defined: at import.
    script = textwrap.dedent(
        """
        import importlib, json, pkgutil
        from prefect import Task
        import prefect_sandbox

        retries = {}
        for module in pkgutil.walk_packages(prefect_sandbox.__path__, "prefect_sandbox."):
            if not module.name.startswith("prefect_sandbox.testing"):
                for value in vars(importlib.import_module(module.name)).values():
                    if isinstance(value, Task):
                        retries[value.name] = value.retries
        print(json.dumps(retries))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, "PREFECT_TASKS_DEFAULT_RETRIES": "2"},
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    retries = json.loads(done.stdout)
    assert {"run-stage", "store-artifacts", "sweep-branch"} <= set(retries)
    assert set(retries.values()) == {0}, retries


async def test_a_flow_retry_gets_a_fresh_sandbox_and_an_emptied_folder(tmp_path: Path) -> None:
    before = {p.pid for p in kernel_processes()}
    state = await amodeling_pipeline.with_options(retries=1)(
        stages={
            "pay": [
                _LEDGER_CELL,
                "import uuid; open(uuid.uuid4().hex + '.txt', 'w').write('once')\n"
                "raise RuntimeError('payment API said no')",
            ]
        },
        artifacts=["*.txt"],
        storage=str(tmp_path),
        return_state=True,
    )
    assert state.is_failed()
    (run_dir,) = tmp_path.iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["attempt"], summary["status"]) == (2, "failed")
    on_disk = {p.relative_to(run_dir).as_posix() for p in run_dir.rglob("*") if p.is_file()}
    listed = {a["path"] for a in summary["artifacts"]}
    assert on_disk == {*listed, "summary.json"}
    assert len([p for p in listed if p.endswith(".txt")]) == 2  # the ledger and one other
    for artifact in summary["artifacts"]:
        data = (run_dir / artifact["path"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == artifact["sha256"]
    # The second attempt's sandbox is fresh: its ledger holds one charge.
    assert (run_dir / "ledger.txt").read_text() == "charge\n"
    assert _cells(run_dir / "executed.ipynb")[0].outputs[0]["text"] == "charges so far: 1\n"
    logs = [log.message for log in await flow_run_logs(summary["flow_run_id"])]
    started = {m.split()[1] for m in logs if m.startswith("Sandbox ") and m.endswith(" started")}
    killed = {m.split()[1] for m in logs if m.startswith("Sandbox ") and m.endswith(" killed")}
    assert len(started) == 2 and started == killed
    assert summary["sandbox_id"] in started
    assert any("removed the 4 file(s) an earlier attempt stored" in m for m in logs), logs
    assert {p.pid for p in kernel_processes()} == before


def _c04_backend(request: pytest.FixtureRequest, where: str) -> Any:
    """The backend block C04 runs on: None (the default local kernel), or a remote one against
    the session's emulator."""
    if where == "e2b":
        from prefect_sandbox import E2BBackend
        from prefect_sandbox.blocks.e2b import E2BCredentials

        emulator = request.getfixturevalue("e2b_emulator")
        credentials = E2BCredentials(
            api_key=emulator.api_key, api_url=emulator.url, sandbox_url=emulator.url
        )
        return E2BBackend(credentials=credentials, interrupt_grace_s=2.0)
    if where == "daytona":
        from prefect_sandbox import DaytonaBackend

        request.getfixturevalue("daytona_env")
        return DaytonaBackend(interrupt_grace_s=2.0)
    return None


C04_BACKENDS = ["local", "e2b", "daytona"]

C04_FLOW_TIMEOUT_S = 30
"""C04's flow timeout. Its runs start together (they wait out one timeout, not one each in
turn), so room for three sandboxes to start at once on a busy machine."""


@pytest.fixture(scope="module")
async def c04_runs(
    prefect_api: None, request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[tuple[set[int], dict[str, asyncio.Task[Any]]]]:
    """C04's `run_past_a_flow_timeout` on each of `C04_BACKENDS`, started together, by
    backend, with this process's kernel pids from before."""
    before = {p.pid for p in kernel_processes()}
    runs = {
        where: asyncio.create_task(
            run_past_a_flow_timeout(
                tmp_path_factory.mktemp(f"c04-{where}"),
                _c04_backend(request, where),
                C04_FLOW_TIMEOUT_S,
            )
        )
        for where in C04_BACKENDS
    }
    try:
        yield before, runs
    finally:
        await asyncio.wait(runs.values())


@pytest.mark.parametrize("where", C04_BACKENDS)
async def test_c04_a_flow_timeout_mid_cell_stores_everything_and_ends_timed_out(
    c04_runs: tuple[set[int], dict[str, asyncio.Task[Any]]],
    request: pytest.FixtureRequest,
    where: str,
) -> None:
    before, runs = c04_runs
    # Every run ends first: the emulators' kernels are this process's children too.
    await asyncio.wait(runs.values())
    summary, run_dir, cells = runs[where].result()
    assert summary["status"] == "failed"
    assert summary["error"] == (
        f"timed out (the flow run's timeout_seconds, {C04_FLOW_TIMEOUT_S:.1f} s) during stage "
        "'setup', cell 1; its sandbox was killed"
    )
    assert summary["sandbox_killed_at"] is not None
    assert [(s["status"], s["failed_cell_index"], s["ename"]) for s in summary["stages"]] == [
        ("failed", 1, "RunTimedOut")
    ]
    assert {a["path"] for a in summary["artifacts"]} == {"step1.txt", "executed.ipynb"}
    for artifact in summary["artifacts"]:
        data = (run_dir / artifact["path"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == artifact["sha256"]
    assert (run_dir / "step1.txt").read_text() == "done"
    assert cells[0].outputs[0]["text"] == "step 1 done\n"
    assert cells[1].outputs[-1]["ename"] == "RunTimedOut"
    assert {p.pid for p in kernel_processes()} == before
    if where != "local":
        from prefect_sandbox.sandbox.labels import FLOW_RUN_ID_LABEL

        emulator = request.getfixturevalue("e2b_emulator" if where == "e2b" else "daytona_env")
        assert emulator.sandbox_ids({FLOW_RUN_ID_LABEL: summary["flow_run_id"]}) == []


def test_artifacts_named_like_the_runs_own_files_get_free_names() -> None:
    from prefect_sandbox.flows.pipeline import own_names_kept

    paths = [
        "summary.json",
        "sandbox-summary.json",
        "inline-figures/cell-000-1.png",
        "executed.ipynb/inside.txt",
        "executed.ipynb.bak",
        "metrics.json",
        "sandbox-inline-figures",
    ]
    assert own_names_kept(paths) == {
        "summary.json": "sandbox-2-summary.json",
        "inline-figures/cell-000-1.png": "sandbox-2-inline-figures/cell-000-1.png",
        "executed.ipynb/inside.txt": "sandbox-executed.ipynb/inside.txt",
    }
    assert own_names_kept(["summary.json", "sandbox-summary.json/z"]) == {
        "summary.json": "sandbox-2-summary.json"
    }


async def test_c05_an_artifact_named_like_the_runs_own_files_is_kept_under_another_name(
    tmp_path: Path,
) -> None:
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [
        nbformat.v4.new_code_cell(
            "import json, os\n"
            "json.dump({'rmse': 0.42, 'model': 'ridge'}, open('summary.json', 'w'))\n"
            "json.dump({'mae': 0.3}, open('metrics.json', 'w'))\n"
            "open('sandbox-summary.json', 'w').write('{}')\n"
            "open('executed.ipynb', 'w').write('my own notebook')\n"
            "os.makedirs('inline-figures')\n"
            "open('inline-figures/cell-000-1.png', 'w').write('my own figure')\n"
            "import matplotlib.pyplot as plt; plt.plot([1, 2]); plt.show()\n"
            "print('wrote my summary')"
        )
    ]
    nbformat.write(notebook, tmp_path / "input.ipynb")
    result = await arun_notebook(
        notebook=str(tmp_path / "input.ipynb"),
        artifacts=["*.json", "*.ipynb", "inline-figures/*"],
        storage=str(tmp_path / "out"),
    )
    run_dir = Path(result.output_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["flow_run_id"] == result.flow_run_id and "rmse" not in summary
    assert json.loads((run_dir / "sandbox-2-summary.json").read_text())["rmse"] == 0.42
    assert (run_dir / "sandbox-summary.json").read_text() == "{}"
    assert (run_dir / "sandbox-executed.ipynb").read_text() == "my own notebook"
    assert (run_dir / "sandbox-inline-figures/cell-000-1.png").read_text() == "my own figure"
    assert (run_dir / "inline-figures/cell-000-1.png").read_bytes()[:4] == b"\x89PNG"
    assert stream_text(_cells(run_dir / "executed.ipynb")[0].outputs) == "wrote my summary\n"
    listed = [a["path"] for a in summary["artifacts"]]
    assert len(listed) == len(set(listed))
    on_disk = {p.relative_to(run_dir).as_posix() for p in run_dir.rglob("*") if p.is_file()}
    assert on_disk == {*listed, "summary.json"}
    for artifact in summary["artifacts"]:
        data = (run_dir / artifact["path"]).read_bytes()
        assert (len(data), hashlib.sha256(data).hexdigest()) == (
            artifact["size_bytes"],
            artifact["sha256"],
        )
    warnings = [log.message for log in await flow_run_logs(result.flow_run_id) if log.level == 30]
    assert any(
        w.startswith("Artifact 'summary.json' is stored as 'sandbox-2-summary.json'")
        for w in warnings
    ), warnings


async def test_inputs_that_would_land_on_one_path_are_refused_before_a_sandbox_starts(
    tmp_path: Path,
) -> None:
    for folder in ["a", "b"]:
        (tmp_path / folder / "data").mkdir(parents=True)
        (tmp_path / folder / "data" / "x.csv").write_text(folder)
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "data").write_text("a file named like the folder")
    before = {p.pid for p in kernel_processes()}
    cases = {
        (str(tmp_path / "a" / "data"), str(tmp_path / "b" / "data")): (
            f"inputs {str(tmp_path / 'a' / 'data')!r} (its 'data/x.csv') and "
            f"{str(tmp_path / 'b' / 'data')!r} (its 'data/x.csv') would both land on "
            "'data/x.csv' in the sandbox"
        ),
        (str(tmp_path / "a" / "data"), str(tmp_path / "c" / "data")): (
            f"inputs {str(tmp_path / 'c' / 'data')!r} and {str(tmp_path / 'a' / 'data')!r} "
            "(its 'data/x.csv') clash in the sandbox: 'data' would be a file and the folder "
            "of 'data/x.csv'"
        ),
    }
    for index, (inputs, message) in enumerate(cases.items()):
        with pytest.raises(PipelineFailedError) as info:
            await amodeling_pipeline(
                stages={"s": ["print('never runs')"]},
                inputs=list(inputs),
                storage=str(tmp_path / f"out{index}"),
            )
        assert str(info.value) == message
        summary = json.loads((Path(info.value.output_dir or "") / "summary.json").read_text())
        assert (summary["status"], summary["error"], summary["sandbox_id"]) == (
            "failed",
            message,
            None,
        )
        assert [s["status"] for s in summary["stages"]] == ["not_run"]
    assert {p.pid for p in kernel_processes()} == before


async def test_a_task_timeout_on_run_stage_leaves_the_sandbox_to_its_flow(tmp_path: Path) -> None:
    from prefect import flow

    from prefect_sandbox.sandbox.notebook import CellSpec, StageSpec
    from prefect_sandbox.tasks import create_sandbox, download_artifacts, kill_sandbox, run_stage
    from prefect_sandbox.tasks.sandbox import partial_stage_result, stage_progress

    backend = LocalKernelBackend()
    stage = StageSpec(
        name="slow",
        cells=[
            CellSpec(index=0, source="open('early.txt', 'w').write('kept'); print('early')"),
            CellSpec(index=1, source="import time; print('sleeping', flush=True); time.sleep(600)"),
        ],
    )
    before = {p.pid for p in kernel_processes()}

    @flow
    async def mine() -> tuple[str | None, Any, list[str], bool, Any]:
        handle = await create_sandbox(backend, {"suite": "task-timeout"})
        try:
            with stage_progress() as progress:
                state = await run_stage.with_options(timeout_seconds=10)(
                    backend, handle, stage, return_state=True
                )
            try:
                await state.result()
            except BaseException as exc:
                error: BaseException | None = exc
            else:
                error = None
            assert error is not None
            partial = partial_stage_result(error, progress)
            downloaded = await download_artifacts(backend, handle, ["*.txt"], str(tmp_path))
            # The timed-out cell was interrupted: the kernel runs the next stage at once.
            after = await run_stage(backend, handle, next_stage, cell_timeout_s=30)
        finally:
            killed = await kill_sandbox(backend, handle)
        return state.name, partial, downloaded, killed, after

    next_stage = StageSpec(name="next", cells=[CellSpec(index=2, source="print('next')")])
    name, partial, downloaded, killed, after = await mine()
    assert name == "TimedOut"
    assert downloaded == ["early.txt"] and killed
    assert partial is not None and partial.status == "failed"
    assert partial.cells[-1].result.error.ename == "RunTimedOut"
    # What the stopped cell printed before the timeout is kept.
    assert partial.cells[-1].result.outputs[0]["text"] == "sleeping\n"
    assert after.status == "ok" and after.cells[0].result.outputs[0]["text"] == "next\n"
    assert {p.pid for p in kernel_processes()} == before
