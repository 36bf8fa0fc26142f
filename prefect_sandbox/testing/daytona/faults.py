"""Faults the Daytona emulator injects on demand, and the book that holds them."""

from __future__ import annotations

import threading
from dataclasses import dataclass

__all__ = ["OPERATIONS", "Fault", "FaultBook"]

OPERATIONS = frozenset(
    {
        # control plane
        "create",
        "list",
        "get",
        "delete",
        "start",
        "stop",
        "refresh_activity",
        # toolbox
        "work_dir",
        "home_dir",
        "create_folder",
        "exec",
        "create_context",
        "list_contexts",
        "delete_context",
        "run_code",
        "upload",
        "download",
    }
)
"""The calls a fault can hit: our names of the emulated endpoints."""


@dataclass
class Fault:
    """A failure for the next calls of one operation.

    Attributes:
        operation: the call it hits (one of `OPERATIONS`).
        status: answer with this HTTP status (429, 500, 502, 503, 504, ...) instead of serving
            the call; for ``run_code`` the WebSocket upgrade is refused with it.
        retry_after_s: with ``status``, the value of the ``Retry-After`` header.
        after_call: with ``status``, serve the call first, then answer with the status
            (a 504 for a sandbox that was in fact created).
        delay_s: seconds to wait before serving the call (a slow API).
        close_code: for ``run_code``: take the request, then close the WebSocket with this
            code without running it (4008 is the daemon's execution timeout).
        drop: serve the call (``run_code``: start the code), then drop the connection without
            an answer (a connection reset after the request was sent).
        times: how many calls it hits.
    """

    operation: str
    status: int | None = None
    retry_after_s: float | None = None
    after_call: bool = False
    delay_s: float = 0.0
    close_code: int | None = None
    drop: bool = False
    times: int = 1

    def __post_init__(self) -> None:
        if self.operation not in OPERATIONS:
            raise ValueError(f"unknown operation {self.operation!r}; one of {sorted(OPERATIONS)}")
        if self.times < 1:
            raise ValueError(f"times must be at least 1, not {self.times}")
        if self.close_code is not None and self.operation != "run_code":
            raise ValueError("close_code only applies to run_code")


class FaultBook:
    """Faults waiting to hit; safe to fill from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._faults: list[Fault] = []
        self.hits: list[str] = []
        """Operations a fault hit, in order."""

    def add(self, fault: Fault) -> None:
        """Queue a fault; faults of one operation hit in the order they were added."""
        with self._lock:
            self._faults.append(fault)

    def clear(self) -> None:
        """Drop every waiting fault."""
        with self._lock:
            self._faults.clear()

    def take(self, operation: str) -> Fault | None:
        """The fault hitting this call of ``operation``, if any (used up one time)."""
        with self._lock:
            for fault in self._faults:
                if fault.operation == operation:
                    fault.times -= 1
                    if fault.times == 0:
                        self._faults.remove(fault)
                    self.hits.append(operation)
                    return fault
        return None
