"""A chaos round of set-up faults (slow set, `./dev.sh bench`): every pipeline and session on
both emulators meets one transient fault before its first cell, and each must still complete
with its artifact stored and no sandbox left. The suite's per-kind twins are in
tests/test_emulator_faults.py.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from prefect_sandbox.blocks.base import SandboxBackend
from prefect_sandbox.flows import amodeling_pipeline
from prefect_sandbox.sandbox.labels import FLOW_RUN_ID_LABEL
from prefect_sandbox.testing.daytona import DaytonaEmulator
from prefect_sandbox.testing.e2b import E2BEmulator
from prefect_sandbox.testing.faults import Fault
from tests.test_emulator_faults import SET_UP_FAULTS as PER_KIND_FAULTS
from tests.test_emulator_faults import Vendor

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("prefect_api")]

# Each makes the faults of one run: transient, and each hitting the set-up only. The suite's
# per-kind test meets the first three; a create refused and a first execution dropped alone too.
SET_UP_FAULTS: dict[str, Callable[[], list[Fault]]] = {
    **PER_KIND_FAULTS,
    "503-create": lambda: [Fault("create", status=503)],
    "429-create": lambda: [Fault("create", status=429, retry_after_s=1, times=2)],
    "dropped-first-execution": lambda: [Fault("run_code", drop=True)],
}
RUNS_PER_VENDOR = 12


async def _pipeline(backend: SandboxBackend, given: Path, out: Path) -> Path:
    result = await amodeling_pipeline(
        stages={"one": ["open('made.txt', 'w').write(open('given.txt').read() + ' used')"]},
        inputs=[str(given)],
        artifacts=["made.txt"],
        backend=backend,
        storage=str(out),
    )
    assert result.status == "completed"
    return Path(result.output_dir)


async def _session(backend: SandboxBackend, given: Path, out: Path) -> Path:
    from prefect import flow

    from prefect_sandbox.flows import sandbox_session

    @flow
    async def agent() -> str:
        async with sandbox_session(
            backend=backend, inputs=[str(given)], artifacts=["made.txt"], storage=str(out)
        ) as session:
            done = await session.run_cell(
                "open('made.txt', 'w').write(open('given.txt').read() + ' used')"
            )
            return done.status

    assert await agent() == "ok"
    [folder] = out.iterdir()
    return folder


@pytest.mark.parametrize("vendor", ["e2b", "daytona"])
async def test_every_run_survives_one_set_up_fault(
    vendor: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    fixture = "e2b_emulator" if vendor == "e2b" else "daytona_env"
    emulator: E2BEmulator | DaytonaEmulator = request.getfixturevalue(fixture)
    backend = Vendor(vendor, emulator).backend
    chooser = random.Random(f"chaos-{vendor}")
    given = tmp_path / "given.txt"
    given.write_text("input")
    seen: list[tuple[str, str, int]] = []
    for number in range(RUNS_PER_VENDOR):
        mode, run = chooser.choice([("pipeline", _pipeline), ("session", _session)])
        fault = sorted(SET_UP_FAULTS)[number % len(SET_UP_FAULTS)]
        out = tmp_path / f"run-{number}"
        emulator.inject(*SET_UP_FAULTS[fault]())
        start = time.monotonic()
        try:
            folder = await run(backend(), given, out)
        finally:
            emulator.clear_faults()
        assert any(r.faulted for r in emulator.requests if r.at >= start), (fault, mode)
        summary = json.loads((folder / "summary.json").read_text())
        assert summary["status"] == "completed", (fault, mode, summary.get("error"))
        assert (folder / "made.txt").read_text() == "input used", (fault, mode)
        assert emulator.sandbox_ids({FLOW_RUN_ID_LABEL: summary["flow_run_id"]}) == []
        seen.append((fault, mode, summary["setup_attempts"]))
    print(f"\n{vendor}: {len(seen)} runs, (fault, mode, set-ups): {seen}")
    assert {fault for fault, _, _ in seen} == set(SET_UP_FAULTS)
    assert {mode for _, mode, _ in seen} == {"pipeline", "session"}
