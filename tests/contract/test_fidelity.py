"""Contract (issue 12): outputs match Jupyter's, and a cell's error reads well wherever it is
copied, on every backend."""

from __future__ import annotations

import nbformat
import pytest
from prefect import flow

from prefect_sandbox.blocks.base import SandboxBackend
from prefect_sandbox.results import StageResult
from prefect_sandbox.sandbox.base import Sandbox, SandboxHandle
from prefect_sandbox.sandbox.errors import SandboxDiedError
from prefect_sandbox.sandbox.notebook import (
    WIDGET_STATE_MIME,
    CellSpec,
    ExecutedNotebook,
    StageSpec,
)
from prefect_sandbox.sandbox.outputs import ERROR_TEXT_CHARS, TRACEBACK_CHARS
from prefect_sandbox.tasks.sandbox import partial_stage_result, run_stage
from tests.conftest import stream_text
from tests.contract.conftest import CONTRACT_LABELS, cannot


async def test_b17_error_text_is_capped_and_names_the_failing_line(sandbox: Sandbox) -> None:
    line = "raise ValueError('bad row: ' + 'E' * 100_000 + ' :end')"
    result = await sandbox.run_cell(f"x = 1\n{line}", timeout_s=60)
    assert result.status == "error" and result.error is not None
    (output,) = [o for o in result.outputs if o["output_type"] == "error"]
    assert output["evalue"] == "bad row: " + "E" * 100_000 + " :end"
    evalue = result.error.evalue
    assert len(evalue) <= ERROR_TEXT_CHARS
    assert evalue.startswith("bad row: EEE") and evalue.endswith("EEE :end")
    assert f"[{len(output['evalue'])} characters," in evalue
    traceback = "\n".join(result.error.traceback)
    assert len(traceback) <= TRACEBACK_CHARS
    assert line in traceback and "\x1b" not in traceback


async def test_b06_b22_display_ids_updates_and_clear_output_as_in_jupyter(
    sandbox: Sandbox,
) -> None:
    shown = await sandbox.run_cell(
        "from IPython.display import clear_output, display\n"
        "status = display('step 0 of 3', display_id=True)\n"
        "handle = display('before', display_id='d1')\n"
        "handle.display('again')"
    )
    assert [o["data"] for o in shown.outputs] == [{"text/plain": "'step 0 of 3'"}] + 2 * [
        {"text/plain": "'again'"}
    ]
    status_id = next(key for key in shown.display_ids if key != "d1")
    assert shown.display_ids == {status_id: [0], "d1": [1, 2]}
    updated = await sandbox.run_cell(
        "status.update('step 3 of 3 (finished)')\nhandle.update('after')\nprint('updated')"
    )
    assert updated.status == "ok"
    assert updated.outputs == [{"output_type": "stream", "name": "stdout", "text": "updated\n"}]
    assert updated.display_updates == {
        status_id: {"data": {"text/plain": "'step 3 of 3 (finished)'"}, "metadata": {}},
        "d1": {"data": {"text/plain": "'after'"}, "metadata": {}},
    }
    cleared = await sandbox.run_cell(
        "for i in range(5):\n"
        "    clear_output(wait=True)\n"
        "    print(f'epoch {i}')\n"
        "display('final table')"
    )
    assert [(o["output_type"], o.get("text", o.get("data"))) for o in cleared.outputs] == [
        ("stream", "epoch 4\n"),
        ("display_data", {"text/plain": "'final table'"}),
    ]


@flow
async def _one_stage(
    backend: SandboxBackend, handle: SandboxHandle, stage: StageSpec
) -> StageResult:
    return await run_stage(backend, handle, stage)


