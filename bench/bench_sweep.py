"""Sweep throughput: the CO2 notebook over 1, 4 and 16 parameter sets, as one sweep flow and as
papermill runs one after another, and the peak memory of each live sandbox meanwhile.

Both sides run the CO2 notebook (``examples/co2/forecast.ipynb``, ~3 s in papermill on an idle
2-core machine) with a different ``train_end`` per branch, ``co2.csv`` beside it, in this one
process under one throwaway Prefect server (``prefect_test_harness``; its start is not timed):

- sweep: ``asweep_notebook`` with the local backend (its defaults: bubblewrap), every branch in
  its own sandbox, figures, ``forecast.csv`` and ``metrics.json`` stored in a local folder.
- papermill: ``papermill.execute_notebook`` once per parameter set, in a loop (what papermill
  users write by hand), each in its own working folder holding ``co2.csv``.

Throughput is branches per minute of wall time, from the call to its return; the median over
``--repeats`` rounds (default 2). One warm-up of each side runs first (imports, disk cache).
Which side goes first alternates from one size and round to the next.

Memory: a thread samples this process's descendants every ``SAMPLE_S``. A sandbox is a kernel
(the innermost process whose command line names ipykernel) with the wrappers above it that hold
no other kernel (bwrap), and all its children; its RSS is the sum over that tree. The table
gives, per side, the highest RSS any one sandbox reached, the median of the sandboxes' peaks
(median over rounds), the most sandboxes alive at once and the highest sum of their RSS. The
local backend's guard process (one small ``python -I -S`` per sandbox) is only in the JSON. RSS
counts shared pages (libraries) in every process, so N sandboxes need less than N times one
sandbox's RSS.

    python bench/bench_sweep.py [--quick] [--sizes 1,4,16] [--repeats 2] [--max-live-sandboxes N]
                                [--papermill-only]

Prints a markdown table and writes it with every sample to ``bench/results/sweep.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench_local import git_state, markdown_table, publish, timed_harness

ROOT = Path(__file__).resolve().parent.parent
CO2 = ROOT / "examples" / "co2"
RESULTS_PATH = Path(__file__).resolve().parent / "results" / "sweep.json"
SAMPLE_S = 0.1
MIB = 1024 * 1024
GUARD_MARK = "os.killpg(group"


def grid(size: int) -> list[dict[str, Any]]:
    """``size`` parameter sets for the CO2 notebook: train_end at the end of 1980, 1981, ..."""
    return [{"train_end": f"{1980 + i % 17}-12-31"} for i in range(size)]


# ---------------------------------------------------------------- memory sampler


@dataclass
class MemoryPeaks:
    """What the sampler saw: peak RSS per sandbox and per guard, and the most alive at once."""

    sandbox_peak_bytes: dict[str, int] = field(default_factory=dict)
    guard_peak_bytes: dict[str, int] = field(default_factory=dict)
    max_live: int = 0
    max_total_bytes: int = 0
    samples: int = 0


def _tree_rss(process: Any) -> int:
    """RSS in bytes of a process and all its descendants (those that vanish count 0)."""
    import psutil

    total = 0
    try:
        members = [process, *process.children(recursive=True)]
    except psutil.Error:
        return 0
    for member in members:
        with contextlib.suppress(psutil.Error):
            total += member.memory_info().rss
    return total


def sandbox_roots(me: Any) -> tuple[list[Any], list[Any]]:
    """The sandbox roots and the guard processes among the descendants of process ``me``.

    A kernel is the lowest process whose command line names ipykernel. Its root is its highest
    ancestor below ``me`` with no other kernel under it: the kernel itself for papermill (a
    child of this process), the outer bwrap for our local sandboxes.
    """
    import psutil

    mentions, guards = [], []
    for process in me.children(recursive=True):
        try:
            cmdline = " ".join(process.cmdline())
            parent = process.ppid()
        except psutil.Error:
            continue
        # The guard's source (its command line) names ipykernel too: asked first.
        if GUARD_MARK in cmdline:
            guards.append(process)
        elif "ipykernel" in cmdline:
            mentions.append((process, parent))
    # bwrap's command line names ipykernel too: the kernel is the last one down the tree.
    wrappers = {parent for _, parent in mentions}
    kernels = [process for process, _ in mentions if process.pid not in wrappers]
    chains: list[list[Any]] = []
    kernels_under: dict[int, int] = {}
    for kernel in kernels:
        chain = [kernel]
        try:
            for parent in kernel.parents():
                if parent.pid == me.pid:
                    break
                chain.append(parent)
            else:
                # Its wrapper died first (a kill under way): the kernel was reparented up to
                # init, whose tree is the whole machine's. Leave it out.
                continue
        except psutil.Error:
            continue
        chains.append(chain)
        for member in chain:
            kernels_under[member.pid] = kernels_under.get(member.pid, 0) + 1
    roots = []
    for chain in chains:
        root = chain[0]
        for member in chain[1:]:
            if kernels_under[member.pid] > 1:
                break
            root = member
        roots.append(root)
    return roots, guards


class MemorySampler:
    """Samples every ``SAMPLE_S`` in a thread while used as a context manager."""

    def __init__(self) -> None:
        self.peaks = MemoryPeaks()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-sampler", daemon=True)

    def __enter__(self) -> MemoryPeaks:
        self._thread.start()
        return self.peaks

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        import psutil

        me = psutil.Process()
        peaks = self.peaks
        while not self._stop.wait(SAMPLE_S):
            roots, guards = sandbox_roots(me)
            total = 0
            for store, processes in (
                (peaks.sandbox_peak_bytes, roots),
                (peaks.guard_peak_bytes, guards),
            ):
                for process in processes:
                    rss = _tree_rss(process)
                    try:
                        # A pid may come back later: key by pid and start time.
                        key = f"{process.pid}@{process.create_time():.2f}"
                    except psutil.Error:
                        continue
                    store[key] = max(store.get(key, 0), rss)
                    if store is peaks.sandbox_peak_bytes:
                        total += rss
            peaks.max_live = max(peaks.max_live, len(roots))
            peaks.max_total_bytes = max(peaks.max_total_bytes, total)
            peaks.samples += 1


def memory_summary(peaks: MemoryPeaks) -> dict[str, Any]:
    """MiB figures for the report from what the sampler saw."""
    sandboxes = sorted(peaks.sandbox_peak_bytes.values())
    guards = sorted(peaks.guard_peak_bytes.values())
    return {
        "sandboxes_seen": len(sandboxes),
        "max_sandbox_mib": round(max(sandboxes, default=0) / MIB, 1),
        "median_sandbox_mib": round(statistics.median(sandboxes) / MIB, 1) if sandboxes else 0,
        "median_guard_mib": round(statistics.median(guards) / MIB, 1) if guards else 0,
        "max_live": peaks.max_live,
        "max_total_mib": round(peaks.max_total_bytes / MIB, 1),
        "samples": peaks.samples,
    }


# ---------------------------------------------------------------- the two sides


def run_papermill_branches(params: list[dict[str, Any]], work: Path) -> None:
    """papermill.execute_notebook once per parameter set, one after another."""
    import papermill  # type: ignore[import-untyped]

    for index, values in enumerate(params):
        folder = work / f"branch-{index:03d}"
        folder.mkdir(parents=True)
        shutil.copy(CO2 / "co2.csv", folder)
        papermill.execute_notebook(
            str(CO2 / "forecast.ipynb"),
            str(folder / "executed.ipynb"),
            parameters=values,
            kernel_name="python3",
            progress_bar=False,
            cwd=str(folder),
        )


async def run_papermill(params: list[dict[str, Any]], work: Path) -> None:
    """papermill is sync: run the loop in a thread, as a user's script would block."""
    await asyncio.to_thread(run_papermill_branches, params, work)


