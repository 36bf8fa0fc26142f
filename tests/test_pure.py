"""Unit tests of the pure pieces: paths, outputs, notebooks, errors, labels."""

from __future__ import annotations

import ast
import datetime
import math
import pickle
import re
import threading
import time
from html import escape as html_escape
from pathlib import Path, PurePosixPath

import nbformat
import pytest

from prefect_sandbox.flows.errors import PipelineFailedError
from prefect_sandbox.results import PipelineResult
from prefect_sandbox.sandbox.errors import (
    CellExecutionError,
    CellTimeoutError,
    NotebookError,
    SandboxDiedError,
    SandboxError,
    UnsafePathError,
)
from prefect_sandbox.sandbox.labels import flow_run_labels
from prefect_sandbox.sandbox.notebook import (
    failing_line,
    inject_parameters,
    notebook_from_stages,
    parse_parameter,
    parse_python,
    split_stages,
)
from prefect_sandbox.sandbox.outputs import OutputCollector
from prefect_sandbox.sandbox.paths import (
    checked_relative_path,
    is_inside,
    path_segment,
    resolve_inside,
    run_folder_name,
)


@pytest.mark.parametrize(
    ("path", "inside"),
    [
        ("/work", True),
        ("/work/", True),
        ("/work/a/b.txt", True),
        ("//work/a", True),
        ("/work/./a/../b", True),
        ("/work/../work/a", True),
        ("/work/..", False),
        ("/work/a/../../etc", False),
        ("/workshop/a", False),
        ("/etc/passwd", False),
        ("/", False),
    ],
)
def test_is_inside_judges_the_normalised_text(path: str, inside: bool) -> None:
    assert is_inside(path, "/work") is inside
    assert is_inside(PurePosixPath(path), PurePosixPath("/work/")) is inside


@pytest.mark.parametrize("bad", ["", "/etc/passwd", "../x", "a/../../x", "~/x", ".", "a/.."])
def test_paths_that_leave_the_workdir_are_refused(bad: str) -> None:
    with pytest.raises(UnsafePathError):
        checked_relative_path(bad)


def test_symlink_out_of_root_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    (root / "link").symlink_to("/etc")
    (root / "inner").symlink_to(root)
    with pytest.raises(UnsafePathError, match="symlink"):
        resolve_inside(root, "link/passwd")
    assert resolve_inside(root, "inner/données 年.csv") == root / "données 年.csv"


@pytest.mark.parametrize(
    ("name", "folder"),
    [
        ("happy-cat", "happy-cat-456789ab"),
        ("../escaped", "escaped-456789ab"),
        ("/abs/path", "abs-path-456789ab"),
        ("..", "456789ab"),
        ("nightly report: 2024/05", "nightly-report-2024-05-456789ab"),
        ("données 年", "données-年-456789ab"),
        ("a\\b\x00c", "a-b-c-456789ab"),
        ("x" * 200, "x" * 64 + "-456789ab"),
    ],
)
def test_run_folder_is_one_safe_segment_unique_per_run(name: str, folder: str) -> None:
    run_id = "01234567-0123-7123-8123-0123456789ab"
    assert run_folder_name(name, run_id) == folder
    assert run_folder_name(name, "01234567-0123-7123-8123-0123ffffffff") != folder
    assert PurePosixPath(folder).parts == (folder,) and folder not in (".", "..")
    assert path_segment("run-notebook") == "run-notebook"


def test_streams_coalesce_and_clear_output_waits() -> None:
    collector = OutputCollector()
    collector.add("stream", {"name": "stdout", "text": "a"})
    collector.add("stream", {"name": "stdout", "text": "b\n"})
    collector.add("stream", {"name": "stderr", "text": "e"})
    collector.add("stream", {"name": "stdout", "text": "c"})
    assert [(o["name"], o["text"]) for o in collector.outputs] == [
        ("stdout", "ab\n"),
        ("stderr", "e"),
        ("stdout", "c"),
    ]
    collector.add("clear_output", {"wait": True})
    assert len(collector.outputs) == 3
    collector.add("display_data", {"data": {"text/plain": "1"}, "metadata": {}})
    assert [o["output_type"] for o in collector.outputs] == ["display_data"]


def test_progress_bar_output_past_the_cap_keeps_its_last_state() -> None:
    # A tqdm-like loop: 200,000 "\r<i>" updates, more than the cap in all, arriving in several
    # messages. A terminal shows only the last state; so must we, with nothing omitted.
    collector = OutputCollector(max_output_chars=1000)
    updates = "".join(f"\r{i}" for i in range(200_000))
    for start in range(0, len(updates), 100_000):
        collector.add("stream", {"name": "stdout", "text": updates[start : start + 100_000]})
    collector.add("stream", {"name": "stdout", "text": "\ndone\n"})
    assert collector.outputs == [
        {"output_type": "stream", "name": "stdout", "text": "199999\ndone\n"}
    ]
    assert collector.omitted_chars == 0


def test_capped_stream_keeps_its_last_lines_whatever_the_message_sizes() -> None:
    text = "".join(f"step {i}: 0%\rstep {i}: 100%\n" for i in range(3000))
    for chunk in (1, 7, 100, 5000, len(text)):
        collector = OutputCollector(max_output_chars=1000)
        for start in range(0, len(text), chunk):
            collector.add("stream", {"name": "stdout", "text": text[start : start + chunk]})
        (output,) = collector.outputs
        head, marker, tail = re.split(
            r"(\n\.\.\. \[output truncated: .*\] \.\.\.\n)", output["text"]
        )
        assert head.startswith("step 0: 100%\nstep 1: 100%\n"), chunk
        assert tail.endswith("step 2998: 100%\nstep 2999: 100%\n"), chunk
        assert "0%\r" not in head + tail and "%step" not in head + tail, chunk
        assert 400 <= len(head) <= 500 and 400 <= len(tail) <= 500, (chunk, len(head), len(tail))
        assert f"{len(text)} characters in all" in marker and collector.omitted_chars > 0


def _figure(number: int, payload_chars: int = 24_000) -> dict[str, object]:
    return {
        "data": {"image/png": "A" * payload_chars, "text/plain": f"fig {number}"},
        "metadata": {},
    }


def test_h11_outputs_between_half_the_cap_and_the_cap_are_all_kept() -> None:
    # 30 figures of 24 KB (720 KB) under the 1 MiB cap: all kept, no marker.
    figures = OutputCollector()
    for number in range(30):
        figures.add("display_data", _figure(number))
    assert [o["data"]["text/plain"] for o in figures.outputs] == [f"fig {n}" for n in range(30)]
    assert figures.omitted_chars == 0
    # 700 KB of text: kept whole, END included, no marker.
    text = OutputCollector()
    for _ in range(7):
        text.add("stream", {"name": "stdout", "text": "x" * 100_000 + "\n"})
    text.add("stream", {"name": "stdout", "text": "END\n"})
    assert text.outputs == [
        {"output_type": "stream", "name": "stdout", "text": ("x" * 100_000 + "\n") * 7 + "END\n"}
    ]
    assert text.omitted_chars == 0


