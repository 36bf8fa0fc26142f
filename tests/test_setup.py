"""Getting the project onto a machine: `dev.sh`'s set-up and the documented install commands."""

from __future__ import annotations

import os
import re
import subprocess
import tomllib
from pathlib import Path

from tests.conftest import ROOT

# Stands in for python3 and the venv's python: logs what it is asked, makes a "venv" holding a
# copy of itself, and succeeds, so dev.sh's set-up runs without installing anything.
_STAND_IN_PYTHON = """#!/bin/sh
echo "$*" >> "$CALLS_LOG"
if [ "$1" = "-m" ] && [ "$2" = "venv" ]; then
    mkdir -p "$3/bin" && cp "$0" "$3/bin/python"
fi
"""


def _dev_sh(*args: str, python: Path, venv: Path, log: Path) -> subprocess.CompletedProcess[str]:
    env = {
        "PATH": os.environ["PATH"],
        "PYTHON": str(python),
        "PREFECT_SANDBOX_VENV": str(venv),
        "CALLS_LOG": str(log),
    }
    return subprocess.run(
        ["sh", str(ROOT / "dev.sh"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_dev_sh_says_what_it_is_doing_before_each_long_step(tmp_path: Path) -> None:
    python, venv, log = tmp_path / "python3", tmp_path / "venv", tmp_path / "calls.log"
    python.write_text(_STAND_IN_PYTHON)
    python.chmod(0o755)
    first = _dev_sh("lint", python=python, venv=venv, log=log)
    assert first.returncode == 0, first.stderr
    assert first.stderr.splitlines() == [
        f"dev.sh: creating the virtual environment {venv}",
        f"dev.sh: upgrading pip in {venv} (under a minute)",
        f"dev.sh: installing prefect-sandbox and its extras into {venv}: about 280 packages, "
        "3-5 minutes with pip's cache warm on a quiet 2-core machine, 15 or more on a busy one",
        f"dev.sh: {venv} is ready",
    ]
    calls = log.read_text().splitlines()
    # Each announced step ran, in that order, pip's own output kept to its log.
    assert calls[1:4] == [
        f"-m venv {venv}",
        "-m pip install --progress-bar off --upgrade pip",
        "-m pip install --progress-bar off -e .[dev]",
    ]
    assert (venv / "pip-install.log").exists()
    again = _dev_sh("lint", python=python, venv=venv, log=log)
    assert (again.returncode, again.stderr) == (0, "")


def _section(page: Path, heading: str) -> str:
    """The text under a ``## heading`` of a markdown page, up to the next ``## ``."""
    sections = dict(re.findall(r"^## (.+?)\n(.*?)(?=^## |\Z)", page.read_text(), re.M | re.S))
    return sections[heading]


def test_the_docs_install_from_a_clone_or_a_wheel_not_the_package_index() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    install = _section(ROOT / "docs" / "getting-started.md", "Installing")
    assert "pip install '.[e2b]'" in install
    assert "pip install '.[examples]'" in install
    assert (
        f"pip install 'dist/prefect_sandbox-{project['version']}-py3-none-any.whl[e2b]'" in install
    )
    for backend in ("e2b", "daytona"):
        set_up = _section(ROOT / "docs" / "backends" / f"{backend}.md", "Set-up")
        (command,) = re.findall(r"pip install '[^']*'", set_up)
        assert command == f"pip install '.[{backend}]'"
    # Every extra the README and the docs name is one pyproject.toml defines.
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    named = {
        extra
        for page in pages
        for group in re.findall(r"\.\[([\w,]+)\]'", page.read_text())
        for extra in group.split(",")
    }
    assert named >= {"examples", "e2b", "daytona", "docker", "dask"}
    assert named <= set(project["optional-dependencies"])
