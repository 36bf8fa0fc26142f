"""The reaper: `areap_sandboxes` / `reap_sandboxes` kill sandboxes whose flow run is over.

It is the net under a flow's own ``finally`` and its cancellation and crash hooks, which do not
run when the flow's process is SIGKILLed. It kills a sandbox carrying our marker and a
flow-run-id label (`prefect_sandbox.sandbox.labels`) when its run is final; missing from the API
it was made through (`API_LABEL`: another API's run is only elsewhere); Running but silent (its
last heartbeat event older than ``heartbeat_timeout_s``, and than `HEARTBEAT_PERIODS` of its own
period: a SIGKILLed run stays Running, but its heartbeats stop); or older than ``max_age_s`` by
its `CREATED_AT_LABEL`. Pooled kernels (no run id) are left to their pool. It also removes this
machine's staging folders whose owner is gone, and a sweep's own concurrency limit whose sweep
is final or gone; a backend cap's slot it cannot free (the API does not say who holds it).
Manual: docs/how-to/reaper.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import get_args
from uuid import UUID

from prefect import flow, get_run_logger
from prefect.artifacts import acreate_table_artifact
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
from prefect.client.schemas.objects import FlowRun
from prefect.events.filters import (
    EventFilter,
    EventNameFilter,
    EventOccurredFilter,
    EventResourceFilter,
)
from prefect.exceptions import ObjectNotFound
from prefect.logging import get_logger
from pydantic import BaseModel

from prefect_sandbox._compat import block_document_name
from prefect_sandbox.blocks import BackendBlock
from prefect_sandbox.blocks.base import SandboxBackend
from prefect_sandbox.blocks.local import LocalKernelBackend
from prefect_sandbox.flows.errors import ReapFailedError
from prefect_sandbox.flows.limits import SWEEP_LIMIT_PREFIX
from prefect_sandbox.flows.staging import orphaned_staging_dirs, remove_orphaned_staging_dirs
from prefect_sandbox.flows.stopping import sync_twin
from prefect_sandbox.sandbox.base import SandboxHandle
from prefect_sandbox.sandbox.errors import SandboxError, SandboxNotFoundError
from prefect_sandbox.sandbox.labels import API_LABEL, FLOW_RUN_ID_LABEL, MARKER_LABEL, created_at
from prefect_sandbox.tasks.sandbox import prefect_api_id

__all__ = [
    "DEFAULT_HEARTBEAT_TIMEOUT_S",
    "DEFAULT_MAX_AGE_S",
    "HEARTBEAT_PERIODS",
    "REAPED_ARTIFACT_KEY",
    "Heartbeats",
    "ReapedSandbox",
    "areap_sandboxes",
    "last_heartbeats",
    "reap_reason",
    "reap_sandboxes",
    "reap_sweep_limits",
    "saved_backends",
]

logger = get_logger(__name__)

REAPED_ARTIFACT_KEY = "reaped-sandboxes"
DEFAULT_MAX_AGE_S = 24 * 3600.0
"""A day: longer than a notebook run is expected to last, shorter than a leak is tolerable."""

DEFAULT_HEARTBEAT_TIMEOUT_S = 600.0
"""Past three heartbeats at Prefect's default period (180 s)."""
HEARTBEAT_EVENT = "prefect.flow-run.heartbeat"
HEARTBEAT_PERIODS = 3
"""Heartbeat periods a Running flow run must miss, at least, to count as dead."""

_FLOW_RUNS_PER_QUERY = 100
_LIMITS_PER_QUERY = 200
"""Prefect's server caps a page of global concurrency limits at ``PREFECT_API_DEFAULT_LIMIT``
(200 by default)."""


