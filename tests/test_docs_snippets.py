"""Every code block the README and the docs tell a user to run: run here, or checked.

A ``python`` or ``sh`` block is preceded by a marker line:

- ``<!-- snippet: run -->``: run as a user would, from an empty folder holding a copy of
  ``examples/``: a Python block as a script (``python snippet.py``), a shell block with bash,
  both with the project's environment first on ``PATH`` and Prefect's test API as
  ``PREFECT_API_URL``. ``<!-- snippet: run, with s3: ... -->`` adds moto's S3 server, holding
  ``my-bucket`` with ``data/co2.csv``, as the standard AWS variables. Every ``summary.json`` and
  ``sweep.json`` the block stored must say ``completed``.
- ``<!-- snippet: not run, REASON -->``: needs what a test cannot have here (an account, a
  server that keeps running, an install). Its syntax is checked (``compile``, ``bash -n``), each
  ``prefect-sandbox`` command line in it is parsed by the CLI's own parser, each ``./dev.sh``
  command must be one dev.sh has, and each ``python -m`` module must exist.

Files the pages include (``--8<-- "path"``, e.g. ``deployments/README.md``) may leave a block
unmarked: it is then checked, not run.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from markdown_it import MarkdownIt

from tests.conftest import ROOT

COMMAND_LANGUAGES = {"python", "py", "sh", "bash", "shell", "console"}
MARKER = re.compile(r"^<!-- snippet: (?P<kind>run|not run)(?:, (?P<note>.+?))? -->$")
INCLUDE = re.compile(r'^--8<-- "(?P<path>[^":]+)', re.M)


@dataclasses.dataclass(frozen=True)
class Snippet:
    """One fenced code block of a page."""

    page: Path
    line: int  # 1-based line of the opening fence
    language: str
    code: str
    kind: str | None  # "run", "not run", or None when unmarked
    note: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def _snippets(page: Path) -> list[Snippet]:
    lines = page.read_text().splitlines()
    found = []
    for token in MarkdownIt().parse(page.read_text()):
        language = token.info.split()[0] if token.info else ""
        if token.type != "fence" or language not in COMMAND_LANGUAGES or token.map is None:
            continue
        start = token.map[0]
        marker = MARKER.match(lines[start - 1].strip()) if start > 0 else None
        found.append(
            Snippet(
                page=page,
                line=start + 1,
                language=language,
                code=token.content,
                kind=marker["kind"] if marker else None,
                note=(marker["note"] or "") if marker else "",
            )
        )
    return found


def _pages() -> tuple[list[Path], list[Path]]:
    """The pages a user reads (README.md, docs/), and the files those pages include."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    included = sorted(
        {ROOT / match["path"] for page in pages for match in INCLUDE.finditer(page.read_text())}
    )
    return pages, included


PAGES, INCLUDED = _pages()
SNIPPETS = [snippet for page in PAGES + INCLUDED for snippet in _snippets(page)]
RUN = [snippet for snippet in SNIPPETS if snippet.kind == "run"]
CHECKED = [snippet for snippet in SNIPPETS if snippet.kind != "run"]


def test_every_block_a_page_shows_to_run_is_marked_run_or_not_run_with_a_reason() -> None:
    unmarked = [s.where for s in SNIPPETS if s.kind is None and s.page in PAGES]
    assert unmarked == []
    unexplained = [s.where for s in SNIPPETS if s.kind == "not run" and len(s.note) < 10]
    assert unexplained == []
    # The pages show code to run, and most of it runs here.
    assert len(RUN) >= 10
    assert {s.language for s in RUN} == {"python", "sh"}


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """An empty folder holding a copy of the repository's examples, as a clone has them."""
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    return tmp_path


def _user_env(short_tmp: Path) -> dict[str, str]:
    from prefect.settings import PREFECT_API_URL

    return {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "PREFECT_API_URL": str(PREFECT_API_URL.value()),
        "TMPDIR": str(short_tmp),
    }


