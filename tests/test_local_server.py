"""The local Prefect server kept for the user (`prefect_sandbox.local_server`): the CLI starts
it, later runs find it, a dead one is restarted, concurrent first runs share one, it stops when
told or once idle, and a failed start names the fix. Real servers, each test in its own
``PREFECT_HOME``, each stopping what it started."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import nbformat
import psutil
import pytest

from prefect_sandbox.local_server import LocalServer, ServerState, configured_api_url
from prefect_sandbox.local_server.serve import Activity
from tests.conftest import SUBPROCESS_TEST_TIMEOUT_S, local_servers_under

pytestmark = pytest.mark.timeout(SUBPROCESS_TEST_TIMEOUT_S)


def _env(home: Path, **extra: str) -> dict[str, str]:
    """This environment with no Prefect API and the local server wanted, ``home`` its
    ``PREFECT_HOME``, plus ``extra``."""
    env = {
        name: value
        for name, value in os.environ.items()
        if name != "PREFECT_API_URL" and not name.startswith("PREFECT_SANDBOX_")
    }
    return {**env, "PREFECT_HOME": str(home), "PREFECT_SANDBOX_LOCAL_SERVER": "cli", **extra}


@pytest.fixture
def home(tmp_path: Path) -> Iterator[Path]:
    """A fresh ``PREFECT_HOME``; its local server, if one runs at the end, is stopped."""
    path = tmp_path / "prefect-home"
    path.mkdir()
    try:
        yield path
    finally:
        LocalServer(path).stop()
        for process in local_servers_under(path):
            process.kill()


def _cli(*args: str, home: Path, cwd: Path, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "prefect_sandbox.cli", *args],
        env=_env(home, **extra),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TEST_TIMEOUT_S - 60,
    )


def _notebook(folder: Path) -> Path:
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell("print(6 * 7)")]
    path = folder / "one.ipynb"
    nbformat.write(notebook, path)
    return path


def _state(home: Path) -> dict[str, object]:
    return dict(json.loads((home / "prefect-sandbox-server" / "state.json").read_text()))


def test_a_second_run_finds_the_first_runs_server_and_server_stop_stops_it(
    home: Path, tmp_path: Path
) -> None:
    notebook = _notebook(tmp_path)
    first = _cli("run", str(notebook), "--out", "out", home=home, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "prefect-sandbox: starting the local Prefect server at" in first.stderr
    started = _state(home)
    second = _cli("run", str(notebook), "--out", "out", home=home, cwd=tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "starting the local Prefect server" not in second.stderr
    assert _state(home) == started
    assert f"127.0.0.1:{started['port']}/runs/flow-run/" in second.stderr  # Prefect's own link
    assert [p.pid for p in local_servers_under(home)] == [started["pid"]]
    # A flow called from Python uses it too when asked (PREFECT_SANDBOX_LOCAL_SERVER=always).
    script = (
        "from prefect_sandbox.flows import run_notebook\n"
        f"print(run_notebook(notebook={str(notebook)!r}, storage='out').status)\n"
    )
    flow = subprocess.run(
        [sys.executable, "-c", script],
        env=_env(home, PREFECT_SANDBOX_LOCAL_SERVER="always"),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TEST_TIMEOUT_S - 60,
    )
    assert flow.stdout == "completed\n", flow.stderr[-3000:]
    assert f"127.0.0.1:{started['port']}/runs/flow-run/" in flow.stderr
    assert "Starting temporary server" not in flow.stderr

    status = _cli("server", "status", home=home, cwd=tmp_path)
    assert status.returncode == 0, status.stderr
    assert f"pid {started['pid']}, answering" in status.stdout
    assert "memory (RSS): " in status.stdout
    stop = _cli("server", "stop", home=home, cwd=tmp_path)
    assert stop.returncode == 0, stop.stderr
    assert f"Stopped the local Prefect server (pid {started['pid']}" in stop.stdout
    assert not psutil.pid_exists(int(str(started["pid"]))) or (
        psutil.Process(int(str(started["pid"]))).status() == psutil.STATUS_ZOMBIE
    )
    assert not (home / "prefect-sandbox-server" / "state.json").exists()
    assert _cli("server", "status", home=home, cwd=tmp_path).returncode == 1


def test_a_dead_server_is_restarted(home: Path, tmp_path: Path) -> None:
    server = LocalServer(home)
    state, started = server.find_or_start()
    assert started
    server.wait_until_ready(state)
    os.killpg(state.pid, signal.SIGKILL)
    done = _cli("run", str(_notebook(tmp_path)), "--out", "out", home=home, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "starting the local Prefect server" in done.stderr
    restarted = server.running()
    assert restarted is not None and restarted.pid != state.pid


def test_two_concurrent_first_runs_share_one_server(home: Path, tmp_path: Path) -> None:
    command = [sys.executable, "-m", "prefect_sandbox.cli", "server", "start"]
    starts = [
        subprocess.Popen(command, env=_env(home), cwd=tmp_path, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outputs = [start.communicate(timeout=SUBPROCESS_TEST_TIMEOUT_S - 60)[0] for start in starts]
    assert [start.returncode for start in starts] == [0, 0], outputs
    pid = _state(home)["pid"]
    assert all(f"pid {pid}, answering" in output for output in outputs), outputs
    assert [p.pid for p in local_servers_under(home)] == [pid]


def test_the_state_names_its_server_by_pid_and_start_time_not_by_command_line(
    home: Path,
) -> None:
    # A server's /proc/PID/cmdline reads empty for a while after Popen returned (its exec has
    # not set up its arguments yet); judged by it, a second run beside two CPU burners took the
    # first's new server for dead and started another on the same database.
    server = LocalServer(home)
    server.folder.mkdir()
    other = subprocess.Popen(["sleep", "60"])
    try:
        ticks = int(Path(f"/proc/{other.pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        state = ServerState(other.pid, 1, time.time(), None, pid_started=ticks)
        server.write_state(state)
        assert server.running() == state
        server.write_state(dataclasses.replace(state, pid_started=ticks - 1))  # a reused pid
        assert server.running() is None
    finally:
        server.state_path.unlink()
        other.kill()
        other.wait()


def test_the_server_stops_itself_once_idle(home: Path, tmp_path: Path) -> None:
    done = _cli(
        "server", "start", home=home, cwd=tmp_path, PREFECT_SANDBOX_LOCAL_SERVER_IDLE_STOP_S="5"
    )
    assert done.returncode == 0, done.stderr
    pid = int(str(_state(home)["pid"]))
    deadline = time.monotonic() + 90
    while local_servers_under(home) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not local_servers_under(home)
    assert not (home / "prefect-sandbox-server" / "state.json").exists()
    log = (home / "prefect-sandbox-server" / "server.log").read_text()
    assert "idle stop 5.0 s" in log
    assert "idle for 5 s: stopping" in log
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_a_server_that_cannot_start_fails_the_run_naming_the_fix(
    home: Path, tmp_path: Path
) -> None:
    done = _cli(
        "run", str(_notebook(tmp_path)), "--out", "out", home=home, cwd=tmp_path,
        PREFECT_API_DATABASE_CONNECTION_URL="sqlite+aiosqlite:////nonexistent/dir/prefect.db",
    )  # fmt: skip
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("prefect-sandbox: the local Prefect server did not start: it exited")
    assert "docs/troubleshooting.md#the-local-prefect-server" in last
    assert str(home / "prefect-sandbox-server" / "server.log") in last
    assert "Traceback" not in done.stderr
    assert not local_servers_under(home)
    assert not (tmp_path / "out").exists()


def test_sigterm_during_start_up_ends_the_cli_within_2_s_with_143_and_nothing_left(
    home: Path, tmp_path: Path
) -> None:
    """One second in, the CLI is importing Prefect while the local server it started starts:
    the CLI ends at once, the kept server stays (it is meant to), nothing else of the run's
    process session is left."""
    process = subprocess.Popen(
        [sys.executable, "-m", "prefect_sandbox.cli", "run", str(_notebook(tmp_path))],
        env=_env(home), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )  # fmt: skip
    time.sleep(1)
    sent = time.monotonic()
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=30)
    took_s = time.monotonic() - sent
    # 143 from our handler; -15 only if the signal came before the interpreter ran our code.
    assert process.returncode in (143, -signal.SIGTERM), stderr
    assert took_s < 2, f"took {took_s:.1f} s"
    left = [
        p for p in psutil.process_iter(["status"])
        if p.info["status"] != psutil.STATUS_ZOMBIE and _session_of(p.pid) == process.pid
    ]  # fmt: skip
    assert left == []
    if process.returncode == 143:
        assert stderr.strip().splitlines()[-1] == (
            "prefect-sandbox: interrupted by SIGTERM before the flow run began"
        )


def test_a_signal_while_the_kernel_started_ahead_starts_ends_the_cli_and_the_kernel(
    home: Path, tmp_path: Path
) -> None:
    """SIGTERM as soon as the kernel the CLI starts ahead (while it imports Prefect) is there:
    the CLI still ends within 2 s with 143, and the kernel ends too."""
    process = subprocess.Popen(
        [sys.executable, "-m", "prefect_sandbox.cli", "run", str(_notebook(tmp_path))],
        env=_env(home), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )  # fmt: skip
    try:
        kernels = _kernels_of(process.pid, timeout_s=60)
    finally:
        sent = time.monotonic()
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=30)
    took_s = time.monotonic() - sent
    assert process.returncode == 143, stderr
    assert took_s < 2, f"took {took_s:.1f} s"
    deadline = time.monotonic() + 10
    while any(map(_alive, kernels)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [kernel for kernel in kernels if _alive(kernel)]


def _alive(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _kernels_of(pid: int, timeout_s: float) -> list[psutil.Process]:
    """The ipykernel processes under process ``pid``, once there is one."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = []
        for child in psutil.Process(pid).children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                if "ipykernel" in " ".join(child.cmdline()):
                    found.append(child)
        if found:
            return found
        time.sleep(0.02)
    raise AssertionError(f"no kernel under the CLI after {timeout_s} s")


