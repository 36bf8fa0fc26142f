"""The cap on live sandboxes: one Prefect global concurrency limit per backend.

A backend block whose ``max_live_sandboxes`` is set makes each flow run hold one slot of the
limit named ``prefect-sandbox:<backend slug>`` (`live_sandbox_limit_name`) from before its
sandbox is made until after it is killed (`live_sandbox_slot`), so no more than that many of the
backend's sandboxes are alive at once across every run that uses the same Prefect API. The
limit is created on first use with the block's value; where it exists with another limit, the
block's value is written back (logged), since the block is where users set the cap. With no cap
no limit is read or taken.

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
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from uuid import UUID

from prefect import get_client, get_run_logger
from prefect.client.schemas.actions import (
    GlobalConcurrencyLimitCreate,
    GlobalConcurrencyLimitUpdate,
)
from prefect.client.schemas.objects import ConcurrencyLeaseHolder
from prefect.client.schemas.responses import GlobalConcurrencyLimitResponse
from prefect.concurrency.asyncio import concurrency
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

from prefect_sandbox.blocks.base import SandboxBackend

__all__ = ["LEASE_DURATION_S", "LIMIT_PREFIX", "live_sandbox_limit_name", "live_sandbox_slot"]

LIMIT_PREFIX = "prefect-sandbox:"
LEASE_DURATION_S = 120.0
"""Seconds a slot's lease lasts without renewal. Prefect renews it every 3/4 of this while the
run lives (with retries), and its server accepts 60 s at least: 120 s leaves a failed renewal
30 s to retry, and frees a killed run's slot within about 2 minutes on a ``prefect server``."""


def live_sandbox_limit_name(backend: SandboxBackend) -> str:
    """The name of the global concurrency limit that caps ``backend``'s live sandboxes, e.g.
    ``"prefect-sandbox:e2b"``: one per kind of backend, whatever the block's name."""
    return f"{LIMIT_PREFIX}{backend.backend_slug}"


async def _limit_set_to(name: str, limit: int) -> GlobalConcurrencyLimitResponse:
    """Read the limit ``name``, creating it or writing ``limit`` back where it differs.

    Returns:
        The limit as read before any change (``active_slots`` says how many are taken).
    """
    logger = get_run_logger()
    async with get_client() as client:
        try:
            current = await client.read_global_concurrency_limit_by_name(name)
        except ObjectNotFound:
            try:
                await client.create_global_concurrency_limit(
                    GlobalConcurrencyLimitCreate(name=name, limit=limit)
                )
                logger.info("Created the concurrency limit %s with %d slot(s)", name, limit)
            except ObjectAlreadyExists:
                pass  # another run made it first
            current = await client.read_global_concurrency_limit_by_name(name)
        if current.limit != limit:
            await client.update_global_concurrency_limit(
                name, GlobalConcurrencyLimitUpdate(limit=limit)
            )
            logger.info(
                "Concurrency limit %s had %d slot(s); set to the block's max_live_sandboxes, %d",
                name,
                current.limit,
                limit,
            )
        if not current.active:
            logger.warning("Concurrency limit %s is inactive: the cap is not enforced", name)
    return current


@asynccontextmanager
async def live_sandbox_slot(backend: SandboxBackend, flow_run_id: str) -> AsyncIterator[None]:
    """Hold one slot of ``backend``'s live-sandbox limit for the block, when it has a cap.

    Waits, as long as it takes, for a free slot (logging once, at info, that it waits when the
    limit is full on arrival); releases it on exit, however the block is left.

    Args:
        backend: the backend block; with ``max_live_sandboxes`` None this holds nothing and
            calls no Prefect API.
        flow_run_id: the flow run's UUID as a string: the slot's holder.

    Raises:
        prefect.concurrency.asyncio.ConcurrencySlotAcquisitionError: the limit vanished before
            a slot was taken, or the API refused the request.
    """
    cap = backend.max_live_sandboxes
    if cap is None:
        yield
        return
    name = live_sandbox_limit_name(backend)
    current = await _limit_set_to(name, cap)
    if current.active and current.active_slots >= cap:
        get_run_logger().info(
            "Waiting for a slot of %s: %d of %d sandbox(es) are alive (max_live_sandboxes). "
            "If no run holds them (a run killed outright on Prefect's temporary API keeps its "
            "slot), free them with: prefect gcl update %s --active-slots 0",
            name,
            current.active_slots,
            cap,
            name,
        )
    acquired = asyncio.Event()
    release = asyncio.Event()

    async def hold() -> None:
        async with concurrency(
            name,
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
    # entered them; held in a task of its own, the caller may shield its exit from a passed
    # deadline (a flow's timeout_seconds) and still give the slot back.
    holder = asyncio.create_task(hold())
    try:
        await _until_acquired(acquired, holder)
        yield
    finally:
        release.set()
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
