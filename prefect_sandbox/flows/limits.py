"""The cap on live sandboxes: Prefect global concurrency limits held while a sandbox lives.

A backend block's ``max_live_sandboxes`` makes each flow run hold one slot of
``prefect-sandbox:<backend slug>`` (`live_sandbox_limit_name`) from before its sandbox is made
until after it is killed (`live_sandbox_slot`); a sweep's ``max_live_sandboxes`` is a limit of
its own, ``prefect-sandbox:sweep:<flow run id>`` (`sweep_limit`), that its branches hold as
well. A run creates a missing limit with the block's value but never rewrites one (it warns
where the sizes differ). Slots are Prefect's leases, taken, renewed and released through its
client, not its ``concurrency()``, whose renewal gives up after 3 failed tries and lets the run
go on uncapped; transient failures are tried again, and a lease lost stops the run's sandbox
(`SlotError`), so the cap holds. A killed process's slot is freed by the server's repossessor
`LEASE_DURATION_S` after its last renewal; Prefect's temporary API has none. Manual:
docs/how-to/cap.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any
from uuid import UUID

import httpx
from prefect import get_client, get_run_logger
from prefect.client.orchestration import PrefectClient
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
from prefect.client.schemas.objects import ConcurrencyLeaseHolder
from prefect.client.schemas.responses import (
    ConcurrencyLimitWithLeaseResponse,
    GlobalConcurrencyLimitResponse,
)
from prefect.concurrency.asyncio import ConcurrencySlotAcquisitionError
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound
from tenacity import AsyncRetrying

from prefect_sandbox.blocks.base import SandboxBackend
from prefect_sandbox.sandbox.backends import cancel_and_wait
from prefect_sandbox.sandbox.errors import SandboxError
from prefect_sandbox.sandbox.retries import async_retrying, retry_delay_s
from prefect_sandbox.tasks.scopes import shielded

__all__ = [
    "API_ATTEMPTS",
    "LEASE_DURATION_S",
    "LIMIT_PREFIX",
    "LOST_MARGIN_S",
    "RENEW_EVERY_S",
    "RETRY_FIRST_DELAY_S",
    "SWEEP_LIMIT_PREFIX",
    "HeldSlot",
    "LiveLimit",
    "SlotError",
    "also_holding",
    "live_sandbox_limit_name",
    "live_sandbox_slot",
    "on_slot",
    "run_limits",
    "sweep_limit",
    "sweep_limit_name",
]

LIMIT_PREFIX = "prefect-sandbox:"
SWEEP_LIMIT_PREFIX = f"{LIMIT_PREFIX}sweep:"
LEASE_DURATION_S = 120.0
"""Seconds a slot's lease lasts without renewal (Prefect's server accepts 60 s at least): it
frees a killed run's slot within about 2 minutes on a ``prefect server``."""
RENEW_EVERY_S = LEASE_DURATION_S / 4
"""Seconds between renewals: a failed one has 3/4 of the lease to be tried again."""
LOST_MARGIN_S = 15.0
"""A lease not renewed within this many seconds of lapsing is taken as lost, so the sandbox is
stopped before the server's repossessor (which looks every 15 s) gives the slot away."""
API_ATTEMPTS = 8
"""Tries in all of each slot call (read, take, release) that fails transiently."""
RETRY_FIRST_DELAY_S = 1.0
"""The first wait before another try; it doubles each time, up to 30 s."""


@dataclass(frozen=True)
class LiveLimit:
    """A global concurrency limit a run holds one slot of while its sandbox lives.

    Attributes:
        name: the limit's name.
        size: the slots it is created with when missing (a limit that exists keeps its own).
        set_by: what asked for that size, for the log (e.g. ``"the block's max_live_sandboxes"``).
    """

    name: str
    size: int
    set_by: str


_ALSO_HELD: ContextVar[LiveLimit | None] = ContextVar("prefect_sandbox_also_held", default=None)
_ON_SLOT: ContextVar[Callable[[], None] | None] = ContextVar(
    "prefect_sandbox_on_slot", default=None
)


def live_sandbox_limit_name(backend: SandboxBackend) -> str:
    """The name of the global concurrency limit that caps ``backend``'s live sandboxes, e.g.
    ``"prefect-sandbox:e2b"``: one per kind of backend, whatever the block's name."""
    return f"{LIMIT_PREFIX}{backend.backend_slug}"


