"""Scale: 64 pipelines at once against a real ``prefect server``, on SQLite and on PostgreSQL.

For each database, a ``prefect server start`` of its own (SQLite: Prefect's default file in a
fresh ``PREFECT_HOME``; PostgreSQL: a throwaway cluster of Debian's ``postgresql``, see
`prefect_sandbox.testing.prefect_server`) and, in this one process, ``--runs`` (default 64)
``amodeling_pipeline`` flow runs started together with ``asyncio.gather``, each in its own local
sandbox (the backend's defaults: bubblewrap). Each run has two stages: one writes a JSON file
after a short sleep (``--sleep-s``, so that the runs overlap), the other reads it back; the file is
collected as an artifact and checked in storage (a local folder).

Reported per database: wall time from the first call to the last return, runs completed, the
errors of the others (first line, counted), the most sandboxes (kernel trees) alive at once, the
highest sum of their RSS, the highest RSS of one sandbox, this process's peak RSS, the Prefect
client's retries by HTTP status or exception (counted from its debug log), and what was left
behind: an
ipykernel child, a file or folder in the private ``TMPDIR`` (work dirs, kernel runtime dirs,
staging folders), a new Jupyter connection file.

    python bench/bench_scale.py [--runs 64] [--databases sqlite,postgres] [--sleep-s 5]
                                [--client-retries N] [--server-db-timeout-s S]

With ``--sweep-branches N`` it runs instead one sweep of N branches (subflows, one trivial cell
each) on a server of its own (``--sweep-database``, PostgreSQL by default), every sandbox on the
E2B emulator with E2B Pro's limits (``--creates-per-s 5 --quota 100``), the sweep capped at
``--live`` (100); it reports wall time, the first sandbox's time, the 429s, the peak of live
sandboxes and the Prefect API calls a second, and checks each branch's metric. Bench-only (not
in ``./dev.sh bench``): 1,000 branches took 18 min on 2 cores.

``--client-retries`` sets ``PREFECT_CLIENT_MAX_RETRIES`` for this process's runs (Prefect's
default: 5); ``--server-db-timeout-s`` sets the server's ``PREFECT_SERVER_DATABASE_TIMEOUT``
(Prefect's default: 10 s; on SQLite it is how long a write waits for the lock). Prints a markdown
table and writes it with the raw figures to ``bench/results/scale-<databases>.json``; exit 1
when anything was left behind.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import logging
import os
import resource
import shutil
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench_local import (
    git_state,
    jupyter_connection_files,
    leftovers,
    markdown_table,
    private_tmpdir,
    publish,
)
from bench_sweep import MemorySampler, memory_summary

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def stages(index: int, sleep_s: float) -> dict[str, list[str]]:
    """Run ``index``'s stages: write ``made.json`` after ``sleep_s`` seconds, then read it."""
    return {
        "make": [
            f"import json, time\ntime.sleep({sleep_s})",
            f"json.dump({{'run': {index}}}, open('made.json', 'w'))",
        ],
        "check": ["print(open('made.json').read())"],
    }


