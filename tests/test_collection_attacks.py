"""Collecting artifacts while the cell attacks the host through its working directory (issue 18).

On the backends whose working directory is a folder of this machine (a local kernel, a Docker
container's bind mount) the kernel is alive while the host collects, so a cell can swap its
artifacts for links to host files, FIFOs or devices in a loop from a thread. Written as an
attacker would: the swapping never stops until the sandbox is killed.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
from pathlib import Path

import pytest

from prefect_sandbox.blocks.base import SandboxBackend
from prefect_sandbox.blocks.docker import DockerBackend
from prefect_sandbox.blocks.local import LocalKernelBackend
from prefect_sandbox.flows.pipeline import amodeling_pipeline

pytestmark = pytest.mark.usefixtures("prefect_api")

RACE_ARTIFACTS = 240
RACE_RUNS = 5
"""Pipelines a slow download race runs; the suite's twin runs one."""

# Each artifact is exchanged (renameat2 RENAME_EXCHANGE: atomic) with a link to a host file,
# a link to a host folder or a FIFO, over and over from a thread, for as long as the kernel
# lives: through the listing, the opening and the copying of every artifact.
SWAPPER = """
import ctypes, os, threading
libc = ctypes.CDLL(None, use_errno=True)
AT_FDCWD, RENAME_EXCHANGE = -100, 2
pairs = []
for i in range({count}):
    name, decoy = f"art{{i:03}}.txt", f"decoy{{i:03}}"
    open(name, "w").write("inside")
    if i % 4 == 0:
        os.symlink({secret!r}, decoy)
    elif i % 4 == 1:
        os.symlink("/proc/self/environ", decoy)
    elif i % 4 == 2:
        os.symlink({folder!r}, decoy)
    else:
        os.mkfifo(decoy)
    pairs.append((name.encode(), decoy.encode()))

def swap():
    while True:
        for name, decoy in pairs:
            libc.renameat2(AT_FDCWD, name, AT_FDCWD, decoy, RENAME_EXCHANGE)

threading.Thread(target=swap, daemon=True).start()
"""


def _backend(request: pytest.FixtureRequest, kind: str) -> SandboxBackend:
    if kind == "docker":
        return DockerBackend(image=request.getfixturevalue("docker_image"))
    return LocalKernelBackend(isolation="none" if kind == "local-none" else "bubblewrap")


