"""Who decides a run's isolation: a deployment run's own parameters and job variables against
`refused_parameters` (plain values), and inputs that are links themselves. The same refusals
through a real `prefect server` and its workers are in tests/test_deployments.py."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import pytest

from prefect_sandbox.flows import ParameterRefusedError
from prefect_sandbox.flows.policy import refused_parameters
from prefect_sandbox.sandbox.errors import FileTransferError
from prefect_sandbox.settings import PrefectSandboxSettings
from prefect_sandbox.tasks.storage import fetch_inputs

REFERENCE = {"$ref": {"block_document_id": "0b7e1a43-8f9e-4c1b-9d52-3d3c1f3f0a11"}}


def _refused(
    given: dict[str, Any],
    deployed: dict[str, Any] | None = None,
    job_variables: dict[str, Any] | None = None,
    roots: list[str] | None = None,
    output_roots: list[str] | None = None,
) -> list[str]:
    return list(
        refused_parameters(
            given, deployed or {}, job_variables or {}, roots or [], output_roots or []
        )
    )


@pytest.mark.parametrize(
    "backend",
    [
        {"isolation": "none"},
        {"network": True},
        {"env": {"LD_PRELOAD": "/tmp/x.so"}},
        {"block_type_slug": "local-kernel-sandbox", "isolation": "none"},
        {**REFERENCE, "isolation": "none"},
        {"$ref": "0b7e1a43-8f9e-4c1b-9d52-3d3c1f3f0a11"},
        # Harmless fields are refused all the same: a block by value is never trusted.
        {"cell_timeout_s": 5},
    ],
)
def test_a_backend_by_value_is_refused(backend: dict[str, Any]) -> None:
    assert _refused({"backend": backend}) == ["backend"]


def test_a_saved_block_by_reference_or_the_deployments_own_backend_goes_ahead() -> None:
    assert _refused({"backend": REFERENCE}) == []
    assert _refused({"backend": None}) == []
    own = {"isolation": "bubblewrap", "env": {"A": "1"}}
    assert _refused({"backend": own}, deployed={"backend": own}) == []
    assert _refused({"backend": {**own, "network": True}}, deployed={"backend": own}) == ["backend"]


def test_paths_outside_the_roots_are_refused_links_resolved(tmp_path: Path) -> None:
    root = tmp_path / "allowed"
    (root / "data").mkdir(parents=True)
    (root / "data" / "a.csv").write_text("a\n")
    (root / "etc").symlink_to("/etc")
    (root / "key").symlink_to(tmp_path / "id_rsa")
    given = {
        "notebook": str(root / "data" / ".." / ".." / "nb.ipynb"),
        "inputs": [
            str(root / "data"),
            str(root / "data" / "a.csv"),
            str(root / "etc"),
            str(root / "etc" / "shadow"),
            str(root / "key"),
            str(tmp_path / "allowed-not"),
            os.path.expanduser("~/.ssh"),
            "s3://team-data/inputs/x.csv",
            "s3://team-data/inputs-other/x.csv",
            "s3://secrets/x",
        ],
    }
    refused = _refused(given, roots=[str(root), "s3://team-data/inputs"])
    assert refused == ["notebook", *(f"inputs[{i}]" for i in [2, 3, 4, 5, 6, 8, 9])]
    # Nothing is allowed when no root is set; the deployment's own paths always are.
    deployed = {"notebook": "../nb.ipynb", "inputs": ["/srv/co2.csv"]}
    assert _refused({"inputs": [str(root / "data")]}) == ["inputs[0]"]
    assert _refused({**deployed}, deployed=deployed) == []
    assert _refused({**deployed, "inputs": ["/srv/co2.csv", "/etc"]}, deployed=deployed) == [
        "inputs[1]"
    ]


@pytest.mark.parametrize(
    "storage",
    [
        # A bucket by value, whatever it says: its endpoint gets the worker's signed uploads.
        {"bucket_name": "b", "credentials": {"aws_client_parameters": {"endpoint_url": "x"}}},
        {"bucket_name": "b"},
        {**REFERENCE, "bucket_name": "b"},
        "/var/tmp/elsewhere",
        "s3://other-team/runs",
        "s3://team-results/runs-elsewhere",
    ],
)
def test_storage_by_value_or_outside_the_output_roots_is_refused(
    storage: Any, tmp_path: Path
) -> None:
    output_roots = [str(tmp_path), "s3://team-results/runs"]
    assert _refused({"storage": storage}, output_roots=output_roots) == ["storage"]


def test_storage_a_saved_block_the_deployments_own_or_under_a_root_goes_ahead(
    tmp_path: Path,
) -> None:
    output_roots = [str(tmp_path), "s3://team-results/runs"]
    for storage in [
        REFERENCE,
        "s3-bucket/team-results",
        str(tmp_path / "run"),
        "s3://team-results/runs/today",
        None,
    ]:
        assert _refused({"storage": storage}, output_roots=output_roots) == [], storage
    own = {"bucket_name": "deployed"}
    assert _refused({"storage": own}, deployed={"storage": own}) == []
    assert _refused({"storage": "/srv/out"}, deployed={"storage": "/srv/out"}) == []
    # A folder link out of a root is followed.
    (tmp_path / "out").symlink_to("/var/tmp")
    assert _refused({"storage": str(tmp_path / "out")}, output_roots=output_roots) == ["storage"]


def test_a_runs_job_variables_may_not_set_the_sandbox_settings() -> None:
    env = {"PREFECT_SANDBOX_ISOLATION": "none", "prefect_sandbox_input_roots": "/", "TZ": "UTC"}
    assert _refused({}, job_variables={"env": env}) == [
        "job_variables.env.PREFECT_SANDBOX_ISOLATION",
        "job_variables.env.prefect_sandbox_input_roots",
    ]
    assert _refused({}, job_variables={"env": {"TZ": "UTC"}, "working_dir": "/tmp"}) == []


def test_a_run_may_not_send_a_sweep_to_a_dask_cluster_of_its_choosing() -> None:
    assert _refused({"task_runner": "dask:tcp://203.0.113.7:8786"}) == ["task_runner"]
    assert _refused({"task_runner": "dask"}) == []
    assert _refused({"task_runner": None}) == []
    own = {"task_runner": "dask:tcp://scheduler.internal:8786"}
    assert _refused(own, deployed=own) == []


def test_the_refusal_names_each_parameter_and_survives_pickling() -> None:
    error = ParameterRefusedError("refused: backend", refused=["backend"])
    copy = pickle.loads(pickle.dumps(error))
    assert isinstance(copy, PermissionError) and copy.refused == ["backend"]


def test_input_roots_are_read_comma_separated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREFECT_SANDBOX_INPUT_ROOTS", "/srv/notebooks, s3://team-data/inputs,")
    assert PrefectSandboxSettings().input_roots == ["/srv/notebooks", "s3://team-data/inputs"]
    monkeypatch.delenv("PREFECT_SANDBOX_INPUT_ROOTS")
    assert PrefectSandboxSettings().input_roots == []
    monkeypatch.setenv("PREFECT_SANDBOX_OUTPUT_ROOTS", "/srv/results,s3://team-results/runs")
    assert PrefectSandboxSettings().output_roots == ["/srv/results", "s3://team-results/runs"]


def test_an_input_that_is_a_link_is_followed_only_to_a_file_in_its_folder(
    tmp_path: Path,
) -> None:
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    (inputs / "co2.csv").write_text("ppm\n")
    (tmp_path / "id_rsa").write_text("PRIVATE KEY")
    (inputs / "latest.csv").symlink_to("co2.csv")
    links = {
        "etc": ("/etc", "a link that leaves its folder"),
        "key": (tmp_path / "id_rsa", "a link that leaves"),
        "here": (inputs, "a link to a folder"),
        "gone": (inputs / "nothing", "a link to no file"),
    }
    for name, (target, _) in links.items():
        (inputs / name).symlink_to(target)
    pairs, skipped = fetch_inputs([str(inputs / "latest.csv")], tmp_path / "staging", None)
    assert [source.read_text() for source, _ in pairs] == ["ppm\n"]
    assert skipped == []
    for name, (_, why) in links.items():
        with pytest.raises(FileTransferError, match=why) as info:
            fetch_inputs([str(inputs / "co2.csv"), str(inputs / name)], tmp_path / "s", None)
        assert info.value.path == str(inputs / name)
