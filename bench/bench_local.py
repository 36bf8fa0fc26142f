"""Local-kernel benchmarks: our code against its anchors, side by side in one process.

(a) per-cell overhead of `LocalKernelSandbox.run_cell` against a raw jupyter_client round trip;
(b) a 100-cell trivial notebook through our `arun_notebook` flow, papermill and nbclient;
(c) what a one-cell pipeline flow run costs beyond a bare kernel create + run + kill.

Run from the repository root: ``python bench/bench_local.py [--quick]``. Prints a markdown table
and writes it, with the raw numbers, to ``bench/results/local.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib.metadata import version
from pathlib import Path
from typing import Any

RESULTS_PATH = Path(__file__).resolve().parent / "results" / "local.json"
CELL = "1+1"
NOTEBOOK_CELLS = 100
RAW_TIMEOUT_S = 30.0
FLOW_OVERHEAD_TARGET_MS = 250
"""(c)'s target (issue 34: half of the 498 ms measured before)."""


@dataclass(frozen=True)
class Sizes:
    """How much each benchmark repeats; ``--quick`` shrinks it."""

    warmup_cells: int
    rounds: int
    cells_per_round: int
    notebook_reps: int
    flow_reps: int


FULL = Sizes(warmup_cells=50, rounds=5, cells_per_round=200, notebook_reps=4, flow_reps=10)
QUICK = Sizes(warmup_cells=20, rounds=2, cells_per_round=100, notebook_reps=1, flow_reps=3)


def ms(seconds: float) -> float:
    """Seconds to milliseconds, rounded for the report."""
    return round(seconds * 1000, 3)


def median(values: list[float]) -> float:
    """The median of a non-empty list."""
    return statistics.median(values)


# ---------------------------------------------------------------- leak checks


def child_kernel_pids() -> set[int]:
    """Pids of this process's child processes that are ipykernels (any state but reaped).

    Every kernel a benchmark starts (ours, jupyter_client's, nbclient's, papermill's) is a
    child of this process, so a leaked one shows up here while other users' kernels do not.
    """
    me = str(os.getpid())
    pids = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if stat.rsplit(")", 1)[1].split()[1] == me and b"ipykernel" in cmdline:
            pids.add(int(entry.name))
    return pids


def jupyter_connection_files() -> set[str]:
    """Connection files in Jupyter's runtime dir (jupyter_client's, nbclient's, papermill's)."""
    from jupyter_core.paths import jupyter_runtime_dir

    return {str(p) for p in Path(jupyter_runtime_dir()).glob("kernel-*.json")}


def leftovers(private_tmp: Path, connection_files_before: set[str]) -> dict[str, list[Any]]:
    """Kernels and files this run made and did not remove (waits a little for exits).

    Everything the run puts in the temp dir goes to ``private_tmp`` (TMPDIR points there), so
    whatever is left in it is ours; the only expected entry is the empty runtime base folder
    that `LocalKernelSandbox` keeps for all its kernels.
    """
    pids: set[int] = set()
    for _ in range(50):
        pids = child_kernel_pids()
        if not pids:
            break
        time.sleep(0.1)
    runtime_base = private_tmp / f"prefect-sandbox-{os.getuid()}"
    paths = {str(p) for p in private_tmp.rglob("*") if p != runtime_base}
    paths |= jupyter_connection_files() - connection_files_before
    return {"ipykernel_pids": sorted(pids), "paths": sorted(paths)}


# ---------------------------------------------------------------- (a) per-cell overhead


async def raw_execute(client: Any, code: str) -> dict[str, Any]:
    """One execute round trip the plain jupyter_client way; returns the execute_reply.

    Same execute arguments as `LocalKernelSandbox.run_cell`, so only client-side work differs.
    """
    msg_id = client.execute(code, store_history=True, allow_stdin=False, stop_on_error=False)
    while True:
        msg = await client.get_iopub_msg(timeout=RAW_TIMEOUT_S)
        if (
            msg["parent_header"].get("msg_id") == msg_id
            and msg["msg_type"] == "status"
            and msg["content"]["execution_state"] == "idle"
        ):
            break
    while True:
        reply: dict[str, Any] = await client.get_shell_msg(timeout=RAW_TIMEOUT_S)
        if reply["parent_header"].get("msg_id") == msg_id:
            return reply


