"""Runs notebook cells inside a Daytona interpreter context as a Jupyter kernel would.

`DaytonaSandbox` sends this file's source into the context (at start and after each restart),
then every cell through `Runner.run`. What a notebook needs beyond Daytona's stdout, stderr and
errors goes as *marker records* on stdout, ``MARKER_START + json + MARKER_END`` (the JSON holds
no raw control character, so a record ends at the first ``MARKER_END``): ``ready``, ``start``,
``result``, ``display``, ``update``, ``clear``, ``error``, ``exit``, ``lost``. It formats values
with IPython's formatters where present, makes matplotlib figures PNG displays, takes top-level
``await`` and the IPython syntax `PlainShell` honours. Its channels are out of a cell's reach
(the streams a cell started with, an empty stdin, forks stopped at the cell's end), and it
writes in pieces under the daemon's 1 MiB line. Standard library only; Python 3.9 and later.
Records and facts: docs/development.md.
"""

from __future__ import annotations

import ast
import asyncio
import base64
import builtins
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import io
import json
import linecache
import os
import re
import shlex
import signal
import subprocess
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
_SYMPY_PRINTING = "sympy.interactive.printing"
_PR_SET_PDEATHSIG = 1  # prctl(2)
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
        self.pid = os.getpid()
        # While a cell runs: the streams records go to, whatever the cell does to sys.stdout.
        self._channels: tuple[_Pieces, _Pieces] | None = None
        # The streams cells put in sys.stdout and sys.stderr, kept for the next cells.
        self._cells_streams: tuple[Any, Any] = (None, None)
        # What cells read as stdin, when the real one is the daemon's command pipe.
        self.cell_stdin: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._formatter: Any = None

    def emit(self, kind: str, **fields: Any) -> None:
        """Write one marker record, after whatever the cell printed so far."""
        out, err = self._channels or (sys.stdout, sys.stderr)
        out.flush()
        err.flush()
        record = MARKER_START + json.dumps({"kind": kind, **fields}, default=_json_default)
        record += MARKER_END
        # In pieces: the daemon reads its worker's output in lines of at most 1 MiB.
        for start in range(0, len(record), _EMIT_PIECE_CHARS):
            out.write(record[start : start + _EMIT_PIECE_CHARS])
            out.flush()

    def run(self, encoded_source: str) -> None:
        """Run one cell, given as base64 of its UTF-8 source. Never raises.

        What the cell writes to stdout and stderr goes on in pieces (see `_Pieces`). The
        runner's records go to the streams it was given, whatever the cell makes of
        ``sys.stdout``; ``sys.stdin`` reads nothing (the command pipe is not the cell's). All
        three are put back when the cell ends; a stream that a cell put in ``sys.stdout`` or
        ``sys.stderr`` is there again for the next cells, as in a kernel.
        """
        streams = sys.stdout, sys.stderr, sys.stdin
        channels = self._channels = _Pieces(streams[0]), _Pieces(streams[1])
        sys.stdout = self._cells_streams[0] or channels[0]
        sys.stderr = self._cells_streams[1] or channels[1]
        if self.cell_stdin is not None:
            sys.stdin = self.cell_stdin
        try:
            self._run(encoded_source)
        finally:
            self._cells_streams = (
                None if sys.stdout is channels[0] else sys.stdout,
                None if sys.stderr is channels[1] else sys.stderr,
            )
            self._channels = None
            sys.stdout, sys.stderr, sys.stdin = streams

    def _run(self, encoded_source: str) -> None:
        self.count += 1
        count = self.count
        self.emit("start", count=count, pid=os.getpid())
        try:
            self._execute(base64.b64decode(encoded_source).decode("utf-8"), count)
        except _ExitRequested as exc:
            self._stop_if_forked()
            self.emit("exit", code=exc.code if isinstance(exc.code, int) else 0)
            return
        except BaseException as exc:  # user code's exceptions are data, interrupts included
            self._stop_if_forked()
            self.emit("error", **error_fields(exc))
        self._stop_if_forked()
        self.show_figures()

    def _stop_if_forked(self) -> None:
        """In a process forked by the cell, which has reached the cell's end: stop it.

        It is a copy of this interpreter holding the daemon's pipes: going on, it would end
        the cell as if it were the interpreter and read the next cells' commands. What it
        printed is sent; then it stops (no CPU) until the interpreter ends, which kills it, as
        a forked kernel does on the Jupyter backends.
        """
        if os.getpid() == self.pid:
            return
        for stream in self._channels or (sys.stdout, sys.stderr):
            stream.flush()
        _stop_until_parent_ends()

    def _execute(self, source: str, count: int) -> None:
        filename = f"<cell-{count}>"
        source = self._transform(source)
        # So that tracebacks show the cell's lines.
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        tree = ast.parse(source, filename)
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr) and not ends_quietly(source):
            last = ast.Expression(tree.body.pop().value)  # type: ignore[attr-defined]
        self._evaluate(compile(tree, filename, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT))
        if last is None:
            return
        value = self._evaluate(
            compile(last, filename, "eval", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        )
        if value is not None:
            self.namespace["_"] = value
            data, metadata, failure = self.format(value)
            if failure is not None:
                raise failure
            self.emit("result", count=count, data=data, metadata=metadata)

    def _evaluate(self, code: types.CodeType) -> Any:
        """Run compiled cell code in the namespace; code with a top-level ``await`` runs to its
        end on the runner's event loop (one for the interpreter's life, as a kernel's)."""
        if not code.co_flags & inspect.CO_COROUTINE:
            return eval(code, self.namespace)
        if self._loop is None or self._loop.is_closed():
            self._loop = asyncio.new_event_loop()
        task = self._loop.create_task(eval(code, self.namespace))
        try:
            return self._loop.run_until_complete(task)
        except BaseException:
            task.cancel()  # interrupted: it must not go on in the next cell's turn
            raise

    def _transform(self, source: str) -> str:
        """Apply IPython's input transformations (magics, ``!`` commands, dedent): IPython's
        own when it is installed, else `transform_magics`'s for whole-line ones."""
        shell = _shell()
        if shell is not None:
            return str(shell.transform_cell(source))
        try:
            from IPython.core.inputtransformer2 import TransformerManager
        except ImportError:
            return transform_magics(source)
        return str(TransformerManager().transform_cell(source))  # type: ignore[no-untyped-call]

    def format(
        self, value: object, include: Any = None, exclude: Any = None
    ) -> tuple[dict[str, Any], dict[str, Any], BaseException | None]:
        """The MIME bundle and metadata of a value, as IPython's display formatter makes them,
        and the exception a formatter raised (None if none), which a kernel shows as an error:
        a cell's value then fails the cell; a display shows it and goes on. The bundle holds
        the formats that did not fail."""
        shell = _shell()
        if shell is not None:
            data, metadata = shell.display_formatter.format(value, include, exclude)
            return dict(data), dict(metadata), None
        formatter = self.display_formatter()
        if formatter is None:
            return _plain_bundle(value), {}, None
        from IPython.core import formatters

        # IPython's formatters hand a failure to the shell's showtraceback, when one runs.
        failure = _FormatFailure()
        names = vars(formatters)
        shown_to = names["get_ipython"]
        names["get_ipython"] = lambda: failure
        try:
            data, metadata = formatter.format(value, include, exclude)
        finally:
            names["get_ipython"] = shown_to
        return dict(data), dict(metadata), failure.error

    def display_formatter(self) -> Any:
        """IPython's ``DisplayFormatter`` for this interpreter, made once (so what a library
        registers in it stays, as in a shell), with a PNG for matplotlib figures as Jupyter's
        inline backend registers; None without IPython."""
        if self._formatter is None:
            try:
                from IPython.core.formatters import DisplayFormatter
            except ImportError:
                return None
            self._formatter = DisplayFormatter()
            self._formatter.formatters["image/png"].for_type_by_name(
                "matplotlib.figure", "Figure", figure_png
            )
        return self._formatter

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
                data, shown_metadata, failure = self.format(obj, include, exclude)
                if failure is not None:
                    self.emit("error", shown=True, **error_fields(failure))
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
                self.emit("display", data=_plain_bundle(manager.canvas.figure), metadata={})
        finally:
            if Gcf.get_all_fig_managers():
                pyplot.close("all")


class _FormatFailure:
    """Stands in for IPython's shell while a cell's value is formatted: keeps the first
    exception a formatter hands to ``showtraceback``."""

    def __init__(self) -> None:
        self.error: BaseException | None = None

    def showtraceback(self, exc_info: Any = None, *args: object, **kwargs: object) -> None:
        """Keep the exception (the first one), its traceback from the first frame outside
        IPython, as a kernel shows it."""
        if self.error is not None:
            return
        error = (exc_info or sys.exc_info())[1]
        if error is None:
            return
        tb = error.__traceback__
        ipython_dir = os.path.dirname(_ipython_file()) + os.sep
        while tb is not None and tb.tb_frame.f_code.co_filename.startswith(ipython_dir):
            tb = tb.tb_next
        self.error = error.with_traceback(tb)


def _ipython_file() -> str:
    import IPython

    return str(IPython.__file__)


def figure_png(figure: Any) -> bytes | None:
    """A matplotlib figure as PNG bytes, as Jupyter's inline backend draws it; None for a
    figure with nothing drawn (no axes, no lines), which shows as its text only."""
    if not figure.axes and not figure.lines:
        return None
    png = io.BytesIO()
    figure.canvas.print_figure(
        png,
        format="png",
        facecolor=figure.get_facecolor(),
        edgecolor=figure.get_edgecolor(),
        dpi=figure.dpi,
        bbox_inches="tight",
    )
    return png.getvalue()


def _plain_bundle(value: object) -> dict[str, Any]:
    """A value's MIME bundle without IPython: its ``repr``, and a figure's PNG."""
    data: dict[str, Any] = {"text/plain": repr(value)}
    figure_type = getattr(sys.modules.get("matplotlib.figure"), "Figure", None)
    if figure_type is not None and isinstance(value, figure_type):
        png = figure_png(value)
        if png is not None:
            data["image/png"] = png
    return data


class UsageError(Exception):
    """A magic that cannot run here: unknown, or asked for what only IPython can do (the name
    and message IPython gives an unknown magic)."""


class PlainShell:
    """What ``get_ipython()`` gives cells (and SymPy's ``init_printing``) in a plain
    interpreter: the display formatter results are made with, and the calls IPython's input
    transformations make of magics and ``!`` commands, for those the runner can honour.

    Honoured: ``%matplotlib`` (inline figures only), ``%env``, ``%pip``, ``!cmd``, ``x = !cmd``,
    ``%%bash``/``%%sh`` and ``%%writefile [-a]``; any other magic raises `UsageError`.
    """

    colors = "neutral"  # IPython's default scheme, which SymPy reads to pick its ink

    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        self.namespace = runner.namespace

    @property
    def display_formatter(self) -> Any:
        """The IPython ``DisplayFormatter`` that cells' values and displays go through."""
        return self.runner.display_formatter()

    def run_line_magic(self, name: str, line: str, _stack_depth: int = 1) -> Any:
        """Run line magic ``%name line``."""
        method = getattr(self, f"line_{name}", None)
        if method is None:
            raise UsageError(f"Line magic function `%{name}` not found.")
        return method(line)

    def run_cell_magic(self, name: str, line: str, cell: str) -> Any:
        """Run cell magic ``%%name line`` on the rest of the cell."""
        method = getattr(self, f"cell_{name}", None)
        if method is None:
            raise UsageError(f"Cell magic `%%{name}` not found.")
        return method(line, cell)

    def system(self, command: str) -> None:
        """``!command``: run it in a shell, its stdout and stderr printed as they come; its
        status in ``_exit_code``, as IPython keeps it."""
        self._shell_run(command, None, print_lines=True)

    def getoutput(self, command: str, split: bool = True, depth: int = 0) -> list[str]:
        """``x = !command``: the lines it printed (stdout and stderr)."""
        return self._shell_run(command, None, print_lines=False)

    def _shell_run(self, command: str, script: str | None, *, print_lines: bool) -> list[str]:
        process = subprocess.Popen(
            command if script is None else shlex.split(command),
            shell=script is None,
            stdin=subprocess.DEVNULL if script is None else subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
        )
        if script is not None:
            assert process.stdin is not None
            process.stdin.write(script)
            process.stdin.close()
        lines = []
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line.rstrip("\n"))
            if print_lines:
                print(line, end="", flush=True)
        self.namespace["_exit_code"] = process.wait()
        return lines

    def line_matplotlib(self, line: str) -> None:
        """``%matplotlib [inline]``: figures show inline, as they do here anyway."""
        gui = line.strip() or "inline"
        if gui != "inline":
            raise UsageError(f"%matplotlib {gui}: only inline figures can be shown here")
        import matplotlib

        _use_figure_backend(matplotlib)

    def line_env(self, line: str) -> Any:
        """``%env``: all variables; ``%env NAME``: one; ``%env NAME=VALUE`` (or ``NAME
        VALUE``): set it, saying so as IPython does."""
        line = line.strip()
        if not line:
            return dict(os.environ)
        name, equals, value = line.partition("=")
        if not equals:
            name, _, value = line.partition(" ")
            if not value.strip():
                return os.environ[name]
        name, value = name.strip(), value.strip()
        os.environ[name] = value
        print(f"env: {name}={value}")
        return None

    def line_pip(self, line: str) -> None:
        """``%pip ARGS``: pip of this interpreter."""
        self.system(f"{shlex.quote(sys.executable)} -m pip {line}")

    def cell_bash(self, line: str, cell: str) -> None:
        """``%%bash``: the cell is a bash script."""
        self._shell_run(f"bash {line}", cell, print_lines=True)

    def cell_sh(self, line: str, cell: str) -> None:
        """``%%sh``: the cell is a sh script."""
        self._shell_run(f"sh {line}", cell, print_lines=True)

    def cell_writefile(self, line: str, cell: str) -> None:
        """``%%writefile [-a] PATH``: write (or append) the cell to a file."""
        args = shlex.split(line)
        append = bool(args) and args[0] in ("-a", "--append")
        paths = args[1:] if append else args
        if len(paths) != 1:
            raise UsageError(f"%%writefile takes one file name, not {line!r}")
        path = os.path.expanduser(paths[0])
        verb = "Appending to" if append else "Overwriting" if os.path.exists(path) else "Writing"
        print(f"{verb} {paths[0]}")
        with open(path, "a" if append else "w", encoding="utf-8") as file:
            file.write(cell)