async def run_sweep(
    params: list[dict[str, Any]], work: Path, max_live_sandboxes: int | None = None
) -> None:
    """The sweep flow over the same parameter sets (branches as subflows, all started at once;
    with ``max_live_sandboxes``, at most that many sandboxes alive, the others waiting for a slot).

    Raises:
        SweepFailedError: a branch did not complete.
    """
    from prefect_sandbox.flows.sweep import asweep_notebook

    result = await asweep_notebook(
        notebook=str(CO2 / "forecast.ipynb"),
        grid=params,
        inputs=[str(CO2 / "co2.csv")],
        artifacts=["figures/*.png", "forecast.csv", "metrics.json"],
        storage=str(work),
        max_live_sandboxes=max_live_sandboxes,
    )
    assert [branch.status for branch in result.branches] == ["completed"] * len(params)


async def timed(
    side: str, size: int, work: Path, max_live_sandboxes: int | None
) -> tuple[float, dict[str, Any]]:
    """Wall seconds of one side over ``size`` branches, and what the memory sampler saw."""
    folder = Path(tempfile.mkdtemp(prefix=f"{side}-{size}-", dir=work))
    with MemorySampler() as peaks:
        start = time.perf_counter()
        if side == "sweep":
            await run_sweep(grid(size), folder, max_live_sandboxes)
        else:
            await run_papermill(grid(size), folder)
        elapsed = time.perf_counter() - start
    shutil.rmtree(folder)
    return elapsed, memory_summary(peaks)


async def run_all(
    sizes: list[int], sides: list[str], repeats: int, work: Path, max_live_sandboxes: int | None
) -> dict[str, Any]:
    """A warm-up of each side, then ``repeats`` rounds of each size on each side, alternating
    which side goes first."""
    raw: dict[str, Any] = {"warmup_s": {}, "runs": []}
    for side in sides:
        raw["warmup_s"][side], _ = await timed(side, 1, work, max_live_sandboxes)
    for repeat in range(repeats):
        for index, size in enumerate(sizes):
            order = sides if (index + repeat) % 2 == 0 else sides[::-1]
            for side in order:
                elapsed, memory = await timed(side, size, work, max_live_sandboxes)
                raw["runs"].append(
                    {
                        "side": side,
                        "size": size,
                        "repeat": repeat,
                        "seconds": elapsed,
                        "memory": memory,
                    }
                )
    return raw