def test_outputs_that_fit_under_the_cap_are_kept_whatever_half_the_head_took() -> None:
    # The head takes 4 figures (480 of its 500); the tail gets the rest of the cap (520), so
    # 4 more figures of 120 still fit: 960 <= 1000, nothing dropped.
    collector = OutputCollector(max_output_chars=1000)
    for number in range(8):
        collector.add("display_data", _figure(number, payload_chars=115))
    assert len(collector.outputs) == 8 and collector.omitted_chars == 0


def test_every_cut_leaves_a_marker_naming_what_was_dropped() -> None:
    collector = OutputCollector(max_output_chars=100_000)
    collector.add("stream", {"name": "stdout", "text": "start\n"})
    for number in range(10):
        collector.add("display_data", _figure(number, payload_chars=20_000))
    collector.add("stream", {"name": "stderr", "text": "e" * 30_000})
    collector.add("stream", {"name": "stdout", "text": "END\n"})
    outputs = collector.outputs
    shown = [o["data"]["text/plain"] for o in outputs if o["output_type"] == "display_data"]
    sizes = {"start": 6, "figure": 20_000 + len("fig 0"), "stderr": 30_000, "end": 4}
    total = sizes["start"] + 10 * sizes["figure"] + sizes["stderr"] + sizes["end"]
    assert collector.total_chars == total
    # The head keeps "start" and 2 figures (under half); the tail the last figure, all of
    # stderr and END; the 7 figures between are dropped, and the marker says so.
    assert shown == ["fig 0", "fig 1", "fig 9"]
    assert collector.omitted_chars == 7 * sizes["figure"]
    (marker,) = [o for o in outputs if "output truncated" in o.get("text", "")]
    assert marker["text"] == (
        f"\n... [output truncated: {total} characters in all, "
        f"{7 * sizes['figure']} characters omitted]"
        " [omitted: 7 display_data (image/png, text/plain)] ...\n"
    )
    assert outputs.index(marker) == 3
    assert outputs[-2:] == [
        {"output_type": "stream", "name": "stderr", "text": "e" * 30_000},
        {"output_type": "stream", "name": "stdout", "text": "END\n"},
    ]


def test_error_outputs_are_never_dropped_by_the_cap() -> None:
    collector = OutputCollector(max_output_chars=1000)
    collector.add("stream", {"name": "stdout", "text": "x" * 5000})
    collector.add("error", {"ename": "ValueError", "evalue": "E" * 3000, "traceback": ["tb"]})
    collector.add("stream", {"name": "stdout", "text": "y" * 5000})
    (error,) = [o for o in collector.outputs if o["output_type"] == "error"]
    assert error["evalue"] == "E" * 3000
    assert collector.omitted_chars == 10_000 - 1000 and collector.has_error()


def test_cap_text_keeps_start_and_end_with_a_marker_within_the_limit() -> None:
    from prefect_sandbox.sandbox.outputs import cap_text

    assert cap_text("short", 100) == "short"
    text = "head " + "E" * 3_000_000 + " :end"
    capped = cap_text(text, 4096)
    assert len(capped) == 4096 and cap_text(capped, 4096) == capped
    assert capped.startswith("head EEE") and capped.endswith("EEE :end")
    assert f"[{len(text)} characters, {len(text) - 4096} left out here]" in capped


def test_cell_error_is_capped_and_ansi_free_wherever_it_is_copied() -> None:
    from prefect_sandbox.sandbox.base import CellError
    from prefect_sandbox.sandbox.outputs import ERROR_TEXT_CHARS, TRACEBACK_CHARS

    evalue = "bad row: " + "E" * 3_000_000
    traceback = [
        "\x1b[0;31m-----\x1b[0m",
        "Cell \x1b[0;32mIn[2], line 1\x1b[0m",
        "\x1b[0;32m----> 1\x1b[0m raise ValueError(...)",
        f"\x1b[0;31mValueError\x1b[0m: {evalue}",
    ]
    error = CellError(ename="ValueError", evalue=f"\x1b[1m{evalue}\x1b[0m", traceback=traceback)
    assert len(error.evalue) == ERROR_TEXT_CHARS and error.evalue.startswith("bad row: E")
    joined = "\n".join(error.traceback)
    assert len(joined) == TRACEBACK_CHARS and "\x1b" not in joined
    assert joined.startswith("-----\nCell In[2], line 1\n----> 1 raise ValueError(...)\n")
    short = CellError(ename="E", evalue="v", traceback=["\x1b[31ma\x1b[0m", "b"])
    assert short.traceback == ["a", "b"]
    assert CellError.model_validate_json(error.model_dump_json()) == error


def test_undeclared_parameters_are_the_names_the_parameters_cell_does_not_set() -> None:
    from prefect_sandbox.sandbox.notebook import undeclared_parameters

    tagged = nbformat.v4.new_code_cell(
        "alpha = 0.5\nrows: int = 10\nfor beta in []: pass", metadata={"tags": ["parameters"]}
    )
    notebook = _notebook(nbformat.v4.new_code_cell("x = 1"), tagged)
    wanted = {"rows": 3, "alhpa": 0.1, "beta": 1, "gamma": 2}
    assert undeclared_parameters(notebook, wanted) == ["alhpa", "gamma"]
    assert undeclared_parameters(_notebook(nbformat.v4.new_code_cell("x = 1")), wanted) == list(
        wanted
    )
    magic = nbformat.v4.new_code_cell("%matplotlib inline", metadata={"tags": ["parameters"]})
    assert undeclared_parameters(_notebook(magic), wanted) == []


def test_update_display_data_replaces_the_shown_output() -> None:
    collector = OutputCollector()
    transient = {"display_id": "d1"}
    collector.add(
        "display_data", {"data": {"text/plain": "old"}, "metadata": {}, "transient": transient}
    )
    collector.add(
        "update_display_data",
        {"data": {"text/plain": "new"}, "metadata": {}, "transient": transient},
    )
    assert collector.outputs[0]["data"] == {"text/plain": "new"}


def test_a_new_display_with_an_id_rewrites_the_earlier_ones_and_is_reported() -> None:
    collector = OutputCollector()
    d1 = {"display_id": "d1"}
    collector.add("display_data", {"data": {"text/plain": "a"}, "metadata": {}, "transient": d1})
    collector.add("stream", {"name": "stdout", "text": "x\n"})
    collector.add("display_data", {"data": {"text/plain": "b"}, "metadata": {}, "transient": d1})
    collector.add(
        "update_display_data",
        {"data": {"text/plain": "u"}, "metadata": {}, "transient": {"display_id": "elsewhere"}},
    )
    assert [o.get("data") for o in collector.outputs] == [
        {"text/plain": "b"},
        None,
        {"text/plain": "b"},
    ]
    assert collector.display_ids == {"d1": [0, 2]}
    assert collector.display_updates == {
        "d1": {"data": {"text/plain": "b"}, "metadata": {}},
        "elsewhere": {"data": {"text/plain": "u"}, "metadata": {}},
    }
    collector.add("clear_output", {"wait": False})
    assert collector.display_ids == {} and "elsewhere" in collector.display_updates


