"""A cell's result as text for a language model to read. Pure functions.

An agent that writes code as it goes reads what each cell printed or raised before writing the
next one. Invariant of every text made here: the only control character in it is the newline
(ANSI sequences and every other control removed, tabs expanded, ``\\r`` applied as a terminal
does) and bidirectional controls are shown as ``<U+202E>``, not acted on. `cell_text` also
fences what the cell produced: outside fences every line is ours; inside, the cell's text, in a
CommonMark code fence longer than any run of backticks in it, so nothing a cell prints can
close it or pass for ours (docs/how-to/agents.md, "What the model reads"). Markdown, LaTeX,
JSON and HTML-only results are given as text; images by the names the flow stores them under.
`mathmodelagent_text` gives the shape MathModelAgent's own interpreters give its CoderAgent.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from html.parser import HTMLParser
from typing import Any

from prefect_sandbox.sandbox.base import CellResult
from prefect_sandbox.sandbox.notebook import inline_figure_path
from prefect_sandbox.sandbox.outputs import cap_text, collapse_carriage_returns, strip_ansi

__all__ = [
    "DEFAULT_MODEL_TEXT_CHARS",
    "MATHMODELAGENT_BLOCK_CHARS",
    "MATHMODELAGENT_IMAGE",
    "NO_OUTPUT",
    "cell_text",
    "mathmodelagent_error",
    "mathmodelagent_text",
    "model_safe",
    "rich_text",
]

DEFAULT_MODEL_TEXT_CHARS = 8000
"""Characters of a cell's rendering a model gets by default (about 2,000 tokens)."""
NO_OUTPUT = "(no output)"
"""The rendering of a cell that ran and showed nothing."""
MATHMODELAGENT_BLOCK_CHARS = 1000
"""Characters of each block of `mathmodelagent_text` at most, as MathModelAgent's interpreters
cut each one (``BaseCodeInterpreter._truncate_text``, 1,000 by default)."""

_IMAGE_TYPES = ("image/png", "image/jpeg", "image/svg+xml")
_BIDI_CONTROLS = "\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069"
_NEUTRALISED = {ord(c): f"<U+{ord(c):04X}>" for c in _BIDI_CONTROLS} | {
    0x2028: "\n",  # line and paragraph separators: line breaks to some parsers, not to others
    0x2029: "\n",
}
# IPython's repr of an object that has a rich repr only: `<IPython.core.display.Markdown object>`.
_DEFAULT_REPR = re.compile(r"<[\w.]+(?: object)?(?: at 0x[0-9a-fA-F]+)?>")
_BACKTICKS = re.compile(r"`+")


def model_safe(text: str) -> str:
    """``text`` as a model should get it: ANSI sequences and every control character removed
    but the newline, ``\\r`` applied as a terminal does, tabs expanded to 8-column stops,
    bidirectional controls (U+202A-202E, U+2066-2069, U+200E, U+200F, U+061C) shown as
    ``<U+202E>``, U+2028 and U+2029 as newlines."""
    shown = collapse_carriage_returns(strip_ansi(text)).replace("\r", "")
    return shown.expandtabs().translate(_NEUTRALISED)


class _HTMLText(HTMLParser):
    """The text of an HTML fragment: block elements on lines of their own, table cells joined
    with `` | ``, scripts and styles dropped, runs of whitespace as one space (in ``<pre>``
    too, but for its line breaks)."""

    _BLOCKS = frozenset(
        {
            *("address", "article", "aside", "blockquote", "br", "caption", "dd", "div", "dl"),
            *("dt", "figcaption", "figure", "footer", "form", "h1", "h2", "h3", "h4", "h5", "h6"),
            *("header", "hr", "li", "main", "nav", "ol", "p", "pre", "section", "table"),
            *("tbody", "thead", "tfoot", "tr", "ul"),
        }
    )
    _CELLS = frozenset({"td", "th"})
    _HIDDEN = frozenset({"script", "style", "head", "title"})

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.lines: list[str] = [""]
        self._hidden = 0
        self._pre = 0
        self._cells = 0

    def _newline(self) -> None:
        self.lines.append("")
        self._cells = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in self._HIDDEN:
            self._hidden += 1
        elif tag in self._CELLS:
            if self._cells:
                self.lines[-1] += " | "
            self._cells += 1
        elif tag in self._BLOCKS:
            self._pre += tag == "pre"
            self._newline()

    def handle_endtag(self, tag: str) -> None:
        if tag in self._HIDDEN:
            self._hidden = max(self._hidden - 1, 0)
        elif tag in self._BLOCKS:
            self._pre = max(self._pre - (tag == "pre"), 0)
            self._newline()

    def handle_data(self, data: str) -> None:
        if self._hidden:
            return
        first, *rest = data.split("\n") if self._pre else [data]
        self.lines[-1] += first
        self.lines.extend(rest)

    def text(self) -> str:
        lines = (" ".join(line.split()) for line in self.lines)
        return "\n".join(line for line in lines if line)


