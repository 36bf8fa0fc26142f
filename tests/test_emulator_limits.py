"""Rate limits and quotas: the emulators answer as E2B's and Daytona's APIs do (checked with
raw HTTP and the vendors' SDKs alone), and our backends wait out a rate limit on creates and
fail clearly at a quota (`prefect_sandbox.testing.limits`).

Each test starts an emulator of its own, with its limits; a module-scoped one would carry one
test's counts into the next.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest
from daytona import AsyncDaytona, DaytonaConfig, DaytonaError
from e2b import RateLimitException
from e2b_code_interpreter import AsyncSandbox as E2BAsyncSandbox

from prefect_sandbox.blocks.daytona import DaytonaBackend, DaytonaCredentials
from prefect_sandbox.blocks.e2b import E2BBackend, E2BCredentials
from prefect_sandbox.sandbox.base import Sandbox
from prefect_sandbox.sandbox.errors import SandboxError, SandboxUnavailableError
from prefect_sandbox.testing.daytona import DaytonaEmulator
from prefect_sandbox.testing.e2b import E2BEmulator
from prefect_sandbox.testing.limits import (
    E2B_PRO,
    FixedWindow,
    Gcra,
    Limits,
    RateLimit,
)


def test_e2bs_limiter_lets_a_burst_through_then_one_call_per_interval() -> None:
    gcra = Gcra(RateLimit(5, 1.0))
    assert [gcra.take(100.0) for _ in range(5)] == [None] * 5
    assert gcra.take(100.0) == pytest.approx(0.2)
    assert gcra.take(100.2) is None and gcra.take(100.2) == pytest.approx(0.2)


def test_daytonas_limiter_blocks_a_whole_period_once_passed() -> None:
    window = FixedWindow(RateLimit(2, 60.0))
    assert [window.take(0.0), window.take(1.0)] == [None, None]
    assert window.take(2.0) == 60.0
    assert window.take(61.0) == pytest.approx(1.0)  # blocked from t=2 s for a whole period
    assert window.take(62.0) is None


@pytest.fixture
def e2b_limited() -> Iterator[E2BEmulator]:
    with E2BEmulator(limits=Limits(rates={"create": RateLimit(2, 1.0)}, max_live_sandboxes=3)) as e:
        yield e


@pytest.fixture
def daytona_limited() -> Iterator[DaytonaEmulator]:
    limits = Limits(rates={"create": RateLimit(2, 3.0)}, max_live_sandboxes=3)
    with DaytonaEmulator(limits=limits) as emulator:
        yield emulator


def test_e2b_answers_a_create_past_its_rate_as_e2bs_api_does(e2b_limited: E2BEmulator) -> None:
    headers = {"X-API-Key": e2b_limited.api_key}
    with httpx.Client(base_url=e2b_limited.url, headers=headers) as client:
        answers = [client.post("/sandboxes", json={"templateID": "base"}) for _ in range(3)]
    assert [a.status_code for a in answers] == [201, 201, 429]
    refused = answers[2]
    assert refused.json() == {"code": 429, "message": "Rate limit exceeded"}
    assert refused.headers["retry-after"] == "1"  # whole seconds, 1 at least
    assert refused.headers["ratelimit-limit"] == "2"
    assert refused.headers["ratelimit-remaining"] == "0"
    assert e2b_limited.limits.refused["create"] == 1


async def test_e2bs_sdk_meets_the_quota_as_e2bs_concurrency_error() -> None:
    with E2BEmulator(limits=Limits(max_live_sandboxes=2)) as emulator:
        options = {"api_key": emulator.api_key, "api_url": emulator.url}
        made = [await E2BAsyncSandbox.create(sandbox_url=emulator.url, **options) for _ in "ab"]
        assert emulator.peak_live_sandboxes == 2
        quota = r"429: .*maximum number of concurrent E2B sandboxes \(2\)"
        with pytest.raises(RateLimitException, match=quota):
            await E2BAsyncSandbox.create(sandbox_url=emulator.url, **options)
        # The SDK asked again after its own back-off: no Retry-After came.
        assert emulator.limits.refused["create"] == 4
        await made[0].kill()
        made[0] = await E2BAsyncSandbox.create(sandbox_url=emulator.url, **options)
        for sandbox in made:
            await sandbox.kill()


def test_daytona_answers_a_create_past_its_rate_as_nests_throttler_does(
    daytona_limited: DaytonaEmulator,
) -> None:
    headers = {"Authorization": f"Bearer {daytona_limited.api_key}"}
    with httpx.Client(base_url=daytona_limited.api_url, headers=headers) as client:
        answers = [client.post("/sandbox", json={}) for _ in range(3)]
    assert [a.status_code for a in answers] == [200, 200, 429]
    refused = answers[2]
    assert refused.json()["message"] == "ThrottlerException: Too Many Requests"
    # Named after the throttler: no plain Retry-After.
    assert refused.headers["retry-after-sandbox-create"] == "3"
    assert "retry-after" not in refused.headers
    assert daytona_limited.limits.refused["create"] == 1


async def test_daytonas_sdk_meets_the_cpu_quota() -> None:
    with DaytonaEmulator(limits=Limits(max_live_sandboxes=2)) as emulator:
        config = DaytonaConfig(
            api_key=emulator.api_key, api_url=emulator.api_url, target=emulator.target
        )
        client = AsyncDaytona(config)
        try:
            made = [await client.create(timeout=0) for _ in "ab"]
            with pytest.raises(
                DaytonaError, match=r"Total CPU limit exceeded\. Maximum allowed: 2"
            ):
                await client.create(timeout=0)
            for sandbox in made:
                await client.delete(sandbox)
        finally:
            await client.close()
        assert emulator.peak_live_sandboxes == 2


def _e2b_backend(emulator: E2BEmulator) -> E2BBackend:
    credentials = E2BCredentials(
        api_key=emulator.api_key, api_url=emulator.url, sandbox_url=emulator.url
    )
    return E2BBackend(credentials=credentials, lifetime_s=60)


def _daytona_backend(emulator: DaytonaEmulator) -> DaytonaBackend:
    credentials = DaytonaCredentials(
        api_key=emulator.api_key, api_url=emulator.api_url, target=emulator.target
    )
    return DaytonaBackend(credentials=credentials)


async def _kill_all(sandboxes: list[Sandbox]) -> None:
    await asyncio.gather(*(sandbox.kill() for sandbox in sandboxes))


@pytest.mark.parametrize("vendor", ["e2b", "daytona"])
async def test_creates_past_the_rate_are_waited_out(
    vendor: str, e2b_limited: E2BEmulator, daytona_limited: DaytonaEmulator
) -> None:
    emulator = e2b_limited if vendor == "e2b" else daytona_limited
    backend = _e2b_backend(e2b_limited) if vendor == "e2b" else _daytona_backend(daytona_limited)
    labels = {"prefect-sandbox": "true", "test-id": uuid.uuid4().hex}
    start = time.monotonic()
    made = await asyncio.gather(*(backend.create(labels) for _ in range(3)))
    try:
        assert len({sandbox.handle.sandbox_id for sandbox in made}) == 3
        assert emulator.limits.refused["create"] >= 1
        # E2B lets the third through a second later, Daytona's window blocks for 3 s.
        assert time.monotonic() - start >= (1.0 if vendor == "e2b" else 3.0)
    finally:
        await _kill_all(list(made))


async def test_e2bs_quota_is_waited_for_then_fails_naming_what_to_set(
    e2b_limited: E2BEmulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PREFECT_SANDBOX_CREATE_WAIT_S", "4")
    backend = _e2b_backend(e2b_limited)
    labels = {"prefect-sandbox": "true"}
    made = [await backend.create(labels) for _ in range(3)]
    try:
        start = time.monotonic()
        with pytest.raises(SandboxUnavailableError) as info:
            await backend.create(labels)
        assert 2.0 <= time.monotonic() - start < 30
        assert info.value.status_code == 429 and info.value.operation == "create"
        message = str(info.value)
        assert "maximum number of concurrent E2B sandboxes (3)" in message
        assert "PREFECT_SANDBOX_CREATE_WAIT_S=4" in message and "max_live_sandboxes" in message
        # A slot freed within the wait: the create goes through.
        await made.pop().kill()
        made.append(await backend.create(labels))
    finally:
        await _kill_all(made)


async def test_daytonas_quota_fails_at_once_naming_it(daytona_limited: DaytonaEmulator) -> None:
    backend = _daytona_backend(daytona_limited)
    labels = {"prefect-sandbox": "true"}
    made = []
    try:
        for _ in range(3):
            made.append(await backend.create(labels))
        start = time.monotonic()
        with pytest.raises(SandboxError) as info:
            await backend.create(labels)
        assert not isinstance(info.value, SandboxUnavailableError)
        assert time.monotonic() - start < 10
        message = str(info.value)
        assert "quota is reached (Total CPU limit exceeded. Maximum allowed: 3.)" in message
        assert "max_live_sandboxes" in message
    finally:
        await _kill_all(made)


def test_e2b_pro_is_five_creates_a_second_and_a_hundred_live() -> None:
    assert E2B_PRO.rates["create"] == RateLimit(5, 1.0)
    assert E2B_PRO.max_live_sandboxes == 100
