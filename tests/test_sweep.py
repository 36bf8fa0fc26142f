"""The sweep flow and ``prefect-sandbox sweep``: grids, branches as subflows on real kernels,
``sweep.json``, the table artifact, a failing branch, and cancellation. Prefect's real
ephemeral API; the CLI as a subprocess."""

from __future__ import annotations

import asyncio
import datetime
import inspect
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import nbformat
import pytest
from prefect.client.orchestration import PrefectClient, get_client
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterName,
    FlowRunFilterParentFlowRunId,
)
from prefect.settings import PREFECT_CLIENT_MAX_RETRIES, temporary_settings

from prefect_sandbox import LocalKernelBackend
from prefect_sandbox._compat import block_document_id
from prefect_sandbox.flows import GridError, SweepFailedError, asweep_notebook, sweep_notebook
from prefect_sandbox.flows.sweep import expand_grid, launchers, metrics_of, read_grid
from prefect_sandbox.flows.sweep.deployment import block_reference
from prefect_sandbox.testing.s3 import MotoServer
from tests.conftest import ROOT, flow_run_logs, kernel_processes
from tests.test_flows import _api_env, _cli

if TYPE_CHECKING:
    from prefect_sandbox.testing.e2b import E2BEmulator

pytestmark = pytest.mark.usefixtures("prefect_api")


def _notebook(path: Path, body: str) -> Path:
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [
        nbformat.v4.new_code_cell("x = 0\nlabel = ''", metadata={"tags": ["parameters"]}),
        nbformat.v4.new_code_cell(body),
    ]
    nbformat.write(notebook, path)
    return path


_METRICS = (
    "import json\n"
    "json.dump({'x2': x * x, 'label': label, 'nested': {'no': 1}}, open('metrics.json', 'w'))\n"
    "if x == 2:\n"
    "    raise ValueError('x may not be 2')"
)


# Grids: pure.


def test_a_list_grid_runs_as_given_and_a_mapping_grid_as_its_product() -> None:
    assert expand_grid([{"a": 1}, {"a": 2, "b": "x"}, {}]) == [{"a": 1}, {"a": 2, "b": "x"}, {}]
    assert expand_grid({"a": [1, 2], "b": ["x", "y", "z"]}) == [
        {"a": 1, "b": "x"},
        {"a": 1, "b": "y"},
        {"a": 1, "b": "z"},
        {"a": 2, "b": "x"},
        {"a": 2, "b": "y"},
        {"a": 2, "b": "z"},
    ]


@pytest.mark.parametrize(
    ("grid", "message"),
    [
        ([], "g.yaml: the grid has no parameter set"),
        ({}, "g.yaml: the grid names no parameter"),
        ("a=1", "g.yaml: a grid is a list of parameter sets or a mapping of name to a list of "),
        ([{"a": 1}, [1]], "g.yaml: entry 1: a parameter set is a mapping of name to value, not "),
        ([{"a": 1}, {"lambda": 1}], "g.yaml: entry 1: parameter name 'lambda' is a Python keyw"),
        ([{"a": object()}], "g.yaml: entry 0: parameter 'a': a value of type object has no Py"),
        ({"a": 1}, "g.yaml: parameter 'a': a mapping grid gives each name a list of values, no"),
        ({"a": []}, "g.yaml: parameter 'a': no values"),
        ({"a": [1, {2}]}, "g.yaml: parameter 'a': value 1: a value of type set has no Python l"),
        ({"a": list(range(200)), "b": list(range(60))}, "g.yaml: the product has 12000 parame"),
    ],
)
def test_a_bad_grid_names_the_source_and_entry(grid: Any, message: str) -> None:
    with pytest.raises(GridError) as info:
        expand_grid(grid, "g.yaml")
    assert str(info.value).startswith(message)
    assert isinstance(info.value, ValueError) and info.value.source == "g.yaml"


def test_grid_files_in_json_and_yaml(tmp_path: Path) -> None:
    (tmp_path / "g.yaml").write_text("train_end: [1990-12-31, '1995-12-31']\nlag: [1, 2.5]\n")
    sets = read_grid(tmp_path / "g.yaml")
    assert [str(s["train_end"]) for s in sets] == ["1990-12-31"] * 2 + ["1995-12-31"] * 2
    assert [s["lag"] for s in sets] == [1, 2.5, 1, 2.5]
    (tmp_path / "g.json").write_text('[{"a": 1}, {"a": null}]')
    assert read_grid(tmp_path / "g.json") == [{"a": 1}, {"a": None}]
    (tmp_path / "bad.json").write_text('[{"a": 1},\n {"a": }]')
    with pytest.raises(GridError, match=r"bad\.json: line 2, column 8: not valid JSON: Expect"):
        read_grid(tmp_path / "bad.json")
    (tmp_path / "bad.yml").write_text("a: [1, 2\nb: 3\n")
    with pytest.raises(GridError, match=r"bad\.yml: line 2, column 2: not valid YAML: "):
        read_grid(tmp_path / "bad.yml")
    (tmp_path / "g.txt").write_text("[]")
    with pytest.raises(GridError, match=r"g\.txt: a grid file's name ends in \.json, \.yaml"):
        read_grid(tmp_path / "g.txt")
    with pytest.raises(GridError, match=r"missing\.json: cannot be read: No such file"):
        read_grid(tmp_path / "missing.json")


