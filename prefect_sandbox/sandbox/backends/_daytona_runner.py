"""Runs notebook cells inside a Daytona interpreter context as a Jupyter kernel would.

`DaytonaSandbox` sends this file's source into the context (at start and after each restart) and
then sends every cell through `Runner.run`. Daytona's interpreter streams only stdout, stderr and
errors, so the runner reports what a notebook needs beyond that as *marker records* written to
stdout: ``MARKER_START + json + MARKER_END``. The JSON holds no raw control characters, so a
record ends at the first ``MARKER_END`` after its start. Records (``kind`` and its fields):

- ``ready``: ``pid`` of the interpreter process; sent once, by `install`.
- ``start``: ``count`` (the cell's execution count) and ``pid``; first record of every cell.
- ``result``: ``count``, ``data``, ``metadata``: the value of the cell's last expression.
- ``display``: ``data``, ``metadata``, and ``display_id`` when it has one: a ``display()`` call
  or a matplotlib figure.
- ``update``: ``data``, ``metadata``, ``display_id``: ``update_display()`` or a display handle's
  ``update()``; what was shown with that id shows this instead.
- ``clear``: ``wait``: ``clear_output()``.
- ``error``: ``ename``, ``evalue``, ``traceback`` (lines): the exception the cell raised.
- ``exit``: ``code``: the cell called ``exit()`` or ``quit()``.
- ``lost``: sent by the per-cell wrapper instead of running the cell when the interpreter has
  been restarted behind our back, so its variables and this runner are gone.

It also makes matplotlib figures into PNG ``display`` records as Jupyter's inline backend does
(on ``plt.show()`` and for figures left open at the end of a cell). The interpreter's stdin is
the daemon's command pipe: the runner refuses stdin reads and gives child processes /dev/null
instead. The daemon reads the interpreter's output in lines under 1 MiB and reads no more after
a longer one, so what a cell writes goes on in smaller pieces. Only the standard library is
needed; IPython and matplotlib are used when present. Kept compatible with Python 3.9.
"""

from __future__ import annotations

import ast
import base64
import builtins
import importlib.abc
import importlib.machinery
import importlib.util
import io
import json
import linecache
import os
import sys
import tokenize
import traceback
import types
import uuid
from collections.abc import Callable, Sequence
from typing import Any

MARKER_START = "\x1e\x1fprefect-sandbox:"
MARKER_END = "\x1e"
FIGURE_BACKEND_MODULE = "_prefect_sandbox_figures"
FIGURE_BACKEND = f"module://{FIGURE_BACKEND_MODULE}"
RUNNER_FILENAME = "<prefect-sandbox>"
NAMESPACE_KEY = "__prefect_sandbox__"

_EMIT_PIECE_CHARS = 256 * 1024
# Daytona's daemon reads its worker's output as JSON lines of under 1 MiB and stops reading at
# a longer one. Pieces are as long as fits (the SDK copies all text so far at each one), with room
# for the interpreter's own buffer; a character takes at most 12 bytes (an escaped surrogate pair).
_MAX_PIECE_BYTES = 960 * 1024
_SAFE_PIECE_CHARS = _MAX_PIECE_BYTES // 12
# IPython's display functions live here; each gets ours (display, update_display,
# clear_output) once imported.
_DISPLAY_MODULES = ("IPython.core.display_functions", "IPython.display", "IPython.core.display")


class StdinNotImplementedError(NotImplementedError):
    """Raised by ``input()`` and ``getpass()``: cells cannot read stdin (as in ipykernel)."""


class _ExitRequested(SystemExit):
    """Raised by our ``exit()``/``quit()``, so the runner can tell them from ``SystemExit``."""


class _ExitCommand:
    """``exit()`` and ``quit()``: end the interpreter after this cell, as in IPython."""

    def __repr__(self) -> str:
        return "Use exit() or quit() to end the interpreter"

    def __call__(self, code: int = 0) -> None:
        raise _ExitRequested(code)


def _no_stdin(*args: object, **kwargs: object) -> str:
    raise StdinNotImplementedError("raw_input was called, but this frontend does not support stdin")


