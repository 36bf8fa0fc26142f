"""Hostile cells stay inside their sandbox: each escape an attacker tried, tried again.

Every escape test runs on each isolating backend (`ISOLATING`) and, as proof that it detects
the escape, on the local kernel without isolation, where it must fail (strict xfail). The
tests use only the `Sandbox` interface and host paths they make themselves, so a backend that
isolates by other means (a container) is one more entry in `ISOLATING`.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import errno
import json
import os
import platform
import signal
import socket
import stat
import subprocess
import sys
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from pathlib import Path

import psutil
import pytest

from prefect_sandbox.blocks.base import SandboxBackend
from prefect_sandbox.blocks.docker import DockerBackend
from prefect_sandbox.blocks.local import LocalKernelBackend
from prefect_sandbox.sandbox.backends.kernel import isolation
from prefect_sandbox.sandbox.backends.kernel import uids as uids_module
from prefect_sandbox.sandbox.backends.kernel.isolation import (
    SANDBOX_HOME,
    SECCOMP_REFUSED,
    SandboxView,
    bwrap_command,
    limited_command,
    sandbox_view,
    staged_command,
)
from prefect_sandbox.sandbox.backends.kernel.local import (
    KERNEL_LOG_BYTES,
    LocalKernelConfig,
    LocalKernelSandbox,
)
from prefect_sandbox.sandbox.base import Sandbox, SandboxHandle
from prefect_sandbox.sandbox.errors import SandboxDiedError, SandboxUnavailableError
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


@contextlib.asynccontextmanager
async def _created(backend: SandboxBackend) -> AsyncIterator[Sandbox]:
    box = await backend.create(LABELS)
    try:
        yield box
    finally:
        await box.kill()


@pytest.fixture
async def sandbox(escape_backend: SandboxBackend) -> AsyncIterator[Sandbox]:
    """A sandbox to escape from, made after the test's host set-up, killed afterwards."""
    async with _created(escape_backend) as box:
        yield box


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


@contextlib.contextmanager
def _serving(server: socket.socket, handle: Callable[[socket.socket], None]) -> Iterator[None]:
    """Accept connections on ``server`` in a thread, each given to ``handle``; close it after."""

    def accept() -> None:
        while True:
            try:
                connection, _ = server.accept()
            except OSError:
                return
            handle(connection)

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield
    finally:
        server.close()
        thread.join(timeout=5)


@pytest.fixture
def host_listener() -> Iterator[int]:
    """A TCP server on the host's 127.0.0.1 (as Prefect's API is); yields its port."""
    server = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []

    def greet(connection: socket.socket) -> None:
        connection.sendall(b"host-listener-banner")
        accepted.append(connection)

    try:
        with _serving(server, greet):
            yield server.getsockname()[1]
    finally:
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


def _host_workdir(sandbox: Sandbox) -> Path:
    """The sandbox's working directory as a host path (a container's is a bind mount)."""
    return Path(sandbox.handle.connection.get("host_workdir", sandbox.handle.workdir))


_PRIVILEGE_CELL = """
import json, os
def host_uid(uid, uid_map):
    for line in uid_map.splitlines():
        inside, outside, count = map(int, line.split())
        if inside <= uid < inside + count:
            return outside + uid - inside
    return None
uid_map = open("/proc/self/uid_map").read()
writable = []
for root, dirs, files in os.walk("/proc/sys"):
    for name in files:
        path = os.path.join(root, name)
        try:
            os.close(os.open(path, os.O_WRONLY))
        except OSError:
            continue
        writable.append(path)
for path in ("/proc/sysrq-trigger", "/proc/sys/kernel/core_pattern"):
    try:
        with open(path, "w") as f:
            f.write(open(path).read() if path.endswith("pattern") else "h")
    except OSError:
        continue
    writable.append(path + " (written)")
print(json.dumps({
    "uid_map": uid_map,
    "host_uid": host_uid(os.geteuid(), uid_map),
    "maps_host_root": any(
        int(outside) <= 0 < int(outside) + int(count)
        for _, outside, count in (line.split() for line in uid_map.splitlines())
    ),
    "writable": writable,
}))
"""


