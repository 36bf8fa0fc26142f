"""The documentation site (`./dev.sh docs`, run by CI): built strictly, its CLI page generated."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT

HOOK = ROOT / "docs" / "hooks" / "cli_reference.py"


def _build(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--site-dir", str(root / "site")],
        cwd=root,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_broken_link_or_anchor_fails_the_build(tmp_path: Path) -> None:
    shutil.copy(ROOT / "mkdocs.yml", tmp_path)
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    for page in (ROOT / "docs").rglob("*.md"):  # the files pages include, outside docs/
        for included in re.findall(r'^--8<-- "([^":]+)', page.read_text(), re.M):
            (tmp_path / included).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(ROOT / included, tmp_path / included)
    with (tmp_path / "docs" / "index.md").open("a") as page:
        page.write("\n[gone](no-such-page.md) and [no anchor](reference/cli.md#no-such-anchor)\n")
    built = _build(tmp_path)
    assert built.returncode != 0
    assert "contains a link 'no-such-page.md', but the target is not found" in built.stderr
    assert "does not contain an anchor '#no-such-anchor'" in built.stderr
    assert "Aborted with 2 warnings in strict mode!" in built.stdout + built.stderr


def test_the_cli_reference_is_the_parsers_own_help() -> None:
    spec = importlib.util.spec_from_file_location("cli_reference", HOOK)
    assert spec is not None and spec.loader is not None
    cli_reference = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli_reference)
    page = cli_reference.on_page_markdown((ROOT / "docs/reference/cli.md").read_text())
    assert cli_reference.MARKER not in page
    for command in ("run", "sweep"):
        help_text = subprocess.run(
            [sys.executable, "-m", "prefect_sandbox.cli", command, "--help"],
            # argparse wraps at the terminal's width less 2 columns.
            env={**os.environ, "COLUMNS": str(cli_reference.WIDTH + 2)},
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
        assert f"## `prefect-sandbox {command}`\n\n```text\n{help_text.rstrip()}\n```" in page


def test_no_block_links_to_a_placeholder_address_while_the_site_is_unpublished() -> None:
    import yaml

    import prefect_sandbox
    from prefect_sandbox.blocks.base import DOCS_URL, docs_page

    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=yaml.BaseLoader)
    # One address in both places, or (as now, unpublished) none in either.
    assert config.get("site_url") == DOCS_URL is None
    assert docs_page("backends/e2b/") is None
    linked = [n for n in prefect_sandbox.__all__ if getattr(prefect_sandbox, n)._documentation_url]
    assert linked == []