async def _download_race(
    kind: str,
    runs: int,
    request: pytest.FixtureRequest,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``runs`` pipelines each collect `RACE_ARTIFACTS` artifacts that the cell swaps for links
    to host files, links to host folders and FIFOs all along; none stores a host file."""
    caplog.set_level(logging.WARNING)
    host = tmp_path / "host"
    host.mkdir()
    token = secrets.token_hex(16)
    secret = host / "id_rsa"
    secret.write_text(f"host secret {token}\n")
    (host / "prefect.db").write_text(token)
    code = SWAPPER.format(count=RACE_ARTIFACTS, secret=str(secret), folder=str(host))
    backend = _backend(request, kind)
    stored_art = refused = 0
    for attempt in range(runs):
        caplog.clear()
        result = await amodeling_pipeline(
            stages={"swap": [code]},
            artifacts=["art*.txt"],
            backend=backend,
            storage=str(tmp_path / f"out{attempt}"),
        )
        assert result.status == "completed", result.error
        run = Path(result.output_dir)
        summary = json.loads((run / "summary.json").read_text())
        assert summary["status"] == "completed"
        for artifact in result.artifacts:
            if artifact.path.startswith("art"):
                stored_art += 1
                assert (run / artifact.path).read_text() == "inside", artifact.path
        stored = {p.relative_to(run).as_posix() for p in run.rglob("*") if not p.is_dir()}
        assert stored == {a.path for a in result.artifacts} | {"summary.json"}
        assert all(not p.is_symlink() for p in run.rglob("*"))
        assert token not in caplog.text
        refused += caplog.text.count("Artifact refused")
    # The race ran through the downloads: some artifacts were caught swapped, and refused,
    # and the others stored; the host's files are as they were.
    assert refused > 0 and stored_art > 0
    assert secret.read_text() == f"host secret {token}\n"
    assert sorted(p.name for p in host.iterdir()) == ["id_rsa", "prefect.db"]


RACING = pytest.mark.parametrize(
    "kind", ["local", pytest.param("docker", marks=pytest.mark.docker)]
)


@pytest.mark.timeout(300)
@RACING
async def test_a_download_race_of_240_swapped_artifacts_in_one_run_stores_no_host_file(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    await _download_race(kind, 1, request, tmp_path, caplog)


@pytest.mark.slow
@pytest.mark.timeout(600)
@RACING
async def test_a_download_race_of_240_swapped_artifacts_stores_no_host_file(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The suite's one-run twin above races on every submission; ./dev.sh bench runs five.
    await _download_race(kind, RACE_RUNS, request, tmp_path, caplog)


SPECIAL_FILES = """
import os, socket, stat
open("ok.txt", "w").write("fine")
os.mkfifo("pipe.fifo")
listener = socket.socket(socket.AF_UNIX)
listener.bind("sock.sock")
with open("sparse.bin", "wb") as sparse:
    sparse.truncate(300 << 20)
    sparse.write(b"head")
open("big.bin", "wb").write(b"x" * 5000)
os.symlink("/etc", "rootlink")
if {device}:
    os.mknod("dev.null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "kind", ["local", "local-none", pytest.param("docker", marks=pytest.mark.docker)]
)
async def test_fifo_socket_device_sparse_big_and_folder_link_each_leave_a_warning(
    kind: str,
    request: pytest.FixtureRequest,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PREFECT_SANDBOX_MAX_ARTIFACT_BYTES", "4096")
    caplog.set_level(logging.WARNING)
    # A device node needs CAP_MKNOD: only an unisolated kernel of root has it.
    device = kind == "local-none" and os.geteuid() == 0
    result = await amodeling_pipeline(
        stages={"make": [SPECIAL_FILES.format(device=device)]},
        artifacts=["*", "rootlink/*"],
        backend=_backend(request, kind),
        storage=str(tmp_path / "out"),
    )
    assert result.status == "completed", result.error
    run = Path(result.output_dir)
    assert sorted(a.path for a in result.artifacts) == ["executed.ipynb", "ok.txt"]
    assert sorted(p.name for p in run.iterdir()) == ["executed.ipynb", "ok.txt", "summary.json"]
    assert json.loads((run / "summary.json").read_text())["status"] == "completed"
    expected = {
        "'pipe.fifo' is not collected: it is a FIFO",
        "'sock.sock' is not collected: it is a socket",
        "'sparse.bin' is not collected: it is sparse",
        "'big.bin' is not collected: it is over the cap of 4096 bytes",
        "path 'rootlink' resolves outside the working directory",
        "Artifact pattern 'rootlink/*' matched no file",
    }
    if device:
        expected.add("'dev.null' is not collected: it is a character device")
    for warning in expected:
        assert warning in caplog.text
    # The folder link is never entered: none of the host folder's names is seen.
    assert "passwd" not in caplog.text and "hostname" not in caplog.text


async def test_a_run_past_the_total_cap_stores_what_fits_and_warns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Many distinct files, each under the per-file cap, are bounded by the run's total.
    monkeypatch.setenv("PREFECT_SANDBOX_MAX_TOTAL_ARTIFACT_BYTES", "2500")
    caplog.set_level(logging.WARNING)
    cell = "for name, size in [('a', 1000), ('b', 1000), ('c', 1000), ('d', 100)]:\n"
    cell += "    open(f'{name}.bin', 'wb').write(b'x' * size)"
    result = await amodeling_pipeline(
        stages={"setup": [cell]},
        artifacts=["*.bin"],
        backend=LocalKernelBackend(),
        storage=str(tmp_path / "out"),
    )
    assert result.status == "completed"
    assert sorted(a.path for a in result.artifacts) == ["a.bin", "b.bin", "d.bin", "executed.ipynb"]
    assert (
        "Artifact 'c.bin' skipped: its 1000 bytes are past the run's total cap "
        "(max_total_artifact_bytes, 500 bytes left)"
    ) in caplog.text
