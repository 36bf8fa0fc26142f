"""Let a vendor SDK's native threads finish their calls into Python before the interpreter exits.

The E2B SDK (2.63) sends its traffic through pyqwest, whose tokio threads complete each call by
taking the GIL to wake the event loop, so a call the loop has seen end can still have its thread
about to take the GIL back. If it asks after the interpreter began finalizing, CPython (3.11 to
3.13) ends it with ``pthread_exit``, and the unwind through Rust frames aborts the process
(SIGABRT) after a run that succeeded (curioswitch/pyqwest#164, PyO3/pyo3#4874): 12 of 60 scripts
ending on an E2B call, beside two CPU-bound processes; with this wait none of 120, at 11 to 17
ms. `wait_for_quiet_threads_at_exit` registers an ``atexit`` handler (it runs before
finalization) that sleeps, GIL free, until no other thread of the process runs or waits for a
CPU. Manual: docs/backends/e2b.md.
"""

from __future__ import annotations

import atexit
import functools
import os
import threading
import time
from pathlib import Path

_TASKS = Path("/proc/self/task")
_BUSY_STATES = frozenset("RD")
"""Linux thread states of a thread that is running, runnable, or in an uninterruptible wait
(a write to a socket, a page fault); ``S`` is a thread blocked on a lock, a condition or I/O."""


def busy_threads() -> int:
    """Count the process's threads, other than the caller's, that are running or runnable.

    Returns:
        How many are in state ``R`` or ``D`` of ``/proc/self/task/*/stat`` (Linux; 0 elsewhere,
        where the states cannot be read). A thread that ends while being read is not counted.
    """
    if not _TASKS.is_dir():
        return 0
    mine = str(threading.get_native_id())
    busy = 0
    for task in os.listdir(_TASKS):
        if task == mine:
            continue
        try:
            stat = (_TASKS / task / "stat").read_text()
        except OSError:
            continue
        # The state follows the command name, which is in parentheses and may hold any byte.
        busy += stat[stat.rindex(")") + 2] in _BUSY_STATES
    return busy


def wait_for_quiet_threads(*, limit_s: float = 1.0, poll_s: float = 0.005) -> float:
    """Sleep until no other thread of the process is running or runnable, or ``limit_s`` passed.

    Quiet means two reads ``poll_s`` apart that find no busy thread (`busy_threads`); sleeping
    between them leaves the GIL free for a thread waiting to take it.

    Args:
        limit_s: the most seconds to wait; a process with a thread that never rests waits this.
        poll_s: seconds between two reads of the threads' states.

    Returns:
        The seconds waited.
    """
    started = time.monotonic()
    quiet_reads = 0
    while quiet_reads < 2 and time.monotonic() - started < limit_s:
        time.sleep(poll_s)
        quiet_reads = 0 if busy_threads() else quiet_reads + 1
    return time.monotonic() - started


@functools.cache
def wait_for_quiet_threads_at_exit() -> None:
    """Make the interpreter's exit wait (`wait_for_quiet_threads`) before it finalizes.

    Registers one ``atexit`` handler however often it is called. Handlers run last in, first
    out, so this one runs before those registered earlier (Prefect's among them).
    """
    atexit.register(wait_for_quiet_threads)
