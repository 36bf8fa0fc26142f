"""`./dev.sh test` stopped by SIGTERM or Ctrl-C: pytest's summary, and no process left behind
(the session's Prefect server included, which runs in a session of its own)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import ROOT, SUBPROCESS_TEST_TIMEOUT_S

PROBE = "PREFECT_SANDBOX_TEST_INTERRUPT_PROBE"
"""Set only in the run the test below starts: the file the probe writes its server's pid to."""


@pytest.mark.skipif(PROBE not in os.environ, reason="runs only inside the interrupt test's run")
def test_probe_holds_a_prefect_server(server: object) -> None:
    Path(os.environ[PROBE]).write_text(str(server.server.pid))  # type: ignore[attr-defined]
    threading.Event().wait(SUBPROCESS_TEST_TIMEOUT_S)  # until the signal ends the run


def _left_running(pids: set[int], session_id: int) -> list[psutil.Process]:
    """The processes still running of ``pids`` and of the session ``session_id``, once those
    that are exiting have had 10 s to (one read as running became a zombie a moment later)."""
    deadline = time.monotonic() + 10
    while (left := _running_now(pids, session_id)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def _running_now(pids: set[int], session_id: int) -> list[psutil.Process]:
    left = []
    for process in psutil.process_iter():
        try:
            mine = process.pid in pids or os.getsid(process.pid) == session_id
            if mine and process.status() != psutil.STATUS_ZOMBIE:
                left.append(process)
        except (psutil.NoSuchProcess, ProcessLookupError, PermissionError):
            continue
    return left


@pytest.mark.timeout(SUBPROCESS_TEST_TIMEOUT_S)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "Ctrl-C"])
def test_dev_sh_test_stops_with_its_summary_and_leaves_nothing_running(
    signum: int, tmp_path: Path
) -> None:
    marker = tmp_path / "server.pid"
    probe = f"{Path(__file__).relative_to(ROOT)}::{test_probe_holds_a_prefect_server.__name__}"
    run = subprocess.Popen(
        # One xdist worker: the controller and a worker stopped, as in a full run, without
        # starting three more for the one probe.
        [str(ROOT / "dev.sh"), "test", probe, "-n", "1", "-p", "no:cacheprovider", "--durations=0"],
        cwd=ROOT,
        env={**os.environ, PROBE: str(marker)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + SUBPROCESS_TEST_TIMEOUT_S - 60
        while not marker.exists() or not marker.read_text():
            assert run.poll() is None, run.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "the probe's Prefect server did not come up"
            time.sleep(0.2)
        server_pid = int(marker.read_text())
        family = {server_pid, *(child.pid for child in psutil.Process(server_pid).children(True))}
        if signum == signal.SIGINT:
            os.killpg(run.pid, signum)  # as a terminal's Ctrl-C: the whole foreground group
        else:
            run.send_signal(signum)
        output, _ = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
        if marker.exists() and marker.read_text():  # a failed stop leaves nothing either
            with contextlib.suppress(ProcessLookupError):
                os.killpg(int(marker.read_text()), signal.SIGKILL)
    lines = output.splitlines()
    assert run.returncode == 2, output[-3000:]  # pytest's "interrupted"
    assert any("KeyboardInterrupt" in line for line in lines), output[-3000:]
    assert any(line.startswith("=") and " in " in line for line in lines[-3:]), output[-3000:]
    assert not [line for line in lines if line.startswith("E ")], output[-3000:]
    assert _left_running(family, run.pid) == []
