"""The run and sweep options: each rule once, with plain values, in the flows' words and in the
CLI's (`prefect_sandbox.options`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from prefect_sandbox.options import (
    CLI,
    CLI_FLAGS,
    RunOptions,
    SweepOptions,
    check_options,
    dask_address,
    one_line,
)
from prefect_sandbox.sandbox.errors import UnsafePathError


def _problem(model: type[RunOptions], context: Any = None, **values: Any) -> str:
    with pytest.raises(ValidationError) as caught:
        model.model_validate(values, context=context)
    return one_line(caught.value, CLI_FLAGS if context else None)


@pytest.fixture
def notebook(tmp_path: Path) -> str:
    path = tmp_path / "nb.ipynb"
    path.write_text("{}")
    return str(path)


@pytest.mark.parametrize("bad", [0, -2, float("nan"), float("inf")])
def test_a_cell_timeout_is_a_positive_duration_or_minus_one(bad: float) -> None:
    shown = f"{bad:g}"
    assert _problem(RunOptions, cell_timeout_s=bad) == (
        f"cell_timeout_s must be a positive number of seconds, or -1 for no timeout; got {shown}"
    )
    assert _problem(RunOptions, CLI, cell_timeout_s=bad).startswith("--cell-timeout must be")
    assert RunOptions(cell_timeout_s=-1).cell_timeout_s == -1


def test_an_artifact_pattern_stays_in_the_working_directory_and_keeps_its_type() -> None:
    assert _problem(RunOptions, CLI, artifacts=["ok/*.png", "../x"]) == (
        "--artifact path '../x' leaves the working directory"
    )
    with pytest.raises(UnsafePathError, match=r"^artifacts path '/etc/passwd' must be relative"):
        check_options(RunOptions, artifacts=["/etc/passwd"])


def test_s3_uris_name_a_valid_bucket_and_keys_that_do_not_climb() -> None:
    assert _problem(RunOptions, CLI, storage="s3:///x") == "--out 's3:///x' names no bucket"
    assert _problem(RunOptions, inputs=["s3://b@d/k"]).startswith(
        "inputs 's3://b@d/k' names no valid bucket: 'b@d' has characters"
    )
    climbing = "s3://b/a b/ü/../../x?y#z"
    with pytest.raises(UnsafePathError, match=r"^storage .* has a '\.' or '\.\.' segment"):
        check_options(RunOptions, storage=climbing)
    # Spaces, '?' and '#' are a key's characters, not a query or fragment.
    RunOptions(storage="s3://b/a b/ü/x?y#z", inputs=["s3://b/data/"])


def test_backend_options_fit_together() -> None:
    assert _problem(RunOptions, CLI, backend="docker") == (
        "--backend docker needs --backend-block NAME or --docker-image IMAGE"
    )
    assert _problem(RunOptions, CLI, docker_image="python:3.12") == (
        "--docker-image needs --backend docker"
    )
    RunOptions.model_validate({"backend": "docker", "docker_image": "img"}, context=CLI)


def test_e2b_without_a_block_needs_its_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("E2B_API_KEY", raising=False)
    assert _problem(RunOptions, CLI, backend="e2b") == (
        "--backend e2b needs --backend-block NAME or the E2B_API_KEY variable"
    )
    RunOptions.model_validate({"backend": "e2b", "backend_block": "saved"}, context=CLI)
    monkeypatch.setenv("E2B_API_KEY", "e2b_x")
    RunOptions.model_validate({"backend": "e2b"}, context=CLI)


def test_a_missing_sdk_names_its_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    assert _problem(RunOptions, CLI, backend="daytona") == (
        "--backend daytona: the Daytona backend needs the daytona extra: "
        "pip install 'prefect-sandbox[daytona]'"
    )
    assert _problem(SweepOptions, CLI, task_runner="dask") == (
        "--task-runner: the Dask task runner needs the dask extra: "
        "pip install 'prefect-sandbox[dask]'"
    )


def test_aws_credentials_need_an_s3_out_on_this_machine() -> None:
    assert _problem(RunOptions, CLI, storage="out", aws_credentials="aws") == (
        "--aws-credentials needs an s3:// --out"
    )
    RunOptions(storage="s3://b/p", aws_credentials="aws")


def test_paths_on_this_machine_are_checked_for_the_cli_only(tmp_path: Path, notebook: str) -> None:
    missing = str(tmp_path / "missing.ipynb")
    assert _problem(RunOptions, CLI, notebook=missing) == f"notebook {missing!r} is not a file"
    assert _problem(RunOptions, CLI, notebook=notebook, inputs=["no/such.csv"]) == (
        "--input 'no/such.csv' does not exist"
    )
    assert _problem(RunOptions, CLI, notebook=notebook, storage=notebook) == (
        f"--out {notebook!r} is not a folder"
    )
    # The flows find a missing file as they read it, and store what the run made.
    RunOptions(notebook=missing, inputs=["no/such.csv"], storage=notebook)


def test_a_sweep_cap_is_one_or_more_and_not_sent_to_a_deployment() -> None:
    assert (
        _problem(SweepOptions, max_live_sandboxes=0)
        == "max_live_sandboxes must be 1 or more; got 0"
    )
    assert _problem(SweepOptions, CLI, max_live_sandboxes=0) == (
        "--max-live-sandboxes must be 1 or more; got 0"
    )
    assert _problem(SweepOptions, CLI, max_live_sandboxes=2, deployment="d").startswith(
        "--max-live-sandboxes is not sent to a deployment's runs"
    )


def test_a_task_runner_is_dask_and_not_with_a_deployment() -> None:
    assert dask_address("dask") is None
    assert dask_address("dask: tcp://h:8786 ") == "tcp://h:8786"
    assert _problem(SweepOptions, CLI, task_runner="ray").startswith(
        "--task-runner: task runner 'ray' is not 'dask' or 'dask:ADDRESS'"
    )
    assert _problem(SweepOptions, task_runner="dask:").startswith("task_runner: task runner")
    assert _problem(SweepOptions, task_runner="dask", deployment="d") == (
        "task_runner and deployment exclude each other: a deployment's runs go to its work "
        "pool's workers"
    )


def test_a_deployment_takes_a_saved_backend_and_its_workers_aws_environment(
    tmp_path: Path,
) -> None:
    assert _problem(SweepOptions, CLI, backend="local", deployment="d") == (
        "--deployment needs a saved backend: --backend-block NAME (or no --backend)"
    )
    assert _problem(SweepOptions, CLI, storage="s3://b/p", aws_credentials="a", deployment="d") == (
        "--deployment sends --out to the workers as text: they use their AWS environment"
    )
    # The notebook and inputs are paths on the workers: not looked for here.
    SweepOptions.model_validate(
        {"notebook": str(tmp_path / "on-workers.ipynb"), "inputs": ["w.csv"], "deployment": "d"},
        context=CLI,
    )


def test_a_metrics_file_stays_in_the_working_directory() -> None:
    with pytest.raises(UnsafePathError, match=r"^metrics_artifact path '\.\./m\.json' leaves"):
        check_options(SweepOptions, metrics_artifact="../m.json")
    SweepOptions(metrics_artifact="")


def test_several_problems_are_one_line_and_wrong_types_name_the_option() -> None:
    with pytest.raises(ValueError) as caught:
        check_options(SweepOptions, max_live_sandboxes=0, cell_timeout_s=0)
    assert caught.type is ValueError
    assert str(caught.value) == (
        "cell_timeout_s must be a positive number of seconds, or -1 for no timeout; got 0; "
        "max_live_sandboxes must be 1 or more; got 0"
    )
    assert _problem(SweepOptions, CLI, max_live_sandboxes="many").startswith(
        "--max-live-sandboxes: "
    )
    assert "\n" not in _problem(RunOptions, unknown=1)