def test_b06_a_display_update_from_a_later_cell_rewrites_the_earlier_cells_output() -> None:
    from datetime import UTC, datetime

    from prefect_sandbox.sandbox.base import CellResult
    from prefect_sandbox.sandbox.notebook import ExecutedNotebook

    def result(*messages: tuple[str, dict[str, object]]) -> CellResult:
        collector = OutputCollector()
        for msg_type, content in messages:
            collector.add(msg_type, content)
        return CellResult(
            status="ok",
            outputs=collector.outputs,
            started_at=datetime.now(UTC),
            duration_s=0,
            display_ids=collector.display_ids,
            display_updates=collector.display_updates,
        )

    def shown(text: str) -> dict[str, object]:
        return {"data": {"text/plain": text}, "metadata": {}, "transient": {"display_id": "d1"}}

    executed = ExecutedNotebook(_notebook(_code("a"), _code("b"), _code("c"), _code("d")))
    executed.record(0, "s", result(("display_data", shown("before"))))
    executed.record(1, "s", result(("stream", {"name": "stdout", "text": "x\n"})))
    executed.record(2, "s", result(("update_display_data", shown("after"))))
    cells = executed.notebook.cells
    assert cells[0].outputs[0]["data"] == {"text/plain": "after"}
    assert cells[2].outputs == []
    executed.record(3, "s", result(("display_data", shown("again"))))
    assert cells[0].outputs[0]["data"] == cells[3].outputs[0]["data"] == {"text/plain": "again"}


def test_e2b_results_marked_by_the_display_hooks_become_jupyter_messages() -> None:
    from prefect_sandbox.sandbox.backends.e2b import DISPLAY_CONTROL_MIME, result_content

    def marked(**control: object) -> dict[str, object]:
        return {"text/plain": "step 1", "image/png": "iVBO", DISPLAY_CONTROL_MIME: control}

    exact = {"text/plain": "'step 1'", "metadata": {"image/png": {"width": 10}}}
    assert result_content(marked(display_id="d1", update=False, **exact), is_main_result=False) == (
        "display_data",
        {
            "data": {"text/plain": "'step 1'", "image/png": "iVBO"},
            "metadata": {"image/png": {"width": 10}},
            "transient": {"display_id": "d1"},
        },
    )
    assert result_content(marked(display_id="d1", update=True), is_main_result=False)[0] == (
        "update_display_data"
    )
    assert result_content(
        {DISPLAY_CONTROL_MIME: {"clear": True, "wait": True}}, is_main_result=False
    ) == (
        "clear_output",
        {"wait": True},
    )
    assert result_content(marked(**exact), is_main_result=True) == (
        "execute_result",
        {
            "data": {"text/plain": "'step 1'", "image/png": "iVBO"},
            "metadata": {"image/png": {"width": 10}},
            "execution_count": None,
        },
    )
    lines = ["\x1b[31m-----\x1b[39m", "Cell In[1], line 1\n----> 1 1 / 0"]
    assert result_content({DISPLAY_CONTROL_MIME: {"traceback": lines}}, is_main_result=False) == (
        "prefect_sandbox_traceback",
        {"traceback": lines},
    )
    # A sandbox without the hooks (made before them): the bundle as E2B gives it.
    assert result_content({"text/plain": "x"}, is_main_result=False) == (
        "display_data",
        {"data": {"text/plain": "x"}, "metadata": {}},
    )


def test_daytona_runner_update_and_clear_records_become_jupyter_messages() -> None:
    from prefect_sandbox.sandbox.backends.daytona import record_content

    shown = {"data": {"text/plain": "'a'"}, "metadata": {}, "display_id": "d1"}
    assert record_content({"kind": "display", **shown}) == (
        "display_data",
        {"data": {"text/plain": "'a'"}, "metadata": {}, "transient": {"display_id": "d1"}},
    )
    assert record_content({"kind": "update", **shown})[0] == "update_display_data"
    assert record_content({"kind": "clear", "wait": True}) == ("clear_output", {"wait": True})


def _notebook(*cells: nbformat.NotebookNode) -> nbformat.NotebookNode:
    notebook = nbformat.v4.new_notebook()
    notebook.cells = list(cells)
    return notebook


def _code(source: str, *tags: str) -> nbformat.NotebookNode:
    cell = nbformat.v4.new_code_cell(source)
    if tags:
        cell.metadata["tags"] = list(tags)
    return cell


def test_b14_parameters_injected_into_an_nbformat_4_4_notebook_keep_it_valid() -> None:
    notebook = _notebook(_code("n = 1", "parameters"), _code("print(n)"))
    notebook.nbformat_minor = 4
    for cell in notebook.cells:
        del cell["id"]
    nbformat.validate(notebook)
    injected = inject_parameters(notebook, {"n": 5})
    nbformat.validate(injected)
    assert "id" not in injected.cells[1] and injected.cells[1].source.endswith("n = 5")
    assert "id" in inject_parameters(_notebook(_code("x = 1")), {"n": 5}).cells[0]


def test_b05_inline_figures_skip_an_image_that_is_not_base64_with_a_warning() -> None:
    from prefect_sandbox.sandbox.notebook import inline_figures

    png = nbformat.v4.new_output("display_data", data={"image/png": "iVBORw0KGgo="})
    bad = nbformat.v4.new_output("display_data", data={"image/png": "not-base64!"})
    notebook = _notebook(_code("a"), _code("b"))
    notebook.cells[0].outputs = [bad]
    notebook.cells[1].outputs = [png, bad, png]
    figures, warnings = inline_figures(notebook)
    assert figures == [
        ("inline-figures/cell-001-1.png", b"\x89PNG\r\n\x1a\n"),
        ("inline-figures/cell-001-3.png", b"\x89PNG\r\n\x1a\n"),
    ]
    assert [w.split(" is not base64")[0] for w in warnings] == [
        "cell 0: image/png output 1",
        "cell 1: image/png output 2",
    ]


