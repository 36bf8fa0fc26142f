"""The CLI and the flows from plain Python, as a user starts them: subprocesses with their own
Prefect API (a temporary server, or none reachable), real kernels."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from prefect_sandbox.sandbox.outputs import strip_ansi
from tests.conftest import SUBPROCESS_TEST_TIMEOUT_S, python_stdout

ROOT = Path(__file__).resolve().parent.parent

SERVER_DELAY_S = 25
"""How long the temporary API server's process sleeps before it starts: past Prefect's default
start-up allowance (20 s), within ours (90 s)."""

_SLOW_SERVER = f"""
import sys, time
from pathlib import Path
# Only the temporary API server's process (python -m uvicorn ... prefect.server.api.server).
if any("prefect.server.api.server" in arg for arg in sys.orig_argv):
    Path(__file__).with_name("server-delayed").touch()
    time.sleep({SERVER_DELAY_S})
"""


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """This process's environment without a Prefect API or a startup setting, its own Prefect
    home (a fresh database), plus ``extra``."""
    env = {
        name: value
        for name, value in os.environ.items()
        if name not in ("PREFECT_API_URL", "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS")
        and (not name.startswith("PREFECT_SANDBOX_") or name == "PREFECT_SANDBOX_LOCAL_SERVER")
    }
    return {**env, "PREFECT_HOME": str(tmp_path / "prefect-home"), **extra}


def _notebook(path: Path) -> Path:
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [
        nbformat.v4.new_code_cell(
            "greeting = 'hi'  # what to say", metadata={"tags": ["parameters"]}
        ),
        nbformat.v4.new_code_cell("print(greeting * 2)"),
    ]
    nbformat.write(notebook, path)
    return path


@pytest.mark.timeout(SUBPROCESS_TEST_TIMEOUT_S)
def test_a_flow_from_plain_python_waits_for_a_slow_temporary_server(tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_SLOW_SERVER)
    notebook = _notebook(tmp_path / "hello.ipynb")
    script = (
        "from prefect_sandbox.flows import run_notebook\n"
        f"result = run_notebook(notebook={str(notebook)!r}, storage={str(tmp_path / 'out')!r})\n"
        "print('STORED', result.output_dir)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        env=_env(tmp_path, PYTHONPATH=str(site)),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (site / "server-delayed").exists(), "the temporary server did not start slowly"
    run_dir = Path(done.stdout.split("STORED ", 1)[1].strip())
    executed = nbformat.read(run_dir / "executed.ipynb", as_version=4)
    assert executed.cells[-1].outputs[0]["text"] == "hihi\n"


def _startup_allowance(tmp_path: Path, **env: str) -> str:
    """Prefect's start-up allowance once ``prefect_sandbox.flows`` is imported, with ``env``."""
    code = (
        "import prefect_sandbox.flows\n"
        "from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS as S\n"
        "print(S.value())"
    )
    return python_stdout("-c", code, env=_env(tmp_path, **env)).strip()


def test_the_startup_allowance_is_a_setting_and_prefects_own_wins(tmp_path: Path) -> None:
    assert _startup_allowance(tmp_path, PREFECT_SANDBOX_EPHEMERAL_STARTUP_TIMEOUT_S="45") == "45"
    both = {
        "PREFECT_SANDBOX_EPHEMERAL_STARTUP_TIMEOUT_S": "45",
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "7",
    }
    assert _startup_allowance(tmp_path, **both) == "7"


