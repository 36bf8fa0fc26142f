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
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from prefect_sandbox import DaytonaBackend, DaytonaCredentials
from prefect_sandbox.sandbox.backends.daytona import (
    DaytonaSandboxConfig,
    MarkerSplitter,
    _bootstrap_code,
    _call,
    _cell_code,
    close_of,
    import_sdk,
    record_content,
    translate_error,
)
from prefect_sandbox.sandbox.backends.kernel.local import LocalKernelConfig, LocalKernelSandbox
from prefect_sandbox.sandbox.base import Sandbox
from prefect_sandbox.sandbox.errors import (
    FileTransferError,
    SandboxAuthError,
    SandboxDiedError,
    SandboxError,
    SandboxNotFoundError,
    SandboxUnavailableError,
)
from prefect_sandbox.sandbox.kernel_side.daytona_runner import transform_magics
from prefect_sandbox.sandbox.outputs import error_content
from prefect_sandbox.sandbox.retries import retry_delay_s
from prefect_sandbox.testing.daytona import DaytonaEmulator, Fault
from tests.conftest import stream_text
from tests.contract.test_forks import forked_child

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
    assert error_content("E", "v", "line 1\nline 2\n") == {
        "ename": "E",
        "evalue": "v",
        "traceback": ["line 1", "line 2"],
    }


def test_close_codes_and_reasons_are_read_from_sdk_errors() -> None:
    sdk = import_sdk()
    error = sdk.DaytonaConnectionError("Failed to run code: worker process ended (close code 1001)")
    assert close_of(error) == (1001, "worker process ended")
    error = sdk.DaytonaConnectionError("Failed to run code: context not found: c (close code 1008)")
    assert close_of(error) == (1008, "context not found: c")
    assert close_of(sdk.DaytonaConnectionError("reset by peer")) is None


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


async def test_bugs_are_let_through_the_error_mapper_unchanged() -> None:
    # Only the SDK's and its transport's exceptions become ours; a bug stays a bug.
    assert translate_error(KeyError("boom"), operation="upload", path="a.csv") is None
    assert translate_error(TypeError("boom"), operation="create") is None
    calls = 0

    async def buggy() -> None:
        nonlocal calls
        calls += 1
        raise KeyError("boom")

    with pytest.raises(KeyError):
        await _call("get", "sb-1", DaytonaSandboxConfig(request_retries=2), buggy, True)
    assert calls == 1


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


def test_the_maximum_lifetime_is_seconds_rounded_up_to_daytonas_minutes() -> None:
    assert DaytonaBackend(max_lifetime_s=61)._config().create_params({}).ttl_minutes == 2
    assert DaytonaBackend(max_lifetime_s=3600)._config().create_params({}).ttl_minutes == 60
    assert DaytonaBackend()._config().create_params({}).ttl_minutes is None


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
        timeout=300,
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
            # A record written in several pieces, as the daemon reads lines of at most 1 MiB.
            "display(HTML('<p>' + 'x' * 1_500_000 + '</p>'))",
            "exit()",
        ]
    )
    assert ready[0]["kind"] == "ready"  # type: ignore[index]
    result, quiet, html, stdin, syntax, figure, agg, system_exit, large, exited = cells
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
    assert len(large[1]["data"]["text/html"]) == 1_500_007  # type: ignore[index]
    assert exited[1] == {"kind": "exit", "code": 0}


def test_magics_become_shell_calls_without_ipython() -> None:
    assert transform_magics("x = 1\nx") == "x = 1\nx"
    assert transform_magics("%matplotlib inline\nif True:\n    !ls -l\n") == (
        "get_ipython().run_line_magic('matplotlib', 'inline')\n"
        "if True:\n"
        "    get_ipython().system('ls -l')\n"
    )
    assert transform_magics("%%writefile -a out.txt\nline 1\nline 2") == (
        "get_ipython().run_cell_magic('writefile', '-a out.txt', 'line 1\\nline 2\\n')\n"
    )
    # Not whole-line magics: left for Python to refuse.
    assert transform_magics("x = !ls") == "x = !ls\n"


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


