"""The local Prefect server kept for the user: found, started, waited for and stopped.

With no ``PREFECT_API_URL``, the CLI (and the flows, with ``PREFECT_SANDBOX_LOCAL_SERVER=always``)
use one Prefect server per ``PREFECT_HOME``, started detached on first use and found again by
later runs through ``$PREFECT_HOME/prefect-sandbox-server/state.json`` (its pid and port). A
file lock there makes concurrent first runs share one. The server (`serve`) stops itself after
``PREFECT_SANDBOX_LOCAL_SERVER_IDLE_STOP_S`` without a request or a run's touch. Hard-won facts:
importing Prefect's server costs ~7 s of CPU, so this module imports only the standard library
(the CLI starts the server before its own imports); no fixed start-up time-out, since a busy
2-core machine outran every fixed one: we wait while the server process is alive and using CPU.
See docs/how-to/local-server.md.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "LocalServer",
    "LocalServerError",
    "ServerState",
    "configured_api_url",
    "describe",
    "healthy",
    "prefect_home",
    "rss_bytes",
]

FOLDER_NAME = "prefect-sandbox-server"
"""The folder under ``PREFECT_HOME`` that holds the state file, the lock and the log."""
STALL_S = 120.0
"""Seconds a starting server may go without using CPU, and without answering, before the wait
for it gives up: a live process under load still gets CPU within this."""
NOTE_EVERY_S = 10.0
"""Seconds between the "still starting" lines of a wait."""
STOP_WAIT_S = 20.0
"""Seconds `LocalServer.stop` waits for the server to exit after SIGTERM, before SIGKILL."""
FIX = (
    "see docs/troubleshooting.md#the-local-prefect-server: read the log, run "
    "`prefect-sandbox server stop` and try again; or set PREFECT_API_URL to a server of yours, "
    "or PREFECT_SANDBOX_LOCAL_SERVER=never for Prefect's temporary server"
)
"""What to do when the local server does not start, for the error's message."""


class LocalServerError(RuntimeError):
    """The local Prefect server did not start: it exited, or stopped making progress. The
    message is one line: what happened, the log's last line, and the fix (`FIX`)."""


@dataclass(frozen=True)
class ServerState:
    """What ``state.json`` says of a local server.

    Attributes:
        pid: the server process's id (its own session: the process group's id too).
        port: the TCP port it listens on, on 127.0.0.1.
        started_at: when it was started, seconds since the epoch.
        idle_stop_s: seconds without use after which it stops itself; None: never.
        pid_started: when the process started, in clock ticks since boot (``/proc/PID/stat``'s
            22nd field); with ``pid`` it names the process, as a reused pid has another.
            None where ``/proc`` cannot be read.
    """

    pid: int
    port: int
    started_at: float
    idle_stop_s: float | None
    pid_started: int | None = None

    @property
    def url(self) -> str:
        """Its API address, ``http://127.0.0.1:PORT/api``."""
        return f"http://127.0.0.1:{self.port}/api"


def prefect_home() -> Path:
    """``PREFECT_HOME`` as Prefect reads it from the environment (default ``~/.prefect``),
    without importing Prefect."""
    return Path(os.environ.get("PREFECT_HOME") or "~/.prefect").expanduser()


def configured_api_url(cwd: Path | None = None) -> str | None:
    """The ``PREFECT_API_URL`` the usual places set, read without importing Prefect (which
    costs seconds): the environment, a ``.env``, ``prefect.toml`` or ``pyproject.toml``
    (``[tool.prefect]``) in ``cwd``, and the active profile. Prefect's own settings remain the
    authority once imported; this decides early whether a local server will be needed.

    Returns:
        The URL, or None when none of those places sets one.
    """
    cwd = cwd or Path.cwd()
    if os.environ.get("PREFECT_API_URL"):
        return os.environ["PREFECT_API_URL"]
    with contextlib.suppress(OSError):
        for line in (cwd / ".env").read_text().splitlines():
            name, _, value = line.partition("=")
            if name.strip().removeprefix("export ").strip() == "PREFECT_API_URL" and value:
                return value.strip().strip("'\"")
    for path, keys in (
        (cwd / "prefect.toml", ("api", "url")),
        (cwd / "pyproject.toml", ("tool", "prefect", "api", "url")),
    ):
        url: Any = _toml(path)
        for key in keys:
            url = url.get(key, {}) if isinstance(url, dict) else None
        if isinstance(url, str) and url:
            return url
    return _profile_api_url()