RAW_KERNEL_ARGS = ["--HistoryManager.hist_file=:memory:"]
"""The raw kernels keep their history in memory, as ours and nbclient's do, so that (a)
compares client-side work only (an on-disk history costs ~1 ms a cell in the kernel)."""


async def start_raw_kernel(transport: str, ipc_dir: Path) -> tuple[Any, Any]:
    """Start a python3 kernel with jupyter_client's AsyncKernelManager; returns (km, kc)."""
    from jupyter_client.manager import AsyncKernelManager

    kwargs: dict[str, Any] = {"kernel_name": "python3"}
    if transport == "ipc":
        # The default ipc path is relative to the cwd; keep the sockets in a temp dir.
        kwargs.update(transport="ipc", ip=str(ipc_dir / "k"))
    km = AsyncKernelManager(**kwargs)
    await km.start_kernel(extra_arguments=RAW_KERNEL_ARGS)
    kc = km.client()
    kc.start_channels()
    await kc.wait_for_ready(timeout=60)
    return km, kc


async def bench_per_cell(sizes: Sizes) -> dict[str, Any]:
    """(a): per-cell time of ``1+1`` on our sandbox and on raw jupyter_client kernels.

    Each round runs one cell on each contender in turn, ``cells_per_round`` times, so that
    drift (other processes, Prefect's threads) hits all of them alike.
    """
    from prefect_sandbox.sandbox.backends.kernel.local import LocalKernelConfig, LocalKernelSandbox

    ipc_dir = Path(tempfile.mkdtemp(prefix="bench-raw-ipc-"))
    sandbox = None
    raw: dict[str, tuple[Any, Any]] = {}
    try:
        sandbox = await LocalKernelSandbox.create(LocalKernelConfig())
        for transport in ("tcp", "ipc"):
            raw[transport] = await start_raw_kernel(transport, ipc_dir)

        async def ours() -> None:
            result = await sandbox.run_cell(CELL)
            assert result.status == "ok", result

        def raw_runner(transport: str) -> Callable[[], Awaitable[None]]:
            client = raw[transport][1]

            async def run() -> None:
                reply = await raw_execute(client, CELL)
                assert reply["content"]["status"] == "ok", reply

            return run

        runners: dict[str, Callable[[], Awaitable[None]]] = {
            "ours": ours,
            "raw_tcp": raw_runner("tcp"),
            "raw_ipc": raw_runner("ipc"),
        }
        for run in runners.values():
            for _ in range(sizes.warmup_cells):
                await run()
        samples: dict[str, list[float]] = {name: [] for name in runners}
        round_means: dict[str, list[float]] = {name: [] for name in runners}
        names = list(runners)
        for round_index in range(sizes.rounds):
            # Alternate cell by cell, so load from other processes hits every contender alike;
            # rotate who goes first each round.
            shift = round_index % len(names)
            order = names[shift:] + names[:shift]
            times: dict[str, list[float]] = {name: [] for name in names}
            for _ in range(sizes.cells_per_round):
                for name in order:
                    start = time.perf_counter()
                    await runners[name]()
                    times[name].append(time.perf_counter() - start)
            for name in names:
                samples[name].extend(times[name])
                round_means[name].append(statistics.fmean(times[name]))
    finally:
        if sandbox is not None:
            await sandbox.kill()
        for km, kc in raw.values():
            kc.stop_channels()
            await km.shutdown_kernel(now=True)
        shutil.rmtree(ipc_dir, ignore_errors=True)
    return {
        "cell": CELL,
        "rounds": sizes.rounds,
        "cells_per_round": sizes.cells_per_round,
        "median_ms": {name: ms(median(values)) for name, values in samples.items()},
        "mean_ms": {name: ms(statistics.fmean(values)) for name, values in samples.items()},
        "p90_ms": {
            name: ms(statistics.quantiles(values, n=10)[-1]) for name, values in samples.items()
        },
        "round_mean_ms": {name: [ms(v) for v in values] for name, values in round_means.items()},
    }


# ---------------------------------------------------------------- (b) 100-cell notebook


