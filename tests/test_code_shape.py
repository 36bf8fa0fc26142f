"""The product code's shape (issue 21): no function in `prefect_sandbox` over `MAX_LINES`
lines, docstring included; a flow's parameter list, which mirrors its options one per line,
and its docstring, which documents each, do not count. The layout (issue 32): the core imports
nothing above it, the remote backends nothing of the host-kernel ones, kernel-side code nothing
of ours; and no product module holds kernel-side code in a string. Prose (issue 32): no module
docstring over `MAX_MODULE_DOCSTRING_LINES` lines."""

from __future__ import annotations

import ast
import string
import textwrap
from pathlib import Path

from prefect_sandbox.sandbox.notebook import parse_python

MAX_LINES = 80
MAX_MODULE_DOCSTRING_LINES = 15
PACKAGE = Path(__file__).resolve().parent.parent / "prefect_sandbox"

Function = ast.FunctionDef | ast.AsyncFunctionDef


def _is_flow(function: Function) -> bool:
    """Decorated ``@flow`` or ``@flow(...)``."""
    for decorator in function.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        if isinstance(target, ast.Name | ast.Attribute) and ast.unparse(target).endswith("flow"):
            return True
    return False


def _counted_lines(function: Function) -> int:
    """Lines from ``def`` to the function's end; for a flow, from its first statement after
    the docstring."""
    assert function.end_lineno is not None
    if not _is_flow(function):
        return function.end_lineno - function.lineno + 1
    body = function.body
    if ast.get_docstring(function) is not None:
        body = body[1:]
    return function.end_lineno - body[0].lineno + 1


def _long_functions(source: str) -> dict[str, int]:
    return {
        f"{node.name}:{node.lineno}": lines
        for node in ast.walk(parse_python(source))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and (lines := _counted_lines(node)) > MAX_LINES
    }


def test_no_function_is_over_the_line_limit() -> None:
    long = {
        f"{path.relative_to(PACKAGE).as_posix()}:{name}": lines
        for path in sorted(PACKAGE.rglob("*.py"))
        for name, lines in _long_functions(path.read_text()).items()
    }
    assert long == {}


def test_the_rule_counts_a_plain_function_whole_and_a_flow_from_its_body() -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    plain = f'def f(\n    a: int,\n) -> None:\n    """Doc."""\n{body}\n'
    assert _long_functions(plain) == {"f:1": MAX_LINES + 4}
    params = "\n".join(f"    a{i}: int," for i in range(40))
    flow = f'@flow(name="x")\nasync def g(\n{params}\n) -> None:\n    """Doc."""\n{body}\n'
    assert _long_functions(flow) == {}
    assert _long_functions(flow + "    y = 1\n") == {"g:2": MAX_LINES + 1}


