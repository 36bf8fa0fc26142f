"""The product code's shape (issue 21): no function in `prefect_sandbox` over `MAX_LINES`
lines, docstring included; a flow's parameter list, which mirrors its options one per line,
and its docstring, which documents each, do not count. The layout (issue 32): the core imports
nothing above it, and the remote backends nothing of the host-kernel ones."""

from __future__ import annotations

import ast
from pathlib import Path

from prefect_sandbox.sandbox.notebook import parse_python

MAX_LINES = 80
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
    remote = [core / "backends" / name for name in ("e2b.py", "daytona.py", "_daytona_runner.py")]
    assert {
        f"{path.name}: {name}"
        for path in remote
        for name in _imported_modules(path)
        if name == kernel or name.startswith(f"{kernel}.")
    } == set()


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
