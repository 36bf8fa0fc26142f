"""What a finished run shows in the Prefect UI: a markdown summary. Pure functions."""

from __future__ import annotations

from collections.abc import Mapping

from prefect_sandbox.results import PipelineResult
from prefect_sandbox.sandbox.outputs import strip_ansi

__all__ = ["summary_markdown"]


def _cell(text: str) -> str:
    """Text safe inside a markdown table cell."""
    return strip_ansi(text).replace("|", "\\|").replace("\n", " ")[:300]


def summary_markdown(result: PipelineResult, figure_urls: Mapping[str, str | None]) -> str:
    """The run's summary: status, stages, errors with cell index, figures and stored files.

    Args:
        result: the pipeline's result.
        figure_urls: stored PNG's path to a URL a browser can open, ``data:`` URIs included
            (shown as an image), or None (only its location is listed; a local path does not
            open from the UI).

    Returns:
        Markdown for a Prefect markdown artifact.
    """
    lines = [
        f"# {result.flow_run_name}: {result.status}",
        "",
        f"{len(result.stages)} stage(s) in {result.duration_s:.1f} s; "
        f"stored in `{result.output_dir}`.",
        "",
        "| stage | status | cells | duration (s) | error |",
        "|---|---|---|---|---|",
    ]
    for stage in result.stages:
        error = ""
        if stage.ename:
            error = _cell(f"cell {stage.failed_cell_index}: {stage.ename}: {stage.evalue or ''}")
        row = [stage.name, stage.status, str(stage.cell_count), f"{stage.duration_s:.2f}", error]
        lines.append(f"| {' | '.join(row)} |")
    if result.error:
        lines += ["", f"**Error:** {_cell(result.error)}"]
    if figure_urls:
        lines += ["", "## Figures", ""]
        for artifact in result.artifacts:
            if artifact.path not in figure_urls:
                continue
            url = figure_urls[artifact.path]
            if url:
                lines.append(f"![{artifact.path}]({url})")
            else:
                lines.append(f"- `{artifact.path}`: `{artifact.location}`")
    lines += ["", "## Stored files", "", "| path | bytes | sha256 |", "|---|---|---|"]
    lines += [f"| {_cell(a.path)} | {a.bytes} | `{a.sha256[:16]}…` |" for a in result.artifacts]
    return "\n".join(lines) + "\n"
