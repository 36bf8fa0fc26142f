"""Per-call overhead of a sandbox session's ``run_cell`` inside a flow against the bare
``Sandbox.run_cell``, on the local backend (bubblewrap, the default).

Two contenders, in one process and one event loop, each on a sandbox of its own made once:

- bare: ``await sandbox.run_cell("1+1")`` on a `LocalKernelSandbox` (no Prefect).
- session: ``await session.run_cell("1+1")`` inside an async flow's ``sandbox_session``: a
  task run (``run-cell-N``) that runs the cell on the session's one attachment (its Jupyter
  client kept for the session's life) and logs its output; plus the model's text rendering
  and the notebook's bookkeeping.

Each round times one call of each, alternating which goes first. Target: session per call
<= 1.2 x bare + a task run's bookkeeping; the bookkeeping is measured apart, as the median of an
empty async task's call in the same flow, so the target is ``1.2 * bare + empty task``.

    python bench/bench_session.py [--quick]

Prints a markdown table and writes it with every sample to ``bench/results/session.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench_local import (
    CELL,
    git_state,
    jupyter_connection_files,
    leftovers,
    markdown_table,
    median,
    ms,
    private_tmpdir,
    publish,
    verdict,
)

RESULTS_PATH = Path(__file__).resolve().parent / "results" / "session.json"
RATIO = 1.2


async def run_all(rounds: int, out: Path) -> dict[str, Any]:
    """Time ``rounds`` calls of each contender, and an empty task's call, in one flow run."""
    from prefect import flow, task
    from prefect.cache_policies import NO_CACHE

    from prefect_sandbox import LocalKernelBackend
    from prefect_sandbox.flows import sandbox_session
    from prefect_sandbox.sandbox.backends.kernel.local import LocalKernelConfig, LocalKernelSandbox
    from prefect_sandbox.sandbox.notebook import CellSpec, StageSpec

    @task(cache_policy=NO_CACHE)
    async def empty() -> None:
        return None

    @task(cache_policy=NO_CACHE)
    async def empty_with_arguments(backend: Any, handle: Any, stage: Any) -> None:
        return None

    @flow(name="bench-session")
    async def bench() -> dict[str, list[float]]:
        times: dict[str, list[float]] = {
            "bare": [],
            "session": [],
            "empty_task": [],
            "empty_task_with_arguments": [],
        }
        bare = await LocalKernelSandbox.create(LocalKernelConfig())
        try:
            async with sandbox_session(backend=LocalKernelBackend(), storage=str(out)) as session:

                async def run_bare() -> None:
                    assert (await bare.run_cell(CELL)).status == "ok"

                async def run_session() -> None:
                    assert (await session.run_cell(CELL)).status == "ok"

                async def run_empty() -> None:
                    await empty()

                stage = StageSpec(name="cell-0", cells=[CellSpec(index=0, source=CELL)])

                async def run_empty_with_arguments() -> None:
                    await empty_with_arguments(session.backend, session.handle, stage)

                contenders = [("bare", run_bare), ("session", run_session)]
                anchors = [
                    ("empty_task", run_empty),
                    ("empty_task_with_arguments", run_empty_with_arguments),
                ]
                for _, run in [*contenders, *anchors]:  # warm-up
                    await run()
                for index in range(rounds):
                    order = contenders if index % 2 == 0 else contenders[::-1]
                    for name, run in [*order, *anchors]:
                        start = time.perf_counter()
                        await run()
                        times[name].append(time.perf_counter() - start)
        finally:
            await bare.kill()
        return times

    times = await bench()
    bare, session, empty_task = (median(times[k]) for k in ("bare", "session", "empty_task"))
    return {
        "rounds": rounds,
        "bare_median_ms": ms(bare),
        "session_median_ms": ms(session),
        "empty_task_median_ms": ms(empty_task),
        "empty_task_with_arguments_median_ms": ms(median(times["empty_task_with_arguments"])),
        "ratio": round(session / bare, 2),
        "target_ms": ms(RATIO * bare + empty_task),
        "samples_ms": {name: [ms(v) for v in values] for name, values in times.items()},
    }


def main() -> int:
    """Run under one ephemeral Prefect server; print and save the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="20 rounds instead of 100")
    args = parser.parse_args()
    # Per-cell logs at INFO would be timed too; the session logs as any flow does.
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from prefect.testing.utilities import prefect_test_harness

    rounds = 20 if args.quick else 100
    load_before = os.getloadavg()
    connection_files_before = jupyter_connection_files()
    # The session's stored files go outside the private temp dir, whose leftovers are leaks.
    with (
        tempfile.TemporaryDirectory(prefix="bench-session-out-") as out,
        prefect_test_harness(server_startup_timeout=90),
        private_tmpdir("bench-session-tmp-") as private_tmp,
    ):
        raw = asyncio.run(run_all(rounds, Path(out)))
        raw["leftovers"] = leftovers(private_tmp, connection_files_before)
    ok = raw["session_median_ms"] <= raw["target_ms"]
    rows = [
        {
            "benchmark": "session.run_cell('1+1') in a flow, per call",
            "ours": f"{raw['session_median_ms']} ms",
            "anchors": f"Sandbox.run_cell {raw['bare_median_ms']} ms; "
            f"empty task {raw['empty_task_median_ms']} ms; the same taking run_stage's "
            f"arguments {raw['empty_task_with_arguments_median_ms']} ms",
            "ratio": f"{raw['ratio']}x",
            "target": f"<= {RATIO} x bare + empty task = {raw['target_ms']} ms",
            "result": verdict(ok),
        }
    ]
    table = markdown_table(rows)
    report = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "python": sys.version.split()[0],
        "git": git_state(),
        "loadavg_before": [round(v, 2) for v in load_before],
        "loadavg_after": [round(v, 2) for v in os.getloadavg()],
        "rows": rows,
        "table_markdown": table,
        "raw": raw,
    }
    return publish(RESULTS_PATH, report, f"session per call {raw['ratio']}x bare")


if __name__ == "__main__":
    sys.exit(main())
