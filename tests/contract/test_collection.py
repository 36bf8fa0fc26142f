"""Contract: which files an artifact pattern names, names that are not UTF-8 (issue 25), and
one file stored once whatever its links (issue 36).

C06 (``shared/cases/found/C06``): a cell writes a file whose name is Latin-1 bytes beside
``clean.csv``; every cell succeeds, so the run completes with ``clean.csv``, the notebook and
``summary.json`` stored, and the undecodable name skipped with a warning naming it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from prefect_sandbox.blocks.base import SandboxBackend
from prefect_sandbox.flows.pipeline import amodeling_pipeline
from prefect_sandbox.sandbox.base import Sandbox
from tests.contract.conftest import LIMITS

pytestmark = pytest.mark.usefixtures("prefect_api")

# The cell of C06's input.ipynb.
C06_CELL = (
    "import os\n"
    "# a file name from a latin-1 source system, as a legacy unzip leaves it\n"
    'open(os.fsdecode(b"r\\xe9sum\\xe9.csv"), "w").write("a,b\\n1,2\\n")\n'
    'open("clean.csv", "w").write("a,b\\n3,4\\n")\n'
    'print(sorted(os.listdir(".")))'
)


async def test_a_name_that_is_not_utf8_is_listed_with_surrogate_escapes(sandbox: Sandbox) -> None:
    result = await sandbox.run_cell(C06_CELL)
    assert result.status == "ok"
    files = await sandbox.list_files("*.csv")
    assert [(f.path, f.size_bytes) for f in files] == [
        ("clean.csv", 8),
        ("r\udce9sum\udce9.csv", 8),
    ]


async def test_c06_a_name_that_is_not_utf8_is_skipped_and_the_rest_stored(
    backend: SandboxBackend, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    result = await amodeling_pipeline(
        stages={"setup": [C06_CELL]},
        artifacts=["*.csv"],
        backend=backend,
        storage=str(tmp_path / "out"),
    )
    assert result.status == "completed"
    assert sorted(a.path for a in result.artifacts) == ["clean.csv", "executed.ipynb"]
    run = Path(result.output_dir)
    assert (run / "clean.csv").read_text() == "a,b\n3,4\n"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert sorted(a["path"] for a in summary["artifacts"]) == ["clean.csv", "executed.ipynb"]
    assert sorted(p.name for p in run.iterdir()) == ["clean.csv", "executed.ipynb", "summary.json"]
    assert "Artifact 'r\\\\xe9sum\\\\xe9.csv' skipped: its name is not UTF-8" in caplog.text


async def test_a_pattern_that_spells_out_a_file_names_that_file_only(sandbox: Sandbox) -> None:
    await sandbox.run_cell(
        "for name in ['data[1].csv', 'data1.csv', 'data2.csv', 'what?.txt', 'whatever.txt']:\n"
        "    open(name, 'w').write(name)"
    )
    # The literal name wins over the glob reading of its brackets and question mark...
    assert [f.path for f in await sandbox.list_files("data[1].csv")] == ["data[1].csv"]
    assert [f.path for f in await sandbox.list_files("./what?.txt")] == ["what?.txt"]
    # ...and a pattern that names no file is a glob.
    assert [f.path for f in await sandbox.list_files("data[12].csv")] == ["data1.csv", "data2.csv"]
    assert [f.path for f in await sandbox.list_files("what*.txt")] == ["what?.txt", "whatever.txt"]


LINKS = 20
# One file with many names: links (relative, and through a folder) and hard links, as an
# attacker multiplies what a run stores.
LINKED_CELL = f"""
import os
os.makedirs("links", exist_ok=True)
open("data.bin", "wb").write(os.urandom(1 << 20))
for i in range({LINKS}):
    os.symlink("data.bin", f"soft{{i:02}}.bin")
    os.symlink("../data.bin", f"links/up{{i:02}}.bin")
    os.link("data.bin", f"hard{{i:02}}.bin")
"""


async def test_a_file_with_many_links_is_stored_once(
    backend: SandboxBackend, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    result = await amodeling_pipeline(
        stages={"setup": [LINKED_CELL]},
        artifacts=["**/*.bin"],
        backend=backend,
        storage=str(tmp_path / "out"),
    )
    assert result.status == "completed"
    stored = sorted(a.path for a in result.artifacts if a.path != "executed.ipynb")
    # Listed in path order: the first name of the file is the one stored.
    first = "data.bin"
    if "hard_links" in LIMITS.get(backend.backend_slug, frozenset()):
        assert stored == [first, *(f"hard{i:02}.bin" for i in range(LINKS))]
    else:
        assert stored == [first]
    links = [f"soft{i:02}.bin" for i in range(LINKS)] + [
        f"links/up{i:02}.bin" for i in range(LINKS)
    ]
    for link in links:
        assert f"Artifact {link!r} skipped: it is a link to {first!r}" in caplog.text
    run = Path(result.output_dir)
    assert sum(p.stat().st_size for p in run.rglob("*.bin")) == len(stored) << 20