class RetryCounter(logging.Handler):
    """Counts the Prefect client's "retryable status code N" debug lines by N, and shows its
    warnings and errors on stderr as they come."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.codes: collections.Counter[str] = collections.Counter()

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        marker = "retryable status code "
        if marker in message:
            self.codes[message.split(marker, 1)[1].split(".", 1)[0]] += 1
        elif "retryable exception" in message:
            kind = record.exc_info[0].__name__ if record.exc_info and record.exc_info[0] else "?"
            self.codes[kind] += 1
        elif record.levelno >= logging.WARNING:
            print(f"{record.levelname} {record.name}: {message}", flush=True)


async def run_many(runs: int, sleep_s: float, storage: Path) -> dict[str, Any]:
    """``runs`` pipelines at once; their outcomes and the wall time."""
    from prefect_sandbox.flows import amodeling_pipeline
    from prefect_sandbox.testing.prefect_server import drain_prefect_workers

    async def one(index: int) -> str:
        result = await amodeling_pipeline(
            stages=stages(index, sleep_s),
            artifacts=["made.json"],
            storage=str(storage / str(index)),
        )
        (folder,) = (storage / str(index)).iterdir()
        assert json.loads((folder / "made.json").read_text()) == {"run": index}
        assert json.loads((folder / "summary.json").read_text())["status"] == "completed"
        return result.status

    # Attached after the flows' import, whose logging set-up replaces the logger's handlers.
    client_logger = logging.getLogger("prefect.client")
    counter = RetryCounter()
    saved = client_logger.level, client_logger.propagate
    client_logger.addHandler(counter)
    client_logger.setLevel(logging.DEBUG)
    client_logger.propagate = False
    try:
        start = time.perf_counter()
        outcomes = await asyncio.gather(*(one(i) for i in range(runs)), return_exceptions=True)
        wall_s = time.perf_counter() - start
        await drain_prefect_workers()
    finally:
        client_logger.removeHandler(counter)
        client_logger.setLevel(saved[0])
        client_logger.propagate = saved[1]
    errors = collections.Counter(
        f"{type(o).__name__}: {str(o).splitlines()[0] if str(o) else ''}"[:300]
        for o in outcomes
        if isinstance(o, BaseException)
    )
    completed = sum(1 for o in outcomes if o == "completed")
    return {
        "wall_s": round(wall_s, 2),
        "completed": completed,
        "errors": dict(errors),
        "client_retries_by_code": dict(counter.codes),
    }


def one_database(database: str, args: argparse.Namespace) -> dict[str, Any]:
    """Start a server on ``database``, run the pipelines against it, and stop it."""
    from prefect.settings import PREFECT_API_URL, PREFECT_CLIENT_MAX_RETRIES, temporary_settings

    from prefect_sandbox.testing.prefect_server import PostgresCluster, PrefectServer

    home = Path(tempfile.mkdtemp(prefix=f"bench-scale-{database}-"))
    cluster = PostgresCluster().start() if database == "postgres" else None
    server_env = {}
    if args.server_db_timeout_s is not None:
        server_env["PREFECT_SERVER_DATABASE_TIMEOUT"] = str(args.server_db_timeout_s)
    settings: dict[Any, Any] = {}
    if args.client_retries is not None:
        settings[PREFECT_CLIENT_MAX_RETRIES] = args.client_retries
    connection_files_before = jupyter_connection_files()
    load_before = os.getloadavg()
    try:
        started = time.perf_counter()
        with PrefectServer(home, cluster.url if cluster else None, server_env) as server:
            server_start_s = time.perf_counter() - started
            settings[PREFECT_API_URL] = server.url
            with (
                temporary_settings(settings),
                private_tmpdir("bench-scale-tmp-") as private_tmp,
                MemorySampler() as peaks,
            ):
                outcome = asyncio.run(run_many(args.runs, args.sleep_s, home / "storage"))
            left = leftovers(private_tmp, connection_files_before)
    finally:
        if cluster is not None:
            cluster.stop()
        shutil.rmtree(home, ignore_errors=True)
    return {
        "database": database,
        **outcome,
        "server_start_s": round(server_start_s, 1),
        "memory": memory_summary(peaks),
        "leftovers": left,
        "loadavg_before": [round(v, 2) for v in load_before],
        "loadavg_after": [round(v, 2) for v in os.getloadavg()],
    }


def build_rows(results: list[dict[str, Any]], runs: int) -> list[dict[str, str]]:
    """One row per database; the target is all runs completed and nothing left behind."""
    rows = []
    for r in results:
        left = r["leftovers"]
        leaked = len(left["ipykernel_pids"]) + len(left["paths"])
        memory = r["memory"]
        retries = ", ".join(f"{n}x {code}" for code, n in r["client_retries_by_code"].items())
        rows.append(
            {
                "benchmark": f"{runs} pipelines at once, {r['database']}",
                "ours": f"{r['completed']}/{runs} completed in {r['wall_s']:.0f} s; "
                f"{memory['max_live']} sandboxes alive at most ({memory['max_total_mib']} MiB "
                f"together, {memory['max_sandbox_mib']} MiB max one); client retries: "
                f"{retries or 'none'}; left behind: {leaked}",
                "anchors": "-",
                "ratio": "-",
                "target": f"{runs}/{runs}, 0 left",
                "result": "pass" if r["completed"] == runs and not leaked else "FAIL",
            }
        )
    return rows


# -- a sweep against the E2B emulator with E2B's limits --------------------------------------

SWEEP_CELL = "import json\njson.dump({'x2': x * 2}, open('metrics.json', 'w'))"
"""Each branch's one cell: trivial, and a metric that shows the branch ran with its own x."""


class ApiCalls:
    """Counts this process's Prefect API calls by answer (its client's ``send``, patched),
    retries included: in subflow mode every flow run of the sweep is in this process."""

    def __init__(self) -> None:
        self.by_status: collections.Counter[str] = collections.Counter()

    def __enter__(self) -> ApiCalls:
        from prefect.client.base import PrefectHttpxAsyncClient

        self._real = real = PrefectHttpxAsyncClient.send
        calls = self.by_status

        async def send(client: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                response = await real(client, request, *args, **kwargs)
            except Exception as exc:  # the client raises for some answers (423, 404...)
                response = getattr(exc, "response", None)
                code = getattr(response, "status_code", None)
                calls[str(code) if code else type(exc).__name__] += 1
                raise
            calls[str(response.status_code)] += 1
            return response

        PrefectHttpxAsyncClient.send = send  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc_info: object) -> None:
        from prefect.client.base import PrefectHttpxAsyncClient

        PrefectHttpxAsyncClient.send = self._real  # type: ignore[method-assign]


