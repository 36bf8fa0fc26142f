"""What a sweep shows of its branches: the rows of the ``sweep-summary`` table artifact, with
the key metrics read from each branch's metrics file (`prefect_sandbox.flows.metrics`). Pure
functions. Manual: docs/how-to/sweeps.md.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from prefect_sandbox.flows.metrics import Metric
from prefect_sandbox.flows.sweep.model import SWEEP_NAME
from prefect_sandbox.markdown_text import table_cell, table_header
from prefect_sandbox.results import SweepResult
from prefect_sandbox.sandbox.outputs import strip_ansi

__all__ = ["METRIC_COLUMNS", "TABLE_ROWS_SHOWN", "sweep_table", "sweep_text_table"]

METRIC_COLUMNS = 8
"""Metrics shown as columns of the table artifact at most (all are in ``sweep.json``)."""
TABLE_ROWS_SHOWN = 500
"""Branches listed in the table artifact at most (all are in ``sweep.json``)."""


_FIXED_COLUMNS = ("branch", "flow run", "status", "parameters", "location", "error")


def _metric_text(value: Metric) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def _parameters_text(parameters: Mapping[str, Any]) -> str:
    return ", ".join(
        f"{name}={json.dumps(value, default=str)}" for name, value in parameters.items()
    )


def _metric_columns(names: list[str]) -> dict[str, str]:
    """Each metric name to its column's name: unique, none a fixed column's."""
    taken = set(_FIXED_COLUMNS)
    columns = {}
    for name in names:
        column = table_header(name)
        if column in _FIXED_COLUMNS:
            column = f"metric {column}"
        base, number = column, 2
        while column in taken:
            column, number = f"{base} ({number})", number + 1
        taken.add(column)
        columns[name] = column
    return columns


def sweep_table(result: SweepResult) -> list[dict[str, str]]:
    """Rows of the sweep's table artifact: one per branch (at most `TABLE_ROWS_SHOWN`, then
    one row saying how many more there are), with its parameters, status, flow run, the first
    `METRIC_COLUMNS` metric names seen as columns, its location and error.

    Every text a branch could choose (parameters, metric values, errors, names) is escaped and
    cut as `table_cell` does; metric names, shown as column names (plain text), as
    `table_header` does, a name taken already (a fixed column's included) getting a
    ``metric`` prefix or a number.

    Returns:
        Rows, each a mapping of column name to text.
    """
    names: list[str] = []
    for branch in result.branches:
        names += [name for name in branch.metrics if name not in names]
    columns = _metric_columns(names[:METRIC_COLUMNS])
    rows = []
    for branch in result.branches[:TABLE_ROWS_SHOWN]:
        row = {
            "branch": str(branch.index),
            "flow run": table_cell(branch.flow_run_name or ""),
            "status": branch.status,
            "parameters": table_cell(_parameters_text(branch.parameters)),
        }
        for name, column in columns.items():
            value = branch.metrics.get(name, "")
            row[column] = table_cell(_metric_text(value)) if name in branch.metrics else ""
        row["location"] = table_cell(branch.output_dir or "")
        row["error"] = table_cell(branch.error or "")
        rows.append(row)
    rest = len(result.branches) - TABLE_ROWS_SHOWN
    if rest > 0:
        rows.append({"branch": f"… and {rest} more branch(es), all listed in {SWEEP_NAME}"})
    return rows


TEXT_CELL_CHARS = 40
"""Characters of one cell of the CLI's table at most; longer ones end in ``…``."""


def _text_cell(text: str) -> str:
    """A branch's text for a terminal: no controls, on one line, cut at `TEXT_CELL_CHARS`."""
    flat = " ".join(strip_ansi(text).split())
    return flat if len(flat) <= TEXT_CELL_CHARS else flat[: TEXT_CELL_CHARS - 1] + "…"


def sweep_text_table(result: SweepResult) -> list[str]:
    """The CLI's table of a sweep's branches, the artifact's columns as plain text: branch,
    status, parameters, the first `METRIC_COLUMNS` metrics, and the branch's folder (all
    branches; a branch's texts without terminal controls, cut at `TEXT_CELL_CHARS`).

    Returns:
        Lines, a header first, columns padded to line up; the folder column uncut, last.
    """
    names: list[str] = []
    for branch in result.branches:
        names += [name for name in branch.metrics if name not in names]
    names = names[:METRIC_COLUMNS]
    header = ["branch", "status", "parameters", *(_text_cell(name) for name in names), "folder"]
    rows = [header]
    for branch in result.branches:
        metrics = [
            _text_cell(_metric_text(branch.metrics[name])) if name in branch.metrics else "-"
            for name in names
        ]
        parameters = _text_cell(_parameters_text(branch.parameters)) or "-"
        folder = strip_ansi(branch.output_dir or "-")
        rows.append([str(branch.index), branch.status, parameters, *metrics, folder])
    widths = [max(len(row[column]) for row in rows) for column in range(len(header) - 1)]
    return [
        "  ".join([*(cell.ljust(width) for cell, width in zip(row, widths, strict=False)), row[-1]])
        for row in rows
    ]
