"""Pure pieces of the E2B emulator: which call a request is, and nbformat outputs as the code
interpreter's NDJSON lines. No I/O."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any

__all__ = ["MIME_FIELDS", "execute_lines", "operation_of", "result_fields"]

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

_SANDBOX = r"/sandboxes/[^/]+"
_ROUTES: list[tuple[str, str, str]] = [
    ("POST", r"(/v2)?/sandboxes", "create"),
    ("GET", r"(/v2)?/sandboxes", "list"),
    ("GET", _SANDBOX, "get_info"),
    ("DELETE", _SANDBOX, "kill"),
    ("POST", _SANDBOX + r"/timeout", "set_timeout"),
    ("POST", r"(/v2)?" + _SANDBOX + r"/connect", "connect"),
    ("GET", r"/health", "health"),
    ("GET", r"/files", "files.read"),
    ("POST", r"/files", "files.write"),
    ("POST", r"/filesystem\.Filesystem/Stat", "files.stat"),
    ("POST", r"/filesystem\.Filesystem/ListDir", "files.list"),
    ("POST", r"/filesystem\.Filesystem/MakeDir", "files.make_dir"),
    ("POST", r"/filesystem\.Filesystem/Remove", "files.remove"),
    ("POST", r"/filesystem\.Filesystem/Move", "files.move"),
    ("POST", r"/execute", "execute"),
    ("POST", r"/contexts", "contexts.create"),
    ("GET", r"/contexts", "contexts.list"),
    ("POST", r"/contexts/[^/]+/restart", "contexts.restart"),
    ("DELETE", r"/contexts/[^/]+", "contexts.remove"),
]


def operation_of(method: str, path: str) -> str | None:
    """Name the SDK call a request belongs to (``"create"``, ``"files.read"``, ``"execute"``...).

    Args:
        method: the HTTP method.
        path: the request path, without the query.

    Returns:
        The operation's name, or None for a path the emulator does not serve.
    """
    for route_method, pattern, name in _ROUTES:
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


def execute_lines(output: dict[str, Any], now: datetime | None = None) -> list[dict[str, Any]]:
    """One nbformat output as the ``/execute`` NDJSON lines the real server sends for it.

    Args:
        output: an nbformat v4 output dict.
        now: the timestamp for stream lines; the current time when None.

    Returns:
        The lines, as dicts to encode one per line.
    """
    kind = output["output_type"]
    if kind == "stream":
        timestamp = (now or datetime.now(UTC)).isoformat()
        return [{"type": output["name"], "text": output["text"], "timestamp": timestamp}]
    if kind in ("display_data", "execute_result"):
        return [result_fields(output.get("data", {}), is_main_result=kind == "execute_result")]
    if kind == "error":
        return [
            {
                "type": "error",
                "name": output["ename"],
                "value": output["evalue"],
                "traceback": "\n".join(output["traceback"]),
            }
        ]
    return []