def sweep_notebook_file(folder: Path) -> Path:
    """A notebook of a parameters cell (``x = 0``) and `SWEEP_CELL`."""
    import nbformat

    notebook = nbformat.v4.new_notebook()
    notebook.cells = [
        nbformat.v4.new_code_cell("x = 0", metadata={"tags": ["parameters"]}),
        nbformat.v4.new_code_cell(SWEEP_CELL),
    ]
    path = folder / "sweep.ipynb"
    nbformat.write(notebook, path)
    return path


async def run_sweep(args: argparse.Namespace, emulator: Any, storage: Path) -> dict[str, Any]:
    """The sweep of ``args.branches`` branches at most ``args.live`` alive at once; its wall
    time, when its first sandbox came, what the branches ended as and what was verified."""
    from prefect_sandbox import E2BBackend, E2BCredentials
    from prefect_sandbox.flows import asweep_notebook

    credentials = E2BCredentials(
        api_key=emulator.api_key, api_url=emulator.url, sandbox_url=emulator.url
    )
    first: list[float] = []

    async def watch_first(start: float) -> None:
        while not emulator.requests or not emulator.sandbox_ids():
            await asyncio.sleep(0.1)
        first.append(time.perf_counter() - start)

    start = time.perf_counter()
    watcher = asyncio.create_task(watch_first(start))
    sweep_error = None
    try:
        await asweep_notebook(
            notebook=str(sweep_notebook_file(storage.parent)),
            grid={"x": list(range(args.branches))},
            backend=E2BBackend(credentials=credentials, lifetime_s=900),
            storage=str(storage),
            max_live_sandboxes=args.live,
            cell_timeout_s=300,
        )
    except Exception as exc:  # a failed branch: sweep.json says which
        sweep_error = f"{type(exc).__name__}: {str(exc)[:500]}"
    wall_s = time.perf_counter() - start
    watcher.cancel()
    (stored,) = storage.glob("*/sweep.json")
    branches = json.loads(stored.read_text())["branches"]
    statuses = collections.Counter(branch["status"] for branch in branches)
    verified = sum(
        1
        for branch in branches
        if branch["status"] == "completed"
        and branch["metrics"].get("x2") == 2 * branch["parameters"]["x"]
    )
    errors = collections.Counter(
        (branch["error"] or "")[:200] for branch in branches if branch["status"] != "completed"
    )
    return {
        "wall_s": round(wall_s, 1),
        "first_sandbox_s": round(first[0], 1) if first else None,
        "branch_statuses": dict(statuses),
        "verified": verified,
        "errors": dict(errors.most_common(5)),
        "sweep_error": sweep_error,
    }


def one_sweep(args: argparse.Namespace) -> dict[str, Any]:
    """A server on ``args.sweep_database``, the E2B emulator with the limits asked for, the
    sweep, and everything stopped."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from prefect_sandbox.flows.sweep import launchers
    from prefect_sandbox.testing.e2b import E2BEmulator
    from prefect_sandbox.testing.limits import Limits, RateLimit
    from prefect_sandbox.testing.prefect_server import PostgresCluster, PrefectServer

    if args.branches_starting:
        launchers.BRANCHES_STARTING = args.branches_starting
    database = args.sweep_database
    home = Path(tempfile.mkdtemp(prefix=f"bench-sweep-{database}-"))
    cluster = PostgresCluster().start() if database == "postgres" else None
    limits = Limits(
        rates={"create": RateLimit(args.creates_per_s, 1.0)}, max_live_sandboxes=args.quota
    )
    load_before = os.getloadavg()
    try:
        with (
            PrefectServer(home, cluster.url if cluster else None) as server,
            temporary_settings({PREFECT_API_URL: server.url}),
            E2BEmulator(limits=limits) as emulator,
            ApiCalls() as calls,
        ):
            outcome = asyncio.run(run_sweep(args, emulator, home / "storage"))
            refused = dict(emulator.limits.refused)
            peak = emulator.peak_live_sandboxes
            creates = sum(1 for r in emulator.requests if r.operation == "create")
            left = emulator.sandbox_ids()
    finally:
        if cluster is not None:
            cluster.stop()
        shutil.rmtree(home, ignore_errors=True)
    total_calls = sum(calls.by_status.values())
    return {
        "database": database,
        "branches": args.branches,
        "branches_starting": launchers.BRANCHES_STARTING,
        "live_cap": args.live,
        "limits": {"creates_per_s": args.creates_per_s, "quota": args.quota},
        **outcome,
        "create_requests": creates,
        "refused_by_limits": refused,
        "peak_live_sandboxes": peak,
        "sandboxes_left": len(left),
        "api_calls": total_calls,
        "api_calls_per_s": round(total_calls / outcome["wall_s"], 1),
        "api_answers": dict(calls.by_status),
        "loadavg_before": [round(v, 2) for v in load_before],
        "loadavg_after": [round(v, 2) for v in os.getloadavg()],
    }


def sweep_rows(r: dict[str, Any]) -> list[dict[str, str]]:
    """The sweep's row: the target is every branch verified, the peak at the cap, none left."""
    completed = r["branch_statuses"].get("completed", 0)
    passed = r["verified"] == r["branches"] and r["peak_live_sandboxes"] <= r["live_cap"]
    return [
        {
            "benchmark": f"{r['branches']}-branch sweep, E2B emulator "
            f"({r['limits']['creates_per_s']} creates/s, {r['limits']['quota']} live), "
            f"{r['database']}",
            "ours": f"{completed}/{r['branches']} completed ({r['verified']} verified) in "
            f"{r['wall_s']:.0f} s, first sandbox at {r['first_sandbox_s']} s; "
            f"{sum(r['refused_by_limits'].values())} 429s; peak {r['peak_live_sandboxes']} "
            f"live (cap {r['live_cap']}); {r['api_calls']} API calls "
            f"({r['api_calls_per_s']}/s); left: {r['sandboxes_left']}",
            "anchors": "-",
            "ratio": "-",
            "target": f"{r['branches']}/{r['branches']}, peak <= {r['live_cap']}",
            "result": "pass" if passed and not r["sandboxes_left"] else "FAIL",
        }
    ]


