"""Faults both vendors share, written once and run on E2B and Daytona: the real SDKs against
the emulators, each fault injected with the one vocabulary of `prefect_sandbox.testing.faults`.

What only one vendor has (E2B's lifetime, Daytona's auto-stop and close codes) is in
tests/test_e2b_faults.py and tests/test_daytona.py.
"""

from __future__ import annotations

import itertools
import json
import logging
import pickle
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from prefect_sandbox.blocks.base import SandboxBackend
from prefect_sandbox.blocks.daytona import DaytonaBackend, DaytonaCredentials
from prefect_sandbox.blocks.e2b import E2BBackend, E2BCredentials
from prefect_sandbox.flows import PipelineFailedError, amodeling_pipeline
from prefect_sandbox.flows.hooks import kill_labelled_sandboxes
from prefect_sandbox.sandbox.base import Sandbox
from prefect_sandbox.sandbox.errors import (
    ForeignError,
    SandboxAuthError,
    SandboxNotFoundError,
    SandboxUnavailableError,
)
from prefect_sandbox.sandbox.labels import FLOW_RUN_ID_LABEL
from prefect_sandbox.testing.daytona import DaytonaEmulator
from prefect_sandbox.testing.e2b import E2BEmulator
from prefect_sandbox.testing.faults import Fault
from tests.conftest import stream_text, unpickled_without_vendors


@dataclass
class Vendor:
    """One vendor's emulator and a backend block pointed at it."""

    name: str
    emulator: E2BEmulator | DaytonaEmulator

    def backend(self, api_key: str | None = None) -> SandboxBackend:
        """A backend block for the emulator (with another API key, if given)."""
        if isinstance(self.emulator, E2BEmulator):
            credentials = E2BCredentials(
                api_key=api_key or self.emulator.api_key,
                api_url=self.emulator.url,
                sandbox_url=self.emulator.url,
            )
            return E2BBackend(credentials=credentials, lifetime_s=60, interrupt_grace_s=2.0)
        if api_key is None:
            # Found through the DAYTONA_* variables, as a user's would be.
            return DaytonaBackend(interrupt_grace_s=2.0)
        credentials_ = DaytonaCredentials(
            api_key=api_key, api_url=self.emulator.api_url, target=self.emulator.target
        )
        return DaytonaBackend(credentials=credentials_, interrupt_grace_s=2.0)

    def since(self, operation: str, start: float) -> list[float]:
        """When requests for ``operation`` arrived, from ``start`` on."""
        return [r.at for r in self.emulator.requests if r.operation == operation and r.at >= start]


@pytest.fixture(params=["e2b", "daytona"])
def vendor(request: pytest.FixtureRequest) -> Iterator[Vendor]:
    """Each vendor's session emulator; faults a test left unused are dropped afterwards."""
    fixture = "e2b_emulator" if request.param == "e2b" else "daytona_env"
    found = Vendor(request.param, request.getfixturevalue(fixture))
    yield found
    found.emulator.clear_faults()


@pytest.fixture
def labels() -> dict[str, str]:
    """Labels unique to one test, to find its sandboxes in the emulator."""
    return {"prefect-sandbox": "true", "test-id": uuid.uuid4().hex}


@pytest.fixture
async def box(vendor: Vendor, labels: dict[str, str]) -> AsyncIterator[Sandbox]:
    sandbox = await vendor.backend().create(labels)
    try:
        yield sandbox
    finally:
        vendor.emulator.clear_faults()
        await sandbox.kill()


async def test_create_waits_out_429s_as_retry_after_says(
    vendor: Vendor, labels: dict[str, str]
) -> None:
    vendor.emulator.inject(Fault("create", status=429, retry_after_s=1, times=2))
    start = time.monotonic()
    sandbox = await vendor.backend().create(labels)
    try:
        assert time.monotonic() - start >= 2.0
        tries = vendor.since("create", start)
        assert len(tries) == 3
        assert all(later - earlier >= 1.0 for earlier, later in itertools.pairwise(tries))
        assert vendor.emulator.faults.hits.count("create") >= 2
        assert vendor.emulator.sandbox_ids(labels) == [sandbox.handle.sandbox_id]
    finally:
        await sandbox.kill()


