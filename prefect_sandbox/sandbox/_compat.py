"""The private APIs of CPython that the core reaches, each here only (as `prefect_sandbox._compat`
holds Prefect's and prefect-aws's, a floor above: the core imports no Prefect).

- ``threading._register_atexit``: CPython's hook that runs before its threads are joined at
  exit (`concurrent.futures` uses it); plain `atexit` where it is missing.

Manual: docs/development.md.
"""

from __future__ import annotations

import atexit
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["register_before_threads_join"]


def register_before_threads_join(function: Callable[[], Any]) -> None:
    """Run ``function`` at this process's normal exit, before Python joins its threads (and
    its thread pools refuse work); at plain `atexit` time where CPython lacks that hook."""
    register = getattr(threading, "_register_atexit", atexit.register)
    register(function)