@pytest.mark.parametrize(
    "text",
    [
        "a: &x [1, *x]\n",
        "&x [*x]\n",
        "a: &x {b: *x}\n",
        "a: &x [[[[2, *x]]]]\n",
        "a: &x [&y [1, *x], *y]\n",
        "- {a: &x [1, {deeper: [*x]}]}\n",
    ],
)
def test_a_yaml_value_that_contains_itself_is_a_grid_error(tmp_path: Path, text: str) -> None:
    (tmp_path / "loop.yaml").write_text(text)
    with pytest.raises(GridError, match=r"loop\.yaml: a value contains itself \(a YAML alias"):
        read_grid(tmp_path / "loop.yaml")


def test_yaml_aliases_that_share_a_value_are_kept(tmp_path: Path) -> None:
    (tmp_path / "shared.yaml").write_text("- {a: &x [1, 2], b: *x}\n- {a: *x, b: [*x, *x]}\n")
    assert read_grid(tmp_path / "shared.yaml") == [
        {"a": [1, 2], "b": [1, 2]},
        {"a": [1, 2], "b": [[1, 2], [1, 2]]},
    ]


def test_metrics_keep_top_level_scalars_only() -> None:
    assert metrics_of(b'{"mae": 0.5, "ok": true, "n": 3, "s": "hi", "d": {}, "l": [1]}') == (
        {"mae": 0.5, "ok": True, "n": 3, "s": "hi"},
        None,
    )
    assert metrics_of(b"[1, 2]") == ({}, "a JSON list, not an object")
    assert metrics_of(b"{")[1] is not None and metrics_of(b"{")[1].startswith("not JSON")  # type: ignore[union-attr]
    long = json.dumps({"k" * 500: "v" * 500}).encode()
    assert metrics_of(long)[0] == {"k" * 100: "v" * 100}


def test_the_table_caps_rows_and_metric_columns_and_keeps_its_own_columns() -> None:
    from prefect_sandbox.flows.sweep import METRIC_COLUMNS, TABLE_ROWS_SHOWN, sweep_table
    from prefect_sandbox.results import BranchResult, SweepResult

    metrics: dict[str, float | int | bool | str | None] = {
        f"m{i}": i / 3 for i in range(METRIC_COLUMNS + 2)
    }
    metrics["status"] = "forged"
    branches = [
        BranchResult(index=i, parameters={"x": i}, status="completed", metrics=metrics)
        for i in range(TABLE_ROWS_SHOWN + 5)
    ]
    result = SweepResult(
        flow_run_id="id", flow_run_name="s", status="completed", mode="subflow",
        notebook="nb.ipynb", output_dir="out", metrics_artifact="metrics.json",
        duration_s=1.0, branches=branches,
    )  # fmt: skip
    rows = sweep_table(result)
    assert len(rows) == TABLE_ROWS_SHOWN + 1
    assert rows[-1] == {"branch": "… and 5 more branch(es), all listed in sweep.json"}
    assert list(rows[1]) == [
        "branch", "flow run", "status", "parameters",
        *[f"m{i}" for i in range(METRIC_COLUMNS)], "location", "error",
    ]  # fmt: skip
    assert (rows[1]["status"], rows[1]["parameters"], rows[1]["m1"]) == (
        "completed",
        "x=1",
        "0.333333",
    )
    metrics_first = {"status": "forged", **metrics}
    branches[0] = BranchResult(index=0, parameters={}, status="failed", metrics=metrics_first)
    first = sweep_table(result.model_copy(update={"branches": branches}))[0]
    assert (first["status"], first["metric status"]) == ("failed", "forged")


def test_the_clis_table_lines_up_parameters_and_metrics_as_plain_text() -> None:
    from prefect_sandbox.flows.sweep.table import sweep_text_table
    from prefect_sandbox.results import BranchResult, SweepResult

    branches = [
        BranchResult(
            index=0, parameters={"train_end": "1990-12-31"}, status="completed",
            metrics={"mae": 0.412345678, "n": 12}, output_dir="out/s/b-0",
        ),
        BranchResult(
            index=1, parameters={"train_end": "\x1b[31m1996\x1b[0m" + "9" * 50},
            status="failed", output_dir="out/s/b-1",
        ),
    ]  # fmt: skip
    result = SweepResult(
        flow_run_id="id", flow_run_name="s", status="failed", mode="subflow",
        notebook="nb.ipynb", output_dir="out", metrics_artifact="metrics.json",
        duration_s=1.0, branches=branches,
    )  # fmt: skip
    header, first, second = sweep_text_table(result)
    assert header.split() == ["branch", "status", "parameters", "mae", "n", "folder"]
    expected = ["0", "completed", 'train_end="1990-12-31"', "0.412346", "12", "out/s/b-0"]
    assert first.split() == expected
    assert "\x1b" not in second and "…" in second
    assert second.split()[-3:] == ["-", "-", "out/s/b-1"]
    # The columns line up: each starts where its header does.
    assert first.index("0.412346") == header.index("mae")
    assert second[header.index("mae")] == "-" and first[header.index("folder") :] == "out/s/b-0"


