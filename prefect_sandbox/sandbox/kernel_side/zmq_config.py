"""Kernel config code: ipykernel's sockets send without zmq's high-water mark.

ipykernel's iopub socket keeps zmq's default send high-water mark of 1,000 messages: when our
reader falls behind (a loaded machine, thousands of flushed writes) the kernel silently DROPS
output past it. ipykernel has no setting for it, but it loads its config file before it makes
its sockets, so the context it makes there sends without a limit instead. A local kernel's
``ipython_kernel_config.py``; run by `run_code` (``main``). Manual: docs/development.md.
"""

from __future__ import annotations

from typing import Any

import zmq


class _UnboundedSendContext(zmq.Context):  # type: ignore[type-arg]
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.setsockopt(zmq.SNDHWM, 0)


def main() -> None:
    """Make every zmq context made from now on send without a limit."""
    zmq.Context = _UnboundedSendContext  # type: ignore[misc]