@pytest.fixture
def s3_bucket(request: pytest.FixtureRequest) -> Iterator[dict[str, str]]:
    """moto's S3 server holding ``my-bucket/data/co2.csv``, as the standard AWS variables."""
    moto = request.getfixturevalue("moto")
    client = moto.client()
    client.create_bucket(Bucket="my-bucket")
    client.upload_file(str(ROOT / "examples/co2/co2.csv"), "my-bucket", "data/co2.csv")
    yield {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing-secret",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": moto.endpoint,
    }
    for item in client.list_objects_v2(Bucket="my-bucket").get("Contents", []):
        client.delete_object(Bucket="my-bucket", Key=item["Key"])
    client.delete_bucket(Bucket="my-bucket")


def _stored_results(workdir: Path, s3: dict[str, str] | None, moto: object | None) -> list[dict]:
    """The ``summary.json`` and ``sweep.json`` files the snippet stored, parsed."""
    found = [
        json.loads(path.read_text())
        for name in ("summary.json", "sweep.json")
        for path in workdir.rglob(name)
        if "examples" not in path.parts
    ]
    if s3 is not None:
        client = moto.client()  # type: ignore[attr-defined]
        for item in client.list_objects_v2(Bucket="my-bucket").get("Contents", []):
            if item["Key"].endswith(("/summary.json", "/sweep.json")):
                body = client.get_object(Bucket="my-bucket", Key=item["Key"])["Body"].read()
                found.append(json.loads(body))
    return found


@pytest.mark.usefixtures("prefect_api")
@pytest.mark.parametrize("snippet", RUN, ids=[s.where for s in RUN])
@pytest.mark.timeout(600)
def test_a_block_marked_run_runs_as_shown(
    snippet: Snippet, workdir: Path, short_tmp: Path, request: pytest.FixtureRequest
) -> None:
    env = _user_env(short_tmp)
    s3 = moto = None
    if snippet.note.startswith("with s3"):
        s3 = request.getfixturevalue("s3_bucket")
        moto = request.getfixturevalue("moto")
        env.update(s3)
    if snippet.language == "python":
        (workdir / "snippet.py").write_text(snippet.code)
        command = [sys.executable, "snippet.py"]
    else:
        (workdir / "snippet.sh").write_text(snippet.code)
        command = ["bash", "-euo", "pipefail", "snippet.sh"]
    done = subprocess.run(
        command, cwd=workdir, env=env, capture_output=True, text=True, timeout=540
    )
    assert done.returncode == 0, f"{snippet.where}:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    stored = _stored_results(workdir, s3, moto)
    assert [result["status"] for result in stored if result["status"] != "completed"] == []


def _commands(code: str) -> list[list[str]]:
    """The shell block's commands as argument lists: continuation lines joined, comments
    dropped, lines split at ``&&``, ``|`` and ``;``."""
    commands = []
    for line in code.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        command: list[str] = []
        for word in [*words, "&&"]:
            if word in {"&&", "|", ";"}:
                if command:
                    commands.append(command)
                command = []
            else:
                command.append(word)
    return commands


def _dev_sh_commands() -> set[str]:
    return set(re.findall(r"^    (\w+)\)$", (ROOT / "dev.sh").read_text(), re.M))


@pytest.mark.parametrize("snippet", CHECKED, ids=[s.where for s in CHECKED])
def test_a_block_not_run_here_is_still_checked(snippet: Snippet) -> None:
    from prefect_sandbox import cli

    if snippet.language in {"python", "py"}:
        compile(snippet.code, snippet.where, "exec")
        return
    syntax = subprocess.run(
        ["bash", "-n"], input=snippet.code, capture_output=True, text=True, timeout=30
    )
    assert syntax.returncode == 0, f"{snippet.where}: {syntax.stderr}"
    for command in _commands(snippet.code):
        match command:
            case ["prefect-sandbox", *argv]:
                try:
                    cli._parser().parse_args(argv)
                except SystemExit as exit:  # --help exits 0; a usage error exits 2
                    assert exit.code == 0, f"{snippet.where}: {shlex.join(command)}"
            case ["./dev.sh", name, *_]:
                assert name in _dev_sh_commands(), f"{snippet.where}: no dev.sh command {name}"
            case ["python", "-m", module, *_]:
                assert importlib.util.find_spec(module) is not None, f"{snippet.where}: {module}"