_MAGIC_LINE = re.compile(r"^([ \t]*)(%%|%|!)(.*)$")


def transform_magics(source: str) -> str:
    """A cell's whole-line magics and ``!`` commands as the calls IPython makes of them, for
    an interpreter without IPython. Only when the cell is not already Python: a cell magic
    (``%%``) on its first line takes the cell; ``%name args`` and ``!cmd`` lines become
    ``get_ipython()`` calls. Anything else stays as it is."""
    try:
        ast.parse(source)
        return source
    except SyntaxError:
        pass
    lines = source.splitlines()
    first = _MAGIC_LINE.match(lines[0]) if lines else None
    if first and first.group(2) == "%%":
        name, _, line = first.group(3).partition(" ")
        cell = "".join(part + "\n" for part in lines[1:])
        return f"get_ipython().run_cell_magic({name!r}, {line!r}, {cell!r})\n"
    changed = []
    for text in lines:
        match = _MAGIC_LINE.match(text)
        if match and match.group(2) == "%":
            name, _, line = match.group(3).partition(" ")
            text = f"{match.group(1)}get_ipython().run_line_magic({name!r}, {line!r})"
        elif match and match.group(2) == "!":
            text = f"{match.group(1)}get_ipython().system({match.group(3)!r})"
        changed.append(text)
    return "".join(text + "\n" for text in changed)


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