def merged(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One side's repeats of one size: median seconds; highest sandbox peak, most alive and
    highest sum over live sandboxes; median of the per-run median peaks."""
    memory = [run["memory"] for run in runs]
    return {
        "seconds": statistics.median(run["seconds"] for run in runs),
        "max_sandbox_mib": max(m["max_sandbox_mib"] for m in memory),
        "median_sandbox_mib": round(statistics.median(m["median_sandbox_mib"] for m in memory), 1),
        "max_live": max(m["max_live"] for m in memory),
        "max_total_mib": max(m["max_total_mib"] for m in memory),
    }


def _max_ratio(memory: dict[str, dict[str, Any]]) -> float:
    """The sweep's highest sandbox RSS over papermill's highest kernel RSS."""
    return float(memory["sweep"]["max_sandbox_mib"] / memory["papermill"]["max_sandbox_mib"])


def _info_row(benchmark: str, ours: str, anchors: str, ratio: str) -> dict[str, str]:
    """A table row with no target (the issue sets none for these)."""
    return {
        "benchmark": benchmark,
        "ours": ours,
        "anchors": anchors,
        "ratio": ratio,
        "target": "info",
        "result": "-",
    }


def build_rows(raw: dict[str, Any], sizes: list[int], sides: list[str]) -> list[dict[str, str]]:
    """Per size, a throughput row (runs per minute) and a memory row (peak RSS per sandbox)."""
    rows = []
    for size in sizes:
        memory = {
            side: merged([r for r in raw["runs"] if (r["side"], r["size"]) == (side, size)])
            for side in sides
        }
        rate = {side: size / memory[side]["seconds"] * 60 for side in sides}
        text = {side: f"{rate[side]:.1f}/min ({memory[side]['seconds']:.1f} s)" for side in sides}
        peak = {
            side: f"{m['max_sandbox_mib']} MiB max, {m['median_sandbox_mib']} median, "
            f"{m['max_live']} alive at most ({m['max_total_mib']} MiB together)"
            for side, m in memory.items()
        }
        ours = "sweep" if "sweep" in sides else "papermill"
        anchor = "papermill" if ours == "sweep" else None
        rows.append(
            _info_row(
                f"{size} branches, runs per minute (wall time)",
                text[ours],
                f"papermill in a loop {text['papermill']}" if anchor else "-",
                f"{rate['sweep'] / rate['papermill']:.2f}" if anchor else "-",
            )
        )
        rows.append(
            _info_row(
                f"{size} branches, peak RSS per live sandbox (kernel tree)",
                peak[ours],
                f"papermill kernel {peak['papermill']}" if anchor else "-",
                f"{_max_ratio(memory):.2f}" if anchor else "-",
            )
        )
    return rows


def main() -> int:
    """Run the sizes under one ephemeral Prefect server; print and save the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="sizes 1 and 4, once (~1 min)")
    parser.add_argument("--repeats", type=int, default=2, help="rounds of every size (default 2)")
    parser.add_argument("--sizes", default="1,4,16", help="branch counts (default 1,4,16)")
    parser.add_argument(
        "--max-live-sandboxes",
        type=int,
        help="the sweep's max_live_sandboxes (a cap on its sandboxes alive at once; default none)",
    )
    parser.add_argument(
        "--papermill-only", action="store_true", help="the papermill side alone (no sweep flow)"
    )
    args = parser.parse_args()
    sizes = [1, 4] if args.quick else [int(s) for s in args.sizes.split(",")]
    repeats = 1 if args.quick else args.repeats
    sides = ["papermill"] if args.papermill_only else ["sweep", "papermill"]
    # Must be set before prefect is imported, which reads its settings once.
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    with timed_harness("bench-sweep-tmp-") as measured:
        work = Path(tempfile.mkdtemp(prefix="work-"))
        try:
            raw = asyncio.run(run_all(sizes, sides, repeats, work, args.max_live_sandboxes))
        finally:
            shutil.rmtree(work, ignore_errors=True)
    raw["leftovers"] = measured.leftovers
    rows = build_rows(raw, sizes, sides)
    table = markdown_table(rows)
    report = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "sizes": sizes,
        "repeats": repeats,
        "max_live_sandboxes": args.max_live_sandboxes,
        "sides": sides,
        "git": git_state(),
        "cpus": os.cpu_count(),
        **measured.fields(),
        "rows": rows,
        "table_markdown": table,
        "raw": raw,
    }
    summary = measured.summary()
    status = publish(RESULTS_PATH, report, summary)
    over = [
        run
        for run in raw["runs"]
        if run["side"] == "sweep"
        and run["memory"]["max_live"] > (args.max_live_sandboxes or 1 << 30)
    ]
    if over:
        print(f"CAP EXCEEDED: {over}", file=sys.stderr)
        return 1
    return status


if __name__ == "__main__":
    sys.exit(main())
