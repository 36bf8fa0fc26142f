"""Ctrl-C (SIGINT) and SIGTERM to the CLI mid-cell, against a real `prefect server` and against
Prefect's temporary server: the run ends Cancelled, its sandbox is killed, what it made is
stored, nothing is left behind, and the CLI exits 130 / 143 with one line."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from uuid import UUID

import nbformat
import psutil
import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import FlowRun, StateType
from prefect.settings import PREFECT_API_URL, temporary_settings

from tests.conftest import ROOT
from tests.test_deployments import PrefectStack

pytestmark = pytest.mark.timeout(600)


def _notebook(path: Path) -> Path:
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [
        nbformat.v4.new_markdown_cell("# Work"),
        nbformat.v4.new_code_cell("open('made.txt', 'w').write('made'); print('started')"),
        nbformat.v4.new_code_cell(
            "import os, time\n"
            "print('sleeping', flush=True)\n"
            "open('sleeping.marker', 'w').write(str(os.getpid()))\n"
            "time.sleep(600)"
        ),
        nbformat.v4.new_markdown_cell("# Never"),
        nbformat.v4.new_code_cell("print('never')"),
    ]
    nbformat.write(notebook, path)
    return path


class Interrupted:
    """The CLI run, interrupted by a signal once its second cell sleeps."""

    def __init__(
        self, tmp_path: Path, tmp: Path, env: dict[str, str], signum: int, group: bool
    ) -> None:
        self.tmp = tmp
        self.out = tmp_path / "out"
        env = {**env, "TMPDIR": str(self.tmp)}
        self.stderr_path = tmp_path / "stderr.txt"
        with self.stderr_path.open("wb") as stderr:
            cli = subprocess.Popen(
                [
                    sys.executable, "-m", "prefect_sandbox.cli", "run",
                    str(_notebook(tmp_path / "wait.ipynb")),
                    "--artifact", "made.txt", "--out", str(self.out),
                ],
                env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=stderr,
                start_new_session=True,
            )  # fmt: skip
            try:
                deadline = time.monotonic() + 240
                # The cell writes it in its working directory, under the CLI's TMPDIR.
                while not [m for m in self.tmp.rglob("sleeping.marker") if m.read_text()]:
                    assert cli.poll() is None, self.stderr_path.read_text()[-3000:]
                    assert time.monotonic() < deadline, "the sleeping cell never started"
                    time.sleep(0.2)
                (pid_file,) = self.tmp.rglob("kernel.pid")
                # The kernel as launched (under bubblewrap, its sandbox), and all it started.
                self.kernel = psutil.Process(int(pid_file.read_text()))
                self.sandbox_processes = [self.kernel, *self.kernel.children(recursive=True)]
                # The cell's first output reaches the CLI (its run logger shows it on stderr).
                while "sleeping" not in self.stderr_path.read_text():
                    assert cli.poll() is None, self.stderr_path.read_text()[-3000:]
                    assert time.monotonic() < deadline, "the cell's output never reached the CLI"
                    time.sleep(0.2)
                self.stderr_at_signal = self.stderr_path.stat().st_size
                # A terminal's Ctrl-C goes to the whole foreground process group.
                if group:
                    os.killpg(cli.pid, signum)
                else:
                    os.kill(cli.pid, signum)
                self.returncode = cli.wait(timeout=120)
            finally:
                if cli.poll() is None:
                    os.killpg(cli.pid, signal.SIGKILL)
                    cli.wait()
        self.cli_pid = cli.pid
        self.stderr = self.stderr_path.read_text()

    def check(self, signum: int) -> str:
        """Assert exit status, one line, stored partial files and nothing left; return the
        flow run's id."""
        name = signal.Signals(signum).name
        assert self.returncode == 128 + signum, self.stderr[-3000:]
        assert "Traceback" not in self.stderr
        after = self.stderr[self.stderr_at_signal :].strip().splitlines()
        assert len(after) == 1, after
        assert after[0].startswith(f"prefect-sandbox: interrupted by {name}: "), after
        assert "cancelled during stage 'work', cell 2" in after[0]

        (run_dir,) = self.out.iterdir()
        assert str(run_dir) in after[0]
        assert (run_dir / "made.txt").read_text() == "made"
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["status"] == "cancelled"
        assert [(s["name"], s["status"]) for s in summary["stages"]] == [
            ("work", "cancelled"),
            ("never", "not_run"),
        ]
        cells = nbformat.read(run_dir / "executed.ipynb", as_version=4).cells
        assert cells[1].outputs[0]["text"] == "started\n"
        assert cells[2].outputs[0]["text"] == "sleeping\n"
        assert cells[2].outputs[-1]["ename"] == "RunCancelled"
        assert cells[4].outputs == []

        # Generous: on a busy machine the kernel's ending can lag the CLI's exit.
        deadline = time.monotonic() + 60
        for process in self.sandbox_processes:
            while process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                assert time.monotonic() < deadline, f"{process.cmdline()} outlived the run"
                time.sleep(0.2)
        left = []
        for process in psutil.process_iter(["cmdline"]):
            cmdline = " ".join(process.info["cmdline"] or [])
            # The kernel's guard names the CLI's pid; kernels name their folder under TMPDIR.
            if str(self.tmp) in cmdline or f" {self.cli_pid} {self.kernel.pid}" in cmdline:
                left.append(cmdline)
        assert left == []
        assert [p.name for p in self.tmp.rglob("*") if not p.is_dir()] == []
        assert [p.name for p in self.tmp.iterdir()] in ([], [f"prefect-sandbox-{os.getuid()}"])
        return str(summary["flow_run_id"])


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
async def test_signal_mid_cell_cancels_the_run_against_a_prefect_server(
    server: PrefectStack, tmp_path: Path, short_tmp: Path, signum: int
) -> None:
    env = {**server.env, "PYTHONPATH": str(ROOT)}
    run = Interrupted(tmp_path, short_tmp, env, signum, group=False)
    flow_run_id = run.check(signum)
    with temporary_settings({PREFECT_API_URL: server.url}):
        async with get_client() as client:
            flow_run = await client.read_flow_run(flow_run_id)  # type: ignore[arg-type]
    assert flow_run.state is not None and flow_run.state.type == StateType.CANCELLED


