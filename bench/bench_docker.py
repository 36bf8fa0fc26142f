"""Docker backend benchmark: sandbox start, per-cell time and kill against a local kernel.

Both run side by side in one process: `DockerSandbox` (the offline test image, default
settings: no network, read-only root, limits) and `LocalKernelSandbox` with its default
settings (under bubblewrap). Starts alternate between the two; cells run in rounds, one
``1+1`` on each in turn, the first one rotating.

Run from the repository root: ``python bench/bench_docker.py [--quick]``. Needs a Docker
daemon (started if none runs, as root) and builds the test image if it is missing. Prints a
markdown table and writes it, with the raw numbers, to ``bench/results/docker.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from prefect_sandbox.sandbox.backends.kernel.docker import DockerSandbox, DockerSandboxConfig
from prefect_sandbox.sandbox.backends.kernel.local import LocalKernelConfig, LocalKernelSandbox
from prefect_sandbox.sandbox.base import Sandbox
from prefect_sandbox.testing.docker import DockerDaemon, build_test_image

ROOT = Path(__file__).resolve().parent.parent
RESULTS_PATH = ROOT / "bench" / "results" / "docker.json"
CELL = "1+1"
LABELS = {"prefect-sandbox": "true", "suite": "bench-docker"}


def ms(seconds: float) -> float:
    """Seconds to milliseconds, rounded for the report."""
    return round(seconds * 1000, 2)


def summary(samples: list[float]) -> dict[str, float]:
    """Median, mean and p90 of samples in seconds, as milliseconds."""
    ordered = sorted(samples)
    return {
        "median_ms": ms(statistics.median(ordered)),
        "mean_ms": ms(statistics.fmean(ordered)),
        "p90_ms": ms(ordered[int(0.9 * (len(ordered) - 1))]),
    }


async def timed(action: Callable[[], Awaitable[Any]]) -> tuple[float, Any]:
    start = time.perf_counter()
    value = await action()
    return time.perf_counter() - start, value


async def bench(image: str, starts: int, rounds: int, cells: int) -> dict[str, Any]:
    makers: dict[str, Callable[[], Awaitable[Sandbox]]] = {
        "docker": lambda: DockerSandbox.create(DockerSandboxConfig(image=image), LABELS),
        "local": lambda: LocalKernelSandbox.create(LocalKernelConfig(), LABELS),
    }
    names = list(makers)
    start_s: dict[str, list[float]] = {name: [] for name in names}
    kill_s: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(starts + 1):  # the first pair warms caches up and is not counted
        for name in names[rep % 2 :] + names[: rep % 2]:
            took, box = await timed(makers[name])
            await box.run_cell(CELL)
            killed, _ = await timed(box.kill)
            if rep:
                start_s[name].append(took)
                kill_s[name].append(killed)
    boxes = {name: await makers[name]() for name in names}
    cell_s: dict[str, list[float]] = {name: [] for name in names}
    try:
        for name in names:
            for _ in range(20):
                await boxes[name].run_cell(CELL)
        for round_ in range(rounds):
            for index in range(cells):
                order = names[(round_ + index) % 2 :] + names[: (round_ + index) % 2]
                for name in order:
                    took, result = await timed(lambda n=name: boxes[n].run_cell(CELL))
                    outputs = result.outputs
                    assert outputs[-1].get("data", {}).get("text/plain") == "2", (name, outputs)
                    cell_s[name].append(took)
    finally:
        for box in boxes.values():
            await box.kill()
    return {
        "start": {name: summary(start_s[name]) for name in names},
        "kill": {name: summary(kill_s[name]) for name in names},
        "cell": {name: summary(cell_s[name]) for name in names},
        "raw_s": {"start": start_s, "kill": kill_s, "cell": cell_s},
    }


def table(results: dict[str, Any]) -> str:
    rows = [
        "| benchmark | docker | local kernel (bubblewrap) | ratio |",
        "|---|---|---|---|",
    ]
    for key, what in [
        ("start", "start to first answer (create), median"),
        ("cell", "`1+1` per cell (run_cell), median"),
        ("kill", "kill, median"),
    ]:
        docker, local = results[key]["docker"]["median_ms"], results[key]["local"]["median_ms"]
        rows.append(f"| {what} | {docker} ms | {local} ms | {docker / local:.2f} |")
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = parser.parse_args()
    starts, rounds, cells = (3, 2, 50) if args.quick else (10, 5, 200)
    with DockerDaemon() as daemon:
        build_start = time.monotonic()
        image = build_test_image(daemon.client)
        build_s = time.monotonic() - build_start
        load_before = os.getloadavg()
        results = asyncio.run(bench(image, starts, rounds, cells))
        load_after = os.getloadavg()
    report = table(results)
    print(report)
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT
    ).stdout.strip()
    RESULTS_PATH.parent.mkdir(parents=True, exist_ok=True)
    RESULTS_PATH.write_text(
        json.dumps(
            {
                "when": datetime.now(UTC).isoformat(),
                "commit": commit,
                "image": image,
                "image_ready_s": round(build_s, 1),
                "sizes": {"starts": starts, "rounds": rounds, "cells_per_round": cells},
                "load_before": load_before,
                "load_after": load_after,
                "table": report,
                **results,
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
