"""The command line against papermill's: what a user waits for, start to exit.

A one-cell and a 20-cell notebook (trivial cells) run through ``prefect-sandbox run`` and
through ``papermill`` on the same notebook, each a fresh process as a user starts it,
interleaved (the order of the two tools alternates per repetition), in these set-ups:

(a) a running ``prefect server`` (started here, on 127.0.0.1, with its own PREFECT_HOME) and
    ``PREFECT_API_URL`` set, the fast path; target: ours <= papermill + 1 s;
(k) no API URL, on a machine that ran one before: the local Prefect server kept for the user
    (`prefect_sandbox.local_server`) is already up in that PREFECT_HOME (a warm-up run started
    it); target: ours <= papermill + 1.5 s;
(f) the first run ever: a fresh PREFECT_HOME each time, so the run starts the kept server
    (stopped after each sample); reported, with its one-cell papermill beside it;
(b) no API URL and ``PREFECT_SANDBOX_LOCAL_SERVER=never``: each run starts Prefect's temporary
    API server, and stops it at exit (not run by default: ``--modes a,k,f,b``).

Wall time per run; for ours also the split, from timestamps the run leaves: the process's own
start (interpreter and site, until the CLI's module runs), imports and argument checks (until the
CLI checks the API), the API (a health check of the running server, finding or starting the
kept one, or starting the temporary one), the flow run's creation (until "Beginning flow run"),
the sandbox's start (until the create-sandbox task ends: notebook read, store prepared, kernel
started), the cells (run-stage tasks' ``duration_s`` from ``--json``), then download, kill and
store (until the flow run ends), and exit (Prefect's shutdown, the temporary server's stop). The
CLI runs through a small wrapper that records when its module starts running and when it checks
the API; log lines give the rest.

Run from the repository root: ``python bench/bench_cli.py [--reps N] [--quick]``. Prints a
markdown table and writes it with every sample to ``bench/results/cli.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS_PATH = ROOT / "bench" / "results" / "cli.json"
BIN = Path(sys.executable).parent
TARGETS_EXTRA_S = {"a": 1.0, "k": 1.5}
"""Targets: ours at most papermill plus this many seconds, per set-up."""
MODE_NAMES = {
    "a": "running server",
    "k": "kept server, up",
    "f": "first run ever",
    "b": "temporary server",
}
SERVER_START_S = 180.0

# The CLI through a wrapper that notes when its module starts and when it checks the API; main()
# without argv (it reads sys.argv[1:]) ends the process as the installed command does.
_WRAPPER = """
import sys, time
started = time.time()
import prefect_sandbox.cli as cli
check = getattr(cli, "_api_problem", None)
if check is not None:
    def timed_check(*args, **kwargs):
        began = time.time()
        try:
            return check(*args, **kwargs)
        finally:
            print(f"BENCH-API {began} {time.time()}", file=sys.stderr, flush=True)
    cli._api_problem = timed_check
print(f"BENCH-START {started}", file=sys.stderr, flush=True)
sys.exit(cli.main())