def test_an_output_that_is_not_valid_nbformat_is_dropped_with_a_warning(tmp_path: Path) -> None:
    from datetime import UTC, datetime

    from prefect_sandbox.sandbox.base import CellResult
    from prefect_sandbox.sandbox.notebook import ExecutedNotebook

    executed = ExecutedNotebook(_notebook(_code("a"), _code("b")))
    good = {"output_type": "stream", "name": "stdout", "text": "kept\n"}
    bad = {"output_type": "display_data", "data": {"image/png": 5}, "metadata": {}}
    now = datetime.now(UTC)
    executed.record(0, "s", CellResult(status="ok", outputs=[good], started_at=now, duration_s=0))
    executed.record(1, "s", CellResult(status="ok", outputs=[bad], started_at=now, duration_s=0))
    warnings = executed.write(tmp_path / "out.ipynb")
    assert len(warnings) == 1 and warnings[0].startswith(
        "cell 1: a display_data output is not valid nbformat and was dropped"
    )
    written = nbformat.read(tmp_path / "out.ipynb", as_version=4)
    nbformat.validate(written)
    assert [c.outputs for c in written.cells] == [[good], []]


def test_widget_state_is_merged_across_cells_as_nbclient_stores_it() -> None:
    from datetime import UTC, datetime

    from prefect_sandbox.sandbox.base import CellResult
    from prefect_sandbox.sandbox.notebook import WIDGET_STATE_MIME, ExecutedNotebook
    from prefect_sandbox.sandbox.outputs import OutputCollector

    model = {"_model_name": "M", "_model_module": "m", "_model_module_version": "1", "value": 1}
    first, second = OutputCollector(), OutputCollector()
    first.add_comm({"comm_id": "w", "data": {"state": model, "buffer_paths": []}}, [])
    first.add_comm({"comm_id": "other", "data": {"state": {"value": 0}}}, [])  # no model name
    first.add_comm({"comm_id": "w", "data": {"method": "custom", "content": {}}}, [])
    update = {"state": {"value": 2}, "buffer_paths": [["b"]]}
    second.add_comm({"comm_id": "w", "data": update}, [b"\x00"])
    second.add_comm({"comm_id": "w", "data": update}, ["AQ=="])  # a path's buffer replaced
    executed = ExecutedNotebook(_notebook(_code("a"), _code("b")))
    now = datetime.now(UTC)
    for index, collector in enumerate((first, second)):
        result = CellResult(
            status="ok", started_at=now, duration_s=0, widget_state=collector.widget_state
        )
        executed.record(index, "s", result)
    assert executed.notebook.metadata["widgets"] == {
        WIDGET_STATE_MIME: {
            "state": {
                "w": {
                    "model_name": "M",
                    "model_module": "m",
                    "model_module_version": "1",
                    "state": {**model, "value": 2},
                    "buffers": [{"path": ["b"], "encoding": "base64", "data": "AQ=="}],
                }
            },
            "version_major": 2,
            "version_minor": 0,
        }
    }
    nbformat.validate(executed.notebook)


def test_stages_follow_tags_and_untagged_cells_join_the_previous_stage() -> None:
    notebook = _notebook(
        _code("a = 1", "stage:load"),
        nbformat.v4.new_markdown_cell("# Ignored heading"),
        _code("b = 2"),
        _code("c = 3", "stage:model"),
    )
    stages = split_stages(notebook)
    assert [(s.name, [c.index for c in s.cells]) for s in stages] == [
        ("load", [0, 2]),
        ("model", [3]),
    ]


def test_b07_cells_tagged_skip_execution_are_not_run_and_keep_their_outputs() -> None:
    from prefect_sandbox.sandbox.notebook import ExecutedNotebook

    skipped = _code("raise RuntimeError('interactive only')", "skip-execution", "stage:b")
    skipped.outputs = [nbformat.v4.new_output("stream", name="stdout", text="old\n")]
    skipped.execution_count = 7
    stale = _code("y = 2", "stage:b")
    stale.outputs = [nbformat.v4.new_output("stream", name="stdout", text="stale\n")]
    notebook = _notebook(_code("x = 1", "stage:a"), skipped, stale)
    assert [(s.name, [c.index for c in s.cells]) for s in split_stages(notebook)] == [
        ("a", [0]),
        ("b", [2]),
    ]
    only_skipped = _notebook(_code("x = 1"), _code("y = 2", "skip-execution"))
    assert [[c.index for c in s.cells] for s in split_stages(only_skipped)] == [[0]]
    executed = ExecutedNotebook(notebook).notebook
    assert executed.cells[1].outputs == skipped.outputs
    assert executed.cells[1].execution_count == 7
    assert executed.cells[2].outputs == [] and executed.cells[2].execution_count is None


def test_untagged_notebook_splits_by_top_level_heading() -> None:
    notebook = _notebook(
        _code("import os"),
        nbformat.v4.new_markdown_cell("# Load the data\ntext"),
        _code("x = 1"),
        nbformat.v4.new_markdown_cell("## Not a stage"),
        _code("y = 2"),
        nbformat.v4.new_markdown_cell("# Fit!"),
        _code("z = 3"),
    )
    assert [(s.name, len(s.cells)) for s in split_stages(notebook)] == [
        ("setup", 1),
        ("load-the-data", 2),
        ("fit", 1),
    ]


def test_a_stage_heading_level_of_2_splits_on_second_level_headings_too() -> None:
    notebook = _notebook(
        nbformat.v4.new_markdown_cell("# Study"),
        _code("import os"),
        nbformat.v4.new_markdown_cell("## Load"),
        _code("x = 1"),
        nbformat.v4.new_markdown_cell("### Detail, not a stage"),
        _code("y = 2"),
        nbformat.v4.new_markdown_cell("## Fit"),
        _code("z = 3"),
    )
    assert [s.name for s in split_stages(notebook)] == ["study"]
    assert [(s.name, len(s.cells)) for s in split_stages(notebook, 2)] == [
        ("study", 1),
        ("load", 2),
        ("fit", 1),
    ]
    assert len(split_stages(notebook, 3)) == 4
    with pytest.raises(NotebookError, match="stage heading level must be 1 to 6, not 0"):
        split_stages(notebook, 0)


def _headed(*markdown: str) -> nbformat.NotebookNode:
    """A notebook of markdown cells, each followed by one code cell."""
    cells = []
    for number, text in enumerate(markdown):
        cells += [nbformat.v4.new_markdown_cell(text), _code(f"x{number} = {number}")]
    return _notebook(*cells)


def test_b09_headings_in_any_script_open_stages_with_readable_names() -> None:
    notebook = _headed(
        "# 数据加载",
        "# Données *brutes*",
        "# Donne\u0301es brutes!",
        "# 🚀",
        "Fit the `model`\n===============",
    )
    assert [s.name for s in split_stages(notebook)] == [
        "数据加载",
        "données-brutes",
        "données-brutes-2",
        "heading-4",
        "fit-the-model",
    ]


def test_hash_lines_in_code_blocks_of_markdown_are_not_headings() -> None:
    notebook = _headed(
        "# Load",
        "Run:\n\n```sh\n# install first\npip install x\n```",
        "Or:\n\n    # indented code\n",
        "#hashtag, no space",
    )
    assert [(s.name, len(s.cells)) for s in split_stages(notebook)] == [("load", 4)]


