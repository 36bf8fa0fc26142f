"""The cancel scopes a run's clean-up needs, for the tasks and the flows above them.

Prefect enforces a flow's or task's ``timeout_seconds`` with an anyio cancel scope, which cancels
every await inside it (not once, as `asyncio.Task.cancel` does) until the scope is left: clean-up
that must finish runs `shielded`, and `deadline_passed` is the one answer to "is this run being
stopped by its ``timeout_seconds``?" (`prefect_sandbox.flows.stopping` names the other ways).
Manual: docs/concepts.md.
"""

from __future__ import annotations

from datetime import UTC, datetime

import anyio
from prefect.context import FlowRunContext

__all__ = ["deadline_passed", "shielded"]


def deadline_passed() -> bool:
    """Whether the caller is being stopped by a deadline: an enclosing cancel scope's deadline
    passed (or it was cancelled), or the current flow run's ``timeout_seconds`` has passed. A
    sync flow's timeout is raised in its own thread (by a signal, or an exception Prefect sets
    there), which an event loop of its own (a sync session's) sees as a plain cancellation,
    with no deadline of its own. Call it where a cancellation was caught, outside any shielded
    scope.
    """
    if anyio.current_effective_deadline() <= anyio.current_time():
        return True
    context = FlowRunContext.get()
    if context is None or context.flow is None or context.flow.timeout_seconds is None:
        return False
    elapsed = datetime.now(UTC) - context.start_time
    return elapsed.total_seconds() >= context.flow.timeout_seconds


def shielded() -> anyio.CancelScope:
    """A scope whose awaits a passed deadline (`deadline_passed`) does not cancel, for clean-up
    that must finish: killing the sandbox, storing what was made. An `asyncio.Task.cancel`
    (the CLI's on SIGINT) still reaches them."""
    return anyio.CancelScope(shield=True)
