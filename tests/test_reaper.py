"""The reaper on Prefect's real ephemeral API: which labelled sandboxes it kills, its dry run and
its table; and H26, a flow process SIGKILLed mid-cell (no hook runs), on the local backend and
on the E2B emulator, with a live run's sandbox beside it left alone."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from uuid import UUID

import psutil
import pytest
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    ArtifactFilterKey,
)
from prefect.client.schemas.objects import FlowRun
from prefect.context import FlowRunContext
from prefect.exceptions import ObjectNotFound
from prefect.settings import PREFECT_API_URL
from prefect.states import Completed, Crashed, Pending, Running
from pydantic import SecretStr

from prefect_sandbox import E2BBackend, E2BCredentials, LocalKernelBackend
from prefect_sandbox.blocks.base import SandboxBackend
from prefect_sandbox.flows import ReapFailedError, areap_sandboxes, reap_sandboxes
from prefect_sandbox.flows.hooks import kill_labelled_sandboxes
from prefect_sandbox.flows.limits import SWEEP_LIMIT_PREFIX, sweep_limit_name
from prefect_sandbox.flows.reaper import (
    REAPED_ARTIFACT_KEY,
    ReapedSandbox,
    last_heartbeats,
    reap_reason,
)
from prefect_sandbox.sandbox.base import SandboxHandle
from prefect_sandbox.sandbox.labels import (
    API_LABEL,
    CREATED_AT_LABEL,
    FLOW_RUN_ID_LABEL,
    FLOW_RUN_NAME_LABEL,
    MARKER_LABEL,
    api_id,
    created_at,
    flow_run_labels,
    with_created_at,
)
from prefect_sandbox.tasks.sandbox import prefect_api_id
from prefect_sandbox.testing.e2b import E2BEmulator, Fault
from tests.conftest import ROOT, flow_run_logs

pytestmark = pytest.mark.usefixtures("prefect_api")

POOL_OWNER_LABEL = "prefect-sandbox-pool-owner"


def test_the_sync_twin_has_the_flows_signature() -> None:
    assert inspect.signature(reap_sandboxes) == inspect.signature(areap_sandboxes.fn)


def test_created_at_round_trips_to_the_second_in_label_safe_characters() -> None:
    when = datetime(2026, 12, 1, 7, 37, 47, 900000, tzinfo=UTC)
    labels = with_created_at({"a": "b"}, when)
    assert labels == {"a": "b", CREATED_AT_LABEL: "20261201T073747Z"}
    assert created_at(labels) == when.replace(microsecond=0)
    assert created_at({}) is None
    assert created_at({CREATED_AT_LABEL: "yesterday"}) is None


def test_reap_reason_kills_final_missing_silent_and_too_old_and_nothing_else() -> None:
    def run(state: Any) -> FlowRun:
        return FlowRun(flow_id=uuid.uuid4(), state=state)

    assert reap_reason(None, None, None) == "no such flow run"
    assert reap_reason(None, 60.0, 3600, same_api=False) is None
    assert reap_reason(None, 7200.0, 3600, same_api=False) == "older than 3600 s"
    assert reap_reason(run(Completed()), 1.0, 3600) == "flow run Completed"
    assert reap_reason(run(Crashed()), None, None) == "flow run Crashed"
    assert reap_reason(run(Running()), 7200.0, 3600) == "older than 3600 s"
    assert reap_reason(run(Running()), 60.0, 3600) is None
    assert reap_reason(run(Running()), None, 3600) is None
    assert reap_reason(run(Running()), 7200.0, None) is None
    hour = {"heartbeat_timeout_s": 600.0, "heartbeat_age_s": 3600.0}
    assert reap_reason(run(Running()), 60.0, None, **hour) == "no heartbeat for 3600 s"
    assert reap_reason(run(Pending()), 60.0, None, **hour) is None
    assert reap_reason(run(Running()), 60.0, None, heartbeat_age_s=None) is None
    assert reap_reason(run(Running()), 60.0, None, heartbeat_age_s=3600.0) is None
    # A process beating every 1500 s is not dead 3600 s after its last beat.
    slow = {**hour, "heartbeat_period_s": 1500.0}
    assert reap_reason(run(Running()), 60.0, None, **slow) is None
    assert reap_reason(run(Running()), 60.0, None, **{**slow, "heartbeat_period_s": 180.0})


@flow
async def _finished() -> UUID:
    context = FlowRunContext.get()
    assert context is not None and context.flow_run is not None
    return context.flow_run.id


async def _reaper_artifact(state_flow_run_id: UUID) -> list[dict[str, str]]:
    async with get_client() as client:
        artifacts = await client.read_artifacts(
            artifact_filter=ArtifactFilter(
                key=ArtifactFilterKey(any_=[REAPED_ARTIFACT_KEY]),
                flow_run_id=ArtifactFilterFlowRunId(any_=[state_flow_run_id]),
            )
        )
    assert len(artifacts) == 1
    data = artifacts[0].data
    rows = json.loads(data) if isinstance(data, str) else data
    assert isinstance(rows, list)
    return rows


async def _reap(**parameters: Any) -> tuple[list[ReapedSandbox], list[dict[str, str]]]:
    """Run the reaper flow; return what it reaped and its artifact's rows."""
    state = await areap_sandboxes(return_state=True, **parameters)
    reaped = await state.aresult()
    assert state.state_details.flow_run_id is not None
    return reaped, await _reaper_artifact(state.state_details.flow_run_id)


