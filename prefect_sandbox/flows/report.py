"""What a finished run shows in the Prefect UI: a markdown summary. Pure functions.

Everything in it that a cell or a notebook could choose (error messages, file names, stage and
flow-run names) is escaped, so the only links and images are the ones built here, and it is
capped: at most `ROWS_SHOWN` stages and stored files and `FIGURES_SHOWN` figures, each cut
list ending with a line saying how many more there are in ``summary.json``, and each text cut
at `CELL_CHARS` characters. So its text stays under about 1 MB whatever a run made (10,000
stored files: about 15 kB), plus the ``data:`` URIs of the figures the caller chose to embed.
Manual: docs/concepts.md.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from prefect_sandbox.markdown_text import code_span, table_cell
from prefect_sandbox.results import PipelineResult
from prefect_sandbox.sandbox.notebook import cell_label

__all__ = ["FIGURES_SHOWN", "ROWS_SHOWN", "summary_markdown"]

ROWS_SHOWN = 100
"""Stages, and stored files, listed in the summary at most."""
FIGURES_SHOWN = 50
"""Figures shown in the summary at most."""


def _url(url: str) -> str:
    """A URL we built, percent-encoding what could end a markdown link destination early."""
    return re.sub(r"[\s()<>\\]", lambda match: f"%{ord(match.group()):02X}", url)


def _more(count: int, what: str) -> str:
    return f"… and {count} more {what}; all are listed in `summary.json`."


def _name_value_table(title: str, column: str, values: Mapping[str, Any]) -> list[str]:
    """A section with a two-column table of ``values`` (at most `ROWS_SHOWN` rows, each value
    as JSON); no lines when ``values`` is empty."""
    if not values:
        return []
    lines = ["", f"## {title}", "", f"| {column} | value |", "|---|---|"]
    for name, value in list(values.items())[:ROWS_SHOWN]:
        text = json.dumps(value, default=str)
        lines.append(f"| {table_cell(name)} | {table_cell(text)} |")
    if len(values) > ROWS_SHOWN:
        lines += ["", _more(len(values) - ROWS_SHOWN, f"{column}(s)")]
    return lines


def _warning_lines(warnings: list[str]) -> list[str]:
    """The summary's list of what the run could not do (`PipelineResult.warnings`)."""
    if not warnings:
        return []
    lines = ["", "**Warnings:**", ""]
    lines += [f"- {table_cell(warning)}" for warning in warnings[:ROWS_SHOWN]]
    if len(warnings) > ROWS_SHOWN:
        lines += ["", _more(len(warnings) - ROWS_SHOWN, "warning(s)")]
    return lines


def summary_markdown(result: PipelineResult, figure_urls: Mapping[str, str | None]) -> str:
    """The run's summary: status, stages, errors with cell index, injected parameters, key
    metrics, figures and stored files.

    Args:
        result: the pipeline's result.
        figure_urls: stored PNG's path to a URL a browser can open, ``data:`` URIs included
            (shown as an image), or None (only its location is listed; a local path does not
            open from the UI).

    Returns:
        Markdown for a Prefect markdown artifact: its text is capped (see the module), its
        size is that plus the figures' ``data:`` URIs.
    """
    lines = [
        f"# {table_cell(result.flow_run_name)}: {result.status}",
        "",
        f"{len(result.stages)} stage(s) in {result.duration_s:.1f} s; "
        f"stored in {code_span(result.output_dir)}.",
        "",
        "| stage | status | cells | duration (s) | error |",
        "|---|---|---|---|---|",
    ]
    for stage in result.stages[:ROWS_SHOWN]:
        error = ""
        if stage.ename:
            where = cell_label(stage.failed_cell_index)
            if stage.failed_line is not None:
                where += f", line {stage.failed_line} ({stage.failed_code or ''})"
            error = table_cell(f"{where}: {stage.ename}: {stage.evalue or ''}")
        row = [
            table_cell(stage.name),
            stage.status,
            str(stage.cell_count),
            f"{stage.duration_s:.2f}",
        ]
        lines.append(f"| {' | '.join([*row, error])} |")
    if len(result.stages) > ROWS_SHOWN:
        lines += ["", _more(len(result.stages) - ROWS_SHOWN, "stage(s)")]
    if result.error:
        lines += ["", f"**Error:** {table_cell(result.error)}"]
    lines += _warning_lines(result.warnings)
    lines += _name_value_table("Parameters", "parameter", result.parameters)
    lines += _name_value_table("Metrics", "metric", result.metrics)
    figures = [a for a in result.artifacts if a.path in figure_urls]
    if figures:
        lines += ["", "## Figures", ""]
        for artifact in figures[:FIGURES_SHOWN]:
            url = figure_urls[artifact.path]
            if url:
                lines.append(f"![{table_cell(artifact.path)}]({_url(url)})")
            else:
                lines.append(f"- {code_span(artifact.path)}: {code_span(artifact.location)}")
        if len(figures) > FIGURES_SHOWN:
            lines += ["", _more(len(figures) - FIGURES_SHOWN, "figure(s)")]
    lines += ["", "## Stored files", "", "| path | bytes | sha256 |", "|---|---|---|"]
    shown = result.artifacts[:ROWS_SHOWN]
    lines += [f"| {table_cell(a.path)} | {a.size_bytes} | `{a.sha256[:16]}…` |" for a in shown]
    if len(result.artifacts) > ROWS_SHOWN:
        rest = result.artifacts[ROWS_SHOWN:]
        total = sum(a.size_bytes for a in rest)
        lines += ["", _more(len(rest), f"file(s) ({total} bytes)")]
    return "\n".join(lines) + "\n"