class ReapedSandbox(BaseModel):
    """A sandbox the reaper killed, would kill (dry run), or could not sweep.

    Attributes:
        backend: the backend's slug (``"local"``, ``"e2b"``, ...); for a backend that could
            not be listed, its block (``"e2b-sandbox/my-block"``).
        sandbox_id: the backend's id for the sandbox; empty when listing the backend failed.
        flow_run_id: the flow run its label names; empty when listing failed.
        flow_run_state: the run's state name (``"Crashed"``, ``"Running"``); None when no such
            flow run exists.
        why: why it is reaped: ``"flow run Completed"``, ``"no such flow run"``,
            ``"no heartbeat for 700 s"``, ``"older than 86400 s"``; or ``"listing failed"``.
        age_s: seconds since the sandbox was made; None when it carries no creation time.
        killed: True if this sweep ended it.
        error: why killing it (or listing the backend) failed; None if it did not.
    """

    backend: str
    sandbox_id: str
    flow_run_id: str
    flow_run_state: str | None
    why: str
    age_s: float | None
    killed: bool
    error: str | None = None


def reap_reason(
    flow_run: FlowRun | None,
    age_s: float | None,
    max_age_s: float | None,
    *,
    same_api: bool = True,
    heartbeat_age_s: float | None = None,
    heartbeat_period_s: float | None = None,
    heartbeat_timeout_s: float | None = None,
) -> str | None:
    """Why a labelled sandbox should be killed, or None to leave it.

    Args:
        flow_run: the flow run its label names, as the API has it; None when there is none.
        age_s: the sandbox's age in seconds; None when unknown.
        same_api: whether the sandbox was made through the API that was asked; when not, a
            missing run says nothing (it lives in the other API).
        max_age_s: the age past which it is killed whatever its run's state; None for none.
        heartbeat_age_s: seconds since the run's last heartbeat; None when it sent none.
        heartbeat_period_s: seconds between its last two heartbeats, when known: the run
            counts as dead only past `HEARTBEAT_PERIODS` of them too, whatever the timeout
            (its process may beat slower than the timeout assumes).
        heartbeat_timeout_s: the heartbeat age past which a Running run counts as dead;
            None to not judge by heartbeats.

    Returns:
        A short reason (``"flow run Crashed"``, ``"no such flow run"``,
        ``"no heartbeat for 700 s"``, ``"older than 3600 s"``), or None.
    """
    if flow_run is None and same_api:
        return "no such flow run"
    state = None if flow_run is None else flow_run.state
    if state is not None and state.is_final():
        return f"flow run {state.name}"
    silent_s = None
    if heartbeat_timeout_s is not None and heartbeat_age_s is not None:
        silent_s = max(heartbeat_timeout_s, HEARTBEAT_PERIODS * (heartbeat_period_s or 0.0))
    if (
        state is not None
        and state.is_running()
        and silent_s is not None
        and heartbeat_age_s is not None
        and heartbeat_age_s > silent_s
    ):
        return f"no heartbeat for {heartbeat_age_s:.0f} s"
    if max_age_s is not None and age_s is not None and age_s > max_age_s:
        return f"older than {max_age_s:g} s"
    return None


async def saved_backends() -> list[SandboxBackend]:
    """The backends the reaper sweeps by default: a local kernel backend (this machine's
    local sandboxes), then every saved block of each backend type, in block-type order.

    Block types not registered with the API are skipped, and so (with a warning) are saved
    blocks that no longer load.

    Returns:
        The backend blocks.
    """
    backends: list[SandboxBackend] = [LocalKernelBackend()]
    async with get_client() as client:
        for block_class in get_args(BackendBlock):
            try:
                documents = await client.read_block_documents_by_type(
                    block_class.get_block_type_slug(), include_secrets=False
                )
            except ObjectNotFound:
                continue
            for document in documents:
                if document.name is None or document.is_anonymous:
                    continue
                try:
                    backends.append(await block_class.aload(document.name))
                except ValueError as exc:  # its fields no longer fit the block's class
                    logger.warning("Skipped saved backend %r: %s", document.name, exc)
    return backends