async def test_a_local_sandbox_whose_handle_is_half_written_is_not_listed() -> None:
    from prefect_sandbox.sandbox.backends.kernel.host import runtime_base

    half_made = runtime_base() / f"local-{uuid.uuid4().hex[:12]}"
    half_made.mkdir()
    try:
        (half_made / "handle.json").write_text('{"backend": "lo')
        listed = await LocalKernelBackend().list_sandboxes({})
        assert half_made.name not in {handle.sandbox_id for handle in listed}
    finally:
        shutil.rmtree(half_made)


def _ghost(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The labels a flow run of this API that no longer exists gave its sandbox just now."""
    labels = {**flow_run_labels(str(uuid.uuid4()), "ghost"), API_LABEL: prefect_api_id()}
    return with_created_at({**labels, **(extra or {})})


def _only(
    sandbox_ids: set[str], reaped: list[ReapedSandbox], rows: list[dict[str, str]]
) -> tuple[list[ReapedSandbox], list[dict[str, str]]]:
    """What concerns this test's sandboxes (earlier tests of the session may leave others on
    this machine's local backend)."""
    return (
        [entry for entry in reaped if entry.sandbox_id in sandbox_ids],
        [row for row in rows if row["sandbox"] in sandbox_ids],
    )


async def test_it_kills_sandboxes_of_finished_missing_and_too_old_runs_and_spares_the_rest() -> (
    None
):
    backend = LocalKernelBackend(interrupt_grace_s=2.0)
    finished = str(await _finished())
    async with get_client() as client:
        running = await client.create_flow_run(_finished, state=Running())
    hour_ago = datetime.now(UTC) - timedelta(hours=1)
    made = {
        "finished": with_created_at(flow_run_labels(finished, "done")),
        "missing": _ghost(),
        # A run of another API (the CLI's temporary server), or of none we can tell: its
        # absence here says nothing.
        "other-api": _ghost({API_LABEL: api_id("http://elsewhere:4200/api")}),
        "unknown-api": with_created_at(flow_run_labels(str(uuid.uuid4()), "ghost")),
        "too-old": with_created_at(flow_run_labels(str(running.id), "old"), hour_ago),
        "live": with_created_at(flow_run_labels(str(running.id), "young")),
        "unlabelled-run": {MARKER_LABEL: "true", FLOW_RUN_NAME_LABEL: "no-id"},
        "pooled": {MARKER_LABEL: "true", POOL_OWNER_LABEL: str(os.getpid())},
    }
    ids = {}
    try:
        for name, labels in made.items():
            sandbox = await backend.create(labels)
            ids[name] = sandbox.handle.sandbox_id
            await sandbox.close()
        doomed = {ids["finished"]: "flow run Completed", ids["missing"]: "no such flow run"}
        doomed[ids["too-old"]] = "older than 1800 s"

        reaped, rows = await _reap(backends=[backend], max_age_s=1800, dry_run=True)
        reaped, rows = _only(set(ids.values()), reaped, rows)
        assert {entry.sandbox_id: entry.why for entry in reaped} == doomed
        assert not any(entry.killed for entry in reaped)
        assert set(ids.values()) <= {h.sandbox_id for h in await backend.list_sandboxes({})}
        assert {row["sandbox"]: row["result"] for row in rows} == dict.fromkeys(
            doomed, "would kill"
        )

        reaped, rows = await _reap(backends=[backend], max_age_s=1800)
        reaped, rows = _only(set(ids.values()), reaped, rows)
        assert {entry.sandbox_id: entry.why for entry in reaped} == doomed
        assert all(entry.killed and entry.error is None for entry in reaped)
        left = {h.sandbox_id for h in await backend.list_sandboxes({})}
        assert not left & set(doomed)
        spared = ["live", "unlabelled-run", "pooled", "other-api", "unknown-api"]
        assert {ids[name] for name in spared} <= left
        by_sandbox = {row["sandbox"]: row for row in rows}
        assert by_sandbox[ids["missing"]]["state"] == "missing"
        assert by_sandbox[ids["finished"]]["state"] == "Completed"
        assert by_sandbox[ids["too-old"]]["state"] == "Running"
        assert 3500 < float(by_sandbox[ids["too-old"]]["age (s)"]) < 3700
        assert {row["result"] for row in rows} == {"killed"}
    finally:
        for handle in await backend.list_sandboxes({}):
            if handle.sandbox_id in ids.values():
                await (await backend.attach(handle)).kill()


async def test_by_default_it_sweeps_the_local_backend_and_every_saved_backend_block(
    e2b_backend: tuple[E2BBackend, dict[str, str]], e2b_emulator: E2BEmulator
) -> None:
    saved, spec = e2b_backend
    scope = {"test-id": spec["test_id"]}
    name = f"reaper-{spec['test_id'][:12]}"
    await saved.save(name)
    ghost = _ghost(scope)
    local = await LocalKernelBackend().create(ghost)
    remote = await saved.create(ghost)
    await local.close()
    await remote.close()
    try:
        reaped = await areap_sandboxes(labels=scope)
        assert {(e.backend, e.sandbox_id, e.killed) for e in reaped} == {
            ("local", local.handle.sandbox_id, True),
            ("e2b", remote.handle.sandbox_id, True),
        }
        assert e2b_emulator.sandbox_ids(scope) == []
        assert await LocalKernelBackend().list_sandboxes(scope) == []
    finally:
        await E2BBackend.adelete(name)
        await local.kill()
        await remote.kill()


async def test_a_sandbox_or_backend_that_fails_does_not_stop_the_others(
    e2b_backend: tuple[E2BBackend, dict[str, str]], e2b_emulator: E2BEmulator
) -> None:
    remote_backend, spec = e2b_backend
    scope = {"test-id": spec["test_id"]}
    ghost = _ghost(scope)
    remote = await remote_backend.create(ghost)
    local = await LocalKernelBackend().create(ghost)
    await remote.close()
    await local.close()
    wrong_key = remote_backend.model_copy(
        update={"credentials": E2BCredentials(api_key=SecretStr("wrong"), api_url=e2b_emulator.url)}
    )
    e2b_emulator.inject(Fault("delete", status=500, times=None))
    try:
        state = await areap_sandboxes(
            backends=[wrong_key, remote_backend, LocalKernelBackend()],
            labels=scope,
            return_state=True,
        )
    finally:
        e2b_emulator.clear_faults()
    assert state.is_failed()
    with pytest.raises(ReapFailedError) as failed:
        await state.aresult()
    assert failed.value.failed == ["listing e2b-sandbox", remote.handle.sandbox_id]
    assert await LocalKernelBackend().list_sandboxes(scope) == []
    assert state.state_details.flow_run_id is not None
    rows = await _reaper_artifact(state.state_details.flow_run_id)
    results = {row["sandbox"]: row["result"] for row in rows}
    assert results[local.handle.sandbox_id] == "killed"
    assert results[remote.handle.sandbox_id].startswith("error: ")
    assert results[""].startswith("error: ")
    assert await remote.kill()


async def _limit_names() -> set[str]:
    async with get_client() as client:
        limits = await client.read_global_concurrency_limits(limit=200)
    return {limit.name for limit in limits}


async def test_it_deletes_the_limits_of_sweeps_crashed_or_gone_and_keeps_a_running_sweeps() -> None:
    async with get_client() as client:
        runs = {
            name: await client.create_flow_run(_finished, state=Running())
            for name in ("crashed", "deleted", "running")
        }
        limits = {name: sweep_limit_name(run.id) for name, run in runs.items()}
        limits["not-a-run"] = f"{SWEEP_LIMIT_PREFIX}not-a-run-{uuid.uuid4().hex}"
        for limit in limits.values():
            await client.create_global_concurrency_limit(
                GlobalConcurrencyLimitCreate(name=limit, limit=2)
            )
        await client.set_flow_run_state(runs["crashed"].id, Crashed(), force=True)
        await client.delete_flow_run(runs["deleted"].id)
    # Sweep no sandbox: only the limits are at stake here.
    nothing = {"backends": [LocalKernelBackend()], "labels": {"test-id": uuid.uuid4().hex}}
    try:
        await areap_sandboxes(dry_run=True, **nothing)
        assert set(limits.values()) <= await _limit_names()

        state = await areap_sandboxes(return_state=True, **nothing)
        await state.aresult()
        left = await _limit_names()
        assert limits["crashed"] not in left and limits["deleted"] not in left
        assert {limits["running"], limits["not-a-run"]} <= left
        assert state.state_details.flow_run_id is not None
        logged = [log.message for log in await flow_run_logs(str(state.state_details.flow_run_id))]
        deleted = [message for message in logged if message.startswith("Deleted concurrency")]
        assert sorted(deleted) == sorted(
            [
                f"Deleted concurrency limit {limits['crashed']} of sweep {runs['crashed'].id} "
                "(flow run Crashed)",
                f"Deleted concurrency limit {limits['deleted']} of sweep {runs['deleted'].id} "
                "(no such flow run)",
            ]
        )
    finally:
        async with get_client() as client:
            for limit in limits.values():
                with contextlib.suppress(ObjectNotFound):
                    await client.delete_global_concurrency_limit_by_name(limit)


_VICTIM = """
import asyncio, json, os
from prefect_sandbox import E2BBackend, E2BCredentials, LocalKernelBackend
from prefect_sandbox.flows import amodeling_pipeline

spec = json.loads(os.environ["REAPER_TEST_VICTIM"])
if spec["backend"] == "e2b":
    credentials = E2BCredentials(
        api_key=spec["api_key"], api_url=spec["url"], sandbox_url=spec["url"]
    )
    backend = E2BBackend(credentials=credentials, metadata={"test-id": spec["test_id"]})
else:
    backend = LocalKernelBackend()
cell = "print('victim-cell-running', flush=True)\\nimport time\\ntime.sleep(600)"
pipeline = amodeling_pipeline.with_options(flow_run_name=spec["name"])
asyncio.run(pipeline(stages={"sleep": [cell]}, backend=backend, storage=spec["storage"]))
"""


@dataclass
class Victim:
    """A flow run in a process of its own, its one cell sleeping in its sandbox."""

    process: subprocess.Popen[bytes]
    handle: SandboxHandle

    @property
    def flow_run_id(self) -> str:
        return self.handle.labels[FLOW_RUN_ID_LABEL]


async def _start_victim(
    backend: SandboxBackend,
    spec: dict[str, str],
    log: Path,
    timeout_s: float = 90,
    script: str = _VICTIM,
) -> Victim:
    """Run a one-cell pipeline (or another flow ``script`` that reads the same spec and prints
    the same line) in a child process on this session's Prefect API; return once its cell is
    running."""
    name = f"reaper-victim-{uuid.uuid4().hex[:8]}"
    env = dict(os.environ)
    env["PREFECT_API_URL"] = str(PREFECT_API_URL.value())
    env["REAPER_TEST_VICTIM"] = json.dumps({**spec, "name": name})
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-c", script], env=env, cwd=ROOT, stdout=out, stderr=out
        )
    deadline = time.monotonic() + timeout_s
    while b"victim-cell-running" not in log.read_bytes():
        assert process.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)
    handles = await backend.list_sandboxes({FLOW_RUN_NAME_LABEL: name})
    assert len(handles) == 1
    # The flow labelled it with its API (the same as this process's) and its creation time.
    assert handles[0].labels[API_LABEL] == prefect_api_id()
    assert CREATED_AT_LABEL in handles[0].labels
    return Victim(process, handles[0])