def _imported_modules(path: Path) -> set[str]:
    """The absolute module names a file imports, at any depth of its code."""
    names: set[str] = set()
    for node in ast.walk(parse_python(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def test_the_core_imports_nothing_above_it_and_remote_backends_no_kernel_machinery() -> None:
    core = PACKAGE / "sandbox"
    above = {
        f"{path.relative_to(PACKAGE).as_posix()}: {name}"
        for path in core.rglob("*.py")
        for name in _imported_modules(path)
        if name.split(".")[0] == "prefect"
        or (name.startswith("prefect_sandbox.") and not name.startswith("prefect_sandbox.sandbox"))
    }
    assert above == set()
    kernel = "prefect_sandbox.sandbox.backends.kernel"
    remote = [core / "backends" / name for name in ("e2b.py", "daytona.py")]
    assert {
        f"{path.name}: {name}"
        for path in remote
        for name in _imported_modules(path)
        if name == kernel or name.startswith(f"{kernel}.")
    } == set()
    # Code that runs in a kernel or a sandbox has none of our package there.
    kernel_side = [path for path in (core / "kernel_side").glob("*.py") if path.stem != "__init__"]
    assert {
        f"{path.name}: {name}"
        for path in kernel_side
        for name in _imported_modules(path)
        if name.split(".")[0] == "prefect_sandbox"
    } == set()


def _statements(text: str) -> list[ast.stmt]:
    """The statements ``text`` parses as, read as it is or as a `str.format` template (each
    field a name); none when it is not Python."""
    try:
        as_template = "".join(
            literal + ("x" if field is not None else "")
            for literal, field, _, _ in string.Formatter().parse(text)
        )
    except ValueError:
        as_template = text
    for candidate in (text, as_template):
        try:
            return ast.parse(textwrap.dedent(candidate)).body
        except (SyntaxError, ValueError):
            continue
    return []


def _python_in_strings(source: str) -> list[int]:
    """Lines of the string constants (f-strings and templates too, a field read as a name) that are
    Python source of two statements or more with a ``def``, ``class`` or ``import``: code for
    a kernel held in a string. Docstrings and a parameter's default (a user's own code, such as
    a setup cell) are not looked at; prose and SQL do not parse."""
    tree = parse_python(source)
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            skipped.add(id(node.value))  # a docstring, or an attribute's
        elif isinstance(node, ast.arguments):
            skipped |= {id(default) for default in [*node.defaults, *node.kw_defaults]}
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
        elif isinstance(node, ast.JoinedStr):
            text = "".join(p.value if isinstance(p, ast.Constant) else "x" for p in node.values)
        else:
            continue
        statements = _statements(text)
        definitions = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef
        if len(statements) > 1 and any(
            isinstance(statement, definitions | ast.Import | ast.ImportFrom)
            for statement in statements
        ):
            found.append(node.lineno)
    return found


def test_no_product_module_holds_kernel_side_code_in_a_string() -> None:
    # It lives in prefect_sandbox/sandbox/kernel_side/, read and checked like the rest (issue
    # 32). The emulators under testing/ are left out: they reproduce what the vendors' servers
    # send (E2B's env-var lines, its template's startup scripts).
    found = {
        path.relative_to(PACKAGE).as_posix(): lines
        for path in sorted(PACKAGE.rglob("*.py"))
        if "testing" not in path.relative_to(PACKAGE).parts
        and (lines := _python_in_strings(path.read_text()))
    }
    assert found == {}


def test_the_string_check_finds_code_and_passes_prose_sql_and_defaults() -> None:
    held = 'CODE = """\nimport os\nprint(os.getpid())\n"""\n'
    formatted = 'def code(n):\n    return f"def f():\\n    return {n}\\nf()"\n'
    assert _python_in_strings(held) == [1]
    assert _python_in_strings(formatted) == [2]
    template = 'CODE = """\nimport json\nprint(json.dumps({root!r}, {{}}))\n"""\n'
    assert _python_in_strings(template) == [1]
    prose = 'TEXT = """Import the module first.\nThen run it; def is a keyword."""\n'
    sql = 'SQL = "DELETE FROM history WHERE session = ?; SELECT 1"\n'
    one_line = 'CALL = "import os"\n'
    default = "def f(setup=\"import matplotlib\\nmatplotlib.use('Agg')\"):\n    pass\n"
    doc = 'def g():\n    """Run:\n\n    import os\n    os.getpid()\n    """\n'
    assert [_python_in_strings(text) for text in (prose, sql, one_line, default, doc)] == [[]] * 5


def test_the_reaper_imports_nothing_from_the_pipeline_flows() -> None:
    pipeline = {
        "prefect_sandbox.flows.pipeline",
        "prefect_sandbox.flows.pipeline_run",
        "prefect_sandbox.flows.session",
    }
    assert _imported_modules(PACKAGE / "flows" / "reaper.py") & pipeline == set()


def test_one_function_answers_whether_a_deadline_passed() -> None:
    # Whether Prefect's timeout_seconds has passed is asked of the clock in one place (issue
    # 32): anyio's cancel-scope clock, or the flow run's start.
    readers = sorted(
        path.relative_to(PACKAGE).as_posix()
        for path in PACKAGE.rglob("*.py")
        if "anyio.current_time()" in (text := path.read_text()) or "context.start_time" in text
    )
    assert readers == ["tasks/scopes.py"]


def _module_docstring_lines(source: str) -> int:
    """Lines of a module's docstring, its quotes included; 0 for none."""
    body = parse_python(source).body
    if not body or not isinstance(body[0], ast.Expr):
        return 0
    value = body[0].value
    if not (isinstance(value, ast.Constant) and isinstance(value.value, str)):
        return 0
    assert body[0].end_lineno is not None
    return body[0].end_lineno - body[0].lineno + 1


def test_no_module_docstring_is_over_the_line_limit() -> None:
    # What a module holds, its invariant, its hard-won facts and its docs page, in a few lines;
    # the manual (docs/) tells the rest (issue 32).
    long = {
        path.relative_to(PACKAGE).as_posix(): lines
        for path in sorted(PACKAGE.rglob("*.py"))
        if (lines := _module_docstring_lines(path.read_text())) > MAX_MODULE_DOCSTRING_LINES
    }
    assert long == {}


def test_a_module_docstring_is_counted_from_its_opening_to_its_closing_quotes() -> None:
    assert _module_docstring_lines('"""One line."""\nx = 1\n') == 1
    assert _module_docstring_lines('"""Title.\n\nMore.\n"""\n') == 4
    assert _module_docstring_lines('x = """not a docstring"""\n') == 0
    assert _module_docstring_lines("") == 0