def _toml(path: Path) -> dict[str, Any]:
    """A TOML file's tables, or none when it is missing or not TOML."""
    try:
        return tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return {}


def _profile_api_url() -> str | None:
    """``PREFECT_API_URL`` in the active Prefect profile: the user's ``profiles.toml`` over the
    defaults Prefect ships (whose ``local`` profile sets one)."""
    import importlib.util

    profiles: dict[str, dict[str, Any]] = {}
    active: Any = None
    spec = importlib.util.find_spec("prefect")
    sources = (
        [
            Path(folder) / "settings" / "profiles.toml"
            for folder in spec.submodule_search_locations or []
        ]
        if spec
        else []
    )
    user = os.environ.get("PREFECT_PROFILES_PATH") or str(prefect_home() / "profiles.toml")
    for path in [*sources, Path(user).expanduser()]:
        data = _toml(path)
        active = data.get("active", active)
        for name, settings in dict(data.get("profiles", {})).items():
            if isinstance(settings, dict):
                profiles.setdefault(name, {}).update(settings)
    active = os.environ.get("PREFECT_PROFILE") or active
    url = profiles.get(str(active), {}).get("PREFECT_API_URL")
    return url if isinstance(url, str) and url else None


class LocalServer:
    """The local server of one ``PREFECT_HOME``: its state file, lock and log, and how to find,
    start, wait for and stop it.

    Args:
        home: the ``PREFECT_HOME`` it belongs to (default: `prefect_home`).

    Attributes:
        folder: ``HOME/prefect-sandbox-server``: ``state.json``, ``lock``, ``last-used`` (its
            modification time is the last use a run declared), ``last-port`` (tried first by
            the next start) and ``server.log``.
    """

    def __init__(self, home: Path | None = None) -> None:
        self.home = home or prefect_home()
        self.folder = self.home / FOLDER_NAME
        self.state_path = self.folder / "state.json"
        self.lock_path = self.folder / "lock"
        self.last_used_path = self.folder / "last-used"
        self.last_port_path = self.folder / "last-port"
        self.log_path = self.folder / "server.log"

    @contextlib.contextmanager
    def locked(self, blocking: bool = True) -> Iterator[bool]:
        """Within, this process holds the folder's lock (``flock``); yields whether it got it
        (always True when ``blocking``)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        with self.lock_path.open("a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
            except BlockingIOError:
                yield False
                return
            try:
                yield True
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def read_state(self) -> ServerState | None:
        """What ``state.json`` says, or None when there is none (or it is unreadable)."""
        try:
            data = json.loads(self.state_path.read_text())
            return ServerState(**data)
        except (OSError, ValueError, TypeError):
            return None

    def running(self) -> ServerState | None:
        """The state of the server that runs now: its process alive and ours; None else."""
        state = self.read_state()
        if state is None or not _is_our_server(state):
            return None
        return state

    def touch(self) -> None:
        """Declare a use now: the server's idle time counts from the later of this and its
        last request."""
        self.last_used_path.touch()

    def find_or_start(self, idle_stop_s: float | None = None) -> tuple[ServerState, bool]:
        """The running server's state, or a new server's, started now (not yet waited for:
        see `wait_until_ready`); either way a use is declared (`touch`).

        Signals are held off while the lock is held, so an interrupted run never leaves a
        started server without its state file.

        Args:
            idle_stop_s: for a new server, seconds without use after which it stops itself;
                None: the server reads ``PREFECT_SANDBOX_LOCAL_SERVER_IDLE_STOP_S``.

        Returns:
            The state, and whether this call started the server.
        """
        held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            with self.locked():
                state = self.running()
                started = state is None
                if state is None:
                    state = self._start(idle_stop_s)
                self.touch()
                return state, started
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)

    def _start(self, idle_stop_s: float | None) -> ServerState:
        """Start the server (`serve`) detached, listening on a socket bound here on a free
        port of 127.0.0.1, and write its state. Called with the lock held."""
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn's own
        try:
            # The last server's port when it is free: its URL (the UI's, the runs' `prefect-api`
            # label) stays the same across restarts.
            try:
                listener.bind(("127.0.0.1", self._last_port()))
            except OSError:
                listener.bind(("127.0.0.1", 0))
            listener.listen(128)
            port = listener.getsockname()[1]
            env = {
                **os.environ,
                "PREFECT_HOME": str(self.home),
                "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
            }
            # Prefect's telemetry writes to SQLite while runs do ("database is locked").
            env.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
            if idle_stop_s is not None:
                env["PREFECT_SANDBOX_LOCAL_SERVER_IDLE_STOP_S"] = str(idle_stop_s)
            command = [sys.executable, "-m", "prefect_sandbox.local_server.serve"]
            command += ["--fd", str(listener.fileno()), "--folder", str(self.folder)]
            with self.log_path.open("ab") as log:
                process = subprocess.Popen(
                    command, env=env, cwd=self.folder, stdin=subprocess.DEVNULL, stdout=log,
                    stderr=subprocess.STDOUT, pass_fds=(listener.fileno(),),
                    start_new_session=True,
                )  # fmt: skip
        finally:
            listener.close()
        _children.append(process)
        state = ServerState(process.pid, port, time.time(), idle_stop_s, _start_ticks(process.pid))
        self.write_state(state)
        self.last_port_path.write_text(str(port))
        return state

    def _last_port(self) -> int:
        """The port the last server started here listened on; 0 (any) when none did."""
        try:
            return int(self.last_port_path.read_text())
        except (OSError, ValueError):
            return 0

    def write_state(self, state: ServerState) -> None:
        """Write ``state.json`` whole (a reader never sees half of it)."""
        partial = self.state_path.with_suffix(".tmp")
        partial.write_text(json.dumps(asdict(state)))
        partial.replace(self.state_path)

    def wait_until_ready(
        self, state: ServerState, say: Callable[[str], None] | None = None
    ) -> None:
        """Wait until the server answers its health check, for as long as its process lives
        and keeps using CPU: no fixed time-out, which a busy machine would outrun.

        Args:
            state: the server to wait for.
            say: called with a line every `NOTE_EVERY_S` seconds of waiting.

        Raises:
            LocalServerError: the process exited, or used no CPU for `STALL_S` seconds
                without answering (the message names the log and the fix).
        """
        began = last_progress = time.monotonic()
        cpu = _cpu_seconds(state.pid)
        next_note = began + NOTE_EVERY_S
        while not healthy(state.url):
            now = time.monotonic()
            if not _alive(state.pid):
                raise LocalServerError(f"it exited while starting; {self._log_tail()}; {FIX}")
            used = _cpu_seconds(state.pid)
            if used is not None and used > (cpu or 0.0):
                cpu, last_progress = used, now
            elif now - last_progress > _stall_limit_s(used is None):
                raise LocalServerError(
                    f"it did not answer in {now - began:.0f} s, and used no CPU for the last "
                    f"{now - last_progress:.0f} s; {self._log_tail()}; {FIX}"
                )
            if say is not None and now >= next_note:
                say(f"still starting ({now - began:.0f} s, load {os.getloadavg()[0]:.1f})")
                next_note += NOTE_EVERY_S
            time.sleep(0.2)

    def _log_tail(self) -> str:
        """The log's last non-empty line, named with the log's path."""
        try:
            lines = [line for line in self.log_path.read_text().splitlines() if line.strip()]
        except OSError:
            lines = []
        last = lines[-1].strip()[:300] if lines else "(empty)"
        return f"its log {self.log_path} ends: {last}"

    def stop(self) -> ServerState | None:
        """Stop the running server: remove its state, SIGTERM its process group, and SIGKILL
        it if it has not exited after `STOP_WAIT_S` seconds.

        Returns:
            The state of the server stopped; None when none was running.
        """
        with self.locked():
            state = self.running()
            self.state_path.unlink(missing_ok=True)
        if state is None:
            return None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(state.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_WAIT_S
        while _alive(state.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _alive(state.pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(state.pid, signal.SIGKILL)
        return state


_children: list[subprocess.Popen[bytes]] = []
"""The servers this process started, kept so each is reaped (`_alive` polls them) and Popen
does not warn that one still runs when its object goes."""


def healthy(url: str, timeout_s: float = 2.0) -> bool:
    """Whether the Prefect API at ``url`` answers ``GET /health`` with 200."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout_s) as response:
            return bool(response.status == 200)
    except (OSError, urllib.error.URLError, ValueError):
        return False