def _sigkill(victim: Victim) -> None:
    victim.process.send_signal(signal.SIGKILL)
    victim.process.wait(timeout=10)


@asynccontextmanager
async def _orphan_and_live_run(
    backend: SandboxBackend, spec: dict[str, str], tmp_path: Path
) -> AsyncIterator[tuple[Victim, Victim]]:
    """An orphan (its flow process SIGKILLed mid-cell, its run still Running in the API) and,
    made after it, a live run mid-cell; the live one is ended on exit."""
    orphan = await _start_victim(backend, spec, tmp_path / "orphan.log")
    _sigkill(orphan)
    # Seconds between the two runs' heartbeats (and creation times), however fast this machine.
    await asyncio.sleep(3)
    live = await _start_victim(backend, spec, tmp_path / "live.log")
    try:
        yield orphan, live
    finally:
        if live.process.poll() is None:
            _sigkill(live)
        await kill_labelled_sandboxes(backend, live.flow_run_id, "test over")
        await kill_labelled_sandboxes(backend, orphan.flow_run_id, "test over")


async def _state_name(flow_run_id: str) -> str | None:
    async with get_client() as client:
        run = await client.read_flow_run(UUID(flow_run_id))
    return None if run.state is None else run.state.name


async def _timeout_between(orphan: Victim, live: Victim, timeout_s: float = 30) -> float:
    """A heartbeat timeout that the orphan's last heartbeat is past and the live run's is not,
    once the API has both (the live run's first came after the orphan was killed).

    A second short of the orphan's silence so far: the orphan stays past it however late the
    reaper looks, and the live run stays within it unless the reaper looks later by nearly
    the gap between their heartbeats (over 3 s)."""
    async with get_client() as client:
        runs = [await client.read_flow_run(UUID(v.flow_run_id)) for v in (orphan, live)]
    deadline = time.monotonic() + timeout_s
    while len(beats := await last_heartbeats(runs)) < 2:
        assert time.monotonic() < deadline, f"heartbeats on record: {beats}"
        await asyncio.sleep(0.5)
    older, younger = beats[orphan.flow_run_id].last, beats[live.flow_run_id].last
    assert (younger - older).total_seconds() > 3
    return (datetime.now(UTC) - older).total_seconds() - 1


