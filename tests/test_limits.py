"""The cap on live sandboxes: a backend block's ``max_live_sandboxes`` makes flow runs share the
Prefect global concurrency limit ``prefect-sandbox:<backend>``, on Prefect's real ephemeral API
with real local kernels. Each run's ``summary.json`` brackets its sandbox's life."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import nbformat
import pytest
from prefect import flow
from prefect.client.orchestration import PrefectClient, get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitUpdate
from prefect.client.schemas.responses import GlobalConcurrencyLimitResponse
from prefect.exceptions import CancelledRun, ObjectNotFound
from prefect.settings import PREFECT_API_URL, temporary_settings

from prefect_sandbox import (
    DaytonaBackend,
    DockerBackend,
    E2BBackend,
    LocalKernelBackend,
)
from prefect_sandbox.flows import (
    PipelineFailedError,
    amodeling_pipeline,
    arun_notebook,
    limits,
    sandbox_session,
)
from prefect_sandbox.flows.limits import SlotError, live_sandbox_limit_name
from prefect_sandbox.results import PipelineResult
from tests.conftest import max_alive_at_once, run_past_a_flow_timeout

if TYPE_CHECKING:
    from tests.test_deployments import PrefectStack

pytestmark = pytest.mark.usefixtures("prefect_api")

LIMIT = "prefect-sandbox:local"


async def _read_limit() -> GlobalConcurrencyLimitResponse:
    async with get_client() as client:
        return await client.read_global_concurrency_limit_by_name(LIMIT)


@pytest.fixture
async def no_limit() -> AsyncIterator[None]:
    """No ``prefect-sandbox:local`` limit before the test, nor after it."""

    async def delete() -> None:
        async with get_client() as client:
            with contextlib.suppress(ObjectNotFound):
                await client.delete_global_concurrency_limit_by_name(LIMIT)

    await delete()
    yield
    await delete()


def _summary(result: PipelineResult) -> dict[str, object]:
    summary: dict[str, object] = json.loads((Path(result.output_dir) / "summary.json").read_text())
    return summary


def _waiting_cell(go: Path) -> str:
    """A cell that marks its start in its working directory, then waits for ``go`` (60 s at
    most)."""
    return (
        "import os, time\n"
        "open('started.marker', 'w').write('1')\n"
        "deadline = time.monotonic() + 60\n"
        f"while not os.path.exists({str(go)!r}) and time.monotonic() < deadline:\n"
        "    time.sleep(0.05)"
    )


def test_each_backend_names_its_limit_by_its_handles_slug() -> None:
    assert [
        live_sandbox_limit_name(backend)
        for backend in (
            LocalKernelBackend(),
            E2BBackend.model_construct(),
            DaytonaBackend.model_construct(),
            DockerBackend.model_construct(),
        )
    ] == [LIMIT, "prefect-sandbox:e2b", "prefect-sandbox:daytona", "prefect-sandbox:docker"]


async def test_uncapped_runs_touch_no_limit(tmp_path: Path, no_limit: None) -> None:
    result = await amodeling_pipeline(stages={"one": ["x = 1"]}, storage=str(tmp_path))
    with pytest.raises(ObjectNotFound):
        await _read_limit()
    summary = _summary(result)
    # The handle's slug is the one the limit is named by.
    notebook = nbformat.read(Path(result.output_dir) / "executed.ipynb", as_version=4)
    assert notebook.metadata["prefect_sandbox"]["backend"] == LocalKernelBackend.backend_slug
    assert summary["sandbox_id"] == notebook.metadata["prefect_sandbox"]["sandbox_id"]
    created = datetime.fromisoformat(str(summary["sandbox_created_at"]))
    killed = datetime.fromisoformat(str(summary["sandbox_killed_at"]))
    assert created.tzinfo == UTC and created < killed <= datetime.now(UTC)


async def test_capped_runs_never_overlap_beyond_the_cap_and_all_complete(
    tmp_path: Path, no_limit: None, caplog: pytest.LogCaptureFixture
) -> None:
    work, go = tmp_path / "work", tmp_path / "go"
    work.mkdir()
    # Unisolated kernels, so that their cells can see the test's "go" file.
    backend = LocalKernelBackend(max_live_sandboxes=2, workdir_root=str(work), isolation="none")
    cell = _waiting_cell(go)

    def start() -> asyncio.Task[PipelineResult]:
        return asyncio.create_task(
            amodeling_pipeline(
                stages={"work": [cell]}, backend=backend, storage=str(tmp_path / "out")
            )
        )

    async def started(count: int) -> None:
        async with asyncio.timeout(60):
            while len(list(work.rglob("started.marker"))) < count:
                await asyncio.sleep(0.05)

    runs = [start(), start()]
    await started(2)
    runs.append(start())
    async with asyncio.timeout(30):
        while "Waiting for a slot of prefect-sandbox:local" not in caplog.text:
            await asyncio.sleep(0.05)
    await asyncio.sleep(0.5)
    assert len(list(work.rglob("started.marker"))) == 2
    go.touch()
    results = await asyncio.gather(*runs)

    assert [r.status for r in results] == ["completed"] * 3
    summaries = [_summary(r) for r in results]
    assert len({s["sandbox_id"] for s in summaries}) == 3
    assert max_alive_at_once(summaries) == 2
    # Created with the block's value on first use, and every slot given back.
    limit = await _read_limit()
    assert (limit.limit, limit.active_slots) == (2, 0)


async def test_two_blocks_with_different_caps_never_rewrite_the_limit_the_first_set(
    tmp_path: Path, no_limit: None, caplog: pytest.LogCaptureFixture
) -> None:
    await LocalKernelBackend(max_live_sandboxes=1).save("cap-one", overwrite=True)
    await LocalKernelBackend(max_live_sandboxes=3).save("cap-three", overwrite=True)
    one, three = (
        await LocalKernelBackend.aload("cap-one"),
        await LocalKernelBackend.aload("cap-three"),
    )

    async def run(backend: LocalKernelBackend) -> PipelineResult:
        return await amodeling_pipeline(
            stages={"one": ["x = 1"]}, backend=backend, storage=str(tmp_path)
        )

    await run(one)
    assert (await _read_limit()).limit == 1
    result = await run(three)
    # The second block's cap did not overwrite the first's: the limit stands, and says so.
    assert result.status == "completed"
    limit = await _read_limit()
    assert (limit.limit, limit.active_slots) == (1, 0)
    assert (
        f"Concurrency limit {LIMIT} has 1 slot(s), not 3 as the block's max_live_sandboxes "
        f"says: it is left as it is (a run never rewrites a limit). To change it: prefect gcl "
        f"update {LIMIT} --limit 3"
    ) in caplog.text
    # A size a user set stands too, for either block.
    async with get_client() as client:
        await client.update_global_concurrency_limit(LIMIT, GlobalConcurrencyLimitUpdate(limit=7))
    await run(one)
    await run(three)
    assert (await _read_limit()).limit == 7


async def test_a_sweeps_cap_is_a_limit_of_its_own_deleted_when_it_ends(
    tmp_path: Path, no_limit: None
) -> None:
    from prefect_sandbox.flows import asweep_notebook

    notebook = nbformat.v4.new_notebook()
    notebook.cells = [
        nbformat.v4.new_code_cell("x = 0", metadata={"tags": ["parameters"]}),
        nbformat.v4.new_code_cell("import time\ntime.sleep(1)"),
    ]
    nbformat.write(notebook, tmp_path / "nb.ipynb")
    # The block has no cap: only the sweep's limit caps the branches.
    result = await asweep_notebook(
        notebook=str(tmp_path / "nb.ipynb"),
        grid={"x": [1, 2, 3]},
        backend=LocalKernelBackend(),
        storage=str(tmp_path / "out"),
        max_live_sandboxes=1,
    )
    assert result.status == "completed"
    summaries = [
        json.loads((Path(str(branch.output_dir)) / "summary.json").read_text())
        for branch in result.branches
    ]
    assert max_alive_at_once(summaries) == 1
    async with get_client() as client:
        with pytest.raises(ObjectNotFound):
            await client.read_global_concurrency_limit_by_name(
                f"prefect-sandbox:sweep:{result.flow_run_id}"
            )
    with pytest.raises(ObjectNotFound):
        await _read_limit()


def _sleeping_notebook(path: Path) -> Path:
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [
        nbformat.v4.new_markdown_cell("# Wait"),
        nbformat.v4.new_code_cell(
            "import time\nopen('sleeping.marker', 'w').write('1')\ntime.sleep(120)"
        ),
    ]
    nbformat.write(notebook, path)
    return path


async def test_the_slot_is_released_after_a_failed_stage_and_a_cancelled_run(
    tmp_path: Path, no_limit: None, caplog: pytest.LogCaptureFixture
) -> None:
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    backend = LocalKernelBackend(max_live_sandboxes=1, workdir_root=str(work))
    with pytest.raises(PipelineFailedError) as info:
        await amodeling_pipeline(
            stages={"fail": ["raise ValueError('no')"]}, backend=backend, storage=str(out)
        )
    failed = json.loads((Path(info.value.output_dir or "") / "summary.json").read_text())
    assert failed["status"] == "failed" and failed["sandbox_killed_at"] is not None
    assert (await _read_limit()).active_slots == 0

    def start(stage: str) -> asyncio.Task[PipelineResult]:
        return asyncio.create_task(
            amodeling_pipeline(
                stages={stage: ["print('my turn')"]}, backend=backend, storage=str(out)
            )
        )

    async def waiting(count: int) -> None:
        async with asyncio.timeout(30):
            while caplog.text.count("Waiting for a slot of prefect-sandbox:local") < count:
                await asyncio.sleep(0.05)

    # A run that holds the only slot mid-cell; one cancelled while it waits; one that waits.
    sleeper = asyncio.create_task(
        arun_notebook(
            notebook=str(_sleeping_notebook(tmp_path / "wait.ipynb")),
            backend=backend,
            storage=str(out),
        )
    )
    async with asyncio.timeout(60):
        while not list(work.rglob("sleeping.marker")):
            await asyncio.sleep(0.05)
    doomed = start("doomed")
    await waiting(1)
    doomed.cancel()
    with pytest.raises(CancelledRun):
        await doomed
    waiter = start("after")
    await waiting(2)
    assert not waiter.done()
    sleeper.cancel()
    with pytest.raises(CancelledRun):
        await sleeper
    after = await waiter
    assert after.status == "completed"

    summaries = [json.loads(path.read_text()) for path in out.rglob("summary.json")]
    by_stage = {summary["stages"][0]["name"]: summary for summary in summaries}
    assert [by_stage[name]["status"] for name in ("fail", "doomed", "wait", "after")] == [
        "failed",
        "cancelled",
        "cancelled",
        "completed",
    ]
    # Cancelled while it waited: it never asked for a sandbox.
    doomed_summary = by_stage["doomed"]
    assert doomed_summary["sandbox_id"] is doomed_summary["sandbox_created_at"] is None
    lived = [by_stage[name] for name in ("fail", "wait", "after")]
    assert max_alive_at_once(lived) == 1
    killed = datetime.fromisoformat(by_stage["wait"]["sandbox_killed_at"])
    assert datetime.fromisoformat(by_stage["after"]["sandbox_created_at"]) >= killed
    assert (await _read_limit()).active_slots == 0


async def test_a_capped_run_past_its_flow_timeout_stores_everything_and_frees_its_slot(
    tmp_path: Path, no_limit: None
) -> None:
    # The slot's exit is shielded from the passed deadline while Prefect's own cancel scopes
    # (its lease renewal) are left where they were entered: both must hold at once.
    summary, _, _ = await run_past_a_flow_timeout(
        tmp_path, LocalKernelBackend(max_live_sandboxes=1)
    )
    assert summary["status"] == "failed" and summary["sandbox_killed_at"] is not None
    assert (await _read_limit()).active_slots == 0


def _api_error(code: int) -> httpx.HTTPStatusError:
    request = httpx.Request("POST", "http://127.0.0.1/api/v2/concurrency_limits/")
    return httpx.HTTPStatusError(
        f"{code} from the API", request=request, response=httpx.Response(code, request=request)
    )


def _failing(
    monkeypatch: pytest.MonkeyPatch, method: str, codes: list[int], *, forever: int | None = None
) -> list[str]:
    """Make the Prefect client's ``method`` answer each of ``codes`` in turn, then ``forever``
    every time (None: the API's own answer). Returns a log of the calls: the code or "ok"."""
    real = getattr(PrefectClient, method)
    calls: list[str] = []

    async def faulty(self: PrefectClient, *args: Any, **kwargs: Any) -> Any:
        code = codes[len(calls)] if len(calls) < len(codes) else forever
        calls.append(str(code or "ok"))
        if code is not None:
            raise _api_error(code)
        return await real(self, *args, **kwargs)

    monkeypatch.setattr(PrefectClient, method, faulty)
    return calls


Faults = Callable[..., list[str]]


@pytest.fixture
def faults(monkeypatch: pytest.MonkeyPatch) -> Faults:
    """`_failing` for this test, with the slot's retries and renewals made quick."""
    monkeypatch.setattr(limits, "RETRY_FIRST_DELAY_S", 0.01)
    monkeypatch.setattr(limits, "RENEW_EVERY_S", 0.05)
    return functools.partial(_failing, monkeypatch)


async def test_slot_faults_never_cost_the_summary(
    tmp_path: Path, no_limit: None, faults: Faults, caplog: pytest.LogCaptureFixture
) -> None:
    backend = LocalKernelBackend(max_live_sandboxes=1)
    # Taking the slot meets two 503s (SQLite locked); giving it back fails every time.
    takes = faults("increment_concurrency_slots_with_lease", [503, 503])
    releases = faults("release_concurrency_slots_with_lease", [], forever=500)
    result = await amodeling_pipeline(
        stages={"one": ["x = 1"]}, backend=backend, storage=str(tmp_path)
    )
    assert takes == ["503", "503", "ok"]
    assert result.status == "completed" and _summary(result)["status"] == "completed"
    assert len(releases) == limits.API_ATTEMPTS
    assert f"The slot of {LIMIT} was not given back" in caplog.text

    # A slot that cannot be taken at all: no sandbox, and the summary says why.
    faults("increment_concurrency_slots_with_lease", [], forever=503)
    with pytest.raises(PipelineFailedError) as info:
        await amodeling_pipeline(stages={"two": ["x = 2"]}, backend=backend, storage=str(tmp_path))
    summary = json.loads((Path(info.value.output_dir or "") / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["sandbox_id"] is None
    assert f"No slot of {LIMIT} could be taken" in summary["error"]


async def test_failed_renewals_keep_the_cap_and_a_lost_lease_stops_the_sandbox(
    tmp_path: Path, no_limit: None, faults: Faults, caplog: pytest.LogCaptureFixture
) -> None:
    work, go, out = tmp_path / "work", tmp_path / "go", tmp_path / "out"
    work.mkdir()
    backend = LocalKernelBackend(max_live_sandboxes=1, workdir_root=str(work), isolation="none")
    cell = _waiting_cell(go)
    # More failed renewals in a row than Prefect's own renewal tries (3) before it gives up.
    renewals = faults("renew_concurrency_lease", [503] * 5)

    def start() -> asyncio.Task[PipelineResult]:
        return asyncio.create_task(
            amodeling_pipeline(stages={"work": [cell]}, backend=backend, storage=str(out))
        )

    first = start()
    async with asyncio.timeout(60):
        while not list(work.rglob("started.marker")):
            await asyncio.sleep(0.05)
    second = start()
    async with asyncio.timeout(60):
        while renewals.count("ok") < 2 or "Waiting for a slot" not in caplog.text:
            await asyncio.sleep(0.05)
    assert renewals[:5] == ["503"] * 5
    assert len(list(work.rglob("started.marker"))) == 1 and not second.done()
    assert (await _read_limit()).active_slots == 1
    go.touch()
    results = await asyncio.gather(first, second)
    assert [r.status for r in results] == ["completed"] * 2
    assert max_alive_at_once([_summary(r) for r in results]) == 1

    # The server no longer has the lease (404): the sandbox is stopped, the run fails.
    faults("renew_concurrency_lease", [], forever=404)
    go.unlink()
    with pytest.raises(PipelineFailedError) as info:
        await amodeling_pipeline(stages={"lost": [cell]}, backend=backend, storage=str(out))
    summary = json.loads((Path(info.value.output_dir or "") / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["sandbox_killed_at"] is not None
    assert f"the lease on its slot of {LIMIT} was lost" in summary["error"]
    assert (await _read_limit()).active_slots == 0


async def test_a_session_whose_lease_is_lost_fails_with_its_summary(
    tmp_path: Path, no_limit: None, faults: Faults
) -> None:
    faults("renew_concurrency_lease", [], forever=404)
    out = tmp_path / "out"

    @flow
    async def agent() -> None:
        async with sandbox_session(
            backend=LocalKernelBackend(max_live_sandboxes=1), storage=str(out)
        ) as session:
            await session.run_cell("import time\ntime.sleep(60)")

    with pytest.raises(SlotError, match="was lost"):
        await agent()
    (summary_path,) = out.glob("*/summary.json")
    summary = json.loads(summary_path.read_text())
    assert summary["status"] == "failed" and summary["sandbox_killed_at"] is not None
    assert (await _read_limit()).active_slots == 0


@pytest.mark.timeout(400)
async def test_renewals_failing_until_the_lease_lapses_never_let_two_sandboxes_live(
    server: PrefectStack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a real ``prefect server`` (its repossessor frees lapsed leases): every renewal of the
    first run's lease fails, and so does its release. It stops its own sandbox before the lease
    lapses; the second run, waiting for the slot, gets it only from the repossessor, after."""
    monkeypatch.setattr(limits, "LEASE_DURATION_S", 60.0)  # the server's least
    monkeypatch.setattr(limits, "RENEW_EVERY_S", 2.0)
    monkeypatch.setattr(limits, "RETRY_FIRST_DELAY_S", 0.01)
    first_over = asyncio.Event()
    for method, code in (
        ("renew_concurrency_lease", 503),
        ("release_concurrency_slots_with_lease", 500),
    ):
        real = getattr(PrefectClient, method)

        async def failing(
            self: PrefectClient, *args: Any, _real: Any = real, _code: int = code, **kwargs: Any
        ) -> Any:
            if not first_over.is_set():
                raise _api_error(_code)
            return await _real(self, *args, **kwargs)

        monkeypatch.setattr(PrefectClient, method, failing)
    work, go, out = tmp_path / "work", tmp_path / "go", tmp_path / "out"
    work.mkdir()
    backend = LocalKernelBackend(max_live_sandboxes=1, workdir_root=str(work), isolation="none")
    cell = _waiting_cell(go)

    async def run(name: str) -> dict[str, Any]:
        try:
            result = await amodeling_pipeline(
                stages={name: [cell]}, backend=backend, storage=str(out / name)
            )
            return _summary(result)
        except PipelineFailedError as exc:
            return json.loads((Path(exc.output_dir or "") / "summary.json").read_text())

    with temporary_settings({PREFECT_API_URL: server.url}):
        try:
            first = asyncio.create_task(run("first"))
            async with asyncio.timeout(60):
                while not list(work.rglob("started.marker")):
                    await asyncio.sleep(0.05)
            second = asyncio.create_task(run("second"))
            first_summary = await first  # its lease taken as lost 15 s before it lapses
            first_over.set()
            go.touch()
            # The lease lapses; the repossessor (every 15 s) frees the slot for the second.
            second_summary = await asyncio.wait_for(second, 150)
        finally:
            async with get_client() as client:
                with contextlib.suppress(ObjectNotFound):
                    await client.delete_global_concurrency_limit_by_name(LIMIT)
    assert first_summary["status"] == "failed"
    assert f"the lease on its slot of {LIMIT} was lost" in first_summary["error"]
    assert second_summary["status"] == "completed"
    assert max_alive_at_once([first_summary, second_summary]) == 1
    killed = datetime.fromisoformat(first_summary["sandbox_killed_at"])
    created = datetime.fromisoformat(second_summary["sandbox_created_at"])
    assert (created - killed).total_seconds() > 5  # freed by the lease's lapse, not the run
