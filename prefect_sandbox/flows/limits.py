"""The cap on live sandboxes: Prefect global concurrency limits held while a sandbox lives.

A backend block whose ``max_live_sandboxes`` is set makes each flow run hold one slot of the
limit named ``prefect-sandbox:<backend slug>`` (`live_sandbox_limit_name`) from before its
sandbox is made until after it is killed (`live_sandbox_slot`), so no more than that many of the
backend's sandboxes are alive at once across every run that uses the same Prefect API. The
limit is created on first use with the block's value. A run never rewrites a limit that exists:
where its size differs from the block's value (another block, or a user, set it), the limit
stands as it is and the run logs a warning naming both sizes and how to change the limit
(``prefect gcl update NAME --limit N``). With no cap no limit is read or taken.

A sweep's ``max_live_sandboxes`` is a limit of its own, ``prefect-sandbox:sweep:<flow run id>``
(`sweep_limit`), made for the sweep's branches and deleted when they have ended; each branch
holds a slot of it as well as its backend's (`also_holding` passes it to the branches' runs).
A sweep killed outright leaves its limit behind; the reaper removes it once the sweep's flow
run is final or gone.

Slots are Prefect's lease-based ones (`prefect.concurrency.asyncio.concurrency`), held by
``{"type": "flow_run", "id": <flow run id>}`` and released on the way out of the block however
it is left: a result, an exception or a cancellation. A process killed outright cannot release:
its lease stops being renewed and the server's repossessor service frees the slot once the lease
expires, `LEASE_DURATION_S` after the last renewal (it looks every 15 s). Prefect's temporary
API server (no ``PREFECT_API_URL``) runs no repossessor, so there such a slot stays taken; and
any server keeps leases in memory by default, so one that restarts while a slot is held forgets
the lease and the slot stays taken in its database. ``prefect gcl update <name> --active-slots
0`` (or deleting the limit) frees such slots; a cap is meant for a long-lived ``prefect server``
or Prefect Cloud.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from uuid import UUID

from prefect import get_client, get_run_logger
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
from prefect.client.schemas.objects import ConcurrencyLeaseHolder
from prefect.client.schemas.responses import GlobalConcurrencyLimitResponse
from prefect.concurrency.asyncio import concurrency
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

from prefect_sandbox.blocks.base import SandboxBackend
from prefect_sandbox.tasks.sandbox import shielded

__all__ = [
    "LEASE_DURATION_S",
    "LIMIT_PREFIX",
    "SWEEP_LIMIT_PREFIX",
    "LiveLimit",
    "also_holding",
    "live_sandbox_limit_name",
    "live_sandbox_slot",
    "run_limits",
    "sweep_limit",
    "sweep_limit_name",
]

LIMIT_PREFIX = "prefect-sandbox:"
SWEEP_LIMIT_PREFIX = f"{LIMIT_PREFIX}sweep:"
LEASE_DURATION_S = 120.0
"""Seconds a slot's lease lasts without renewal. Prefect renews it every 3/4 of this while the
run lives (with retries), and its server accepts 60 s at least: 120 s leaves a failed renewal
30 s to retry, and frees a killed run's slot within about 2 minutes on a ``prefect server``."""


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


@asynccontextmanager
async def live_sandbox_slot(limits: list[LiveLimit], flow_run_id: str) -> AsyncIterator[None]:
    """Hold one slot of each of ``limits`` at once (`run_limits` says which a run holds).

    Each limit is created when missing (`LiveLimit.size`); one that exists keeps its size (a
    warning says when it differs). Waits, as long as it takes, for a free slot of each (logging
    once, at info, that it waits when one is full on arrival); releases them on exit, however
    the block is left, a passed deadline (a flow's ``timeout_seconds``) not stopping the
    release (`shielded`).

    Args:
        limits: the limits; none: this holds nothing and calls no Prefect API.
        flow_run_id: the flow run's UUID as a string: the slots' holder.

    Raises:
        prefect.concurrency.asyncio.ConcurrencySlotAcquisitionError: a limit vanished before
            a slot was taken, or the API refused the request.
    """
    if not limits:
        yield
        return
    for limit in limits:
        _check(limit, await _existing(limit))
    acquired = asyncio.Event()
    release = asyncio.Event()

    async def hold() -> None:
        async with concurrency(
            [limit.name for limit in limits],
            lease_duration=LEASE_DURATION_S,
            strict=True,
            holder=ConcurrencyLeaseHolder(type="flow_run", id=UUID(flow_run_id)),
            # A renewal that fails after its retries is logged; the run goes on rather than
            # lose the user's work to an API hiccup.
            raise_on_lease_renewal_failure=False,
        ):
            acquired.set()
            await release.wait()

    # Prefect's slot opens cancel scopes (its lease renewal) that must be left in the task that
    # entered them; held in a task of its own, its release can be shielded from a passed
    # deadline here and still give the slot back.
    holder = asyncio.create_task(hold())
    try:
        await _until_acquired(acquired, holder)
        yield
    finally:
        release.set()
        with shielded():
            await holder


async def _until_acquired(acquired: asyncio.Event, holder: asyncio.Task[None]) -> None:
    """Wait until ``holder`` holds its slot; raises what ``holder`` raised if it ended first.
    Cancelled while waiting, it cancels ``holder`` (whose exit gives back a slot it took)."""
    waiter = asyncio.create_task(acquired.wait())
    try:
        await asyncio.wait({waiter, holder}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        holder.cancel()
        raise
    finally:
        waiter.cancel()
    if not acquired.is_set():
        await holder  # ended without a slot: its error is the caller's
