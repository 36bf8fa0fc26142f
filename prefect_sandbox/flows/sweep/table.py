"""What a sweep shows of its branches: the key metrics read from each branch's stored metrics
file, and the rows of the ``sweep-summary`` table artifact. Pure functions."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from prefect_sandbox.flows.report import table_cell, table_header
from prefect_sandbox.flows.sweep.model import SWEEP_NAME
from prefect_sandbox.results import SweepResult
from prefect_sandbox.sandbox.outputs import cap_text

__all__ = [
    "METRICS_KEPT",
    "METRICS_MAX_BYTES",
    "METRIC_COLUMNS",
    "METRIC_TEXT_CHARS",
    "TABLE_ROWS_SHOWN",
    "Metric",
    "metrics_of",
    "sweep_table",
]

METRICS_KEPT = 50
"""Metrics kept per branch in ``sweep.json`` at most."""
METRICS_MAX_BYTES = 1 << 20
"""A stored metrics file larger than this is not read (it is a notebook's output: untrusted)."""
METRIC_TEXT_CHARS = 100
"""Characters of a metric's name, or of its value when a string, kept at most."""
METRIC_COLUMNS = 8
"""Metrics shown as columns of the table artifact at most (all are in ``sweep.json``)."""
TABLE_ROWS_SHOWN = 500
"""Branches listed in the table artifact at most (all are in ``sweep.json``)."""

Metric = float | int | bool | str | None


def metrics_of(data: bytes) -> tuple[dict[str, Metric], str | None]:
    """The key metrics in a branch's stored metrics file: its top-level numbers, booleans,
    nulls and strings, in order, at most `METRICS_KEPT`, names and strings cut at
    `METRIC_TEXT_CHARS` characters.

    Args:
        data: the file's content (a notebook wrote it: anything).

    Returns:
        The metrics, and why there are none when the file is no JSON object (else None).
    """
    try:
        value = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        return {}, f"not JSON: {cap_text(str(exc), 200)}"
    if not isinstance(value, dict):
        return {}, f"a JSON {type(value).__name__}, not an object"
    kept: dict[str, Metric] = {}
    for name, item in value.items():
        if len(kept) == METRICS_KEPT:
            break
        if isinstance(item, str):
            item = item[:METRIC_TEXT_CHARS]
        elif item is not None and not isinstance(item, bool | int | float):
            continue
        kept[name[:METRIC_TEXT_CHARS]] = item
    return kept, None


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
