"""Parallel test workers cannot meet (issue 39): two processes set up as pytest-xdist workers
(`tests.workers`), each with its own Prefect API, reap at the same moment while the other's
sandboxes live, on the local backend and on one E2B account they share; each kills only its
own finished run's sandboxes, and both keep their live ones."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from prefect_sandbox.testing.e2b import E2BEmulator
from tests.conftest import ROOT, SUBPROCESS_TEST_TIMEOUT_S

# One worker: its own TMPDIR and PREFECT_HOME (importing tests.workers as a worker), its own
# Prefect API (the harness each worker's session starts), and on each backend one sandbox of a
# Completed flow run and one of a Running one. Once its sibling is as far, it reaps with the
# defaults (the local backend and every saved backend block), then lists what is left.
_WORKER = """
import asyncio, json, os, sys, tempfile, time
from pathlib import Path

import tests.workers

from prefect import flow
from prefect.client.orchestration import get_client
from prefect.settings import PREFECT_API_URL
from prefect.states import Completed, Running
from prefect.testing.utilities import prefect_test_harness

from prefect_sandbox import E2BBackend, E2BCredentials, LocalKernelBackend
from prefect_sandbox.flows import areap_sandboxes
from prefect_sandbox.sandbox.labels import API_LABEL, flow_run_labels, with_created_at
from prefect_sandbox.tasks.sandbox import prefect_api_id

spec = json.loads(sys.argv[1])
me, sibling = Path(spec["me"]), Path(spec["sibling"])


def meet(step, what):
    (me / f"{step}.partial").write_text(json.dumps(what))
    (me / f"{step}.partial").replace(me / f"{step}.json")
    deadline = time.monotonic() + 300
    while not (sibling / f"{step}.json").exists():
        assert time.monotonic() < deadline, f"the sibling never reached {step}"
        time.sleep(0.1)


@flow
def probe():
    pass


async def main():
    credentials = E2BCredentials(
        api_key=spec["api_key"], api_url=spec["url"], sandbox_url=spec["url"]
    )
    e2b = E2BBackend(credentials=credentials, metadata={"test-id": spec["test_id"]})
    await e2b.save("shared-account")
    backends = {"local": LocalKernelBackend(), "e2b": e2b}
    made, boxes = {}, []
    async with get_client() as client:
        for state in ("done", "live"):
            run = await client.create_flow_run(probe, state=Running())
            labels = {**flow_run_labels(str(run.id), state), API_LABEL: prefect_api_id()}
            for kind, backend in backends.items():
                boxes.append(await backend.create(with_created_at(labels)))
                made[f"{kind} {state}"] = boxes[-1].handle.sandbox_id
            if state == "done":
                await client.set_flow_run_state(run.id, Completed(), force=True)
    where = {"tmp": tempfile.gettempdir(), "home": os.environ["PREFECT_HOME"]}
    meet("made", {**made, **where, "api": str(PREFECT_API_URL.value())})
    reaped = await areap_sandboxes()
    meet("reaped", sorted([e.backend, e.sandbox_id, e.killed] for e in reaped))
    ours = {"local": {}, "e2b": {"test-id": spec["test_id"]}}
    left = {k: [h.sandbox_id for h in await b.list_sandboxes(ours[k])] for k, b in backends.items()}
    meet("left", left)
    for box in boxes:
        await box.kill()


with prefect_test_harness(server_startup_timeout=90):
    asyncio.run(main())
"""


@pytest.mark.timeout(SUBPROCESS_TEST_TIMEOUT_S)
def test_two_workers_reaping_at_once_each_kill_their_own_and_keep_the_others(
    e2b_emulator: E2BEmulator, tmp_path: Path
) -> None:
    test_id = uuid.uuid4().hex
    folders = {name: tmp_path / name for name in ("gwA", "gwB")}
    workers = {}
    for name, folder in folders.items():
        folder.mkdir()
        sibling = folders["gwB" if name == "gwA" else "gwA"]
        spec = {"me": str(folder), "sibling": str(sibling), "test_id": test_id}
        spec.update(url=e2b_emulator.url, api_key=e2b_emulator.api_key)
        env = {**os.environ, "PYTEST_XDIST_WORKER": name, "PYTHONPATH": str(ROOT)}
        env.pop("PREFECT_API_URL", None)
        with (folder / "log").open("wb") as log:
            workers[name] = subprocess.Popen(
                [sys.executable, "-c", _WORKER, json.dumps(spec)],
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
    deadline = time.monotonic() + SUBPROCESS_TEST_TIMEOUT_S - 30
    try:
        for name, worker in workers.items():
            worker.wait(timeout=max(deadline - time.monotonic(), 1))
            assert worker.returncode == 0, (folders[name] / "log").read_text()[-3000:]
    finally:
        for worker in workers.values():
            if worker.poll() is None:
                worker.kill()
                worker.wait()

    def read(name: str, step: str) -> dict[str, str]:
        found: dict[str, str] = json.loads((folders[name] / f"{step}.json").read_text())
        return found

    made = {name: read(name, "made") for name in folders}
    # Each its own TMPDIR, PREFECT_HOME and Prefect API.
    for where in ("tmp", "home", "api"):
        assert made["gwA"][where] != made["gwB"][where]
    for name, other in (("gwA", "gwB"), ("gwB", "gwA")):
        mine, theirs = made[name], made[other]
        # It killed its own finished run's sandboxes, nothing else, though on the shared E2B
        # account it listed its sibling's too (theirs are of another API: not its to judge).
        assert read(name, "reaped") == sorted(
            [["e2b", mine["e2b done"], True], ["local", mine["local done"], True]]
        )
        left = read(name, "left")
        # Its local backend lists its own sandboxes only.
        assert left["local"] == [mine["local live"]]
        # Both live sandboxes were left on the shared account, and both finished ones killed.
        assert sorted(left["e2b"]) == sorted([mine["e2b live"], theirs["e2b live"]])
    assert e2b_emulator.sandbox_ids({"test-id": test_id}) == []