def output_kwargs(flow: Any, folder: Path) -> dict[str, Any]:
    """The flow's argument that names a local output folder (``storage``, or ``output_dir``)."""
    import inspect

    params = inspect.signature(flow.fn).parameters
    return {"storage" if "storage" in params else "output_dir": str(folder)}


def write_notebook(path: Path, cells: int) -> None:
    """A notebook of ``cells`` trivial code cells (``x = i`` / ``x + 1`` alternating)."""
    import nbformat

    sources = [f"x = {i}" if i % 2 == 0 else "x + 1" for i in range(cells)]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources])
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    nbformat.write(nb, path)


class CellPhase:
    """nbclient hooks that time the cell phase: kernel ready to last cell executed.

    ``on_notebook_start`` fires once the kernel answers, before nbclient's kernel_info request
    and the first cell; ``on_cell_executed`` fires after each cell. So the phase leaves out
    kernel start and shutdown, like our run-stage time (which includes attaching to the kernel
    and one kernel_info round trip). papermill's client runs the same hooks; its notebook
    write after each cell is inside the phase, except the write after the last cell.
    """

    def __init__(self) -> None:
        self.start = self.end = 0.0

    def on_notebook_start(self, **_: Any) -> None:
        """Hook: the kernel is ready."""
        self.start = time.perf_counter()

    def on_cell_executed(self, **_: Any) -> None:
        """Hook: a cell finished; the last call marks the end of the phase."""
        self.end = time.perf_counter()

    def hooks(self) -> dict[str, Any]:
        """Keyword arguments that install the hooks on a NotebookClient (or via papermill)."""
        return {
            "on_notebook_start": self.on_notebook_start,
            "on_cell_executed": self.on_cell_executed,
        }

    @property
    def seconds(self) -> float:
        """Length of the cell phase."""
        return self.end - self.start


def run_papermill(src: Path, out: Path, cwd: Path, phase: CellPhase) -> None:
    """papermill.execute_notebook as a user would call it (reads and writes the notebook)."""
    import papermill  # type: ignore[import-untyped]

    papermill.execute_notebook(
        str(src), str(out), kernel_name="python3", progress_bar=False, cwd=str(cwd), **phase.hooks()
    )


def run_nbclient(src: Path, cwd: Path, phase: CellPhase) -> None:
    """nbclient.NotebookClient(...).execute() on the notebook read from disk (no write)."""
    import nbclient
    import nbformat

    nb = nbformat.read(src, as_version=4)
    nbclient.NotebookClient(
        nb, kernel_name="python3", resources={"metadata": {"path": str(cwd)}}, **phase.hooks()
    ).execute()