async def test_a_504_for_a_created_sandbox_leaves_no_orphan(
    vendor: Vendor, labels: dict[str, str]
) -> None:
    vendor.emulator.inject(Fault("create", status=504, after_call=True))
    sandbox = await vendor.backend().create(labels)
    try:
        assert vendor.emulator.sandbox_ids(labels) == [sandbox.handle.sandbox_id]
        assert (await sandbox.run_cell("print('one')")).status == "ok"
    finally:
        await sandbox.kill()
    assert vendor.emulator.sandbox_ids(labels) == []


async def test_a_create_that_stays_unavailable_says_so_with_status_and_operation(
    vendor: Vendor, labels: dict[str, str]
) -> None:
    vendor.emulator.inject(Fault("create", status=503, times=None))
    with pytest.raises(SandboxUnavailableError) as info:
        await vendor.backend().create(labels)
    vendor.emulator.clear_faults()
    assert (info.value.operation, info.value.status_code) == ("create", 503)
    assert vendor.emulator.sandbox_ids(labels) == []


async def test_idempotent_file_calls_are_retried_and_then_fail_with_status_and_operation(
    vendor: Vendor, box: Sandbox, tmp_path: Path
) -> None:
    source = tmp_path / "data.csv"
    source.write_text("a,b\n1,2\n")
    vendor.emulator.inject(Fault("upload", status=502), Fault("download", status=500))
    await box.upload(source, "data.csv")
    assert await box.download("data.csv", tmp_path / "back.csv") == source.stat().st_size
    assert (tmp_path / "back.csv").read_bytes() == source.read_bytes()
    vendor.emulator.inject(Fault("download", status=503, times=2))
    assert await box.download("data.csv", tmp_path / "again.csv") == source.stat().st_size
    # Four tries in all on both backends (request_retries=3 on E2B and on Daytona).
    vendor.emulator.inject(Fault("download", status=503, times=4))
    with pytest.raises(SandboxUnavailableError) as info:
        await box.download("data.csv", tmp_path / "never.csv")
    assert (info.value.status_code, info.value.operation) == (503, "download")
    assert info.value.sandbox_id == box.handle.sandbox_id


async def test_an_upload_that_keeps_failing_says_which_status(
    vendor: Vendor, box: Sandbox, tmp_path: Path
) -> None:
    source = tmp_path / "data.csv"
    source.write_text("a,b\n")
    for status in (502, 503, 500):
        vendor.emulator.inject(Fault("upload", status=status, times=4))
        with pytest.raises(SandboxUnavailableError) as info:
            await box.upload(source, "data.csv")
        assert (info.value.status_code, info.value.operation) == (status, "upload")
        assert info.value.sandbox_id == box.handle.sandbox_id


async def test_a_dropped_execute_is_reported_and_never_replayed(
    vendor: Vendor, box: Sandbox
) -> None:
    await box.run_cell("acc = []")
    vendor.emulator.inject(Fault("run_code", drop=True))
    with pytest.raises(SandboxUnavailableError) as info:
        await box.run_cell("acc.append(1); print(len(acc))")
    assert (info.value.status_code, info.value.operation) == (None, "run_cell")
    assert info.value.sandbox_id == box.handle.sandbox_id
    if vendor.name == "daytona":
        assert "not run again" in str(info.value)
    after = await box.run_cell("print(len(acc))")
    assert stream_text(after.outputs) == "1\n"


async def test_an_interrupt_from_outside_mid_cell_ends_it_with_keyboard_interrupt(
    vendor: Vendor, box: Sandbox
) -> None:
    # Another process's SIGINT (Daytona) or another client's interrupt (E2B): no timeout.
    await box.run_cell("x = 1")
    vendor.emulator.inject(Fault("run_code", interrupt_after_s=1.0))
    result = await box.run_cell("import time\ntime.sleep(60)", timeout_s=600)
    assert (result.status, result.state_lost, result.interrupted) == ("error", False, False)
    assert result.error is not None and result.error.ename == "KeyboardInterrupt"
    assert 1.0 <= result.duration_s < 30
    assert stream_text((await box.run_cell("print(x)")).outputs) == "1\n"


