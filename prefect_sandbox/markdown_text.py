"""Untrusted text made inert for what a person reads in the Prefect UI: Markdown (summaries,
table artifacts' cells) and table column names. Pure functions.

A cell chooses file names, error messages, stage and metric names: nothing it writes may become
HTML, a link, an image, emphasis or table syntax, a terminal control (an OSC 52 clipboard
write, a screen clear), a line break or a bidirectional override that reorders what is shown.
The manual's page: docs/concepts.md.
"""

from __future__ import annotations

import re

from prefect_sandbox.sandbox.outputs import strip_ansi

__all__ = ["CELL_CHARS", "code_span", "escape_markdown", "table_cell", "table_header"]

CELL_CHARS = 300
"""Characters of one untrusted text (an error, a name) shown at most."""

_HTML = {"&": "&amp;", "<": "&lt;", ">": "&gt;"}
_MARKDOWN = frozenset("\\`*_[]|~@")
# GFM autolinks (http://..., www....) become links by themselves; an escaped ':' or '.' stops it.
_AUTOLINK = re.compile(r"(?i)(?<=[a-z]):(?=//)|(?<=www)\.")
# Controls and line breaks, C1 included, and the bidirectional marks, embeddings, overrides and
# isolates (Trojan Source, CVE-2021-42574) become one space.
_WHITESPACE = re.compile(r"[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069]+")


def escape_markdown(text: str) -> str:
    """``text`` as literal markdown: no HTML, link, image, emphasis or table syntax in it.

    HTML's ``& < >`` become entities; markdown's ``\\ ` * _ [ ] | ~ @`` and the ``:`` of
    ``scheme://`` and the ``.`` of ``www.`` are backslash-escaped (CommonMark allows that for
    any ASCII punctuation); control characters, line breaks and bidirectional controls become
    one space.

    Args:
        text: any text, e.g. an exception message a cell chose.

    Returns:
        Markdown that renders as ``text`` on one line.
    """
    text = _WHITESPACE.sub(" ", text)
    autolink = {match.start() for match in _AUTOLINK.finditer(text)}
    escaped = []
    for index, char in enumerate(text):
        if char in _HTML:
            escaped.append(_HTML[char])
        elif char in _MARKDOWN or index in autolink:
            escaped.append(f"\\{char}")
        else:
            escaped.append(char)
    return "".join(escaped)


def code_span(text: str) -> str:
    """``text`` as an inline code span: fenced by more backticks than it holds in a row."""
    text = _WHITESPACE.sub(" ", text)[:CELL_CHARS]
    fence = "`" * (max((len(run) for run in re.findall("`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def table_cell(text: str) -> str:
    """Untrusted text safe inside a markdown table cell, cut at `CELL_CHARS` characters."""
    return escape_markdown(strip_ansi(text)[:CELL_CHARS])


def table_header(text: str) -> str:
    """Untrusted text as a table artifact's column name, cut at `CELL_CHARS` characters.

    The Prefect UI shows column names as plain text, not markdown, so nothing is escaped (an
    escape would show, as ``mae\\_ppm``); ANSI codes are removed and control characters, line
    breaks and bidirectional controls become one space.
    """
    return _WHITESPACE.sub(" ", strip_ansi(text))[:CELL_CHARS]