async def bench_notebook(sizes: Sizes, work: Path) -> dict[str, Any]:
    """(b): the 100-cell notebook and a 1-cell notebook through ours, papermill and nbclient.

    Per cell, two ways: the cell phase / 100 (ours: the run-stage time from the PipelineResult;
    anchors: `CellPhase`), and whole runs as (T100 - T1) / 99, where the 1-cell run is the
    tool's fixed cost (kernel start and shutdown, notebook I/O, flow bookkeeping, one cell).
    papermill and nbclient are sync, so they run in a worker thread with their own loop.
    """
    from prefect_sandbox.flows import arun_notebook

    notebooks = {n: work / f"trivial-{n}.ipynb" for n in (NOTEBOOK_CELLS, 1)}
    for n, path in notebooks.items():
        write_notebook(path, n)
    out_kwargs = output_kwargs(arun_notebook, work / "out")
    phases: dict[str, list[float]] = {"ours": [], "papermill": [], "nbclient": []}
    counter = 0

    async def ours(n: int) -> None:
        result = await arun_notebook(notebook=str(notebooks[n]), **out_kwargs)
        assert result.status == "completed" and result.stages[0].cell_count == n, result
        if n == NOTEBOOK_CELLS:
            phases["ours"].append(result.stages[0].duration_s)

    async def papermill(n: int) -> None:
        nonlocal counter
        counter += 1
        phase = CellPhase()
        out = work / f"pm-{counter}.ipynb"
        await asyncio.to_thread(run_papermill, notebooks[n], out, work, phase)
        assert phase.seconds > 0, "papermill did not run the nbclient hooks"
        if n == NOTEBOOK_CELLS:
            phases["papermill"].append(phase.seconds)

    async def nbclient(n: int) -> None:
        phase = CellPhase()
        await asyncio.to_thread(run_nbclient, notebooks[n], work, phase)
        assert phase.seconds > 0, "nbclient did not run its hooks"
        if n == NOTEBOOK_CELLS:
            phases["nbclient"].append(phase.seconds)

    tools: dict[str, Callable[[int], Awaitable[None]]] = {
        "ours": ours,
        "papermill": papermill,
        "nbclient": nbclient,
    }
    for tool in tools.values():  # warm-up: first imports, first flow run, page cache
        await tool(1)
    wall: dict[str, dict[int, list[float]]] = {name: {NOTEBOOK_CELLS: [], 1: []} for name in tools}
    names = list(tools)
    for rep in range(sizes.notebook_reps):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            for n in (NOTEBOOK_CELLS, 1):
                start = time.perf_counter()
                await tools[name](n)
                wall[name][n].append(time.perf_counter() - start)
    summary: dict[str, Any] = {}
    for name, by_n in wall.items():
        t100, t1 = median(by_n[NOTEBOOK_CELLS]), median(by_n[1])
        summary[name] = {
            "phase_per_cell_ms": ms(median(phases[name]) / NOTEBOOK_CELLS),
            "wall_per_cell_ms": ms(t100 / NOTEBOOK_CELLS),
            "incremental_per_cell_ms": ms((t100 - t1) / (NOTEBOOK_CELLS - 1)),
            "wall_100_ms": ms(t100),
            "wall_1_ms": ms(t1),
            "phase_samples_ms": [ms(v) for v in phases[name]],
            "wall_100_samples_ms": [ms(v) for v in by_n[NOTEBOOK_CELLS]],
            "wall_1_samples_ms": [ms(v) for v in by_n[1]],
        }
    return {"cells": NOTEBOOK_CELLS, "reps": sizes.notebook_reps, "tools": summary}


# ---------------------------------------------------------------- (c) flow overhead


def prefect_floor() -> dict[str, Callable[[], Awaitable[None]]]:
    """Prefect's own cost, no sandbox: an empty async flow run, and one that awaits four no-op
    async tasks (a pipeline's create, run-stage, kill and store-artifacts)."""
    from prefect import flow, task

    @task(name="noop-task")
    async def noop_task(index: int) -> int:
        return index

    @flow(name="empty-flow")
    async def empty_flow() -> None:
        return None

    @flow(name="four-noop-tasks")
    async def four_tasks() -> None:
        for index in range(4):
            await noop_task(index)

    async def empty() -> None:
        await empty_flow()

    async def tasks() -> None:
        await four_tasks()

    return {"empty_flow": empty, "four_tasks": tasks}


FLOOR_PAUSE_S = 2.0
"""The untimed pause before each of Prefect's floor runs, for the server to write the events of
the run before (it answered 503 meanwhile)."""