# -- against the emulator, with the real SDK -------------------------------------------------

LABELS = {"prefect-sandbox": "true", "suite": "daytona"}


@pytest.fixture
def emulator(daytona_env: DaytonaEmulator) -> Iterator[DaytonaEmulator]:
    """The session's emulator; faults a test left unused are dropped afterwards."""
    yield daytona_env
    daytona_env.clear_faults()


@pytest.fixture
def backend(emulator: DaytonaEmulator) -> DaytonaBackend:
    return DaytonaBackend(interrupt_grace_s=2.0)


@pytest.fixture
async def box(backend: DaytonaBackend) -> AsyncIterator[Sandbox]:
    sandbox = await backend.create(LABELS)
    try:
        yield sandbox
    finally:
        await sandbox.kill()


async def test_a_4008_before_any_deadline_is_an_interrupt_from_outside_not_a_timeout(
    emulator: DaytonaEmulator, box: Sandbox
) -> None:
    # Daytona closes with 4008 whenever its interpreter says "interrupted" (the SDK raises
    # "Execution timed out"): here as the execution starts, the code never run.
    await box.run_cell("x = 1")
    emulator.inject(Fault("run_code", close_code=4008))
    result = await box.run_cell("x = 2", timeout_s=600)
    assert (result.status, result.state_lost, result.interrupted) == ("error", False, False)
    assert result.error is not None and result.error.ename == "KeyboardInterrupt"
    assert "interrupted from outside the run" in result.error.evalue
    assert "close code 4008" in result.error.evalue and "600" in result.error.evalue
    assert "timed out" not in result.error.evalue
    after = await box.run_cell("print(x)")  # the interpreter lives on, state kept
    assert stream_text(after.outputs) == "1\n"


async def test_a_slow_api_is_waited_for(
    emulator: DaytonaEmulator, backend: DaytonaBackend, box: Sandbox
) -> None:
    emulator.inject(Fault("get", delay_s=1.0))
    start = time.monotonic()
    again = await backend.attach(box.handle)
    try:
        assert time.monotonic() - start >= 1.0
        assert stream_text((await again.run_cell("print(6 * 7)")).outputs) == "42\n"
    finally:
        await again.close()


FAST_MINUTE_S = 3.0
"""A lifecycle minute of `fast_clock`: long enough for a sandbox's creation on a busy machine
(at 0.5 s, auto-stop ended one being created at load 11), short enough for a test."""

SILENT_CELL = f"import time; time.sleep({2.5 * FAST_MINUTE_S})"
"""A cell that prints nothing for well over auto-stop's one (fast) minute."""


@pytest.fixture(scope="module")
def fast_clock() -> Iterator[DaytonaEmulator]:
    """An emulator whose lifecycle minutes last `FAST_MINUTE_S`, so auto-stop acts within a
    test."""
    with DaytonaEmulator(minute_s=FAST_MINUTE_S) as emulator:
        yield emulator


def _fast_backend(emulator: DaytonaEmulator, refresh_s: float) -> DaytonaBackend:
    credentials = DaytonaCredentials(
        api_key=emulator.api_key, api_url=emulator.api_url, target=emulator.target
    )
    return DaytonaBackend(
        credentials=credentials,
        auto_stop_interval_min=1,
        auto_delete_interval_min=None,
        activity_refresh_s=refresh_s,
    )


async def test_auto_stop_never_stops_a_running_cell(fast_clock: DaytonaEmulator) -> None:
    box = await _fast_backend(fast_clock, refresh_s=0.1).create(LABELS)
    try:
        result = await box.run_cell(f"{SILENT_CELL}; print('awake')")
        assert stream_text(result.outputs) == "awake\n"
        assert fast_clock.sandbox_state(box.handle.sandbox_id) == "started"
    finally:
        await box.kill()


