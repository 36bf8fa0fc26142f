"""Flow-run state hooks that kill a run's sandboxes by label, and the backend a flow uses.

``on_cancellation`` and ``on_crashed`` hooks may run in another process that sees only the
flow-run record, so they find sandboxes by the flow-run id label, not by a live handle, with the
backend found the way the run found it (`run_backend`): in the run's own process, from the
parameters it was given; elsewhere, from the API's copy, where Prefect masks an inline block's
secrets, so these come from the environment as the CLI takes them (``E2B_API_KEY``...,
``DAYTONA_*``). Manual: docs/how-to/reaper.md.
"""

from __future__ import annotations

from typing import Any

from prefect import Flow
from prefect.blocks.core import Block
from prefect.client.schemas.objects import FlowRun, State
from prefect.context import FlowRunContext
from prefect.exceptions import ObjectNotFound
from prefect.logging import get_logger
from prefect.utilities.dispatch import lookup_type
from pydantic import SecretStr

from prefect_sandbox.blocks.base import SandboxBackend
from prefect_sandbox.blocks.daytona import DaytonaBackend
from prefect_sandbox.blocks.e2b import E2BBackend, E2BCredentials
from prefect_sandbox.blocks.local import LocalKernelBackend
from prefect_sandbox.sandbox.errors import SandboxError
from prefect_sandbox.sandbox.labels import FLOW_RUN_ID_LABEL
from prefect_sandbox.settings import PrefectSandboxSettings

__all__ = [
    "backend_from_parameter",
    "default_backend",
    "hook_backend",
    "kill_labelled_sandboxes",
    "kill_run_sandboxes",
    "run_backend",
]

logger = get_logger(__name__)

MASKED_SECRET = str(SecretStr("any"))
"""What pydantic, and so the API's copy of a flow run's parameters, shows for a secret."""


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
            reference, a block's serialised fields with ``block_type_slug`` (masked credentials
            are replaced by the environment's: E2B's variables, or none for Daytona, whose SDK
            reads its own), or a block.

    Returns:
        The backend block.

    Raises:
        ValueError: ``value`` is none of those, or names no sandbox backend (a reference to
            no saved block or to another kind of block, an unknown ``block_type_slug``, fields
            that do not validate): the message says what is missing. Never the default
            backend instead, whose sandboxes are not the run's.
    """
    if value is None:
        return await default_backend()
    if isinstance(value, SandboxBackend):
        return value
    if isinstance(value, dict) and "$ref" in value:
        try:
            block = await Block.aload_from_ref(value["$ref"])
        except (ValueError, ObjectNotFound) as exc:
            raise ValueError(f"no saved block for the reference {value['$ref']!r}: {exc}") from exc
    elif isinstance(value, dict) and "block_type_slug" in value:
        slug = value["block_type_slug"]
        try:
            block_class = lookup_type(Block, slug)
        except KeyError:
            raise ValueError(f"no block type {slug!r} is known to this process") from None
        fields = {k: v for k, v in value.items() if k != "block_type_slug"}
        block = _unmasked(block_class.model_validate(fields))
    else:
        raise ValueError(
            f"a {type(value).__name__}: neither empty, a block reference ($ref) nor a block's "
            "fields with block_type_slug"
        )
    if not isinstance(block, SandboxBackend):
        raise ValueError(f"a {type(block).__name__} block, not a sandbox backend block")
    return block


def _unmasked(backend: Block) -> Block:
    """``backend``, its credentials taken from the environment (as the CLI takes them) when
    the copy it was rebuilt from had them masked; a warning when the environment has none."""
    credentials = getattr(backend, "credentials", None)
    if credentials is None or MASKED_SECRET not in {
        secret.get_secret_value()
        for secret in vars(credentials).values()
        if isinstance(secret, SecretStr)
    }:
        return backend
    assert isinstance(backend, SandboxBackend)
    if isinstance(backend, DaytonaBackend):
        # The SDK reads DAYTONA_API_KEY, DAYTONA_API_URL and DAYTONA_TARGET.
        return backend.model_copy(update={"credentials": None})
    if isinstance(backend, E2BBackend):
        try:
            return backend.model_copy(update={"credentials": E2BCredentials.from_environment()})
        except KeyError:
            pass
    logger.warning(
        "The %s backend's credentials are masked in the flow run's parameters and this "
        "process's environment has none to use instead; save the backend as a block",
        backend.backend_slug,
    )
    return backend


async def kill_labelled_sandboxes(backend: SandboxBackend, flow_run_id: str, why: str) -> list[str]:
    """Kill every sandbox of ``backend`` labelled with the flow run's id.

    Args:
        backend: the backend block.
        flow_run_id: the flow run's UUID as a string.
        why: what ended the run, for the log (e.g. the final state's name).

    Returns:
        The ids of the sandboxes this call killed; a sandbox it could not kill, or a listing
        that failed, is logged as a warning.
    """
    killed: list[str] = []
    try:
        handles = await backend.list_sandboxes({FLOW_RUN_ID_LABEL: flow_run_id})
    except SandboxError as exc:
        logger.warning("Sandboxes of flow run %s not listed, none killed: %s", flow_run_id, exc)
        return killed
    for handle in handles:
        try:
            sandbox = await backend.attach(handle)
            if await sandbox.kill():
                killed.append(handle.sandbox_id)
        except SandboxError as exc:
            logger.warning("Sandbox %s of flow run %s: %s", handle.sandbox_id, flow_run_id, exc)
            continue
        logger.info("Killed sandbox %s of flow run %s (%s)", handle.sandbox_id, flow_run_id, why)
    return killed


async def run_backend(flow_run: FlowRun) -> SandboxBackend:
    """The backend a flow run uses, found as the run found it.

    In the run's own process (its run context is current) from the parameters as given, secrets
    included; elsewhere (a runner, a worker, a reaper) from the API's copy, whose masked secrets
    are taken from the environment (see `backend_from_parameter`).
    """
    context = FlowRunContext.get()
    if context is not None and context.flow_run is not None and context.flow_run.id == flow_run.id:
        return await backend_from_parameter((context.parameters or {}).get("backend"))
    return await backend_from_parameter(flow_run.parameters.get("backend"))


async def hook_backend(flow_run: FlowRun) -> SandboxBackend | None:
    """The backend whose sandboxes a hook cleans for ``flow_run`` (`run_backend`), or None,
    after an error log naming the flow run and what is missing, when it cannot be told: a
    hook never guesses (the default backend's sandboxes are not the run's)."""
    try:
        return await run_backend(flow_run)
    except ValueError as exc:
        logger.error(
            "Flow run %s (%s): its sandboxes are not killed: its 'backend' parameter gives no "
            "backend to clean (%s). Kill them by their label %s=%s",
            flow_run.name,
            flow_run.id,
            exc,
            FLOW_RUN_ID_LABEL,
            flow_run.id,
        )
        return None


async def kill_run_sandboxes(flow: Flow[Any, Any], flow_run: FlowRun, state: State) -> None:
    """Kill every sandbox labelled with this flow run's id (a cancellation or crash hook);
    none when its backend cannot be told (`hook_backend`, which logs an error)."""
    backend = await hook_backend(flow_run)
    if backend is not None:
        await kill_labelled_sandboxes(backend, str(flow_run.id), state.name or state.type.value)