def _servers_of(home: Path) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["cmdline"]):
        if "prefect.server.api.server:create_app" not in " ".join(process.info["cmdline"] or []):
            continue
        try:
            if process.environ().get("PREFECT_HOME") == str(home):
                found.append(process)
        except (psutil.AccessDenied, psutil.NoSuchProcess):
            continue
    return found


@pytest.mark.parametrize(
    ("signum", "group"),
    [(signal.SIGINT, True), (signal.SIGTERM, False)],
    ids=["Ctrl-C to the group", "SIGTERM"],
)
def test_signal_with_the_temporary_server_leaves_no_server_and_a_cancelled_run(
    tmp_path: Path, short_tmp: Path, signum: int, group: bool
) -> None:
    home = tmp_path / "prefect-home"
    env = {name: value for name, value in os.environ.items() if not name.startswith("PREFECT_")}
    # With Ctrl-C, the temporary server takes over 20 s (Prefect's default start-up timeout)
    # to start: the CLI's own timeout must be the one in force. (Once is enough: a slow start
    # costs the suite 25 s.)
    slow_start = tmp_path / "slow-start"
    slow_start.mkdir()
    if group:
        (slow_start / "sitecustomize.py").write_text(
            "import sys, time\nif 'prefect.server.api.server:create_app' in sys.orig_argv:\n"
            "    time.sleep(25)\n"
        )
    env.update(
        PREFECT_HOME=str(home),
        PREFECT_SANDBOX_LOCAL_SERVER="never",  # Prefect's temporary server, not the kept one
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PYTHONPATH=os.pathsep.join([str(slow_start), str(ROOT)]),
    )
    run = Interrupted(tmp_path, short_tmp, env, signum, group=group)
    flow_run_id = run.check(signum)
    assert _servers_of(home) == []
    with sqlite3.connect(home / "prefect.db") as database:
        (state,) = database.execute(
            "SELECT state_type FROM flow_run WHERE id = ?", (flow_run_id,)
        ).fetchone()
    assert state == "CANCELLED"