def sweep_main(args: argparse.Namespace) -> int:
    """Run the sweep once; print and save its row."""
    result = one_sweep(args)
    rows = sweep_rows(result)
    report = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "git": git_state(),
        "cpus": os.cpu_count(),
        "rows": rows,
        "table_markdown": markdown_table(rows),
        "raw": {"sweep": result, "leftovers": {"ipykernel_pids": [], "paths": []}},
    }
    print(json.dumps(result, indent=2))
    name = f"scale-sweep-{args.branches}-{args.sweep_database}.json"
    return publish(RESULTS_DIR / name, report, f"a {args.branches}-branch sweep")


def main() -> int:
    """Run the pipelines once per database (or the sweep, with ``--sweep-branches``); print
    and save the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=64, help="pipelines at once (default 64)")
    parser.add_argument("--databases", default="sqlite,postgres", help="default sqlite,postgres")
    parser.add_argument("--sleep-s", type=float, default=5.0, help="each run's sleep (default 5)")
    parser.add_argument(
        "--client-retries", type=int, help="PREFECT_CLIENT_MAX_RETRIES (default: Prefect's, 5)"
    )
    parser.add_argument(
        "--server-db-timeout-s",
        type=float,
        help="the server's PREFECT_SERVER_DATABASE_TIMEOUT (default: Prefect's, 10 s)",
    )
    parser.add_argument(
        "--sweep-branches",
        dest="branches",
        type=int,
        help="run the simulated sweep of this many branches instead (e.g. 1000)",
    )
    parser.add_argument("--sweep-database", default="postgres", help="default postgres")
    parser.add_argument("--live", type=int, default=100, help="the sweep's cap (default 100)")
    parser.add_argument("--creates-per-s", type=int, default=5, help="E2B Pro's: 5")
    parser.add_argument("--quota", type=int, default=100, help="E2B Pro's live quota: 100")
    parser.add_argument(
        "--branches-starting",
        type=int,
        help="subflow branches starting at once (default: the launcher's BRANCHES_STARTING)",
    )
    args = parser.parse_args()
    # Must be set before prefect is imported, which reads its settings once.
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    if args.branches:
        return sweep_main(args)
    results = [one_database(d, args) for d in args.databases.split(",")]
    rows = build_rows(results, args.runs)
    report = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "runs": args.runs,
        "sleep_s": args.sleep_s,
        "client_retries": args.client_retries,
        "server_db_timeout_s": args.server_db_timeout_s,
        "git": git_state(),
        "cpus": os.cpu_count(),
        "peak_rss_this_process_mib": round(
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        ),
        "rows": rows,
        "table_markdown": markdown_table(rows),
        "raw": {
            "databases": results,
            "leftovers": {
                "ipykernel_pids": [p for r in results for p in r["leftovers"]["ipykernel_pids"]],
                "paths": [p for r in results for p in r["leftovers"]["paths"]],
            },
        },
    }
    for r in results:
        print(
            f"{r['database']}: errors {r['errors'] or 'none'}; load {r['loadavg_before']} -> "
            f"{r['loadavg_after']}; server start {r['server_start_s']} s"
        )
    path = RESULTS_DIR / f"scale-{args.databases.replace(',', '-')}.json"
    return publish(path, report, f"{args.runs} pipelines per database")


if __name__ == "__main__":
    raise SystemExit(main())
