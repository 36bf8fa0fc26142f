"""A sweep's grid: the parameter sets it runs, checked before anything runs, and the grid and
parameters files the CLI reads (``.json``, or ``.yaml`` / ``.yml`` with YAML's safe loader).
Pure functions, apart from reading the file. Manual: docs/how-to/sweeps.md.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import yaml

from prefect_sandbox.flows.errors import GridError
from prefect_sandbox.sandbox.errors import SandboxError
from prefect_sandbox.sandbox.notebook import parameter_name_problem, python_literal

__all__ = ["MAX_BRANCHES", "expand_grid", "read_grid", "read_parameters_file"]

MAX_BRANCHES = 10_000
"""Parameter sets a grid may expand to at most (a cartesian product grows fast)."""


class _GridCheck:
    """Checks one grid's names and values, naming ``source`` (its file) in each error."""

    def __init__(self, source: str) -> None:
        self.source = source

    def error(self, where: str, problem: str) -> GridError:
        return GridError(f"{self.source}: {where}{problem}", source=self.source)

    def name(self, name: object, where: str) -> str:
        problem = parameter_name_problem(name)
        if problem:
            raise self.error(where, f"parameter name {name!r} {problem}")
        return cast(str, name)

    def value(self, value: Any, where: str) -> None:
        try:
            python_literal(value)
        except SandboxError as exc:
            raise self.error(where, str(exc)) from None


def expand_grid(grid: Any, source: str = "grid") -> list[dict[str, Any]]:
    """The parameter sets a grid stands for, checked before anything runs.

    Args:
        grid: a list of parameter sets (each a mapping of name to value), run as given; or a
            mapping of name to a list of values, run as their cartesian product (the first
            name varies slowest). Values are those `arun_notebook` injects: None, bools,
            numbers, strings, dates, and lists, tuples and dicts of those.
        source: what to call the grid in errors, e.g. its file's path.

    Returns:
        The parameter sets, in order: 1 to `MAX_BRANCHES` of them.

    Raises:
        GridError: the grid is neither form, is empty, expands past `MAX_BRANCHES`, or an
            entry, name or value is invalid (the message names ``source``, the entry by its
            0-based index or the parameter, and the problem).
    """
    check = _GridCheck(source)
    if isinstance(grid, Mapping):
        return _product(grid, check)
    if not isinstance(grid, list | tuple):
        raise check.error(
            "",
            "a grid is a list of parameter sets or a mapping of name to a list of values, "
            f"not {type(grid).__name__}",
        )
    if not grid:
        raise check.error("", "the grid has no parameter set")
    if len(grid) > MAX_BRANCHES:
        raise check.error("", f"{len(grid)} parameter sets; at most {MAX_BRANCHES} run")
    sets = []
    for index, entry in enumerate(grid):
        where = f"entry {index}: "
        if not isinstance(entry, Mapping):
            raise check.error(
                where, f"a parameter set is a mapping of name to value, not {type(entry).__name__}"
            )
        for name, value in entry.items():
            check.value(value, f"{where}parameter {check.name(name, where)!r}: ")
        sets.append(dict(entry))
    return sets


def _product(grid: Mapping[Any, Any], check: _GridCheck) -> list[dict[str, Any]]:
    if not grid:
        raise check.error("", "the grid names no parameter")
    for name, values in grid.items():
        where = f"parameter {check.name(name, '')!r}: "
        if not isinstance(values, list | tuple):
            raise check.error(
                where,
                f"a mapping grid gives each name a list of values, not {type(values).__name__}",
            )
        if not values:
            raise check.error(where, "no values")
        for index, value in enumerate(values):
            check.value(value, f"{where}value {index}: ")
    count = math.prod(len(values) for values in grid.values())
    if count > MAX_BRANCHES:
        raise check.error("", f"the product has {count} parameter sets; at most {MAX_BRANCHES} run")
    names = list(grid)
    return [dict(zip(names, values, strict=True)) for values in itertools.product(*grid.values())]


def read_grid(path: str | Path) -> list[dict[str, Any]]:
    """Read a grid file (``.json``, or ``.yaml`` / ``.yml`` read with YAML's safe loader) and
    expand it with `expand_grid`.

    Args:
        path: the file.

    Returns:
        The parameter sets, in order.

    Raises:
        GridError: the file has another suffix, cannot be read, is not valid JSON or YAML
            (with the line and column), holds a value that contains itself (a YAML alias
            inside its anchor), or holds an invalid grid (names the file and entry).
    """
    source = str(path)
    data = _read_data_file(path, _GridCheck(source), "grid")
    return expand_grid(data, source)


def read_parameters_file(path: str | Path) -> dict[str, Any]:
    """Read a parameters file: a mapping of parameter name to value, in ``.json``, or ``.yaml``
    / ``.yml`` read with YAML's safe loader (the CLI's ``-f``, as papermill's).

    Args:
        path: the file.

    Returns:
        The parameters, in file order.

    Raises:
        GridError: the file has another suffix, cannot be read, is not valid JSON or YAML, is
            not a mapping, or holds a bad name or a value with no Python literal (names the
            file and parameter).
    """
    check = _GridCheck(str(path))
    data = _read_data_file(path, check, "parameters")
    if not isinstance(data, dict):
        raise check.error("", "a parameters file holds a mapping of name to value")
    for name, value in data.items():
        check.value(value, f"{check.name(name, '')}: ")
    return data


def _read_data_file(path: str | Path, check: _GridCheck, what: str) -> Any:
    """The data in a ``.json``, ``.yaml`` or ``.yml`` file; errors name the file (and the
    line and column), ``what`` says what kind of file it should be."""
    suffix = Path(path).suffix.lower()
    if suffix not in (".json", ".yaml", ".yml"):
        raise check.error("", f"a {what} file's name ends in .json, .yaml or .yml")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise check.error("", f"cannot be read: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise check.error("", f"is not UTF-8 text: {exc.reason} at byte {exc.start}") from None
    try:
        data = json.loads(text) if suffix == ".json" else yaml.safe_load(text)
    except json.JSONDecodeError as exc:
        where = f"line {exc.lineno}, column {exc.colno}: "
        raise check.error(where, f"not valid JSON: {exc.msg}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise check.error(where, f"not valid YAML: {problem}") from None
    if _contains_itself(data):
        raise check.error("", "a value contains itself (a YAML alias inside its own anchor)")
    return data


def _contains_itself(data: Any) -> bool:
    """Whether a list or dict in ``data`` contains itself, as YAML's aliases can make one.

    Walked without recursion, each container once, so a deep or alias-heavy file costs no
    more than its distinct containers.
    """
    done: set[int] = set()
    on_path: set[int] = set()
    stack: list[tuple[Any, bool]] = [(data, False)]
    while stack:
        value, leaving = stack.pop()
        if leaving:
            on_path.discard(id(value))
            done.add(id(value))
            continue
        if not isinstance(value, list | dict) or id(value) in done:
            continue
        if id(value) in on_path:
            return True
        on_path.add(id(value))
        stack.append((value, True))
        stack.extend(
            (child, False) for child in (value.values() if isinstance(value, dict) else value)
        )
    return False