async def test_an_execute_answered_500_is_unavailable_and_not_retried(
    vendor: Vendor, box: Sandbox
) -> None:
    start = time.monotonic()
    vendor.emulator.inject(Fault("run_code", status=500))
    with pytest.raises(SandboxUnavailableError) as info:
        await box.run_cell("print('never')")
    assert (info.value.operation, info.value.status_code) == ("run_cell", 500)
    assert len(vendor.since("run_code", start)) == 1


async def test_an_expired_sandbox_is_not_found_everywhere(
    vendor: Vendor, labels: dict[str, str], tmp_path: Path
) -> None:
    backend = vendor.backend()
    box = await backend.create(labels)
    sandbox_id = box.handle.sandbox_id
    vendor.emulator.expire(sandbox_id)
    with pytest.raises(SandboxNotFoundError, match=sandbox_id) as info:
        await box.run_cell("print('late')")
    assert info.value.sandbox_id == sandbox_id
    source = tmp_path / "a.txt"
    source.write_text("a")
    with pytest.raises(SandboxNotFoundError):
        await box.upload(source, "a.txt")
    with pytest.raises(SandboxNotFoundError, match=sandbox_id):
        await backend.attach(box.handle)
    assert await box.kill() is False


async def test_a_refused_api_key_is_an_auth_error_that_never_shows_the_key(
    vendor: Vendor, labels: dict[str, str]
) -> None:
    secret = f"{vendor.name}_not_the_right_key_{uuid.uuid4().hex}"
    backend = vendor.backend(api_key=secret)
    with pytest.raises(SandboxAuthError) as info:
        await backend.create(labels)
    for text in (str(info.value), repr(info.value), pickle.dumps(info.value).hex()):
        assert secret not in text and secret.encode().hex() not in text
    assert vendor.emulator.api_key not in str(info.value)
    assert secret not in backend.model_dump_json()
    assert vendor.emulator.sandbox_ids(labels) == []


async def test_a_refused_api_key_crosses_a_dask_process_boundary_as_an_auth_error(
    vendor: Vendor, labels: dict[str, str], dask_pickling: None
) -> None:
    from distributed.core import error_message

    secret = f"{vendor.name}_not_the_right_key_{uuid.uuid4().hex}"
    with pytest.raises(SandboxAuthError) as info:
        await vendor.backend(api_key=secret).create(labels)
    # What a Dask worker sends back for a task that raised (a bare Exception if pickling fails).
    blob = error_message(info.value)["exception"].data
    assert secret.encode() not in blob
    copy = pickle.loads(blob)
    assert type(copy) is SandboxAuthError and str(copy) == str(info.value)
    # The vendor's exception travels as a stand-in naming it, never as itself.
    assert isinstance(info.value.__cause__, ForeignError)
    assert str(copy.__cause__) == str(info.value.__cause__)
    assert str(copy.__cause__).startswith(f"{vendor.name}.")
    # ... and a process that has no vendor SDK reads it whole.
    chain = unpickled_without_vendors(blob)
    assert chain[0] == "prefect_sandbox.sandbox.errors.SandboxAuthError"
    assert set(chain[1:]) == {"prefect_sandbox.sandbox.errors.ForeignError"}


async def test_a_vanished_sandbox_crosses_a_dask_process_boundary_without_the_vendor(
    vendor: Vendor, labels: dict[str, str], dask_pickling: None
) -> None:
    from distributed.core import error_message

    box = await vendor.backend().create(labels)
    vendor.emulator.expire(box.handle.sandbox_id)
    try:
        with pytest.raises(SandboxNotFoundError) as info:
            await box.run_cell("print('late')")
    finally:
        await box.kill()
    blob = error_message(info.value)["exception"].data
    chain = unpickled_without_vendors(blob)
    assert chain[0] == "prefect_sandbox.sandbox.errors.SandboxNotFoundError"
    assert set(chain[1:]) <= {
        "prefect_sandbox.sandbox.errors.ForeignError",
        "prefect_sandbox.sandbox.errors.SandboxNotFoundError",
    }


