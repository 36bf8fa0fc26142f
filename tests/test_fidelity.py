"""Fidelity: a notebook run through the product gives the outputs nbclient gives (issue 12).

One notebook of our own exercises streams, ``\\r``, display / update / clear, every rich MIME
type, errors, magics, shell commands, top-level ``await`` and a figure. It runs once through
nbclient on a local kernel, and through the ``run-notebook`` flow on each backend; every cell's
outputs and execution count are compared after masking memory addresses and times. On the local
kernel they are identical; on the E2B and Daytona emulators too, but for the cells whose feature
the documentation lists under "Differences between backends" (docs/backends/index.md).
"""

from __future__ import annotations

import base64
import copy
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nbformat
import pytest

from prefect_sandbox.blocks.base import SandboxBackend
from prefect_sandbox.blocks.daytona import DaytonaBackend
from prefect_sandbox.blocks.e2b import E2BBackend, E2BCredentials
from prefect_sandbox.blocks.local import LocalKernelBackend
from prefect_sandbox.flows import arun_notebook

pytestmark = pytest.mark.usefixtures("prefect_api")

FEATURE_PREFIX = "feature:"

# What docs/backends/index.md lists under "Differences between backends": per backend, the
# features of the cells whose outputs differ by design (not compared), and whether tracebacks
# differ (errors then compared by ename and evalue only).
SKIPPED_FEATURES: dict[str, set[str]] = {
    "local": set(),
    "e2b": set(),
    # Daytona's worker runs plain Python: no magics, !commands or top-level await.
    "daytona": {"magic", "shell", "await"},
}
PYTHON_TRACEBACKS = {"daytona"}
"""Backends whose tracebacks are Python's own format, not IPython's (a SyntaxError's evalue
names ``<cell-N>`` where IPython names a hashed file)."""
TEMPLATE_PARTS = {"e2b"}
"""Backends whose sandbox template adds parts to displays and turns colours off: E2B's adds
``application/json`` (metadata ``{"expanded": true}``) to every dict or list, and ``e2b/data``
to DataFrames; its tracebacks have no ANSI codes (compared without either)."""
LINE_STREAMS = {"daytona"}
"""Backends that send each line of stdout as it is written, where a Jupyter kernel holds
unflushed stdout back (up to 0.2 s): stdout and stderr may interleave otherwise (then compared
stream by stream between other outputs)."""

# A 1x1 PNG and the start of a JPEG and a PDF, as base64.
PNG = (
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9aw"
    "AAAABJRU5ErkJggg=="
)
JPEG = base64.b64encode(b"\xff\xd8\xff\xe0" + bytes(16)).decode()
PDF = base64.b64encode(b"%PDF-1.1\n%%EOF\n").decode()

