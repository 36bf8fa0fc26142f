"""Every code block the README and the docs tell a user to run: run here, or checked.

A ``python`` or ``sh`` block is preceded by a marker line:

- ``<!-- snippet: run -->``: run as a user would, from an empty folder holding a copy of
  ``examples/``: a Python block as a script (``python snippet.py``), a shell block with bash,
  both with the project's environment first on ``PATH`` and Prefect's test API as
  ``PREFECT_API_URL``. ``<!-- snippet: run, with s3: ... -->`` adds moto's S3 server, holding
  ``my-bucket`` with ``data/co2.csv``, as the standard AWS variables. Every ``summary.json`` and
  ``sweep.json`` the block stored must say ``completed``. Snippets run two at a time, each in
  its own folder and process; one that runs the reaper runs alone, last.
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
import tempfile
from collections.abc import Iterator
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from markdown_it import MarkdownIt

from prefect_sandbox.testing.s3 import MotoServer
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


SNIPPETS_AT_ONCE = 2
"""How many run-marked snippets run at the same time. Each is a fresh interpreter that spends
seconds of CPU importing Prefect and its notebook's libraries, then mostly waits on its kernel
and the API: two at once keep a 2-core machine busy without crowding it."""


def _reaps(snippet: Snippet) -> bool:
    """Whether the snippet runs the reaper, which kills the sandbox of a flow run that has just
    ended before that run's own clean-up does: it runs alone, after every other snippet."""
    return "reap_sandboxes" in snippet.code


def _user_env(short_tmp: Path) -> dict[str, str]:
    from prefect.settings import PREFECT_API_URL

    return {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "PREFECT_API_URL": str(PREFECT_API_URL.value()),
        "TMPDIR": str(short_tmp),
    }


@pytest.fixture(scope="module")
def s3_bucket(moto: MotoServer) -> Iterator[dict[str, str]]:
    """moto's S3 server holding ``my-bucket/data/co2.csv``, as the standard AWS variables."""
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


@dataclasses.dataclass(frozen=True)
class SnippetRun:
    """A run-marked snippet, run: its process's outcome and the folder it ran in."""

    done: subprocess.CompletedProcess[str]
    workdir: Path


def _run_snippet(snippet: Snippet, workdir: Path, env: dict[str, str]) -> SnippetRun:
    """Run the snippet as a user would, in ``workdir`` (an empty folder holding a copy of the
    repository's examples, as a clone has them)."""
    shutil.copytree(ROOT / "examples", workdir / "examples")
    if snippet.language == "python":
        (workdir / "snippet.py").write_text(snippet.code)
        command = [sys.executable, "snippet.py"]
    else:
        (workdir / "snippet.sh").write_text(snippet.code)
        command = ["bash", "-euo", "pipefail", "snippet.sh"]
    done = subprocess.run(
        command, cwd=workdir, env=env, capture_output=True, text=True, timeout=540
    )
    return SnippetRun(done, workdir)


@pytest.fixture(scope="module")
def snippet_runs(
    prefect_api: None, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[dict[str, Future[SnippetRun]]]:
    """Every run-marked snippet this session runs a test of, started at once,
    `SNIPPETS_AT_ONCE` at a time in page order (one that `_reaps` alone, last), each in its own
    folder with its own short TMPDIR; by `Snippet.where`. Waits for them all on teardown."""
    selected = {
        item.callspec.params["snippet"].where
        for item in request.session.items
        if isinstance(item, pytest.Function)
        and item.originalname == "test_a_block_marked_run_runs_as_shown"
    }
    short_tmps, prepared = [], {}
    for snippet in (s for s in RUN if s.where in selected):
        short_tmps.append(Path(tempfile.mkdtemp(prefix="sig-")))
        env = _user_env(short_tmps[-1])
        if snippet.note.startswith("with s3"):
            env.update(request.getfixturevalue("s3_bucket"))
        prepared[snippet.where] = (snippet, tmp_path_factory.mktemp("snippet"), env)
    pool = ThreadPoolExecutor(SNIPPETS_AT_ONCE, thread_name_prefix="snippet")
    others = {
        where: pool.submit(_run_snippet, *args)
        for where, args in prepared.items()
        if not _reaps(args[0])
    }

    def alone(*args: Any) -> SnippetRun:
        futures.wait(others.values())
        return _run_snippet(*args)

    reapers = {
        where: pool.submit(alone, *args) for where, args in prepared.items() if _reaps(args[0])
    }
    try:
        yield {**others, **reapers}
    finally:
        pool.shutdown(wait=True)
        for path in short_tmps:
            shutil.rmtree(path, ignore_errors=True)


def _stored_results(workdir: Path, s3: bool, moto: MotoServer | None) -> list[dict[str, Any]]:
    """The ``summary.json`` and ``sweep.json`` files the snippet stored, parsed."""
    found = [
        json.loads(path.read_text())
        for name in ("summary.json", "sweep.json")
        for path in workdir.rglob(name)
        if "examples" not in path.parts
    ]
    if s3 and moto is not None:
        client = moto.client()
        for item in client.list_objects_v2(Bucket="my-bucket").get("Contents", []):
            if item["Key"].endswith(("/summary.json", "/sweep.json")):
                body = client.get_object(Bucket="my-bucket", Key=item["Key"])["Body"].read()
                found.append(json.loads(body))
    return found


@pytest.mark.parametrize("snippet", RUN, ids=[s.where for s in RUN])
@pytest.mark.timeout(600)
def test_a_block_marked_run_runs_as_shown(
    snippet: Snippet, snippet_runs: dict[str, Future[SnippetRun]], request: pytest.FixtureRequest
) -> None:
    run = snippet_runs[snippet.where].result()
    done = run.done
    assert done.returncode == 0, f"{snippet.where}:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    s3 = snippet.note.startswith("with s3")
    moto = request.getfixturevalue("moto") if s3 else None
    stored = _stored_results(run.workdir, s3, moto)
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