@pytest.mark.parametrize(
    ("metadata", "refusal"),
    [
        (
            {"kernelspec": {"name": "ir", "display_name": "R", "language": "R"}},
            "is written for kernel 'ir' in 'R'",
        ),
        ({"language_info": {"name": "julia"}}, "is written for a kernel in 'julia'"),
        ({"kernelspec": {"name": "python3", "display_name": "P", "language": "python"}}, None),
        ({"language_info": {"name": "python", "version": "3.6.0"}}, None),
        ({}, None),
    ],
)
def test_notebooks_for_other_languages_are_refused_naming_the_kernel(
    tmp_path: Path, metadata: dict[str, object], refusal: str | None
) -> None:
    from prefect_sandbox.sandbox.notebook import read_notebook

    path = tmp_path / "nb.ipynb"
    nbformat.write(nbformat.v4.new_notebook(metadata=metadata), path)
    if refusal is None:
        assert read_notebook(path).metadata == metadata
        return
    with pytest.raises(NotebookError) as info:
        read_notebook(path)
    assert str(info.value) == (
        f"notebook {str(path)!r} {refusal}; prefect-sandbox runs Python notebooks only"
    )


def test_non_consecutive_stage_names_the_cell() -> None:
    notebook = _notebook(_code("1", "stage:a"), _code("2", "stage:b"), _code("3", "stage:a"))
    with pytest.raises(NotebookError, match="cell 2") as info:
        split_stages(notebook)
    assert info.value.cell_index == 2


def test_two_stage_tags_on_one_cell_are_refused() -> None:
    with pytest.raises(NotebookError, match="cell 0"):
        split_stages(_notebook(_code("1", "stage:a", "stage:b")))


def test_parameters_are_injected_after_the_parameters_cell_in_its_stage() -> None:
    notebook = _notebook(
        _code("import math", "stage:setup"),
        _code("n = 1\nname = 'x'", "parameters", "stage:load"),
        _code("print(n)", "stage:load"),
    )
    injected = inject_parameters(notebook, {"n": 5, "name": "it's", "flag": None})
    cell = injected.cells[2]
    assert cell.metadata["tags"] == ["injected-parameters", "stage:load"]
    namespace: dict[str, object] = {}
    exec(cell.source, namespace)
    assert (namespace["n"], namespace["name"], namespace["flag"]) == (5, "it's", None)
    assert [s.name for s in split_stages(injected)] == ["setup", "load"]
    again = inject_parameters(injected, {"n": 6})
    assert sum("injected-parameters" in c.metadata.get("tags", []) for c in again.cells) == 1
    assert len(notebook.cells) == 3


def test_parameters_without_a_parameters_cell_open_the_notebook() -> None:
    injected = inject_parameters(_notebook(_code("print(n)")), {"n": 1})
    assert injected.cells[0].source.endswith("n = 1")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("a=1", ("a", 1)),
        ("a=1.5", ("a", 1.5)),
        ("a=True", ("a", True)),
        ("a=None", ("a", None)),
        ("a=1996-12-31", ("a", "1996-12-31")),
        ("a=x=y", ("a", "x=y")),
    ],
)
def test_parse_parameter_types_values_like_papermill(
    text: str, expected: tuple[str, object]
) -> None:
    assert parse_parameter(text) == expected


@pytest.mark.parametrize("bad", ["novalue", "1a=2", "=3"])
def test_parse_parameter_names_the_bad_parameter(bad: str) -> None:
    with pytest.raises(NotebookError, match=bad):
        parse_parameter(bad)


@pytest.mark.parametrize(
    ("assignment", "problem"),
    [
        ("lambda=0.5", "is a Python keyword"),
        ("class=1", "is a Python keyword"),
        ("None=1", "is a Python keyword"),
        ("a-b=1", "is not a Python identifier"),
    ],
)
def test_b04_keyword_parameter_names_are_refused(assignment: str, problem: str) -> None:
    name = assignment.split("=")[0]
    with pytest.raises(NotebookError) as info:
        parse_parameter(assignment)
    assert str(info.value) == f"parameter name {name!r} (in {assignment!r}) {problem}"
    with pytest.raises(NotebookError, match=f"parameter name {name!r} {problem}"):
        inject_parameters(_notebook(_code("x = 1")), {name: 1})


def _injected_values(parameters: dict[str, object]) -> dict[str, object]:
    """What the injected cell assigns, run as the kernel would run it (no imports)."""
    injected = inject_parameters(_notebook(_code("x = 1", "parameters")), parameters)
    namespace: dict[str, object] = {}
    exec(injected.cells[1].source, {}, namespace)
    return namespace


def test_b01_nan_and_infinities_are_injected_as_floats() -> None:
    assert parse_parameter("x=nan")[1] != parse_parameter("x=nan")[1]
    values = _injected_values({"x": float("nan"), "up": float("inf"), "down": float("-inf")})
    assert math.isnan(values["x"])  # type: ignore[arg-type]
    assert (values["up"], values["down"]) == (math.inf, -math.inf)
    source = inject_parameters(_notebook(), {"x": math.nan}).cells[0].source
    assert source.splitlines()[-1] == "x = float('nan')"


def test_b02_values_without_a_literal_convert_as_papermill_does() -> None:
    import enum

    import numpy as np

    class Colour(enum.IntEnum):
        RED = 1

    class Name(str):
        pass

    values = _injected_values(
        {
            "start": datetime.date(2019, 1, 1),
            "at": datetime.datetime(2019, 1, 1, 12, 30, tzinfo=datetime.UTC),
            "n": np.int64(3),
            "rate": np.float64(0.25),
            "gone": np.float32("nan"),
            "flag": np.bool_(True),
            "colour": Colour.RED,
            "name": Name("it's"),
            "nested": {"a": [1, (2.5,), {"d": datetime.time(8, 0)}], 3: None},
        }
    )
    assert values["start"] == "2019-01-01"
    assert values["at"] == "2019-01-01T12:30:00+00:00"
    assert [type(values[k]) for k in ("n", "rate", "flag", "colour", "name")] == [
        int,
        float,
        bool,
        int,
        str,
    ]
    assert (values["n"], values["rate"], values["flag"], values["colour"]) == (3, 0.25, True, 1)
    assert values["name"] == "it's" and math.isnan(values["gone"])  # type: ignore[arg-type]
    assert values["nested"] == {"a": [1, (2.5,), {"d": "08:00:00"}], 3: None}


@pytest.mark.parametrize(
    ("value", "kind"),
    [(object(), "object"), ({1, 2}, "set"), (1j, "complex"), ([Path("x")], "PosixPath")],
)
def test_b02_values_of_other_types_are_refused_naming_the_parameter(
    value: object, kind: str
) -> None:
    with pytest.raises(NotebookError) as info:
        inject_parameters(_notebook(_code("x = 1")), {"ok": 1, "bad": value})
    assert str(info.value).startswith(
        f"parameter 'bad': a value of type {kind} has no Python literal form"
    )


