"""JSON Schema for a notebook's parameters, from its cell tagged ``parameters``.

A `NotebookParameter`'s type (its annotation's source, or the type of its literal default, as
papermill's ``--help-notebook`` infers it) is read as an AST, never evaluated: builtins, dates,
``list[X]``, ``dict[str, X]``, ``Optional[X]``, ``X | Y`` and ``Literal[...]`` map to their
JSON Schema; anything else (a class of the notebook's own, a call) leaves the value untyped.
A literal default becomes the schema's ``default``; none of the parameters is required, since
the notebook's own assignment applies to those left out. The deployments page of the docs
(docs/how-to/deployments.md) shows the Run form this makes.
"""

from __future__ import annotations

import ast
import datetime
import json
from typing import Any

from nbformat import NotebookNode

from prefect_sandbox.sandbox.notebook import NotebookParameter, notebook_parameters

__all__ = ["notebook_parameters_schema", "parameter_schema"]

_NAMES: dict[str, dict[str, Any]] = {
    "int": {"type": "integer"},
    "float": {"type": "number"},
    "str": {"type": "string"},
    "bool": {"type": "boolean"},
    "None": {"type": "null"},
    "NoneType": {"type": "null"},
    "list": {"type": "array"},
    "List": {"type": "array"},
    "tuple": {"type": "array"},
    "Tuple": {"type": "array"},
    "set": {"type": "array"},
    "dict": {"type": "object"},
    "Dict": {"type": "object"},
    "date": {"type": "string", "format": "date"},
    "datetime": {"type": "string", "format": "date-time"},
    "time": {"type": "string", "format": "time"},
    "Any": {},
}
_OPTIONAL = {"Optional"}
_UNION = {"Union"}
_LITERAL = {"Literal"}
_SEQUENCES = {"list", "List", "set", "Set", "Sequence", "tuple", "Tuple"}
_MAPPINGS = {"dict", "Dict", "Mapping"}


def _name(node: ast.expr) -> str | None:
    """``int`` of ``int``, ``date`` of ``datetime.date``, ``Optional`` of ``typing.Optional``."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Constant) and node.value is None:
        return "None"
    return None


def _schema(node: ast.expr) -> dict[str, Any]:
    """The JSON Schema of an annotation's AST; ``{}`` (any value) for what it cannot map."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return _any_of([_schema(node.left), _schema(node.right)])
    if isinstance(node, ast.Subscript):
        outer = _name(node.value)
        items = list(node.slice.elts) if isinstance(node.slice, ast.Tuple) else [node.slice]
        if outer in _OPTIONAL:
            return _any_of([_schema(items[0]), {"type": "null"}])
        if outer in _UNION:
            return _any_of([_schema(item) for item in items])
        if outer in _LITERAL:
            return {"enum": [_literal(item) for item in items]}
        if outer in _SEQUENCES:
            schema: dict[str, Any] = {"type": "array"}
            if len(items) == 1 or (len(items) == 2 and _is_ellipsis(items[1])):
                schema["items"] = _schema(items[0])
            return schema
        if outer in _MAPPINGS and len(items) == 2:
            return {"type": "object", "additionalProperties": _schema(items[1])}
        return dict(_NAMES.get(outer or "", {}))
    return dict(_NAMES.get(_name(node) or "", {}))


def _is_ellipsis(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and node.value is Ellipsis


def _literal(node: ast.expr) -> Any:
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None


def _any_of(schemas: list[dict[str, Any]]) -> dict[str, Any]:
    """One schema for a union: any value when one member is (``{}``)."""
    if any(not schema for schema in schemas):
        return {}
    return {"anyOf": schemas}


def _json_default(source: str) -> tuple[bool, Any]:
    """Whether the default's source is a literal that JSON can hold, and its value."""
    try:
        value = ast.literal_eval(source)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False, None
    if isinstance(value, tuple | set):
        value = list(value)
    if isinstance(value, datetime.date | datetime.time):
        value = value.isoformat()
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return False, None
    return True, value


def parameter_schema(parameter: NotebookParameter, position: int) -> dict[str, Any]:
    """One parameter's JSON Schema, as Prefect's deployment parameter schema writes a field.

    Args:
        parameter: the parameter, from `notebook_parameters`.
        position: its place in the Run form (Prefect orders fields by ``position``).

    Returns:
        ``title`` (the name), ``position``, the type's keywords (none when unknown),
        ``default`` when the notebook's default is a JSON-able literal, and ``description``:
        the assignment's comment, or the default's source when it is no literal.
    """
    schema: dict[str, Any] = {"title": parameter.name, "position": position}
    if parameter.type_name and parameter.type_name != "None":
        try:
            annotation = ast.parse(parameter.type_name, mode="eval").body
        except SyntaxError:
            annotation = None
        if annotation is not None:
            schema.update(_schema(annotation))
    has_default, default = _json_default(parameter.default)
    descriptions = [parameter.help] if parameter.help else []
    if has_default:
        schema["default"] = default
    else:
        descriptions.append(f"default in the notebook: {parameter.default}")
    if descriptions:
        schema["description"] = "; ".join(descriptions)
    return schema


def notebook_parameters_schema(notebook: NotebookNode) -> dict[str, Any]:
    """The JSON Schema of a mapping of the notebook's parameters to values.

    Returns:
        An object schema with a property per parameter (`parameter_schema`), in the cell's
        order, none required; names the cell does not assign are still allowed, as papermill
        allows them (with a warning). An object with no properties for a notebook without a
        cell tagged ``parameters``.

    Raises:
        NotebookError: the cell tagged ``parameters`` is not valid Python (names the cell).
    """
    found = notebook_parameters(notebook) or []
    return {
        "type": "object",
        "title": "parameters",
        "properties": {
            parameter.name: parameter_schema(parameter, position)
            for position, parameter in enumerate(found)
        },
    }
