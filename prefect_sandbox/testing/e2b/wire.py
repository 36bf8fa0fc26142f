"""Pure pieces of the E2B emulator: its routes and which call a request is, and MIME bundles
as the code interpreter's ``result`` lines. No I/O. Manual: docs/backends/e2b.md.
"""

from __future__ import annotations

import re
from typing import Any

from starlette.routing import compile_path

__all__ = ["MIME_FIELDS", "ROUTES", "operation_of", "result_fields"]

MIME_FIELDS = {
    "text/plain": "text",
    "text/html": "html",
    "text/markdown": "markdown",
    "image/svg+xml": "svg",
    "image/png": "png",
    "image/jpeg": "jpeg",
    "application/pdf": "pdf",
    "text/latex": "latex",
    "application/json": "json",
    "application/javascript": "javascript",
    "e2b/data": "data",
    "e2b/chart": "chart",
}
"""MIME type to the field of an ``Execution`` result, as the code interpreter server maps it."""

ROUTES: tuple[tuple[str, str, str], ...] = (
    # the REST control plane (both the v2 paths and the v1 ones older SDKs use)
    ("POST", "/v2/sandboxes", "create"),
    ("POST", "/sandboxes", "create"),
    ("GET", "/v2/sandboxes", "list"),
    ("GET", "/sandboxes", "list"),
    ("GET", "/sandboxes/{sid}", "get_info"),
    ("DELETE", "/sandboxes/{sid}", "delete"),
    ("POST", "/sandboxes/{sid}/timeout", "set_timeout"),
    ("POST", "/v2/sandboxes/{sid}/connect", "connect"),
    ("POST", "/sandboxes/{sid}/connect", "connect"),
    # envd
    ("GET", "/health", "health"),
    ("GET", "/envs", "envs"),
    ("GET", "/files", "download"),
    ("POST", "/files", "upload"),
    ("POST", "/filesystem.Filesystem/Stat", "stat"),
    ("POST", "/filesystem.Filesystem/ListDir", "list_files"),
    ("POST", "/filesystem.Filesystem/MakeDir", "make_dir"),
    ("POST", "/filesystem.Filesystem/Remove", "remove"),
    ("POST", "/filesystem.Filesystem/Move", "move"),
    # the code interpreter
    ("POST", "/execute", "run_code"),
    ("POST", "/contexts", "create_context"),
    ("GET", "/contexts", "list_contexts"),
    ("POST", "/contexts/{cid}/restart", "restart_context"),
    ("DELETE", "/contexts/{cid}", "delete_context"),
)
"""``(method, path, operation)`` of every call the emulator serves."""

_COMPILED = [(method, compile_path(path)[0], name) for method, path, name in ROUTES]


def operation_of(method: str, path: str) -> str | None:
    """Name the call a request belongs to (``"create"``, ``"download"``, ``"run_code"``...).

    Args:
        method: the HTTP method.
        path: the request path, without the query.

    Returns:
        The operation's name, or None for a path the emulator does not serve.
    """
    for route_method, pattern, name in _COMPILED:
        if method == route_method and re.fullmatch(pattern, path):
            return name
    return None


def _strip_quotes(text: str) -> str:
    # The server strips the quotes of a string's repr, so 'abc' reads as abc.
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text


def result_fields(data: dict[str, Any], *, is_main_result: bool) -> dict[str, Any]:
    """A ``display_data`` or ``execute_result`` MIME bundle as a ``result`` line's fields.

    Args:
        data: the MIME bundle.
        is_main_result: True for an ``execute_result``.

    Returns:
        The line, ``{"type": "result", "text": ..., "png": ..., "extra": {...}, ...}``; MIME
        types the server has no field for go to ``extra``.
    """
    line: dict[str, Any] = {"type": "result", "is_main_result": is_main_result, "extra": {}}
    for mime, value in data.items():
        field = MIME_FIELDS.get(mime)
        if field is None:
            line["extra"][mime] = value
        elif field == "text":
            line["text"] = _strip_quotes(str(value))
        else:
            line[field] = value
    return line
