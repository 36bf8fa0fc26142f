"""What the local backend's warm pool saves: a pooled create against a cold one, and memory.

Two contenders per isolation level (bubblewrap, the default, and none), in one process and one
event loop: `LocalKernelSandbox.create` with no pool (a cold start: the kernel is launched and
answers a kernel_info request), and the same with ``warm_pool_size=1`` once the pool holds a
ready kernel (the create takes it, relabels it, connects and does one kernel_info round trip).

- Create: from the call until ``create`` returns a ready sandbox. Before each sample the pool
  is waited on until it is full again, so no refill runs while either contender is timed; the
  kill is not timed. Rounds alternate which contender goes first.
- First answer: the same plus a ``1+1`` cell, i.e. until the first result is back.
- Memory per live sandbox: the kernel's process tree (``kernel.pid`` and its descendants: the
  ``/bin/sh`` that set the rlimits exec's bwrap, bwrap's init, ipykernel), after create and one
  cell; RSS summed, USS summed (pages only that tree holds) and peak RSS (``VmHWM``) summed;
  and apart, the RSS of the sandbox's guard process (a bare Python that kills the kernel's
  process group if this process dies).

Target: pooled / cold create <= 0.05 (bubblewrap, the default).

    python bench/bench_warm_pool.py [--quick]

Prints a markdown table and writes it with every sample to ``bench/results/warm_pool.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil
from bench_local import (
    CELL,
    child_kernel_pids,
    git_state,
    markdown_table,
    median,
    ms,
    private_tmpdir,
    verdict,
)

from prefect_sandbox.sandbox.backends.kernel.isolation import Isolation
from prefect_sandbox.sandbox.backends.kernel.local import (
    LocalKernelConfig,
    LocalKernelSandbox,
    _guards,
)
from prefect_sandbox.sandbox.backends.kernel.warm_pool import close_warm_pools

RESULTS_PATH = Path(__file__).resolve().parent / "results" / "warm_pool.json"
ISOLATIONS: tuple[Isolation, ...] = ("bubblewrap", "none")
CONTENDERS = ("cold", "pooled")
TARGET = 0.05
FILL_TIMEOUT_S = 120.0
MIB = 1 << 20


def tree_memory(box: LocalKernelSandbox) -> dict[str, float]:
    """RSS, USS and peak RSS (MiB) of the sandbox's kernel and every process under it, and
    its guard's RSS."""
    pid = int((Path(box.handle.connection["runtime_dir"]) / "kernel.pid").read_text())
    root = psutil.Process(pid)
    rss = uss = peak = 0
    for process in [root, *root.children(recursive=True)]:
        info = process.memory_full_info()
        rss += info.rss
        uss += info.uss
        status = Path(f"/proc/{process.pid}/status").read_text()
        peak += next(int(line.split()[1]) for line in status.splitlines() if "VmHWM" in line) * 1024
    guard = psutil.Process(_guards[box.handle.sandbox_id].pid).memory_info().rss
    return {
        "rss_mib": rss / MIB,
        "uss_mib": uss / MIB,
        "peak_rss_mib": peak / MIB,
        "guard_rss_mib": guard / MIB,
    }


async def one_start(config: LocalKernelConfig) -> tuple[float, float, dict[str, float]]:
    """Seconds to a ready sandbox, seconds to its first result, and its memory."""
    start = time.perf_counter()
    box = await LocalKernelSandbox.create(config, {"bench": "warm-pool"})
    created = time.perf_counter() - start
    try:
        result = await box.run_cell(CELL)
        answered = time.perf_counter() - start
        assert result.status == "ok" and result.execution_count == 1, result
        return created, answered, tree_memory(box)
    finally:
        await box.kill()


async def bench_isolation(isolation: Isolation, rounds: int) -> dict[str, Any]:
    """Cold and pooled starts at one isolation level, one warm-up round first."""
    configs = {
        "cold": LocalKernelConfig(isolation=isolation),
        "pooled": LocalKernelConfig(isolation=isolation, warm_pool_size=1),
    }
    samples: dict[str, dict[str, list[Any]]] = {
        name: {"create_s": [], "answer_s": [], "memory": []} for name in CONTENDERS
    }
    for round_index in range(rounds + 1):
        order = CONTENDERS if round_index % 2 == 0 else CONTENDERS[::-1]
        for name in order:
            await LocalKernelSandbox.fill_warm_pool(configs["pooled"], FILL_TIMEOUT_S)
            created, answered, memory = await one_start(configs[name])
            if round_index:
                samples[name]["create_s"].append(created)
                samples[name]["answer_s"].append(answered)
                samples[name]["memory"].append(memory)
    close_warm_pools()
    return samples


def build_rows(results: dict[str, dict[str, Any]]) -> list[dict[str, str]]:
    """Per isolation level: create and first answer, pooled against cold."""
    rows = []
    for isolation, samples in results.items():
        for key, label in (("create_s", "create"), ("answer_s", f"create + first `{CELL}`")):
            cold, pooled = (median(samples[name][key]) for name in CONTENDERS)
            ratio = pooled / cold
            gated = key == "create_s" and isolation == "bubblewrap"
            rows.append(
                {
                    "benchmark": f"{label}, median ({isolation}): pooled vs cold",
                    "ours": f"{ms(pooled):.1f} ms",
                    "anchors": f"cold {ms(cold):.1f} ms",
                    "ratio": f"{ratio:.3f}",
                    "target": f"<= {TARGET}" if gated else "info",
                    "result": verdict(ratio <= TARGET) if gated else "-",
                }
            )
    return rows


def memory_table(results: dict[str, dict[str, Any]]) -> str:
    """Median memory of a live sandbox's process tree, per isolation level and contender."""
    lines = [
        "| sandbox | RSS (MiB) | USS (MiB) | peak RSS (MiB) | guard RSS (MiB) |",
        "|---|---|---|---|---|",
    ]
    for isolation, samples in results.items():
        for name in CONTENDERS:
            memory = samples[name]["memory"]
            cells = [f"{median([m[k] for m in memory]):.1f}" for k in memory[0]]
            lines.append(f"| {name}, {isolation} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    """Run every contender in a private temp dir; print and save the tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (~20 s)")
    args = parser.parse_args()
    rounds = 4 if args.quick else 12
    load_before = os.getloadavg()
    total_start = time.perf_counter()
    with private_tmpdir("bench-warm-pool-"):
        results = {
            isolation: asyncio.run(bench_isolation(isolation, rounds)) for isolation in ISOLATIONS
        }
        left = child_kernel_pids()
    total_s = time.perf_counter() - total_start
    load_after = os.getloadavg()
    table, memory = markdown_table(build_rows(results)), memory_table(results)
    report = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "mode": "quick" if args.quick else "full",
        "git": git_state(),
        "loadavg_before": [round(v, 2) for v in load_before],
        "loadavg_after": [round(v, 2) for v in load_after],
        "total_s": round(total_s, 2),
        "table_markdown": table,
        "memory_markdown": memory,
        "samples": results,
    }
    RESULTS_PATH.parent.mkdir(parents=True, exist_ok=True)
    RESULTS_PATH.write_text(json.dumps(report, indent=2))
    print(table, memory, sep="\n\n")
    print(
        f"\n{report['mode']} run, {os.cpu_count()} CPUs, {total_s:.1f} s; load average 1 min "
        f"before {load_before[0]:.2f}, after {load_after[0]:.2f}; samples in {RESULTS_PATH}"
    )
    if left:
        print(f"LEFT BEHIND: kernel processes {sorted(left)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