def _html_text(html: str) -> str:
    parser = _HTMLText()
    parser.feed(html)
    parser.close()
    return parser.text()


def _joined(value: Any) -> str:
    return value if isinstance(value, str) else "".join(value)


def rich_text(data: dict[str, Any]) -> str | None:
    """The text a model can use of a MIME bundle (a result's or display's ``data``), or None.

    ``text/markdown`` first; then ``text/plain``, unless it is only an object's default repr
    (``<IPython.core.display.Markdown object>``); then ``text/latex``, ``application/json``
    (indented), the text of ``text/html``; a default repr last.
    """
    plain = _joined(data["text/plain"]) if "text/plain" in data else None
    if "text/markdown" in data:
        return _joined(data["text/markdown"])
    if plain is not None and not _DEFAULT_REPR.fullmatch(plain.strip()):
        return plain
    if "text/latex" in data:
        return _joined(data["text/latex"])
    if "application/json" in data:
        return json.dumps(data["application/json"], indent=2, ensure_ascii=False)
    if "text/html" in data:
        return _html_text(_joined(data["text/html"]))
    return plain


@dataclass(frozen=True)
class _Part:
    """One piece of a rendering: ``body`` None is a line of ours (``line``); otherwise the
    cell's text, fenced with ``line`` as the fence's info string."""

    line: str
    body: str | None = None

    @property
    def size(self) -> int:
        return len(self.body if self.body is not None else self.line)


