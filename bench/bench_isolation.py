"""What bubblewrap isolation costs a local kernel: start and per-cell time, side by side.

Three contenders in one process and one event loop: our `LocalKernelSandbox` under bubblewrap
(the default), the same without isolation (``isolation="none"``, the target's anchor: same code
but for bwrap), and a raw jupyter_client kernel over IPC (``AsyncKernelManager``, no sandbox
code at all).

- Start: from the call to the kernel answering (``create`` returns after a kernel_info round
  trip; raw: ``start_kernel`` + ``wait_for_ready``). Kill/shutdown is not timed. Each round
  starts one kernel of each contender in turn, rotating who goes first.
- Per cell: ``1+1`` on one warm kernel of each, one cell per contender in turn, as in
  ``bench_local.py`` (a).

Targets: isolated / none <= 1.2 for start and <= 1.1 per cell.

    python bench/bench_isolation.py [--quick]

Prints a markdown table and writes it with every sample to ``bench/results/isolation.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench_local import (
    CELL,
    git_state,
    markdown_table,
    median,
    ms,
    private_tmpdir,
    raw_execute,
    verdict,
)

from prefect_sandbox.sandbox.backends.kernel.isolation import Isolation
from prefect_sandbox.sandbox.backends.kernel.local import LocalKernelConfig, LocalKernelSandbox

RESULTS_PATH = Path(__file__).resolve().parent / "results" / "isolation.json"
OURS: tuple[Isolation, ...] = ("bubblewrap", "none")
CONTENDERS = (*OURS, "raw")
START_TARGET = 1.2
CELL_TARGET = 1.1


async def _start_raw(ipc_dir: Path) -> tuple[Any, Any]:
    """A kernel started the plain jupyter_client way over IPC; returns (manager, client)."""
    from jupyter_client.manager import AsyncKernelManager

    manager = AsyncKernelManager(kernel_name="python3", transport="ipc", ip=str(ipc_dir / "k"))
    await manager.start_kernel()
    client = manager.client()
    client.start_channels()
    await client.wait_for_ready(timeout=60)
    return manager, client


async def _stop_raw(manager: Any, client: Any) -> None:
    client.stop_channels()
    await manager.shutdown_kernel(now=True)


async def bench_start(rounds: int, ipc_root: Path) -> dict[str, list[float]]:
    """Seconds from asking for a kernel to its first answer, per contender."""
    samples: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    for round_index in range(rounds + 1):  # the first round warms the disk cache up
        shift = round_index % len(CONTENDERS)
        for name in CONTENDERS[shift:] + CONTENDERS[:shift]:
            start = time.perf_counter()
            if name not in OURS:
                ipc_dir = Path(tempfile.mkdtemp(prefix="raw-", dir=ipc_root))
                manager, client = await _start_raw(ipc_dir)
                elapsed = time.perf_counter() - start
                await _stop_raw(manager, client)
                shutil.rmtree(ipc_dir)
            else:
                box = await LocalKernelSandbox.create(LocalKernelConfig(isolation=name))
                elapsed = time.perf_counter() - start
                await box.kill()
            if round_index:
                samples[name].append(elapsed)
    return samples


async def bench_cells(
    warmup: int, rounds: int, per_round: int, ipc_root: Path
) -> dict[str, list[float]]:
    """Seconds per ``1+1`` cell, per contender, on one warm kernel each."""
    boxes = {
        name: await LocalKernelSandbox.create(LocalKernelConfig(isolation=name)) for name in OURS
    }
    raw = await _start_raw(Path(tempfile.mkdtemp(prefix="raw-", dir=ipc_root)))
    try:

        def ours(box: LocalKernelSandbox) -> Callable[[], Awaitable[None]]:
            async def run() -> None:
                result = await box.run_cell(CELL)
                assert result.status == "ok", result

            return run

        async def run_raw() -> None:
            reply = await raw_execute(raw[1], CELL)
            assert reply["content"]["status"] == "ok", reply

        runners = {**{name: ours(box) for name, box in boxes.items()}, "raw": run_raw}
        for run in runners.values():
            for _ in range(warmup):
                await run()
        samples: dict[str, list[float]] = {name: [] for name in CONTENDERS}
        for round_index in range(rounds):
            shift = round_index % len(CONTENDERS)
            order = CONTENDERS[shift:] + CONTENDERS[:shift]
            for _ in range(per_round):
                for name in order:
                    start = time.perf_counter()
                    await runners[name]()
                    samples[name].append(time.perf_counter() - start)
    finally:
        for box in boxes.values():
            await box.kill()
        await _stop_raw(*raw)
    return samples


def build_rows(
    start: dict[str, list[float]], cells: dict[str, list[float]]
) -> list[dict[str, str]]:
    """One row per quantity: isolated against none (the target) and against raw (info)."""
    rows = []
    for label, samples, target in (
        ("start to first answer", start, START_TARGET),
        (f"`{CELL}` per cell", cells, CELL_TARGET),
    ):
        med = {name: median(values) for name, values in samples.items()}
        ratio = med["bubblewrap"] / med["none"]
        rows.append(
            {
                "benchmark": f"{label}, median: bubblewrap vs none",
                "ours": f"{ms(med['bubblewrap']):.1f} ms",
                "anchors": f"none {ms(med['none']):.1f} ms; raw ipc {ms(med['raw']):.1f} ms",
                "ratio": f"{ratio:.2f} (vs none); {med['bubblewrap'] / med['raw']:.2f} (vs raw)",
                "target": f"<= {target:.2f} (vs none)",
                "result": verdict(ratio <= target),
            }
        )
    return rows


def main() -> int:
    """Run both benchmarks in a private temp dir; print and save the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (~30 s)")
    args = parser.parse_args()
    start_rounds, warmup, rounds, per_round = (4, 20, 2, 100) if args.quick else (12, 50, 5, 200)
    load_before = os.getloadavg()
    total_start = time.perf_counter()
    with private_tmpdir("bench-isolation-") as private_tmp:
        start = asyncio.run(bench_start(start_rounds, private_tmp))
        cells = asyncio.run(bench_cells(warmup, rounds, per_round, private_tmp))
    total_s = time.perf_counter() - total_start
    load_after = os.getloadavg()
    rows = build_rows(start, cells)
    table = markdown_table(rows)
    report = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "mode": "quick" if args.quick else "full",
        "git": git_state(),
        "bwrap": shutil.which("bwrap"),
        "loadavg_before": [round(v, 2) for v in load_before],
        "loadavg_after": [round(v, 2) for v in load_after],
        "total_s": round(total_s, 2),
        "rows": rows,
        "table_markdown": table,
        "start_s": start,
        "cell_s": {name: [round(v, 6) for v in values] for name, values in cells.items()},
        "cell_p90_ms": {
            name: ms(statistics.quantiles(values, n=10)[-1]) for name, values in cells.items()
        },
    }
    RESULTS_PATH.parent.mkdir(parents=True, exist_ok=True)
    RESULTS_PATH.write_text(json.dumps(report, indent=2))
    print(table)
    print(
        f"\n{report['mode']} run, {os.cpu_count()} CPUs, {total_s:.1f} s; load average 1 min "
        f"before {load_before[0]:.2f}, after {load_after[0]:.2f}; samples in {RESULTS_PATH}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
