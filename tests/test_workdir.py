"""Reading a working directory that a sandbox may be changing
(`prefect_sandbox.sandbox.backends.kernel.workdir`), and the pure rules of which files a
pattern names, on plain folders of this machine."""

from __future__ import annotations

import contextlib
import io
import json
import os
import socket
import subprocess
import sys
from pathlib import Path, PurePosixPath

import pytest

from prefect_sandbox.sandbox.backends.kernel.workdir import MAX_LINK_HOPS, copy_out, list_workdir
from prefect_sandbox.sandbox.base import RemoteFile
from prefect_sandbox.sandbox.errors import FileTransferError, UnsafePathError
from prefect_sandbox.sandbox.kernel_side import run_code, source
from prefect_sandbox.sandbox.paths import (
    check_size,
    is_utf8,
    matching_files,
    shown_path,
)

SANDBOX_ROOT = PurePosixPath("/work")


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A working directory as a container sees it at ``/work``, with a host secret beside it."""
    work = tmp_path / "work"
    (work / "sub").mkdir(parents=True)
    (work / "real.txt").write_text("inside")
    (work / "sub" / "deep.txt").write_text("deep")
    (tmp_path / "secret").write_text("host secret")
    return work


def _copy(root: Path, path: str, dest: Path, max_bytes: int | None = None) -> int:
    return copy_out(root, path, dest, sandbox_root=SANDBOX_ROOT, max_bytes=max_bytes)


def _list(root: Path, pattern: str) -> list[RemoteFile]:
    return list_workdir(root, pattern, SANDBOX_ROOT)


def test_links_inside_are_resolved_by_hand_within_the_working_directory(
    root: Path, tmp_path: Path
) -> None:
    (root / "alias").symlink_to("/work/sub/deep.txt")  # as the sandbox names it
    (root / "relative").symlink_to("sub/../real.txt")
    (root / "sub" / "up").symlink_to("../real.txt")
    (root / "dirlink").symlink_to("sub")
    for path, content in [
        ("alias", "deep"),
        ("relative", "inside"),
        ("sub/up", "inside"),
        ("dirlink/deep.txt", "deep"),
    ]:
        dest = tmp_path / "out" / path
        assert _copy(root, path, dest) == len(content)
        assert dest.read_text() == content


@pytest.mark.parametrize(
    "target", ["../secret", "/etc/passwd", "sub/../../secret", "/work/../secret", "/"]
)
def test_links_that_lead_out_are_refused_without_reading_the_target(
    root: Path, tmp_path: Path, target: str
) -> None:
    (root / "link").symlink_to(target)
    (root / "via").symlink_to("link")
    for path in ["link", "via"]:
        with pytest.raises(UnsafePathError, match=f"'{path}' resolves outside"):
            _copy(root, path, tmp_path / "never")
    assert not (tmp_path / "never").exists()


def test_a_folder_link_that_leads_out_is_never_entered(root: Path, tmp_path: Path) -> None:
    (root / "etc").symlink_to("/etc")
    with pytest.raises(UnsafePathError):
        _copy(root, "etc/passwd", tmp_path / "never")
    assert _list(root, "etc/*") == []
    assert [f.path for f in _list(root, "**/*")] == ["etc", "real.txt", "sub/deep.txt"]


def test_a_link_loop_is_refused(root: Path, tmp_path: Path) -> None:
    (root / "a").symlink_to("b")
    (root / "b").symlink_to("a")
    with pytest.raises(UnsafePathError, match="too many levels"):
        _copy(root, "a", tmp_path / "never")
    assert MAX_LINK_HOPS == 40


def test_special_files_missing_files_and_folders_are_refused_by_name(
    root: Path, tmp_path: Path
) -> None:
    os.mkfifo(root / "pipe")
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(root / "sock"))
        for path, reason in [
            ("pipe", "a FIFO"),
            ("sock", "a socket"),
            ("sub", "a folder"),
            ("missing.txt", "not in the working directory"),
            ("real.txt/below", "not in the working directory"),
        ]:
            with pytest.raises(FileTransferError, match=f"'{path}' is not collected: .*{reason}"):
                _copy(root, path, tmp_path / "never")
    assert not (tmp_path / "never").exists()


def test_sparse_and_oversized_files_are_refused(root: Path, tmp_path: Path) -> None:
    with open(root / "sparse.bin", "wb") as sparse:
        sparse.truncate(64 << 20)
        sparse.write(b"head")
    with pytest.raises(FileTransferError, match=r"'sparse\.bin' is not collected: it is sparse"):
        _copy(root, "sparse.bin", tmp_path / "never")
    (root / "big.bin").write_bytes(b"x" * 101)
    with pytest.raises(FileTransferError, match="over the cap of 100 bytes"):
        _copy(root, "big.bin", tmp_path / "never", max_bytes=100)
    assert _copy(root, "big.bin", tmp_path / "big.bin", max_bytes=101) == 101


def test_a_gone_working_directory_lists_nothing_and_copies_nothing(
    root: Path, tmp_path: Path
) -> None:
    gone = tmp_path / "gone"
    assert _list(gone, "**/*") == []
    with pytest.raises(FileTransferError, match="not in the working directory"):
        _copy(gone, "real.txt", tmp_path / "never")


def test_names_that_are_not_utf8_are_listed_and_copied(root: Path, tmp_path: Path) -> None:
    (root / os.fsdecode(b"r\xe9sum\xe9.csv")).write_text("a,b")
    files = _list(root, "*.csv")
    assert [(f.path, f.size_bytes) for f in files] == [("r\udce9sum\udce9.csv", 3)]
    assert not is_utf8(files[0].path) and is_utf8("données_年.csv")
    assert shown_path(files[0].path) == "r\\xe9sum\\xe9.csv"
    assert _copy(root, files[0].path, tmp_path / "back.csv") == 3


@pytest.mark.parametrize(
    ("pattern", "matches"),
    [
        ("data[1].csv", ["data[1].csv"]),
        ("./data[1].csv", ["data[1].csv"]),
        ("data[12].csv", ["data1.csv", "data2.csv"]),
        ("what?.txt", ["what?.txt"]),
        ("what*.txt", ["what?.txt", "whatever.txt"]),
        ("**/*.csv", ["data1.csv", "data2.csv", "data[1].csv", "sub/x.csv"]),
        ("missing[1].csv", []),
    ],
)
def test_a_pattern_that_spells_out_a_file_names_it_alone(pattern: str, matches: list[str]) -> None:
    paths = ["data[1].csv", "data1.csv", "data2.csv", "what?.txt", "whatever.txt", "sub/x.csv"]
    assert matching_files(pattern, paths) == matches


def test_check_size_names_the_file_and_the_setting() -> None:
    check_size("a.bin", 10, 10)
    check_size("a.bin", 10**12, None)
    with pytest.raises(FileTransferError, match=r"'a\.bin'.*max_artifact_bytes"):
        check_size("a.bin", 11, 10)


def printed_listing(root: Path) -> str:
    """What kernel_side/listing.py prints, run as E2B runs it (`run_code`, here in this
    process) and as Daytona does (``python3 -I -c SOURCE JSON``): the same."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(run_code("listing", "main", {"root": str(root)}), {})
    argument = json.dumps({"root": str(root)}, ensure_ascii=False)
    script = [sys.executable, "-I", "-c", source("listing"), argument]
    assert subprocess.run(script, capture_output=True, check=True).stdout.decode() == (
        printed.getvalue()
    )
    return printed.getvalue()