async def _flow_runs(flow_run_ids: Iterable[str]) -> dict[str, FlowRun]:
    """The flow runs the API has among ``flow_run_ids``, by id; ids that are not UUIDs name
    no flow run."""
    wanted: list[UUID] = []
    for value in set(flow_run_ids):
        try:
            wanted.append(UUID(value))
        except ValueError:
            continue
    found: dict[str, FlowRun] = {}
    async with get_client() as client:
        for start in range(0, len(wanted), _FLOW_RUNS_PER_QUERY):
            chunk = wanted[start : start + _FLOW_RUNS_PER_QUERY]
            runs = await client.read_flow_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=chunk)), limit=len(chunk)
            )
            found.update({str(run.id): run for run in runs})
    return found


async def _sweep_limits() -> dict[str, UUID]:
    """The sweeps' own global concurrency limits the API has, by name, with the sweep's flow
    run id each names (names under `SWEEP_LIMIT_PREFIX` that end in no UUID are left out)."""
    found: dict[str, UUID] = {}
    async with get_client() as client:
        offset = 0
        while page := await client.read_global_concurrency_limits(
            limit=_LIMITS_PER_QUERY, offset=offset
        ):
            offset += len(page)
            for limit in page:
                if not limit.name.startswith(SWEEP_LIMIT_PREFIX):
                    continue
                try:
                    found[limit.name] = UUID(limit.name.removeprefix(SWEEP_LIMIT_PREFIX))
                except ValueError:
                    continue
    return found


async def reap_sweep_limits(dry_run: bool = False) -> list[str]:
    """Delete the sweeps' own limits whose sweep is over: its flow run is in a final state or
    no longer exists (`reap_reason` without age or heartbeats), logging each.

    Args:
        dry_run: log what would be deleted, and delete nothing.

    Returns:
        The names of the limits deleted (or that would be); one the sweep deleted meanwhile
        counts too.

    Raises:
        prefect.exceptions.PrefectHTTPStatusError: the API refused a read or a deletion.
    """
    log = get_run_logger()
    limits = await _sweep_limits()
    runs = await _flow_runs(str(sweep) for sweep in limits.values())
    reaped = []
    async with get_client() as client:
        for name, sweep in limits.items():
            why = reap_reason(runs.get(str(sweep)), None, None)
            if why is None:
                continue
            reaped.append(name)
            if dry_run:
                log.info("Would delete concurrency limit %s (%s)", name, why)
                continue
            with contextlib.suppress(ObjectNotFound):  # the sweep's own exit got there first
                await client.delete_global_concurrency_limit_by_name(name)
            log.info("Deleted concurrency limit %s of sweep %s (%s)", name, sweep, why)
    return reaped


@dataclass(frozen=True)
class Heartbeats:
    """What the API has of a flow run's heartbeats.

    Attributes:
        last: when the last one occurred (UTC).
        period_s: seconds between the last two; None when there was only one.
    """

    last: datetime
    period_s: float | None


async def last_heartbeats(flow_runs: Iterable[FlowRun]) -> dict[str, Heartbeats]:
    """Each flow run's last two ``prefect.flow-run.heartbeat`` events since it started, as the
    API stores them.

    Args:
        flow_runs: the runs to ask about.

    Returns:
        Flow run id to its `Heartbeats`; runs with none are left out.
    """
    found: dict[str, Heartbeats] = {}
    async with get_client() as client:
        for run in flow_runs:
            since = run.start_time or run.created
            occurred = EventOccurredFilter() if since is None else EventOccurredFilter(since=since)
            page = await client.read_events(
                EventFilter(
                    occurred=occurred,
                    event=EventNameFilter(name=[HEARTBEAT_EVENT]),
                    resource=EventResourceFilter(id=[f"prefect.flow-run.{run.id}"]),
                ),
                limit=2,
            )
            times = [event.occurred for event in page.events]  # newest first
            if times:
                period_s = (times[0] - times[1]).total_seconds() if len(times) > 1 else None
                found[str(run.id)] = Heartbeats(last=times[0], period_s=period_s)
    return found