def _give_children_no_stdin() -> bool:
    """Keep the command pipe (fd 0) for this interpreter only: children get /dev/null.

    A child process inherits fd 0, so one that reads stdin (``cat``, a prompt) would block on
    the daemon's command pipe, or swallow the next cells. The interpreter reads its commands
    through ``sys.stdin``, which moves to a copy of the pipe; the original object stays in
    ``sys.__stdin__``, so it is never collected (closing fd 0).

    Returns:
        Whether it did: fd 0, and so ``sys.__stdin__``, now reads /dev/null.
    """
    try:
        if sys.stdin is None or sys.stdin.fileno() != 0:
            return False
    except (OSError, ValueError):
        return False
    sys.stdin = os.fdopen(os.dup(0), "r", encoding=sys.stdin.encoding or "utf-8")
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    return True


def _shell() -> Any:
    """The running IPython shell, if this interpreter is one."""
    ipython = sys.modules.get("IPython")
    return None if ipython is None else ipython.get_ipython()


def _patch_display(runner: Runner, module: types.ModuleType) -> None:
    for name in ("display", "update_display", "clear_output"):
        if hasattr(module, name):
            setattr(module, name, getattr(runner, name))


def _stop_until_parent_ends() -> None:
    """Stop this (forked) process until its parent ends; then it is killed (Linux's parent
    death signal: a stopped process is no one's to reap or end otherwise)."""
    parent = os.getppid()
    try:
        import ctypes

        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # not Linux: it ends when its process group or sandbox is killed
    if os.getppid() != parent:
        os._exit(1)  # the parent ended before the signal was asked for
    os.kill(os.getpid(), signal.SIGSTOP)