async def bench_flow_overhead(sizes: Sizes, work: Path) -> dict[str, Any]:
    """(c): a one-stage, one-cell (``pass``) pipeline flow run against a bare sandbox.

    The bare run is `LocalKernelSandbox.create` + ``run_cell('pass')`` + `kill`, which is the
    kernel work the flow cannot avoid; the difference is the flow's own overhead. Beside them,
    in a rotation of its own, Prefect's floor (`prefect_floor`): what any flow run of it costs.
    """
    from prefect_sandbox.flows import amodeling_pipeline
    from prefect_sandbox.sandbox.backends.kernel.local import LocalKernelConfig, LocalKernelSandbox

    out_kwargs = output_kwargs(amodeling_pipeline, work / "out-flow")

    async def flow() -> None:
        result = await amodeling_pipeline(stages={"main": ["pass"]}, **out_kwargs)
        assert result.status == "completed", result

    async def bare() -> None:
        sandbox = await LocalKernelSandbox.create(LocalKernelConfig())
        try:
            assert (await sandbox.run_cell("pass")).status == "ok"
        finally:
            await sandbox.kill()

    # Two rotations, not one: a flow run right after the floor's four task runs met the
    # SQLite server busy writing their events (a 503 and Prefect's ~2 s retry) in 6 of 10;
    # so each floor run also starts after a pause, untimed, as a user's runs would.
    rotations: list[tuple[dict[str, Callable[[], Awaitable[None]]], float]] = [
        ({"flow": flow, "bare": bare}, 0.0),
        (prefect_floor(), FLOOR_PAUSE_S),
    ]
    first: dict[str, float] = {}
    times: dict[str, list[float]] = {}
    for runs, pause_s in rotations:
        for name, run in runs.items():  # warm-up, kept for the record
            start = time.perf_counter()
            await run()
            first[name] = time.perf_counter() - start
        names = list(runs)
        for rep in range(sizes.flow_reps):
            shift = rep % len(names)
            for name in names[shift:] + names[:shift]:
                await asyncio.sleep(pause_s)
                start = time.perf_counter()
                await runs[name]()
                times.setdefault(name, []).append(time.perf_counter() - start)
    diffs = [f - b for f, b in zip(times["flow"], times["bare"], strict=True)]
    return {
        "reps": sizes.flow_reps,
        "flow_median_ms": ms(median(times["flow"])),
        "bare_median_ms": ms(median(times["bare"])),
        "overhead_ms": ms(median(times["flow"]) - median(times["bare"])),
        "paired_diff_median_ms": ms(median(diffs)),
        "empty_flow_median_ms": ms(median(times["empty_flow"])),
        "four_tasks_median_ms": ms(median(times["four_tasks"])),
        "samples_ms": {name: [ms(v) for v in values] for name, values in times.items()},
        "warmup_ms": {name: ms(v) for name, v in first.items()},
    }


# ---------------------------------------------------------------- report


def verdict(ok: bool) -> str:
    """The pass/fail cell of the table."""
    return "pass" if ok else "FAIL"


def build_rows(a: dict[str, Any], b: dict[str, Any], c: dict[str, Any]) -> list[dict[str, str]]:
    """The table's rows, one per compared quantity."""
    med = a["median_ms"]
    tools = b["tools"]
    ours, nbc, pm = tools["ours"], tools["nbclient"], tools["papermill"]
    r_tcp = med["ours"] / med["raw_tcp"]
    r_ipc = med["ours"] / med["raw_ipc"]
    r_phase = ours["phase_per_cell_ms"] / nbc["phase_per_cell_ms"]
    r_wall = ours["wall_per_cell_ms"] / nbc["wall_per_cell_ms"]
    # (T100 - T1) / 99 is a small difference of two noisy numbers; no ratio if it is not > 0.
    r_incr = (
        f"{ours['incremental_per_cell_ms'] / nbc['incremental_per_cell_ms']:.2f} (vs nbclient)"
        if nbc["incremental_per_cell_ms"] > 0 and ours["incremental_per_cell_ms"] > 0
        else "n/a (noise)"
    )

    def anchors(key: str) -> str:
        return f"nbclient {nbc[key]:.2f} ms; papermill {pm[key]:.2f} ms"

    return [
        {
            "benchmark": f"(a) `{CELL}` per cell, median: run_cell vs raw jupyter_client (tcp)",
            "ours": f"{med['ours']:.2f} ms",
            "anchors": f"raw tcp {med['raw_tcp']:.2f} ms",
            "ratio": f"{r_tcp:.2f}",
            "target": "<= 1.10",
            "result": verdict(r_tcp <= 1.10),
        },
        {
            "benchmark": "(a') same, vs raw jupyter_client on ipc (our transport)",
            "ours": f"{med['ours']:.2f} ms",
            "anchors": f"raw ipc {med['raw_ipc']:.2f} ms",
            "ratio": f"{r_ipc:.2f}",
            "target": "<= 1.10",
            "result": verdict(r_ipc <= 1.10),
        },
        {
            "benchmark": "(b) 100 trivial cells, per cell: cell phase (ours: run-stage time)",
            "ours": f"{ours['phase_per_cell_ms']:.2f} ms",
            "anchors": anchors("phase_per_cell_ms"),
            "ratio": f"{r_phase:.2f} (vs nbclient)",
            "target": "<= 1.00",
            "result": verdict(r_phase <= 1.0),
        },
        {
            "benchmark": "(b') same, whole runs: (T100 - T1) / 99",
            "ours": f"{ours['incremental_per_cell_ms']:.2f} ms",
            "anchors": anchors("incremental_per_cell_ms"),
            "ratio": r_incr,
            "target": "info",
            "result": "-",
        },
        {
            "benchmark": "(b'') same, whole runs: T100 / 100 (kernel start etc. included)",
            "ours": f"{ours['wall_per_cell_ms']:.2f} ms",
            "anchors": anchors("wall_per_cell_ms"),
            "ratio": f"{r_wall:.2f} (vs nbclient)",
            "target": "info",
            "result": "-",
        },
        {
            "benchmark": "(c) one-cell pipeline flow minus bare create+run_cell+kill, median",
            "ours": f"{c['overhead_ms']:.0f} ms",
            "anchors": f"flow {c['flow_median_ms']:.0f} ms; bare {c['bare_median_ms']:.0f} ms",
            "ratio": f"{c['flow_median_ms'] / c['bare_median_ms']:.2f} (flow/bare)",
            "target": f"<= {FLOW_OVERHEAD_TARGET_MS} ms",
            "result": verdict(c["overhead_ms"] <= FLOW_OVERHEAD_TARGET_MS),
        },
        {
            "benchmark": "(c') Prefect's floor: an empty async flow run; one awaiting 4 no-op "
            "tasks, median",
            "ours": "-",
            "anchors": f"empty {c['empty_flow_median_ms']:.0f} ms; "
            f"4 tasks {c['four_tasks_median_ms']:.0f} ms",
            "ratio": f"{c['four_tasks_median_ms'] / c['overhead_ms']:.2f} (4 tasks / (c))"
            if c["overhead_ms"] > 0
            else "n/a (noise)",
            "target": "info",
            "result": "-",
        },
    ]


