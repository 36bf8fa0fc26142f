"""Many pipelines at once against a real `prefect server` on PostgreSQL: every run completes,
stores its files, and leaves no kernel, folder or connection file behind. The 64-run version on
SQLite and PostgreSQL is ``bench/bench_scale.py``."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import psutil
import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
from prefect.client.schemas.objects import StateType
from prefect.settings import PREFECT_API_URL, temporary_settings

from prefect_sandbox.flows import amodeling_pipeline
from prefect_sandbox.testing.prefect_server import PostgresCluster, drain_prefect_workers
from tests.conftest import kernel_processes
from tests.test_deployments import PrefectStack

pytestmark = pytest.mark.timeout(600)

RUNS = 8


@pytest.fixture
def private_tmp(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fresh TMPDIR for this process and the kernels it starts: whatever the runs leave in
    the temp dir (work dirs, kernel runtime dirs, staging folders) lands here."""
    path = Path(tempfile.mkdtemp(prefix="scale-"))
    monkeypatch.setenv("TMPDIR", str(path))
    monkeypatch.setattr(tempfile, "tempdir", str(path))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _left_in(private_tmp: Path) -> list[str]:
    runtime_base = private_tmp / f"prefect-sandbox-{os.getuid()}"
    return sorted(str(p) for p in private_tmp.rglob("*") if p != runtime_base)


async def test_eight_pipelines_at_once_against_a_postgresql_server_complete_and_leave_nothing(
    postgres_server: PrefectStack, private_tmp: Path, tmp_path: Path
) -> None:
    assert "postgresql+asyncpg://" in postgres_server.env["PREFECT_API_DATABASE_CONNECTION_URL"]
    with temporary_settings({PREFECT_API_URL: postgres_server.url}):
        results = await asyncio.gather(
            *(
                amodeling_pipeline(
                    stages={
                        "make": [f"import json\njson.dump({{'run': {i}}}, open('made.json', 'w'))"],
                        "check": ["print(open('made.json').read())"],
                    },
                    artifacts=["made.json"],
                    storage=str(tmp_path / str(i)),
                )
                for i in range(RUNS)
            )
        )
        async with get_client() as client:
            flow_runs = await client.read_flow_runs(
                flow_run_filter=FlowRunFilter(
                    id=FlowRunFilterId(any_=[r.flow_run_id for r in results])
                )
            )
        await drain_prefect_workers()
    assert [r.status for r in results] == ["completed"] * RUNS
    # The server recorded every run, in PostgreSQL.
    assert sorted(str(r.id) for r in flow_runs) == sorted(r.flow_run_id for r in results)
    assert {r.state.type for r in flow_runs if r.state} == {StateType.COMPLETED}
    for index, result in enumerate(results):
        folder = Path(result.output_dir)
        assert folder.parent == tmp_path / str(index)
        assert json.loads((folder / "made.json").read_text()) == {"run": index}
        assert json.loads((folder / "summary.json").read_text())["status"] == "completed"
    deadline = time.monotonic() + 30
    while kernel_processes() and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    assert kernel_processes() == []
    assert _left_in(private_tmp) == []


async def test_a_throwaway_postgresql_cluster_answers_on_127_0_0_1_and_leaves_nothing() -> None:
    with PostgresCluster() as cluster:
        assert cluster.folder is not None
        folder = cluster.folder
        url = cluster.url.replace("postgresql+asyncpg://", "postgresql://")
        assert "@127.0.0.1:" in url
        connection = await asyncpg.connect(url)
        try:
            assert await connection.fetchval("SELECT current_database()") == "prefect"
        finally:
            await connection.close()
        # A wrong password is refused.
        with pytest.raises(asyncpg.InvalidPasswordError):
            await asyncpg.connect(url.replace(cluster.password, "wrong"))
    assert not folder.exists()
    assert [
        p.pid
        for p in psutil.process_iter(["cmdline"])
        if str(folder) in " ".join(p.info["cmdline"] or [])
    ] == []