async def test_the_kernel_is_not_host_root_and_proc_sys_is_read_only(sandbox: Sandbox) -> None:
    result = await sandbox.run_cell(_PRIVILEGE_CELL, timeout_s=120)
    assert result.status == "ok", result.error
    seen = json.loads(stream_text(result.outputs))
    assert seen["host_uid"] not in (0, None), seen["uid_map"]
    assert seen["writable"] == [], seen["writable"][:20]
    if sandbox.handle.backend == "local":
        # Not even a uid the kernel cannot take: no line of its map reaches host uid 0.
        assert not seen["maps_host_root"], seen["uid_map"]


async def test_the_local_kernels_processes_are_not_host_root_seen_from_the_host() -> None:
    box = await LocalKernelSandbox.create(LocalKernelConfig())
    try:
        pid = int((Path(box.handle.connection["runtime_dir"]) / "kernel.pid").read_text())
        spawned = await box.run_cell(
            "import subprocess\nchild = subprocess.Popen(['sleep', '60'])", timeout_s=60
        )
        assert spawned.status == "ok", spawned.error
        tree = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
        owners = {process.pid: process.uids() for process in tree}
    finally:
        await box.kill()
    # bwrap, its init, the kernel and the cell's own child: four processes at least.
    assert len(owners) >= 4, owners
    if os.geteuid() == 0:
        uid = box.handle.connection["uid"]
        first, last = LocalKernelConfig().uid_range
        assert first <= uid <= last
        assert all(set(uids) == {uid} for uids in owners.values()), owners
    else:
        assert all(set(uids) == {os.getuid()} for uids in owners.values()), owners


async def test_a_root_only_file_in_a_mounted_folder_is_unreadable(sandbox: Sandbox) -> None:
    secret = f"root-only-secret-{uuid.uuid4().hex}"
    folders = [_host_workdir(sandbox)]
    if sandbox.handle.backend.startswith("local"):
        folders.append(Path(sys.prefix))  # the kernel's Python environment, mounted
    planted = [folder / f"root-only-{uuid.uuid4().hex}.key" for folder in folders]
    for path in planted:
        path.write_text(secret)
        path.chmod(0o600)
    try:
        found = await _try_to_read(
            sandbox, [*map(str, planted), "/etc/shadow", "/etc/ssl/private", "/etc/ssh"]
        )
    finally:
        for path in planted:
            path.unlink()
    assert all(value.startswith("refused") for value in found.values()), found
    assert secret not in json.dumps(found)


async def test_memory_folders_hold_no_more_than_the_memory_limit() -> None:
    limit = 1 << 30
    box = await LocalKernelSandbox.create(LocalKernelConfig(memory_limit_bytes=limit))
    try:
        result = await box.run_cell(
            "import json, os\n"
            "sizes = {}\n"
            "for path in ('/tmp', os.environ['HOME'], '/dev/shm'):\n"
            "    st = os.statvfs(path)\n"
            "    sizes[path] = st.f_blocks * st.f_frsize\n"
            "try:\n"
            "    open('/dev/planted', 'w')\n"
            "    sizes['/dev'] = 'written'\n"
            "except OSError as exc:\n"
            "    sizes['/dev'] = type(exc).__name__\n"
            "print(json.dumps(sizes))",
            timeout_s=60,
        )
    finally:
        await box.kill()
    sizes = json.loads(stream_text(result.outputs))
    assert sizes.pop("/dev") != "written"
    assert sizes == {"/tmp": limit, SANDBOX_HOME: limit, "/dev/shm": limit}


