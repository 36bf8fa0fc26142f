"""Contract (H22): files round-trip exactly; paths that leave the working directory are refused."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from prefect_sandbox.sandbox.base import Sandbox
from prefect_sandbox.sandbox.errors import FileTransferError, UnsafePathError
from tests.conftest import stream_text
from tests.contract.conftest import cannot


@pytest.mark.shares_sandbox
async def test_odd_names_round_trip(sandbox: Sandbox, tmp_path: Path) -> None:
    names = ["my data (v2).csv", "données_年.csv", "empty.bin"]
    for name in names:
        content = b"" if name == "empty.bin" else name.encode() * 100
        (tmp_path / name).write_bytes(content)
        await sandbox.upload(tmp_path / name, f"inputs/{name}")
    listing = await sandbox.run_cell("import os; print(sorted(os.listdir('inputs')))")
    assert stream_text(listing.outputs) == f"{sorted(names)}\n"
    files = await sandbox.list_files("inputs/*")
    assert [(f.path, f.size_bytes) for f in files] == sorted(
        (f"inputs/{n}", (tmp_path / n).stat().st_size) for n in names
    )
    for name in names:
        back = tmp_path / "back" / name
        size = await sandbox.download(f"inputs/{name}", back)
        assert size == (tmp_path / name).stat().st_size
        assert hashlib.sha256(back.read_bytes()).digest() == (
            hashlib.sha256((tmp_path / name).read_bytes()).digest()
        )


@pytest.mark.shares_sandbox
async def test_paths_that_leave_the_workdir_are_refused(sandbox: Sandbox, tmp_path: Path) -> None:
    source = tmp_path / "data.txt"
    source.write_text("x")
    await sandbox.run_cell("import os; os.symlink('/etc/passwd', 'link.txt')")
    for bad in ["../escape.txt", "/etc/passwd", "a/../../x"]:
        with pytest.raises(UnsafePathError):
            await sandbox.upload(source, bad)
        with pytest.raises(UnsafePathError):
            await sandbox.download(bad, tmp_path / "never")
    with pytest.raises(UnsafePathError, match=r"link\.txt"):
        await sandbox.download("link.txt", tmp_path / "never")
    with pytest.raises(UnsafePathError):
        await sandbox.list_files("../*")
    assert not (tmp_path / "never").exists()
    with pytest.raises(FileTransferError, match=r"missing\.txt"):
        await sandbox.download("missing.txt", tmp_path / "never")


async def test_file_written_by_a_cell_downloads_byte_exact(
    sandbox: Sandbox, tmp_path: Path
) -> None:
    result = await sandbox.run_cell(
        "import matplotlib; matplotlib.use('Agg'); import matplotlib.pyplot as plt; "
        "plt.plot([1, 2]); plt.savefig('saved.png')\n"
        "import hashlib; print(hashlib.sha256(open('saved.png', 'rb').read()).hexdigest())"
    )
    shown = [o for o in result.outputs if "image/png" in o.get("data", {})]
    assert len(shown) == (1 if cannot(sandbox, "quiet_image_save") else 0)
    await sandbox.download("saved.png", tmp_path / "saved.png")
    digest = hashlib.sha256((tmp_path / "saved.png").read_bytes()).hexdigest()
    assert stream_text(result.outputs) == f"{digest}\n"


async def test_a_removed_working_directory_lists_no_files(sandbox: Sandbox) -> None:
    # A cell may remove its own working directory (an isolated kernel's cannot go: it is a
    # mount point, so only what is in it does); nothing is left to list, on any backend.
    removed = await sandbox.run_cell(
        "import os, shutil\n"
        "open('left.txt', 'w').write('x')\n"
        "shutil.rmtree(os.getcwd(), ignore_errors=True)\n"
        "print(os.path.exists('left.txt'))"
    )
    assert stream_text(removed.outputs) == "False\n"
    assert await sandbox.list_files() == []
    assert await sandbox.list_files("*.png") == []
