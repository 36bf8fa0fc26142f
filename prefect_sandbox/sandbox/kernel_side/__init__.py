"""Code that runs inside a kernel or a sandbox, kept as real modules that ruff and mypy read.

Each module here runs in another interpreter (a kernel's namespace, a sandbox's ``python3``) and
imports nothing of prefect_sandbox: the host reads its text (`source`) and sends it. Values go
as JSON, never formatted into the source: a script run with ``python -c`` reads one JSON argument
(``sys.argv[1]``); code for a kernel (`run_code`) calls the module's entry function with a JSON
literal that the function parses. `run_code` runs the module in a namespace of its own, so the
user's namespace keeps no name of ours. The host's side: docs/development.md.
"""

from __future__ import annotations

import functools
import importlib.resources
import json

__all__ = ["python_str", "run_code", "source"]


@functools.cache
def source(module: str) -> str:
    """The text of this package's module ``module`` (e.g. ``"fork_guard"``).

    Raises:
        FileNotFoundError: there is no such module.
    """
    return importlib.resources.files(__name__).joinpath(f"{module}.py").read_text(encoding="utf-8")


def python_str(text: str) -> str:
    """A Python string literal of ``text`` (JSON's string escapes are Python's).

    ``text`` must hold no lone surrogate (our sources do not; JSON texts are ASCII).
    """
    return json.dumps(text, ensure_ascii=False)


def run_code(module: str, entry: str, args: object = None) -> str:
    """One statement that runs this package's ``module`` in a namespace of its own and calls
    its function ``entry``: with no argument when ``args`` is None, else with ``args``' JSON
    text (the function parses it).

    The statement's value is None, so a kernel displays nothing; a traceback names the module
    as ``<prefect-sandbox kernel_side/MODULE.py>``.

    Raises:
        FileNotFoundError: there is no such module.
        TypeError: ``args`` is not JSON-serialisable.
    """
    call = f"{entry}()" if args is None else f"{entry}({python_str(json.dumps(args))})"
    code = f"{source(module)}\n{call}\n"
    filename = f"<prefect-sandbox kernel_side/{module}.py>"
    namespace = f"{{'__name__': {python_str(f'{__name__}.{module}')}}}"
    return f"exec(compile({python_str(code)}, {python_str(filename)}, 'exec'), {namespace})\n"