@pytest.mark.parametrize("bad", [0, -2, -1.5, math.nan, math.inf])
def test_b13_cell_timeouts_are_positive_or_minus_one(bad: float) -> None:
    from prefect_sandbox import LocalKernelBackend
    from prefect_sandbox.sandbox.base import checked_timeout_s

    assert (checked_timeout_s(2.5), checked_timeout_s(-1), checked_timeout_s(None)) == (
        2.5,
        None,
        None,
    )
    with pytest.raises(ValueError) as info:
        checked_timeout_s(bad, "cell_timeout_s")
    assert str(info.value) == (
        f"cell_timeout_s must be a positive number of seconds, or -1 for no timeout; got {bad:g}"
    )
    with pytest.raises(ValueError, match="cell_timeout_s must be a positive number"):
        LocalKernelBackend(cell_timeout_s=bad)
    assert LocalKernelBackend(cell_timeout_s=-1).cell_timeout_s == -1


def test_notebook_from_stages_tags_each_cell() -> None:
    notebook = notebook_from_stages({"a": ["x = 1", "x"], "b": ["y = 2"]})
    nbformat.validate(notebook)
    assert [c.metadata["tags"] for c in notebook.cells] == [["stage:a"], ["stage:a"], ["stage:b"]]
    with pytest.raises(NotebookError, match="'empty'"):
        notebook_from_stages({"empty": []})


@pytest.mark.parametrize(
    "error",
    [
        CellExecutionError("m", ename="E", evalue="v", traceback=["t"], stage="s", cell_index=3),
        CellTimeoutError("m", timeout_s=0.5, stage="s", cell_index=1, interrupted=True),
        SandboxDiedError("m", exit_code=1, signal=None, cell_index=2, sandbox_id="x"),
        UnsafePathError("m", path="../x"),
        PipelineFailedError("m", stage="s", cell_index=4, output_dir="/o"),
    ],
)
def test_errors_keep_their_fields_through_pickling(error: SandboxError) -> None:
    error.stage_result = {"partial": True}
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error)
    assert vars(copy) == vars(error)
    assert str(copy) == "m"


def test_error_families_mix_in_the_stdlib_types() -> None:
    assert issubclass(CellTimeoutError, TimeoutError)
    assert issubclass(UnsafePathError, ValueError)
    assert SandboxDiedError("m").state_lost is True


def test_flow_run_labels_carry_id_name_and_marker() -> None:
    assert flow_run_labels("id-1", "happy-cat") == {
        "prefect-sandbox": "true",
        "prefect-flow-run-id": "id-1",
        "prefect-flow-run-name": "happy-cat",
    }


def test_summary_markdown_names_the_failing_cell_and_shows_figures() -> None:
    from prefect_sandbox.flows.report import summary_markdown
    from prefect_sandbox.results import PipelineResult, StageSummary, StoredArtifact

    result = PipelineResult(
        flow_run_id="id",
        flow_run_name="happy-cat",
        status="failed",
        stages=[
            StageSummary(name="load", status="ok", cell_count=2, duration_s=0.5),
            StageSummary(
                name="fit",
                status="failed",
                cell_count=1,
                duration_s=1.0,
                failed_cell_index=4,
                ename="ValueError",
                evalue="bad | \x1b[31mred\x1b[0m",
            ),
        ],
        artifacts=[
            StoredArtifact(
                path="figures/a.png", size_bytes=10, sha256="ab" * 32, location="s3://b/k/a"
            ),
            StoredArtifact(
                path="figures/b.png", size_bytes=10, sha256="cd" * 32, location="/out/b.png"
            ),
        ],
        output_dir="s3://b/k",
        duration_s=2.0,
        error="stage 'fit', cell 4: ValueError: bad",
        warnings=["artifact 'big.csv' not downloaded: 429 | busy"],
    )
    markdown = summary_markdown(
        result, {"figures/a.png": "https://example.test/a.png", "figures/b.png": None}
    )
    assert "| fit | failed | 1 | 1.00 | cell 4: ValueError: bad \\| red |" in markdown
    assert "![figures/a.png](https://example.test/a.png)" in markdown
    assert "- `figures/b.png`: `/out/b.png`" in markdown
    assert "- artifact 'big.csv' not downloaded: 429 \\| busy" in markdown
    assert "\x1b" not in markdown


def _hostile_result(artifact_count: int) -> PipelineResult:
    from prefect_sandbox.results import PipelineResult, StageSummary, StoredArtifact

    evil = (
        "![x](http://evil.test/a.png) <img src=http://evil.test/b.png> "
        "[click](javascript:alert(1)) <script>alert(1)</script> www.evil.test "
        "https://evil.test/c &lt;img&gt; **bold** `code` a\\ | b\nnext line"
    )
    return PipelineResult(
        flow_run_id="id",
        flow_run_name="run <img src=http://evil.test/n.png>",
        status="failed",
        stages=[
            StageSummary(
                name="[fit](http://evil.test/s)",
                status="failed",
                cell_count=1,
                duration_s=1.0,
                failed_cell_index=0,
                ename="ValueError",
                evalue=evil,
            )
        ],
        artifacts=[
            StoredArtifact(
                path="figures/](http:evil.test) `x` <b>.png",
                size_bytes=10,
                sha256="ab" * 32,
                location="/out/figures/](http:evil.test) `x` <b>.png",
            ),
            *(
                StoredArtifact(
                    path=f"f/{n}.txt", size_bytes=3, sha256="cd" * 32, location=f"/o/{n}"
                )
                for n in range(artifact_count)
            ),
        ],
        output_dir="/out/`run`",
        duration_s=2.0,
        error=f"stage 'fit', cell 0: ValueError: {evil}",
    )


def test_summary_markdown_escapes_untrusted_text_and_builds_the_only_links() -> None:
    from markdown_it import MarkdownIt

    from prefect_sandbox.flows.report import summary_markdown

    result = _hostile_result(0)
    figure = result.artifacts[0].path
    for url in ["https://store.test/fig.png?sig=1", None]:
        markdown = summary_markdown(result, {figure: url})
        html = MarkdownIt("commonmark", {"html": True}).enable("table").render(markdown)
        images = re.findall(r"<img [^>]*>", html)
        assert images == ([f'<img src="{url}" alt="{html_escape(figure)}" />'] if url else [])
        assert "<a " not in html and "<script" not in html and "<b>" not in html
        # GFM autolinks (www., scheme://) stay text: their trigger is escaped.
        assert not re.search(r"(?<!\\)www\.|[a-z](?<!\\):(?=//)", markdown.replace(url or "", ""))
        assert "evil.test/a.png) &lt;img src=http" in html  # shown, as text
        assert "<td>[fit](http" in html and "a\\ | b next line" in html
        assert f"<h1>{html_escape(result.flow_run_name)}: failed</h1>" in html
        if url is None:
            assert f"<code>{html_escape(figure)}</code>" in html
            assert "<code>/out/`run`</code>" in html