def test_the_tables_column_names_are_plain_text_and_unique_and_its_values_escaped() -> None:
    from prefect_sandbox.flows.sweep import sweep_table
    from prefect_sandbox.results import BranchResult, SweepResult

    metrics: dict[str, float | int | bool | str | None] = {
        "mae_ppm": "a_b",
        "\x1b[31mred\x1b[0m\nline": 1,
        "error": 2,
        "metric error": 3,
        "two\tspaces": 4,
        "two spaces": 5,
    }
    result = SweepResult(
        flow_run_id="id", flow_run_name="s", status="completed", mode="subflow",
        notebook="nb.ipynb", output_dir="out", metrics_artifact="metrics.json",
        duration_s=1.0,
        branches=[BranchResult(index=0, parameters={}, status="completed", metrics=metrics)],
    )  # fmt: skip
    (row,) = sweep_table(result)
    # The UI shows column names as they are: no markdown escape may show in them.
    assert list(row)[4:10] == [
        "mae_ppm", "red line", "metric error", "metric error (2)", "two spaces", "two spaces (2)",
    ]  # fmt: skip
    assert row["mae_ppm"] == "a\\_b"  # values are markdown, escaped
    assert [row[name] for name in list(row)[5:10]] == ["1", "2", "3", "4", "5"]
    assert row["error"] == ""


def test_the_sync_twin_has_the_flows_signature() -> None:
    assert inspect.signature(sweep_notebook) == inspect.signature(asweep_notebook.fn)


# Sweeps on local kernels.


async def _table(flow_run_id: str) -> list[dict[str, str]]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    async with get_client() as client:
        artifacts = await client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )
    (table,) = [a for a in artifacts if a.key == "sweep-summary"]
    data = json.loads(str(table.data))
    assert isinstance(data, list)
    return data


async def test_a_failing_branch_stops_no_other_and_fails_the_sweep_naming_it(
    tmp_path: Path,
) -> None:
    source = _notebook(tmp_path / "nb.ipynb", _METRICS)
    with pytest.raises(SweepFailedError) as info:
        await asweep_notebook(
            notebook=str(source),
            grid=[{"x": 1}, {"x": 2}, {"x": 3, "label": "<b>bold</b> | [x](http://e.vil)"}],
            artifacts=["metrics.json"],
            storage=str(tmp_path / "out"),
        )
    (sweep_dir,) = (tmp_path / "out").iterdir()
    assert info.value.output_dir == str(sweep_dir)
    sweep = json.loads((sweep_dir / "sweep.json").read_text())
    branches = sweep["branches"]
    assert [b["status"] for b in branches] == ["completed", "failed", "completed"]
    assert sweep["status"] == "failed" and sweep["mode"] == "subflow"
    names = [b["flow_run_name"] for b in branches]
    assert names == [f"{sweep['flow_run_name']}-{i}" for i in range(3)]
    # Each branch: its own folder inside the sweep's, with its own summary and metrics.
    folders = sorted(p for p in sweep_dir.iterdir() if p.is_dir())
    assert [Path(b["output_dir"]) for b in branches] == folders
    for branch, folder in zip(branches, folders, strict=True):
        summary = json.loads((folder / "summary.json").read_text())
        assert summary["flow_run_id"] == branch["flow_run_id"]
        assert summary["status"] == branch["status"]
        assert branch["summary_stored"] is True
        assert (folder / "metrics.json").exists()
    assert [b["metrics"].get("x2") for b in branches] == [1, 4, 9]
    assert "nested" not in branches[0]["metrics"]
    assert branches[1]["parameters"] == {"x": 2}
    assert "ValueError: x may not be 2" in branches[1]["error"]
    assert branches[0]["error"] is None
    # The error names the failed branch, why, and where its partial results are.
    failed = branches[1]
    assert info.value.failed == [failed["flow_run_name"]]
    assert str(info.value).startswith(
        f"1 of 3 branch(es) did not complete: {failed['flow_run_name']} (failed: "
    )
    assert f"partial results in {failed['output_dir']})" in str(info.value)
    assert str(info.value).endswith(f"sweep.json in {sweep_dir}")
    rows = await _table(sweep["flow_run_id"])
    assert [row["status"] for row in rows] == ["completed", "failed", "completed"]
    assert [row["x2"] for row in rows] == ["1", "4", "9"]
    assert rows[1]["location"] == failed["output_dir"].replace("_", "\\_")
    # A branch's text is escaped: no HTML, link or table syntax reaches the table.
    assert rows[2]["label"] == r"&lt;b&gt;bold&lt;/b&gt; \| \[x\](http\://e.vil)"
    assert "<b>" not in json.dumps(rows)