def markdown_table(rows: list[dict[str, str]]) -> str:
    """Render rows as a markdown table."""
    header = ["benchmark", "ours", "anchor(s)", "ratio", "target", "pass/fail"]
    keys = ["benchmark", "ours", "anchors", "ratio", "target", "result"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row[k] for k in keys) + " |" for row in rows]
    return "\n".join(lines)


async def run_all(sizes: Sizes) -> dict[str, Any]:
    """Every benchmark in this event loop."""
    work = Path(tempfile.mkdtemp(prefix="bench-local-"))
    timings: dict[str, float] = {}
    try:
        start = time.perf_counter()
        a = await bench_per_cell(sizes)
        timings["a_s"] = time.perf_counter() - start
        start = time.perf_counter()
        b = await bench_notebook(sizes, work)
        timings["b_s"] = time.perf_counter() - start
        start = time.perf_counter()
        c = await bench_flow_overhead(sizes, work)
        timings["c_s"] = time.perf_counter() - start
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"a": a, "b": b, "c": c, "section_s": timings}


@contextlib.contextmanager
def private_tmpdir(prefix: str) -> Iterator[Path]:
    """A fresh folder that TMPDIR (of this process and the kernels it starts) points at.

    Removed, and TMPDIR restored, on exit.
    """
    private_tmp = Path(tempfile.mkdtemp(prefix=prefix))
    saved_tmpdir = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = tempfile.tempdir = str(private_tmp)
    try:
        yield private_tmp
    finally:
        tempfile.tempdir = None  # recomputed from the restored TMPDIR on next use
        if saved_tmpdir is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = saved_tmpdir
        shutil.rmtree(private_tmp, ignore_errors=True)


@dataclass
class HarnessRun:
    """What `timed_harness` measured: seconds (wall), load averages (1, 5, 15 min) and what
    the benchmark left behind (see `leftovers`)."""

    load_before: tuple[float, ...]
    harness_s: float = 0.0
    total_s: float = 0.0
    load_after: tuple[float, ...] = ()
    leftovers: dict[str, list[Any]] = field(default_factory=dict)

    def fields(self) -> dict[str, Any]:
        """The report's timing and load fields."""
        return {
            "loadavg_before": [round(v, 2) for v in self.load_before],
            "loadavg_after": [round(v, 2) for v in self.load_after],
            "harness_start_s": round(self.harness_s, 2),
            "total_s": round(self.total_s, 2),
        }

    def summary(self) -> str:
        """One line: CPUs, total and server-start seconds, the 1-minute load before and after."""
        return (
            f"{os.cpu_count()} CPUs, total {self.total_s:.1f} s (server start "
            f"{self.harness_s:.1f} s); load average 1 min before {self.load_before[0]:.2f}, "
            f"after {self.load_after[0]:.2f}"
        )