def _signalled_script(
    server: PrefectStack,
    tmp_path: Path,
    short_tmp: Path,
    source: Callable[[Path, Path], str],
    signum: int,
    *,
    sigint_ignored: bool = False,
) -> tuple[int, str, list[Path]]:
    """Run the script ``source(notebook, out)`` gives against ``server``, signal it once the
    sleeping notebook's cell sleeps, and check its run ended Cancelled with what it made.

    Returns:
        Its exit status, its stderr, and the staging folders that were there before the signal.
    """
    from tests.test_api_cancellation import Started, _check_cancelled, _sleeping_notebook

    notebook = _sleeping_notebook(tmp_path / "wait.ipynb")
    out = tmp_path / "out"
    script = tmp_path / "script.py"
    script.write_text(source(notebook, out))
    env = {**server.env, "PYTHONPATH": str(ROOT), "TMPDIR": str(short_tmp)}
    # As a background job of a non-interactive shell starts: SIGINT ignored, so asyncio.run
    # installs no handler of its own.
    trap = "trap '' INT; " if sigint_ignored else ""
    run = Started(["bash", "-c", f"{trap}exec {sys.executable} {script}"], env, tmp_path)
    staging = list(short_tmp.glob("prefect-sandbox-staging-*"))
    try:
        run.process.send_signal(signum)
        returncode = run.process.wait(timeout=180)
    finally:
        run.stop()
    stderr = run.stderr_path.read_text()
    (summary_path,) = out.glob("*/summary.json")
    flow_run_id = json.loads(summary_path.read_text())["flow_run_id"]
    with temporary_settings({PREFECT_API_URL: server.url}):
        flow_run = asyncio.run(_read_flow_run(flow_run_id))
    _check_cancelled(flow_run, out)
    return returncode, stderr, staging


def test_sigterm_to_a_script_run_mid_cell_cancels_it_and_leaves_no_staging_folder(
    server: PrefectStack, tmp_path: Path, short_tmp: Path
) -> None:
    def source(notebook: Path, out: Path) -> str:
        return (
            "from prefect_sandbox.flows import run_notebook\n"
            f"run_notebook({str(notebook)!r}, artifacts=['made.txt'], storage={str(out)!r})\n"
        )

    returncode, stderr, staging = _signalled_script(
        server, tmp_path, short_tmp, source, signal.SIGTERM
    )
    # It exits as the CLI does on SIGTERM, after its run's clean-up.
    assert returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert len(staging) == 1 and not staging[0].exists()
    assert [p.name for p in short_tmp.rglob("*") if not p.is_dir()] == []
    assert [p.name for p in short_tmp.iterdir()] in ([], [f"prefect-sandbox-{os.getuid()}"])


async def _read_flow_run(flow_run_id: str) -> FlowRun:
    async with get_client() as client:
        return await client.read_flow_run(UUID(flow_run_id))


def test_sigint_to_an_asyncio_run_script_that_inherited_it_ignored_cancels_the_run(
    server: PrefectStack, tmp_path: Path, short_tmp: Path
) -> None:
    def source(notebook: Path, out: Path) -> str:
        return (
            "import asyncio, sys\n"
            "from prefect.exceptions import CancelledRun\n"
            "from prefect_sandbox.flows import arun_notebook\n"
            "try:\n"
            f"    asyncio.run(arun_notebook({str(notebook)!r}, artifacts=['made.txt'],"
            f" storage={str(out)!r}))\n"
            "except CancelledRun as exc:\n"
            "    print('CancelledRun:', exc, file=sys.stderr)\n"
        )

    returncode, stderr, _ = _signalled_script(
        server, tmp_path, short_tmp, source, signal.SIGINT, sigint_ignored=True
    )
    assert returncode == 0, stderr[-3000:]
    assert "CancelledRun: flow run " in stderr