async def test_a_retried_sweep_runs_every_branch_again_in_the_folder_it_emptied(
    tmp_path: Path,
) -> None:
    source = _notebook(tmp_path / "nb.ipynb", _METRICS)
    state = await asweep_notebook.with_options(retries=1)(
        notebook=str(source),
        grid=[{"x": 1}, {"x": 2}],
        storage=str(tmp_path / "out"),
        return_state=True,
    )
    assert state.is_failed()
    (sweep_dir,) = (tmp_path / "out").iterdir()
    sweep = json.loads((sweep_dir / "sweep.json").read_text())
    assert [b["status"] for b in sweep["branches"]] == ["completed", "failed"]
    # The first attempt's branch folders are gone: sweep.json lists all there is.
    listed = {Path(b["output_dir"]).name for b in sweep["branches"]}
    assert {p.name for p in sweep_dir.iterdir()} == {*listed, "sweep.json"}
    messages = [log.message for log in await flow_run_logs(sweep["flow_run_id"])]
    assert any(
        m.startswith("Flow run attempt 2: removed the") and str(sweep_dir) in m for m in messages
    ), messages


async def test_a_sweep_past_its_timeout_stops_its_branches_and_stores_everything(
    tmp_path: Path,
) -> None:
    from prefect.client.orchestration import get_client

    before = {p.pid for p in kernel_processes()}
    source = _notebook(
        tmp_path / "nb.ipynb",
        "import json, time\n"
        "json.dump({'x2': x * x}, open('metrics.json', 'w'))\n"
        "time.sleep(x * 600)",
    )
    state = await asweep_notebook.with_options(timeout_seconds=15)(
        notebook=str(source), grid={"x": [0, 1]}, storage=str(tmp_path / "out"), return_state=True
    )
    assert state.name == "TimedOut", state
    (sweep_dir,) = (tmp_path / "out").iterdir()
    sweep = json.loads((sweep_dir / "sweep.json").read_text())
    assert sweep["status"] == "failed"
    assert sweep["error"].startswith("timed out (the flow run's timeout_seconds, 15.0 s); ")
    sleeper = sweep["branches"][1]
    assert sleeper["status"] == "cancelled" and sleeper["summary_stored"] is True
    assert json.loads((Path(sleeper["output_dir"]) / "summary.json").read_text())["status"] == (
        "cancelled"
    )
    # No branch's flow run is left Running, and no branch's kernel is left alive.
    async with get_client() as client:
        for branch in sweep["branches"]:
            run = await client.read_flow_run(uuid.UUID(branch["flow_run_id"]))
            assert run.state is not None and run.state.is_final(), (branch, run.state)
    assert {p.pid for p in kernel_processes()} == before


async def test_a_sweep_where_every_branch_completes_returns_its_result(tmp_path: Path) -> None:
    source = _notebook(tmp_path / "nb.ipynb", _METRICS)
    result = await asweep_notebook(
        notebook=str(source), grid={"x": [3, 4]}, storage=str(tmp_path / "out")
    )
    assert result.status == "completed" and result.error is None
    # The metrics file is collected without being asked for among the artifacts.
    assert [b.metrics["x2"] for b in result.branches] == [9, 16]
    stored = json.loads((Path(result.output_dir) / "sweep.json").read_text())
    assert stored == json.loads(result.model_dump_json())


async def test_a_bad_grid_or_notebook_is_refused_before_any_branch(tmp_path: Path) -> None:
    source = _notebook(tmp_path / "nb.ipynb", "pass")
    with pytest.raises(GridError, match="grid: entry 0: parameter name 'class' is a Python"):
        await asweep_notebook(
            notebook=str(source), grid=[{"class": 1}], storage=str(tmp_path / "out")
        )
    with pytest.raises(ValueError, match="max_live_sandboxes must be 1 or more; got 0"):
        await asweep_notebook(
            notebook=str(source),
            grid=[{"x": 1}],
            max_live_sandboxes=0,
            storage=str(tmp_path / "out"),
        )
    assert not (tmp_path / "out").exists()


