"""Hostile cells stay inside their sandbox: each escape an attacker tried, tried again.

Every escape test runs on each isolating backend (`ISOLATING`) and, as proof that it detects
the escape, on the local kernel without isolation, where it must fail (strict xfail). The
tests use only the `Sandbox` interface and host paths they make themselves, so a backend that
isolates by other means (a container) is one more entry in `ISOLATING`.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import stat
import subprocess
import sys
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from prefect_sandbox.blocks.base import SandboxBackend
from prefect_sandbox.blocks.docker import DockerBackend
from prefect_sandbox.blocks.local import LocalKernelBackend
from prefect_sandbox.sandbox.backends.local import LocalKernelConfig, LocalKernelSandbox
from prefect_sandbox.sandbox.base import Sandbox, SandboxHandle
from prefect_sandbox.sandbox.errors import SandboxUnavailableError
from prefect_sandbox.sandbox.isolation import (
    SANDBOX_HOME,
    SandboxView,
    bwrap_command,
    limited_command,
    sandbox_view,
)
from tests.conftest import ROOT, stream_text

LABELS = {"prefect-sandbox": "true", "suite": "isolation"}

ISOLATING = ["local", pytest.param("docker", marks=pytest.mark.docker)]
"""Backends whose sandboxes must stop every escape below."""

UNISOLATED = pytest.param(
    "local-none",
    marks=pytest.mark.xfail(strict=True, reason="without isolation the escape works"),
)


def _backend(request: pytest.FixtureRequest) -> SandboxBackend:
    name = request.param
    if name == "docker":
        return DockerBackend(image=request.getfixturevalue("docker_image"), interrupt_grace_s=2.0)
    if name == "local":
        return LocalKernelBackend(interrupt_grace_s=2.0)
    if name == "local-none":
        return LocalKernelBackend(interrupt_grace_s=2.0, isolation="none")
    raise AssertionError(f"unknown backend {name}")


@pytest.fixture(params=[*ISOLATING, UNISOLATED])
def escape_backend(request: pytest.FixtureRequest) -> SandboxBackend:
    """A backend an escape is tried on: each isolating one, and the local kernel without."""
    return _backend(request)


@pytest.fixture(params=ISOLATING)
def isolated_backend(request: pytest.FixtureRequest) -> SandboxBackend:
    """Each isolating backend."""
    return _backend(request)


@pytest.fixture
async def sandbox(escape_backend: SandboxBackend) -> AsyncIterator[Sandbox]:
    """A sandbox to escape from, made after the test's host set-up, killed afterwards."""
    box = await escape_backend.create(LABELS)
    try:
        yield box
    finally:
        await box.kill()


@pytest.fixture
def host_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A user's home as an attacker finds it: Prefect's database and profile, keys, a canary.

    ``HOME`` points at it, so a kernel without isolation inherits it as its own home.
    """
    home = tmp_path / "home"
    files = {
        ".prefect/prefect.db": "SQLite format 3\0 block secret: prefect-db-secret",
        ".prefect/profiles.toml": (
            'active = "local"\n[profiles.local]\n'
            'PREFECT_API_URL = "http://127.0.0.1:4200/api"\n'
            'PREFECT_API_KEY = "prefect-profile-secret"\n'
        ),
        ".prefect/memo_store.toml": "prefect-memo-secret",
        ".aws/credentials": "[default]\naws_secret_access_key = aws-file-secret\n",
        ".ssh/id_ed25519": "-----BEGIN OPENSSH PRIVATE KEY----- ssh-key-secret",
        "canary.txt": "home-canary-secret",
    }
    for name, text in files.items():
        (home / name).parent.mkdir(parents=True, exist_ok=True)
        (home / name).write_text(text)
    monkeypatch.setenv("HOME", str(home))
    return home


SECRETS = (
    "prefect-db-secret",
    "prefect-profile-secret",
    "prefect-memo-secret",
    "aws-file-secret",
    "ssh-key-secret",
    "home-canary-secret",
)

# A cell that tries to read each path and to list each folder, and prints what it got.
_READ_CELL = """
import json, os
found = {}
for path in %r:
    path = os.path.expanduser(path)
    try:
        if os.path.isdir(path):
            found[path] = "listed: " + " ".join(sorted(os.listdir(path)))
        else:
            with open(path, errors="replace") as f:
                found[path] = "read: " + f.read()
    except OSError as exc:
        found[path] = "refused: " + type(exc).__name__
