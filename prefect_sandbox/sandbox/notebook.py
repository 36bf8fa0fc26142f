"""Notebooks in and out: stages from a notebook, injected parameters, the executed notebook.

Pure functions over nbformat nodes; only `read_notebook` and `ExecutedNotebook.write` touch disk.
Manual: docs/concepts.md.
"""

from __future__ import annotations

import ast
import base64
import copy
import datetime
import io
import itertools
import json
import keyword
import math
import re
import sys
import tokenize
import unicodedata
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar, cast

import nbformat
from markdown_it import MarkdownIt
from nbformat import NotebookNode
from nbformat.corpus.words import generate_corpus_id
from pydantic import BaseModel, Field, model_validator

from prefect_sandbox.sandbox.base import CellResult, KernelInfo, is_python_language
from prefect_sandbox.sandbox.errors import NotebookError
from prefect_sandbox.sandbox.outputs import strip_ansi

__all__ = [
    "CellSpec",
    "ExecutedNotebook",
    "StageSpec",
    "cell_label",
    "failing_line",
    "inject_parameters",
    "inline_figure_path",
    "inline_figures",
    "notebook_from_stages",
    "notebook_parameters",
    "parameter_name_problem",
    "parse_parameter",
    "parse_python",
    "python_literal",
    "read_notebook",
    "retry_ast_race",
    "split_stages",
    "undeclared_parameters",
]

STAGE_TAG_PREFIX = "stage:"
PARAMETERS_TAG = "parameters"
INJECTED_TAG = "injected-parameters"
SKIP_TAG = "skip-execution"
"""Cells tagged so are not run, and keep their outputs as they are (nbclient's convention)."""
LEADING_STAGE = "setup"
METADATA_KEY = "prefect_sandbox"
WIDGET_STATE_MIME = "application/vnd.jupyter.widget-state+json"
"""The key of ``metadata.widgets`` under which notebook viewers find the widgets' state."""


class CellSpec(BaseModel):
    """One code cell to run.

    Attributes:
        index: 0-based index of the cell in the ``cells`` list of the notebook that runs (the
            executed notebook: a parameters cell injected by the run included).
        source: the cell's code.
        tags: the cell's metadata tags (``raises-exception`` lets it fail).
        number: the cell's number as people are told it (logs, errors, ``summary.json``, the
            CLI): its 0-based index in the notebook as its author wrote it, markdown cells
            counted and the injected parameters cell not, so ``-p`` shifts no number; None for
            that injected cell. Default: ``index`` (None for a cell tagged
            ``injected-parameters``).
    """

    index: int
    source: str
    tags: list[str] = Field(default_factory=list)
    number: int | None = None

    @model_validator(mode="after")
    def _number_from_index(self) -> CellSpec:
        if "number" not in self.model_fields_set and INJECTED_TAG not in self.tags:
            self.number = self.index
        return self

    @property
    def label(self) -> str:
        """How people are told the cell: `cell_label` of its `number`."""
        return cell_label(self.number)


_CELL_FRAME = re.compile(r"^\s*Cell In\s*\[\s*\d*\s*\],\s*line (\d+)")
"""IPython's (8 and later) heading of a traceback frame in a cell's own code."""
FAILING_CODE_CHARS = 200
"""The most characters of the failing line of code `failing_line` gives."""


def failing_line(source: str, traceback: Sequence[str]) -> tuple[int, str] | None:
    """Where in a cell's ``source`` its error points: the first frame of the cell's own code
    in IPython's ``traceback`` (``Cell In[4], line 4``; a ``SyntaxError``'s too).

    Returns:
        The line's 1-based number and its code, stripped and cut at `FAILING_CODE_CHARS`;
        None when the traceback names no line of the cell (an error before its code ran, a
        kernel that formats tracebacks otherwise).
    """
    lines = source.splitlines()
    for entry in traceback:
        for line in strip_ansi(entry).splitlines():
            match = _CELL_FRAME.match(line)
            if match is None:
                continue
            number = int(match.group(1))
            if not 1 <= number <= len(lines):
                return None
            return number, lines[number - 1].strip()[:FAILING_CODE_CHARS]
    return None