"""
_LOG_LINE = re.compile(r"^(\d\d):(\d\d):(\d\d)\.(\d{3}) \| \w+ +\| (.*)$")


def write_notebook(path: Path, cells: int) -> None:
    """A notebook of ``cells`` trivial code cells, the first tagged ``parameters``."""
    import nbformat

    notebook = nbformat.v4.new_notebook()
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3"}
    notebook.cells = [nbformat.v4.new_code_cell("x = 1", metadata={"tags": ["parameters"]})]
    notebook.cells += [nbformat.v4.new_code_cell(f"y = x + {n}") for n in range(cells - 1)]
    nbformat.write(notebook, path)


def load() -> str:
    """``uptime``'s load averages (1, 5, 15 minutes)."""
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} {five:.2f} {fifteen:.2f}"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class PrefectServer:
    """``prefect server start`` on 127.0.0.1 with its own PREFECT_HOME, stopped by `stop`."""

    def __init__(self, home: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/api"
        env = {**base_env(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
        self.log = (home / "server.log").open("w")
        self.process = subprocess.Popen(
            [
                str(BIN / "prefect"),
                "server",
                "start",
                "--host",
                "127.0.0.1",
                "--port",
                f"{self.port}",
            ],
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_until_healthy(self) -> float:
        """Seconds it took to answer its health check."""
        start = time.monotonic()
        while time.monotonic() - start < SERVER_START_S:
            if self.process.poll() is not None:
                raise RuntimeError(f"prefect server exited: see {self.log.name}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as response:
                    if response.status == 200:
                        return time.monotonic() - start
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"prefect server did not answer in {SERVER_START_S} s")

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.log.close()


def base_env(home: Path) -> dict[str, str]:
    """This environment without a Prefect API or sandbox settings, with its own PREFECT_HOME."""
    env = {
        name: value
        for name, value in os.environ.items()
        if name != "PREFECT_API_URL" and not name.startswith("PREFECT_SANDBOX_")
    }
    return {**env, "PREFECT_HOME": str(home), "JUPYTER_PLATFORM_DIRS": "1"}


def log_times(stderr: str, day: datetime) -> list[tuple[float, str]]:
    """(epoch seconds, message) of each Prefect console line, its clock read on ``day``."""
    found = []
    for line in stderr.splitlines():
        match = _LOG_LINE.match(line)
        if match:
            hours, minutes, seconds, millis = (int(part) for part in match.groups()[:4])
            moment = day.replace(
                hour=hours, minute=minutes, second=seconds, microsecond=millis * 1000
            )
            found.append((moment.timestamp(), match.group(5)))
    return found


def first(times: list[tuple[float, str]], pattern: str, last: bool = False) -> float | None:
    hits = [moment for moment, message in times if re.search(pattern, message)]
    if not hits:
        return None
    return hits[-1] if last else hits[0]


def split(stderr: str, stdout: str, spawned: float, exited: float) -> dict[str, float | None]:
    """Where one run of ours spent its time (seconds per phase; None where a mark is missing)."""
    day = datetime.fromtimestamp(spawned)
    times = log_times(stderr, day.replace(hour=0, minute=0, second=0, microsecond=0))
    marks: dict[str, float | None] = {"spawned": spawned}
    start = re.search(r"^BENCH-START (\S+)$", stderr, re.M)
    api = re.search(r"^BENCH-API (\S+) (\S+)$", stderr, re.M)
    marks["module"] = float(start.group(1)) if start else None
    marks["api_check"] = float(api.group(1)) if api else None
    marks["api_ready"] = float(api.group(2)) if api else None
    marks["flow_begins"] = first(times, r"Beginning flow run")
    marks["sandbox_ready"] = first(times, r"Task run 'create-sandbox.*Finished in state")
    marks["cells_end"] = first(times, r"Task run 'run-stage.*Finished in state", last=True)
    marks["flow_ends"] = first(times, r"Flow run .* - Finished in state")
    marks["exited"] = exited
    names = [
        ("process start", "spawned", "module"),
        ("imports and checks", "module", "api_check"),
        ("API", "api_check", "api_ready"),
        ("flow run created", "api_ready", "flow_begins"),
        ("sandbox start", "flow_begins", "sandbox_ready"),
        ("cells (tasks)", "sandbox_ready", "cells_end"),
        ("kill, store", "cells_end", "flow_ends"),
        ("exit", "flow_ends", "exited"),
    ]
    phases: dict[str, float | None] = {}
    for name, begin, end in names:
        a, b = marks[begin], marks[end]
        phases[name] = round(b - a, 3) if a is not None and b is not None else None
    try:
        result = json.loads(stdout)
        phases["cells (run-stage duration_s)"] = round(
            sum(stage["duration_s"] for stage in result["stages"]), 3
        )
    except (ValueError, KeyError, TypeError):
        phases["cells (run-stage duration_s)"] = None
    return phases


def run_ours(notebook: Path, env: dict[str, str], out: Path) -> dict[str, Any]:
    command = [
        sys.executable,
        "-c",
        _WRAPPER,
        "run",
        str(notebook),
        "--out",
        str(out),
        "--json",
        "-v",
    ]
    spawned = time.time()
    done = subprocess.run(
        command, env=env, cwd=notebook.parent, capture_output=True, text=True, timeout=900
    )
    exited = time.time()
    if done.returncode != 0:
        raise RuntimeError(
            f"prefect-sandbox run failed ({done.returncode}):\n{done.stderr[-3000:]}"
        )
    return {
        "wall_s": round(exited - spawned, 3),
        "split": split(done.stderr, done.stdout, spawned, exited),
    }


def run_papermill(notebook: Path, env: dict[str, str], out: Path) -> dict[str, Any]:
    command = [str(BIN / "papermill"), str(notebook), str(out / f"pm-{notebook.name}")]
    spawned = time.time()
    done = subprocess.run(
        command, env=env, cwd=notebook.parent, capture_output=True, text=True, timeout=900
    )
    exited = time.time()
    if done.returncode != 0:
        raise RuntimeError(f"papermill failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return {"wall_s": round(exited - spawned, 3)}


def bench_mode(mode: str, env: dict[str, str], work: Path, reps: int) -> list[dict[str, Any]]:
    """Every sample of one set-up, after a warm-up run of each tool (not kept)."""
    notebooks = {cells: work / f"cells-{cells}.ipynb" for cells in (1, 20)}
    out = work / "out"
    tools = {"prefect-sandbox": run_ours, "papermill": run_papermill}
    for tool in tools.values():
        tool(notebooks[1], env, out)
    samples = []
    for rep in range(reps):
        for cells, notebook in notebooks.items():
            order = list(tools) if rep % 2 == 0 else list(reversed(tools))
            for name in order:
                before = load()
                sample = tools[name](notebook, env, out)
                samples.append(
                    {"mode": mode, "cells": cells, "tool": name, "rep": rep, "load": before}
                    | sample
                )
                print(
                    f"  ({mode}) {cells:>2} cell(s) {name:<15} {sample['wall_s']:7.2f} s  "
                    f"load {before}",
                    file=sys.stderr,
                )
    return samples


def bench_first_runs(work: Path, reps: int) -> list[dict[str, Any]]:
    """(f): per repetition a fresh PREFECT_HOME, so our run starts the kept server (stopped
    after), beside a papermill run of the one-cell notebook."""
    from prefect_sandbox.local_server import LocalServer

    notebook = work / "cells-1.ipynb"
    samples = []
    for rep in range(reps):
        home = work / f"first-home-{rep}"
        home.mkdir()
        env = base_env(home)
        try:
            for name in ("prefect-sandbox", "papermill"):
                before = load()
                run = run_ours if name == "prefect-sandbox" else run_papermill
                sample = run(notebook, env, work / "out")
                samples.append(
                    {"mode": "f", "cells": 1, "tool": name, "rep": rep, "load": before} | sample
                )
                print(
                    f"  (f)  1 cell(s) {name:<15} {sample['wall_s']:7.2f} s  load {before}",
                    file=sys.stderr,
                )
        finally:
            LocalServer(home).stop()
    return samples


def median_or_none(values: list[float | None]) -> float | None:
    present = [value for value in values if value is not None]
    return round(statistics.median(present), 2) if present else None


def table(samples: list[dict[str, Any]]) -> list[str]:
    """The markdown rows: per set-up and notebook, median walls, the target, the split."""
    rows = [
        "| set-up | cells | ours (s) | papermill (s) | ours - papermill (s) | target | "
        "ours' split, medians (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode, mode_name in MODE_NAMES.items():
        for cells in (1, 20):
            mine = [
                s
                for s in samples
                if (s["mode"], s["cells"], s["tool"]) == (mode, cells, "prefect-sandbox")
            ]
            theirs = [
                s
                for s in samples
                if (s["mode"], s["cells"], s["tool"]) == (mode, cells, "papermill")
            ]
            if not mine or not theirs:
                continue
            ours_s = statistics.median(s["wall_s"] for s in mine)
            papermill_s = statistics.median(s["wall_s"] for s in theirs)
            target = "report"
            if mode in TARGETS_EXTRA_S:
                extra = TARGETS_EXTRA_S[mode]
                met = ours_s <= papermill_s + extra
                target = f"<= +{extra:g} s: {'met' if met else 'NOT met'}"
            phases = mine[0]["split"].keys()
            parts = ", ".join(
                f"{name} {median_or_none([s['split'][name] for s in mine])}" for name in phases
            )
            rows.append(
                f"| ({mode}) {mode_name} | {cells} | {ours_s:.2f} | {papermill_s:.2f} | "
                f"{ours_s - papermill_s:+.2f} | {target} | {parts} |"
            )
    return rows


def run_modes(modes: list[str], work: Path, reps: int) -> tuple[list[dict[str, Any]], Any]:
    """The samples of each set-up asked for, and the seconds ``prefect server start`` took."""
    from prefect_sandbox.local_server import LocalServer

    samples: list[dict[str, Any]] = []
    server_start_s = None
    if "a" in modes:
        (work / "server-home").mkdir()
        server = PrefectServer(work / "server-home")
        try:
            server_start_s = round(server.wait_until_healthy(), 2)
            (work / "client-home").mkdir()
            env = base_env(work / "client-home") | {"PREFECT_API_URL": server.url}
            samples += bench_mode("a", env, work, reps)
        finally:
            server.stop()
    if "k" in modes:
        (work / "kept-home").mkdir()
        try:  # the warm-up run starts the kept server; the samples find it up
            samples += bench_mode("k", base_env(work / "kept-home"), work, reps)
        finally:
            LocalServer(work / "kept-home").stop()
    if "f" in modes:
        samples += bench_first_runs(work, reps)
    if "b" in modes:
        (work / "ephemeral-home").mkdir()
        env = base_env(work / "ephemeral-home") | {"PREFECT_SANDBOX_LOCAL_SERVER": "never"}
        samples += bench_mode("b", env, work, reps)
    return samples, server_start_s


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3, help="repetitions per notebook and tool")
    parser.add_argument("--quick", action="store_true", help="one repetition")
    parser.add_argument("--modes", default="a,k,f", help="set-ups to run, of a, k, f and b")
    args = parser.parse_args()
    reps = 1 if args.quick else args.reps
    modes = args.modes.split(",")
    work = Path(tempfile.mkdtemp(prefix="bench-cli-"))
    load_before = load()
    try:
        for cells in (1, 20):
            write_notebook(work / f"cells-{cells}.ipynb", cells)
        samples, server_start_s = run_modes(modes, work, reps)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = table(samples)
    print("\n".join(rows))
    print(f"\nload before {load_before}, after {load()}; prefect server start {server_start_s} s")
    RESULTS_PATH.parent.mkdir(parents=True, exist_ok=True)
    RESULTS_PATH.write_text(
        json.dumps(
            {
                "when": datetime.now().astimezone().isoformat(),
                "load_before": load_before,
                "load_after": load(),
                "cpus": os.cpu_count(),
                "reps": reps,
                "modes": modes,
                "prefect_server_start_s": server_start_s,
                "table": rows,
                "samples": samples,
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
