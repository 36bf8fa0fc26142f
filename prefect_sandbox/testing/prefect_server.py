"""A real ``prefect server start`` in a child process, on SQLite or on a throwaway PostgreSQL
cluster (Debian's ``postgresql`` packages), for tests and benchmarks that need Prefect's own
server rather than its temporary one.

Both listen on 127.0.0.1 only and remove everything they made when stopped.
Manual: docs/development.md.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Self

import httpx

from prefect_sandbox.testing.s3 import free_port
from prefect_sandbox.testing.stopping import StopsOnExit

__all__ = [
    "PREFECT",
    "PostgresCluster",
    "PrefectServer",
    "drain_prefect_workers",
    "postgres_bin_dir",
]

PREFECT = [sys.executable, "-m", "prefect"]
_STOP_TIMEOUT_S = 20.0
_SECOND_SIGTERM_S = 5.0
"""When a process group still there after SIGTERM gets a second: Prefect's worker and server
take the first as Ctrl-C (a worker waits for its flow runs) and the second as SIGKILL."""
# PostgreSQL refuses to run as root; as root, the cluster runs as this user when it exists.
_POSTGRES_USER = "postgres"
_DEBIAN_PG_ROOT = Path("/usr/lib/postgresql")


def postgres_bin_dir() -> Path | None:
    """The folder holding PostgreSQL's ``initdb``, ``pg_ctl`` and ``postgres``: the one on PATH,
    else Debian's newest ``/usr/lib/postgresql/<version>/bin``; None when neither has them."""
    on_path = shutil.which("pg_ctl")
    if on_path is not None:
        return Path(on_path).resolve().parent
    versions = sorted(
        (p for p in _DEBIAN_PG_ROOT.glob("*/bin") if (p / "pg_ctl").exists()),
        key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0,
    )
    return versions[-1] if versions else None