def _session_of(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None


def test_an_api_url_from_a_profile_env_file_or_prefect_toml_counts_as_configured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.delenv("PREFECT_PROFILE", raising=False)
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PREFECT_PROFILES_PATH", str(tmp_path / "profiles.toml"))
    assert configured_api_url(tmp_path) is None
    (tmp_path / "profiles.toml").write_text('active = "local"\n')  # Prefect's own: a URL
    assert configured_api_url(tmp_path) == "http://127.0.0.1:4200/api"
    (tmp_path / "profiles.toml").write_text(
        'active = "mine"\n[profiles.mine]\nPREFECT_API_URL = "http://h:1/api"\n'
    )
    assert configured_api_url(tmp_path) == "http://h:1/api"
    (tmp_path / "prefect.toml").write_text('[api]\nurl = "http://toml:2/api"\n')
    assert configured_api_url(tmp_path) == "http://toml:2/api"
    (tmp_path / ".env").write_text("PREFECT_API_URL=http://dotenv:3/api\n")
    assert configured_api_url(tmp_path) == "http://dotenv:3/api"
    monkeypatch.setenv("PREFECT_API_URL", "http://env:4/api")
    assert configured_api_url(tmp_path) == "http://env:4/api"


async def test_activity_counts_open_requests_and_not_health_checks() -> None:
    release = asyncio.Event()

    async def app(scope: object, receive: object, send: object) -> None:
        await release.wait()

    activity = Activity(app)
    request = {"type": "http", "path": "/api/flow_runs/"}
    held = asyncio.create_task(activity(request, None, None))  # type: ignore[arg-type]
    await asyncio.sleep(0)
    assert activity.open == 1 and activity.idle_s() == 0.0
    probe = {"type": "http", "path": "/api/health"}
    health = asyncio.create_task(activity(probe, None, None))  # type: ignore[arg-type]
    await asyncio.sleep(0)
    assert activity.open == 1
    release.set()
    await asyncio.gather(held, health)
    assert activity.open == 0
    await asyncio.sleep(0.05)
    assert activity.idle_s() >= 0.05
