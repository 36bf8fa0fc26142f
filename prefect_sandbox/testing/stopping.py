"""A base for the test servers that are context managers and stop when the block is left.

Manual: docs/development.md.
"""

from __future__ import annotations

import abc
from types import TracebackType


class StopsOnExit(abc.ABC):
    """A test server (process, cluster or thread) that a ``with`` block stops on leaving.

    Each subclass gives ``stop()`` and an ``__enter__`` that starts it or waits until it answers.
    """

    @abc.abstractmethod
    def stop(self) -> None:
        """Stop what this object started, leaving anything it did not start alone; idempotent."""

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