@pytest.mark.timeout(300)
async def test_h26_local_sigkilled_flow_its_orphan_is_reaped_a_live_run_is_not(
    tmp_path: Path,
) -> None:
    backend = LocalKernelBackend()
    spec = {"backend": "local", "storage": str(tmp_path / "out")}
    async with _orphan_and_live_run(backend, spec, tmp_path) as (orphan, live):
        assert await _state_name(orphan.flow_run_id) == "Running"
        orphan_dir = Path(orphan.handle.connection["runtime_dir"])
        orphan_pid = int((orphan_dir / "kernel.pid").read_text())
        live_pid = int((Path(live.handle.connection["runtime_dir"]) / "kernel.pid").read_text())
        # No hook ran: the orphan's folders are still listed.
        assert orphan.handle.sandbox_id in {h.sandbox_id for h in await backend.list_sandboxes({})}

        ours = {orphan.handle.sandbox_id, live.handle.sandbox_id}
        # Its run still looks alive to the API, and its last heartbeat is recent.
        reaped, _ = _only(ours, *await _reap(backends=[backend], dry_run=True))
        assert reaped == []

        # Its heartbeats stopped when it was killed; the live run's go on.
        stale = {"heartbeat_timeout_s": await _timeout_between(orphan, live), "max_age_s": None}
        reaped, rows = _only(ours, *await _reap(backends=[backend], dry_run=True, **stale))
        assert [(e.sandbox_id, e.killed) for e in reaped] == [(orphan.handle.sandbox_id, False)]
        assert [row["result"] for row in rows] == ["would kill"]
        assert orphan_dir.exists()

        reaped, rows = _only(ours, *await _reap(backends=[backend], **stale))
        assert [(e.sandbox_id, e.killed) for e in reaped] == [(orphan.handle.sandbox_id, True)]
        assert reaped[0].flow_run_state == "Running"
        assert reaped[0].why.startswith("no heartbeat for")
        assert [row["result"] for row in rows] == ["killed"]
        listed = {h.sandbox_id for h in await backend.list_sandboxes({})}
        assert orphan.handle.sandbox_id not in listed
        assert not orphan_dir.exists()
        assert not _alive(orphan_pid)
        assert live.handle.sandbox_id in listed
        assert _alive(live_pid)
        assert live.process.poll() is None