print(json.dumps(found))
"""


async def _try_to_read(sandbox: Sandbox, paths: list[str]) -> dict[str, str]:
    result = await sandbox.run_cell(_READ_CELL % (paths,), timeout_s=60)
    assert result.status == "ok", result.error
    found: dict[str, str] = json.loads(stream_text(result.outputs))
    return found


async def test_prefect_database_and_profile_are_unreadable(
    host_home: Path, sandbox: Sandbox
) -> None:
    prefect_home = host_home / ".prefect"
    paths = [
        str(prefect_home / "prefect.db"),
        str(prefect_home / "profiles.toml"),
        str(prefect_home),
        "~/.prefect/prefect.db",
        "~/.prefect/profiles.toml",
    ]
    found = await _try_to_read(sandbox, paths)
    assert all(value.startswith("refused") for value in found.values()), found
    assert not any(secret in json.dumps(found) for secret in SECRETS)


async def test_a_canary_in_the_host_home_is_unreadable(host_home: Path, sandbox: Sandbox) -> None:
    paths = [
        str(host_home / "canary.txt"),
        str(host_home),
        str(host_home / ".aws" / "credentials"),
        str(host_home / ".ssh" / "id_ed25519"),
        "~/canary.txt",
        "~/.aws/credentials",
        "~/.ssh/id_ed25519",
    ]
    found = await _try_to_read(sandbox, paths)
    assert all(value.startswith("refused") for value in found.values()), found
    assert not any(secret in json.dumps(found) for secret in SECRETS)


@pytest.fixture
def host_listener() -> Iterator[int]:
    """A TCP server on the host's 127.0.0.1 (as Prefect's API is); yields its port."""
    server = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                connection, _ = server.accept()
            except OSError:
                return
            connection.sendall(b"host-listener-banner")
            accepted.append(connection)

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        server.close()
        thread.join(timeout=5)
        for connection in accepted:
            connection.close()


_CONNECT_CELL = """
import socket
for host in ("127.0.0.1", "localhost"):
    try:
        with socket.create_connection((host, %d), timeout=3) as s:
            print(host, "connected", s.recv(100).decode())
    except OSError as exc:
        print(host, "refused", type(exc).__name__)
"""


async def test_no_tcp_connection_to_a_listener_on_the_host_loopback(
    host_listener: int, sandbox: Sandbox
) -> None:
    result = await sandbox.run_cell(_CONNECT_CELL % host_listener, timeout_s=60)
    text = stream_text(result.outputs)
    assert result.status == "ok", result.error
    assert "connected" not in text and "banner" not in text
    assert text.count("refused") == 2


async def test_network_true_reaches_the_host(host_listener: int) -> None:
    box = await LocalKernelSandbox.create(LocalKernelConfig(network=True))
    try:
        result = await box.run_cell(_CONNECT_CELL % host_listener, timeout_s=60)
    finally:
        await box.kill()
    assert "127.0.0.1 connected host-listener-banner" in stream_text(result.outputs)


def _host_paths(handle: SandboxHandle) -> list[str]:
    """The host paths a handle names: its working directory and its connection details."""
    paths = [handle.workdir]
    paths += [v for v in handle.connection.values() if isinstance(v, str) and v.startswith("/")]
    return paths


async def test_another_sandboxs_files_and_connection_are_invisible(
    escape_backend: SandboxBackend, sandbox: Sandbox
) -> None:
    other = await escape_backend.create(LABELS)
    try:
        canary = f"other-sandbox-canary-{uuid.uuid4().hex}"
        written = await other.run_cell(f"open('canary.txt', 'w').write({canary!r})")
        assert written.status == "ok", written.error
        targets = [str(Path(other.handle.workdir) / "canary.txt")]
        for path in _host_paths(other.handle):
            targets += [path, str(Path(path).parent)]
            targets += [str(Path(path) / "connection.json"), str(Path(path) / "handle.json")]
        found = await _try_to_read(sandbox, targets)
    finally:
        await other.kill()
    seen = " ".join(found.values())
    assert canary not in seen
    # No listing of a folder that holds sandboxes shows the other one.
    assert other.handle.sandbox_id not in seen, found
    assert not any(
        value.startswith("read") for path, value in found.items() if path.endswith(".json")
    ), found


_PROC_CELL = """
import json, os
secret = %r
def environ(pid):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read().decode(errors="replace")
    except OSError as exc:
        return "refused: " + type(exc).__name__