def _fenced(info: str, body: str) -> str:
    longest = max((len(run) for run in _BACKTICKS.findall(body)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}{info}\n{body}\n{fence}"


def _render(parts: list[_Part]) -> str:
    return "\n".join(_fenced(p.line, p.body) if p.body is not None else p.line for p in parts)


def _kept(parts: list[_Part], budget: int, *, from_end: bool) -> tuple[list[_Part], int]:
    """The parts that the first (or last) ``budget`` characters of the output stream reach,
    in order: our lines whole or not at all, the cell's text cut; and the characters kept."""
    kept: list[_Part] = []
    used = 0
    for part in reversed(parts) if from_end else parts:
        room = budget - used
        if room <= 0 or (part.body is None and part.size > room):
            break
        if part.body is not None and part.size > room:
            body = part.body[len(part.body) - room :] if from_end else part.body[:room]
            part = _Part(part.line, body)
        kept.append(part)
        used += part.size
    return (kept[::-1] if from_end else kept), used


def _capped(parts: list[_Part], max_chars: int) -> str:
    """The rendering in at most ``max_chars``: the start and end of the output stream, and
    between them, outside any fence, a line saying how many characters were left out."""
    total = sum(part.size for part in parts)
    if total <= max_chars:  # else the rendering, longer still, cannot fit
        rendered = _render(parts)
        if len(rendered) <= max_chars:
            return rendered

    def attempt(keep: int) -> str:
        head, head_used = _kept(parts, keep - keep // 2, from_end=False)
        tail, tail_used = _kept(parts, keep // 2, from_end=True)
        marker = _Part(f"[... {total - head_used - tail_used} characters left out here ...]")
        return _render([*head, marker, *tail])

    # The rendering grows with what is kept: the most that fits, by bisection.
    low, high = 0, total - 1
    while low < high:
        middle = (low + high + 1) // 2
        if len(attempt(middle)) <= max_chars:
            low = middle
        else:
            high = middle - 1
    return attempt(low)


def _figure_lines(data: dict[str, Any], cell_index: int | None, pngs: int) -> tuple[list[str], int]:
    lines = []
    for mime in _IMAGE_TYPES:
        if mime not in data:
            continue
        if mime == "image/png":
            pngs += 1
            if cell_index is not None:
                lines.append(f"[figure {inline_figure_path(cell_index, pngs)}]")
                continue
        lines.append(f"[figure: {mime}]")
    return lines, pngs


def _error_body(output: dict[str, Any]) -> str:
    head = f"{output.get('ename', '')}: {output.get('evalue', '')}"
    return "\n".join([head, *output.get("traceback", [])])


def cell_text(
    result: CellResult, *, cell_index: int | None = None, max_chars: int = DEFAULT_MODEL_TEXT_CHARS
) -> str:
    """Render a cell's outputs, in the order they came, as text for a model.

    What the cell produced is fenced, with the output's kind as the fence's info string:
    ``stdout``, ``stderr``, ``result`` (an ``execute_result``), ``display`` (`rich_text` of
    a display) and ``error`` (``Name: message`` and the traceback). Our own lines stand outside
    fences: ``[figure inline-figures/cell-004-1.png]`` for a PNG (the name the flow stores it
    under), ``[figure: image/svg+xml]`` for other images, ``[error] CellTimeoutError: ...`` for
    a timed-out cell (after the kernel's ``KeyboardInterrupt``, if it sent one), the cap's
    marker. Every part is `model_safe`. For example::

        ```stdout
        4 rows
        ```
        [figure inline-figures/cell-004-1.png]

    Args:
        result: the cell's result.
        cell_index: the cell's 0-based index in the executed notebook, to name its figures;
            None names them by type only.
        max_chars: the most characters returned; past it the start and end of the outputs are
            kept, fenced as before, with a line ``[... N characters left out here ...]`` between
            them.

    Returns:
        The text; `NO_OUTPUT` when the cell showed nothing.

    Raises:
        ValueError: ``max_chars`` is below 100.
    """
    if max_chars < 100:
        raise ValueError(f"max_chars must be at least 100, not {max_chars}")
    parts: list[_Part] = []
    pngs = 0
    for output in result.outputs:
        kind = output["output_type"]
        if kind == "stream":
            parts.append(_Part(output["name"], model_safe(_joined(output["text"])).rstrip("\n")))
        elif kind == "error":
            parts.append(_Part("error", model_safe(_error_body(output)).rstrip("\n")))
        else:
            data = output.get("data", {})
            figures, pngs = _figure_lines(data, cell_index, pngs)
            parts.extend(_Part(line) for line in figures)
            text = None if figures else rich_text(data)
            if text is not None:
                info = "result" if kind == "execute_result" else "display"
                parts.append(_Part(info, model_safe(text).rstrip("\n")))
    error = result.error
    shown = {output.get("ename") for output in result.outputs}
    if result.status == "timeout" and error is not None and error.ename not in shown:
        # The kernel's own KeyboardInterrupt says nothing of the deadline; this does.
        line = " ".join(model_safe(f"{error.ename}: {error.evalue}").split())
        parts.append(_Part(f"[error] {line}"))
    parts = [part for part in parts if part.body is None or part.body]
    return _capped(parts, max_chars) if parts else NO_OUTPUT


MATHMODELAGENT_IMAGE = "[{mark} 图片已生成\uff0c内容为 base64\uff0c未展示]"
"""The line MathModelAgent's interpreters give for an image (``mark`` is ``display_png``,
``execute_result_jpeg``...): "image made, its base64 not shown"."""
_MMA_IMAGE_MARKS = {"image/png": "png", "image/jpeg": "jpeg"}


def mathmodelagent_error(result: CellResult) -> str:
    """A failed cell's ``error_message`` as MathModelAgent's ``E2BCodeInterpreter`` gives it:
    ``"Error: <name>: <value>\\n<traceback>"``, `model_safe`, cut to
    `MATHMODELAGENT_BLOCK_CHARS` (head and tail kept); empty when the cell did not fail."""
    error = result.error
    if error is None:
        return ""
    text = model_safe(f"Error: {error.ename}: {error.evalue}\n" + "\n".join(error.traceback))
    return cap_text(text, MATHMODELAGENT_BLOCK_CHARS)


def mathmodelagent_text(result: CellResult) -> str:
    """A cell's outputs in the shape MathModelAgent's ``LocalCodeInterpreter`` gives its
    CoderAgent (``text_to_gpt``, joined by newlines), every part `model_safe`.

    Blocks, in the order the outputs came: ``[stdout]\\n<text>`` and ``[stderr]\\n<text>`` per
    stream output (MathModelAgent's local interpreter drops stderr; its E2B one passes it
    unlabelled); ``[execute_result_text]\\n<text>`` and ``[display_text]\\n<text>`` (the text
    `rich_text` picks, where MathModelAgent takes ``text/plain``); `MATHMODELAGENT_IMAGE`
    with mark ``display_png`` for each PNG or JPEG (``execute_result_png`` for a result's;
    ``_jpeg`` for JPEG); for a failed cell, `mathmodelagent_error`. Each block is cut to
    `MATHMODELAGENT_BLOCK_CHARS`, start and end kept. A cell that showed nothing gives ``""``.
    """
    blocks: list[str] = []
    for output in result.outputs:
        kind = output["output_type"]
        if kind == "stream":
            text = model_safe(_joined(output["text"]))
            blocks.append(cap_text(f"[{output['name']}]\n{text}", MATHMODELAGENT_BLOCK_CHARS))
        elif kind in ("execute_result", "display_data"):
            prefix = "execute_result" if kind == "execute_result" else "display"
            data = output.get("data", {})
            shown = rich_text(data)
            if shown is not None:
                block = f"[{prefix}_text]\n{model_safe(shown)}"
                blocks.append(cap_text(block, MATHMODELAGENT_BLOCK_CHARS))
            blocks.extend(
                MATHMODELAGENT_IMAGE.format(mark=f"{prefix}_{mark}")
                for mime, mark in _MMA_IMAGE_MARKS.items()
                if mime in data
            )
    if result.status != "ok":
        blocks.append(mathmodelagent_error(result))
    return "\n".join(blocks)