def _give_shell(module: types.ModuleType, shell: PlainShell) -> None:
    module.get_ipython = lambda: shell  # type: ignore[attr-defined]


def _pandas_as_in_a_kernel(pandas: types.ModuleType) -> None:
    """pandas takes a plain interpreter for a terminal and cuts wide frames to fit it with
    ``...``; in a kernel it shows up to 20 columns, wrapped at ``display.width``."""
    if pandas.get_option("display.max_columns") == 0:
        pandas.set_option("display.max_columns", 20)


def _use_figure_backend(matplotlib: types.ModuleType) -> None:
    if "matplotlib.pyplot" in sys.modules:
        sys.modules["matplotlib.pyplot"].switch_backend(FIGURE_BACKEND)
    else:
        matplotlib.rcParams["backend"] = FIGURE_BACKEND


def install(namespace: dict[str, Any]) -> Runner:
    """Set the runner up in an interpreter whose globals are ``namespace``; send ``ready``."""
    runner = Runner(namespace)
    hooks: dict[str, Callable[[types.ModuleType], None]] = {
        "matplotlib": _use_figure_backend,
        "pandas": _pandas_as_in_a_kernel,
    }
    for name in _DISPLAY_MODULES:
        if name in sys.modules:
            _patch_display(runner, sys.modules[name])
        else:
            hooks[name] = lambda module: _patch_display(runner, module)
    for name in ("matplotlib", "pandas"):
        if name in sys.modules:
            hooks.pop(name)(sys.modules[name])
    sys.meta_path.insert(0, _AfterImport(hooks, runner))
    builtins.display = runner.display  # type: ignore[attr-defined]
    namespace["exit"] = namespace["quit"] = _ExitCommand()
    if _shell() is None:
        shell = PlainShell(runner)
        namespace["get_ipython"] = lambda: shell
        if importlib.util.find_spec("IPython") is not None:
            # SymPy's init_printing looks for get_ipython() to print as in a notebook.
            hooks[_SYMPY_PRINTING] = lambda module: _give_shell(module, shell)
            if _SYMPY_PRINTING in sys.modules:
                _give_shell(sys.modules[_SYMPY_PRINTING], shell)
        # A plain interpreter's stdin is the daemon's command pipe: reading it would eat cells.
        import getpass

        builtins.input = _no_stdin
        getpass.getpass = _no_stdin
        if _give_children_no_stdin():
            # As a kernel's stdin (jupyter_client gives it none to read): reads find its end.
            runner.cell_stdin = sys.__stdin__
    runner.emit("ready", pid=os.getpid())
    return runner
