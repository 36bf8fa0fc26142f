"""Retrying transient failures: one policy, on tenacity, for every backend and for S3 storage.

A call is tried ``attempts`` times in all. Between tries we wait what the service asked for
(``Retry-After``, carried by `SandboxUnavailableError.retry_after_s`), or else ``first_delay_s``
doubling each time; never more than `MAX_RETRY_DELAY_S`. What is transient is the caller's
decision (``retry_if``): only calls that are safe to repeat retry more than a 429, and an
execute that may have reached the kernel is never replayed. Manual: docs/concepts.md.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from tenacity import (
    AsyncRetrying,
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
)
from tenacity.stop import stop_base

__all__ = ["MAX_RETRY_DELAY_S", "async_retrying", "retry_delay_s", "sync_retrying"]

MAX_RETRY_DELAY_S = 30.0
FIRST_RETRY_DELAY_S = 0.5

logger = logging.getLogger(__name__)


def retry_delay_s(
    error: BaseException | None, attempt: int, *, first_delay_s: float = FIRST_RETRY_DELAY_S
) -> float:
    """Seconds to wait after ``error`` ended the ``attempt``-th try (1-based).

    The ``retry_after_s`` the error carries wins; otherwise ``first_delay_s``, doubling each
    try. Either way at most `MAX_RETRY_DELAY_S`.
    """
    retry_after_s = getattr(error, "retry_after_s", None)
    if retry_after_s is not None:
        return float(min(retry_after_s, MAX_RETRY_DELAY_S))
    return float(min(first_delay_s * 2.0 ** (attempt - 1), MAX_RETRY_DELAY_S))


class _StopBeforeDeadline(stop_base):
    """Stop when the next wait would end past ``deadline`` (a `time.monotonic` time)."""

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline

    def __call__(self, retry_state: RetryCallState) -> bool:
        return time.monotonic() + retry_state.upcoming_sleep > self.deadline


def _policy(
    attempts: int,
    retry_if: Callable[[BaseException], bool],
    first_delay_s: float,
    what: str,
    deadline: float | None = None,
) -> dict[str, Any]:
    def wait(state: RetryCallState) -> float:
        error = state.outcome.exception() if state.outcome is not None else None
        return retry_delay_s(error, state.attempt_number, first_delay_s=first_delay_s)

    def log(state: RetryCallState) -> None:
        error = state.outcome.exception() if state.outcome is not None else None
        delay_s = state.next_action.sleep if state.next_action is not None else 0.0
        logger.info("%s failed (%s); trying again in %.1f s", what, error, delay_s)

    stop: stop_base = stop_after_attempt(attempts)
    if deadline is not None:
        stop = stop | _StopBeforeDeadline(deadline)
    return {
        "retry": retry_if_exception(retry_if),
        "stop": stop,
        "wait": wait,
        "before_sleep": log,
        "reraise": True,
    }


def async_retrying(
    *,
    attempts: int,
    retry_if: Callable[[BaseException], bool],
    first_delay_s: float = FIRST_RETRY_DELAY_S,
    what: str,
    deadline: float | None = None,
) -> AsyncRetrying:
    """A tenacity loop for an async call: ``async for attempt in ...: with attempt: ...``.

    Args:
        attempts: tries in all (1 for none again).
        retry_if: whether an exception is worth another try.
        first_delay_s: the first wait when the service names none.
        what: the call, for the log line each retry writes (``"Daytona upload"``).
        deadline: a `time.monotonic` time no wait may end past: a try that would need one
            is the last; None for no such bound.

    Returns:
        The loop; the last try's exception is raised as it is.
    """
    return AsyncRetrying(**_policy(attempts, retry_if, first_delay_s, what, deadline))


def sync_retrying(
    *,
    attempts: int,
    retry_if: Callable[[BaseException], bool],
    first_delay_s: float = FIRST_RETRY_DELAY_S,
    what: str,
) -> Retrying:
    """The same loop as `async_retrying`, for a blocking call: ``for attempt in ...:``."""
    return Retrying(**_policy(attempts, retry_if, first_delay_s, what))