_NEW_NAMESPACE_CELL = """
import ctypes, json, os, shutil, subprocess, threading
libc = ctypes.CDLL(None, use_errno=True)
tried = {}
for name, flags in (("user", 0x10000000), ("user+mount", 0x10020000)):
    tried[name] = "made" if libc.unshare(flags) == 0 else os.strerror(ctypes.get_errno())
if shutil.which("unshare"):
    done = subprocess.run(["unshare", "--user", "--map-root-user", "id", "-u"],
                          capture_output=True, text=True)
    tried["unshare(1)"] = done.stdout.strip() or done.stderr.strip()[-80:]
# What a notebook needs still works: threads, and processes (glibc's clone3, then clone).
thread = threading.Thread(target=lambda: tried.update(thread="ran"))
thread.start()
thread.join()
tried["process"] = subprocess.run(["echo", "ran"], capture_output=True, text=True).stdout.strip()
print(json.dumps(tried))
"""


async def test_a_cell_cannot_make_a_user_namespace(sandbox: Sandbox) -> None:
    result = await sandbox.run_cell(_NEW_NAMESPACE_CELL, timeout_s=60)
    assert result.status == "ok", result.error
    tried = json.loads(stream_text(result.outputs))
    assert tried.pop("thread") == "ran" and tried.pop("process") == "ran"
    assert tried.pop("user") != "made" and tried.pop("user+mount") != "made"
    # unshare(1) prints the uid it became; refused, it prints why.
    assert tried.get("unshare(1)", "refused") != "0", tried


@pytest.fixture
async def isolated_sandbox(isolated_backend: SandboxBackend) -> AsyncIterator[Sandbox]:
    """A sandbox of each isolating backend, killed afterwards."""
    async with _created(isolated_backend) as box:
        yield box


_IGNORE_SIGINT_FOREVER = (
    "import signal, time\n"
    "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
    "while True: time.sleep(0.01)"
)

_PLANT_IPYTHON_LINKS_CELL = """
import os, shutil
profile = os.path.join(os.environ["IPYTHONDIR"], "profile_default")
config = os.path.join(profile, "ipython_kernel_config.py")
startup = os.path.join(profile, "startup")
os.remove(config)
os.symlink(%r, config)
shutil.rmtree(startup)
os.symlink(%r, startup)
print(os.readlink(config), os.readlink(startup))
"""


async def test_a_restart_after_links_planted_in_the_ipython_folder_touches_no_host_file(
    tmp_path: Path, isolated_sandbox: Sandbox, caplog: pytest.LogCaptureFixture
) -> None:
    host_file = tmp_path / "host-config.py"
    host_file.write_text("host-original")
    before = host_file.stat()
    host_folder = tmp_path / "host-folder"
    host_folder.mkdir()
    planted = await isolated_sandbox.run_cell(
        _PLANT_IPYTHON_LINKS_CELL % (str(host_file), str(host_folder)), timeout_s=60
    )
    assert planted.status == "ok", planted.error
    assert stream_text(planted.outputs) == f"{host_file} {host_folder}\n"
    # Ignores SIGINT: the timeout ends in a restart, which writes the kernel's IPython files.
    stuck = await isolated_sandbox.run_cell(_IGNORE_SIGINT_FOREVER, timeout_s=0.5)
    assert stuck.status == "timeout" and stuck.state_lost
    after = await isolated_sandbox.run_cell("print('restarted')", timeout_s=60)
    assert stream_text(after.outputs) == "restarted\n"
    assert host_file.read_text() == "host-original"
    assert host_file.stat().st_mtime_ns == before.st_mtime_ns
    assert list(host_folder.iterdir()) == []
    if isolated_sandbox.handle.backend == "local":
        # Local kernels rewrite their IPython files at a restart: each link is named.
        warned = [record.getMessage() for record in caplog.records]
        profile = (
            Path(isolated_sandbox.handle.connection["runtime_dir"]) / "ipython/profile_default"
        )
        for path in (profile / "ipython_kernel_config.py", profile / "startup"):
            assert any(f"{path} was replaced from inside the sandbox" in line for line in warned)


