"""Shared fixtures: one Prefect test harness per session, real kernels, clean-up checks."""

from __future__ import annotations

import ast
import contextlib
import copyreg
import functools
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
import pytest

# A pytest-xdist worker's own TMPDIR and PREFECT_HOME, set before Prefect is imported.
import tests.workers  # noqa: F401  # isort: split

# jupyter_core warns about its coming path change unless told which to use.
os.environ.setdefault("JUPYTER_PLATFORM_DIRS", "1")
# The suite's runs use servers of its own (Prefect's test harness, `PrefectServer`): a CLI or
# script run here never starts the local server kept for the user, which would outlive the
# suite. Tests of that server ask for it in their subprocesses' environment.
os.environ["PREFECT_SANDBOX_LOCAL_SERVER"] = "never"

from prefect_sandbox.sandbox.notebook import retry_ast_race
from prefect_sandbox.testing.daytona import DaytonaEmulator
from prefect_sandbox.testing.s3 import MotoServer

pytest_plugins = [
    "prefect_sandbox.testing.daytona.fixtures",
    "prefect_sandbox.testing.docker_fixtures",
]

if TYPE_CHECKING:
    from prefect_sandbox.testing.e2b import E2BEmulator
    from tests.test_deployments import PrefectStack

ROOT = Path(__file__).resolve().parent.parent

# This process is full of threads that log exceptions, and CPython 3.11 builds an AST to format
# each traceback: pytest's own reports (ast.parse in its source lookup) met the race that
# `retry_ast_race` describes and stopped a whole run with an INTERNALERROR.
ast.parse = functools.partial(retry_ast_race, ast.parse)


LONGEST_MODULES_FIRST = (
    "test_deployments.py",
    "test_emulator_faults.py",
    "contract/test_session.py",
    "test_isolation.py",
    "test_interrupts.py",
    "test_sweep.py",
    "contract/test_timeouts.py",
    "test_limits.py",
    "test_flows.py",
    "test_docs_snippets.py",
    "test_local_server.py",
    "test_cli.py",
    "test_agent_clients.py",
    "test_dev_sh.py",
    "test_dask.py",
    "test_session.py",
    "contract/test_fidelity.py",
    "test_local_sandbox.py",
)
"""The modules that take longest (their tests' time on six workers, 2026-12-06: 122-325 s each),
longest first: pytest-xdist's ``loadscope`` hands modules out in collection order (with
``--no-loadscope-reorder``: by default it hands out the modules with most tests first, which
started test_deployments, 7 tests and 325 s, at 550 s of 875), and one of them started last
would leave the other workers idle at the end."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Collect `LONGEST_MODULES_FIRST` first, in that order; the rest as found."""
    rank = {name: position for position, name in enumerate(LONGEST_MODULES_FIRST)}

    def module_rank(item: pytest.Item) -> int:
        return rank.get(item.path.relative_to(ROOT / "tests").as_posix(), len(rank))

    items.sort(key=module_rank)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"stopped by {signal.Signals(signum).name}")


def pytest_configure(config: pytest.Config) -> None:
    """SIGTERM stops the run as Ctrl-C does: pytest prints its summary and tears the session's
    fixtures down (the Prefect servers, moto, the emulators), which SIGTERM's default action
    (the process ends at once) leaves running in sessions of their own. SIGINT is Python's
    own even where the suite inherited it ignored (started with ``&`` by a shell without job
    control, as ``nohup ./dev.sh test &``): the tests of Ctrl-C send it to this process and its
    children, who would ignore it too."""
    signal.signal(signal.SIGTERM, _interrupt)
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def _signal_handlers_as_they_were() -> Iterator[None]:
    """Each test leaves this process's SIGINT and SIGTERM handlers as it found them.

    A library may leave one of its own behind, as the Daytona SDK's socket.io client did (on the
    session's event loop too, until `keep_sigint_from_socketio`): a later test that counts on
    Python's own (``asyncio.run`` cancelling its task on Ctrl-C) met it when the workers' order
    put a Daytona test first.
    """
    saved = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    yield
    for signum, handler in saved.items():
        if handler is not None and signal.getsignal(signum) is not handler:
            signal.signal(signum, handler)