CELLS: list[tuple[str, str]] = [
    (
        "streams",
        "import sys\n"
        "print('out 1', flush=True)\n"
        "print('err 1', file=sys.stderr, flush=True)\n"
        "sys.stdout.write('no newline'); sys.stdout.flush()\n"
        "print(' then newline', flush=True)\n"
        "print('err 2', file=sys.stderr, flush=True)\n"
        "print('out 2')",
    ),
    (
        "carriage-return",
        "import sys\n"
        "for i in range(5):\n"
        "    sys.stdout.write(f'\\rprogress {i}/4'); sys.stdout.flush()\n"
        "print()\n"
        "print('abcdef\\rXY')\n"
        "print('done')",
    ),
    (
        "display",
        "from IPython.display import HTML, clear_output, display, update_display\n"
        "status = display('before', display_id=True)\n"
        "fixed = display(HTML('<b>x</b>'), display_id='fixed')\n"
        "fixed.display(HTML('<b>x again</b>'))",
    ),
    (
        "display",
        "status.update('after')\n"
        "update_display(HTML('<i>y</i>'), display_id='fixed')\n"
        "print('updated')",
    ),
    (
        "display",
        "for i in range(3):\n    clear_output(wait=True)\n    print(f'tick {i}')\ndisplay('kept')",
    ),
    ("display", "print('gone')\nclear_output()\nprint('fresh')"),
    (
        "mime",
        "import base64\n"
        "from IPython.display import JSON, SVG, Image, Javascript, Latex, Markdown\n"
        f"display(Image(data=base64.b64decode({PNG!r}), width=10))\n"
        f"display(Image(data=base64.b64decode({JPEG!r}), format='jpeg'))\n"
        'display(SVG(\'<svg xmlns="http://www.w3.org/2000/svg" width="4" height="4"/>\'))\n'
        "display(Markdown('**bold**'), Latex('$x^2$'), JSON({'a': [1, 2]}))\n"
        "display(Javascript('console.log(1)'))\n"
        f"display({{'application/pdf': {PDF!r}, 'text/plain': 'a pdf'}}, raw=True)\n"
        "display({'application/vnd.custom+json': {'k': [1, 2]}, 'text/plain': 'custom'},\n"
        "        raw=True)\n"
        "HTML('<p>result</p>')",
    ),
    ("mime", "{'answer': 42, 'items': [1, 2, 3]}"),
    ("mime", "x = 41\nx + 1;"),
    ("error", "print('before the error')\n1 / 0"),
    ("error", "def inner():\n    raise ValueError('bad value')\ninner()"),
    ("error", "def broken(:\n    pass"),
    ("magic", "%%writefile note.txt\nhello from a magic"),
    ("magic", "%env FIDELITY_VAR=1"),
    ("magic", "%%capture captured\nprint('hidden')"),
    ("magic", "print(captured.stdout.strip(), open('note.txt').read())"),
    ("shell", "!echo shell says hi"),
    ("await", "import asyncio\nawait asyncio.sleep(0)\n'awaited'"),
    (
        "figure",
        "import matplotlib.pyplot as plt\n"
        "plt.plot([1, 2, 3], [3, 1, 2])\nplt.title('fidelity')\nplt.show()",
    ),
]
RAISING = {"error"}


def fidelity_notebook(may_fail: set[str] | frozenset[str] = frozenset()) -> nbformat.NotebookNode:
    """The notebook, each cell tagged with its feature; cells that raise, or whose feature is in
    ``may_fail``, tagged ``raises-exception``."""
    notebook = nbformat.v4.new_notebook()
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3"}
    for feature, source in CELLS:
        cell = nbformat.v4.new_code_cell(source)
        cell.metadata["tags"] = [f"{FEATURE_PREFIX}{feature}"]
        if feature in RAISING | may_fail:
            cell.metadata["tags"].append("raises-exception")
        notebook.cells.append(cell)
    return notebook


_ADDRESS = re.compile(r"0x[0-9a-fA-F]{6,}")
_DURATION = re.compile(r"\b\d+(\.\d+)?\s?(ns|µs|us|ms|s)\b")
_SYNTAX_FILE = re.compile(r"\((<cell-\d+>|\d+\.py), line")


def _terminal(text: str) -> str:
    """Text as a terminal shows it: in each line, text after ``\\r`` overwrites its start."""
    lines = []
    for line in text.split("\n"):
        shown = ""
        for segment in line.split("\r"):
            shown = segment + shown[len(segment) :]
        lines.append(shown)
    return "\n".join(lines)