async def test_the_kernel_writes_the_files_and_folders_uploaded_for_it(
    tmp_path: Path, isolated_sandbox: Sandbox
) -> None:
    source = tmp_path / "in.csv"
    source.write_text("a\n")
    await isolated_sandbox.upload(source, "data/deep/in.csv")
    result = await isolated_sandbox.run_cell(
        "open('data/deep/in.csv', 'a').write('b\\n')\n"
        "open('data/deep/out.txt', 'w').write('out')\n"
        "open('data/beside.txt', 'w').write('beside')\n"
        "print(open('data/deep/in.csv').read(), end='')",
        timeout_s=60,
    )
    assert result.status == "ok", result.error
    assert stream_text(result.outputs) == "a\nb\n"


@pytest.fixture
def host_unix_listener(tmp_path: Path) -> Iterator[tuple[Path, list[bytes]]]:
    """A Unix socket server on the host, as a daemon's; yields its path and what it got."""
    path = tmp_path / "host.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen()
    received: list[bytes] = []

    def record(connection: socket.socket) -> None:
        with connection:
            connection.settimeout(2)
            try:
                received.append(connection.recv(1000) or b"(connected)")
            except OSError:
                received.append(b"(connected)")

    with _serving(server, record):
        yield path, received


_SWAP_SOCKETS_CELL = """
import glob, os
from ipykernel.kernelapp import IPKernelApp
swapped = []
for path in glob.glob(IPKernelApp.instance().ip + "-*"):
    os.remove(path)
    os.symlink(%r, path)
    swapped.append(os.path.basename(path))
print(len(swapped))
"""


async def test_sockets_swapped_for_links_never_lead_the_host_to_another_socket(
    host_unix_listener: tuple[Path, list[bytes]],
    isolated_backend: SandboxBackend,
    isolated_sandbox: Sandbox,
) -> None:
    host_socket, received = host_unix_listener
    swapped = await isolated_sandbox.run_cell(_SWAP_SOCKETS_CELL % str(host_socket), timeout_s=60)
    assert swapped.status == "ok", swapped.error
    assert int(stream_text(swapped.outputs)) >= 2  # shell and iopub at least
    # Each task of a run attaches anew: a new client, connecting by name.
    for _ in range(3):
        again = await isolated_backend.attach(isolated_sandbox.handle)
        try:
            result = await again.run_cell("print('still mine')", timeout_s=60)
        finally:
            await again.close()
        assert stream_text(result.outputs) == "still mine\n"
    # A forced restart starts a kernel on the same names, and connects again.
    swapped = await isolated_sandbox.run_cell(_SWAP_SOCKETS_CELL % str(host_socket), timeout_s=60)
    assert swapped.status == "ok", swapped.error
    stuck = await isolated_sandbox.run_cell(_IGNORE_SIGINT_FOREVER, timeout_s=0.5)
    assert stuck.status == "timeout" and stuck.state_lost
    after = await isolated_sandbox.run_cell("print('restarted')", timeout_s=60)
    assert stream_text(after.outputs) == "restarted\n"
    assert received == []


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
    # It runs as nobody when we are root: its folders must let nobody in.
    for folder in [tmp_path, *tmp_path.parents]:
        if folder.stat().st_uid == os.getuid():
            folder.chmod(folder.stat().st_mode | 0o011)
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
                    str(runtime_dir / "connection.json"),
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
    # It sees of its runtime folder only what it needs: its connection file (read-only), the
    # sockets' folder and its IPython folder; never the pid and handle files this side trusts,
    # nor the host's connection file (naming the sockets pinned where only the host writes).
    assert found[str(runtime_dir)] == "listed: ipc ipython kernel.json"
    assert found[str(runtime_dir.parent)] == f"listed: {runtime_dir.name}"
    assert found[str(runtime_dir / "kernel.pid")].startswith("refused")
    assert found[str(runtime_dir / "handle.json")].startswith("refused")
    assert found[str(runtime_dir / "connection.json")].startswith("refused")
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


