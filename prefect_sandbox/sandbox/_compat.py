"""The private APIs of CPython that the core reaches, each here only (as `prefect_sandbox._compat`
holds Prefect's and prefect-aws's, a floor above: the core imports no Prefect).

- ``threading._register_atexit``: CPython's hook that runs before its threads are joined at
  exit (`concurrent.futures` uses it); plain `atexit` where it is missing.
- python-engineio's and python-socketio's module flags ``async_signal_handler_set`` and
  ``original_signal_handler``: set, they keep those clients (the Daytona SDK's event stream)
  from taking SIGINT over.

Manual: docs/development.md.
"""

from __future__ import annotations

import atexit
import importlib
import signal
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["keep_sigint_from_socketio", "register_before_threads_join"]


def register_before_threads_join(function: Callable[[], Any]) -> None:
    """Run ``function`` at this process's normal exit, before Python joins its threads (and
    its thread pools refuse work); at plain `atexit` time where CPython lacks that hook."""
    register = getattr(threading, "_register_atexit", atexit.register)
    register(function)


def keep_sigint_from_socketio() -> None:
    """Keep python-socketio's and python-engineio's clients (which the Daytona SDK opens for its
    event stream, with their default ``handle_sigint=True``) from taking SIGINT over.

    On its first connect in a process, engineio's async client puts a SIGINT handler on the
    running event loop that cancels every task of that loop and stops it, and keeps it there
    after the client closes; both base clients put a Python-level handler in place of the
    process's own. Ctrl-C would then stop the loop before a run kills its sandbox, and a later
    SIGINT meant for other code (our CLI's, ``asyncio.run``'s) cancels whatever runs on that
    loop. Each flag, once set, is read as "already handled" (engineio 4.x, socketio 5.x). A
    module that is not installed is skipped.
    """
    for name, flag, value in (
        ("engineio.async_client", "async_signal_handler_set", True),
        ("engineio.base_client", "original_signal_handler", signal.default_int_handler),
        ("socketio.base_client", "original_signal_handler", signal.default_int_handler),
    ):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if not getattr(module, flag, None):
            setattr(module, flag, value)