def ends_quietly(source: str) -> bool:
    """Whether the cell's last code token is ``;``, which hides its result (IPython's rule)."""
    last = ""
    try:
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            if token.type not in (
                tokenize.COMMENT,
                tokenize.NL,
                tokenize.NEWLINE,
                tokenize.INDENT,
                tokenize.DEDENT,
                tokenize.ENDMARKER,
            ):
                last = token.string
    except (tokenize.TokenError, SyntaxError):
        return False
    return last == ";"


def error_fields(exc: BaseException) -> dict[str, Any]:
    """The ``error`` record of an exception, without the runner's own frames."""
    shown = traceback.TracebackException(type(exc), exc, exc.__traceback__)
    if isinstance(exc, SyntaxError):
        shown.stack = traceback.StackSummary.from_list([])
    else:
        shown.stack = traceback.StackSummary.from_list(
            [frame for frame in shown.stack if frame.filename != RUNNER_FILENAME]
        )
    lines = "".join(shown.format()).rstrip("\n").split("\n")
    return {"ename": type(exc).__name__, "evalue": str(exc), "traceback": lines}


def _json_default(value: object) -> str:
    if isinstance(value, (bytes, bytearray)):
        return base64.b64encode(bytes(value)).decode("ascii")
    return repr(value)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls a hook after a module is first imported, and serves the figure backend module."""

    def __init__(self, hooks: dict[str, Callable[[types.ModuleType], None]], runner: Runner):
        self.hooks = hooks
        self.runner = runner

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname == FIGURE_BACKEND_MODULE:
            return importlib.util.spec_from_loader(fullname, _FigureBackendLoader(self.runner))
        if fullname not in self.hooks:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _HookedLoader(spec.loader, self.hooks[fullname])
                return spec
        return None


class _HookedLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader, hook: Callable[[types.ModuleType], None]):
        self.loader = loader
        self.hook = hook

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self.loader.exec_module(module)
        self.hook(module)


class _FigureBackendLoader(importlib.abc.Loader):
    """A matplotlib backend: Agg canvases whose ``show()`` sends figures as PNG records."""

    def __init__(self, runner: Runner):
        self.runner = runner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        from matplotlib.backend_bases import FigureManagerBase
        from matplotlib.backends.backend_agg import FigureCanvasAgg

        module.FigureCanvas = FigureCanvasAgg  # type: ignore[attr-defined]
        module.FigureManager = FigureManagerBase  # type: ignore[attr-defined]
        module.show = self.runner.show_figures  # type: ignore[attr-defined]


class Runner:
    """Runs cells in ``namespace`` (the interpreter's globals) and writes marker records."""

    def __init__(self, namespace: dict[str, Any]) -> None:
        self.namespace = namespace
        self.count = 0

    def emit(self, kind: str, **fields: Any) -> None:
        """Write one marker record, after whatever the cell printed so far."""
        sys.stdout.flush()
        sys.stderr.flush()
        record = MARKER_START + json.dumps({"kind": kind, **fields}, default=_json_default)
        record += MARKER_END
        # In pieces: the daemon reads its worker's output in lines of at most 1 MiB.
        for start in range(0, len(record), _EMIT_PIECE_CHARS):
            sys.stdout.write(record[start : start + _EMIT_PIECE_CHARS])
            sys.stdout.flush()

    def run(self, encoded_source: str) -> None:
        """Run one cell, given as base64 of its UTF-8 source. Never raises.

        What the cell writes to stdout and stderr goes on in pieces (see `_Pieces`).
        """
        streams = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = _Pieces(streams[0]), _Pieces(streams[1])
        try:
            self._run(encoded_source)
        finally:
            sys.stdout, sys.stderr = streams

    def _run(self, encoded_source: str) -> None:
        self.count += 1
        count = self.count
        self.emit("start", count=count, pid=os.getpid())
        try:
            self._execute(base64.b64decode(encoded_source).decode("utf-8"), count)
        except _ExitRequested as exc:
            self.emit("exit", code=exc.code if isinstance(exc.code, int) else 0)
            return
        except BaseException as exc:  # user code's exceptions are data, interrupts included
            self.emit("error", **error_fields(exc))
        self.show_figures()

    def _execute(self, source: str, count: int) -> None:
        filename = f"<cell-{count}>"
        source = self._transform(source)
        # So that tracebacks show the cell's lines.
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        tree = ast.parse(source, filename)
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr) and not ends_quietly(source):
            last = ast.Expression(tree.body.pop().value)  # type: ignore[attr-defined]
        exec(compile(tree, filename, "exec"), self.namespace)
        if last is None:
            return
        value = eval(compile(last, filename, "eval"), self.namespace)
        if value is not None:
            self.namespace["_"] = value
            data, metadata = self.format(value)
            self.emit("result", count=count, data=data, metadata=metadata)

    def _transform(self, source: str) -> str:
        """Apply IPython's input transformations (magics, dedent) when IPython is installed."""
        shell = _shell()
        if shell is not None:
            return str(shell.transform_cell(source))
        try:
            from IPython.core.inputtransformer2 import TransformerManager
        except ImportError:
            return source
        return str(TransformerManager().transform_cell(source))  # type: ignore[no-untyped-call]

    def format(
        self, value: object, include: Any = None, exclude: Any = None
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """The MIME bundle and metadata of a value, as IPython's display formatter makes them."""
        shell = _shell()
        if shell is not None:
            data, metadata = shell.display_formatter.format(value, include, exclude)
            return dict(data), dict(metadata)
        try:
            from IPython.core.formatters import DisplayFormatter
        except ImportError:
            return {"text/plain": repr(value)}, {}
        formatter = DisplayFormatter()
        data, metadata = formatter.format(value, include, exclude)  # type: ignore[no-untyped-call]
        return dict(data), dict(metadata)

    def display(
        self,
        *objs: object,
        include: Any = None,
        exclude: Any = None,
        metadata: dict[str, Any] | None = None,
        transient: dict[str, Any] | None = None,
        display_id: Any = None,
        raw: bool = False,
        clear: bool = False,
        update: bool = False,
        **kwargs: Any,
    ) -> DisplayHandle | None:
        """``display()`` as IPython's: a ``display`` record per object (``update`` records with
        ``update=True``); with a ``display_id`` (True for a new one), returns its handle."""
        transient = dict(transient or {})
        if display_id:
            if display_id is True:
                display_id = uuid.uuid4().hex
            transient["display_id"] = display_id
        shown_id = transient.get("display_id")
        if update and not shown_id:
            raise TypeError("display_id required for update_display")
        if not objs and display_id:
            objs, raw = ({},), True
        if clear:
            self.clear_output(wait=True)
        for obj in objs:
            if raw:
                data: dict[str, Any] = dict(obj)  # type: ignore[call-overload]
                shown_metadata = dict(metadata or {})
            else:
                data, shown_metadata = self.format(obj, include, exclude)
                if not data:
                    continue
                _merge(shown_metadata, metadata or {})
            fields: dict[str, Any] = {"data": data, "metadata": shown_metadata}
            if shown_id:
                fields["display_id"] = shown_id
            self.emit("update" if update else "display", **fields)
        return DisplayHandle(self, display_id) if display_id else None

    def update_display(self, obj: object, *, display_id: Any, **kwargs: Any) -> None:
        """``update_display()``: show ``obj`` where ``display_id`` was shown."""
        self.display(obj, display_id=display_id, update=True, **kwargs)

    def clear_output(self, wait: bool = False) -> None:
        """``clear_output()``: a ``clear`` record (with ``wait``, at the next output)."""
        self.emit("clear", wait=bool(wait))

    def show_figures(self, *args: object, **kwargs: object) -> None:
        """Send every open matplotlib figure as a PNG, then close them all (the inline way)."""
        pyplot = sys.modules.get("matplotlib.pyplot")
        if pyplot is None or str(pyplot.get_backend()) != FIGURE_BACKEND:
            return
        from matplotlib._pylab_helpers import Gcf

        try:
            for manager in Gcf.get_all_fig_managers():
                figure = manager.canvas.figure
                if not figure.axes and not figure.lines:
                    continue
                png = io.BytesIO()
                figure.canvas.print_figure(
                    png,
                    format="png",
                    facecolor=figure.get_facecolor(),
                    edgecolor=figure.get_edgecolor(),
                    dpi=figure.dpi,
                    bbox_inches="tight",
                )
                data = {"image/png": png.getvalue(), "text/plain": repr(figure)}
                self.emit("display", data=data, metadata={})
        finally:
            if Gcf.get_all_fig_managers():
                pyplot.close("all")


class DisplayHandle:
    """What ``display(..., display_id=...)`` returns, as IPython's ``DisplayHandle``."""

    def __init__(self, runner: Runner, display_id: str) -> None:
        self.runner = runner
        self.display_id = display_id

    def __repr__(self) -> str:
        return f"<DisplayHandle display_id={self.display_id}>"

    def display(self, obj: object, **kwargs: Any) -> None:
        """Show ``obj`` anew with this id, and where the id was shown before."""
        self.runner.display(obj, display_id=self.display_id, **kwargs)

    def update(self, obj: object, **kwargs: Any) -> None:
        """Show ``obj`` where this id was shown."""
        self.runner.update_display(obj, display_id=self.display_id, **kwargs)


def _merge(target: dict[str, Any], extra: dict[str, Any]) -> None:
    """Merge metadata as IPython's display does: nested dicts key by key."""
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            _merge(target[key], value)
        else:
            target[key] = value


class _Pieces(io.TextIOBase):
    """A text stream that passes long writes on in pieces: the interpreter sends each write as
    (part of) one JSON line to the daemon, which reads no more after a line of 1 MiB."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def write(self, text: str) -> int:
        if len(text) <= _SAFE_PIECE_CHARS:
            self._stream.write(text)
            return len(text)
        start = 0
        while start < len(text):
            size = _MAX_PIECE_BYTES
            while size > _SAFE_PIECE_CHARS and (
                len(json.dumps(text[start : start + size])) > _MAX_PIECE_BYTES
            ):
                size //= 2
            self._stream.write(text[start : start + size])
            start += size
        return len(text)

    def flush(self) -> None:
        self._stream.flush()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return str(getattr(self._stream, "encoding", None) or "utf-8")


def _give_children_no_stdin() -> None:
    """Keep the command pipe (fd 0) for this interpreter only: children get /dev/null.

    A child process inherits fd 0, so one that reads stdin (``cat``, a prompt) would block on
    the daemon's command pipe, or swallow the next cells. The interpreter reads its commands
    through ``sys.stdin``, which moves to a copy of the pipe; the original object stays in
    ``sys.__stdin__``, so it is never collected (closing fd 0).
    """
    try:
        if sys.stdin is None or sys.stdin.fileno() != 0:
            return
    except (OSError, ValueError):
        return
    sys.stdin = os.fdopen(os.dup(0), "r", encoding=sys.stdin.encoding or "utf-8")
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)


def _shell() -> Any:
    """The running IPython shell, if this interpreter is one."""
    ipython = sys.modules.get("IPython")
    return None if ipython is None else ipython.get_ipython()


def _patch_display(runner: Runner, module: types.ModuleType) -> None:
    for name in ("display", "update_display", "clear_output"):
        if hasattr(module, name):
            setattr(module, name, getattr(runner, name))


def _use_figure_backend(matplotlib: types.ModuleType) -> None:
    if "matplotlib.pyplot" in sys.modules:
        sys.modules["matplotlib.pyplot"].switch_backend(FIGURE_BACKEND)
    else:
        matplotlib.rcParams["backend"] = FIGURE_BACKEND


def install(namespace: dict[str, Any]) -> Runner:
    """Set the runner up in an interpreter whose globals are ``namespace``; send ``ready``."""
    runner = Runner(namespace)
    hooks: dict[str, Callable[[types.ModuleType], None]] = {"matplotlib": _use_figure_backend}
    for name in _DISPLAY_MODULES:
        if name in sys.modules:
            _patch_display(runner, sys.modules[name])
        else:
            hooks[name] = lambda module: _patch_display(runner, module)
    if "matplotlib" in sys.modules:
        _use_figure_backend(sys.modules["matplotlib"])
        del hooks["matplotlib"]
    sys.meta_path.insert(0, _AfterImport(hooks, runner))
    builtins.display = runner.display  # type: ignore[attr-defined]
    namespace["exit"] = namespace["quit"] = _ExitCommand()
    if _shell() is None:
        # A plain interpreter's stdin is the daemon's command pipe: reading it would eat cells.
        import getpass

        builtins.input = _no_stdin
        getpass.getpass = _no_stdin
        _give_children_no_stdin()
    runner.emit("ready", pid=os.getpid())
    return runner