async def test_a_memory_limit_too_small_to_start_a_kernel_says_so() -> None:
    config = LocalKernelConfig(memory_limit_bytes=16 << 20)
    labels = {**LABELS, "test": uuid.uuid4().hex}
    with pytest.raises(SandboxDiedError) as info:
        await LocalKernelSandbox.create(config, labels)
    assert "at start-up" in str(info.value)
    assert f"memory_limit_bytes={16 << 20} may be too little" in str(info.value)
    assert await LocalKernelSandbox.list_handles(config, labels) == []


_ALLOCATE = "import sys; hog = bytearray(int(sys.argv[1]) << 20); print('allocated')"


async def test_half_a_gib_starts_a_kernel_and_bounds_each_of_its_processes() -> None:
    box = await LocalKernelSandbox.create(LocalKernelConfig(memory_limit_bytes=512 << 20))
    try:
        bomb = await box.run_cell("hog = bytearray(1 << 30)", timeout_s=60)
        children = await box.run_cell(
            "import subprocess, sys\n"
            f"run = lambda mib: subprocess.run([sys.executable, '-c', {_ALLOCATE!r}, str(mib)],"
            " capture_output=True, text=True)\n"
            "print([run(mib).stdout.strip() or run(mib).stderr.strip().splitlines()[-1]"
            " for mib in (300, 300, 1024)])",
            timeout_s=120,
        )
    finally:
        await box.kill()
    assert bomb.error is not None and bomb.error.ename == "MemoryError"
    # The limit is each process's, not a total: two children of 300 MiB each fit, 1 GiB not.
    assert stream_text(children.outputs) == "['allocated', 'allocated', 'MemoryError']\n"


async def test_the_kernel_log_keeps_at_most_its_cap_of_what_a_cell_writes_to_fd_1() -> None:
    box = await LocalKernelSandbox.create(LocalKernelConfig())
    log = Path(box.handle.connection["runtime_dir"]) / "kernel.log"
    try:
        result = await box.run_cell(
            "import os\nchunk = b'x' * (1 << 20)\n"
            "for _ in range(96):\n    os.write(1, chunk)\n    os.write(2, chunk)\n"
            "print('done')",
            timeout_s=300,
        )
        assert result.status == "ok", result.error
        assert "done" in stream_text(result.outputs)
        size = log.stat().st_size
        tail = log.read_bytes()[-200:]
    finally:
        await box.kill()
    assert KERNEL_LOG_BYTES <= size <= KERNEL_LOG_BYTES + 200
    assert tail.endswith(b"kernel.log is full; the rest is not kept]\n")


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
        ("--ro-bind", "/proc/sys"),
        ("--tmpfs", "/dev/shm"),
        ("--tmpfs", "/tmp"),
        ("--tmpfs", SANDBOX_HOME),
        ("--ro-bind", "/usr"),
        ("--ro-bind", "/venv"),
        ("--ro-bind", "/run/k/connection.json"),
        ("--bind", "/tmp/work"),
        ("--bind", "/run/k/ipc"),
    ]
    assert ("--cap-drop", "ALL") in mounts and ("--remount-ro", "/") in mounts
    assert ("--uid", "0") in mounts and ("--remount-ro", "/dev") in mounts
    assert "--size" not in argv
    sized = bwrap_command("bwrap", SandboxView((), (), (), tmpfs_size_bytes=4096), ["x"])
    assert [sized[i + 1 : i + 4] for i, arg in enumerate(sized) if arg == "--size"] == [
        ["4096", "--tmpfs", folder] for folder in ("/dev/shm", "/tmp", SANDBOX_HOME)
    ]