def test_cli_sweep_exits_1_naming_the_failed_branch_and_2_on_a_bad_grid(tmp_path: Path) -> None:
    _notebook(tmp_path / "nb.ipynb", _METRICS)
    (tmp_path / "grid.yaml").write_text("x: [1, 2]\n")
    done = _cli(
        "sweep", "nb.ipynb", "--grid", "grid.yaml", "--artifact", "metrics.json", "--out", "out",
        cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr[-3000:]
    (sweep_dir,) = (tmp_path / "out").iterdir()
    sweep = json.loads((sweep_dir / "sweep.json").read_text())
    failed = sweep["branches"][1]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(
        f"prefect-sandbox: sweep failed: 1 of 2 branch(es) did not complete: "
        f"{failed['flow_run_name']} (failed: "
    )
    assert f"partial results in {failed['output_dir']}" in last
    assert f"Stored sweep.json in {sweep_dir}" not in done.stdout
    (tmp_path / "bad.json").write_text('{"x": [1], "if": [2]}')
    bad = _cli("sweep", "nb.ipynb", "--grid", "bad.json", "--out", "out2", cwd=tmp_path)
    assert (bad.returncode, bad.stderr) == (
        2,
        "prefect-sandbox: bad.json: parameter name 'if' is a Python keyword\n",
    )
    assert not (tmp_path / "out2").exists()


def test_sigint_stops_every_branch_kills_their_sandboxes_and_stores_sweep_json(
    tmp_path: Path,
) -> None:
    import psutil

    _notebook(
        tmp_path / "nb.ipynb",
        "import time\nopen('sleeping.marker', 'w').write('1')\ntime.sleep(x)",
    )
    (tmp_path / "grid.json").write_text('{"x": [300, 301]}')
    # A short TMPDIR of its own: the kernels' socket paths, and a place to see what is left.
    tmp = Path(tempfile.mkdtemp(prefix="sweep-"))
    cli = subprocess.Popen(
        [
            sys.executable, "-m", "prefect_sandbox.cli", "sweep", "nb.ipynb",
            "--grid", "grid.json", "--out", "out",
        ],
        env={**_api_env(), "TMPDIR": str(tmp)}, cwd=tmp_path, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while len(list(tmp.rglob("sleeping.marker"))) < 2:
            assert cli.poll() is None, cli.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the branches' cells never started"
            time.sleep(0.2)
        kernels = [psutil.Process(int(p.read_text())) for p in tmp.rglob("kernel.pid")]
        assert len(kernels) == 2
        os.killpg(cli.pid, signal.SIGINT)  # as a terminal's Ctrl-C
        _, stderr = cli.communicate(timeout=120)
    finally:
        if cli.poll() is None:
            os.killpg(cli.pid, signal.SIGKILL)
            cli.wait()
    try:
        assert cli.returncode == 130, stderr[-3000:]
        last = stderr.strip().splitlines()[-1]
        assert last.startswith("prefect-sandbox: interrupted by SIGINT: sweep "), last
        (sweep_dir,) = (tmp_path / "out").iterdir()
        assert last.endswith(f"cancelled; sweep.json in {sweep_dir}")
        sweep = json.loads((sweep_dir / "sweep.json").read_text())
        assert sweep["status"] == "cancelled"
        assert [b["status"] for b in sweep["branches"]] == ["cancelled", "cancelled"]
        for branch in sweep["branches"]:
            summary = json.loads((Path(branch["output_dir"]) / "summary.json").read_text())
            assert summary["status"] == "cancelled"
            assert summary["stages"][0]["status"] == "cancelled"
        deadline = time.monotonic() + 60
        for kernel in kernels:
            while kernel.is_running() and kernel.status() != psutil.STATUS_ZOMBIE:
                assert time.monotonic() < deadline, f"{kernel.cmdline()} outlived the sweep"
                time.sleep(0.2)
        assert [p.name for p in tmp.rglob("*") if not p.is_dir()] == []
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


async def test_a_sweep_on_s3_stores_sweep_json_beside_its_branches_prefixes(
    moto: MotoServer, tmp_path: Path
) -> None:
    from prefect_aws import AwsClientParameters, AwsCredentials, S3Bucket

    from prefect_sandbox.sandbox.paths import run_folder_name

    name = f"bucket-{uuid.uuid4().hex[:12]}"
    client = moto.client()
    client.create_bucket(Bucket=name)
    credentials = AwsCredentials(
        aws_access_key_id="testing",
        aws_secret_access_key="testing-secret",
        region_name="us-east-1",
        aws_client_parameters=AwsClientParameters(endpoint_url=moto.endpoint),
    )
    bucket = S3Bucket(bucket_name=name, bucket_folder="results", credentials=credentials)
    source = _notebook(tmp_path / "nb.ipynb", _METRICS)
    with pytest.raises(SweepFailedError) as info:
        await asweep_notebook(
            notebook=str(source),
            grid={"x": [1, 2]},
            artifacts=["metrics.json"],
            storage=bucket,
        )
    keys = {item["Key"] for item in client.list_objects_v2(Bucket=name)["Contents"]}
    (sweep_key,) = [key for key in keys if key.endswith("/sweep.json")]
    sweep = json.loads(client.get_object(Bucket=name, Key=sweep_key)["Body"].read())
    prefix = (
        f"results/sweep-notebook/{run_folder_name(sweep['flow_run_name'], sweep['flow_run_id'])}"
    )
    assert sweep_key == f"{prefix}/sweep.json"
    assert info.value.output_dir == sweep["output_dir"] == f"s3://{name}/{prefix}"
    assert [b["status"] for b in sweep["branches"]] == ["completed", "failed"]
    assert [b["metrics"]["x2"] for b in sweep["branches"]] == [1, 4]
    for branch in sweep["branches"]:
        folder = run_folder_name(branch["flow_run_name"], branch["flow_run_id"])
        assert branch["output_dir"] == f"s3://{name}/{prefix}/run-notebook/{folder}"
        for stored in ("summary.json", "metrics.json", "executed.ipynb"):
            assert f"{prefix}/run-notebook/{folder}/{stored}" in keys
    assert f"partial results in {sweep['branches'][1]['output_dir']}" in str(info.value)


def _max_overlap(lives: list[tuple[datetime.datetime, datetime.datetime]]) -> int:
    """The most intervals alive at one instant (one ending as another starts: not both)."""
    events = sorted([(start, 1) for start, _ in lives] + [(end, -1) for _, end in lives])
    alive = most = 0
    for _, step in events:
        alive += step
        most = max(most, alive)
    return most


@pytest.mark.timeout(600)
async def test_four_co2_branches_on_e2b_with_a_cap_of_two(
    e2b_emulator: E2BEmulator, tmp_path: Path
) -> None:
    # The suite's twin of the twelve below, which ./dev.sh bench runs.
    await _co2_sweep_on_e2b(e2b_emulator, tmp_path, years=range(1995, 1997), cap=2)


@pytest.mark.slow
@pytest.mark.timeout(900)
async def test_twelve_co2_branches_on_e2b_with_a_cap_of_three(
    e2b_emulator: E2BEmulator, tmp_path: Path
) -> None:
    await _co2_sweep_on_e2b(e2b_emulator, tmp_path, years=range(1991, 1997), cap=3)


async def _co2_sweep_on_e2b(
    e2b_emulator: E2BEmulator, tmp_path: Path, years: range, cap: int
) -> None:
    """The CO2 notebook swept over two ``train_end`` dates a year on E2B, ``cap`` sandboxes
    alive at most: every branch's metrics stored, at most ``cap`` alive, at least two at once."""
    from prefect_sandbox import E2BBackend, E2BCredentials

    test_id = uuid.uuid4().hex
    backend = E2BBackend(
        credentials=E2BCredentials(
            api_key=e2b_emulator.api_key, api_url=e2b_emulator.url, sandbox_url=e2b_emulator.url
        ),
        metadata={"test-id": test_id},
    )
    example = ROOT / "examples" / "co2"
    train_ends = [f"{year}-{day}" for year in years for day in ("06-30", "12-31")]
    # Runs side by side on Prefect's SQLite server: the client retries its 503s as long as
    # docs/troubleshooting.md advises (a loaded run got one past the default 5 retries).
    with temporary_settings(updates={PREFECT_CLIENT_MAX_RETRIES: 12}):
        result = await asweep_notebook(
            notebook=str(example / "forecast.ipynb"),
            grid={"train_end": train_ends},
            inputs=[str(example / "co2.csv")],
            artifacts=["metrics.json", "forecast.csv"],
            backend=backend,
            storage=str(tmp_path / "out"),
            max_live_sandboxes=cap,
        )
    assert result.status == "completed", result.error
    (sweep_dir,) = (tmp_path / "out").iterdir()
    assert json.loads((sweep_dir / "sweep.json").read_text()) == json.loads(
        result.model_dump_json()
    )
    folders = sorted(p for p in sweep_dir.iterdir() if p.is_dir())
    assert len(folders) == len(train_ends)
    assert sorted(Path(b.output_dir or "") for b in result.branches) == folders
    lives = []
    for branch in result.branches:
        summary = json.loads((Path(branch.output_dir or "") / "summary.json").read_text())
        assert summary["status"] == "completed"
        lives.append(
            (
                datetime.datetime.fromisoformat(summary["sandbox_created_at"]),
                datetime.datetime.fromisoformat(summary["sandbox_killed_at"]),
            )
        )
        assert 0 < float(branch.metrics["mae_ppm"]) < 5  # type: ignore[arg-type]
    assert [b.parameters["train_end"] for b in result.branches] == train_ends
    # Never more than the cap alive at once, and the branches did run side by side.
    assert 2 <= _max_overlap(lives) <= cap, lives
    assert len({b.metrics["mae_ppm"] for b in result.branches}) > 1
    assert e2b_emulator.sandbox_ids({"test-id": test_id}) == []


async def test_deployment_mode_refuses_what_it_cannot_send_before_any_branch(
    tmp_path: Path,
) -> None:
    from prefect_sandbox import LocalKernelBackend

    source = str(_notebook(tmp_path / "nb.ipynb", "pass"))
    out = str(tmp_path / "out")
    with pytest.raises(ValueError, match="deployment 'other/x' is of flow 'other'; a sweep's b"):
        await asweep_notebook(notebook=source, grid=[{}], deployment="other/x", storage=out)
    with pytest.raises(ValueError, match="no deployment 'run-notebook/nowhere' is known to the"):
        await asweep_notebook(notebook=source, grid=[{}], deployment="nowhere", storage=out)
    with pytest.raises(ValueError, match="max_live_sandboxes is not sent to a deployment's runs"):
        await asweep_notebook(
            notebook=source, grid=[{}], deployment="x", max_live_sandboxes=2, storage=out
        )
    await _run_notebook_deployment("sweep-test")
    with pytest.raises(ValueError, match="backend must be a saved block to be sent to a deploym"):
        await asweep_notebook(
            notebook=source,
            grid=[{}],
            deployment="sweep-test",
            backend=LocalKernelBackend(),
            storage=out,
        )
    # A saved block goes by reference: a branch's parameters hold none of its fields.
    await LocalKernelBackend(env={"SECRET_ISH": "kept-out"}).save("sweep-test", overwrite=True)
    saved = await LocalKernelBackend.aload("sweep-test")
    assert block_reference(saved, "backend") == {
        "$ref": {"block_document_id": str(block_document_id(saved))}
    }


async def _run_notebook_deployment(name: str) -> None:
    """A deployment run-notebook/NAME on the session's API (no worker runs it)."""
    from prefect.client.orchestration import get_client

    from prefect_sandbox.flows import arun_notebook

    async with get_client() as client:
        flow_id = await client.create_flow_from_name(arun_notebook.name)
        await client.create_deployment(flow_id=flow_id, name=name)


async def test_the_crash_hook_kills_the_sandboxes_of_branches_still_running() -> None:
    """A sweep process that died leaves subflows marked Running and their sandboxes alive: the
    sweep's crash hook (run with nothing but the records) finds and kills them."""
    from prefect import task
    from prefect.client.orchestration import get_client
    from prefect.states import Completed, Crashed, Running

    from prefect_sandbox import LocalKernelBackend
    from prefect_sandbox.flows import arun_notebook
    from prefect_sandbox.flows.sweep import cancel_branches
    from prefect_sandbox.sandbox.labels import flow_run_labels

    @task
    def branch() -> None: ...

    backend = LocalKernelBackend()
    async with get_client() as client:
        sweep = await client.create_flow_run(asweep_notebook, state=Running())
        children = []
        for index, state in enumerate([Running(), Completed()]):
            parent = await client.create_task_run(
                branch, flow_run_id=sweep.id, dynamic_key=str(index)
            )
            children.append(
                await client.create_flow_run(
                    arun_notebook, parent_task_run_id=parent.id, state=state
                )
            )
        other = await client.create_flow_run(arun_notebook, state=Running())
    sandboxes = [
        await backend.create(flow_run_labels(str(run.id), run.name)) for run in [*children, other]
    ]
    try:
        await cancel_branches(asweep_notebook, sweep, Crashed())
    finally:
        # kill() says whether the sandbox was still alive: the running branch's was killed by
        # the hook; a finished branch's and another flow run's are none of its business.
        still_alive = [await sandbox.kill() for sandbox in sandboxes]
    assert still_alive == [False, True, True]


@pytest.mark.parametrize(
    ("given", "missing"),
    [
        ({"$ref": {"block_document_id": str(uuid.uuid4())}}, "no saved block for the reference"),
        ({"block_type_slug": "no-such-block"}, "no block type 'no-such-block' is known"),
        ("local", "a str: neither empty, a block reference"),
    ],
)
async def test_the_crash_hooks_refuse_to_guess_a_backend_they_cannot_tell(
    given: object, missing: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A hook that cannot rebuild the run's backend from its parameter kills nothing and says
    so: the default backend (a local kernel here) is not guessed, so its sandboxes live."""
    from prefect import task
    from prefect.client.orchestration import get_client
    from prefect.states import Crashed, Running

    from prefect_sandbox import LocalKernelBackend
    from prefect_sandbox.flows import arun_notebook
    from prefect_sandbox.flows.hooks import kill_run_sandboxes
    from prefect_sandbox.flows.sweep import cancel_branches
    from prefect_sandbox.sandbox.labels import flow_run_labels

    @task
    def branch() -> None: ...

    async with get_client() as client:
        run = await client.create_flow_run(
            arun_notebook, parameters={"backend": given}, state=Running()
        )
        sweep = await client.create_flow_run(
            asweep_notebook, parameters={"backend": given}, state=Running()
        )
        parent = await client.create_task_run(branch, flow_run_id=sweep.id, dynamic_key="0")
        child = await client.create_flow_run(
            arun_notebook, parent_task_run_id=parent.id, state=Running()
        )
    default = LocalKernelBackend()
    sandboxes = [await default.create(flow_run_labels(str(r.id), r.name)) for r in (run, child)]
    try:
        await kill_run_sandboxes(arun_notebook, run, Crashed())
        await cancel_branches(asweep_notebook, sweep, Crashed())
    finally:
        still_alive = [await sandbox.kill() for sandbox in sandboxes]
    assert still_alive == [True, True]
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    for flow_run in (run, sweep):
        (error,) = [e for e in errors if f"Flow run {flow_run.name} ({flow_run.id})" in e]
        assert "its sandboxes are not killed: its 'backend' parameter gives no backend" in error
        assert missing in error


async def cancel_sweep_through_the_api(notebook: Path) -> uuid.UUID:
    """Set the running sweep of ``notebook`` Cancelling, as the UI's Cancel button does.

    Returns:
        Its flow run id.
    """
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName
    from prefect.states import Cancelling

    async with get_client() as client:
        runs = await client.read_flow_runs(
            flow_filter=FlowFilter(name=FlowFilterName(any_=["sweep-notebook"]))
        )
        (run,) = [r for r in runs if r.parameters.get("notebook") == str(notebook)]
        await client.set_flow_run_state(run.id, Cancelling())
    return run.id


async def branch_run_states(sweep_id: uuid.UUID) -> list[str]:
    """The sweep's and its branches' flow runs' state types, the sweep's first."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    async with get_client() as client:
        sweep = await client.read_flow_run(sweep_id)
        children = await client.read_flow_runs(
            flow_run_filter=FlowRunFilter(
                parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[sweep_id])
            )
        )
    return [str(run.state_type.value if run.state_type else None) for run in [sweep, *children]]


async def test_a_sweep_cancelled_through_the_api_stops_its_branches_and_ends_cancelled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sweep run from plain Python has no runner to act on a Cancelling state: it notices it
    itself, cancels its subflow branches (their sandboxes killed, what they made stored) and
    ends Cancelled."""
    import asyncio

    from prefect.exceptions import CancelledRun

    from prefect_sandbox import LocalKernelBackend

    monkeypatch.setenv("PREFECT_SANDBOX_CANCEL_POLL_S", "0.5")
    source = _notebook(
        tmp_path / "nb.ipynb",
        "import time\nopen('sleeping.marker', 'w').write('1')\ntime.sleep(x)",
    )
    work = tmp_path / "work"
    sweep = asyncio.create_task(
        asweep_notebook(
            notebook=str(source),
            grid={"x": [300, 301]},
            backend=LocalKernelBackend(workdir_root=str(work)),
            storage=str(tmp_path / "out"),
        )
    )
    deadline = time.monotonic() + 120
    while len(list(work.rglob("sleeping.marker"))) < 2:
        assert not sweep.done(), sweep.exception() if sweep.done() else None
        assert time.monotonic() < deadline, "the branches' cells never started"
        await asyncio.sleep(0.2)
    sweep_id = await cancel_sweep_through_the_api(source)
    async with asyncio.timeout(120):
        with pytest.raises(CancelledRun, match=r"cancelled; sweep\.json in "):
            await sweep
    (sweep_dir,) = (tmp_path / "out").iterdir()
    stored = json.loads((sweep_dir / "sweep.json").read_text())
    assert (stored["status"], stored["flow_run_id"]) == ("cancelled", str(sweep_id))
    assert [b["status"] for b in stored["branches"]] == ["cancelled", "cancelled"]
    for branch in stored["branches"]:
        summary = json.loads((Path(branch["output_dir"]) / "summary.json").read_text())
        assert summary["status"] == "cancelled"
        assert summary["stages"][0]["status"] == "cancelled"
        assert summary["sandbox_killed_at"] is not None
    assert await branch_run_states(sweep_id) == ["CANCELLED"] * 3
    assert list(work.iterdir()) == []


async def test_subflow_branches_start_a_few_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A branch's flow run is made only when one of those starting before it holds its slot
    (or ended): with a cap of 1 and 2 starting at once, one branch runs, two wait for the
    slot, and the other three are not asked of the API yet."""
    monkeypatch.setattr(launchers, "BRANCHES_STARTING", 2)
    go = tmp_path / "go"
    notebook = _notebook(
        tmp_path / "nb.ipynb",
        f"import os, time\nwhile not os.path.exists({str(go)!r}):\n    time.sleep(0.05)\n",
    )
    sweep = asyncio.create_task(
        asweep_notebook(
            notebook=str(notebook),
            grid={"x": list(range(6))},
            backend=LocalKernelBackend(isolation="none"),
            storage=str(tmp_path / "out"),
            max_live_sandboxes=1,
            metrics_artifact=None,
        )
    )

    async def branch_runs() -> int:
        """The sweep's branch flow runs made so far (its folder is named after its run)."""
        folders = list((tmp_path / "out").glob("*"))
        if not folders:
            return 0
        name = folders[0].name.rsplit("-", 1)[0]
        async with get_client() as client:
            (sweep_run,) = await client.read_flow_runs(
                flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[name]))
            )
            children = await client.read_flow_runs(
                flow_run_filter=FlowRunFilter(
                    parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[sweep_run.id])
                )
            )
        return len(children)

    async with asyncio.timeout(120):
        while await branch_runs() < 3:
            await asyncio.sleep(0.2)
    await asyncio.sleep(2.0)  # time for more to be made, were they not held back
    assert await branch_runs() == 3
    go.touch()
    result = await sweep
    assert [branch.status for branch in result.branches] == ["completed"] * 6