pids = [name for name in os.listdir("/proc") if name.isdigit()]
cmdlines = []
for pid in pids:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdlines.append(f.read().replace(b"\\0", b" ").decode(errors="replace"))
    except OSError:
        pass
print(json.dumps({
    "parent": environ(os.getppid()),
    "holder": environ(%d),
    "secret_seen": any(secret in environ(pid) for pid in pids),
    "cmdlines": cmdlines,
}))
"""


async def test_host_processes_and_the_parents_environ_are_invisible(sandbox: Sandbox) -> None:
    secret = f"aws-env-secret-{uuid.uuid4().hex}"
    # A host process holding a secret in its environment, as the flow process holds AWS keys.
    holder = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(120)"],
        env={**os.environ, "AWS_SECRET_ACCESS_KEY": secret},
    )
    try:
        result = await sandbox.run_cell(_PROC_CELL % (secret, holder.pid), timeout_s=60)
    finally:
        holder.kill()
        holder.wait()
    assert result.status == "ok", result.error
    seen = json.loads(stream_text(result.outputs))
    assert secret not in json.dumps(seen)
    assert not seen["secret_seen"]
    assert seen["holder"].startswith("refused")
    # The kernel's parent is not this (the flow's) process.
    own_environ = Path(f"/proc/{os.getpid()}/environ").read_bytes().decode(errors="replace")
    assert seen["parent"] != own_environ
    own_cmdline = Path(f"/proc/{os.getpid()}/cmdline").read_bytes().replace(b"\0", b" ")
    assert own_cmdline.decode(errors="replace") not in seen["cmdlines"]


_WRITE_CELL = """
import json, os, sys
results = {}
system = [os.path.join(sys.prefix, "escape.txt"), "/usr/escape.txt", "/etc/escape.txt"]
for path in %r + system:
    try:
        with open(path, "x") as f:
            f.write("escaped")
    except OSError as exc:
        results[path] = "refused: " + type(exc).__name__
    else:
        results[path] = "written"
        if path in system:
            os.remove(path)  # not to leave a mark on a host without isolation
with open("inside.txt", "w") as f:
    f.write("inside")
