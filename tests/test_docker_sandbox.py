"""The Docker backend beyond the contract suite: the container's confinement, finding and
removing containers by label, reaching one from another process, the memory limit, files that
resolve inside the container, and the flows and CLI on it."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import docker
import pytest

from prefect_sandbox import DockerBackend
from prefect_sandbox.flows import PipelineFailedError, amodeling_pipeline, arun_notebook
from prefect_sandbox.sandbox.backends.kernel.docker import DockerSandbox
from prefect_sandbox.sandbox.errors import (
    CellTimeoutError,
    SandboxDiedError,
    SandboxError,
    SandboxNotFoundError,
    SandboxUnavailableError,
    UnsafePathError,
)
from prefect_sandbox.sandbox.labels import FLOW_RUN_ID_LABEL
from tests.conftest import ROOT, stream_text, unpickled_without_vendors

EXAMPLE = ROOT / "examples" / "co2"
ARTIFACTS = ["figures/*.png", "forecast.csv", "metrics.json"]


def _labels() -> dict[str, str]:
    return {"prefect-sandbox": "true", "test-id": uuid.uuid4().hex}


@pytest.fixture
def backend(docker_image: str) -> DockerBackend:
    return DockerBackend(image=docker_image, interrupt_grace_s=2.0)


@pytest.fixture
async def sandbox(backend: DockerBackend) -> AsyncIterator[DockerSandbox]:
    box = await backend.create(_labels())
    try:
        yield box
    finally:
        await box.kill()


async def test_container_is_confined_as_configured(
    docker_image: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PREFECT_SANDBOX_TEST_SECRET", "host-only")
    backend = DockerBackend(
        image=docker_image, env={"ALLOWED": "yes"}, cpus=1.5, memory_limit_bytes=512 << 20
    )
    labels = _labels()
    box = await backend.create(labels)
    try:
        container = docker.from_env().containers.get(box.handle.connection["container"])
        host_config = container.attrs["HostConfig"]
        assert host_config["NetworkMode"] == "none"
        assert host_config["ReadonlyRootfs"] is True
        assert host_config["CapDrop"] == ["ALL"]
        assert host_config["SecurityOpt"] == ["no-new-privileges"]
        assert (host_config["Memory"], host_config["MemorySwap"]) == (512 << 20,) * 2
        assert host_config["NanoCpus"] == 1_500_000_000
        assert host_config["PidsLimit"] == 512
        assert labels.items() <= container.labels.items()
        result = await box.run_cell(
            "import os, json\n"
            "print(json.dumps({'uid': os.getuid(), 'cwd': os.getcwd(), 'env': sorted(os.environ)}))"
        )
        seen = json.loads(stream_text(result.outputs))
        assert seen["uid"] != 0 and seen["cwd"] == "/work"
        assert "ALLOWED" in seen["env"] and "PREFECT_SANDBOX_TEST_SECRET" not in seen["env"]
        writes = await box.run_cell(
            "import errno, pathlib\n"
            "for path in ['/etc/escape', '/opt/kernel/escape', '/tmp/ok', '/work/ok']:\n"
            "    try:\n"
            "        pathlib.Path(path).write_text('x'); print(path, 'written')\n"
            "    except OSError as exc:\n"
            "        print(path, errno.errorcode[exc.errno])"
        )
        assert stream_text(writes.outputs).splitlines() == [
            "/etc/escape EROFS",
            "/opt/kernel/escape EROFS",
            "/tmp/ok written",
            "/work/ok written",
        ]
        assert [f.path for f in await box.list_files()] == ["ok"]
    finally:
        await box.kill()


async def test_no_connection_reaches_a_listener_on_the_host(sandbox: DockerSandbox) -> None:
    with socket.create_server(("0.0.0.0", 0)) as listener:
        port = listener.getsockname()[1]
        result = await sandbox.run_cell(
            "import socket\n"
            f"for host in ['127.0.0.1', '172.17.0.1', 'host.docker.internal']:\n"
            "    try:\n"
            f"        socket.create_connection((host, {port}), timeout=2).close(); print('open')\n"
            "    except OSError as exc:\n"
            "        print(type(exc).__name__)"
        )
    assert "open" not in stream_text(result.outputs).split()
    assert len(stream_text(result.outputs).split()) == 3


async def test_kill_removes_the_container_and_its_folders(backend: DockerBackend) -> None:
    mine, other = _labels(), _labels()
    box = await backend.create(mine)
    neighbour = await backend.create(other)
    try:
        assert [h.sandbox_id for h in await backend.list_sandboxes(mine)] == [box.handle.sandbox_id]
        runtime_dir = Path(box.handle.connection["runtime_dir"])
        host_workdir = Path(box.handle.connection["host_workdir"])
        assert runtime_dir.is_dir() and host_workdir.is_dir()
        assert oct(runtime_dir.stat().st_mode & 0o777) == "0o700"
        assert await box.kill() is True
        with pytest.raises(docker.errors.NotFound):
            docker.from_env().containers.get(box.handle.connection["container"])
        assert not runtime_dir.exists() and not host_workdir.exists()
        assert await box.kill() is False
        assert await backend.list_sandboxes(mine) == []
        with pytest.raises(SandboxNotFoundError):
            await backend.attach(box.handle)
        survivor = await backend.attach(neighbour.handle)
        assert stream_text((await survivor.run_cell("print(1)")).outputs) == "1\n"
        await survivor.close()
    finally:
        await neighbour.kill()


async def test_another_process_attaches_with_state_intact(
    backend: DockerBackend, sandbox: DockerSandbox
) -> None:
    await sandbox.run_cell("answer = 42")
    await sandbox.close()
    script = (
        "import asyncio, json, sys\n"
        "from prefect_sandbox import DockerBackend\n"
        "from prefect_sandbox.sandbox.base import SandboxHandle\n"
        "async def main():\n"
        "    backend = DockerBackend.model_validate_json(sys.argv[1])\n"
        "    box = await backend.attach(SandboxHandle.model_validate_json(sys.argv[2]))\n"
        "    result = await box.run_cell('print(answer)')\n"
        "    await box.close()\n"
        "    print(result.outputs[0]['text'], end='')\n"
        "asyncio.run(main())\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, backend.model_dump_json(), sandbox.handle.model_dump_json()],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == "42\n"


async def test_memory_limit_kills_the_kernel_and_says_so(docker_image: str) -> None:
    backend = DockerBackend(image=docker_image, memory_limit_bytes=256 << 20)
    box = await backend.create(_labels())
    try:
        with pytest.raises(SandboxDiedError) as info:
            await box.run_cell("hog = b'x' * (1 << 30)", timeout_s=60)
        assert "out of memory" in str(info.value)
        assert info.value.signal == 9
    finally:
        await box.kill()


async def test_symlinks_resolve_inside_the_container_only(
    sandbox: DockerSandbox, tmp_path: Path
) -> None:
    await sandbox.run_cell(
        "import os\n"
        "open('real.txt', 'w').write('inside')\n"
        "os.symlink('/work/real.txt', 'alias.txt')\n"
        "os.symlink('/etc', 'etc')\n"
        "os.symlink('/root', 'home')"
    )
    assert await sandbox.download("alias.txt", tmp_path / "alias.txt") == 6
    assert (tmp_path / "alias.txt").read_text() == "inside"
    # The host's /etc and /root are never listed or written through the sandbox's links.
    assert await sandbox.list_files("etc/*") == []
    assert await sandbox.list_files("home/**/*") == []
    # Links are listed as found, as on a local kernel; those that lead out are refused.
    assert [f.path for f in await sandbox.list_files()] == ["alias.txt", "etc", "home", "real.txt"]
    for link in ["etc", "home"]:
        with pytest.raises(UnsafePathError, match=link):
            await sandbox.download(link, tmp_path / link)
        assert not (tmp_path / link).exists()
    source = tmp_path / "payload"
    source.write_text("x")
    for dest in ["etc/payload", "home/payload"]:
        with pytest.raises(UnsafePathError):
            await sandbox.upload(source, dest)
    assert not Path("/etc/payload").exists()
    await sandbox.upload(source, "deep/er/payload")
    result = await sandbox.run_cell(
        "import os; print(open('deep/er/payload').read(), os.stat('deep/er').st_uid == os.getuid())"
    )
    assert stream_text(result.outputs) == "x True\n"


async def test_crash_hook_finds_and_removes_the_runs_containers(
    backend: DockerBackend, docker_image: str
) -> None:
    from prefect.client.schemas.objects import FlowRun
    from prefect.states import Crashed

    from prefect_sandbox.flows.hooks import kill_run_sandboxes
    from prefect_sandbox.sandbox.labels import flow_run_labels

    run_id = uuid.uuid4()
    box = await backend.create(flow_run_labels(str(run_id), "crashing-run"))
    # The kernel has died already: the hook removes exited containers too.
    with pytest.raises(SandboxDiedError):
        await box.run_cell("import os; os._exit(1)")
    flow_run = FlowRun(
        id=run_id,
        name="crashing-run",
        flow_id=uuid.uuid4(),
        parameters={"backend": backend.model_dump(mode="json")},
    )
    await box.close()
    await kill_run_sandboxes(None, flow_run, Crashed())  # type: ignore[arg-type]
    assert await backend.list_sandboxes({FLOW_RUN_ID_LABEL: str(run_id)}) == []
    assert not Path(box.handle.connection["runtime_dir"]).exists()


async def test_a_large_file_round_trips_byte_exact(sandbox: DockerSandbox, tmp_path: Path) -> None:
    source = tmp_path / "big.bin"
    source.write_bytes(os.urandom(48 << 20))
    digest = hashlib.sha256(source.read_bytes()).hexdigest()
    await sandbox.upload(source, "data/big.bin")
    seen = await sandbox.run_cell(
        "import hashlib; print(hashlib.sha256(open('data/big.bin', 'rb').read()).hexdigest())"
    )
    assert stream_text(seen.outputs) == f"{digest}\n"
    assert await sandbox.download("data/big.bin", tmp_path / "back.bin") == 48 << 20
    assert hashlib.sha256((tmp_path / "back.bin").read_bytes()).hexdigest() == digest


@pytest.mark.usefixtures("prefect_api")
async def test_pipelines_leave_no_container_ok_failed_or_timed_out(
    backend: DockerBackend, tmp_path: Path
) -> None:
    ok = await amodeling_pipeline(
        stages={"only": ["x = 41", "print(x + 1)"]}, backend=backend, storage=str(tmp_path)
    )
    summary = json.loads((Path(ok.output_dir) / "summary.json").read_text())
    run_ids = [summary["flow_run_id"]]
    with pytest.raises(PipelineFailedError) as timed_out:
        await amodeling_pipeline(
            stages={"spin": ["while True: pass"]},
            backend=backend,
            storage=str(tmp_path),
            cell_timeout_s=0.5,
        )
    assert isinstance(timed_out.value.__cause__, CellTimeoutError)
    failed_dir = Path(timed_out.value.output_dir or "")
    run_ids.append(json.loads((failed_dir / "summary.json").read_text())["flow_run_id"])
    for run_id in run_ids:
        assert await backend.list_sandboxes({FLOW_RUN_ID_LABEL: run_id}) == []


def _api_env() -> dict[str, str]:
    from prefect.settings import PREFECT_API_URL

    return {**os.environ, "PREFECT_API_URL": str(PREFECT_API_URL.value())}


@pytest.mark.usefixtures("prefect_api")
async def test_main_job_through_the_cli_on_docker_gives_the_local_metrics(
    docker_image: str, tmp_path: Path
) -> None:
    args = [str(EXAMPLE / "forecast.ipynb"), "--input", str(EXAMPLE / "co2.csv"), "--out", "OUT"]
    args += ["--backend", "docker", "--docker-image", docker_image]
    for pattern in ARTIFACTS:
        args += ["--artifact", pattern]
    done = subprocess.run(
        [sys.executable, "-m", "prefect_sandbox.cli", "run", *args],
        env=_api_env(),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (docker_dir,) = (tmp_path / "OUT").iterdir()
    local = await arun_notebook(
        notebook=str(EXAMPLE / "forecast.ipynb"),
        inputs=[str(EXAMPLE / "co2.csv")],
        artifacts=ARTIFACTS,
        storage=str(tmp_path / "LOCAL"),
    )
    local_dir = Path(local.output_dir)
    metrics = json.loads((docker_dir / "metrics.json").read_text())
    assert metrics == json.loads((local_dir / "metrics.json").read_text())
    assert 0 < metrics["mae_ppm"] < 2
    figures = sorted(p.name for p in (docker_dir / "figures").glob("*.png"))
    assert len(figures) >= 2
    assert figures == sorted(p.name for p in (local_dir / "figures").glob("*.png"))
    summary = json.loads((docker_dir / "summary.json").read_text())
    assert all(stage["status"] == "ok" for stage in summary["stages"])
    backend = DockerBackend(image=docker_image)
    assert await backend.list_sandboxes({FLOW_RUN_ID_LABEL: summary["flow_run_id"]}) == []


def test_cli_backend_docker_needs_an_image_or_a_block(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from prefect_sandbox.cli import main

    notebook = str(EXAMPLE / "forecast.ipynb")
    assert main(["run", notebook, "--backend", "docker", "--out", str(tmp_path)]) == 2
    assert "--docker-image" in capsys.readouterr().err
    assert main(["run", notebook, "--docker-image", "x", "--out", str(tmp_path)]) == 2
    assert "--backend docker" in capsys.readouterr().err


async def test_dockers_errors_cross_a_dask_process_boundary_without_the_sdk(
    docker_image: str, dask_pickling: None
) -> None:
    from distributed.core import error_message

    # The docker SDK's errors for an image it cannot find (nor pull, offline) hold the
    # daemon's HTTP response (requests'); a client that reaches no daemon raises requests'
    # and urllib3's errors.
    missing = DockerBackend(image=f"{docker_image}-not-built-{uuid.uuid4().hex[:8]}")
    unreachable = DockerBackend(image=docker_image, docker_host="unix:///nonexistent/docker.sock")
    for backend in (missing, unreachable):
        with pytest.raises(SandboxError) as info:
            await backend.create(_labels())
        blob = error_message(info.value)["exception"].data
        chain = unpickled_without_vendors(blob)
        assert chain[0] == f"prefect_sandbox.sandbox.errors.{type(info.value).__name__}"
        assert set(chain[1:]) == {"prefect_sandbox.sandbox.errors.ForeignError"}
    assert isinstance(info.value, SandboxUnavailableError)