def _alive(pid: int) -> bool:
    """Whether the process exists and is not a zombie."""
    for child in _children:
        child.poll()  # reaps it if it exited
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError, IndexError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return True


def _is_our_server(state: ServerState) -> bool:
    """Whether the server ``state`` names still runs: its pid alive and started when the state
    says (a reused pid is not taken for it). Its command line would not do: ``/proc/PID/cmdline``
    reads empty until the new program has set up its arguments, some time after ``Popen``
    returned, so a second run could start a second server (seen beside two CPU burners)."""
    return _alive(state.pid) and _start_ticks(state.pid) == state.pid_started


def _start_ticks(pid: int) -> int | None:
    """When the process started, in clock ticks since boot, from ``/proc``; None where that
    cannot be read."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _stall_limit_s(blind: bool) -> float:
    """Seconds a starting server may go without visible progress: `STALL_S`, or, where its CPU
    use cannot be read (``blind``), that scaled by the load per core."""
    if not blind:
        return STALL_S
    return STALL_S * max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))


def _cpu_seconds(pid: int) -> float | None:
    """CPU seconds (user and system) the process has used, from ``/proc``; None where that
    cannot be read."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def rss_bytes(pid: int) -> int | None:
    """The process's resident memory in bytes, from ``/proc``; None where it cannot be read."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def describe(server: LocalServer) -> list[str]:
    """``prefect-sandbox server status``'s lines: whether the server runs; if it does, its
    address, pid, age, last use, idle stop, resident memory and whether it answers."""
    state = server.running()
    if state is None:
        return [f"No local Prefect server runs for PREFECT_HOME={server.home}."]
    now = time.time()
    try:
        used = f"{_span(now - server.last_used_path.stat().st_mtime)} ago"
    except OSError:
        used = "never"
    rss = rss_bytes(state.pid)
    idle = "never" if state.idle_stop_s is None else f"after {_span(state.idle_stop_s)} unused"
    return [
        f"Local Prefect server: {state.url} (UI at {state.url.removesuffix('/api')}), "
        f"pid {state.pid}, {'answering' if healthy(state.url) else 'NOT answering'}",
        f"  started {_span(now - state.started_at)} ago; last run started {used}; stops {idle}",
        f"  memory (RSS): {'unknown' if rss is None else f'{rss / 2**20:.0f} MiB'}",
        f"  state and log: {server.folder}",
    ]


def _span(seconds: float) -> str:
    """``42 s`` under two minutes, else ``17 min``."""
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"
