"""E2B backend under injected faults: the real SDK against the emulator; each fault's error
type and fields, retries that honour Retry-After, and an execute that is never replayed."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from prefect_sandbox.blocks.e2b import E2BBackend, E2BCredentials
from prefect_sandbox.sandbox.backends.e2b import E2BConfig, E2BSandbox
from prefect_sandbox.sandbox.errors import (
    SandboxAuthError,
    SandboxNotFoundError,
    SandboxUnavailableError,
)
from prefect_sandbox.testing.e2b import E2BEmulator, Fault
from tests.conftest import stream_text


def _credentials(emulator: E2BEmulator, **options: float) -> E2BCredentials:
    return E2BCredentials(
        api_key=emulator.api_key, api_url=emulator.url, sandbox_url=emulator.url, **options
    )


@pytest.fixture
def labels() -> dict[str, str]:
    """Labels unique to one test, to find its sandboxes in the emulator."""
    return {"prefect-sandbox": "true", "test-id": uuid.uuid4().hex}


@pytest.fixture
def e2b_backend(e2b_emulator: E2BEmulator) -> E2BBackend:
    return E2BBackend(credentials=_credentials(e2b_emulator), lifetime_s=60, interrupt_grace_s=2.0)


@pytest.fixture
async def box(
    e2b_emulator: E2BEmulator, e2b_backend: E2BBackend, labels: dict[str, str]
) -> AsyncIterator[E2BSandbox]:
    sandbox = await e2b_backend.create(labels)
    try:
        yield sandbox
    finally:
        e2b_emulator.clear_faults()
        await sandbox.kill()


def _requests(emulator: E2BEmulator, operation: str, since: float) -> list[float]:
    return [r.at for r in emulator.requests if r.operation == operation and r.at >= since]


async def test_create_retries_429_honouring_retry_after(
    e2b_emulator: E2BEmulator, e2b_backend: E2BBackend, labels: dict[str, str]
) -> None:
    start = time.monotonic()
    e2b_emulator.inject(Fault("create", status=429, retry_after_s=1, times=2))
    sandbox = await e2b_backend.create(labels)
    try:
        tries = _requests(e2b_emulator, "create", start)
        assert len(tries) == 3
        assert all(later - earlier >= 1.0 for earlier, later in itertools.pairwise(tries))
        assert e2b_emulator.live_sandboxes(labels) == [sandbox.handle.sandbox_id]
    finally:
        await sandbox.kill()


async def test_create_answered_504_after_making_the_sandbox_makes_only_one(
    e2b_emulator: E2BEmulator, e2b_backend: E2BBackend, labels: dict[str, str]
) -> None:
    e2b_emulator.inject(Fault("create", status=504, serve_first=True))
    sandbox = await e2b_backend.create(labels)
    try:
        assert e2b_emulator.live_sandboxes(labels) == [sandbox.handle.sandbox_id]
        assert (await sandbox.run_cell("print('one')")).status == "ok"
    finally:
        await sandbox.kill()
    assert e2b_emulator.live_sandboxes(labels) == []


async def test_create_that_stays_unavailable_says_so_with_status_and_operation(
    e2b_emulator: E2BEmulator, e2b_backend: E2BBackend, labels: dict[str, str]
) -> None:
    e2b_emulator.inject(Fault("create", status=503, times=None))
    try:
        with pytest.raises(SandboxUnavailableError) as info:
            await e2b_backend.create(labels)
    finally:
        e2b_emulator.clear_faults()
    assert (info.value.operation, info.value.status_code) == ("create", 503)
    assert e2b_emulator.live_sandboxes(labels) == []


async def test_file_calls_retry_transient_errors(
    e2b_emulator: E2BEmulator, box: E2BSandbox, tmp_path: Path
) -> None:
    source = tmp_path / "data.csv"
    source.write_text("a,b\n1,2\n")
    e2b_emulator.inject(Fault("files.write", status=502), Fault("files.read", status=500))
    await box.upload(source, "data.csv")
    assert await box.download("data.csv", tmp_path / "back.csv") == source.stat().st_size
    assert (tmp_path / "back.csv").read_bytes() == source.read_bytes()


async def test_file_call_that_stays_rate_limited_gives_up_with_429(
    e2b_emulator: E2BEmulator, box: E2BSandbox, tmp_path: Path
) -> None:
    await box.run_cell("open('out.txt', 'w').write('x')")
    fast = E2BSandbox(box._sdk, E2BConfig(file_retries=2, retry_backoff_s=0.05), box.handle)
    start = time.monotonic()
    e2b_emulator.inject(Fault("files.read", status=429, retry_after_s=1, times=None))
    with pytest.raises(SandboxUnavailableError) as info:
        await fast.download("out.txt", tmp_path / "out.txt")
    assert (info.value.operation, info.value.status_code) == ("download", 429)
    assert info.value.sandbox_id == box.handle.sandbox_id
    assert len(_requests(e2b_emulator, "files.read", start)) == 3


async def test_slow_file_listing_times_out_as_unavailable(
    e2b_emulator: E2BEmulator, box: E2BSandbox
) -> None:
    credentials = _credentials(e2b_emulator, request_timeout_s=0.5)
    config = E2BConfig(client_factory=credentials.get_client, file_retries=1, retry_backoff_s=0.05)
    impatient = await E2BSandbox.attach(box.handle, config)
    e2b_emulator.inject(Fault("files.list", delay_s=2.0, times=2))
    start = time.monotonic()
    with pytest.raises(SandboxUnavailableError) as info:
        await impatient.list_files()
    assert time.monotonic() - start < 4.0
    assert info.value.operation == "list_files"


async def test_dropped_connection_mid_execute_is_never_replayed(
    e2b_emulator: E2BEmulator, box: E2BSandbox
) -> None:
    await box.run_cell("acc = []")
    e2b_emulator.inject(Fault("execute", drop_after_lines=0))
    with pytest.raises(SandboxUnavailableError) as info:
        await box.run_cell("acc.append(1); print(len(acc))")
    assert info.value.operation == "run_cell"
    assert info.value.sandbox_id == box.handle.sandbox_id
    after = await box.run_cell("print(len(acc))")
    assert stream_text(after.outputs) == "1\n"


async def test_execute_answered_500_is_unavailable_and_not_retried(
    e2b_emulator: E2BEmulator, box: E2BSandbox
) -> None:
    start = time.monotonic()
    e2b_emulator.inject(Fault("execute", status=500))
    with pytest.raises(SandboxUnavailableError) as info:
        await box.run_cell("print('never')")
    assert (info.value.operation, info.value.status_code) == ("run_cell", 500)
    assert len(_requests(e2b_emulator, "execute", start)) == 1


async def test_expired_sandbox_is_not_found_naming_it(
    e2b_emulator: E2BEmulator, e2b_backend: E2BBackend, box: E2BSandbox
) -> None:
    sandbox_id = box.handle.sandbox_id
    e2b_emulator.expire(sandbox_id)
    with pytest.raises(SandboxNotFoundError, match=sandbox_id) as info:
        await box.run_cell("print('late')")
    assert info.value.sandbox_id == sandbox_id
    with pytest.raises(SandboxNotFoundError, match=sandbox_id):
        await e2b_backend.attach(box.handle)
    assert await box.kill() is False


async def test_sandbox_expiring_mid_cell_is_not_found_in_that_cell(
    e2b_emulator: E2BEmulator, box: E2BSandbox
) -> None:
    sandbox_id = box.handle.sandbox_id
    timer = threading.Timer(1.0, e2b_emulator.expire, args=(sandbox_id,))
    timer.start()
    try:
        with pytest.raises(SandboxNotFoundError, match="while running a cell") as info:
            await box.run_cell("import time; time.sleep(30)", timeout_s=20)
    finally:
        timer.join()
    assert info.value.sandbox_id == sandbox_id


async def test_wrong_api_key_is_an_auth_error_that_hides_the_key(
    e2b_emulator: E2BEmulator, labels: dict[str, str]
) -> None:
    wrong = "e2b_wrong_" + uuid.uuid4().hex
    credentials = E2BCredentials(
        api_key=wrong, api_url=e2b_emulator.url, sandbox_url=e2b_emulator.url
    )
    with pytest.raises(SandboxAuthError) as info:
        await E2BBackend(credentials=credentials).create(labels)
    assert wrong not in str(info.value) and wrong not in repr(info.value)
    assert e2b_emulator.api_key not in str(info.value)


async def test_lifetime_is_extended_before_and_during_cells(
    e2b_emulator: E2BEmulator, labels: dict[str, str]
) -> None:
    backend = E2BBackend(credentials=_credentials(e2b_emulator), lifetime_s=2)
    sandbox = await backend.create(labels)
    try:
        # Cells and pauses that add up to well over the 2 s lifetime.
        for _ in range(3):
            result = await sandbox.run_cell("import time; time.sleep(1.5); print('ok')")
            assert stream_text(result.outputs) == "ok\n"
            await asyncio.sleep(0.5)
        assert e2b_emulator.live_sandboxes(labels) == [sandbox.handle.sandbox_id]
        # Left alone, it expires on its own: the last net if the flow dies.
        deadline = time.monotonic() + 10
        while e2b_emulator.live_sandboxes(labels) and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert e2b_emulator.live_sandboxes(labels) == []
    finally:
        await sandbox.kill()
