"""`WarmPool`: sandboxes started ahead of time, each handed out once, refilled in the background.

A pool holds the handles of started, never-used sandboxes of one configuration. `WarmPool.take`
hands one out (it is then the taker's, never returned); `WarmPool.refill` starts sandboxes in
a background thread of its own, one at a time, until the pool is full again. Which sandboxes
are started, checked and ended is the backend's: the pool only calls the functions it was
given, so it knows nothing of kernels.

Pools live per process, found by key with `warm_pool` (one per configuration). `close_warm_pools`
ends them all; it runs at the exit of a process that made one, so a process that ends
normally leaves no idle sandbox behind. A forked child starts with no pool: its parent's
idle sandboxes stay its parent's. Manual: docs/backends/local.md.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable

from prefect_sandbox.sandbox._compat import register_before_threads_join
from prefect_sandbox.sandbox.base import SandboxHandle

__all__ = ["WarmPool", "close_warm_pools", "found_warm_pool", "warm_pool"]

_CLOSE_WAIT_S = 30.0
"""Seconds `close_warm_pools` waits for a sandbox being started to be started, to end it."""

logger = logging.getLogger(__name__)


class WarmPool:
    """Up to ``size`` started, never-used sandboxes of one configuration.

    Thread-safe: sandboxes are taken from any thread or event loop, and started in a daemon
    thread of the pool's.

    Args:
        size: how many idle sandboxes the pool keeps (at least 1).
        start: starts one sandbox and returns its handle; called in the pool's thread.
        destroy: ends a sandbox the pool will not hand out (idle at close, dead, surplus).
        alive: whether an idle sandbox can still be handed out.
    """

    def __init__(
        self,
        size: int,
        *,
        start: Callable[[], SandboxHandle],
        destroy: Callable[[SandboxHandle], object],
        alive: Callable[[SandboxHandle], bool],
    ) -> None:
        if size < 1:
            raise ValueError(f"a warm pool holds at least 1 sandbox, not {size}")
        self.size = size
        self._start = start
        self._destroy = destroy
        self._alive = alive
        self._idle: deque[SandboxHandle] = deque()
        self._changed = threading.Condition()
        self._filler: threading.Thread | None = None
        self._closed = False

    @property
    def idle(self) -> list[SandboxHandle]:
        """The handles of the sandboxes now waiting to be handed out, oldest first."""
        with self._changed:
            return list(self._idle)

    def take(self) -> SandboxHandle | None:
        """Hand out an idle sandbox, which from now on is the caller's; None if none is ready.

        Idle sandboxes that died meanwhile are ended and skipped. Does not refill: call
        `refill` once the caller's own start-up work is done.
        """
        while True:
            with self._changed:
                if not self._idle:
                    return None
                handle = self._idle.popleft()
            if self._alive(handle):
                return handle
            logger.warning("Warm pool: idle sandbox %s had died; ended it", handle.sandbox_id)
            self._destroy(handle)

    def refill(self) -> None:
        """Start sandboxes in the background until ``size`` are idle; no-op if already doing so.

        A sandbox that fails to start stops the refill (logged as a warning): the next
        `refill` tries again, and a caller starting one itself sees the error.
        """
        with self._changed:
            if self._closed or self._filler is not None or len(self._idle) >= self.size:
                return
            self._filler = threading.Thread(
                target=self._fill, name="prefect-sandbox-warm-pool", daemon=True
            )
            self._filler.start()

    def wait_full(self, timeout_s: float) -> bool:
        """Wait until ``size`` sandboxes are idle, or the refill stopped short.

        Args:
            timeout_s: the longest wait, in seconds.

        Returns:
            True if the pool is full.
        """
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while len(self._idle) < self.size and self._filler is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._changed.wait(left)
            return len(self._idle) >= self.size

    def close(self, timeout_s: float = _CLOSE_WAIT_S) -> int:
        """End the idle sandboxes and stop refilling; a sandbox being started is ended too.

        Args:
            timeout_s: seconds to wait for a sandbox being started (it is ended once started).

        Returns:
            How many idle sandboxes this call ended.
        """
        with self._changed:
            self._closed = True
            idle = list(self._idle)
            self._idle.clear()
            filler = self._filler
        for handle in idle:
            self._destroy(handle)
        if filler is not None and filler is not threading.current_thread():
            filler.join(timeout_s)
        return len(idle)

    def _fill(self) -> None:
        """The pool's thread: start sandboxes one at a time until the pool is full or closed."""
        try:
            while True:
                with self._changed:
                    if self._closed or len(self._idle) >= self.size:
                        return
                try:
                    handle = self._start()
                except Exception:
                    logger.warning("Warm pool: a sandbox failed to start", exc_info=True)
                    return
                with self._changed:
                    kept = not self._closed
                    if kept:
                        self._idle.append(handle)
                        self._changed.notify_all()
                if not kept:
                    self._destroy(handle)
        finally:
            with self._changed:
                self._filler = None
                self._changed.notify_all()


_pools: dict[Hashable, WarmPool] = {}
_pools_lock = threading.Lock()


@functools.cache
def _close_at_exit() -> None:
    """Run `close_warm_pools` at this process's normal exit (registered once)."""
    # Before Python joins its threads at exit, as concurrent.futures does: plain atexit runs
    # after the executors that start kernels (and asyncio.to_thread) refuse work, so a kernel
    # being started then could not be ended. atexit where Python lacks that hook.
    register_before_threads_join(close_warm_pools)


def warm_pool(key: Hashable, make: Callable[[], WarmPool]) -> tuple[WarmPool, bool]:
    """This process's pool for ``key``, made by ``make`` if there is none yet.

    Args:
        key: everything that makes one pool's sandboxes differ from another's.
        make: builds the pool (not started: `WarmPool.refill` starts it).

    Returns:
        The pool, and whether this call made it.
    """
    with _pools_lock:
        pool = _pools.get(key)
        if pool is not None:
            return pool, False
        _close_at_exit()
        pool = _pools[key] = make()
        return pool, True


def found_warm_pool(key: Hashable) -> WarmPool | None:
    """This process's pool for ``key``; None if none was made (see `warm_pool`)."""
    with _pools_lock:
        return _pools.get(key)


def _forget_pools_in_child() -> None:
    # After fork() the parent's pools (and maybe their held lock) are copied but not its
    # threads; handing out or ending the parent's sandboxes from here would break the parent.
    global _pools_lock
    _pools.clear()
    _pools_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_pools_in_child)


def close_warm_pools(timeout_s: float = _CLOSE_WAIT_S) -> int:
    """End every pool of this process and its idle sandboxes (see `WarmPool.close`).

    Runs at this process's normal exit, before its threads are joined. A later `warm_pool`
    call makes a new pool.

    Args:
        timeout_s: seconds to wait, per pool, for a sandbox being started.

    Returns:
        How many idle sandboxes were ended.
    """
    with _pools_lock:
        pools = list(_pools.values())
        _pools.clear()
    return sum(pool.close(timeout_s) for pool in pools)