def sweep_limit_name(sweep_id: UUID) -> str:
    """The name of a sweep's own limit: `SWEEP_LIMIT_PREFIX` and the sweep's flow run id."""
    return f"{SWEEP_LIMIT_PREFIX}{sweep_id}"


def run_limits(backend: SandboxBackend) -> list[LiveLimit]:
    """The limits a run of ``backend`` holds a slot of: its backend's, when the block has a
    cap, and the one `also_holding` passes it (a sweep's), if any."""
    limits = [] if (also := _ALSO_HELD.get()) is None else [also]
    if backend.max_live_sandboxes is not None:
        name = live_sandbox_limit_name(backend)
        limits.insert(
            0, LiveLimit(name, backend.max_live_sandboxes, "the block's max_live_sandboxes")
        )
    return limits


@contextlib.contextmanager
def also_holding(limit: LiveLimit | None) -> Iterator[None]:
    """Within (this task and those it starts, a subflow's included): each run's sandbox also
    holds a slot of ``limit`` (`run_limits`); None changes nothing."""
    token = _ALSO_HELD.set(limit) if limit is not None else None
    try:
        yield
    finally:
        if token is not None:
            _ALSO_HELD.reset(token)


@contextlib.contextmanager
def on_slot(callback: Callable[[], None]) -> Iterator[None]:
    """Within (this task and the runs it starts, a subflow's included): ``callback`` is called
    once a run holds its slots (`live_sandbox_slot`), just before its sandbox is asked for; at
    once when it has no limit to hold."""
    token = _ON_SLOT.set(callback)
    try:
        yield
    finally:
        _ON_SLOT.reset(token)


@asynccontextmanager
async def sweep_limit(sweep_id: UUID, size: int | None) -> AsyncIterator[LiveLimit | None]:
    """Within: the sweep's own limit, ``prefect-sandbox:sweep:<sweep_id>``, with ``size``
    slots (None: no limit, nothing made); deleted on exit, however it is left.

    Raises:
        prefect.exceptions.PrefectHTTPStatusError: the API refused to make it.
    """
    if size is None:
        yield None
        return
    limit = LiveLimit(sweep_limit_name(sweep_id), size, "the sweep's max_live_sandboxes")
    async with get_client() as client:
        await client.create_global_concurrency_limit(
            GlobalConcurrencyLimitCreate(name=limit.name, limit=size)
        )
    try:
        yield limit
    finally:
        async with get_client() as client:
            with contextlib.suppress(ObjectNotFound):
                await client.delete_global_concurrency_limit_by_name(limit.name)


async def _existing(limit: LiveLimit) -> GlobalConcurrencyLimitResponse:
    """The limit as the API has it, created with ``limit.size`` when missing; where it exists
    with another size it is left as it is, with a warning.

    Returns:
        The limit as read (``active_slots`` says how many are taken).
    """
    logger = get_run_logger()
    async with get_client() as client:
        try:
            return await client.read_global_concurrency_limit_by_name(limit.name)
        except ObjectNotFound:
            pass
        try:
            await client.create_global_concurrency_limit(
                GlobalConcurrencyLimitCreate(name=limit.name, limit=limit.size)
            )
            logger.info("Created the concurrency limit %s with %d slot(s)", limit.name, limit.size)
        except ObjectAlreadyExists:
            pass  # another run made it first
        return await client.read_global_concurrency_limit_by_name(limit.name)


def _check(limit: LiveLimit, current: GlobalConcurrencyLimitResponse) -> None:
    """Warn where the limit as it is does not cap as ``limit`` asks."""
    logger = get_run_logger()
    if current.limit != limit.size:
        logger.warning(
            "Concurrency limit %s has %d slot(s), not %d as %s says: it is left as it is (a "
            "run never rewrites a limit). To change it: prefect gcl update %s --limit %d",
            limit.name,
            current.limit,
            limit.size,
            limit.set_by,
            limit.name,
            limit.size,
        )
    if not current.active:
        logger.warning("Concurrency limit %s is inactive: the cap is not enforced", limit.name)
    elif current.active_slots >= current.limit:
        logger.info(
            "Waiting for a slot of %s: %d of %d sandbox(es) are alive. If no run holds them (a "
            "run killed outright on Prefect's temporary API keeps its slot), free them with: "
            "prefect gcl update %s --active-slots 0",
            limit.name,
            current.active_slots,
            current.limit,
            limit.name,
        )


