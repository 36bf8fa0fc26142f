"""Flow-run state hooks that kill a run's sandboxes by label, and the backend a flow uses.

``on_cancellation`` and ``on_crashed`` hooks may run in another process that sees only the
flow-run record, so they find sandboxes by the flow-run id label, not by a live handle, with the
backend rebuilt from the run's ``backend`` parameter the way the flow chose it.
"""

from __future__ import annotations

from typing import Any

from prefect import Flow
from prefect.blocks.core import Block
from prefect.client.schemas.objects import FlowRun, State
from prefect.logging import get_logger
from prefect.utilities.dispatch import lookup_type

from prefect_sandbox.blocks.base import SandboxBackend
from prefect_sandbox.blocks.local import LocalKernelBackend
from prefect_sandbox.sandbox.errors import SandboxError
from prefect_sandbox.sandbox.labels import FLOW_RUN_ID_LABEL
from prefect_sandbox.settings import PrefectSandboxSettings

__all__ = [
    "backend_from_parameter",
    "default_backend",
    "kill_labelled_sandboxes",
    "kill_run_sandboxes",
]

logger = get_logger(__name__)


async def default_backend() -> SandboxBackend:
    """The backend a flow given none uses: the saved block ``PREFECT_SANDBOX_BACKEND_BLOCK``
    names, else a local kernel.

    Raises:
        ValueError: the variable names no saved block, or one that is not a sandbox backend.
    """
    name = PrefectSandboxSettings().backend_block
    if name is None:
        return LocalKernelBackend()
    where = f"PREFECT_SANDBOX_BACKEND_BLOCK={name!r}"
    try:
        block = await Block.aload(name)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from exc
    if not isinstance(block, SandboxBackend):
        raise ValueError(f"{where} is a {type(block).__name__}, not a sandbox backend block")
    return block


async def backend_from_parameter(value: Any) -> SandboxBackend:
    """Rebuild the backend block from a flow run's ``backend`` parameter as stored.

    Args:
        value: None (the flow's default, `default_backend`), a ``{"$ref": ...}`` block
            reference, a block's serialised fields with ``block_type_slug``, or a block.

    Returns:
        The backend block.
    """
    if isinstance(value, SandboxBackend):
        return value
    if isinstance(value, dict) and "$ref" in value:
        loaded = await Block.aload_from_ref(value["$ref"])
        if isinstance(loaded, SandboxBackend):
            return loaded
    elif isinstance(value, dict) and "block_type_slug" in value:
        block_class = lookup_type(Block, value["block_type_slug"])
        fields = {k: v for k, v in value.items() if k != "block_type_slug"}
        block = block_class.model_validate(fields)
        if isinstance(block, SandboxBackend):
            return block
    return await default_backend()


async def kill_labelled_sandboxes(backend: SandboxBackend, flow_run_id: str, why: str) -> int:
    """Kill every sandbox of ``backend`` labelled with the flow run's id.

    Args:
        backend: the backend block.
        flow_run_id: the flow run's UUID as a string.
        why: what ended the run, for the log (e.g. the final state's name).

    Returns:
        How many this call killed; a sandbox it could not kill, or a listing that failed, is
        logged as a warning.
    """
    killed = 0
    try:
        handles = await backend.list_sandboxes({FLOW_RUN_ID_LABEL: flow_run_id})
    except SandboxError as exc:
        logger.warning("Sandboxes of flow run %s not listed, none killed: %s", flow_run_id, exc)
        return 0
    for handle in handles:
        try:
            sandbox = await backend.attach(handle)
            killed += await sandbox.kill()
        except SandboxError as exc:
            logger.warning("Sandbox %s of flow run %s: %s", handle.sandbox_id, flow_run_id, exc)
            continue
        logger.info("Killed sandbox %s of flow run %s (%s)", handle.sandbox_id, flow_run_id, why)
    return killed


async def kill_run_sandboxes(flow: Flow[Any, Any], flow_run: FlowRun, state: State) -> None:
    """Kill every sandbox labelled with this flow run's id (a cancellation or crash hook)."""
    backend = await backend_from_parameter(flow_run.parameters.get("backend"))
    await kill_labelled_sandboxes(backend, str(flow_run.id), state.name or state.type.value)