async def _labelled_sandboxes(
    backends: list[SandboxBackend], labels: dict[str, str]
) -> tuple[list[tuple[SandboxBackend, SandboxHandle]], list[ReapedSandbox]]:
    """The sandboxes of ``backends`` that carry ``labels`` and a flow-run-id label, each once.

    Returns:
        Each sandbox with the backend that listed it; and a `ReapedSandbox` with the error for
        each backend that could not be listed (logged as a warning).
    """
    found: dict[tuple[str, str], tuple[SandboxBackend, SandboxHandle]] = {}
    failed: list[ReapedSandbox] = []
    for backend in backends:
        try:
            handles = await backend.list_sandboxes(labels)
        except SandboxError as exc:
            name = _block_name(backend)
            get_run_logger().warning("Could not list the sandboxes of %s: %s", name, exc)
            failed.append(
                ReapedSandbox(
                    backend=name,
                    sandbox_id="",
                    flow_run_id="",
                    flow_run_state=None,
                    why="listing failed",
                    age_s=None,
                    killed=False,
                    error=str(exc),
                )
            )
            continue
        for handle in handles:
            if FLOW_RUN_ID_LABEL in handle.labels:
                found.setdefault((handle.backend, handle.sandbox_id), (backend, handle))
    return list(found.values()), failed


async def _kill(backend: SandboxBackend, handle: SandboxHandle) -> bool:
    """Kill one sandbox; False when it was already gone (its run's own clean-up may have
    just killed it).

    Raises:
        SandboxError: the backend could not reach or end it.
    """
    try:
        sandbox = await backend.attach(handle)
    except SandboxNotFoundError:
        return False
    return await sandbox.kill()


def _block_name(backend: SandboxBackend) -> str:
    """A backend block as people know it: its type's slug, and its name when saved."""
    slug = backend.get_block_type_slug()
    name = block_document_name(backend)
    return slug if name is None else f"{slug}/{name}"


def _table(reaped: list[ReapedSandbox], dry_run: bool) -> list[dict[str, str]]:
    """The rows of the ``reaped-sandboxes`` artifact."""
    rows = []
    for entry in reaped:
        if entry.error is not None:
            result = f"error: {entry.error}"
        elif dry_run:
            result = "would kill"
        else:
            result = "killed" if entry.killed else "already gone"
        rows.append(
            {
                "backend": entry.backend,
                "sandbox": entry.sandbox_id,
                "flow run": entry.flow_run_id,
                "state": entry.flow_run_state or "missing",
                "why": entry.why,
                "age (s)": "unknown" if entry.age_s is None else f"{entry.age_s:.0f}",
                "result": result,
            }
        )
    return rows