def test_staged_command_mounts_every_bound_path_at_the_stage_and_drops_root() -> None:
    view = SandboxView(links=(), read_only=("/usr", "/root/venv"), writable=("/run/k/ipc",))
    argv = bwrap_command("/usr/bin/bwrap", view, ["python", "--bind", "/x"], seccomp_fd=9)
    assert argv[argv.index("--seccomp") + 1] == "9"
    staged = staged_command(argv, (1879048200, 1879048200), python="/py")
    if os.geteuid() != 0:
        assert staged == argv
        return
    assert staged[:4] == [
        "/py",
        "-I",
        "-S",
        str(Path(isolation.__file__).with_name("_drop_root.py")),
    ]
    spec = json.loads(staged[4])
    assert spec["sources"] == ["/proc/sys", "/usr", "/root/venv", "/run/k/ipc"]
    assert (spec["uid"], spec["gid"]) == (1879048200, 1879048200)
    stage = spec["stage"]
    # The same argv, each bound path replaced by its staged name; the command left alone.
    expected = [
        f"{stage}/{spec['sources'].index(arg)}"
        if arg in spec["sources"] and argv[index - 1] in {"--bind", "--ro-bind"}
        else arg
        for index, arg in enumerate(argv)
    ]
    assert spec["argv"] == expected
    assert spec["argv"][-3:] == ["python", "--bind", "/x"]


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
    probe = "ulimit -d; ulimit -S -t; ulimit -H -t; grep SigIgn /proc/self/status"
    argv = limited_command(["/bin/sh", "-c", probe], memory_limit_bytes=3 << 30, cpu_time_limit_s=7)
    done = subprocess.run(argv, capture_output=True, text=True, check=True)
    lines = done.stdout.split("\n")
    assert lines[:3] == [str(3 << 20), "7", "12"]
    # SIGINT (bit 2) ignored: an interrupt to the process group must not end bwrap.
    assert int(lines[3].split()[1], 16) & 0b10


_SYSCALL_CELL = """
import ctypes, json, socket
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
tried = {}
def errno_of(number, *args):
    ctypes.set_errno(0)
    done = libc.syscall(ctypes.c_long(number), *(ctypes.c_long(a) for a in args))
    return ctypes.get_errno() if done == -1 else 0
for name, number in %r.items():
    tried[name] = errno_of(number)
for family in [40, 17, 31, 0, (1 << 32) | 40]:  # VSOCK, PACKET, BLUETOOTH
    tried[f"socket({family})"] = errno_of(%d, family, socket.SOCK_STREAM, 0)
for family in [socket.AF_UNIX, socket.AF_INET, socket.AF_INET6, socket.AF_NETLINK]:
    kind = socket.SOCK_RAW if family == socket.AF_NETLINK else socket.SOCK_STREAM
    socket.socket(family, kind).close()
    tried[f"made {family}"] = 0
print(json.dumps(tried))
"""


def _syscall_numbers(names: Iterable[str]) -> dict[str, int]:
    """This architecture's syscall numbers, by name, from libseccomp."""
    lib = ctypes.CDLL(ctypes.util.find_library("seccomp") or "libseccomp.so.2")
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    numbers = {name: lib.seccomp_syscall_resolve_name(name.encode()) for name in names}
    return {name: number for name, number in numbers.items() if number >= 0}


async def test_the_seccomp_filter_refuses_its_calls_and_socket_families_but_inet_and_unix() -> None:
    refused = _syscall_numbers(SECCOMP_REFUSED)
    assert {"memfd_secret", "modify_ldt", "kcmp", "mbind", "move_pages"} <= set(refused)
    async with _created(LocalKernelBackend()) as box:
        cell = _SYSCALL_CELL % (refused, _syscall_numbers(["socket"])["socket"])
        result = await box.run_cell(cell, timeout_s=60)
    assert result.status == "ok", result.error
    tried = json.loads(stream_text(result.outputs))
    families = [socket.AF_UNIX, socket.AF_INET, socket.AF_INET6, socket.AF_NETLINK]
    assert tried == {
        **dict.fromkeys(refused, errno.EPERM),
        **{f"socket({f})": errno.EPERM for f in [40, 17, 31, 0, (1 << 32) | 40]},
        **{f"made {f}": 0 for f in families},
    }