def test_the_listing_lists_files_and_links_never_entering_folder_links(root: Path) -> None:
    (root / "etc").symlink_to("/etc")
    (root / os.fsdecode(b"caf\xe9")).write_text("x")
    (root / "again.txt").hardlink_to(root / "real.txt")
    (root / "link.txt").symlink_to("real.txt")
    (root / "dangling").symlink_to("nowhere")
    real = os.stat(root / "real.txt")
    same = f"{real.st_dev}:{real.st_ino}"
    rows = sorted(json.loads(printed_listing(root)))
    assert [row[:2] for row in rows] == [
        ["again.txt", 6],
        ["caf\udce9", 1],
        ["dangling", len("nowhere")],
        ["etc", len("/etc")],
        ["link.txt", len("real.txt")],
        ["real.txt", 6],
        ["sub/deep.txt", 4],
    ]
    identities = {row[0]: row[2] for row in rows}
    assert identities["again.txt"] == identities["link.txt"] == identities["real.txt"] == same
    assert identities["dangling"] is None and identities["sub/deep.txt"] != same


def test_the_listing_knows_links_and_hard_links_to_one_file(root: Path) -> None:
    (root / "again.txt").hardlink_to(root / "real.txt")
    (root / "sub" / "up.txt").symlink_to("../real.txt")
    (root / "abs.txt").symlink_to(SANDBOX_ROOT / "sub" / "up.txt")  # as the sandbox names it
    (root / "out.txt").symlink_to("/etc/hostname")
    identities = {f.path: f.identity for f in _list(root, "**/*")}
    real = os.stat(root / "real.txt")
    same = f"{real.st_dev}:{real.st_ino}"
    assert {path for path, identity in identities.items() if identity == same} == {
        "abs.txt",
        "again.txt",
        "real.txt",
        "sub/up.txt",
    }
    assert identities["out.txt"] is None
    assert identities["sub/deep.txt"] not in (None, same)
