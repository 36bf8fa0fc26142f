"""What a person sees, in headless Chromium (docs/run_form_check.mjs): the Run form of a
notebook deployment made by ``prefect-sandbox deploy`` on a real ``prefect server``, and pages
of the built docs site. Skipped where chromium or playwright-core is missing (see the script's
header); ``PREFECT_SANDBOX_UPDATE_SCREENSHOTS=1`` also saves the form's screenshot into
docs/screenshots/."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, SUBPROCESS_TEST_TIMEOUT_S
from tests.test_deployments import PrefectStack

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
NODE_PATH = os.environ.get("PLAYWRIGHT_NODE_PATH", "/tmp/pwcore/node_modules")

pytestmark = pytest.mark.skipif(
    not (
        Path(CHROMIUM).exists()
        and shutil.which("node")
        and Path(NODE_PATH, "playwright-core").is_dir()
    ),
    reason="needs chromium, node and playwright-core (docs/run_form_check.mjs says how)",
)


def _run(*args: str, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        list(args), cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, f"{args}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.mark.timeout(SUBPROCESS_TEST_TIMEOUT_S)
def test_the_run_form_shows_the_notebooks_parameters_and_the_docs_read_whole(
    server: PrefectStack, tmp_path: Path
) -> None:
    env = server.env
    _run(*(sys.executable, "-m", "prefect", "work-pool", "create", "browser-check"),
         "--type", "process", "--overwrite", env=env)  # fmt: skip
    # Relative paths, as a user in the repository gives them: the form shows no folder of ours.
    deployed = _run(
        *(sys.executable, "-m", "prefect_sandbox.cli", "deploy", "examples/co2/forecast.ipynb"),
        *("--pool", "browser-check", "--input", "examples/co2/co2.csv"),
        env=env,
    )
    deployment_id = deployed.split("(", 1)[1].split(")", 1)[0]
    site = tmp_path / "site"
    _run(sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(site),
         env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})  # fmt: skip
    shots = (
        ROOT / "docs/screenshots"
        if os.environ.get("PREFECT_SANDBOX_UPDATE_SCREENSHOTS")
        else tmp_path
    )
    found = json.loads(
        _run(
            "node",
            "docs/run_form_check.mjs",
            server.url.removesuffix("/api"),
            deployment_id,
            str(site),
            str(shots),
            env={**os.environ, "NODE_PATH": NODE_PATH, "CHROMIUM": CHROMIUM},
        )
    )
    fields = {field["label"]: field for field in found["fields"]}
    # The notebook's parameters are fields of their own, inside `parameters`, with defaults.
    assert fields["parameters (Optional)"]["nested"] == 5
    assert fields["train_end (Optional)"]["value"] == "1996-12-31"
    assert fields["notebook"]["value"] == "examples/co2/forecast.ipynb"
    assert fields["inputs (Optional)"]["value"] == "examples/co2/co2.csv"
    assert str(ROOT) not in json.dumps(found["fields"])
    assert (shots / "deployment-run-form.png").stat().st_size > 10_000
    # No code block runs past the page's edge; every flow, sync twins included, has a signature.
    assert {page: shown["cut_off"] for page, shown in found["pages"].items()} == {
        page: [] for page in found["pages"]
    }
    assert all(shown["code_blocks"] > 0 for shown in found["pages"].values())
    signatures = found["pages"]["reference/api"]["signatures"]
    for flow in ("run_notebook", "modeling_pipeline", "sweep_notebook", "reap_sandboxes"):
        for name in (flow, f"a{flow}"):
            assert any(s.startswith(f"{name}(") for s in signatures), (name, signatures)
