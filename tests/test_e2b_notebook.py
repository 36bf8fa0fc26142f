"""The executed notebook as Jupyter writes it, on the E2B emulator's harshest server ways and on
local: display updates across cells, the ``exit()`` cell, reply-only errors, a display whose
formatter fails, a thread's output, widget state (``metadata.widgets``)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import nbformat
import pytest

from prefect_sandbox.blocks.e2b import E2BBackend, E2BCredentials
from prefect_sandbox.sandbox.backends.kernel.local import LocalKernelConfig, LocalKernelSandbox
from prefect_sandbox.sandbox.base import Sandbox
from prefect_sandbox.sandbox.errors import SandboxDiedError
from prefect_sandbox.sandbox.notebook import WIDGET_STATE_MIME, ExecutedNotebook
from prefect_sandbox.testing.e2b import E2BEmulator
from tests.conftest import stream_text
from tests.contract.test_execution import (
    RELEASE_THREAD,
    START_RELEASED_THREAD,
    START_WAITING_THREAD,
    release_printer,
)

LABELS = {"prefect-sandbox": "true", "suite": "e2b-notebook"}
TEMPLATE_IPYKERNEL = "6.31.0"  # what e2b-dev/code-interpreter's template/requirements.txt pins


def _backend(emulator: E2BEmulator) -> E2BBackend:
    credentials = E2BCredentials(
        api_key=emulator.api_key, api_url=emulator.url, sandbox_url=emulator.url
    )
    return E2BBackend(credentials=credentials, lifetime_s=120)


@pytest.fixture(scope="module")
def shared_profile() -> Iterator[E2BEmulator]:
    """The server as run on one machine: one IPython folder for every sandbox's kernels, and
    every reply read after its idle."""
    with E2BEmulator(shared_ipython_dir=True, reply_after_idle=True) as emulator:
        yield emulator


@pytest.fixture(params=["local", "e2b"])
async def box(
    request: pytest.FixtureRequest, shared_profile: E2BEmulator
) -> AsyncIterator[Sandbox]:
    sandbox: Sandbox
    if request.param == "local":
        sandbox = await LocalKernelSandbox.create(LocalKernelConfig(isolation="none"))
    else:
        # Not the emulator's first sandbox: its kernel starts with our hooks' startup file.
        await (await _backend(shared_profile).create(LABELS)).kill()
        sandbox = await _backend(shared_profile).create(LABELS)
    try:
        yield sandbox
    finally:
        await sandbox.kill()


def _shapes(outputs: list[dict[str, Any]]) -> list[tuple[str, str]]:
    shown = []
    for output in outputs:
        kind = output["output_type"]
        if kind == "stream":
            shown.append((kind, output["text"]))
        elif kind == "error":
            shown.append((kind, output["ename"]))
        else:
            shown.append((kind, output.get("data", {}).get("text/plain", "")))
    return shown


async def test_updating_displays_give_the_cells_nbclient_gives(box: Sandbox) -> None:
    source = nbformat.v4.new_notebook()
    cells = [
        "h = display('v1', display_id='d')",
        "h.update('v2'); print('u')",
        "bar = display('0%', display_id='bar')\nfor i in range(3):\n    bar.update(f'{i}%')",
        "h.display('again')",
    ]
    source.cells = [nbformat.v4.new_code_cell(code) for code in cells]
    executed = ExecutedNotebook(source)
    for index, code in enumerate(cells):
        executed.record(index, "main", await box.run_cell(code))
    got = [_shapes(cell.outputs) for cell in executed.notebook.cells]
    # nbclient's notebook: an update rewrites the outputs shown with its id, adds none.
    assert got == [
        [("display_data", "'again'")],
        [("stream", "u\n")],
        [("display_data", "'2%'")],
        [("display_data", "'again'")],
    ]


async def test_the_exit_cell_shows_its_print_and_no_empty_display(box: Sandbox) -> None:
    with pytest.raises(SandboxDiedError) as died:
        await box.run_cell("print('bye')\nexit()")
    assert _shapes(died.value.outputs or []) == [("stream", "bye\n")]


async def test_a_display_whose_formatter_fails_is_ok_and_shows_the_traceback(box: Sandbox) -> None:
    result = await box.run_cell(
        "class Bad:\n"
        "    def _repr_html_(self):\n"
        "        raise RuntimeError('no html')\n"
        "display(Bad())\n"
        "print('on')"
    )
    assert result.status == "ok"
    errors = [o for o in result.outputs if o["output_type"] == "error"]
    assert [(o["ename"], o["evalue"]) for o in errors] == [("RuntimeError", "no html")]
    assert "_repr_html_" in "\n".join(errors[0]["traceback"])
    assert stream_text(result.outputs) == "on\n"


async def _unknown_magic_runs(sandbox: Sandbox, runs: int) -> list[str]:
    statuses = []
    for _ in range(runs):
        result = await sandbox.run_cell("%not_a_magic")
        assert result.error is not None and result.error.ename == "UsageError"
        assert "not_a_magic" in stream_text(result.outputs, "stderr")
        statuses.append(result.status)
    return statuses


async def test_a_reply_only_error_ends_the_cell_error_though_the_server_drops_it(
    box: Sandbox,
) -> None:
    # The session's emulator reads every reply after its idle: the reply's UsageError is lost.
    assert await _unknown_magic_runs(box, 5) == ["error"] * 5


@pytest.mark.slow
async def test_200_runs_of_an_unknown_magic_all_end_error(box: Sandbox) -> None:
    assert await _unknown_magic_runs(box, 200) == ["error"] * 200


SLIDER_CELLS = [
    "import ipywidgets\nslider = ipywidgets.IntSlider(value=1, description='n')\nslider",
    "slider.value = 5",
]


def _models(notebook: nbformat.NotebookNode) -> list[tuple[str, dict[str, Any]]]:
    """The widget models of ``metadata.widgets``, model ids left out (they are random)."""
    state = notebook.metadata["widgets"][WIDGET_STATE_MIME]["state"]
    ids = set(state)
    models = []
    for model in state.values():
        fields = {
            k: ("<model>" if isinstance(v, str) and v.removeprefix("IPY_MODEL_") in ids else v)
            for k, v in model["state"].items()
        }
        models.append((model["model_name"], fields))
    return sorted(models, key=lambda model: model[0])


@pytest.fixture(scope="module")
def nbclient_slider() -> nbformat.NotebookNode:
    """The slider notebook as nbclient executes it, widget state stored."""
    from nbclient import NotebookClient

    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell(code) for code in SLIDER_CELLS]
    NotebookClient(notebook, timeout=60, kernel_name="python3").execute()
    return notebook


async def test_a_real_ipywidgets_slider_keeps_its_last_value_as_nbclient_does(
    box: Sandbox, nbclient_slider: nbformat.NotebookNode
) -> None:
    cells = SLIDER_CELLS
    source = nbformat.v4.new_notebook()
    source.cells = [nbformat.v4.new_code_cell(code) for code in cells]
    executed = ExecutedNotebook(source)
    for index, code in enumerate(cells):
        result = await box.run_cell(code)
        assert result.status == "ok", result.error
        executed.record(index, "main", result)
    view = executed.notebook.cells[0].outputs[-1]["data"][
        "application/vnd.jupyter.widget-view+json"
    ]
    state = executed.notebook.metadata["widgets"][WIDGET_STATE_MIME]["state"]
    assert state[view["model_id"]]["model_name"] == "IntSliderModel"
    assert state[view["model_id"]]["state"]["value"] == 5
    assert state[view["model_id"]]["state"]["description"] == "n"
    assert _models(executed.notebook) == _models(nbclient_slider)
    nbformat.validate(executed.notebook)


# --- the template's ipykernel (6.x): a thread's output is tagged with the cell that started it


@pytest.fixture(scope="module")
def template_ipykernel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding ipykernel as E2B's template pins it, installed from PyPI once per
    run (the project's own environment keeps ipykernel 7)."""
    target = tmp_path_factory.mktemp("ipykernel6")
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps"]
    installed = subprocess.run(
        [*pip, "--target", str(target), f"ipykernel=={TEMPLATE_IPYKERNEL}"],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    if installed.returncode != 0:
        pytest.skip(f"ipykernel {TEMPLATE_IPYKERNEL} not installable: {installed.stderr[-300:]}")
    return target


@pytest.fixture(scope="module")
def template_emulator(template_ipykernel: Path) -> Iterator[E2BEmulator]:
    with E2BEmulator(kernel_pythonpath=template_ipykernel, reply_after_idle=True) as emulator:
        yield emulator


async def test_on_the_templates_ipykernel_a_threads_output_is_kept_as_on_local(
    template_emulator: E2BEmulator, tmp_path: Path
) -> None:
    sandbox = await _backend(template_emulator).create(LABELS)
    try:
        version = await sandbox.run_cell("import ipykernel; ipykernel.__version__")
        assert version.outputs[0]["data"]["text/plain"] == repr(TEMPLATE_IPYKERNEL)
        # Printed while a later cell runs: in that cell, as ipykernel 7 and local give it.
        await sandbox.run_cell(START_WAITING_THREAD.format(text="during next"))
        during = await sandbox.run_cell(RELEASE_THREAD + "print('cell two')")
        assert stream_text(during.outputs) == "during next\ncell two\n"
        # Printed while no cell runs: the server drops it (it owns no running execution).
        first = await sandbox.run_cell(START_RELEASED_THREAD.format(text="between cells"))
        assert stream_text(first.outputs) == "started\n"
        await release_printer(sandbox, tmp_path)
        await asyncio.sleep(0.8)  # the thread prints; nothing shows that it was dropped
        after = await sandbox.run_cell("print('last')")
        assert stream_text(after.outputs) == "last\n"
        assert await sandbox.take_late_outputs() == {}
        # The reply-only error holds on this kernel too.
        assert await _unknown_magic_runs(sandbox, 3) == ["error"] * 3
    finally:
        await sandbox.kill()