async def test_a_syscall_of_another_abi_kills_the_kernel_not_a_thread() -> None:
    # An x32 number (bit 30) on x86_64: libseccomp's default killed the calling thread only,
    # and the cell never ended.
    if platform.machine() != "x86_64":
        pytest.skip("the x32 ABI is x86_64's")
    async with _created(LocalKernelBackend()) as box:
        code = "import ctypes; ctypes.CDLL(None).syscall(0x40000000 | 39)"  # x32 getpid
        with pytest.raises(SandboxDiedError) as info:
            await box.run_cell(code, timeout_s=60)
    assert info.value.signal == signal.SIGSYS, info.value


ALLOWED_SYSCALLS = ROOT / "tests" / "seccomp_allowed_x86_64.txt"


def test_what_the_seccomp_filter_still_allows_is_listed() -> None:
    # Every syscall of this architecture that the filter lets through unconditionally, as a
    # list a reviewer reads: a change to the filter shows here. clone, clone3, socket and
    # socketpair are allowed only in part (see seccomp_filter) and are not listed.
    if platform.machine() != "x86_64":
        pytest.skip("the list is x86_64's")
    lib = ctypes.CDLL(ctypes.util.find_library("seccomp") or "libseccomp.so.2")
    lib.seccomp_syscall_resolve_num_arch.restype = ctypes.c_char_p
    lib.seccomp_syscall_resolve_num_arch.argtypes = [ctypes.c_uint32, ctypes.c_int]
    native = 0  # SCMP_ARCH_NATIVE
    names = {lib.seccomp_syscall_resolve_num_arch(native, n) for n in range(1024)} - {None}
    partly = {"clone", "clone3", "socket", "socketpair"}
    allowed = sorted({name.decode() for name in names} - set(SECCOMP_REFUSED) - partly)
    assert allowed == ALLOWED_SYSCALLS.read_text().split()


_HOLD_INOTIFY_CELL = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
held = []
while (fd := libc.inotify_init1(0)) >= 0:
    held.append(fd)
print(len(held), ctypes.get_errno())
"""


@pytest.fixture(params=["local", pytest.param("docker", marks=pytest.mark.docker)])
def uid_backend(request: pytest.FixtureRequest) -> SandboxBackend:
    """Each backend whose sandboxes take a host uid of their own."""
    return _backend(request)


def _host_uid(sandbox: Sandbox) -> int:
    if sandbox.handle.backend == "docker":
        return int(sandbox.handle.connection["user"].split(":")[0])
    return int(sandbox.handle.connection["uid"])


@pytest.mark.skipif(os.geteuid() != 0, reason="only root runs sandboxes as uids of their own")
async def test_two_live_sandboxes_have_their_own_uids_and_per_uid_limits(
    uid_backend: SandboxBackend,
) -> None:
    # One sandbox takes every inotify instance its uid may have (128 here): another sandbox,
    # of another uid, can still make one. All sandboxes were uid 65534 before, and it could not.
    async with _created(uid_backend) as first, _created(uid_backend) as second:
        uids = [_host_uid(box) for box in (first, second)]
        first_uid, last_uid = LocalKernelConfig().uid_range
        assert all(first_uid <= uid <= last_uid for uid in uids)
        assert uids[0] != uids[1]
        hoarded = await first.run_cell(_HOLD_INOTIFY_CELL, timeout_s=60)
        count, error = map(int, stream_text(hoarded.outputs).split())
        assert error == errno.EMFILE and count > 0
        made = await second.run_cell(
            "import ctypes; print(ctypes.CDLL(None).inotify_init1(0) >= 0)", timeout_s=60
        )
        assert stream_text(made.outputs) == "True\n"
    # Released: no claim holds either sandbox's runtime folder. (Their uids may be claimed again
    # at once by another process's sandbox: claims are machine-wide, the lowest free uid first.)
    runtime_dirs = {box.handle.connection["runtime_dir"] for box in (first, second)}
    assert not runtime_dirs & set(uids_module.claimed_uids().values())


@pytest.mark.skipif(os.geteuid() != 0, reason="only root runs sandboxes as uids of their own")
async def test_a_uid_range_in_use_refuses_a_sandbox_until_its_uid_is_released() -> None:
    # A range of one uid, of the test's own: a second live sandbox cannot have it.
    config = LocalKernelConfig(uid_range=(0x7100_0000, 0x7100_0000))
    box = await LocalKernelSandbox.create(config)
    try:
        started = await box.run_cell("import subprocess; subprocess.Popen(['sleep', '600'])")
        assert started.status == "ok"
        with pytest.raises(SandboxUnavailableError, match="PREFECT_SANDBOX_UID_RANGE"):
            await LocalKernelSandbox.create(config)
    finally:
        await box.kill()
    assert uids_module.uid_processes(0x7100_0000) == []
    again = await LocalKernelSandbox.create(config)
    await again.kill()


_FORK_CELL = """
import os, time
children = 0
try:
    for _ in range(10_000):
        if os.fork() == 0:
            time.sleep(600)
            os._exit(0)
        children += 1