@pytest.mark.parametrize("name", ["e2b", "daytona"])
def test_emulator_runs_in_the_foreground_and_prints_the_sdk_settings(name: str) -> None:
    module = f"prefect_sandbox.testing.{name}"
    command = [sys.executable, "-m", module, "--api-key", f"{name}_fg"]
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as process:
        try:
            assert process.stdout is not None
            lines = [process.stdout.readline().strip() for _ in range(3)]
            settings = dict(line.split("=", 1) for line in lines)
            prefix = name.upper()
            assert list(settings) == _SETTINGS[name]
            assert settings[f"{prefix}_API_KEY"] == f"{name}_fg"
            assert settings[f"{prefix}_API_URL"].startswith("http://127.0.0.1:")
            listed = subprocess.run(
                [sys.executable, "-c", _LIST_SANDBOXES[name]],
                env={**settings, "PATH": ""},
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert listed.returncode == 0, listed.stderr
            assert listed.stdout == "[]\n"
        finally:
            process.terminate()
            assert process.wait(timeout=30) == 0


_SETTINGS = {
    "e2b": ["E2B_API_KEY", "E2B_API_URL", "E2B_SANDBOX_URL"],
    "daytona": ["DAYTONA_API_KEY", "DAYTONA_API_URL", "DAYTONA_TARGET"],
}
# The vendor's SDK, in a process of its own, lists the emulator's sandboxes: none yet.
_LIST_SANDBOXES = {
    "e2b": ("from e2b_code_interpreter import Sandbox\nprint(Sandbox.list().next_items())"),
    "daytona": ("from daytona import Daytona\nprint(list(Daytona().list()))"),
}


# --- the pipeline under faults on the clean-up and set-up paths ----------------------------


def _summary(output_dir: str | None) -> dict[str, Any]:
    summary: dict[str, Any] = json.loads((Path(output_dir or "") / "summary.json").read_text())
    return summary


@pytest.mark.usefixtures("prefect_api")
async def test_a_500_on_delete_is_retried_and_the_run_keeps_its_status(
    vendor: Vendor, tmp_path: Path
) -> None:
    vendor.emulator.inject(Fault("delete", status=500))
    start = time.monotonic()
    result = await amodeling_pipeline(
        stages={"one": ["print('ok')"]}, backend=vendor.backend(), storage=str(tmp_path)
    )
    assert result.status == "completed" and result.sandbox_killed_at is not None
    assert _summary(result.output_dir)["status"] == "completed"
    assert len(vendor.since("delete", start)) == 2
    assert vendor.emulator.sandbox_ids({FLOW_RUN_ID_LABEL: result.flow_run_id}) == []


@pytest.mark.usefixtures("prefect_api")
async def test_a_kill_that_keeps_failing_is_a_warning_naming_the_sandbox_not_a_lost_result(
    vendor: Vendor, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    vendor.emulator.inject(Fault("delete", status=500, times=None))
    try:
        with pytest.raises(PipelineFailedError) as info:
            await amodeling_pipeline(
                stages={"one": ["print('made')"], "two": ["raise ValueError('cell says no')"]},
                backend=vendor.backend(),
                storage=str(tmp_path),
            )
    finally:
        vendor.emulator.clear_faults()
    # The run's true status is its cell's, not the kill's; everything it made is stored.
    assert info.value.stage == "two"
    summary = _summary(info.value.output_dir)
    assert summary["status"] == "failed" and "cell says no" in summary["error"]
    assert [stage["status"] for stage in summary["stages"]] == ["ok", "failed"]
    assert summary["sandbox_killed_at"] is None
    sandbox_id = summary["sandbox_id"]
    assert f"Sandbox {sandbox_id} could not be killed" in caplog.text
    assert (Path(info.value.output_dir or "") / "executed.ipynb").is_file()
    alive = vendor.emulator.sandbox_ids({FLOW_RUN_ID_LABEL: summary["flow_run_id"]})
    assert alive == [sandbox_id]
    await kill_labelled_sandboxes(vendor.backend(), summary["flow_run_id"], "test clean-up")
    assert vendor.emulator.sandbox_ids({FLOW_RUN_ID_LABEL: summary["flow_run_id"]}) == []


# Made per test: a fault counts down the calls it hits. Each hits one set-up, once.
SET_UP_FAULTS: dict[str, Callable[[], list[Fault]]] = {
    "502-context-create": lambda: [Fault("create_context", status=502)],
    # The set-up's first execution (display hooks, the runner) loses its connection, and the
    # kill that follows meets a 500 once.
    "dropped-set-up": lambda: [Fault("run_code", drop=True), Fault("delete", status=500)],
    # The input's upload stays unavailable through the backend's own retries.
    "503-upload": lambda: [Fault("upload", status=503, times=4)],
}


@pytest.mark.parametrize("faults", sorted(SET_UP_FAULTS))
@pytest.mark.usefixtures("prefect_api")
async def test_one_failed_set_up_is_met_with_a_fresh_sandbox(
    vendor: Vendor, tmp_path: Path, caplog: pytest.LogCaptureFixture, faults: str
) -> None:
    caplog.set_level(logging.INFO)
    given = tmp_path / "given.txt"
    given.write_text("input")
    vendor.emulator.inject(*SET_UP_FAULTS[faults]())
    start = time.monotonic()
    result = await amodeling_pipeline(
        stages={"one": ["open('made.txt', 'w').write(open('given.txt').read() + ' used')"]},
        inputs=[str(given)],
        artifacts=["made.txt"],
        backend=vendor.backend(),
        storage=str(tmp_path / "out"),
    )
    assert any(r.faulted for r in vendor.emulator.requests if r.at >= start), "no fault hit"
    assert result.status == "completed" and result.setup_attempts == 2
    summary = _summary(result.output_dir)
    assert summary["setup_attempts"] == 2 and summary["warnings"] == []
    assert (Path(result.output_dir) / "made.txt").read_text() == "input used"
    told = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    assert any("trying again in" in line for line in told)
    # The real cause, never the SDK's guess at one for a 502.
    assert not [line for line in told if "likely due to sandbox timeout" in line]
    assert vendor.emulator.sandbox_ids({FLOW_RUN_ID_LABEL: result.flow_run_id}) == []


@pytest.mark.usefixtures("prefect_api")
async def test_a_session_meets_one_failed_set_up_with_a_fresh_sandbox(
    vendor: Vendor, tmp_path: Path
) -> None:
    from prefect import flow

    from prefect_sandbox.flows import sandbox_session

    given = tmp_path / "given.txt"
    given.write_text("input")
    out = tmp_path / "out"
    vendor.emulator.inject(Fault("create_context", status=502))

    @flow
    async def agent() -> str:
        async with sandbox_session(
            backend=vendor.backend(), inputs=[str(given)], artifacts=["made.txt"], storage=str(out)
        ) as session:
            done = await session.run_cell("open('made.txt', 'w').write(open('given.txt').read())")
            return done.status

    assert await agent() == "ok"
    [folder] = out.iterdir()
    summary = _summary(str(folder))
    assert summary["status"] == "completed" and summary["setup_attempts"] == 2
    assert (folder / "made.txt").read_text() == "input"
    assert vendor.emulator.sandbox_ids({FLOW_RUN_ID_LABEL: summary["flow_run_id"]}) == []


@pytest.mark.usefixtures("prefect_api")
async def test_a_set_up_that_keeps_failing_kills_each_sandbox_and_stores_the_summary(
    vendor: Vendor,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    caplog.set_level(logging.INFO)
    monkeypatch.setenv("PREFECT_SANDBOX_SETUP_ATTEMPTS", "2")
    vendor.emulator.inject(Fault("create_context", status=502, times=None))
    start = time.monotonic()
    try:
        with pytest.raises(PipelineFailedError) as info:
            await amodeling_pipeline(
                stages={"one": ["print('never')"]}, backend=vendor.backend(), storage=str(tmp_path)
            )
    finally:
        vendor.emulator.clear_faults()
    assert isinstance(info.value.__cause__, SandboxUnavailableError)
    summary = _summary(info.value.output_dir)
    assert summary["status"] == "failed" and summary["setup_attempts"] == 2
    assert summary["stages"] == [
        {**summary["stages"][0], "name": "one", "status": "not_run"},
    ]
    assert summary["error"] == str(info.value)
    # The real cause, not the SDK's guess at one.
    assert "Bad Gateway" in summary["error"] and "set-up failed 2 times" in summary["error"]
    assert "likely due to sandbox timeout" not in summary["error"]
    assert "set-up failed; killing it" in caplog.text
    assert "could not be killed" not in caplog.text
    assert len(vendor.since("delete", start)) >= 2
    assert vendor.emulator.sandbox_ids({FLOW_RUN_ID_LABEL: summary["flow_run_id"]}) == []


@pytest.mark.usefixtures("prefect_api")
async def test_a_first_cell_that_cannot_reach_the_sandbox_is_named_in_the_summary(
    vendor: Vendor, tmp_path: Path
) -> None:
    # The set-up's one execution (display hooks, the runner) is served; the first cell's
    # execute is answered 500.
    vendor.emulator.inject(Fault("run_code"), Fault("run_code", status=500))
    with pytest.raises(PipelineFailedError) as info:
        await amodeling_pipeline(
            stages={"one": ["print('never')"], "two": ["print('never either')"]},
            backend=vendor.backend(),
            storage=str(tmp_path),
        )
    assert isinstance(info.value.__cause__, SandboxUnavailableError)
    assert (info.value.stage, info.value.cell_index) == ("one", 0)
    assert str(info.value).startswith("stage 'one', cell 0: ")
    summary = _summary(info.value.output_dir)
    assert [(s["name"], s["status"]) for s in summary["stages"]] == [
        ("one", "failed"),
        ("two", "not_run"),
    ]
    assert summary["stages"][0]["ename"] == "SandboxUnavailableError"
    notebook = json.loads((Path(info.value.output_dir or "") / "executed.ipynb").read_text())
    assert notebook["cells"][0]["outputs"][-1]["ename"] == "SandboxUnavailableError"
    assert vendor.emulator.sandbox_ids({FLOW_RUN_ID_LABEL: summary["flow_run_id"]}) == []


# The call an artifact listing makes: E2B's envd lists a folder; Daytona's is a script run by
# the toolbox's process exec.
_LISTING = {"e2b": "list_files", "daytona": "exec"}


@pytest.mark.usefixtures("prefect_api")
async def test_a_429_burst_on_listing_and_download_loses_no_artifact(
    vendor: Vendor, tmp_path: Path
) -> None:
    # Each burst outlasts the backend's own 4 tries.
    vendor.emulator.inject(
        Fault(_LISTING[vendor.name], status=429, retry_after_s=1, times=6),
        Fault("download", status=429, retry_after_s=1, times=5),
    )
    start = time.monotonic()
    result = await amodeling_pipeline(
        stages={"one": ["open('made.txt', 'w').write('made')"]},
        artifacts=["made.txt"],
        backend=vendor.backend(),
        storage=str(tmp_path),
    )
    faulted = [r.operation for r in vendor.emulator.requests if r.faulted and r.at >= start]
    assert faulted.count("download") == 5 and len(faulted) == 11
    assert result.status == "completed" and result.warnings == []
    assert (Path(result.output_dir) / "made.txt").read_text() == "made"
    assert _summary(result.output_dir)["warnings"] == []


@pytest.mark.usefixtures("prefect_api")
async def test_an_artifact_that_stays_rate_limited_is_named_in_warnings_and_the_state(
    vendor: Vendor, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PREFECT_SANDBOX_TRANSFER_RETRY_BUDGET_S", "1")
    vendor.emulator.inject(Fault("download", status=429, retry_after_s=1, times=None))
    try:
        state = await amodeling_pipeline(
            stages={"one": ["open('made.txt', 'w').write('made')"]},
            artifacts=["made.txt"],
            backend=vendor.backend(),
            storage=str(tmp_path),
            return_state=True,
        )
    finally:
        vendor.emulator.clear_faults()
    result = await state.result()
    assert state.is_completed() and result.status == "completed"
    [warning] = result.warnings
    assert warning.startswith("artifact 'made.txt' not downloaded: ") and "429" in warning
    assert "made.txt" in (state.message or "") and "1 warning" in (state.message or "")
    assert _summary(result.output_dir)["warnings"] == [warning]
    assert [a.path for a in result.artifacts] == ["executed.ipynb"]
