"""Kernel start-up code: a process forked by a cell sends the cell's outputs only, and stops.

A process forked by a cell (``os.fork``) is a copy of the kernel holding its sockets: it would
send the cell's busy/idle status and reply as if it were the kernel. It may send the cell's
outputs only, and it stops (no CPU, killed with the kernel) where its copy of the cell ends,
instead of carrying on as a second kernel that nothing can reach. Part of a local kernel's
startup file and of E2B's display hooks; run by `run_code` (``main``).
Manual: docs/development.md.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

from IPython import get_ipython

_OUTPUTS = frozenset({"stream", "display_data", "update_display_data", "clear_output", "error"})
_PR_SET_PDEATHSIG = 1  # prctl(2)


def main() -> None:
    """Hook the kernel's session and its ``post_run_cell`` event; a no-op outside ipykernel."""
    kernel_pid = os.getpid()
    shell: Any = get_ipython()
    session = getattr(getattr(shell, "kernel", None), "session", None)
    if session is None:
        return  # not ipykernel
    send = session.send

    def send_from_kernel(stream: Any, msg_or_type: Any, *args: Any, **kwargs: Any) -> Any:
        if os.getpid() != kernel_pid:
            msg_type = msg_or_type
            if not isinstance(msg_type, str):
                msg_type = msg_or_type["header"]["msg_type"]
            if msg_type not in _OUTPUTS:
                return None
        return send(stream, msg_or_type, *args, **kwargs)

    def stop_forked_child(result: object) -> None:
        if os.getpid() == kernel_pid:
            return
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        parent = os.getppid()
        try:
            import ctypes  # here, not at kernel start: forks are rare

            # Killed when its parent ends (PR_SET_PDEATHSIG): a restart, not only a kill.
            ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):
            pass
        if os.getppid() != parent:
            os._exit(1)
        os.kill(os.getpid(), signal.SIGSTOP)

    session.send = send_from_kernel
    shell.events.register("post_run_cell", stop_forked_child)