def cell_label(number: int | None) -> str:
    """``cell 3`` for a cell's number (`CellSpec.number`), ``injected parameters cell`` for
    None."""
    return "injected parameters cell" if number is None else f"cell {number}"


class NotebookParameter(BaseModel):
    """One assignment in a notebook's cell tagged ``parameters``, as papermill's
    ``--help-notebook`` infers it.

    Attributes:
        name: the name assigned.
        type_name: the annotation's source (``n: int = 3``); else the type of a literal value
            (``"str"`` for ``path = 'co2.csv'``); None when it is neither.
        default: the assigned value's source.
        help: the comment at the end of the assignment's last line, without ``#``; or "".
    """

    name: str
    type_name: str | None
    default: str
    help: str


class StageSpec(BaseModel):
    """A named run of consecutive code cells; one Prefect task runs one stage."""

    name: str
    cells: list[CellSpec]


def read_notebook(path: Path) -> NotebookNode:
    """Read and validate a notebook file as nbformat v4, for a Python kernel.

    A notebook whose ``kernelspec.language`` or ``language_info.name`` is another language
    (R, Julia...) is refused rather than run as Python; one that names no language is taken
    as Python.

    Raises:
        NotebookError: the file is missing, not JSON, not a valid notebook, or written for a
            kernel that is not Python (names the file, and the kernel and its language).
    """
    try:
        notebook = cast(NotebookNode, nbformat.read(path, as_version=4))
        nbformat.validate(notebook)
    except FileNotFoundError:
        raise NotebookError(f"notebook {str(path)!r} does not exist") from None
    except (json.JSONDecodeError, nbformat.ValidationError, nbformat.reader.NotJSONError) as exc:
        raise NotebookError(f"notebook {str(path)!r} is not a valid notebook: {exc}") from exc
    spec = notebook.metadata.get("kernelspec", {})
    for language in (spec.get("language"), notebook.metadata.get("language_info", {}).get("name")):
        if isinstance(language, str) and language and not is_python_language(language):
            kernel = f"kernel {spec['name']!r}" if spec.get("name") else "a kernel"
            raise NotebookError(
                f"notebook {str(path)!r} is written for {kernel} in {language!r}; "
                "prefect-sandbox runs Python notebooks only"
            )
    return notebook


def notebook_from_stages(stages: Mapping[str, Sequence[str]]) -> NotebookNode:
    """Build a notebook with one code cell per source, each tagged ``stage:<name>``.

    Args:
        stages: stage name to its cells' sources, in running order.

    Raises:
        NotebookError: a stage has an empty name or no cells.
    """
    notebook = cast(NotebookNode, nbformat.v4.new_notebook())
    for name, sources in stages.items():
        _check_stage_name(name, None)
        if not sources:
            raise NotebookError(f"stage {name!r} has no cells")
        for source in sources:
            cell = nbformat.v4.new_code_cell(source)
            cell.metadata["tags"] = [f"{STAGE_TAG_PREFIX}{name}"]
            notebook.cells.append(cell)
    return notebook


def parse_parameter(assignment: str) -> tuple[str, Any]:
    """Parse ``NAME=VALUE`` as papermill's ``-p`` does.

    ``True``/``False``/``None``, integers and floats (``nan`` and ``inf`` included) become those
    types; anything else is a string.

    Raises:
        NotebookError: no ``=``, or NAME is not a Python identifier or is a keyword.
    """
    name, sep, raw = assignment.partition("=")
    if not sep:
        raise NotebookError(
            f"parameter {assignment!r} must look like NAME=VALUE (or NAME VALUE, as papermill's)"
        )
    problem = parameter_name_problem(name)
    if problem:
        raise NotebookError(f"parameter name {name!r} (in {assignment!r}) {problem}")
    value: Any
    if raw in ("True", "False"):
        value = raw == "True"
    elif raw == "None":
        value = None
    else:
        for kind in (int, float):
            try:
                value = kind(raw)
                break
            except ValueError:
                continue
        else:
            value = raw
    return name, value


def parameter_name_problem(name: object) -> str | None:
    """Why ``name`` cannot be assigned to (``"is a Python keyword"``, ...); None if it can."""
    if not isinstance(name, str) or not name.isidentifier():
        return "is not a Python identifier"
    if keyword.iskeyword(name):
        return "is a Python keyword"
    return None