print(json.dumps(results))
"""


async def test_writes_outside_the_working_directory_never_reach_the_host(
    host_home: Path, tmp_path: Path, sandbox: Sandbox
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    name = f"escape-{uuid.uuid4().hex}.txt"
    host_targets = [
        outside / name,
        host_home / name,
        Path(sandbox.handle.workdir).parent / name,
    ]
    result = await sandbox.run_cell(
        _WRITE_CELL % ([str(path) for path in host_targets],), timeout_s=60
    )
    assert result.status == "ok", result.error
    try:
        assert not any(path.exists() for path in host_targets)
    finally:
        for path in host_targets:
            path.unlink(missing_ok=True)
    written = json.loads(stream_text(result.outputs))
    # The system and the Python environment are read-only; the rest is not on the host.
    assert all(written[path].startswith("refused") for path in list(written)[-3:]), written
    assert [file.path for file in await sandbox.list_files("inside.txt")] == ["inside.txt"]


@pytest.mark.usefixtures("prefect_api")
async def test_the_co2_main_job_passes_isolated(
    isolated_backend: SandboxBackend, tmp_path: Path
) -> None:
    from prefect_sandbox.flows import arun_notebook

    example = ROOT / "examples" / "co2"
    result = await arun_notebook(
        notebook=str(example / "forecast.ipynb"),
        inputs=[str(example / "co2.csv")],
        artifacts=["figures/*.png", "forecast.csv", "metrics.json"],
        backend=isolated_backend,
        storage=str(tmp_path / "out"),
    )
    assert result.status == "completed", result.error
    assert all(stage.status == "ok" for stage in result.stages)
    run_dir = Path(result.output_dir)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert 0 < metrics["mae_ppm"] < 2
    assert len(list((run_dir / "figures").glob("*.png"))) >= 2


# --- the local kernel's isolation itself ---


async def test_without_bwrap_create_says_how_to_install_it_and_starts_nothing() -> None:
    config = LocalKernelConfig(bwrap_path="/nonexistent/bwrap")
    before = await LocalKernelSandbox.list_handles(config)
    with pytest.raises(SandboxUnavailableError) as info:
        await LocalKernelSandbox.create(config)
    assert "apt-get install bubblewrap" in str(info.value)
    assert "isolation='none'" in str(info.value)
    assert await LocalKernelSandbox.list_handles(config) == before


async def test_a_bwrap_that_cannot_make_namespaces_is_reported(tmp_path: Path) -> None:
    # What bwrap prints where user namespaces are off (a locked-down container, a sysctl).
    fake = tmp_path / "bwrap"
    fake.write_text(
        "#!/bin/sh\necho 'bwrap: No permissions to creating new namespace' >&2\nexit 1\n"
    )
    fake.chmod(0o755)
    with pytest.raises(SandboxUnavailableError) as info:
        await LocalKernelSandbox.create(LocalKernelConfig(bwrap_path=str(fake)))
    assert "No permissions to creating new namespace" in str(info.value)
    assert "apt-get install bubblewrap" in str(info.value)


def test_a_kernel_outlives_the_thread_that_started_it() -> None:
    # bwrap's --die-with-parent fires when the starting THREAD ends; flows start sandboxes
    # from worker threads that end long before the sandbox should.
    handles: list[SandboxHandle] = []

    def start() -> None:
        async def create() -> None:
            box = await LocalKernelSandbox.create(LocalKernelConfig())
            handles.append(box.handle)
            await box.close()

        asyncio.run(create())

    thread = threading.Thread(target=start)
    thread.start()
    thread.join()

    async def use() -> str:
        box = await LocalKernelSandbox.attach(handles[0], LocalKernelConfig())
        try:
            await asyncio.sleep(1.0)
            return stream_text((await box.run_cell("print('alive')", timeout_s=30)).outputs)
        finally:
            await box.kill()

    assert asyncio.run(use()) == "alive\n"


async def test_runtime_folder_is_private_holds_only_its_own_and_goes_at_kill() -> None:
    box = await LocalKernelSandbox.create(LocalKernelConfig())
    runtime_dir = Path(box.handle.connection["runtime_dir"])
    try:
        for folder in (runtime_dir, runtime_dir / "ipc"):
            assert stat.S_IMODE(folder.stat().st_mode) & 0o777 == 0o700
        assert stat.S_IMODE((runtime_dir / "connection.json").stat().st_mode) == 0o600
        result = await box.run_cell(
            _READ_CELL
            % (
                [
                    str(runtime_dir),
                    str(runtime_dir.parent),
                    str(runtime_dir / "kernel.pid"),
                    str(runtime_dir / "handle.json"),
                ],
            )
        )
        found = json.loads(stream_text(result.outputs))
        pid = (runtime_dir / "kernel.pid").read_text()
        # A pid of the kernel's choosing would make kill() signal that process group.
        await box.run_cell(
            f"import os\nfor name in ('kernel.pid', 'handle.json'):\n"
            f"    try: open(os.path.join({str(runtime_dir)!r}, name), 'w').write('1')\n"
            f"    except OSError: pass"
        )
        after = [(runtime_dir / name).read_text() for name in ("kernel.pid", "handle.json")]
    finally:
        await box.kill()
    # It sees of its runtime folder only what it needs: the connection file (read-only), the
    # sockets' folder and its IPython folder; never the pid and handle files this side trusts.
    assert found[str(runtime_dir)] == "listed: connection.json ipc ipython"
    assert found[str(runtime_dir.parent)] == f"listed: {runtime_dir.name}"
    assert found[str(runtime_dir / "kernel.pid")].startswith("refused")
    assert found[str(runtime_dir / "handle.json")].startswith("refused")
    assert after[0] == pid and after[1].startswith("{")
    assert not runtime_dir.exists()


async def test_the_kernel_sees_an_empty_home_and_tmp_and_only_loopback() -> None:
    box = await LocalKernelSandbox.create(LocalKernelConfig())
    try:
        result = await box.run_cell(
            "import json, os, socket\n"
            "print(json.dumps([os.environ['HOME'], os.listdir(os.environ['HOME']),"
            " sorted(n for _, n in socket.if_nameindex()), os.getpid()]))"
        )
    finally:
        await box.kill()
    home, listing, interfaces, pid = json.loads(stream_text(result.outputs))
    assert (home, listing, interfaces) == (SANDBOX_HOME, [], ["lo"])
    assert pid < 10  # its own PID namespace


# --- pure parts ---


def test_bwrap_command_mounts_in_order_and_shares_the_network_only_if_asked() -> None:
    view = SandboxView(
        links=(("/bin", "usr/bin"),),
        read_only=("/usr", "/venv", "/run/k/connection.json"),
        writable=("/tmp/work", "/run/k/ipc"),
    )
    argv = bwrap_command("/usr/bin/bwrap", view, ["python", "-m", "ipykernel_launcher"])
    assert argv[:2] == ["/usr/bin/bwrap", "--unshare-all"]
    assert "--share-net" not in argv
    assert "--share-net" in bwrap_command("bwrap", SandboxView((), (), (), network=True), ["x"])
    assert argv[argv.index("--setenv") + 1 :][:2] == ["JPY_PARENT_PID", "1"]
    assert argv[-4:] == ["--", "python", "-m", "ipykernel_launcher"]
    mounts = [(argv[i], argv[i + 1]) for i in range(len(argv) - 1) if argv[i].startswith("--")]
    order = [(flag, path) for flag, path in mounts if flag in {"--tmpfs", "--ro-bind", "--bind"}]
    assert order == [
        ("--tmpfs", "/tmp"),
        ("--tmpfs", SANDBOX_HOME),
        ("--ro-bind", "/usr"),
        ("--ro-bind", "/venv"),
        ("--ro-bind", "/run/k/connection.json"),
        ("--bind", "/tmp/work"),
        ("--bind", "/run/k/ipc"),
    ]
    assert ("--cap-drop", "ALL") in mounts and ("--remount-ro", "/") in mounts


def test_sandbox_view_holds_the_python_environment_and_nothing_twice(tmp_path: Path) -> None:
    view = sandbox_view(sys.executable, writable=[tmp_path])
    assert sys.prefix in view.read_only and sys.base_prefix in view.read_only
    assert "/usr" in view.read_only
    # Inside another read-only path: not mounted again.
    assert not any(path.startswith("/usr/") for path in view.read_only)
    assert len(set(view.read_only)) == len(view.read_only)
    assert view.writable == (str(tmp_path),)
    assert not any(str(Path.home()) == path for path in view.read_only)


def test_limited_command_sets_limits_before_the_command_starts() -> None:
    probe = "ulimit -v; ulimit -S -t; ulimit -H -t; grep SigIgn /proc/self/status"
    argv = limited_command(["/bin/sh", "-c", probe], memory_limit_bytes=3 << 30, cpu_time_limit_s=7)
    done = subprocess.run(argv, capture_output=True, text=True, check=True)
    lines = done.stdout.split("\n")
    assert lines[:3] == [str(3 << 20), "7", "12"]
    # SIGINT (bit 2) ignored: an interrupt to the process group must not end bwrap.
    assert int(lines[3].split()[1], 16) & 0b10
