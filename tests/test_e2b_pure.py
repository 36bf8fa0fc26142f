"""Pure pieces of the E2B backend and its emulator, on plain values and the SDK's own types."""

from __future__ import annotations

import json

import httpx
import pytest
from e2b import exceptions as e2b_errors
from e2b_code_interpreter.models import Result

from prefect_sandbox.sandbox.backends.e2b import (
    E2BConfig,
    mime_bundle,
    translate_error,
)
from prefect_sandbox.sandbox.errors import (
    FileTransferError,
    SandboxAuthError,
    SandboxError,
    SandboxNotFoundError,
    SandboxUnavailableError,
)
from prefect_sandbox.sandbox.outputs import error_content
from prefect_sandbox.sandbox.paths import glob_match
from prefect_sandbox.testing.e2b.wire import operation_of, result_fields


def test_mime_bundle_maps_every_field_and_keeps_extra() -> None:
    result = Result(
        text="42",
        html="<b>42</b>",
        png="iVBORw0KGgo=",
        svg="<svg/>",
        json={"a": 1},
        markdown="**x**",
        latex="$x$",
        is_main_result=True,
        extra={"application/vnd.custom+json": {"k": 1}},
    )
    assert mime_bundle(result) == {
        "text/plain": "42",
        "text/html": "<b>42</b>",
        "image/png": "iVBORw0KGgo=",
        "image/svg+xml": "<svg/>",
        "application/json": {"a": 1},
        "text/markdown": "**x**",
        "text/latex": "$x$",
        "application/vnd.custom+json": {"k": 1},
    }


def test_error_content_splits_the_joined_traceback() -> None:
    assert error_content("ValueError", "bad", "line 1\nline 2") == {
        "ename": "ValueError",
        "evalue": "bad",
        "traceback": ["line 1", "line 2"],
    }
    assert error_content("E", "v", "")["traceback"] == []


@pytest.mark.parametrize(
    ("pattern", "path", "matches"),
    [
        ("**/*", "a.csv", True),
        ("**/*", "figures/a.png", True),
        ("figures/*.png", "figures/a.png", True),
        ("figures/*.png", "figures/sub/a.png", False),
        ("*.csv", "data/a.csv", False),
        ("**/*.png", "a/b/c.png", True),
        ("inputs/*", "inputs/données_年.csv", True),
        ("metrics.json", "metrics.json", True),
    ],
)
def test_glob_match_follows_pathlib(pattern: str, path: str, matches: bool) -> None:
    assert glob_match(pattern, path) is matches


def test_config_refuses_bad_values() -> None:
    with pytest.raises(ValueError, match="lifetime_s"):
        E2BConfig(lifetime_s=0)
    with pytest.raises(ValueError, match="workdir"):
        E2BConfig(workdir="relative")


def _unreachable_after(cause: Exception) -> Exception:
    """The SDK's unreachable error for a failed connection, which has it as its cause."""
    error = e2b_errors.SandboxUnreachableException(f"{cause}: could not be reached")
    error.__cause__ = cause
    return error


@pytest.mark.parametrize(
    ("exc", "kind", "status"),
    [
        (e2b_errors.AuthenticationException("401: Unauthorized"), SandboxAuthError, None),
        (e2b_errors.SandboxNotFoundException("gone"), SandboxNotFoundError, None),
        (
            e2b_errors.TimeoutException("The sandbox was not found: likely"),
            SandboxNotFoundError,
            None,
        ),
        (e2b_errors.RateLimitException("429: slow down"), SandboxUnavailableError, 429),
        (e2b_errors.SandboxException("503: busy", status_code=503), SandboxUnavailableError, 503),
        (e2b_errors.SandboxException("500 Internal Server Error: x"), SandboxUnavailableError, 500),
        (e2b_errors.TimeoutException("Request timed out"), SandboxUnavailableError, None),
        (httpx.ConnectError("refused"), SandboxUnavailableError, None),
        (httpx.RemoteProtocolError("peer closed"), SandboxUnavailableError, None),
        (json.JSONDecodeError("blank", "", 0), SandboxUnavailableError, None),
        (e2b_errors.SandboxException("400: bad template", status_code=400), SandboxError, None),
        # envd's answers lose their status in the SDK: it is implied by the exception's type.
        (e2b_errors.RateLimitException("slow down"), SandboxUnavailableError, 429),
        (e2b_errors.ServiceBusyException("busy"), SandboxUnavailableError, 503),
        (
            e2b_errors.SandboxUnreachableException("bad gateway: could not be reached"),
            SandboxUnavailableError,
            502,
        ),
        (_unreachable_after(httpx.ConnectError("refused")), SandboxUnavailableError, None),
    ],
)
def test_translate_error_maps_sdk_and_transport_errors(
    exc: Exception, kind: type[SandboxError], status: int | None
) -> None:
    error = translate_error(exc, operation="create", sandbox_id="sbx1")
    assert type(error) is kind
    assert "sbx1" in str(error)
    if isinstance(error, SandboxUnavailableError):
        assert (error.operation, error.status_code) == ("create", status)


def test_translate_error_names_missing_files_and_lets_bugs_through() -> None:
    error = translate_error(
        e2b_errors.FileNotFoundException("nope"), operation="download", path="a.csv"
    )
    assert isinstance(error, FileTransferError) and error.path == "a.csv"
    assert translate_error(KeyError("bug"), operation="create") is None


def test_operation_of_names_each_route() -> None:
    assert operation_of("POST", "/v2/sandboxes") == "create"
    assert operation_of("POST", "/sandboxes") == "create"
    assert operation_of("POST", "/v2/sandboxes/abc/connect") == "connect"
    assert operation_of("POST", "/sandboxes/abc/timeout") == "set_timeout"
    assert operation_of("DELETE", "/sandboxes/abc") == "delete"
    assert operation_of("POST", "/filesystem.Filesystem/ListDir") == "list_files"
    assert operation_of("POST", "/contexts/c1/restart") == "restart_context"
    assert operation_of("GET", "/nowhere") is None


def test_result_lines_follow_the_real_server() -> None:
    assert result_fields(
        {"text/plain": "'abc'", "image/png": "x", "x/y": 1}, is_main_result=True
    ) == {
        "type": "result",
        "is_main_result": True,
        "text": "abc",
        "png": "x",
        "extra": {"x/y": 1},
    }
