"""`PrefectSandboxSettings`: ``PREFECT_SANDBOX_*`` variables give the blocks', flows' and CLI's
defaults, read when used; an explicit argument always wins."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import nbformat
import pytest
from pydantic import ValidationError

from prefect_sandbox import E2BBackend, E2BCredentials, LocalKernelBackend
from prefect_sandbox.flows import amodeling_pipeline
from prefect_sandbox.flows.hooks import backend_from_parameter
from prefect_sandbox.settings import PrefectSandboxSettings

pytestmark = pytest.mark.usefixtures("prefect_api")


@pytest.fixture(autouse=True)
def _no_settings_from_outside(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("PREFECT_SANDBOX_"):
            monkeypatch.delenv(name)


def test_settings_are_read_when_built_not_at_import(monkeypatch: pytest.MonkeyPatch) -> None:
    assert PrefectSandboxSettings().cell_timeout_s == 600.0
    assert PrefectSandboxSettings().storage == "prefect-sandbox-output"
    assert PrefectSandboxSettings().isolation == "bubblewrap"
    assert PrefectSandboxSettings().max_live_sandboxes is None
    monkeypatch.setenv("PREFECT_SANDBOX_MAX_LIVE_SANDBOXES", "3")
    assert PrefectSandboxSettings().max_live_sandboxes == 3
    monkeypatch.setenv("PREFECT_SANDBOX_MAX_LIVE_SANDBOXES", "None")
    assert PrefectSandboxSettings().max_live_sandboxes is None
    monkeypatch.setenv("PREFECT_SANDBOX_CELL_TIMEOUT_S", "2.5")
    monkeypatch.setenv("PREFECT_SANDBOX_MAX_OUTPUT_CHARS", "none")
    monkeypatch.setenv("PREFECT_SANDBOX_STORAGE", "s3://bucket/runs")
    monkeypatch.setenv("PREFECT_SANDBOX_ISOLATION", "none")
    settings = PrefectSandboxSettings()
    assert (settings.cell_timeout_s, settings.max_output_chars) == (2.5, None)
    assert (settings.storage, settings.isolation) == ("s3://bucket/runs", "none")
    assert PrefectSandboxSettings(cell_timeout_s=9).cell_timeout_s == 9
    monkeypatch.setenv("PREFECT_SANDBOX_CELL_TIMEOUT_S", "-1")  # nbclient's "no limit"
    assert PrefectSandboxSettings().cell_timeout_s == -1


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("PREFECT_SANDBOX_CELL_TIMEOUT_S", "0"),
        ("PREFECT_SANDBOX_CELL_TIMEOUT_S", "-2"),
        ("PREFECT_SANDBOX_CELL_TIMEOUT_S", "soon"),
        ("PREFECT_SANDBOX_MAX_OUTPUT_CHARS", "-1"),
        ("PREFECT_SANDBOX_MAX_LIVE_SANDBOXES", "0"),
        ("PREFECT_SANDBOX_MAX_LIVE_SANDBOXES", "-1"),
        ("PREFECT_SANDBOX_ISOLATION", "docker"),
        ("PREFECT_SANDBOX_BACKEND_BLOCK", "no-slug"),
        ("PREFECT_SANDBOX_STORAGE", ""),
        ("PREFECT_SANDBOX_WARM_POOL_SIZE", "-1"),
    ],
)
def test_bad_values_are_refused_naming_the_setting(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ValidationError) as info:
        PrefectSandboxSettings()
    (problem,) = info.value.errors()
    assert f"PREFECT_SANDBOX_{problem['loc'][0]}".upper() == name


def test_blocks_take_their_defaults_from_the_settings_and_explicit_fields_win(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    credentials = E2BCredentials(api_key="k")
    assert LocalKernelBackend().cell_timeout_s == 600.0
    monkeypatch.setenv("PREFECT_SANDBOX_CELL_TIMEOUT_S", "3")
    monkeypatch.setenv("PREFECT_SANDBOX_MAX_OUTPUT_CHARS", "4096")
    monkeypatch.setenv("PREFECT_SANDBOX_MAX_LIVE_SANDBOXES", "5")
    for block in (LocalKernelBackend(), E2BBackend(credentials=credentials)):
        assert (block.cell_timeout_s, block.max_output_chars) == (3.0, 4096)
        assert block.max_live_sandboxes == 5
    assert LocalKernelBackend(max_live_sandboxes=None).max_live_sandboxes is None
    with pytest.raises(ValidationError):
        LocalKernelBackend(max_live_sandboxes=0)
    assert LocalKernelBackend().isolation == "bubblewrap"
    monkeypatch.setenv("PREFECT_SANDBOX_ISOLATION", "none")
    assert LocalKernelBackend().isolation == "none"
    explicit = LocalKernelBackend(cell_timeout_s=None, max_output_chars=100, isolation="bubblewrap")
    assert (explicit.cell_timeout_s, explicit.max_output_chars) == (None, 100)
    assert explicit.isolation == "bubblewrap"
    assert LocalKernelBackend().warm_pool_size == 0
    monkeypatch.setenv("PREFECT_SANDBOX_WARM_POOL_SIZE", "3")
    assert LocalKernelBackend().warm_pool_size == 3
    assert LocalKernelBackend(warm_pool_size=0).warm_pool_size == 0
    # A saved block's fields are explicit too.
    saved = LocalKernelBackend.model_validate({"cell_timeout_s": 30.0})
    assert (saved.cell_timeout_s, saved.max_output_chars) == (30.0, 4096)
    # The UI still offers the unset environment's defaults.
    schema = LocalKernelBackend.model_json_schema()["properties"]
    assert schema["cell_timeout_s"]["default"] == 600.0


async def test_flows_store_where_the_settings_say_unless_told(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PREFECT_SANDBOX_STORAGE", str(tmp_path / "from-env"))
    defaulted = await amodeling_pipeline(stages={"one": ["x = 1"]})
    assert Path(defaulted.output_dir).parent == tmp_path / "from-env"
    assert (Path(defaulted.output_dir) / "summary.json").is_file()
    explicit = await amodeling_pipeline(stages={"one": ["x = 1"]}, storage=str(tmp_path / "arg"))
    assert Path(explicit.output_dir).parent == tmp_path / "arg"


async def test_flows_and_hooks_use_the_backend_block_the_settings_name_unless_told(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    name = f"settings-{uuid.uuid4().hex[:8]}"
    await LocalKernelBackend(env={"WHICH_BACKEND": "saved"}).save(name)
    monkeypatch.setenv("PREFECT_SANDBOX_BACKEND_BLOCK", f"local-kernel-sandbox/{name}")
    show = ["import os; print(os.environ.get('WHICH_BACKEND'))"]

    async def printed(**backend: LocalKernelBackend) -> str:
        result = await amodeling_pipeline(stages={"show": show}, storage=str(tmp_path), **backend)
        notebook = nbformat.read(Path(result.output_dir) / "executed.ipynb", as_version=4)
        return str(notebook.cells[0].outputs[0]["text"])

    assert await printed() == "saved\n"
    assert await printed(backend=LocalKernelBackend()) == "None\n"
    # The cancellation hook rebuilds the same backend from a run's empty parameter.
    rebuilt = await backend_from_parameter(None)
    assert isinstance(rebuilt, LocalKernelBackend) and rebuilt.env == {"WHICH_BACKEND": "saved"}


def _sleepy_notebook(path: Path) -> Path:
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [
        nbformat.v4.new_markdown_cell("# Wait"),
        nbformat.v4.new_code_cell("import time\ntime.sleep(5)\nprint('slept')"),
    ]
    nbformat.write(notebook, path)
    return path


def _cli(*args: str, cwd: Path, **settings: str) -> subprocess.CompletedProcess[str]:
    from prefect.settings import PREFECT_API_URL

    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_SANDBOX_")}
    env["PREFECT_API_URL"] = str(PREFECT_API_URL.value())
    env.update(settings)
    return subprocess.run(
        [sys.executable, "-m", "prefect_sandbox.cli", *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_cli_cell_timeout_comes_from_the_environment_and_the_flag_wins(tmp_path: Path) -> None:
    source = _sleepy_notebook(tmp_path / "sleepy.ipynb")
    timed_out = _cli("run", str(source), cwd=tmp_path, PREFECT_SANDBOX_CELL_TIMEOUT_S="1")
    assert timed_out.returncode == 1, timed_out.stderr[-3000:]
    last = timed_out.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "prefect-sandbox: pipeline failed: stage 'wait', cell 1: timed out after 1.0 s"
    )
    explicit = _cli(
        "run",
        str(source),
        "--out",
        str(tmp_path / "explicit"),
        "--cell-timeout",
        "60",
        cwd=tmp_path,
        PREFECT_SANDBOX_CELL_TIMEOUT_S="1",
    )
    assert explicit.returncode == 0, explicit.stderr[-3000:]
    (run_dir,) = (tmp_path / "explicit").iterdir()
    notebook = nbformat.read(run_dir / "executed.ipynb", as_version=4)
    assert notebook.cells[1].outputs[0]["text"] == "slept\n"


def test_cli_output_folder_comes_from_the_environment_and_bad_values_are_usage_errors(
    tmp_path: Path,
) -> None:
    source = tmp_path / "quick.ipynb"
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell("x = 1")]
    nbformat.write(notebook, source)
    done = _cli("run", str(source), cwd=tmp_path, PREFECT_SANDBOX_STORAGE=str(tmp_path / "env"))
    assert done.returncode == 0, done.stderr[-3000:]
    (run_dir,) = (tmp_path / "env").iterdir()
    assert (run_dir / "summary.json").is_file()
    bad = _cli("run", str(source), cwd=tmp_path, PREFECT_SANDBOX_CELL_TIMEOUT_S="soon")
    assert bad.returncode == 2
    assert bad.stderr.strip().startswith("prefect-sandbox: PREFECT_SANDBOX_CELL_TIMEOUT_S='soon'")
    unknown = _cli(
        "run",
        str(source),
        cwd=tmp_path,
        PREFECT_SANDBOX_BACKEND_BLOCK="local-kernel-sandbox/no-such-block",
    )
    assert unknown.returncode == 2
    assert (
        unknown.stderr.strip()
        .splitlines()[-1]
        .startswith(
            "prefect-sandbox: PREFECT_SANDBOX_BACKEND_BLOCK='local-kernel-sandbox/no-such-block'"
        )
    )
