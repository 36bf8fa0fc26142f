"""What only the Daytona backend has: its pure translation logic, the in-sandbox runner, the
blocks, and (against the emulator, with the real SDK) faults, keep-alive and figures.

Behaviour every backend shares is in tests/contract/.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import subprocess
import sys
import textwrap
from typing import Any

import pytest
from prefect.testing.standard_test_suites import BlockStandardTestSuite

from prefect_sandbox import DaytonaBackend, DaytonaCredentials
from prefect_sandbox.sandbox.daytona import (
    MarkerSplitter,
    _bootstrap_code,
    _cell_code,
    close_code_of,
    daemon_error_content,
    import_sdk,
    record_content,
    retry_delay_s,
    translate_error,
)
from prefect_sandbox.sandbox.errors import (
    FileTransferError,
    SandboxAuthError,
    SandboxError,
    SandboxNotFoundError,
    SandboxUnavailableError,
)

START, END = "\x1e\x1fprefect-sandbox:", "\x1e"


def _record(**fields: Any) -> str:
    return START + json.dumps(fields) + END


def test_marker_splitter_passes_text_and_holds_split_records() -> None:
    splitter = MarkerSplitter()
    record = _record(kind="start", count=1, pid=7)
    assert splitter.feed("plain\n") == ["plain\n"]
    # A record cut anywhere, even inside its start marker, comes out whole.
    assert splitter.feed("a" + record[:3]) == ["a"]
    assert splitter.feed(record[3:20]) == []
    assert splitter.feed(record[20:] + "b") == [{"kind": "start", "count": 1, "pid": 7}, "b"]
    # Not a record after all: a start marker with bad JSON is text.
    assert splitter.feed(START + "{oops" + END) == [START + "{oops" + END]
    assert splitter.feed("tail" + START[:4]) == ["tail"]
    assert splitter.finish() == [START[:4]]


def test_marker_splitter_releases_a_start_marker_that_never_ends() -> None:
    splitter = MarkerSplitter(max_record_chars=50)
    items = splitter.feed(START + "x" * 100)
    assert (
        "".join(i for i in items if isinstance(i, str))
        + "".join(i for i in splitter.finish() if isinstance(i, str))
        == START + "x" * 100
    )


def test_records_become_nbformat_message_contents() -> None:
    assert record_content({"kind": "display", "data": {"text/plain": "x"}, "metadata": {}}) == (
        "display_data",
        {"data": {"text/plain": "x"}, "metadata": {}},
    )
    assert record_content({"kind": "result", "count": 3, "data": {}, "metadata": {}}) == (
        "execute_result",
        {"data": {}, "metadata": {}, "execution_count": 3},
    )
    error = {"kind": "error", "ename": "E", "evalue": "v", "traceback": ["t"]}
    assert record_content(error) == ("error", {"ename": "E", "evalue": "v", "traceback": ["t"]})
    assert record_content({"kind": "start", "count": 1, "pid": 2}) is None
    assert daemon_error_content("E", "v", "line 1\nline 2\n") == (
        "error",
        {"ename": "E", "evalue": "v", "traceback": ["line 1", "line 2"]},
    )


def test_close_codes_are_read_from_sdk_errors() -> None:
    sdk = import_sdk()
    error = sdk.DaytonaConnectionError("Failed to run code: worker process ended (close code 1001)")
    assert close_code_of(error) == 1001
    assert close_code_of(sdk.DaytonaConnectionError("reset by peer")) is None


def _daytona_error(cls_name: str, status: int | None, headers: dict[str, str] | None = None) -> Any:
    sdk = import_sdk()
    return getattr(sdk, cls_name)("Failed: boom", status_code=status, headers=headers)


@pytest.mark.parametrize(
    ("error", "path", "expected", "status"),
    [
        (("DaytonaRateLimitError", 429), None, SandboxUnavailableError, 429),
        (("DaytonaInternalServerError", 500), None, SandboxUnavailableError, 500),
        (("DaytonaError", 502), "a.csv", SandboxUnavailableError, 502),
        (("DaytonaTimeoutError", 504), None, SandboxUnavailableError, 504),
        (("DaytonaConnectionError", None), None, SandboxUnavailableError, None),
        (("DaytonaNotFoundError", 404), None, SandboxNotFoundError, None),
        (("DaytonaNotFoundError", 404), "a.csv", FileTransferError, None),
        (("DaytonaAuthenticationError", 401), None, SandboxAuthError, None),
        (("DaytonaForbiddenError", 403), None, SandboxAuthError, None),
        (("DaytonaBadRequestError", 400), None, SandboxError, None),
    ],
)
def test_sdk_errors_map_to_our_tree(
    error: tuple[str, int | None],
    path: str | None,
    expected: type[SandboxError],
    status: int | None,
) -> None:
    translated = translate_error(
        _daytona_error(*error), operation="upload", sandbox_id="sb-1", path=path
    )
    assert type(translated) is expected
    assert translated.sandbox_id == "sb-1"
    assert "boom" in str(translated)
    if isinstance(translated, SandboxUnavailableError):
        assert (translated.status_code, translated.operation) == (status, "upload")


def test_statuses_on_causes_and_retry_after_are_found() -> None:
    from daytona_toolbox_api_client_async.exceptions import ApiException

    sdk = import_sdk()
    raw = ApiException(status=408, reason="Request Timeout")
    translated = translate_error(raw, operation="exec")
    assert isinstance(translated, SandboxUnavailableError) and translated.status_code == 408
    # The bulk-download path wraps aiohttp's response error in a status-less DaytonaError.
    wrapped = sdk.DaytonaError("Failed to download file: 503, message='Service Unavailable'")
    wrapped.__cause__ = _daytona_error("DaytonaError", 503)
    assert translate_error(wrapped, operation="download").status_code == 503  # type: ignore[attr-defined]
    limited = translate_error(
        _daytona_error("DaytonaRateLimitError", 429, {"Retry-After": "2"}), operation="create"
    )
    assert isinstance(limited, SandboxUnavailableError) and limited.retry_after_s == 2.0
    assert retry_delay_s(limited, 1) == 2.0
    plain = SandboxUnavailableError("x", status_code=503)
    assert [retry_delay_s(plain, n) for n in (1, 2, 3)] == [0.5, 1.0, 2.0]
    assert retry_delay_s(SandboxUnavailableError("x", retry_after_s=600), 1) == 30.0
    copy = pickle.loads(pickle.dumps(limited))
    assert (copy.status_code, copy.operation, copy.retry_after_s) == (429, "create", 2.0)


def test_missing_sdk_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "daytona", None)
    with pytest.raises(ImportError, match=r"pip install 'prefect-sandbox\[daytona\]'"):
        import_sdk()


def test_backend_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="snapshot or an image"):
        DaytonaBackend(snapshot="s", image="python:3.12")
    with pytest.raises(ValueError, match="only be set with an image"):
        DaytonaBackend(cpu=2)
    params = DaytonaBackend(image="python:3.12", cpu=2, auto_delete_interval_min=None)._config()
    created = params.create_params({"k": "v"})
    assert (created.resources.cpu, created.auto_delete_interval, created.labels) == (
        2,
        -1,
        {"k": "v"},
    )
    assert DaytonaBackend(auto_stop_interval_min=8)._config().refresh_period_s() == 120.0
    assert DaytonaBackend(auto_stop_interval_min=0)._config().refresh_period_s() is None


class TestDaytonaCredentialsBlock(BlockStandardTestSuite):
    @pytest.fixture
    def block(self) -> type[DaytonaCredentials]:
        return DaytonaCredentials

    def test_has_a_valid_image(self, block: type[DaytonaCredentials]) -> None:
        pytest.skip("needs the internet to fetch the logo")


class TestDaytonaBackendBlock(BlockStandardTestSuite):
    @pytest.fixture
    def block(self) -> type[DaytonaBackend]:
        return DaytonaBackend

    def test_has_a_valid_image(self, block: type[DaytonaBackend]) -> None:
        pytest.skip("needs the internet to fetch the logo")


# The runner as Daytona's own Python worker runs it: a plain interpreter, exec() into one
# globals dict, no IPython shell.
_WORKER = """
import json, sys
cells = json.loads(sys.stdin.read())
namespace = {"__name__": "__main__", "__builtins__": __builtins__}
for code in cells:
    exec(compile(code, "<string>", "exec"), namespace)
    sys.stdout.write("\\n<<cell>>\\n")