def python_literal(value: Any) -> str:
    """The Python source that recreates a parameter value, as papermill's PythonTranslator
    writes it.

    None, bools, ints, strings and finite floats become their literals; NaN and the infinities
    ``float('nan')``, ``float('inf')`` and ``float('-inf')``; lists, tuples and dicts are
    written item by item; dates, times and datetimes become ISO 8601 strings (papermill writes
    ``str(value)``); numpy scalars become the plain Python value they hold.

    Raises:
        NotebookError: the value (or an item in it) is of any other type, which has no
            Python literal form.
    """
    if value is None or isinstance(value, bool):
        return repr(value)
    # The base types' own repr: a subclass's (an IntEnum's, numpy's float64) is no literal.
    if isinstance(value, int):
        return int.__repr__(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "float('nan')"
        if math.isinf(value):
            return "float('inf')" if value > 0 else "float('-inf')"
        return float.__repr__(value)
    if isinstance(value, str):
        return str.__repr__(value)
    if isinstance(value, list):
        return f"[{', '.join(python_literal(item) for item in value)}]"
    if isinstance(value, tuple):
        items = ", ".join(python_literal(item) for item in value)
        return f"({items},)" if len(value) == 1 else f"({items})"
    if isinstance(value, dict):
        pairs = (f"{python_literal(key)}: {python_literal(item)}" for key, item in value.items())
        return f"{{{', '.join(pairs)}}}"
    if isinstance(value, datetime.date | datetime.time):
        return repr(value.isoformat())
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(value, numpy.generic):
        return python_literal(value.item())
    raise NotebookError(
        f"a value of type {type(value).__name__} has no Python literal form; use None, a bool, "
        "number, string, date, or a list, tuple or dict of those"
    )


T = TypeVar("T")

_AST_DEPTH_MISMATCH = "AST constructor recursion depth mismatch"

_ast_parse = ast.parse
"""The interpreter's own `ast.parse`, even where a process wraps ``ast.parse`` in
`retry_ast_race` (the test suite does)."""


def retry_ast_race(parse: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``parse(*args, **kwargs)`` (`ast.parse` or the like), proof against a CPython 3.11 race.

    CPython 3.11 keeps the AST constructor's recursion depth in state that all threads share
    (gh-106905), so a parse in one thread while another builds an AST (Python 3.11's traceback
    formatting does, to place its carets, whenever a thread logs an exception) can end in a
    spurious ``SystemError: AST constructor recursion depth mismatch``. The call is then made
    again, at most twice.

    Returns:
        What ``parse`` returns.

    Raises:
        SyntaxError: the source is not valid Python (from ``parse``).
    """
    for _ in range(2):
        try:
            return parse(*args, **kwargs)
        except SystemError as exc:
            if _AST_DEPTH_MISMATCH not in str(exc):
                raise
    return parse(*args, **kwargs)


def parse_python(source: str, filename: str = "<unknown>") -> ast.Module:
    """`ast.parse` of a module's source through `retry_ast_race`.

    Args:
        source: Python source text.
        filename: the name that a `SyntaxError` gives.

    Returns:
        The module's tree.

    Raises:
        SyntaxError: the source is not valid Python.
    """
    tree: ast.Module = retry_ast_race(_ast_parse, source, filename)
    return tree


def undeclared_parameters(notebook: NotebookNode, parameters: Mapping[str, Any]) -> list[str]:
    """The parameter names that the notebook's cell tagged ``parameters`` does not assign.

    papermill warns of these too: a misspelt name is injected but changes nothing.

    Returns:
        The names, in ``parameters`` order; all of them if no cell is tagged ``parameters``, none
        if that cell is not plain Python (magics), so nothing can be said.
    """
    for cell in notebook.cells:
        if PARAMETERS_TAG not in _tags(cell):
            continue
        try:
            tree = parse_python(cell.source)
        except SyntaxError:
            return []
        assigned = {
            node.id
            for node in ast.walk(tree)
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store)
        }
        return [name for name in parameters if name not in assigned]
    return list(parameters)


def _literal_type(value: ast.expr) -> str | None:
    """The type of a literal value's source (``"str"`` for ``'co2.csv'``, ``"None"`` for
    ``None``); None when it is no literal (a call, a name)."""
    try:
        literal = ast.literal_eval(value)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None
    return "None" if literal is None else type(literal).__name__


def notebook_parameters(notebook: NotebookNode) -> list[NotebookParameter] | None:
    """The top-level assignments of one name in the notebook's cell tagged ``parameters``.

    Returns:
        Each `NotebookParameter` in source order; None when no cell is tagged ``parameters``.

    Raises:
        NotebookError: that cell is not valid Python (it names the cell and line).
    """
    for index, cell in enumerate(notebook.cells):
        if PARAMETERS_TAG not in _tags(cell):
            continue
        source = cell.source
        try:
            tree = parse_python(source)
        except SyntaxError as exc:
            raise NotebookError(
                f"cell {index} (tagged 'parameters') is not valid Python: line {exc.lineno}: "
                f"{exc.msg}"
            ) from None
        comments = {
            token.start[0]: token.string.lstrip("#").strip()
            for token in tokenize.generate_tokens(io.StringIO(source).readline)
            if token.type == tokenize.COMMENT
        }
        found = []
        for node in tree.body:
            if isinstance(node, ast.Assign) and len(node.targets) == 1:
                target, value = node.targets[0], node.value
                annotation = _literal_type(value)
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                target, value = node.target, node.value
                annotation = ast.unparse(node.annotation)
            else:
                continue
            if isinstance(target, ast.Name):
                found.append(
                    NotebookParameter(
                        name=target.id,
                        type_name=annotation,
                        default=ast.get_source_segment(source, value) or "",
                        help=comments.get(node.end_lineno or node.lineno, ""),
                    )
                )
        return found
    return None


def inject_parameters(notebook: NotebookNode, parameters: Mapping[str, Any]) -> NotebookNode:
    """Return a copy of ``notebook`` with a papermill-style injected parameters cell.

    The new cell, tagged ``injected-parameters``, follows the cell tagged ``parameters`` (or
    opens the notebook if none is) and replaces an earlier injected cell. It joins the stage of
    the parameters cell.

    Values are written by `python_literal`.

    Raises:
        NotebookError: a name is not an identifier or is a keyword, or a value has no Python
            literal form (names the parameter).
    """
    result = copy.deepcopy(notebook)
    if not parameters:
        return result
    lines = ["# Parameters"]
    for name, value in parameters.items():
        problem = parameter_name_problem(name)
        if problem:
            raise NotebookError(f"parameter name {name!r} {problem}")
        try:
            literal = python_literal(value)
        except NotebookError as exc:
            raise NotebookError(f"parameter {name!r}: {exc}") from None
        lines.append(f"{name} = {literal}")
    cells = [cell for cell in result.cells if INJECTED_TAG not in _tags(cell)]
    position = 0
    stage_tags: list[str] = []
    for index, cell in enumerate(cells):
        if PARAMETERS_TAG in _tags(cell):
            position = index + 1
            stage_tags = [tag for tag in _tags(cell) if tag.startswith(STAGE_TAG_PREFIX)]
            break
    injected = nbformat.v4.new_code_cell("\n".join(lines))
    if (result.nbformat, result.nbformat_minor) < (4, 5):
        del injected["id"]  # cell ids came with nbformat 4.5; older notebooks refuse them
    injected.metadata["tags"] = [INJECTED_TAG, *stage_tags]
    cells.insert(position, injected)
    result.cells = cells
    return result


def split_stages(notebook: NotebookNode, heading_level: int = 1) -> list[StageSpec]:
    """Split a notebook's code cells into stages.

    If any cell carries a ``stage:<name>`` tag, a cell's stage is its tag, else that of the cell
    before it. Otherwise each markdown cell's first heading of level ``heading_level`` or above
    (with the default 1, ``# Title``; with 2, ``## Part`` too; in any script; CommonMark, so not
    a ``#`` line in a code block) opens a stage named by its slug:
    ``# Données brutes`` -> ``données-brutes``, ``# 数据加载`` -> ``数据加载``, a heading with
    no letters or digits ``heading-<n>`` (its number among the headings); a slug seen before
    gets ``-2``, ``-3``... Code cells before the first stage form a stage named ``setup``.
    Cells tagged ``skip-execution`` are left out, as nbclient skips them. Each cell's `number`
    leaves out the injected parameters cell (``injected-parameters``), so it is the cell's
    index in the notebook its author wrote; errors name cells by it.

    Returns:
        The stages in notebook order, empty stages left out.

    Raises:
        NotebookError: a cell has two stage tags, a stage's cells are not consecutive
            (names the cell), or ``heading_level`` is not 1 to 6.
    """
    if heading_level not in range(1, 7):
        raise NotebookError(f"the stage heading level must be 1 to 6, not {heading_level!r}")
    tagged = any(_stage_tag(cell, index) for index, cell in enumerate(notebook.cells))
    stages: list[StageSpec] = []
    current = LEADING_STAGE
    seen_headings: dict[str, int] = {}
    headings = 0
    injected = 0
    for index, cell in enumerate(notebook.cells):
        if INJECTED_TAG in _tags(cell):
            injected += 1
        if tagged:
            current = _stage_tag(cell, index - injected) or current
        elif cell.cell_type == "markdown":
            heading = _top_heading(cell.source, heading_level)
            if heading is not None:
                headings += 1
                slug = _slug(heading) or f"heading-{headings}"
                count = seen_headings[slug] = seen_headings.get(slug, 0) + 1
                current = slug if count == 1 else f"{slug}-{count}"
        if cell.cell_type != "code" or not cell.source.strip() or SKIP_TAG in _tags(cell):
            continue
        number = None if INJECTED_TAG in _tags(cell) else index - injected
        spec = CellSpec(index=index, source=cell.source, tags=_tags(cell), number=number)
        if stages and stages[-1].name == current:
            stages[-1].cells.append(spec)
            continue
        if any(stage.name == current for stage in stages):
            raise NotebookError(
                f"{spec.label} is in stage {current!r}, whose cells are not consecutive",
                cell_index=spec.number,
            )
        stages.append(StageSpec(name=current, cells=[spec]))
    return stages


def _tags(cell: NotebookNode) -> list[str]:
    return list(cell.get("metadata", {}).get("tags", []))


def _stage_tag(cell: NotebookNode, index: int) -> str | None:
    names = [
        tag[len(STAGE_TAG_PREFIX) :] for tag in _tags(cell) if tag.startswith(STAGE_TAG_PREFIX)
    ]
    if len(names) > 1:
        raise NotebookError(f"cell {index} has more than one stage tag: {names}", cell_index=index)
    if names:
        _check_stage_name(names[0], index)
        return names[0]
    return None


def _check_stage_name(name: str, index: int | None) -> None:
    if not name.strip():
        where = f"cell {index}" if index is not None else "a stage"
        raise NotebookError(f"{where} has an empty stage name", cell_index=index)


_MARKDOWN = MarkdownIt("commonmark")
_TEXT_TOKENS = {"text": "", "code_inline": "", "image": "", "softbreak": " ", "hardbreak": " "}


def _top_heading(markdown: str, level: int = 1) -> str | None:
    """The text of the first heading of ``level`` or above (``h1`` to ``h{level}``) of a
    markdown cell, or None if it has none.

    Parsed as CommonMark: ``# Title`` and setext headings count, ``#`` lines in fenced or
    indented code do not; emphasis, code and link markup are dropped, leaving the words.
    """
    tokens = _MARKDOWN.parse(markdown)
    for opening, inline in itertools.pairwise(tokens):
        if opening.type == "heading_open" and int(opening.tag[1:]) <= level:
            return "".join(
                child.content or _TEXT_TOKENS[child.type]
                for child in inline.children or []
                if child.type in _TEXT_TOKENS
            )
    return None


def _slug(heading: str) -> str:
    """A heading as a stage name: lower case, letters and digits of any script kept, each run
    of anything else one ``-`` (``"Données brutes!"`` -> ``"données-brutes"``)."""
    words = unicodedata.normalize("NFC", heading).lower()
    return re.sub(r"[\W_]+", "-", words).strip("-")


INLINE_FIGURES_DIR = "inline-figures"


def inline_figure_path(cell_index: int, number: int) -> str:
    """Where the ``number``-th (1-based) PNG that cell ``cell_index`` displayed is stored,
    e.g. ``inline-figures/cell-004-1.png``."""
    return f"{INLINE_FIGURES_DIR}/cell-{cell_index:03d}-{number}.png"


def inline_figures(notebook: NotebookNode) -> tuple[list[tuple[str, bytes]], list[str]]:
    """The PNG images that code cells displayed, as files to store beside the notebook.

    An ``image/png`` payload that is not base64 gives no file, and a warning instead; its output
    stays in the notebook as it is.

    Returns:
        The figures as ``(relative path, PNG bytes)``, the path
        ``inline-figures/cell-<index>-<n>.png`` with the cell's 0-based notebook index and the
        image's 1-based number in that cell; and one warning per image skipped, naming it.
    """
    figures: list[tuple[str, bytes]] = []
    warnings: list[str] = []
    for index, cell in enumerate(notebook.cells):
        if cell.cell_type != "code":
            continue
        images = [
            output["data"]["image/png"]
            for output in cell.outputs
            if output.output_type in ("display_data", "execute_result")
            and "image/png" in output.get("data", {})
        ]
        for number, image in enumerate(images, start=1):
            path = inline_figure_path(index, number)
            try:
                text = image if isinstance(image, str) else "".join(image)
                figures.append((path, base64.b64decode(text)))
            except (ValueError, TypeError) as exc:  # binascii.Error is a ValueError
                warnings.append(
                    f"cell {index}: image/png output {number} is not base64 ({exc}); "
                    f"kept in the notebook as it is, not stored as {path}"
                )
    return figures, warnings


class ExecutedNotebook:
    """The executed notebook, built up cell by cell as results arrive.

    Starts from the source notebook with code cells' outputs cleared, so markdown stays in place
    and cells that never ran show no stale outputs; cells tagged ``skip-execution`` are kept as
    they are, as nbclient keeps them.
    """

    def __init__(self, source: NotebookNode) -> None:
        self.notebook = copy.deepcopy(source)
        # Display id -> cell index -> indexes of the cell's outputs shown with that id.
        self._displays: dict[str, dict[int, list[int]]] = {}
        # Comm id -> the widget model's state (and buffers) as the cells left it.
        self._widgets: dict[str, dict[str, Any]] = {}
        for cell in self.notebook.cells:
            if cell.cell_type == "code" and SKIP_TAG not in _tags(cell):
                cell.outputs = []
                cell.execution_count = None
                cell.metadata.pop(METADATA_KEY, None)

    def record(self, cell_index: int, stage: str, result: CellResult) -> None:
        """Put one cell's result into the notebook; call it for the cells in the order they ran.

        Display ids are tracked across the whole run, as nbclient does: what a cell sends for
        a display id (``result.display_updates``) rewrites the outputs that cells recorded
        before it showed with that id.

        Args:
            cell_index: 0-based index of the cell in the notebook.
            stage: the stage it ran in.
            result: what it produced.
        """
        cell = self.notebook.cells[cell_index]
        cell.outputs = [nbformat.from_dict(output) for output in result.outputs]
        for shown in self._displays.values():
            shown.pop(cell_index, None)
        for display_id, content in result.display_updates.items():
            for other, indexes in self._displays.get(display_id, {}).items():
                for index in indexes:
                    output = self.notebook.cells[other].outputs[index]
                    output["data"] = nbformat.from_dict(copy.deepcopy(content["data"]))
                    output["metadata"] = nbformat.from_dict(copy.deepcopy(content["metadata"]))
        for display_id, indexes in result.display_ids.items():
            self._displays.setdefault(display_id, {})[cell_index] = list(indexes)
        if result.widget_state:
            self._record_widgets(result.widget_state)
        cell.execution_count = result.execution_count
        # Merged, so facts noted when the cell was added (a session's step and attempt) stay.
        cell.metadata.setdefault(METADATA_KEY, {}).update(
            {
                "stage": stage,
                "status": result.status,
                "started_at": result.started_at.isoformat(),
                "duration_s": round(result.duration_s, 6),
            }
        )

    def _record_widgets(self, widget_state: dict[str, dict[str, Any]]) -> None:
        """Keep the widget models' last state in ``metadata.widgets``, in the widget-state
        format nbclient's ``store_widget_state`` writes (``@jupyter-widgets/schema``, v2.0):
        models with a ``_model_name``, their binary buffers base64."""
        for comm_id, sent in widget_state.items():
            kept = self._widgets.setdefault(comm_id, {"state": {}, "buffers": {}})
            kept["state"].update(copy.deepcopy(sent["state"]))
            for buffer in sent.get("buffers", []):
                kept["buffers"][tuple(buffer["path"])] = dict(buffer)
        models = {}
        for comm_id, kept in self._widgets.items():
            state = kept["state"]
            if "_model_name" not in state:
                continue
            model: dict[str, Any] = {
                "model_name": state["_model_name"],
                "model_module": state.get("_model_module"),
                "model_module_version": state.get("_model_module_version"),
                "state": state,
            }
            if kept["buffers"]:
                model["buffers"] = list(kept["buffers"].values())
            models[comm_id] = model
        if models:
            self.notebook.metadata["widgets"] = nbformat.from_dict(
                {
                    WIDGET_STATE_MIME: {
                        "state": copy.deepcopy(models),
                        "version_major": 2,
                        "version_minor": 0,
                    }
                }
            )

    def add_code_cell(self, source: str, **facts: Any) -> int:
        """Append a code cell that is about to run (a session's cells are known only then).

        Args:
            source: the cell's code.
            facts: JSON-able values for the cell's ``metadata.prefect_sandbox``, kept when its
                result is recorded (e.g. ``step=3, attempt=2``).

        Returns:
            The new cell's 0-based index, for `record`.
        """
        # Not nbformat.v4.new_code_cell, which validates each cell; `write` validates once.
        cell = nbformat.from_dict(
            {
                "cell_type": "code",
                "id": generate_corpus_id(),
                "metadata": {METADATA_KEY: dict(facts)},
                "execution_count": None,
                "outputs": [],
                "source": source,
            }
        )
        self.notebook.cells.append(cell)
        return len(self.notebook.cells) - 1

    def add_outputs(self, cell_index: int, outputs: list[dict[str, Any]]) -> None:
        """Append outputs that arrived after the cell ended (printed by its threads)."""
        cell = self.notebook.cells[cell_index]
        cell.outputs.extend(nbformat.from_dict(output) for output in outputs)

    def set_metadata(self, **fields: Any) -> None:
        """Record run facts (flow run, backend, sandbox id) in the notebook's metadata."""
        self.notebook.metadata.setdefault(METADATA_KEY, {}).update(fields)

    def set_kernel(self, kernel: KernelInfo) -> None:
        """Record the kernel that ran the cells as the notebook's ``kernelspec`` and
        ``language_info``, in place of the source notebook's."""
        self.notebook.metadata["kernelspec"] = nbformat.from_dict(kernel.kernelspec)
        self.notebook.metadata["language_info"] = nbformat.from_dict(kernel.language_info)

    def write(self, path: Path) -> list[str]:
        """Validate and write the notebook, repaired if it must be.

        An output that is not valid nbformat is dropped, and cell ids are dropped from a
        notebook older than nbformat 4.5 (which has none), so one bad output never stops the
        notebook from being written.

        Returns:
            One warning per repair, naming the cell; empty when none was needed.

        Raises:
            nbformat.ValidationError: the notebook is still not valid (a bug of ours).
            OSError: the file could not be written.
        """
        warnings: list[str] = []
        try:
            nbformat.validate(self.notebook)
        except nbformat.ValidationError:
            warnings = self._repair()
            nbformat.validate(self.notebook)
        path.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(self.notebook, path)
        return warnings

    def _repair(self) -> list[str]:
        warnings = []
        minor = self.notebook.nbformat_minor
        for index, cell in enumerate(self.notebook.cells):
            if minor < 5 and "id" in cell:
                del cell["id"]
            if cell.cell_type != "code":
                continue
            kept = []
            for output in cell.outputs:
                try:
                    nbformat.validate(output, ref="output", version=4, version_minor=minor)
                except nbformat.ValidationError as exc:
                    kind = output.get("output_type", "unknown")
                    warnings.append(
                        f"cell {index}: a {kind} output is not valid nbformat and was dropped: "
                        f"{exc.message}"
                    )
                    continue
                kept.append(output)
            cell.outputs = kept
        return warnings
