"""A cell's result as text for a language model to read. Pure functions.

An agent that writes code as it goes reads what each cell printed or raised before writing the
next one (E2B's guide to code tools for LLMs, MathModelAgent's CoderAgent). The rendering keeps
what a model can use and nothing it cannot: stdout and stderr as a terminal ends up showing them,
the ``text/plain`` of results and displays, the names under which displayed figures are stored,
and the error's name, message and traceback without colour codes (IPython's names the cell's
failing line). Base64 images and HTML are left out.
"""

from __future__ import annotations

from typing import Any

from prefect_sandbox.sandbox.base import CellResult
from prefect_sandbox.sandbox.notebook import inline_figure_path
from prefect_sandbox.sandbox.outputs import cap_text, collapse_carriage_returns, strip_ansi

__all__ = ["DEFAULT_MODEL_TEXT_CHARS", "NO_OUTPUT", "cell_text"]

DEFAULT_MODEL_TEXT_CHARS = 8000
"""Characters of a cell's rendering a model gets by default (about 2,000 tokens)."""
NO_OUTPUT = "(no output)"
"""The rendering of a cell that ran and showed nothing."""

_IMAGE_TYPES = ("image/png", "image/jpeg", "image/svg+xml")


def _plain(text: str) -> str:
    return collapse_carriage_returns(strip_ansi(text)).rstrip("\n")


def _rich(output: dict[str, Any], cell_index: int | None, pngs: int) -> tuple[str, int]:
    """A display's or result's text, and how many PNGs were counted so far in the cell."""
    data = output.get("data", {})
    parts = []
    for mime in _IMAGE_TYPES:
        if mime not in data:
            continue
        if mime == "image/png":
            pngs += 1
            if cell_index is not None:
                parts.append(f"[figure {inline_figure_path(cell_index, pngs)}]")
                continue
        parts.append(f"[figure: {mime}]")
    if not parts and "text/plain" in data:
        text = data["text/plain"]
        parts.append(_plain(text if isinstance(text, str) else "".join(text)))
    return "\n".join(parts), pngs


def cell_text(
    result: CellResult, *, cell_index: int | None = None, max_chars: int = DEFAULT_MODEL_TEXT_CHARS
) -> str:
    """Render a cell's outputs, in the order they came, as text for a model.

    Stdout as printed; stderr under a ``[stderr]`` line; an ``execute_result`` under
    ``[result]``; a display's ``text/plain``, or ``[figure inline-figures/cell-004-1.png]`` for
    a PNG (the name the flow stores it under) and ``[figure: image/svg+xml]`` for others; an
    error as ``[error] Name: message`` and its traceback, ANSI codes removed. A timed-out cell
    ends with ``[error] CellTimeoutError: ...`` (after the kernel's ``KeyboardInterrupt``, if
    it sent one).

    Args:
        result: the cell's result.
        cell_index: the cell's 0-based index in the executed notebook, to name its figures;
            None names them by type only.
        max_chars: the most characters returned; past it the start and end are kept with a
            marker between them saying how many characters were left out (`cap_text`).

    Returns:
        The text; `NO_OUTPUT` when the cell showed nothing.

    Raises:
        ValueError: ``max_chars`` is below 100.
    """
    if max_chars < 100:
        raise ValueError(f"max_chars must be at least 100, not {max_chars}")
    blocks: list[str] = []
    pngs = 0
    for output in result.outputs:
        kind = output["output_type"]
        if kind == "stream":
            text = _plain(output["text"])
            blocks.append(text if output["name"] == "stdout" else f"[stderr]\n{text}")
        elif kind == "error":
            lines = [strip_ansi(line) for line in output.get("traceback", [])]
            head = f"[error] {output['ename']}: {strip_ansi(output['evalue'])}"
            blocks.append("\n".join([head, *lines]).rstrip("\n"))
        else:
            text, pngs = _rich(output, cell_index, pngs)
            if text:
                blocks.append(f"[result]\n{text}" if kind == "execute_result" else text)
    error = result.error
    shown = {output.get("ename") for output in result.outputs}
    if result.status == "timeout" and error is not None and error.ename not in shown:
        # The kernel's own KeyboardInterrupt says nothing of the deadline; this does.
        blocks.append(f"[error] {error.ename}: {error.evalue}")
    rendered = "\n".join(block for block in blocks if block)
    return cap_text(rendered, max_chars) if rendered else NO_OUTPUT