async def test_without_keep_alive_auto_stop_ends_the_interpreter(
    fast_clock: DaytonaEmulator,
) -> None:
    # The control for the test above: the emulator does stop a busy, silent sandbox.
    box = await _fast_backend(fast_clock, refresh_s=60).create(LABELS)
    try:
        with pytest.raises(SandboxDiedError, match="stopped"):
            await box.run_cell(SILENT_CELL)
        assert fast_clock.sandbox_state(box.handle.sandbox_id) in ("stopping", "stopped")
    finally:
        await box.kill()


_FIGURE_CELLS = [
    # H10: a figure left open, no plt.show(), with a last-expression value.
    "import matplotlib.pyplot as plt; fig, ax = plt.subplots(); "
    "ax.plot([1, 2, 3], [3, 1, 2]); ax.set_title('no-show')",
    "print('x')",
    "print('before'); plt.plot([1, 2]); plt.show(); print('after')",
    "plt.figure(); plt.bar([1, 2], [3, 4]); plt.figure(figsize=(3, 2)); plt.plot([0, 1]);",
]


@pytest.fixture
async def local_box() -> AsyncIterator[LocalKernelSandbox]:
    """A local kernel to compare the emulated Daytona sandbox against."""
    box = await LocalKernelSandbox.create(LocalKernelConfig())
    try:
        yield box
    finally:
        await box.kill()


# Where IPython formats values: a wide frame wraps (not cut with ...), a figure with no axes
# shows as text, a figure that is the value has its PNG, SymPy's init_printing takes effect.
_FORMATTED_CELLS = [
    "import pandas as pd\npd.DataFrame({f'column_{i}': range(3) for i in range(30)})",
    "import matplotlib.pyplot as plt\nplt.figure()",
    "fig, ax = plt.subplots()\nax.plot([1, 2])\nfig",
    "import sympy\nsympy.init_printing()\nx = sympy.Symbol('x')\nx**2 / 3",
]


@pytest.mark.parametrize("cells", [_FIGURE_CELLS, _FORMATTED_CELLS], ids=["h10", "formatted"])
async def test_h10_figures_and_values_are_the_same_as_on_the_local_kernel(
    local_box: LocalKernelSandbox, box: Sandbox, cells: list[str]
) -> None:
    for code in cells:
        local = await local_box.run_cell(code)
        remote = await box.run_cell(code)
        assert remote.status == local.status == "ok"
        assert [o["output_type"] for o in remote.outputs] == [
            o["output_type"] for o in local.outputs
        ]
        for ours, theirs in zip(remote.outputs, local.outputs, strict=True):
            if "image/png" in ours.get("data", {}):
                assert base64.b64decode(ours["data"]["image/png"])[:8] == b"\x89PNG\r\n\x1a\n"
            # Same matplotlib, same settings: the very same PNG bytes.
            assert {k: v for k, v in ours.items() if k != "execution_count"} == {
                k: v for k, v in theirs.items() if k != "execution_count"
            }


async def test_a_forked_child_stopped_at_its_cells_end_ends_with_the_interpreter(
    box: Sandbox,
) -> None:
    child = await forked_child(box)
    await box.kill()
    # Killed with the interpreter, not left stopped and reparented for good.
    child.wait(timeout=30)
    assert not child.is_running()


_SIGINT_AFTER_A_CELL = """
import asyncio, os, signal
from prefect_sandbox import DaytonaBackend

received = []
signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))

async def main():
    box = await DaytonaBackend().create({"prefect-sandbox": "true", "suite": "daytona"})
    try:
        await box.run_cell("x = 1")
        os.kill(os.getpid(), signal.SIGINT)
        await asyncio.sleep(0.5)
        print("after", (await box.run_cell("print(x)")).outputs[0]["text"].strip(), received)
    finally:
        await box.kill()

asyncio.run(main())
"""


def test_the_sdks_event_stream_leaves_sigint_to_the_process(daytona_env: DaytonaEmulator) -> None:
    # The SDK's client starts its socket.io connection as it is made; engineio would then put a
    # handler on the loop that cancels every task and stops the loop on Ctrl-C, ahead of the
    # process's own (a run's orderly stop, the CLI's).
    done = subprocess.run(
        [sys.executable, "-c", _SIGINT_AFTER_A_CELL],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "after 1 [2]"