async def drain_prefect_workers() -> None:
    """Send this process's pending logs and events to the current API before its server stops,
    as ``prefect_test_harness`` does: Prefect's process-wide workers would otherwise retry them
    against the stopped server when the process exits, ~70 s per event."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    with contextlib.suppress(RuntimeError):  # never started
        drained = APILogWorker.instance().drain()
        if inspect.isawaitable(drained):
            await drained
    events = EventsWorker.drain_all()
    if inspect.isawaitable(events):
        await events


class PostgresCluster(StopsOnExit):
    """A throwaway PostgreSQL cluster: ``initdb`` in a fresh temporary folder, then ``pg_ctl
    start`` listening on 127.0.0.1 at a free port (no Unix socket), password-authenticated.
    A context manager; `stop` removes the cluster's folder.

    As root, the cluster's processes run as the ``postgres`` user (``runuser``), since
    PostgreSQL refuses root; its folder is made in the system temp dir, where that user can
    reach it.

    Args:
        database: the database the `url` names (created at start).

    Raises:
        RuntimeError: from `start`: PostgreSQL is not installed, or running as root with no
            ``postgres`` user, or the cluster did not start (the log's tail is in the message).
    """

    def __init__(self, database: str = "prefect") -> None:
        self.database = database
        self.user = "prefect"
        self.password = secrets.token_urlsafe(16)
        self.port = 0
        self.folder: Path | None = None
        self._bin: Path | None = None
        self._run_as: list[str] = []

    @property
    def url(self) -> str:
        """The SQLAlchemy URL Prefect's server takes in ``PREFECT_API_DATABASE_CONNECTION_URL``:
        ``postgresql+asyncpg://prefect:PASSWORD@127.0.0.1:PORT/prefect``."""
        return (
            f"postgresql+asyncpg://{self.user}:{self.password}@127.0.0.1:{self.port}/"
            f"{self.database}"
        )

    def _pg(self, tool: str, *args: str, timeout_s: float = 120) -> None:
        assert self._bin is not None
        done = subprocess.run(
            [*self._run_as, str(self._bin / tool), *args],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env={**os.environ, "PGPASSWORD": self.password, "LC_ALL": "C"},
        )
        if done.returncode != 0:
            log = self.folder / "server.log" if self.folder else None
            tail = log.read_text()[-2000:] if log and log.exists() else ""
            raise RuntimeError(f"{tool} {' '.join(args)} failed:\n{done.stderr}{tail}")

    def start(self) -> Self:
        """Make and start the cluster and its database; returns once it accepts connections."""
        self._bin = postgres_bin_dir()
        if self._bin is None:
            raise RuntimeError("PostgreSQL is not installed (Debian: apt-get install postgresql)")
        # tempfile.gettempdir() may be a private folder the postgres user cannot enter.
        self.folder = Path(tempfile.mkdtemp(prefix="prefect-sandbox-pg-", dir="/tmp"))
        if os.geteuid() == 0:
            try:
                owner = pwd.getpwnam(_POSTGRES_USER)
            except KeyError:
                shutil.rmtree(self.folder)
                raise RuntimeError(
                    f"PostgreSQL refuses to run as root and there is no {_POSTGRES_USER!r} user"
                ) from None
            os.chown(self.folder, owner.pw_uid, owner.pw_gid)
            self._run_as = ["runuser", "-u", _POSTGRES_USER, "--"]
        try:
            password_file = self.folder / "password"
            password_file.write_text(self.password)
            if self._run_as:
                os.chown(password_file, owner.pw_uid, owner.pw_gid)
            data = str(self.folder / "data")
            self._pg(
                "initdb", "-D", data, "-U", self.user, "--auth=scram-sha-256",
                f"--pwfile={password_file}", "--encoding=UTF8", "--no-sync",
            )  # fmt: skip
            password_file.unlink()
            self.port = free_port()
            options = (
                f"-c listen_addresses=127.0.0.1 -c port={self.port} "
                "-c unix_socket_directories='' -c fsync=off -c max_connections=200"
            )
            self._pg(
                "pg_ctl", "start", "-D", data, "-w", "-t", "120", "-o", options,
                "-l", str(self.folder / "server.log"),
            )  # fmt: skip
            self._pg(
                "createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", self.user,
                self.database,
            )  # fmt: skip
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop the cluster (fast shutdown: open connections are ended) and remove its folder.
        Idempotent."""
        if self.folder is None:
            return
        data = self.folder / "data"
        if (data / "postmaster.pid").exists():
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                self._pg("pg_ctl", "stop", "-D", str(data), "-m", "fast", "-w", timeout_s=60)
        shutil.rmtree(self.folder, ignore_errors=True)
        self.folder = None

    def __enter__(self) -> Self:
        return self.start()


class PrefectServer(StopsOnExit):
    """``prefect server start`` on 127.0.0.1 at a free port, in its own session (process group),
    with its log in ``home/server.log``. A context manager: entering waits until it is healthy.

    Args:
        home: its ``PREFECT_HOME`` (SQLite's database file lives there unless `database_url`).
        database_url: ``PREFECT_API_DATABASE_CONNECTION_URL``, e.g. `PostgresCluster.url`;
            None for Prefect's default SQLite file.
        env: more environment variables for the server and for `env` (e.g.
            ``PREFECT_SANDBOX_INPUT_ROOTS``).

    Attributes:
        url: its API address, ``http://127.0.0.1:PORT/api``.
        env: the environment the server runs with; clients started with it reach this server.
    """

    def __init__(
        self, home: Path, database_url: str | None = None, env: dict[str, str] | None = None
    ) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}/api"
        self.home = home
        self.env = dict(os.environ)
        self.env.update(
            PREFECT_HOME=str(home),
            PREFECT_API_URL=self.url,
            PREFECT_SERVER_ANALYTICS_ENABLED="false",
            PREFECT_LOGGING_LEVEL="INFO",
        )
        self.env.pop("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", None)
        if database_url is not None:
            self.env["PREFECT_API_DATABASE_CONNECTION_URL"] = database_url
        self.env.update(env or {})
        self.others: list[subprocess.Popen[bytes]] = []
        self.server = self._spawn(
            "server", ["server", "start", "--host", "127.0.0.1", "--port", str(port)]
        )

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        with (self.home / f"{name}.log").open("wb") as log:
            return subprocess.Popen(
                [*PREFECT, *args], env=self.env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip

    def start_process(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        """Run ``prefect ARGS`` (a worker, say) with the server's environment, in its own
        session, logging to ``home/NAME.log``; `stop` ends it before the server."""
        process = self._spawn(name, args)
        self.others.append(process)
        return process

    def wait_until_healthy(self, timeout_s: float = 120) -> None:
        """Wait until ``/api/health`` answers 200.

        Raises:
            RuntimeError: it did not within `timeout_s` seconds, or the server exited (the
                message holds its log's tail).
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.server.poll() is not None:
                break
            time.sleep(0.5)
        raise RuntimeError((self.home / "server.log").read_text()[-3000:])

    def stop_started(self) -> None:
        """End every process `start_process` started, with its process group, all at once
        (`_end_groups`); the server goes on, for others to share."""
        _end_groups(self.others)
        self.others = []

    def stop(self) -> None:
        """End every process `start_process` started, then the server, with their process
        groups (`_end_groups`)."""
        self.stop_started()
        _end_groups([self.server])

    def __enter__(self) -> Self:
        try:
            self.wait_until_healthy()
        except BaseException:
            self.stop()
            raise
        return self


def _end_groups(processes: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM each process's group at once; a second SIGTERM to a group whose process is
    still there after `_SECOND_SIGTERM_S`, SIGKILL after `_STOP_TIMEOUT_S` in all."""
    deadline = time.monotonic() + _STOP_TIMEOUT_S
    for signum, until in (
        (signal.SIGTERM, time.monotonic() + _SECOND_SIGTERM_S),
        (signal.SIGTERM, deadline),
        (signal.SIGKILL, None),
    ):
        for process in processes:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signum)
        for process in processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(None if until is None else max(0.0, until - time.monotonic()))