async def test_a_branch_whose_flow_run_the_api_failed_to_make_is_started_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 503 that outlasts Prefect's client retries while a branch's flow run is made (SQLite
    locked, at load): nothing ran, so the branch starts again rather than being lost."""
    real = PrefectClient.create_flow_run
    refused: list[str] = []

    async def once_refused(self: PrefectClient, flow: Any, *args: Any, **kwargs: Any) -> Any:
        if flow.name == "run-notebook" and not refused:
            refused.append(flow.name)
            request = httpx.Request("POST", "http://127.0.0.1/api/flow_runs/")
            response = httpx.Response(503, request=request)
            raise httpx.HTTPStatusError("503 from the API", request=request, response=response)
        return await real(self, flow, *args, **kwargs)

    monkeypatch.setattr(PrefectClient, "create_flow_run", once_refused)
    monkeypatch.setattr(launchers, "retry_delay_s", lambda *args, **kwargs: 0.1)
    notebook = _notebook(tmp_path / "nb.ipynb", "y = x * 2")
    result = await asweep_notebook(
        notebook=str(notebook),
        grid={"x": [1, 2]},
        backend=LocalKernelBackend(isolation="none"),
        storage=str(tmp_path / "out"),
        metrics_artifact=None,
    )
    assert refused == ["run-notebook"]
    assert [branch.status for branch in result.branches] == ["completed"] * 2
