"""The seam every backend implements, checked once over all of them: the factories' one
signature, the one error a missing extra raises, how every cell's result is built, and the one
retry policy."""

from __future__ import annotations

import inspect
import itertools
import pickle
import sys
import time
from datetime import UTC, datetime
from typing import Any

import pytest

from prefect_sandbox.blocks import E2BCredentials
from prefect_sandbox.sandbox.backends import daytona, e2b
from prefect_sandbox.sandbox.backends.daytona import DaytonaSandbox
from prefect_sandbox.sandbox.backends.e2b import E2BSandbox
from prefect_sandbox.sandbox.backends.kernel import docker
from prefect_sandbox.sandbox.backends.kernel.docker import DockerSandbox
from prefect_sandbox.sandbox.backends.kernel.local import LocalKernelSandbox
from prefect_sandbox.sandbox.base import (
    TIMEOUT_ENAME,
    CellError,
    CellReply,
    CellResult,
    Sandbox,
    cell_result,
)
from prefect_sandbox.sandbox.errors import (
    BackendNotInstalledError,
    SandboxError,
    SandboxUnavailableError,
)
from prefect_sandbox.sandbox.outputs import CellOutputs
from prefect_sandbox.sandbox.retries import (
    MAX_RETRY_DELAY_S,
    async_retrying,
    retry_delay_s,
    sync_retrying,
)

BACKENDS = [LocalKernelSandbox, E2BSandbox, DaytonaSandbox, DockerSandbox]


def _shape(function: object) -> list[tuple[str, inspect._ParameterKind]]:
    return [(p.name, p.kind) for p in inspect.signature(function).parameters.values()]  # type: ignore[arg-type]


@pytest.mark.parametrize("operation", ["create", "attach", "list_handles"])
@pytest.mark.parametrize("backend", BACKENDS, ids=lambda cls: cls.__name__)
def test_factories_have_the_abstract_classs_signature(
    backend: type[Sandbox], operation: str
) -> None:
    ours = getattr(backend, operation)
    assert _shape(ours) == _shape(getattr(Sandbox, operation))
    assert inspect.iscoroutinefunction(ours)


@pytest.mark.parametrize(
    ("module", "sdk", "extra"),
    [
        (e2b, "e2b_code_interpreter", "e2b"),
        (daytona, "daytona", "daytona"),
        (docker, "docker", "docker"),
    ],
)
def test_a_missing_extra_is_one_error_that_names_it(
    monkeypatch: pytest.MonkeyPatch, module: object, sdk: str, extra: str
) -> None:
    monkeypatch.setitem(sys.modules, sdk, None)
    with pytest.raises(BackendNotInstalledError) as info:
        module.import_sdk()  # type: ignore[attr-defined]
    assert isinstance(info.value, ImportError) and isinstance(info.value, SandboxError)
    assert info.value.extra == extra
    assert f"pip install 'prefect-sandbox[{extra}]'" in str(info.value)
    copy = pickle.loads(pickle.dumps(info.value))
    assert (type(copy), copy.extra, str(copy)) == (BackendNotInstalledError, extra, str(info.value))


def test_a_block_without_its_extra_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "e2b_code_interpreter", None)
    with pytest.raises(BackendNotInstalledError, match=r"prefect-sandbox\[e2b\]"):
        E2BCredentials(api_key="e2b_x").get_client()


def _result(
    outputs: CellOutputs,
    reply: CellReply,
    *,
    interrupts: int = 0,
    state_lost: bool = False,
) -> CellResult:
    return cell_result(
        outputs,
        reply,
        timeout_s=1.5,
        interrupts=interrupts,
        state_lost=state_lost,
        started_at=datetime.now(UTC),
        duration_s=0.1,
    )


def _with_error(ename: str = "ValueError") -> CellOutputs:
    outputs = CellOutputs(None, None)
    outputs.add("stream", {"name": "stdout", "text": "x\n"})
    outputs.add("error", {"ename": ename, "evalue": "bad", "traceback": ["t"]})
    return outputs


