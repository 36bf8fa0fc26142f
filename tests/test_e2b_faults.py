"""What only the E2B backend meets under faults: the real SDK against the emulator (a file
call that stays rate-limited, a slow listing, expiry mid-cell, the renewed lifetime).

Faults both vendors share are in tests/test_emulator_faults.py."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from prefect_sandbox.blocks.e2b import E2BBackend, E2BCredentials
from prefect_sandbox.sandbox.backends.e2b import E2BConfig, E2BSandbox
from prefect_sandbox.sandbox.errors import (
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


async def test_a_create_whose_answer_is_lost_is_sent_again_and_gives_the_sandbox_it_made(
    e2b_emulator: E2BEmulator, e2b_backend: E2BBackend, labels: dict[str, str]
) -> None:
    # The SDK retries neither a lost answer nor a pooled connection reset under the request
    # (seen: "Connection reset by peer" on a create beside a busy suite).
    start = time.monotonic()
    e2b_emulator.inject(Fault("create", drop=True))
    sandbox = await e2b_backend.create(labels)
    try:
        assert e2b_emulator.sandbox_ids(labels) == [sandbox.handle.sandbox_id]
        tries = [r for r in e2b_emulator.requests if r.operation == "create" and r.at >= start]
        assert len(tries) == 2
        assert len({r.headers["idempotency-key"] for r in tries}) == 1
        assert (await sandbox.run_cell("print('one')")).status == "ok"
    finally:
        await sandbox.kill()


async def test_file_call_that_stays_rate_limited_gives_up_with_429(
    e2b_emulator: E2BEmulator, box: E2BSandbox, tmp_path: Path
) -> None:
    await box.run_cell("open('out.txt', 'w').write('x')")
    fast = E2BSandbox(box._sdk, E2BConfig(request_retries=2, retry_backoff_s=0.05), box.handle)
    start = time.monotonic()
    e2b_emulator.inject(Fault("download", status=429, retry_after_s=1, times=None))
    with pytest.raises(SandboxUnavailableError) as info:
        await fast.download("out.txt", tmp_path / "out.txt")
    assert (info.value.operation, info.value.status_code) == ("download", 429)
    assert info.value.sandbox_id == box.handle.sandbox_id
    assert len(_requests(e2b_emulator, "download", start)) == 3


async def test_slow_file_listing_times_out_as_unavailable(
    e2b_emulator: E2BEmulator, box: E2BSandbox
) -> None:
    credentials = _credentials(e2b_emulator, request_timeout_s=0.5)
    config = E2BConfig(
        client_factory=credentials.get_client, request_retries=1, retry_backoff_s=0.05
    )
    impatient = await E2BSandbox.attach(box.handle, config)
    e2b_emulator.inject(Fault("list_files", delay_s=2.0, times=2))
    start = time.monotonic()
    with pytest.raises(SandboxUnavailableError) as info:
        await impatient.list_files()
    assert time.monotonic() - start < 4.0
    assert info.value.operation == "list_files"


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
        assert e2b_emulator.sandbox_ids(labels) == [sandbox.handle.sandbox_id]
        # Left alone, it expires on its own: the last net if the flow dies.
        deadline = time.monotonic() + 60
        while e2b_emulator.sandbox_ids(labels) and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert e2b_emulator.sandbox_ids(labels) == []
    finally:
        await sandbox.kill()


async def test_a_500_on_connect_is_retried_so_a_kill_still_reaches_the_sandbox(
    e2b_emulator: E2BEmulator, e2b_backend: E2BBackend, labels: dict[str, str]
) -> None:
    sandbox = await e2b_backend.create(labels)
    start = time.monotonic()
    e2b_emulator.inject(Fault("connect", status=500, times=2))
    try:
        # A kill task attaches first (`kill_sandbox`).
        again = await e2b_backend.attach(sandbox.handle)
        assert await again.kill()
    finally:
        e2b_emulator.clear_faults()
        await sandbox.kill()
    assert len(_requests(e2b_emulator, "connect", start)) == 3
    assert e2b_emulator.sandbox_ids(labels) == []


async def test_a_context_whose_sandbox_is_killed_as_its_kernel_starts_ends_with_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The emulator's side of a kill that lands while a code context starts, once its kernel
    answers (the kill comes as the context's first ``cd`` ends): the context is not kept in the
    dead sandbox, and its kernel and connection end. A quiet suite run met such a connection's
    zmq sockets freed unclosed (a ResourceWarning) in a later test."""
    import psutil

    from prefect_sandbox.sandbox.errors import SandboxDiedError
    from prefect_sandbox.testing.e2b.state import EmulatedContext, EmulatedSandbox, World

    world = World(tmp_path, interrupt_delay_s=0.1, dead_kernel_poll_s=60)
    sandbox = world.create({}, None)
    change_directory = World._change_directory
    started: list[psutil.Process] = []

    async def killed_meanwhile(box: EmulatedSandbox, context: EmulatedContext, cwd: str) -> None:
        await change_directory(box, context, cwd)
        assert context.kernel is not None
        runtime_dir = Path(context.kernel.handle.connection["runtime_dir"])
        started.append(psutil.Process(int((runtime_dir / "kernel.pid").read_text())))
        await world.kill(box)

    monkeypatch.setattr(World, "_change_directory", staticmethod(killed_meanwhile))
    with pytest.raises(SandboxDiedError, match="killed as a context started"):
        await world.create_context(sandbox, "python", None)
    assert sandbox.contexts == {}
    assert started
    with contextlib.suppress(psutil.NoSuchProcess):
        assert started[0].status() == psutil.STATUS_ZOMBIE