@flow(name="reap-sandboxes")
async def areap_sandboxes(
    backends: list[BackendBlock] | None = None,
    max_age_s: float | None = DEFAULT_MAX_AGE_S,
    heartbeat_timeout_s: float | None = DEFAULT_HEARTBEAT_TIMEOUT_S,
    dry_run: bool = False,
    labels: dict[str, str] | None = None,
) -> list[ReapedSandbox]:
    """Kill sandboxes whose flow run is over, gone or silent, or that are too old (see the
    module's docstring).

    Only sandboxes carrying both the prefect-sandbox marker and a flow-run-id label are
    considered: pooled kernels and sandboxes made outside a flow are left alone. Each is killed
    on its own; one that cannot be killed is logged and the others still are. A table artifact
    (key ``reaped-sandboxes``) lists what was killed, or would be on a dry run.

    It also removes orphaned staging folders and deletes the concurrency limits of sweeps
    that are over (`reap_sweep_limits`), logging each.

    Sandboxes made through another Prefect API are judged by age alone. To keep two APIs that
    share a vendor account apart, give each one's blocks labels of their own (E2B's metadata,
    Daytona's labels) and pass them here.

    Args:
        backends: Backend blocks whose sandboxes to sweep; when empty, a local kernel backend
            (this machine's local sandboxes) and every saved block of each backend type.
        max_age_s: Seconds after which a sandbox is killed even if its flow run still looks
            alive (a run whose process was SIGKILLed stays Running); empty for no limit.
        heartbeat_timeout_s: Seconds without a heartbeat after which a Running flow run counts
            as dead (its process was killed or its machine lost); at least 3 heartbeat
            periods (PREFECT_FLOWS_HEARTBEAT_FREQUENCY of the flows' processes). Runs with no
            heartbeat on record are not judged by it. Empty to not judge by heartbeats.
        dry_run: List what would be killed (or removed, deleted), and change nothing.
        labels: Further labels a sandbox must carry to be swept, e.g. {"team": "ml"}.

    Returns:
        One `ReapedSandbox` per sandbox killed (or that would be), and one per backend that
        could not be listed.

    Raises:
        ValueError: ``max_age_s`` or ``heartbeat_timeout_s`` is zero, negative, NaN or
            infinite.
        ReapFailedError: a backend could not be listed or a sandbox killed; the others were
            swept and the artifact written first.
    """
    for name, value in (("max_age_s", max_age_s), ("heartbeat_timeout_s", heartbeat_timeout_s)):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a positive number of seconds; got {value:g}")
    log = get_run_logger()
    if dry_run:
        for path in await asyncio.to_thread(orphaned_staging_dirs):
            log.info("Would remove staging folder %s (its process is gone)", path)
    else:
        for path in await asyncio.to_thread(remove_orphaned_staging_dirs):
            log.info("Removed staging folder %s (its process is gone)", path)
    await reap_sweep_limits(dry_run)
    swept: list[SandboxBackend] = list(backends) if backends else await saved_backends()
    found, reaped = await _labelled_sandboxes(swept, {**(labels or {}), MARKER_LABEL: "true"})
    runs = await _flow_runs(handle.labels[FLOW_RUN_ID_LABEL] for _, handle in found)
    running = [run for run in runs.values() if run.state is not None and run.state.is_running()]
    heartbeats = await last_heartbeats(running) if heartbeat_timeout_s is not None else {}
    this_api = prefect_api_id()
    now = datetime.now(UTC)
    for backend, handle in found:
        flow_run_id = handle.labels[FLOW_RUN_ID_LABEL]
        flow_run = runs.get(flow_run_id)
        made = created_at(handle.labels)
        age_s = None if made is None else (now - made).total_seconds()
        beats = heartbeats.get(flow_run_id)
        why = reap_reason(
            flow_run,
            age_s,
            max_age_s,
            same_api=handle.labels.get(API_LABEL) == this_api,
            heartbeat_age_s=None if beats is None else (now - beats.last).total_seconds(),
            heartbeat_period_s=None if beats is None else beats.period_s,
            heartbeat_timeout_s=heartbeat_timeout_s,
        )
        if why is None:
            continue
        entry = ReapedSandbox(
            backend=handle.backend,
            sandbox_id=handle.sandbox_id,
            flow_run_id=flow_run_id,
            flow_run_state=flow_run.state.name if flow_run and flow_run.state else None,
            why=why,
            age_s=age_s,
            killed=False,
        )
        reaped.append(entry)
        if dry_run:
            log.info("Would kill sandbox %s (%s)", handle.sandbox_id, why)
            continue
        try:
            entry.killed = await _kill(backend, handle)
        except SandboxError as exc:
            entry.error = str(exc)
            log.warning("Could not kill sandbox %s (%s): %s", handle.sandbox_id, why, exc)
            continue
        log.info("Killed sandbox %s of flow run %s (%s)", handle.sandbox_id, flow_run_id, why)
    verb = "Would kill" if dry_run else "Killed"
    count = sum(1 for entry in reaped if entry.error is None and (dry_run or entry.killed))
    await acreate_table_artifact(
        key=REAPED_ARTIFACT_KEY,
        table=_table(reaped, dry_run),
        description=f"{verb} {count} sandbox(es) of {len(found)} labelled with a flow run",
    )
    failed = [e.sandbox_id or f"listing {e.backend}" for e in reaped if e.error is not None]
    if failed:
        raise ReapFailedError(f"could not sweep: {', '.join(failed)}", failed=failed)
    return reaped


reap_sandboxes = sync_twin(areap_sandboxes)