except OSError as exc:
    print(children, exc.errno)
"""

_FILL_MEMORY_FOLDERS_CELL = """
import os
chunk = b"x" * (1 << 20)
for folder in ["/dev/shm", "/tmp", os.environ["HOME"]]:
    with open(os.path.join(folder, "fill"), "wb") as file:
        for _ in range(1 << 14):
            file.write(chunk)
            file.flush()
"""

needs_cgroups = pytest.mark.skipif(
    os.geteuid() != 0 or not Path("/sys/fs/cgroup/pids/cgroup.procs").exists(),
    reason="cgroups are made by root, and these tests read cgroup v1's pids and memory",
)


@needs_cgroups
async def test_a_fork_bomb_is_stopped_at_the_sandboxs_process_cap() -> None:
    config = LocalKernelConfig(max_processes=64)
    box = await LocalKernelSandbox.create(config)
    try:
        [memory, pids, _] = box.handle.connection["cgroup"]["folders"]
        assert box.handle.limits["processes"] == (
            "whole sandbox (cgroup v1): 64 processes and threads"
        )
        result = await box.run_cell(_FORK_CELL, timeout_s=120)
        children, error = map(int, stream_text(result.outputs).split())
        assert error == errno.EAGAIN and 0 < children < 64
        # The host counts no more of the sandbox's processes than its cap.
        assert int(Path(pids, "pids.current").read_text()) <= 64
    finally:
        await box.kill()
    assert not Path(pids).exists() and not Path(memory).exists()


@needs_cgroups
@pytest.mark.usefixtures("prefect_api")
async def test_filling_the_memory_folders_ends_at_the_sandboxs_memory_limit(
    tmp_path: Path,
) -> None:
    from prefect_sandbox.flows import PipelineFailedError, amodeling_pipeline

    # 400 MiB for all: each of /dev/shm, /tmp and HOME may hold that much, and they are
    # filled in turn, so only the sandbox's memory as a whole stops the cell (before: 400 MiB
    # each, 1.2 GB of host memory).
    limit = 400 << 20
    with pytest.raises(PipelineFailedError) as failed:
        await amodeling_pipeline(
            stages={"fill": [_FILL_MEMORY_FOLDERS_CELL]},
            backend=LocalKernelBackend(memory_limit_bytes=limit),
            storage=str(tmp_path / "out"),
        )
    result = failed.value.result
    assert result is not None and result.status == "failed"
    assert result.error is not None and "the sandbox used all of its memory" in result.error
    summary = json.loads((Path(result.output_dir) / "summary.json").read_text())
    assert summary["sandbox_limits"] == {
        "memory": f"whole sandbox (cgroup v1): {limit} bytes; each process (RLIMIT_DATA): "
        f"{limit} bytes",
        "processes": "whole sandbox (cgroup v1): 4096 processes and threads",
        "tmpfs": f"each of /tmp, /dev/shm, HOME: {limit} bytes",
    }
