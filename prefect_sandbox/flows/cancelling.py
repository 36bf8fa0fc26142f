"""Noticing a flow run cancelled through the API or the UI, wherever the run executes.

Prefect acts on a Cancelling state only through a runner or a worker, which kills the process;
a run started from the CLI or a plain script has neither, so it would run on. `cancelled_from_api`
polls the flow run's state, as Prefect's runner does, every ``PREFECT_SANDBOX_CANCEL_POLL_S``
seconds, and on Cancelling (or Cancelled) cancels the asyncio task that entered it: the pipeline
then stops its cell, kills its sandbox, stores what it made and ends Cancelled. The bound: the
poll interval, plus the time the kill and storing take.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from uuid import UUID

import httpx
from prefect import get_run_logger
from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import StateType
from prefect.exceptions import PrefectHTTPStatusError

from prefect_sandbox.sandbox.backends import cancel_and_wait

__all__ = ["cancelled_from_api"]

_STOPPING = frozenset({StateType.CANCELLING, StateType.CANCELLED})


@asynccontextmanager
async def cancelled_from_api(flow_run_id: UUID, *, poll_s: float) -> AsyncIterator[None]:
    """While inside, cancel the current asyncio task once the flow run is Cancelling.

    Only the inside is cancelled: once it is left, a late poll cancels nothing. A read that
    fails (the API busy or unreachable) is logged at debug level and tried again next time.

    Args:
        flow_run_id: the flow run to watch.
        poll_s: seconds between reads of its state.
    """
    task = asyncio.current_task()
    assert task is not None, "must run in an asyncio task"
    inside = True

    logger = get_run_logger()

    async def watch() -> None:
        async with get_client() as client:
            while True:
                await asyncio.sleep(poll_s)
                try:
                    flow_run = await client.read_flow_run(flow_run_id)
                except (httpx.HTTPError, PrefectHTTPStatusError) as exc:
                    logger.debug("Flow run %s: state not read (%s)", flow_run_id, exc)
                    continue
                if flow_run.state is not None and flow_run.state.type in _STOPPING and inside:
                    logger.warning(
                        "Flow run %s is %s (through the API or UI): stopping it",
                        flow_run_id,
                        flow_run.state.name,
                    )
                    task.cancel()
                    return

    watcher = asyncio.create_task(watch())
    try:
        yield
    finally:
        inside = False
        await cancel_and_wait(watcher)