def test_a_timeout_says_how_it_was_stopped_and_keeps_the_kernels_own_error() -> None:
    interrupted = _result(_with_error("KeyboardInterrupt"), CellReply(), interrupts=2)
    assert (interrupted.status, interrupted.interrupted, interrupted.state_lost) == (
        "timeout",
        True,
        False,
    )
    assert interrupted.error is not None and interrupted.error.ename == TIMEOUT_ENAME
    assert (
        interrupted.error.evalue == "cell exceeded its 1.5 s timeout; interrupted on the second try"
    )
    assert [o["ename"] for o in interrupted.outputs if o["output_type"] == "error"] == [
        "KeyboardInterrupt"
    ]
    restarted = _result(
        _with_error("KeyboardInterrupt"), CellReply(), interrupts=1, state_lost=True
    )
    assert (restarted.status, restarted.interrupted, restarted.state_lost) == (
        "timeout",
        False,
        True,
    )
    assert restarted.outputs[-1]["ename"] == TIMEOUT_ENAME
    assert "restarted, state lost" in restarted.outputs[-1]["evalue"]
    # A backend that restarted the kernel on its own deadline: a timeout too, state lost.
    backstop = _result(CellOutputs(None, None), CellReply(state_lost=True))
    assert (backstop.status, backstop.state_lost) == ("timeout", True)


def test_the_reply_decides_whether_user_code_raised_when_it_says() -> None:
    # An error output with an ok execute_reply (showtraceback() in user code) is no failure.
    shown = _result(_with_error(), CellReply(raised=False, msg_id="m-1"))
    assert (shown.status, shown.error, shown.msg_id) == ("ok", None, "m-1")
    # Without a reply status, the error output decides; its error is the cell's.
    raised = _result(_with_error(), CellReply())
    assert raised.status == "error" and raised.error is not None
    assert (raised.error.ename, raised.error.traceback, raised.msg_id) == (
        "ValueError",
        ["t"],
        None,
    )
    # A failure reported only by the reply gets an error output, so the notebook shows it.
    reply_only = CellError(ename="KeyboardInterrupt", evalue="interrupted")
    stopped = _result(CellOutputs(None, None), CellReply(error=reply_only))
    assert stopped.status == "error" and stopped.error == reply_only
    assert stopped.outputs == [
        {
            "output_type": "error",
            "ename": "KeyboardInterrupt",
            "evalue": "interrupted",
            "traceback": [],
        }
    ]


def test_execute_results_get_the_replys_count_and_outputs_are_handed_over_once() -> None:
    seen: list[dict[str, Any]] = []
    outputs = CellOutputs(None, seen.append)
    outputs.add("stream", {"name": "stdout", "text": "a"}, hold=True)
    outputs.add("stream", {"name": "stdout", "text": "b"}, hold=True)
    assert seen == [] and outputs.held
    outputs.add("execute_result", {"data": {"text/plain": "1"}, "metadata": {}})
    assert seen == [
        {"output_type": "stream", "name": "stdout", "text": "ab"},
        {
            "output_type": "execute_result",
            "data": {"text/plain": "1"},
            "metadata": {},
            "execution_count": None,
        },
    ]
    result = _result(outputs, CellReply(execution_count=7))
    assert (result.status, result.execution_count, result.outputs[-1]["execution_count"]) == (
        "ok",
        7,
        7,
    )


def test_one_retry_policy_waits_as_asked_and_retries_only_what_it_is_told() -> None:
    calls: list[float] = []

    def flaky() -> str:
        calls.append(time.monotonic())
        if len(calls) < 3:
            raise SandboxUnavailableError("busy", status_code=429, retry_after_s=0.2)
        return "done"

    for attempt in sync_retrying(
        attempts=4, retry_if=lambda e: isinstance(e, SandboxUnavailableError), what="test call"
    ):
        with attempt:
            result = flaky()
    assert result == "done" and len(calls) == 3
    assert all(later - earlier >= 0.2 for earlier, later in itertools.pairwise(calls))
    # Without Retry-After: the first delay, doubling, capped; a huge Retry-After is capped too.
    plain = SandboxUnavailableError("busy", status_code=503)
    assert [retry_delay_s(plain, n, first_delay_s=0.1) for n in (1, 2, 3)] == [0.1, 0.2, 0.4]
    assert retry_delay_s(plain, 20) == MAX_RETRY_DELAY_S
    assert retry_delay_s(SandboxUnavailableError("x", retry_after_s=1e6), 1) == MAX_RETRY_DELAY_S


async def test_the_async_loop_gives_up_after_its_attempts_and_never_retries_the_rest() -> None:
    tries = 0

    async def always(error: Exception) -> None:
        nonlocal tries
        tries += 1
        raise error

    for error, expected in (
        (SandboxUnavailableError("down", status_code=502), 2),
        (KeyError("bug"), 1),
    ):
        tries = 0
        with pytest.raises(type(error)):
            async for attempt in async_retrying(
                attempts=2,
                retry_if=lambda e: isinstance(e, SandboxUnavailableError),
                first_delay_s=0.01,
                what="test call",
            ):
                with attempt:
                    await always(error)
        assert tries == expected
