"""H05 benchmark: a cell printing 100 MB to stdout, through `LocalKernelSandbox.run_cell`
(capped at 1 MiB) against a raw jupyter_client read of the same cell (everything kept); then,
through ours only, a cell that publishes 10 raw display messages of 50 MiB each (issue 18: the
CLI grew to 829 MB), whose peak RSS growth should stay near one message, not ten.

Reports throughput (MB/s) and the client process's peak RSS growth for each, side by side in
one process. Targets: ours >= 0.8x raw throughput; our RSS growth bounded by the cap plus a
small constant (raw keeps all 100 MB, so its growth is the reference for the unbounded case).

    python bench/bench_output.py
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path
from queue import Empty
from typing import Any

import psutil
from jupyter_client.manager import AsyncKernelManager

from prefect_sandbox.sandbox.backends.kernel.local import LocalKernelConfig, LocalKernelSandbox

CELL = "import sys\nfor _ in range(100): sys.stdout.write('x' * 2**20 + '\\n')\nprint('END')"
RAW_DISPLAYS_CELL = (
    "from IPython.display import publish_display_data\n"
    "for _ in range(10): publish_display_data({'text/plain': 'x' * (50 << 20)})\n"
    "print('END')"
)
MB = 1e6
RESULTS = Path(__file__).parent / "results"


class PeakRss:
    """Samples this process's RSS every 10 ms while in use."""

    def __enter__(self) -> PeakRss:
        self._process = psutil.Process()
        self.baseline = self._process.memory_info().rss
        self.peak = self.baseline
        self._running = True
        self._thread = threading.Thread(target=self._sample)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while self._running:
            self.peak = max(self.peak, self._process.memory_info().rss)
            time.sleep(0.01)

    def __exit__(self, *exc: object) -> None:
        self._running = False
        self._thread.join()

    @property
    def growth_mib(self) -> float:
        return (self.peak - self.baseline) / 2**20


async def raw_round(client: Any) -> tuple[float, int]:
    """Execute the cell raw; keep every stream text; return (seconds, bytes received)."""
    start = time.perf_counter()
    msg_id = client.execute(CELL, allow_stdin=False)
    texts: list[str] = []
    while True:
        try:
            msg = await client.get_iopub_msg(timeout=60)
        except Empty:
            raise RuntimeError("raw kernel went silent") from None
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["header"]["msg_type"] == "stream":
            texts.append(msg["content"]["text"])
        if msg["header"]["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            break
    await client.get_shell_msg(timeout=60)
    return time.perf_counter() - start, sum(len(t) for t in texts)


async def main() -> None:
    rows: dict[str, dict[str, float]] = {}
    manager = AsyncKernelManager(kernel_name="python3")
    await manager.start_kernel()
    client = manager.client()
    client.start_channels()
    await client.wait_for_ready(timeout=60)
    box = await LocalKernelSandbox.create(LocalKernelConfig())
    try:
        await box.run_cell("print('warm')")
        await raw_round(client)
        for name in ("raw", "ours", "raw", "ours"):
            with PeakRss() as rss:
                if name == "raw":
                    seconds, size = await raw_round(client)
                else:
                    start = time.perf_counter()
                    result = await box.run_cell(CELL, timeout_s=120)
                    seconds, size = time.perf_counter() - start, result.output_chars
                    assert result.status == "ok" and "END" in result.outputs[-1]["text"]
            best = rows.get(name)
            if best is None or seconds < best["seconds"]:
                rows[name] = {
                    "seconds": seconds,
                    "mb_per_s": size / MB / seconds,
                    "rss_growth_mib": rss.growth_mib,
                }
        with PeakRss() as rss:
            result = await box.run_cell(RAW_DISPLAYS_CELL, timeout_s=300)
            assert result.status == "ok" and "END" in str(result.outputs)
        displays_growth_mib = rss.growth_mib
    finally:
        await box.kill()
        client.stop_channels()
        await manager.shutdown_kernel(now=True)
    ratio = rows["ours"]["mb_per_s"] / rows["raw"]["mb_per_s"]
    print("| 100 MB stdout cell | MB/s | peak RSS growth (MiB) |")
    print("|---|---|---|")
    for name in ("raw", "ours"):
        row = rows[name]
        print(f"| {name} | {row['mb_per_s']:.1f} | {row['rss_growth_mib']:.1f} |")
    print(f"throughput ratio ours/raw: {ratio:.2f} (target >= 0.8)")
    print(f"10 raw 50 MiB display messages, ours: peak RSS growth {displays_growth_mib:.1f} MiB")
    RESULTS.mkdir(exist_ok=True)
    summary = {"rows": rows, "ratio": ratio, "raw_displays_rss_growth_mib": displays_growth_mib}
    (RESULTS / "output.json").write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