def _alive(pid: int) -> bool:
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


@pytest.fixture
def e2b_backend(e2b_emulator: E2BEmulator) -> Iterator[tuple[E2BBackend, dict[str, str]]]:
    test_id = uuid.uuid4().hex
    credentials = E2BCredentials(
        api_key=SecretStr(e2b_emulator.api_key),
        api_url=e2b_emulator.url,
        sandbox_url=e2b_emulator.url,
    )
    spec = {
        "backend": "e2b",
        "url": e2b_emulator.url,
        "api_key": e2b_emulator.api_key,
        "test_id": test_id,
    }
    yield E2BBackend(credentials=credentials, metadata={"test-id": test_id}), spec


@pytest.mark.timeout(300)
async def test_h26_e2b_sigkilled_flow_its_orphan_is_found_silent_and_reaped_once_crashed(
    e2b_emulator: E2BEmulator,
    e2b_backend: tuple[E2BBackend, dict[str, str]],
    tmp_path: Path,
) -> None:
    backend, spec = e2b_backend
    spec = {**spec, "storage": str(tmp_path / "out")}
    scope = {"test-id": spec["test_id"]}
    async with _orphan_and_live_run(backend, spec, tmp_path) as (orphan, live):
        both = sorted([orphan.handle.sandbox_id, live.handle.sandbox_id])
        # The SIGKILLed process left its sandbox running at the vendor, its run Running.
        assert e2b_emulator.sandbox_ids(scope) == both
        assert await _state_name(orphan.flow_run_id) == "Running"
        reaped, _ = await _reap(backends=[backend], labels=scope)
        assert reaped == []
        # Its heartbeats stopped; the live run's go on.
        stale = await _timeout_between(orphan, live)
        reaped, rows = await _reap(
            backends=[backend], labels=scope, heartbeat_timeout_s=stale, dry_run=True
        )
        assert [(e.sandbox_id, e.why[:12], e.killed) for e in reaped] == [
            (orphan.handle.sandbox_id, "no heartbeat", False)
        ]
        assert e2b_emulator.sandbox_ids(scope) == both

        # What Prefect's zombie detection does once the run's heartbeats stop.
        async with get_client() as client:
            await client.set_flow_run_state(UUID(orphan.flow_run_id), Crashed(), force=True)

        reaped, rows = await _reap(backends=[backend], labels=scope, dry_run=True)
        assert [(e.sandbox_id, e.why, e.killed) for e in reaped] == [
            (orphan.handle.sandbox_id, "flow run Crashed", False)
        ]
        assert [(row["state"], row["result"]) for row in rows] == [("Crashed", "would kill")]
        assert e2b_emulator.sandbox_ids(scope) == both

        reaped, rows = await _reap(backends=[backend], labels=scope)
        assert [(e.sandbox_id, e.killed) for e in reaped] == [(orphan.handle.sandbox_id, True)]
        assert [row["result"] for row in rows] == ["killed"]
        assert e2b_emulator.sandbox_ids(scope) == [live.handle.sandbox_id]
        assert live.process.poll() is None