STOPPING_GRACE_S = 8.0
"""``interrupt_grace_s`` for a test that asserts a cell stopped by SIGINT kept its state: a kernel
acts on SIGINT within milliseconds on a quiet machine, but beside two CPU burners it took over the
suite's usual 2 s, so its kernel was restarted and the state lost. A kernel that stops is not
held up by a longer grace; one that ignores SIGINT waits all of it for its restart."""

SUBPROCESS_TEST_TIMEOUT_S = 400
"""pytest-timeout for a test whose CLI or script runs start Prefect's temporary server or a Dask
cluster in fresh interpreters: the suite's 120 s was outrun at load 11."""


@pytest.fixture(scope="session")
def prefect_api() -> Iterator[None]:
    """Prefect's real ephemeral API, started once for the whole session."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=90):
        yield


def local_servers_under(folder: Path) -> list[psutil.Process]:
    """Live local Prefect server processes (`prefect_sandbox.local_server.serve`) whose
    ``PREFECT_HOME`` is under ``folder``."""
    found = []
    for process in psutil.process_iter(["cmdline", "status"]):
        command = process.info["cmdline"] or []
        if "prefect_sandbox.local_server.serve" not in command:
            continue
        if process.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        home = command[command.index("--folder") + 1] if "--folder" in command else ""
        if Path(home).is_relative_to(folder):
            found.append(process)
    return found


@pytest.fixture(scope="session", autouse=True)
def _no_local_server_outlives_the_suite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """After the session, no local server started under its temporary folders runs: any left
    is stopped, and the session fails naming it (a test must stop what it started)."""
    yield
    left = local_servers_under(tmp_path_factory.getbasetemp())
    named = [" ".join(process.info["cmdline"]) for process in left]
    for process in left:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    assert not left, f"local Prefect servers left running: {named}"


@pytest.fixture(scope="session")
def e2b_emulator() -> Iterator[E2BEmulator]:
    """One offline E2B emulator for the session; stopping it kills what tests left alive.

    It reads every reply after its idle, the real server's harshest way now and then: an error
    only the reply holds is dropped.
    """
    from prefect_sandbox.testing.e2b import E2BEmulator

    with E2BEmulator(reply_after_idle=True) as emulator:
        yield emulator


@pytest.fixture(scope="session")
def daytona_env(daytona_emulator: DaytonaEmulator) -> Iterator[DaytonaEmulator]:
    """The session's Daytona emulator, named by the SDK's environment variables.

    Set in this process's environment, so subprocesses (the CLI, a second process attaching)
    reach it too.
    """
    settings = daytona_emulator.env()
    saved = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)
    try:
        yield daytona_emulator
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.fixture(scope="module")
def moto() -> Iterator[MotoServer]:
    """moto's S3 server in its own process, for one test module."""
    server = MotoServer()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrefectStack]:
    """`prefect server start` on 127.0.0.1, started once for the session (it takes 15-30 s);
    a module adds the workers it needs (`PrefectStack.start_worker`) and stops them
    (`PrefectServer.stop_started`)."""
    from tests.test_deployments import PrefectStack

    stack = PrefectStack(tmp_path_factory.mktemp("prefect-home"), tmp_path_factory.getbasetemp())
    try:
        stack.wait_until_healthy()
        yield stack
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def postgres_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrefectStack]:
    """`prefect server start` on a throwaway PostgreSQL cluster (`PostgresCluster`), without a
    worker, for one test module."""
    from prefect_sandbox.testing.prefect_server import PostgresCluster
    from tests.test_deployments import PrefectStack

    with PostgresCluster() as cluster:
        stack = PrefectStack(
            tmp_path_factory.mktemp("prefect-home"), tmp_path_factory.getbasetemp(), cluster.url
        )
        try:
            stack.wait_until_healthy()
            yield stack
        finally:
            stack.stop()


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """An empty TMPDIR for a CLI or script process, short enough for its kernels' IPC socket
    paths."""
    path = Path(tempfile.mkdtemp(prefix="sig-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


async def flow_run_logs(flow_run_id: str) -> list[Any]:
    """The logs of a flow run (its task runs' included), read back from Prefect's API after
    this process's pending log records are sent."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogHandler

    await APILogHandler.aflush()
    async with get_client() as client:
        return await client.read_logs(
            log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id]))
        )


def cli_usage_error(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """The CLI's exit status and stderr for ``args``, run in this process. For usage errors
    only, which it finds before anything starts: a subprocess would cost a fresh interpreter's
    import of Prefect (3 s of CPU) each time; tests that run the CLI end to end show the same
    path as a user starts it."""
    from prefect_sandbox.cli import main

    status = main(list(args))
    return status, capsys.readouterr().err


def python_stdout(
    *argv: str, env: dict[str, str] | None = None, cwd: Path | None = None, timeout_s: float = 300
) -> str:
    """What ``python *argv`` (``"-c", code`` or a script and its arguments) printed, run in a
    fresh interpreter of this environment (nothing this test process imported counts), with
    ``env`` (default: this process's) in ``cwd``, killed after ``timeout_s`` seconds. Fails the
    test, with the interpreter's stderr, unless it exits 0."""
    command = [sys.executable, *argv]
    done = subprocess.run(command, env=env, cwd=cwd, capture_output=True, timeout=timeout_s)
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-3000:]
    return done.stdout.decode()


SUITE_LOAD_PER_CORE = 4.0
"""The load per core the suite makes of itself (two xdist workers per core; up to 4 seen), at
which the flow timeouts here leave room enough for a sandbox to start."""


def load_scaled(seconds: float) -> int:
    """``seconds`` stretched by how far this machine's load per core (its last minute) is over
    `SUITE_LOAD_PER_CORE`, rounded up: for a flow timeout that a sandbox's set-up must not
    outlast. Beside two CPU burners a session's set-up took 24 s, past its 20 s timeout."""
    per_core = os.getloadavg()[0] / (os.cpu_count() or 1)
    return math.ceil(seconds * max(1.0, per_core / SUITE_LOAD_PER_CORE))


FLOW_TIMEOUT_S = 20
"""The flow run's ``timeout_seconds`` in `run_past_a_flow_timeout` by default: room for a kernel
to start on a busy machine; the notebook's second cell outlasts it anyway."""


async def run_past_a_flow_timeout(
    tmp_path: Path, backend: Any, timeout_s: float = FLOW_TIMEOUT_S
) -> tuple[dict[str, Any], Path, list[Any]]:
    """Run a two-cell notebook through `arun_notebook` with a flow ``timeout_seconds`` of
    ``timeout_s`` and storage ``tmp_path/out``: cell 0 writes ``step1.txt`` (the run's one
    artifact) and prints ``step 1 done``, cell 1 sleeps 600 s. ``backend`` is a backend block,
    or None for the default local kernel.

    Checks that the flow run ended Failed/TimedOut and stored exactly ``executed.ipynb``,
    ``step1.txt`` and ``summary.json`` in its one run folder.

    Returns:
        ``summary.json`` parsed, the run folder, and the executed notebook's cells.
    """
    import nbformat

    from prefect_sandbox.flows import arun_notebook

    notebook = nbformat.v4.new_notebook()
    notebook.cells = [
        nbformat.v4.new_code_cell("open('step1.txt', 'w').write('done')\nprint('step 1 done')"),
        nbformat.v4.new_code_cell("import time\ntime.sleep(600)\nprint('slow step done')"),
    ]
    nbformat.write(notebook, tmp_path / "input.ipynb")
    state = await arun_notebook.with_options(timeout_seconds=timeout_s)(
        notebook=str(tmp_path / "input.ipynb"),
        backend=backend,
        artifacts=["step1.txt"],
        storage=str(tmp_path / "out"),
        return_state=True,
    )
    assert (state.type.value, state.name) == ("FAILED", "TimedOut")
    (run_dir,) = (tmp_path / "out").iterdir()
    assert {p.name for p in run_dir.iterdir()} == {"executed.ipynb", "step1.txt", "summary.json"}
    executed = nbformat.read(run_dir / "executed.ipynb", as_version=4)
    nbformat.validate(executed)
    return json.loads((run_dir / "summary.json").read_text()), run_dir, list(executed.cells)


def kernel_processes() -> list[psutil.Process]:
    """Live (non-zombie) ipykernel processes started by this test process."""
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE and "ipykernel" in " ".join(child.cmdline()):
                found.append(child)
        except psutil.NoSuchProcess:
            continue
    return found


def stream_text(outputs: list[dict[str, object]], name: str = "stdout") -> str:
    """All text a cell wrote to one stream."""
    return "".join(
        str(o["text"]) for o in outputs if o["output_type"] == "stream" and o["name"] == name
    )


def max_alive_at_once(summaries: list[dict[str, object]]) -> int:
    """The most sandboxes alive at one time, from runs' ``summary.json`` contents: each
    sandbox lives from its ``sandbox_created_at`` to its ``sandbox_killed_at`` (both required).
    A kill and a create at the same instant do not overlap."""
    events: list[tuple[datetime, int]] = []
    for summary in summaries:
        events.append((datetime.fromisoformat(str(summary["sandbox_created_at"])), 1))
        events.append((datetime.fromisoformat(str(summary["sandbox_killed_at"])), -1))
    alive = most = 0
    # At equal times -1 sorts before +1: the kill comes first.
    for _, change in sorted(events):
        alive += change
        most = max(most, alive)
    return most


@pytest.fixture
def dask_pickling() -> Iterator[None]:
    """Exceptions pickled as Dask pickles them; copyreg's reducers are restored afterwards.

    ``import distributed`` and each error it ships install tblib's reducers, which carry an
    exception's ``__cause__``, ``__context__`` and traceback along with it.
    """
    saved = dict(copyreg.dispatch_table)
    try:
        yield
    finally:
        copyreg.dispatch_table.clear()
        copyreg.dispatch_table.update(saved)


VENDOR_MODULES = frozenset(
    {"e2b", "e2b_code_interpreter", "daytona", "docker", "requests", "urllib3", "aiohttp"}
    | {"daytona_api_client", "daytona_api_client_async", "daytona_toolbox_api_client"}
)
"""The backends' SDKs and their transports (httpx aside: Prefect itself imports it)."""

_UNPICKLE_WITHOUT_VENDORS = f"""
import importlib.abc, json, pickle, sys

class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {sorted(VENDOR_MODULES)!r}:
            raise ImportError(f"vendor module {{name}} imported while unpickling")

sys.meta_path.insert(0, Refuse())
error, chain, seen = pickle.loads(sys.stdin.buffer.read()), [], set()
while error is not None and id(error) not in seen:
    seen.add(id(error))
    chain.append(f"{{type(error).__module__}}.{{type(error).__qualname__}}")
    error = error.__cause__ or error.__context__
print(json.dumps(chain))
"""


def unpickled_without_vendors(blob: bytes) -> list[str]:
    """Unpickle an exception in a fresh process where importing any `VENDOR_MODULES` fails.

    Returns:
        The qualified class names along its ``__cause__``/``__context__`` chain, itself first.
    """
    done = subprocess.run(
        [sys.executable, "-c", _UNPICKLE_WITHOUT_VENDORS],
        input=blob,
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    chain: list[str] = json.loads(done.stdout)
    return chain