"""


def _run_in_plain_worker(cells: list[str]) -> list[list[str | dict[str, Any]]]:
    codes = [_bootstrap_code(), *(_cell_code(cell) for cell in cells)]
    done = subprocess.run(
        [sys.executable, "-c", _WORKER],
        input=json.dumps(codes),
        capture_output=True,
        text=True,
        timeout=60,
        env={name: value for name, value in os.environ.items() if name != "MPLBACKEND"},
    )
    assert done.returncode == 0, done.stderr
    results = []
    for chunk in done.stdout.split("\n<<cell>>\n")[:-1]:
        splitter = MarkerSplitter()
        results.append(splitter.feed(chunk) + splitter.finish())
    return results


def test_runner_gives_a_plain_worker_notebook_outputs() -> None:
    ready, *cells = _run_in_plain_worker(
        [
            "x = 6\nx * 7",
            "x * 7;",
            "from IPython.display import display, HTML\ndisplay(HTML('<b>hi</b>'))\nprint('after')",
            "input('name? ')",
            "def f(:\n  pass",
            "import matplotlib.pyplot as plt\nplt.plot([1, 2])\nprint('drawn')",
            "import matplotlib\nmatplotlib.use('Agg')\nplt.plot([1, 2])",
            "raise SystemExit(3)",
            "exit()",
        ]
    )
    assert ready[0]["kind"] == "ready"  # type: ignore[index]
    result, quiet, html, stdin, syntax, figure, agg, system_exit, exited = cells
    assert result[0] == {"kind": "start", "count": 1, "pid": ready[0]["pid"]}  # type: ignore[index]
    assert result[1] == {
        "kind": "result",
        "count": 1,
        "data": {"text/plain": "42"},
        "metadata": {},
    }
    assert quiet[1:] == []
    assert html[1]["data"]["text/html"] == "<b>hi</b>"  # type: ignore[index]
    assert html[2:] == ["after\n"]
    assert stdin[1]["ename"] == "StdinNotImplementedError"  # type: ignore[index]
    assert syntax[1]["ename"] == "SyntaxError"  # type: ignore[index]
    assert "line 1" in syntax[1]["evalue"]  # type: ignore[index]
    assert figure[1] == "drawn\n"
    png = base64.b64decode(figure[2]["data"]["image/png"])  # type: ignore[index]
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    assert figure[2]["data"]["text/plain"].startswith("<Figure size")  # type: ignore[index]
    assert [item for item in agg if isinstance(item, dict) and item["kind"] == "display"] == []
    assert system_exit[1]["ename"] == "SystemExit"  # type: ignore[index]
    assert exited[1] == {"kind": "exit", "code": 0}


def test_runner_traceback_shows_the_cell_not_the_runner() -> None:
    (_, cell) = _run_in_plain_worker(
        [
            textwrap.dedent("""
            def inner():
                raise ValueError('deep')
            inner()
            """)
        ]
    )
    error = cell[1]
    assert isinstance(error, dict) and error["ename"] == "ValueError"
    text = "\n".join(error["traceback"])
    assert "<prefect-sandbox>" not in text
    assert "raise ValueError('deep')" in text and text.endswith("ValueError: deep")