class SlotError(SandboxError):
    """The run's live-sandbox slot could not be taken (the API kept failing, or a limit
    vanished), or its lease was lost while the sandbox lived (the sandbox is then stopped so
    that the cap holds). The run still stores what it made and ``summary.json``."""


@dataclass
class HeldSlot:
    """The slots `live_sandbox_slot` holds.

    Attributes:
        lost: why the lease was lost while held (the body was cancelled then), or None.
    """

    lost: str | None = None


def _transient(error: BaseException) -> bool:
    """Whether a Prefect API call that failed so is worth another try: no answer, a timeout, a
    429 or a 5xx (a 503 is SQLite locked, under load)."""
    if isinstance(error, httpx.HTTPStatusError):
        code = error.response.status_code
        return code in (408, 429) or code >= 500
    return isinstance(error, httpx.TransportError)


def _retrying(what: str, attempts: int = API_ATTEMPTS) -> AsyncRetrying:
    return async_retrying(
        attempts=attempts, retry_if=_transient, first_delay_s=RETRY_FIRST_DELAY_S, what=what
    )


@asynccontextmanager
async def live_sandbox_slot(limits: list[LiveLimit], flow_run_id: str) -> AsyncIterator[HeldSlot]:
    """Hold one slot of each of ``limits`` at once (`run_limits` says which a run holds).

    Each limit is created when missing (`LiveLimit.size`); one that exists keeps its size (a
    warning says when it differs). Waits, as long as it takes, for a free slot of each (logging
    once, at info, that it waits when one is full on arrival); an API call that fails on the
    way (a 503 while SQLite is locked) is tried again, `API_ATTEMPTS` times in all. Inside, the
    lease is renewed every `RENEW_EVERY_S`, a failed renewal tried again until the lease would
    lapse; a lease lost (the server no longer has it, or it could not be renewed in time)
    cancels the body, so that its sandbox is stopped before the server gives the slot to
    another run, and `SlotError` is raised on the way out. The slots are released on exit,
    however the block is left, a passed deadline not stopping the release (`shielded`); a
    release that still fails is a warning (the server frees the slot once its lease lapses).

    Args:
        limits: the limits; none: this holds nothing and calls no Prefect API.
        flow_run_id: the flow run's UUID as a string: the slots' holder.

    Yields:
        The `HeldSlot`.

    Raises:
        SlotError: a limit vanished before a slot was taken, the API kept failing, or the
            lease was lost inside.
    """
    slot = HeldSlot()
    if not limits:
        _slot_taken()
        yield slot
        return
    names = [limit.name for limit in limits]
    try:
        for limit in limits:
            async for attempt in _retrying(f"Reading the concurrency limit {limit.name}"):
                with attempt:
                    current = await _existing(limit)
            _check(limit, current)
        lease_id, asked_at = await _acquire(names, UUID(flow_run_id))
    except (httpx.HTTPError, ConcurrencySlotAcquisitionError) as exc:
        raise SlotError(f"No slot of {', '.join(names)} could be taken: {exc}") from exc
    body = asyncio.current_task()
    assert body is not None, "must run in an asyncio task"
    keeper = asyncio.create_task(_keep_lease(lease_id, asked_at, names, slot, body))
    _slot_taken()
    try:
        yield slot
    except asyncio.CancelledError:
        if slot.lost is None:
            raise
        body.uncancel()  # the cancellation was the keeper's, for the lost lease
    finally:
        with shielded():
            await cancel_and_wait(keeper)
            await _release(lease_id, names)
    if slot.lost is not None:
        raise SlotError(slot.lost)


def _slot_taken() -> None:
    """Tell whoever asked (`on_slot`) that this run holds its slots."""
    callback = _ON_SLOT.get()
    if callback is not None:
        callback()


