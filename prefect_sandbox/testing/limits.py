"""Rate limits and quotas the emulators enforce, as E2B and Daytona publish and answer them.

`Limits` is the option both emulators take: calls per period for any operation (an emulator's
``OPERATIONS`` name) and a quota of live sandboxes; `E2B_PRO` is E2B Pro's (5 creates a second,
100 live). Each vendor counts and answers in its own way, learnt from its server's code: E2B's
API (``infra``'s ratelimit middleware) with a GCRA per route (`Gcra`), a 429 with
``Retry-After`` in whole seconds, and its quota a 429 with no ``Retry-After``
(`E2B_QUOTA_MESSAGE`); Daytona's (NestJS's throttler) with a fixed window that then blocks a
whole period (`FixedWindow`), a 429 with ``Retry-After-<throttler>``, and its CPU quota a 400
(`DAYTONA_QUOTA_MESSAGE`). Manual: docs/how-to/cap.md ("The vendor's own limits").
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = [
    "DAYTONA_QUOTA_MESSAGE",
    "E2B_PRO",
    "E2B_QUOTA_MESSAGE",
    "FixedWindow",
    "Gcra",
    "Limiter",
    "Limits",
    "RateLimit",
    "RateLimits",
]

E2B_QUOTA_MESSAGE = (
    "you have reached the maximum number of concurrent E2B sandboxes ({quota}). If you need "
    "more, please visit 'https://e2b.dev/docs/billing'"
)
DAYTONA_QUOTA_MESSAGE = (
    "Total CPU limit exceeded. Maximum allowed: {quota}.\nTo increase concurrency limits, "
    "upgrade your organization's Tier by visiting https://app.daytona.io/dashboard/limits."
)


@dataclass(frozen=True)
class RateLimit:
    """``calls`` calls of one operation per ``period_s`` seconds, for the emulator's one API
    key (one E2B team, one Daytona organization).

    Raises:
        ValueError: ``calls`` is below 1 or ``period_s`` not positive.
    """

    calls: int
    period_s: float = 1.0

    def __post_init__(self) -> None:
        if self.calls < 1 or self.period_s <= 0:
            raise ValueError(f"a rate limit is 1 call or more per positive period, not {self}")


@dataclass(frozen=True)
class Limits:
    """What an emulator refuses as its vendor does past a rate or a quota; none by default.

    Attributes:
        rates: per operation (an emulator's ``OPERATIONS`` name), its rate limit.
        max_live_sandboxes: sandboxes alive at once; None for no quota.
    """

    rates: Mapping[str, RateLimit] = field(default_factory=dict)
    max_live_sandboxes: int | None = None


E2B_PRO = Limits(rates={"create": RateLimit(5, 1.0)}, max_live_sandboxes=100)
"""E2B's Pro tier as published: 5 sandbox creates a second, 100 sandboxes alive at once."""


class Limiter(ABC):
    """One operation's limiter: `take` counts a call, or says how long to wait."""

    def __init__(self, limit: RateLimit) -> None:
        self.limit = limit

    @abstractmethod
    def take(self, now: float) -> float | None:
        """Count a call at ``now`` (`time.monotonic`); None when it is allowed, else the
        seconds until one would be (the call is not counted)."""


class Gcra(Limiter):
    """E2B's limiter (``redis_rate``): a call every ``period_s / calls`` seconds, with a burst
    of ``calls``."""

    def __init__(self, limit: RateLimit) -> None:
        super().__init__(limit)
        self.interval_s = limit.period_s / limit.calls
        self.arrival = 0.0  # the theoretical arrival time of the next call

    def take(self, now: float) -> float | None:
        arrival = max(self.arrival, now) + self.interval_s
        allowed_at = arrival - self.limit.calls * self.interval_s
        if allowed_at - now > 1e-9:  # not a float's rounding
            return allowed_at - now
        self.arrival = arrival
        return None


class FixedWindow(Limiter):
    """Daytona's limiter (NestJS's throttler): ``calls`` calls a window of ``period_s``; the
    call past them blocks every call for ``period_s`` from then on."""

    def __init__(self, limit: RateLimit) -> None:
        super().__init__(limit)
        self.hits = 0
        self.window_ends = 0.0
        self.blocked_until = 0.0

    def take(self, now: float) -> float | None:
        if now < self.blocked_until:
            return self.blocked_until - now
        if now >= self.window_ends:
            self.window_ends, self.hits = now + self.limit.period_s, 0
        self.hits += 1
        if self.hits > self.limit.calls:
            self.blocked_until, self.hits = now + self.limit.period_s, 0
            return self.limit.period_s
        return None


class RateLimits:
    """An emulator's limiters, one per limited operation, and what they refused; safe to use
    from any thread.

    Args:
        limits: the emulator's limits.
        limiter: the vendor's kind of limiter (`Gcra` or `FixedWindow`).
    """

    def __init__(self, limits: Limits, limiter: type[Limiter]) -> None:
        self.limits = limits
        self._limiters = {name: limiter(rate) for name, rate in limits.rates.items()}
        self._lock = threading.Lock()
        self.refused: Counter[str] = Counter()
        """Calls refused per operation (rate limited, or past the quota)."""

    def wait_s(self, operation: str | None) -> float | None:
        """Count a call of ``operation``: None when it may be served, else the seconds the
        vendor's limiter says to wait (the refusal is counted)."""
        limiter = self._limiters.get(operation or "")
        if limiter is None:
            return None
        with self._lock:
            wait_s = limiter.take(time.monotonic())
            if wait_s is not None:
                self.refused[operation or ""] += 1
        return wait_s

    def over_quota(self, live: int) -> bool:
        """Whether a create with ``live`` sandboxes alive breaks the quota (it is counted)."""
        quota = self.limits.max_live_sandboxes
        if quota is None or live < quota:
            return False
        with self._lock:
            self.refused["create"] += 1
        return True