def _masked(value: Any) -> Any:
    if isinstance(value, str):
        return _DURATION.sub("<time>", _ADDRESS.sub("0x<address>", value))
    if isinstance(value, dict):
        return {key: _masked(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_masked(item) for item in value]
    return value


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _without_template_parts(output: dict[str, Any]) -> None:
    data, metadata = output.get("data", {}), output.get("metadata", {})
    if metadata.get("application/json") == {"expanded": True}:
        data.pop("application/json", None)
        del metadata["application/json"]
    data.pop("e2b/data", None)


def normalized(
    outputs: list[dict[str, Any]],
    *,
    python_tracebacks: bool = False,
    by_stream: bool = False,
    template_parts: bool = False,
) -> list[dict[str, Any]]:
    """Outputs as a front end shows them: back-to-back text of one stream joined and ``\\r``
    applied, tracebacks as one text, addresses and times masked. With ``python_tracebacks``,
    errors keep only their ename and evalue, a SyntaxError's file name masked. With
    ``by_stream``, back-to-back stream outputs are put stdout first, then stderr. With
    ``template_parts``, the parts E2B's template adds to displays are dropped, and tracebacks
    compared without colours."""
    shown: list[dict[str, Any]] = []
    copied = copy.deepcopy([dict(o) for o in outputs])
    for output in _by_stream(copied) if by_stream else copied:
        if template_parts:
            _without_template_parts(output)
        if output["output_type"] == "error":
            output["traceback"] = "\n".join(output["traceback"])
            if template_parts:
                output["traceback"] = _ANSI.sub("", output["traceback"])
            if python_tracebacks:
                del output["traceback"]
                output["evalue"] = _SYNTAX_FILE.sub("(<cell>, line", output["evalue"])
        previous = shown[-1] if shown else None
        if (
            output["output_type"] == "stream"
            and previous is not None
            and previous["output_type"] == "stream"
            and previous["name"] == output["name"]
        ):
            previous["text"] += output["text"]
            continue
        shown.append(output)
    for output in shown:
        if output["output_type"] == "stream":
            output["text"] = _terminal(output["text"])
    return [_masked(output) for output in shown]


def _by_stream(outputs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each run of back-to-back stream outputs reordered stdout first, then stderr."""
    ordered: list[dict[str, Any]] = []
    run: list[dict[str, Any]] = []
    for output in [*outputs, None]:
        if output is not None and output["output_type"] == "stream":
            run.append(output)
            continue
        ordered.extend(sorted(run, key=lambda o: o["name"] != "stdout"))
        run = []
        if output is not None:
            ordered.append(output)
    return ordered


def features(cell: nbformat.NotebookNode) -> set[str]:
    return {
        tag[len(FEATURE_PREFIX) :]
        for tag in cell.metadata.get("tags", [])
        if tag.startswith(FEATURE_PREFIX)
    }


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> nbformat.NotebookNode:
    """The notebook as nbclient executes it on a local python3 kernel."""
    from nbclient import NotebookClient

    workdir = tmp_path_factory.mktemp("nbclient")
    notebook = fidelity_notebook()
    NotebookClient(
        notebook, timeout=60, kernel_name="python3", resources={"metadata": {"path": str(workdir)}}
    ).execute()
    return notebook


def _backend(name: str, request: pytest.FixtureRequest) -> SandboxBackend:
    if name == "local":
        return LocalKernelBackend()
    if name == "e2b":
        emulator = request.getfixturevalue("e2b_emulator")
        credentials = E2BCredentials(
            api_key=emulator.api_key, api_url=emulator.url, sandbox_url=emulator.url
        )
        return E2BBackend(credentials=credentials)
    request.getfixturevalue("daytona_env")
    return DaytonaBackend()


def _compared(
    product: nbformat.NotebookNode, reference: nbformat.NotebookNode, backend: str
) -> Iterator[tuple[int, Any, Any]]:
    """(cell index, product's, nbclient's) for every cell not listed as a vendor difference."""
    options = {
        "python_tracebacks": backend in PYTHON_TRACEBACKS,
        "by_stream": backend in LINE_STREAMS,
        "template_parts": backend in TEMPLATE_PARTS,
    }
    for index, (ours, theirs) in enumerate(zip(product.cells, reference.cells, strict=True)):
        if features(theirs) & SKIPPED_FEATURES[backend]:
            continue
        yield (
            index,
            (ours.execution_count, normalized(ours.outputs, **options)),
            (theirs.execution_count, normalized(theirs.outputs, **options)),
        )


@pytest.mark.parametrize("backend_name", ["local", "e2b", "daytona"])
async def test_outputs_match_nbclients(
    backend_name: str,
    reference: nbformat.NotebookNode,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    source = tmp_path / "fidelity.ipynb"
    nbformat.write(fidelity_notebook(SKIPPED_FEATURES[backend_name]), source)
    result = await arun_notebook(
        notebook=str(source), backend=_backend(backend_name, request), storage=str(tmp_path)
    )
    assert result.status == "completed"
    product = nbformat.read(Path(result.output_dir) / "executed.ipynb", as_version=4)
    compared = list(_compared(product, reference, backend_name))
    assert len(compared) == len(CELLS) - sum(
        feature in SKIPPED_FEATURES[backend_name] for feature, _ in CELLS
    )
    for index, ours, theirs in compared:
        assert ours == theirs, f"cell {index} ({CELLS[index][0]}): {CELLS[index][1]!r}"
