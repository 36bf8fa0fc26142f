"""A sweep's branches as flow runs of a ``run-notebook`` deployment: the deployment checked,
saved blocks sent by reference, runs waited on and cancelled through the Prefect API.
Manual: docs/how-to/deployments.md.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any
from uuid import UUID

from prefect.blocks.core import Block
from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import FlowRun, State, StateType
from prefect.states import Cancelled, Cancelling

from prefect_sandbox._compat import block_document_id
from prefect_sandbox.flows.sweep.model import RUN_NOTEBOOK, BranchOptions

__all__ = [
    "DEPLOYMENT_POLL_S",
    "block_reference",
    "checked_deployment",
    "deployment_arguments",
    "final_state",
    "request_cancel",
]

DEPLOYMENT_POLL_S = 2.0
"""Seconds between two reads of a deployment run's state."""


async def checked_deployment(deployment: str) -> str:
    """The deployment's full name, ``run-notebook/NAME``, once the API knows it.

    Raises:
        ValueError: it is of another flow, or the API knows no such deployment.
    """
    from prefect.exceptions import ObjectNotFound

    flow_name, slash, name = deployment.rpartition("/")
    if slash and flow_name != RUN_NOTEBOOK:
        raise ValueError(
            f"deployment {deployment!r} is of flow {flow_name!r}; a sweep's branches run "
            f"{RUN_NOTEBOOK!r}"
        )
    full = f"{RUN_NOTEBOOK}/{name}"
    async with get_client() as client:
        try:
            await client.read_deployment_by_name(full)
        except ObjectNotFound:
            raise ValueError(f"no deployment {full!r} is known to the Prefect API") from None
    return full


def block_reference(block: Block, what: str) -> dict[str, Any]:
    """A saved block as a deployment run's parameter: a reference, so its secrets travel in
    no parameter and the worker loads it.

    Raises:
        ValueError: the block is not saved.
    """
    document_id = block_document_id(block)
    if document_id is None:
        raise ValueError(
            f"{what} must be a saved block to be sent to a deployment's runs: save it, "
            f"or give its name"
        )
    return {"$ref": {"block_document_id": str(document_id)}}


def deployment_arguments(options: BranchOptions) -> dict[str, Any]:
    """``options`` as a deployment run's parameters: those given (the deployment's defaults
    apply to the others), blocks as references.

    Raises:
        ValueError: a block to send is not saved.
    """
    arguments = {name: value for name, value in options.arguments().items() if value is not None}
    for name, value in arguments.items():
        if isinstance(value, Block):
            arguments[name] = block_reference(value, name)
    return arguments


async def final_state(flow_run_id: UUID, within_s: float | None) -> State[Any] | None:
    """The flow run's state once final, polled every `DEPLOYMENT_POLL_S`; after ``within_s``
    seconds (None: no limit), its state then."""
    deadline = None if within_s is None else time.monotonic() + within_s
    async with get_client() as client:
        while True:
            state = (await client.read_flow_run(flow_run_id)).state
            if state is not None and state.is_final():
                return state
            if deadline is not None and time.monotonic() >= deadline:
                return state
            await asyncio.sleep(DEPLOYMENT_POLL_S)


async def request_cancel(flow_run: FlowRun, why: str) -> None:
    """Cancel a deployment run: one not started yet at once; a running one through its worker,
    whose cancellation kills its sandbox (the run's own hook)."""
    state = flow_run.state
    if state is not None and state.is_final():
        return
    not_started = state is None or state.type in (StateType.SCHEDULED, StateType.PENDING)
    async with get_client() as client:
        await client.set_flow_run_state(
            flow_run.id, Cancelled(message=why) if not_started else Cancelling(message=why)
        )