@contextlib.contextmanager
def timed_harness(tmp_prefix: str) -> Iterator[HarnessRun]:
    """Prefect's throwaway server (``prefect_test_harness``) and, inside it, a `private_tmpdir`
    named ``tmp_prefix...``, for a benchmark run in the ``with`` block. Set Prefect's settings in
    the environment before: Prefect reads them once, at import.

    Yields the `HarnessRun`, filled in on exit: the server's start, the whole run's wall time,
    the load before and after (other work on a 2-core machine skews everything; readers judge by
    it), and what was left behind in the private TMPDIR or as Jupyter connection files.
    """
    from prefect.testing.utilities import prefect_test_harness

    run = HarnessRun(load_before=os.getloadavg())
    connection_files_before = jupyter_connection_files()
    total_start = time.perf_counter()
    with prefect_test_harness(server_startup_timeout=90):
        run.harness_s = time.perf_counter() - total_start
        # Made after the harness, whose database dir is removed only at exit; kernels inherit
        # TMPDIR too, so the leak check sees only the benchmark's files.
        with private_tmpdir(tmp_prefix) as private_tmp:
            yield run
            run.leftovers = leftovers(private_tmp, connection_files_before)
    run.total_s = time.perf_counter() - total_start
    run.load_after = os.getloadavg()


def git_state() -> dict[str, Any]:
    """The commit measured and whether the working tree had local changes."""
    import subprocess

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], capture_output=True, text=True, cwd=Path(__file__).parent
        ).stdout.strip()

    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain"))}


def publish(path: Path, report: dict[str, Any], summary: str) -> int:
    """Record in ``report`` whether the run was clean, save it as JSON at ``path``, and print
    its ``table_markdown`` and the one-line ``summary``.

    Returns:
        The exit status: 1, with ``LEFT BEHIND: ...`` on stderr, when ``report["raw"]
        ["leftovers"]`` (see `leftovers`) names a kernel or a path; else 0.
    """
    left = report["raw"]["leftovers"]
    report["clean"] = not left["ipykernel_pids"] and not left["paths"]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    print(report["table_markdown"])
    print(f"\n{summary}; raw numbers in {path}")
    if not report["clean"]:
        print(f"LEFT BEHIND: {left}", file=sys.stderr)
        return 1
    return 0


def main() -> int:
    """Run the benchmarks under one ephemeral Prefect server; print and save the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (~1 min)")
    parser.add_argument(
        "--log-level",
        default="WARNING",
        help="PREFECT_LOGGING_LEVEL for the run (default WARNING: keeps per-cell logs quiet)",
    )
    args = parser.parse_args()
    # Must be set before prefect is imported, which reads its settings once.
    os.environ["PREFECT_LOGGING_LEVEL"] = args.log_level
    # The throwaway server's telemetry only adds noise (and a write that can hit a locked DB).
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    sizes = QUICK if args.quick else FULL
    with timed_harness("bench-local-tmp-") as measured:
        raw = asyncio.run(run_all(sizes))
    raw["leftovers"] = measured.leftovers
    rows = build_rows(raw["a"], raw["b"], raw["c"])
    table = markdown_table(rows)
    report = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "mode": "quick" if args.quick else "full",
        "prefect_logging_level": args.log_level,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": sys.version.split()[0],
        },
        "versions": {
            pkg: version(pkg)
            for pkg in ("prefect", "jupyter_client", "ipykernel", "nbclient", "papermill", "pyzmq")
        },
        "git": git_state(),
        "sizes": sizes.__dict__,
        **measured.fields(),
        "rows": rows,
        "table_markdown": table,
        "raw": raw,
    }
    summary = f"{report['mode']} run, {measured.summary()}"
    return publish(RESULTS_PATH, report, summary)


if __name__ == "__main__":
    sys.exit(main())