def test_summary_markdown_and_table_artifact_are_capped_for_10000_files() -> None:
    from prefect_sandbox.flows.report import ROWS_SHOWN, summary_markdown
    from prefect_sandbox.tasks.storage import TABLE_ROWS_SHOWN, stored_table_rows

    result = _hostile_result(10_000)
    markdown = summary_markdown(result, {})
    assert len(markdown.encode()) < 30_000
    rows = [line for line in markdown.splitlines() if line.startswith("| f/")]
    assert len(rows) == ROWS_SHOWN - 1
    more = 10_001 - ROWS_SHOWN
    assert f"… and {more} more file(s) ({more * 3} bytes); all are listed in" in markdown
    table = stored_table_rows(result.artifacts)
    assert len(table) == TABLE_ROWS_SHOWN + 1
    assert table[-1]["key"] == (
        f"… and {10_001 - TABLE_ROWS_SHOWN} more file(s), all listed in summary.json"
    )
    assert len(str(table).encode()) < 200_000


def test_the_stored_files_table_renders_names_a_cell_chose_inert() -> None:
    from markdown_it import MarkdownIt

    from prefect_sandbox.results import StoredArtifact
    from prefect_sandbox.tasks.storage import stored_table_rows

    names = [
        "<img src=x onerror=alert(1)>.png",
        "clip\x1b]52;c;ZXZpbA==\x07board.txt",  # OSC 52: a clipboard write
        "clear\x9b2J\x1b[2Jscreen.txt",  # C1 and ESC-led screen clears
        "two\nlines\r.txt",
        "gnp.\u202etxt",  # a right-to-left override: shows as 'txt.png'
        "[x](http://evil.test).csv",
    ]
    stored = [
        StoredArtifact(path=name, size_bytes=1, sha256="ab" * 32, location=f"/out/{name}")
        for name in names
    ]
    rows = stored_table_rows(stored)
    for row, name in zip(rows, names, strict=True):
        key = str(row["key"])
        html = MarkdownIt("commonmark", {"html": True}).render(key)
        assert "<img" not in html and "<a " not in html, html
        assert not re.search("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]", key), key
        assert key.startswith("/out/"), (name, key)


def test_summary_markdown_lists_parameters_and_metrics_escaped() -> None:
    from markdown_it import MarkdownIt

    from prefect_sandbox.flows.report import summary_markdown

    result = _hostile_result(0).model_copy(
        update={
            "parameters": {"alpha": 0.5, "path": "[x](http://evil.test)", "dates": ["2001"]},
            "metrics": {"mae": 0.25, "<b>name</b>": "ok", "converged": True},
        }
    )
    markdown = summary_markdown(result, {})
    assert "## Parameters" in markdown and "## Metrics" in markdown
    assert "| alpha | 0.5 |" in markdown
    assert '| dates | \\["2001"\\] |' in markdown
    assert "| mae | 0.25 |" in markdown and "| converged | true |" in markdown
    html = MarkdownIt("commonmark", {"html": True}).enable("table").render(markdown)
    assert "<a " not in html and "<b>" not in html
    assert "&lt;b&gt;name&lt;/b&gt;" in html
    # Empty ones add no section.
    bare = summary_markdown(result.model_copy(update={"parameters": {}, "metrics": {}}), {})
    assert "## Parameters" not in bare and "## Metrics" not in bare


def test_a_progress_bars_200_updates_reach_the_log_as_its_first_and_last_state() -> None:
    from prefect_sandbox.sandbox.outputs import StreamLogThrottle

    throttle = StreamLogThrottle(interval_s=5.0, max_chars=1000)
    logged = [
        text
        for n in range(1, 201)
        if (text := throttle.feed(f"\r{n:3d}/200 \x1b[32m|{'#' * (n // 20)}", n * 0.01))
    ]
    assert logged == ["  1/200 |"]
    assert throttle.feed("\n", 2.5) == "200/200 |##########"
    assert throttle.flush() is None


def test_an_unfinished_line_is_logged_once_per_interval_then_flushed_at_the_cells_end() -> None:
    from prefect_sandbox.sandbox.outputs import StreamLogThrottle

    throttle = StreamLogThrottle(interval_s=5.0, max_chars=1000)
    assert throttle.feed("line 1\nline 2\nwork", 0.0) == "line 1\nline 2\nwork"
    assert throttle.feed("ing", 1.0) is None  # within the interval
    assert throttle.feed(".", 4.9) is None
    assert throttle.feed(".", 5.0) == "working.."
    assert throttle.feed("\r10%", 6.0) is None
    assert throttle.flush() == "10%king.."  # as a terminal shows it
    assert throttle.flush() is None
    # A line that never ends is logged when it passes max_chars, and starts anew.
    long = StreamLogThrottle(interval_s=5.0, max_chars=10)
    assert long.feed("x" * 4, 0.0) == "xxxx"
    assert long.feed("y" * 8, 1.0) == "xxxxyyyyyyyy"
    assert long.feed("z", 2.0) == "z"


def test_help_notebook_types_literal_defaults_and_leaves_expressions_unknown() -> None:
    from prefect_sandbox.sandbox.notebook import notebook_parameters

    notebook = nbformat.v4.new_notebook()
    notebook.cells = [
        nbformat.v4.new_code_cell(
            "a = 'x'\nb = 1\nc = 0.5\nd = True\ne = None\nf = [1, 2]\ng = {'k': 1}\n"
            "h = compute()\ni: int = 'annotation wins'\nj = -3\n",
            metadata={"tags": ["parameters"]},
        )
    ]
    found = notebook_parameters(notebook)
    assert found is not None
    assert [(p.name, p.type_name) for p in found] == [
        ("a", "str"),
        ("b", "int"),
        ("c", "float"),
        ("d", "bool"),
        ("e", "None"),
        ("f", "list"),
        ("g", "dict"),
        ("h", None),
        ("i", "int"),
        ("j", "int"),
    ]