def test_the_cli_says_in_one_line_that_the_api_does_not_answer(tmp_path: Path) -> None:
    notebook = _notebook(tmp_path / "hello.ipynb")
    done = subprocess.run(
        [sys.executable, "-m", "prefect_sandbox.cli", "run", str(notebook), "--out", "out"],
        env=_env(tmp_path, PREFECT_API_URL="http://127.0.0.1:9/api"),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("prefect-sandbox: the Prefect API at PREFECT_API_URL=")
    assert "127.0.0.1:9" in last
    assert not (tmp_path / "out").exists()


def test_importing_the_flows_imports_no_vendor_sdk_and_no_dask() -> None:
    """The E2B and Daytona SDKs load with their backend's first sandbox, Dask with a sweep on
    it. (prefect_aws does load: the flows' ``storage: S3Bucket | str | None`` parameters need
    the block class when Prefect builds their parameter schema, at ``@flow``.)"""
    vendors = ["e2b", "e2b_code_interpreter", "daytona", "distributed", "dask", "prefect_dask"]
    # Every flow: the package imports each on first use.
    code = (
        "import sys, prefect_sandbox.cli\n"
        "from prefect_sandbox.flows import *\n"
        f"print(sorted(set({vendors!r}) & set(sys.modules)))"
    )
    assert python_stdout("-c", code).strip() == "[]"


def _cli(
    *args: str, cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "prefect_sandbox.cli", *args],
        env=env or dict(os.environ),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_version_is_the_installed_distributions(tmp_path: Path) -> None:
    from importlib.metadata import version

    done = _cli("--version", cwd=tmp_path)
    assert done.returncode == 0
    assert done.stdout.strip() == f"prefect-sandbox {version('prefect-sandbox')}"


def test_help_shows_examples(tmp_path: Path) -> None:
    for command in ([], ["run"], ["sweep"]):
        done = _cli(*command, "--help", cwd=tmp_path)
        assert done.returncode == 0
        examples = done.stdout.split("examples:\n", 1)[1]
        assert "prefect-sandbox run analysis.ipynb -f params.yaml -p alpha=0.6" in examples


def test_help_notebook_shows_the_co2_notebooks_parameters_and_runs_nothing(
    tmp_path: Path,
) -> None:
    done = _cli("run", str(ROOT / "examples/co2/forecast.ipynb"), "--help-notebook", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("Parameters inferred for notebook ")
    assert lines[1:] == [
        '  data_path: str (default "co2.csv")',
        f"{'':34}the weekly CO2 series, columns date (YYYYMMDD) and co2 (ppm)",
        '  train_end: str (default "1996-12-31")',
        f"{'':34}last day the model is fitted on",
        '  holdout_end: str (default "2001-12-31")',
        f"{'':34}last day of the scored hold-out period",
        '  forecast_end: str (default "2010-12-31")',
        f"{'':34}the forecast runs to this day",
        '  figures_dir: str (default "figures")',
        f"{'':34}folder the figures are saved in",
        "",
        "Stages, split by its cells' stage tags:",
        "  load                     cell(s) 1, 2, 3, 4",
        "  explore                  cell(s) 6, 7",
        "  model                    cell(s) 9, 10",
        "  evaluate                 cell(s) 12, 13, 14",
        "  forecast                 cell(s) 16, 17, 18",
    ]
    assert list(tmp_path.iterdir()) == []  # no output folder: nothing ran


def test_help_notebook_lists_the_stages_the_heading_level_gives(tmp_path: Path) -> None:
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [
        nbformat.v4.new_markdown_cell("## Load"),
        nbformat.v4.new_code_cell("x = 1"),
        nbformat.v4.new_markdown_cell("## Fit"),
        nbformat.v4.new_code_cell("y = 2"),
        nbformat.v4.new_code_cell("z = 3"),
    ]
    nbformat.write(notebook, tmp_path / "sections.ipynb")
    one = _cli("run", "sections.ipynb", "--help-notebook", cwd=tmp_path)
    assert one.returncode == 0, one.stderr
    assert one.stdout.splitlines()[-2:] == [
        "Stages, split by markdown headings (#):",
        "  setup                    cell(s) 1, 3, 4",
    ]
    two = _cli(
        "run", "sections.ipynb", "--help-notebook", "--stage-heading-level", "2", cwd=tmp_path
    )
    assert two.returncode == 0, two.stderr
    assert two.stdout.splitlines()[-3:] == [
        "Stages, split by markdown headings (# or ##):",
        "  load                     cell(s) 1",
        "  fit                      cell(s) 3, 4",
    ]


def test_help_notebook_shows_types_and_comments_as_papermill_does(tmp_path: Path) -> None:
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [
        nbformat.v4.new_code_cell(
            "# defaults\nn: int = 3  # how many\nalpha = 0.5  # learning rate\nname = 'x'\n"
            "seed = make_seed()  # a call: its type is unknown\n",
            metadata={"tags": ["parameters"]},
        )
    ]
    nbformat.write(notebook, tmp_path / "typed.ipynb")
    done = _cli("run", "typed.ipynb", "--help-notebook", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[1:6] == [
        "  n: int (default 3)              how many",
        "  alpha: float (default 0.5)      learning rate",
        "  name: str (default 'x')",
        "  seed: Unknown type (default make_seed())",
        "                                  a call: its type is unknown",
    ]


def test_help_notebook_on_a_notebook_without_parameters_says_so_and_succeeds(
    tmp_path: Path,
) -> None:
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell("print(1)")]
    nbformat.write(notebook, tmp_path / "none.ipynb")
    done = _cli("run", "none.ipynb", "--help-notebook", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[1:] == [
        "",
        "  No cell tagged 'parameters': this notebook takes no parameters.",
        "",
        "Stages, split by markdown headings (#):",
        "  setup                    cell(s) 0",
    ]
    assert list(tmp_path.iterdir()) == [tmp_path / "none.ipynb"]  # nothing ran


def test_a_parameters_file_that_is_no_mapping_is_a_usage_error(tmp_path: Path) -> None:
    notebook = _notebook(tmp_path / "hello.ipynb")
    (tmp_path / "params.yaml").write_text("- 1\n- 2\n")
    done = _cli("run", str(notebook), "-f", "params.yaml", cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        "prefect-sandbox: params.yaml: a parameters file holds a mapping of name to value"
    )


@pytest.mark.usefixtures("prefect_api")
@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_a_parameters_file_merges_under_p_and_quiet_prints_only_the_run_folder(
    tmp_path: Path, suffix: str
) -> None:
    from prefect.settings import PREFECT_API_URL

    notebook = nbformat.v4.new_notebook()
    notebook.cells = [
        nbformat.v4.new_code_cell("a = 0\nb = 0", metadata={"tags": ["parameters"]}),
        nbformat.v4.new_code_cell("print(a, b)"),
    ]
    nbformat.write(notebook, tmp_path / "ab.ipynb")
    text = "a: 1\nb: two\n" if suffix == ".yaml" else '{"a": 1, "b": "two"}'
    (tmp_path / f"params{suffix}").write_text(text)
    env = {**os.environ, "PREFECT_API_URL": str(PREFECT_API_URL.value())}
    done = _cli(
        "run",
        "ab.ipynb",
        "-f",
        f"params{suffix}",
        "-p",
        "b=3",
        "-q",
        "--out",
        "out",
        cwd=tmp_path,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert len(lines) == 1
    run_dir = Path(lines[0])
    assert run_dir.parent == (tmp_path / "out").resolve()
    assert " INFO " not in done.stderr  # Prefect's console log lines are off
    executed = nbformat.read(run_dir / "executed.ipynb", as_version=4)
    assert executed.cells[-1].outputs[0]["text"] == "1 3\n"


def test_a_bad_startup_allowance_warns_and_the_flows_still_import(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", "import prefect_sandbox.flows"],
        env=_env(tmp_path, PREFECT_SANDBOX_EPHEMERAL_STARTUP_TIMEOUT_S="soon"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "UserWarning" in done.stderr
    assert "ephemeral_startup_timeout_s" in done.stderr


def test_a_broken_rule_on_the_options_is_exit_2_before_prefect_is_imported(
    tmp_path: Path,
) -> None:
    _notebook(tmp_path / "nb.ipynb")
    code = (
        "import sys\n"
        "from prefect_sandbox.cli import main\n"
        "status = main(sys.argv[1:])\n"
        "print(status, sorted({'prefect', 'prefect_aws'} & set(sys.modules)))\n"
    )
    cases = {
        ("run", "nb.ipynb", "--docker-image", "python:3.12"): (
            "--docker-image needs --backend docker"
        ),
        ("sweep", "nb.ipynb", "--grid", "g.json", "--max-live-sandboxes", "0"): (
            "--max-live-sandboxes must be 1 or more; got 0"
        ),
        ("run", "nb.ipynb", "--out", "s3://b@d/runs"): (
            "--out 's3://b@d/runs' names no valid bucket: 'b@d' has characters other than "
            "letters, digits, '.', '-' and '_', or is over 255 long"
        ),
    }
    for args, message in cases.items():
        done = subprocess.run(
            [sys.executable, "-c", code, *args],
            cwd=tmp_path,
            env=_env(tmp_path),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert (done.stdout, done.stderr) == ("2 []\n", f"prefect-sandbox: {message}\n")


def test_help_and_version_import_neither_prefect_nor_prefect_aws(tmp_path: Path) -> None:
    """The CLI's answers that run nothing stay fast: Prefect costs seconds to import."""
    code = (
        "import sys\n"
        "from prefect_sandbox.cli import main\n"
        "try:\n"
        "    main(sys.argv[1:])\n"
        "except SystemExit as exc:\n"
        "    print('exit', exc.code)\n"
        "heavy = {'prefect', 'prefect_aws', 'boto3', 'prefect_sandbox.flows'}\n"
        "print(sorted(heavy & set(sys.modules)))\n"
    )
    for args in (["--help"], ["--version"], ["run", "--help"], ["sweep", "--help"]):
        stdout = python_stdout("-c", code, *args, cwd=tmp_path)
        assert stdout.splitlines()[-2:] == ["exit 0", "[]"], args


def test_the_run_command_imports_the_pipeline_flows_only() -> None:
    """``prefect_sandbox.flows`` imports each flow on first use: a run pays for no sweep,
    session or reaper module; every exported name still imports."""
    code = (
        "import sys\n"
        "from prefect_sandbox.flows import PipelineFailedError, SweepFailedError, arun_notebook\n"
        "print(sorted({'prefect_sandbox.flows.sweep', 'prefect_sandbox.flows.session',\n"
        "    'prefect_sandbox.flows.reaper'} & set(sys.modules)))\n"
        "import prefect_sandbox, prefect_sandbox.flows as flows\n"
        "for module in (prefect_sandbox, flows):\n"
        "    assert all(getattr(module, name) for name in module.__all__)\n"
        "    assert set(module.__all__) <= set(dir(module))\n"
    )
    assert python_stdout("-c", code).strip() == "[]"


@pytest.mark.timeout(SUBPROCESS_TEST_TIMEOUT_S)
@pytest.mark.usefixtures("prefect_api")
def test_a_run_to_a_folder_imports_neither_prefect_aws_nor_boto3(tmp_path: Path) -> None:
    """prefect-aws and boto3 cost about 0.5 s to import: a run whose storage is a folder runs
    ``run-notebook`` with text storage and never loads them; one to ``s3://`` does."""
    from prefect.settings import PREFECT_API_URL

    _notebook(tmp_path / "nb.ipynb")
    code = (
        "import sys\n"
        "from prefect_sandbox.cli import main\n"
        "status = main(sys.argv[1:])\n"
        "aws = {'prefect_aws', 'boto3', 'botocore'}\n"
        "print(status, sorted(aws & set(sys.modules)))\n"
    )
    env = {**os.environ, "PREFECT_API_URL": str(PREFECT_API_URL.value())}
    loaded_by = {}
    for out in ("out", "s3://no-such-bucket/runs"):
        done = subprocess.run(
            [sys.executable, "-c", code, "run", "nb.ipynb", "--out", out, "-q"],
            cwd=tmp_path,
            env={**env, "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x"},
            capture_output=True,
            text=True,
            timeout=SUBPROCESS_TEST_TIMEOUT_S,
        )
        status, loaded_by[out] = done.stdout.splitlines()[-1].split(" ", 1)
        assert status == ("0" if out == "out" else "1"), done.stderr
    assert loaded_by == {
        "out": "[]",
        "s3://no-such-bucket/runs": "['boto3', 'botocore', 'prefect_aws']",
    }
    run_dir = next((tmp_path / "out").iterdir())
    assert nbformat.read(run_dir / "executed.ipynb", as_version=4).cells[1].outputs


def test_the_clis_run_notebook_flow_is_the_public_one_with_text_storage() -> None:
    """The CLI's flow (`arun_notebook_text_storage`) cannot drift from `arun_notebook`: same
    name, hooks, parameters and defaults; only ``storage`` differs, and the public flow's
    schema still offers a saved S3Bucket block (the UI's block selector)."""
    import inspect

    from prefect_sandbox.flows import arun_notebook
    from prefect_sandbox.flows.notebook_run import arun_notebook_text_storage

    public = inspect.signature(arun_notebook.fn).parameters
    text = inspect.signature(arun_notebook_text_storage.fn).parameters
    assert list(public) == list(text)
    assert [p.default for p in public.values()] == [p.default for p in text.values()]
    differing = [n for n in public if public[n].annotation != text[n].annotation]
    assert differing == ["storage"]
    assert (arun_notebook.name, arun_notebook.on_crashed_hooks) == (
        arun_notebook_text_storage.name,
        arun_notebook_text_storage.on_crashed_hooks,
    )
    assert arun_notebook.on_cancellation_hooks == arun_notebook_text_storage.on_cancellation_hooks
    storage = arun_notebook.parameters.model_dump()["properties"]["storage"]
    slugs = [
        definition.get("block_type_slug")
        for definition in arun_notebook.parameters.model_dump()["definitions"].values()
    ]
    assert "s3-bucket" in slugs, storage
    text_storage = arun_notebook_text_storage.parameters.model_dump()["properties"]["storage"]
    assert "$ref" not in str(text_storage)


def _api_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """The CLI against the session's Prefect API (stdout and stderr are pipes)."""
    from prefect.settings import PREFECT_API_URL

    return _cli(*args, cwd=cwd, env={**os.environ, "PREFECT_API_URL": str(PREFECT_API_URL.value())})


def _metrics_notebook(path: Path, *, fail: bool) -> Path:
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [
        nbformat.v4.new_code_cell("alpha = 0.1\nlabel = 'a'", metadata={"tags": ["parameters"]}),
        nbformat.v4.new_code_cell(
            "import json\njson.dump({'mae': alpha * 2, 'label': label, 'table': [1, 2]}, "
            "open('metrics.json', 'w'))"
        ),
        nbformat.v4.new_code_cell("raise ValueError('bad fit')" if fail else "print('done')"),
    ]
    nbformat.write(notebook, path)
    return path


@pytest.mark.usefixtures("prefect_api")
def test_json_is_the_only_thing_on_stdout_and_shows_a_completed_run(tmp_path: Path) -> None:
    import hashlib
    import json

    _metrics_notebook(tmp_path / "m.ipynb", fail=False)
    done = _api_cli(
        "run", "m.ipynb", "--json", "-v", "-p", "alpha", "0.5", "--artifact", "metrics.json",
        "--out", "out", cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)  # the whole of stdout is one object
    assert result["status"] == "completed" and result["exit_status"] == 0
    assert result["parameters"] == {"alpha": 0.5}  # papermill's `-p NAME VALUE`, typed
    assert result["metrics"] == {"mae": 1.0, "label": "a"}  # top-level scalars only
    assert [(s["name"], s["status"], s["cell_count"]) for s in result["stages"]] == [
        ("setup", "ok", 4)
    ]
    run_dir = Path(result["output_dir"])
    assert run_dir.parent == (tmp_path / "out").resolve()
    files = {a["path"]: a for a in result["artifacts"]}
    assert set(files) == {"metrics.json", "executed.ipynb"}
    for path, artifact in files.items():
        data = (run_dir / path).read_bytes()
        assert artifact["size_bytes"] == len(data)
        assert artifact["sha256"] == hashlib.sha256(data).hexdigest()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary == {k: v for k, v in result.items() if k != "exit_status"}
    # With -v, progress went to stderr, one plain line per cell (no terminal here), and
    # Prefect's console left out its own record of each cell's end.
    progress = [line for line in done.stderr.splitlines() if line.startswith("prefect-sandbox: [")]
    assert [line.split("]")[0] for line in progress] == [
        f"prefect-sandbox: [{n}/4" for n in (1, 2, 3, 4)
    ]
    # The injected parameters cell shifts no cell's number: cell 1 is cell 1 of m.ipynb.
    assert progress[1].startswith("prefect-sandbox: [2/4] stage 'setup' injected parameters cell")
    assert progress[2].startswith("prefect-sandbox: [3/4] stage 'setup' cell 1 ok in ")
    assert " ok in " not in "".join(set(done.stderr.splitlines()) - set(progress))


_TEARDOWN_WITNESS = """
import sys
from prefect_sandbox import cli

class Witness:
    def __del__(self):
        print("torn down", file=sys.stderr)

witness = Witness()  # freed by the interpreter's teardown, where there is one
called_as = sys.argv.pop(1)
sys.exit(cli.main() if called_as == "command" else cli.main(sys.argv[1:]))
"""


@pytest.mark.usefixtures("prefect_api")
@pytest.mark.parametrize("called_as", ["command", "function"])
def test_the_command_ends_without_the_interpreters_teardown_keeping_status_and_output(
    tmp_path: Path, called_as: str
) -> None:
    """As the command, a run ends its process after the exit handlers, without the teardown
    of Prefect's modules (about 0.5 s of CPU); its status and its JSON are whole. Called as a
    function, Python's own exit follows (the witness of the teardown)."""
    import json

    from prefect.settings import PREFECT_API_URL

    _metrics_notebook(tmp_path / "m.ipynb", fail=False)
    (tmp_path / "witness.py").write_text(_TEARDOWN_WITNESS)
    args = ["run", "m.ipynb", "--json", "--artifact", "metrics.json", "--out", "out"]
    done = subprocess.run(
        [sys.executable, "witness.py", called_as, *args],
        env={**os.environ, "PREFECT_API_URL": str(PREFECT_API_URL.value())},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["status"] == "completed" and result["metrics"]["mae"] == 0.2
    assert ("torn down" in done.stderr.splitlines()) is (called_as == "function")


@pytest.mark.usefixtures("prefect_api")
def test_json_shows_a_failed_run_with_its_stages_files_and_metrics(tmp_path: Path) -> None:
    import json

    _metrics_notebook(tmp_path / "m.ipynb", fail=True)
    done = _api_cli(
        "run", "m.ipynb", "--json", "--artifact", "metrics.json", "--out", "out", cwd=tmp_path
    )
    assert done.returncode == 1
    result = json.loads(done.stdout)
    assert result["status"] == "failed" and result["exit_status"] == 1
    assert result["error"] == "stage 'setup', cell 2: ValueError: bad fit"
    (stage,) = result["stages"]
    assert (stage["status"], stage["failed_cell_index"], stage["ename"]) == (
        "failed",
        2,
        "ValueError",
    )
    assert result["metrics"] == {"mae": 0.2, "label": "a"}
    assert {a["path"] for a in result["artifacts"]} == {"metrics.json", "executed.ipynb"}
    assert Path(result["output_dir"], "summary.json").is_file()
    # Without -v, stderr is as -q leaves it: the reason alone.
    (reason,) = [line for line in done.stderr.splitlines() if line.strip()]
    assert reason.startswith("prefect-sandbox: pipeline failed:")


@pytest.mark.usefixtures("prefect_api")
def test_a_failing_cell_ends_in_three_lines_and_v_adds_the_engines_tracebacks(
    tmp_path: Path,
) -> None:
    """After the cell's own traceback: its progress line, the cell (numbered as in m.ipynb,
    which -p's injected cell does not shift) with its line of code, and the reason with where
    the files are. No engine traceback, no stage table; -v shows both, -q the reason alone."""
    import json

    _metrics_notebook(tmp_path / "m.ipynb", fail=True)
    args = ("run", "m.ipynb", "-p", "alpha", "0.5", "--out", "out")
    done = _api_cli(*args, cwd=tmp_path)
    assert done.returncode == 1
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    cell_end = max(n for n, line in enumerate(lines) if line.startswith("[setup cell 2] "))
    assert lines[cell_end] == "[setup cell 2] ValueError: bad fit"
    after = lines[cell_end + 1 :]
    (run_dir,) = (tmp_path / "out").iterdir()
    assert after[0].startswith("prefect-sandbox: [4/4] stage 'setup' cell 2 error in ")
    assert after[1:] == [
        "prefect-sandbox: cell 2 of m.ipynb (counting from 0), line 1: raise ValueError('bad fit')",
        "prefect-sandbox: pipeline failed: stage 'setup', cell 2: ValueError: bad fit "
        f"(partial results in {run_dir.resolve()})",
    ]
    assert not any(line.startswith("Traceback") for line in lines)
    (stage,) = json.loads((run_dir / "summary.json").read_text())["stages"]
    assert (stage["failed_cell_index"], stage["failed_line"], stage["failed_code"]) == (
        2,
        1,
        "raise ValueError('bad fit')",
    )

    verbose = _api_cli(*args, "-v", cwd=tmp_path)
    assert verbose.returncode == 1
    table = verbose.stdout.splitlines()
    assert table[0].startswith("Stored 1 file(s) and summary.json in ")
    assert table[1].split()[:4] == ["setup", "failed", "4", "cell(s)"]
    assert table[1].endswith("  cell 2: ValueError")
    assert "Traceback (most recent call last):" in verbose.stderr.splitlines()
    assert "task_engine.py" in verbose.stderr

    quiet = _api_cli(*args, "-q", cwd=tmp_path)
    assert quiet.returncode == 1
    assert quiet.stdout == ""
    (reason,) = [line for line in quiet.stderr.splitlines() if line.strip()]
    assert reason.startswith(
        "prefect-sandbox: pipeline failed: stage 'setup', cell 2: ValueError: bad fit "
        "(partial results in "
    )


def test_progress_is_a_bar_on_a_terminal_lines_elsewhere_and_none_when_quiet() -> None:
    import io
    import pty

    from prefect_sandbox.progress import progress_mode

    leader, follower = pty.openpty()
    try:
        with open(follower, "w", closefd=False) as terminal:
            assert progress_mode(False, terminal) == "bar"
            assert progress_mode(True, terminal) is None
    finally:
        os.close(leader)
        os.close(follower)
    assert progress_mode(False, io.StringIO()) == "lines"
    assert progress_mode(True, io.StringIO()) is None


def test_the_bar_names_the_cell_that_runs_and_at_the_end_the_last_that_ended() -> None:
    import io
    import logging

    from prefect_sandbox.progress import CellProgress
    from prefect_sandbox.tasks.sandbox import CELL_DONE_ATTRIBUTE, CellDone

    def ended(stage: str, index: int, status: str) -> logging.LogRecord:
        record = logging.LogRecord("prefect.task_runs", logging.INFO, "", 0, "", None, None)
        setattr(record, CELL_DONE_ATTRIBUTE, CellDone(stage, index, status, 0.1))
        return record

    progress = CellProgress("bar", [("load", 1), ("load", 2), ("fit", 4)], io.StringIO())
    progress.start()
    try:
        assert progress.description == "load cell 1 running"
        progress.emit(ended("load", 1, "ok"))
        assert progress.description == "load cell 2 running"
        progress.emit(ended("load", 2, "ok"))
        assert progress.description == "fit cell 4 running"
        progress.emit(ended("fit", 4, "error"))
        assert progress.description == "fit cell 4 error"
    finally:
        progress.stop()


def test_papermills_p_name_value_is_taken_as_name_equals_value() -> None:
    from prefect_sandbox.cli import _joined_parameters

    assert _joined_parameters(["run", "nb.ipynb", "-p", "alpha", "-0.5", "-p", "n=3"]) == [
        "run",
        "nb.ipynb",
        "-p",
        "alpha=-0.5",
        "-p",
        "n=3",
    ]
    assert _joined_parameters(["run", "nb.ipynb", "--parameter", "a", "b c"])[-1] == "a=b c"
    assert _joined_parameters(["run", "nb.ipynb", "-p", "alone"])[-2:] == ["-p", "alone"]
    assert _joined_parameters(["run", "--", "-p", "x", "1"])[-3:] == ["-p", "x", "1"]


@pytest.mark.usefixtures("prefect_api")
def test_a_run_on_a_terminal_draws_a_progress_bar(tmp_path: Path) -> None:
    """The CLI with a pseudo-terminal as its stdout and stderr, as a user's shell gives it."""
    import pty
    import threading

    from prefect.settings import PREFECT_API_URL

    _metrics_notebook(tmp_path / "m.ipynb", fail=False)
    leader, follower = pty.openpty()
    env = {
        **os.environ,
        "PREFECT_API_URL": str(PREFECT_API_URL.value()),
        "TERM": "xterm",
        "COLUMNS": "120",
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "prefect_sandbox.cli", "run", "m.ipynb", "--out", "out"],
        stdin=subprocess.DEVNULL,
        stdout=follower,
        stderr=follower,
        cwd=tmp_path,
        env=env,
    )
    os.close(follower)
    chunks: list[bytes] = []

    def read() -> None:
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: the terminal's last writer closed it
                return
            if not chunk:
                return
            chunks.append(chunk)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        assert process.wait(timeout=300) == 0
    finally:
        process.kill()
        reader.join(timeout=30)
        os.close(leader)
    raw = b"".join(chunks).decode(errors="replace")
    assert "\x1b[?25l" in raw  # rich hid the cursor to redraw the bar in place
    shown = strip_ansi(raw)
    assert "setup cell 0 running" in shown and "0/3 cells" in shown, shown[-3000:]
    assert "setup cell 2 ok " in shown and "3/3 cells" in shown
    assert "prefect-sandbox: [" not in shown  # no plain progress lines
    assert " ok in " not in shown  # nor Prefect's own record of each cell's end
    assert "Stored 1 file(s) and summary.json in " in shown


def test_a_signal_whose_exception_a_library_wraps_still_ends_the_run_as_interrupted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """SIGTERM while pydantic serializes (as Prefect's settings are, while it is imported):
    the handler's exception comes out as pydantic's own error, and is still the signal's."""
    import signal

    import pydantic

    from prefect_sandbox import cli

    class Settings(pydantic.BaseModel):
        @pydantic.model_serializer(mode="wrap")
        def _serialize(self, handler: pydantic.SerializerFunctionWrapHandler) -> object:
            signal.raise_signal(signal.SIGTERM)
            return handler(self)

    def serializing(mode: str, quiet: bool) -> None:
        Settings().model_dump()

    monkeypatch.setattr(cli, "_early_local_server", serializing)
    notebook = _notebook(tmp_path / "two.ipynb")
    assert cli.main(["run", str(notebook)]) == 128 + signal.SIGTERM
    assert capsys.readouterr().err.splitlines()[-1] == (
        "prefect-sandbox: interrupted by SIGTERM before the flow run began"
    )


def test_main_called_as_a_function_gives_the_callers_signal_handlers_back(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import signal

    from prefect_sandbox.cli import main

    before = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    assert main(["run", "missing.ipynb"]) == 2
    assert {signum: signal.getsignal(signum) for signum in before} == before
    assert "is not a file" in capsys.readouterr().err