@pytest.mark.usefixtures("prefect_api")
@pytest.mark.parametrize(
    ("code", "how", "last"),
    [
        (
            "import os, time\nprint('bye', flush=True)\ntime.sleep(0.5)\nos._exit(3)",
            "exit code 3",
            False,
        ),
        ("print('bye')\nexit()", "exit()", False),
        # E2B's server passes nothing on of exit(): no later cell may be the one to notice.
        ("print('bye')\nexit()", "exit()", True),
    ],
    ids=["os._exit", "exit()", "exit()-as-the-last-cell"],
)
async def test_the_cell_that_ended_the_kernel_carries_an_error_output(
    backend: SandboxBackend, code: str, how: str, last: bool
) -> None:
    sandbox = await backend.create(CONTRACT_LABELS)
    handle = sandbox.handle
    await sandbox.close()
    cells = [CellSpec(index=0, source="x = 1"), CellSpec(index=1, source=code)]
    if not last:
        cells.append(CellSpec(index=2, source="print(x)"))
    stage = StageSpec(name="s", cells=cells)
    try:
        with pytest.raises(SandboxDiedError) as info:
            await _one_stage(backend, handle, stage)
    finally:
        await (await backend.attach(handle)).kill()
    result = partial_stage_result(info.value)
    assert result is not None
    assert [(record.index, record.result.status) for record in result.cells] == [
        (0, "ok"),
        (1, "error"),
    ]
    died = result.cells[1].result
    # What the cell printed before the end stays, then the end as an error output.
    printed, output = died.outputs
    assert printed == {"output_type": "stream", "name": "stdout", "text": "bye\n"}
    assert (output["output_type"], output["ename"]) == ("error", "SandboxDiedError")
    assert "state is lost" in output["evalue"] and handle.sandbox_id in output["evalue"]
    if not cannot(sandbox, "exit_status") or how == "exit()":
        assert how in output["evalue"]
    assert result.error is not None and result.error.ename == "SandboxDiedError"


# D23: a jupyter.widget model opened and updated over a raw comm, as ipywidgets does it.
WIDGET_CELLS = [
    "from comm import create_comm\n"
    "state = {'_model_name': 'IntSliderModel', '_model_module': '@jupyter-widgets/controls',\n"
    "         '_model_module_version': '2.0.0', '_view_name': 'IntSliderView', 'value': 7}\n"
    "c = create_comm(target_name='jupyter.widget', data={'state': state, 'buffer_paths': []},\n"
    "                metadata={'version': '2.1.0'})\n"
    "display({'text/plain': 'IntSlider(value=7)',\n"
    "         'application/vnd.jupyter.widget-view+json':\n"
    "             {'version_major': 2, 'version_minor': 0, 'model_id': c.comm_id}}, raw=True)\n"
    "print(c.comm_id)",
    "c.send({'method': 'update', 'state': {'value': 9}, 'buffer_paths': [['data']]},\n"
    "       buffers=[b'\\x01\\x02'])\n"
    "print('updated')",
]


async def test_d23_a_widgets_last_state_is_in_the_notebooks_metadata(sandbox: Sandbox) -> None:
    source = nbformat.v4.new_notebook()
    source.cells = [nbformat.v4.new_code_cell(code) for code in WIDGET_CELLS]
    executed = ExecutedNotebook(source)
    results = [await sandbox.run_cell(code) for code in WIDGET_CELLS]
    for index, result in enumerate(results):
        assert result.status == "ok", result.error
        executed.record(index, "main", result)
    nbformat.validate(executed.notebook)
    if cannot(sandbox, "widget_state"):
        assert "widgets" not in executed.notebook.metadata
        return
    model_id = stream_text(results[0].outputs).strip()
    widgets = executed.notebook.metadata["widgets"][WIDGET_STATE_MIME]
    assert (widgets["version_major"], widgets["version_minor"]) == (2, 0)
    model = widgets["state"][model_id]
    assert (model["model_name"], model["model_module"]) == (
        "IntSliderModel",
        "@jupyter-widgets/controls",
    )
    assert model["state"]["value"] == 9
    assert model["buffers"] == [{"path": ["data"], "encoding": "base64", "data": "AQI="}]