def test_a_notebooks_parameters_become_a_json_schema_with_types_defaults_and_comments() -> None:
    import jsonschema

    from prefect_sandbox.sandbox.parameter_schema import notebook_parameters_schema

    notebook = nbformat.v4.new_notebook()
    notebook.cells = [
        nbformat.v4.new_code_cell(
            "n: int = 3  # how many\nalpha = 0.5\nend: datetime.date = '1996-12-31'\n"
            "tags: list[str] = ['a']\nmode: Literal['fit', 'score'] = 'fit'\n"
            "limit: int | None = None\nseed = make_seed()  # from the clock\n"
            "weights: dict[str, float] = {}\nmodel: Model = Model()\n",
            metadata={"tags": ["parameters"]},
        )
    ]
    schema = notebook_parameters_schema(notebook)
    fields = schema["properties"]
    names = ["n", "alpha", "end", "tags", "mode", "limit", "seed", "weights", "model"]
    assert list(fields) == names
    assert fields["n"] == {
        "title": "n",
        "position": 0,
        "type": "integer",
        "default": 3,
        "description": "how many",
    }
    assert (fields["alpha"]["type"], fields["alpha"]["default"]) == ("number", 0.5)
    assert (fields["end"]["type"], fields["end"]["format"]) == ("string", "date")
    assert fields["tags"]["items"] == {"type": "string"}
    assert fields["mode"]["enum"] == ["fit", "score"]
    assert fields["limit"]["anyOf"] == [{"type": "integer"}, {"type": "null"}]
    assert "type" not in fields["seed"] and "default" not in fields["seed"]
    assert fields["seed"]["description"] == "from the clock; default in the notebook: make_seed()"
    assert fields["weights"]["additionalProperties"] == {"type": "number"}
    assert "type" not in fields["model"]  # a class of the notebook's own: any value
    jsonschema.validate({"n": 4, "limit": None, "mode": "score", "model": [1]}, schema)
    for wrong in ({"n": "four"}, {"mode": "guess"}, {"tags": [1]}, {"limit": 1.5}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)


PRIVATE_NAMES = frozenset(
    {"_block_document_id", "_block_document_name", "_join_bucket_folder", "_register_atexit"}
    | {"SubprocessASGIServer", "GLOBAL_SETTINGS_CONTEXT"}
)
"""Private or internal names of Prefect, prefect-aws and CPython (see `prefect_sandbox._compat`
and, for CPython's, `prefect_sandbox.sandbox._compat`)."""
PRIVATE_KEYWORDS = frozenset({"_sync"})
"""Private keyword arguments: Prefect's ``async_dispatch`` takes ``_sync``."""


def _private_uses(source: str) -> set[str]:
    """The private names and keywords that code (not its docstrings or comments) reaches."""
    names, keywords = set(), set()
    for node in ast.walk(parse_python(source)):
        if isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.ImportFrom | ast.Import):
            names |= {alias.name.rsplit(".", 1)[-1] for alias in node.names}
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.add(node.value)
        elif isinstance(node, ast.keyword) and node.arg is not None:
            keywords.add(node.arg)
    return (names & PRIVATE_NAMES) | (keywords & PRIVATE_KEYWORDS)


def test_private_apis_are_reached_only_through_the_compat_module() -> None:
    package = Path(__file__).resolve().parent.parent / "prefect_sandbox"
    reaching = {
        path.relative_to(package).as_posix(): _private_uses(path.read_text())
        for path in package.rglob("*.py")
        if path.name != "_compat.py"
    }
    assert {path: names for path, names in reaching.items() if names} == {}
    compat_modules = (package / "_compat.py", package / "sandbox" / "_compat.py")
    reached = set().union(*(_private_uses(path.read_text()) for path in compat_modules))
    assert reached == PRIVATE_NAMES | PRIVATE_KEYWORDS


class _CyclicGarbage:
    """Its collection runs Python code (``__del__``), which lets another thread take the GIL in
    the middle of building an AST."""

    def __init__(self) -> None:
        self.me = self

    def __del__(self) -> None:
        time.sleep(0)


def test_parse_python_survives_threads_building_asts_at_once() -> None:
    """CPython 3.11's AST depth counter is shared by all threads (gh-106905): with plain
    `ast.parse` here, about one parse in 600 fails with a SystemError on CPython 3.11.7."""
    source = "\n".join(f"def f{n}(x):\n    return [x for x in range({n})]" for n in range(300))
    failures: list[str] = []
    sizes: list[int] = []

    def parse_among_garbage() -> None:
        for _ in range(150):
            for _ in range(50):
                _CyclicGarbage()
            try:
                sizes.append(len(parse_python(source).body))
            except SystemError as exc:
                failures.append(str(exc))

    threads = [threading.Thread(target=parse_among_garbage) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    assert sizes == [300] * 600


# As ipykernel 6 on IPython 8+ sends them (the error message's ``traceback``), colours included.
_RUNTIME_TRACEBACK = [
    "\x1b[31m---------------------------------------------------------------------------\x1b[39m",
    "\x1b[31mZeroDivisionError\x1b[39m                         Traceback (most recent call last)",
    "\x1b[36mCell\x1b[39m\x1b[36m \x1b[39m\x1b[32mIn[4]\x1b[39m\x1b[32m, line 4\x1b[39m\n"
    "\x1b[32m      1\x1b[39m \x1b[38;5;28;01mdef\x1b[39;00m f(x):\n"
    "\x1b[32m----> 4\x1b[39m c = f(\x1b[32m0\x1b[39m)\n",
    "\x1b[36mCell\x1b[39m\x1b[36m \x1b[39m\x1b[32mIn[4]\x1b[39m\x1b[32m, line 2\x1b[39m, in f(x)\n"
    "\x1b[32m----> 2\x1b[39m     \x1b[38;5;28;01mreturn\x1b[39;00m 1 / x\n",
    "\x1b[31mZeroDivisionError\x1b[39m: division by zero",
]
_SYNTAX_TRACEBACK = [
    "  \x1b[36mCell\x1b[39m\x1b[36m \x1b[39m\x1b[32mIn[1]\x1b[39m\x1b[32m, line 2\x1b[39m\n"
    "\x1b[31m    \x1b[39m\x1b[31mx = (\x1b[39m\n         ^\n"
    "\x1b[31mSyntaxError\x1b[39m\x1b[31m:\x1b[39m incomplete input\n"
]


def test_the_failing_line_is_the_cells_own_frame_in_ipythons_traceback() -> None:
    source = "def f(x):\n    return 1 / x\n\nc = f(0)\nprint(c)"
    # The cell's own (outermost) frame, not the function's it called.
    assert failing_line(source, _RUNTIME_TRACEBACK) == (4, "c = f(0)")
    assert failing_line("y = 1\nx = (", _SYNTAX_TRACEBACK) == (2, "x = (")
    assert failing_line("x = 1", ["KeyboardInterrupt"]) is None
    assert failing_line("x = 1", _SYNTAX_TRACEBACK) is None  # line 2 of a one-line cell
    assert failing_line("  " + "a" * 500, ["Cell In[1], line 1"]) == (1, "a" * 200)


def test_a_cells_number_is_its_index_in_the_notebook_as_written_whatever_was_injected() -> None:
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [
        nbformat.v4.new_markdown_cell("# Load"),
        nbformat.v4.new_code_cell("a = 1", metadata={"tags": ["parameters"]}),
        nbformat.v4.new_code_cell("b = a"),
    ]
    before = [(c.index, c.number, c.label) for s in split_stages(notebook) for c in s.cells]
    assert before == [(1, 1, "cell 1"), (2, 2, "cell 2")]
    injected = inject_parameters(notebook, {"a": 5})
    after = [(c.index, c.number, c.label) for s in split_stages(injected) for c in s.cells]
    assert after == [(1, 1, "cell 1"), (2, None, "injected parameters cell"), (3, 2, "cell 2")]