async def _acquire(names: list[str], holder_id: UUID) -> tuple[UUID, float]:
    """Take one slot of each of ``names`` with a lease held by the flow run ``holder_id``,
    waiting while a limit is full (the server's 423 and its Retry-After, as Prefect's own
    acquisition service does) and trying again what is transient.

    Returns:
        The lease's id, and the `time.monotonic` before the request that took it (the lease
        lasts `LEASE_DURATION_S` from a moment after that).

    Raises:
        ConcurrencySlotAcquisitionError: a limit does not exist.
        httpx.HTTPError: the API kept failing (`API_ATTEMPTS` tries).
    """
    holder = ConcurrencyLeaseHolder(type="flow_run", id=holder_id)
    async with get_client() as client:
        async for attempt in _retrying(f"Taking a slot of {', '.join(names)}"):
            with attempt:
                while True:
                    asked_at = time.monotonic()
                    request = asyncio.ensure_future(
                        client.increment_concurrency_slots_with_lease(
                            names=names,
                            slots=1,
                            mode="concurrency",
                            lease_duration=LEASE_DURATION_S,
                            holder=holder,
                        )
                    )
                    try:
                        response = await asyncio.shield(request)
                    except asyncio.CancelledError:
                        with shielded():
                            await _release_if_granted(client, request)
                        raise
                    except httpx.HTTPStatusError as exc:
                        if exc.response.status_code != 423:
                            raise
                        await asyncio.sleep(float(exc.response.headers.get("Retry-After", 1)))
                        continue
                    granted = ConcurrencyLimitWithLeaseResponse.model_validate(response.json())
                    if len(granted.limits) < len(names):
                        raise ConcurrencySlotAcquisitionError(
                            f"Concurrency limits {names!r} vanished before a slot was taken"
                        )
                    return granted.lease_id, asked_at
    raise AssertionError("unreachable: tenacity reraises")


async def _release_if_granted(
    client: PrefectClient, request: asyncio.Future[httpx.Response]
) -> None:
    """Give back the lease that ``request``, whose caller was cancelled, may still be granted:
    else its slot stays taken until the lease lapses (forever on Prefect's temporary API)."""
    await asyncio.wait({request})
    if request.cancelled() or request.exception() is not None:
        return
    granted = ConcurrencyLimitWithLeaseResponse.model_validate(request.result().json())
    with contextlib.suppress(httpx.HTTPError):
        await client.release_concurrency_slots_with_lease(granted.lease_id)


async def _keep_lease(
    lease_id: UUID, held_from: float, names: list[str], slot: HeldSlot, body: asyncio.Task[Any]
) -> None:
    """Renew the lease every `RENEW_EVERY_S` until cancelled. A renewal that fails is tried
    again, with back-off, while the lease still has `LOST_MARGIN_S` to run; when it has not, or
    the server no longer has the lease, the lease is lost: ``slot.lost`` says why and ``body``
    is cancelled. (Prefect's own renewal gives up after 3 tries and lets the run go on
    uncapped: `prefect.concurrency._leases`.)"""
    logger = get_run_logger()
    held_until = held_from + LEASE_DURATION_S
    async with get_client() as client:
        while True:
            await asyncio.sleep(RENEW_EVERY_S)
            tries = 0
            while True:
                sent = time.monotonic()
                try:
                    await client.renew_concurrency_lease(lease_id, LEASE_DURATION_S)
                except httpx.HTTPError as exc:
                    tries += 1
                    delay = retry_delay_s(exc, tries, first_delay_s=RETRY_FIRST_DELAY_S)
                    gone = isinstance(exc, httpx.HTTPStatusError) and not _transient(exc)
                    if gone or time.monotonic() + delay > held_until - LOST_MARGIN_S:
                        slot.lost = (
                            f"the lease on its slot of {', '.join(names)} was lost ({exc}); "
                            "its sandbox was stopped so that the cap holds"
                        )
                        logger.error("Live-sandbox slot lost: %s", slot.lost)
                        body.cancel()
                        return
                    logger.warning(
                        "Renewing the lease on the slot of %s failed (%s); trying again in %.1f s",
                        ", ".join(names),
                        exc,
                        delay,
                    )
                    await asyncio.sleep(delay)
                else:
                    held_until = sent + LEASE_DURATION_S
                    break


async def _release(lease_id: UUID, names: list[str]) -> None:
    """Give the slots back, trying again what is transient; a release that still fails is a
    warning, never the run's failure: the server frees the slots once the lease lapses."""
    try:
        async with get_client() as client:
            async for attempt in _retrying(f"Releasing the slot of {', '.join(names)}"):
                with attempt:
                    await client.release_concurrency_slots_with_lease(lease_id)
    except httpx.HTTPError as exc:
        get_run_logger().warning(
            "The slot of %s was not given back (%s); the server frees it once its lease "
            "lapses, %.0f s after its last renewal",
            ", ".join(names),
            exc,
            LEASE_DURATION_S,
        )
