"""Staging folders: a SIGKILLed process's is removed by the next run and by the reaper, and only
folders whose owning process is gone are."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from prefect_sandbox.blocks import LocalKernelBackend
from prefect_sandbox.flows import amodeling_pipeline
from prefect_sandbox.flows.reaper import areap_sandboxes
from prefect_sandbox.flows.staging import (
    STAGING_PREFIX,
    orphaned_staging_dirs,
    remove_orphaned_staging_dirs,
    staging_dir,
)
from tests.conftest import ROOT

_HOLD = """
import sys, time
from prefect_sandbox.flows.staging import staging_dir
with staging_dir() as path:
    (path / "inputs.csv").write_text("a,b")
    print(path, flush=True)
    time.sleep(600)
"""


class Holder:
    """A process holding a staging folder in ``root`` until it is killed."""

    def __init__(self, root: Path) -> None:
        env = {**os.environ, "TMPDIR": str(root), "PYTHONPATH": str(ROOT)}
        self.process = subprocess.Popen(
            [sys.executable, "-c", _HOLD], env=env, stdout=subprocess.PIPE, text=True
        )
        assert self.process.stdout is not None
        self.path = Path(self.process.stdout.readline().strip())
        assert self.path.is_dir() and self.path.parent == root

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()
        assert self.process.stdout is not None
        self.process.stdout.close()


@pytest.fixture
def root(short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """This process's temporary folder for the test (``tempfile`` caches it), short enough for
    local kernels' IPC socket paths."""
    monkeypatch.setattr(tempfile, "tempdir", str(short_tmp))
    yield short_tmp


def test_only_folders_whose_owner_is_gone_are_orphans(root: Path) -> None:
    killed, alive = Holder(root), Holder(root)
    try:
        killed.kill()
        namespace = os.stat("/proc/self/ns/pid").st_ino
        # A live process's pid with another start time: the pid was reused, the owner is gone.
        reused = root / f"{STAGING_PREFIX}ns{namespace}-{alive.process.pid}-1-abcd"
        reused.mkdir()
        unrelated = root / f"{STAGING_PREFIX}notours"
        unrelated.mkdir()
        # A process of another pid namespace (a container sharing the folder): not judged.
        elsewhere = root / f"{STAGING_PREFIX}ns{namespace + 1}-{killed.process.pid}-1-abcd"
        elsewhere.mkdir()
        with staging_dir() as own:
            assert orphaned_staging_dirs() == sorted([killed.path, reused])
            assert remove_orphaned_staging_dirs() == sorted([killed.path, reused])
            assert own.is_dir() and alive.path.is_dir() and unrelated.is_dir()
            assert elsewhere.is_dir()
            assert not killed.path.exists() and not reused.exists()
        assert not own.exists()
        assert orphaned_staging_dirs() == []
    finally:
        alive.kill()
    assert orphaned_staging_dirs() == [alive.path]


@pytest.mark.usefixtures("prefect_api")
async def test_the_next_run_and_the_reaper_remove_a_sigkilled_process_folder(
    root: Path, tmp_path: Path
) -> None:
    first = Holder(root)
    first.kill()
    result = await amodeling_pipeline(
        stages={"one": ["print('ok')"]},
        backend=LocalKernelBackend(isolation="none"),
        storage=str(tmp_path / "out"),
    )
    assert result.status == "completed"
    assert not first.path.exists()
    # The run removed its own on the way out, too.
    assert [p for p in root.iterdir() if p.name.startswith(STAGING_PREFIX)] == []
    second = Holder(root)
    second.kill()
    dry = await areap_sandboxes(backends=[LocalKernelBackend()], dry_run=True)
    assert second.path.is_dir() and dry == []
    await areap_sandboxes(backends=[LocalKernelBackend()])
    assert not second.path.exists()
