"""Code that runs inside a kernel, local or remote: what host kernels and E2B's share.

Importing it imports nothing of a kernel's; each constant is source for IPython's namespace.
"""

__all__ = ["FORKED_CHILD_GUARD_CODE"]

FORKED_CHILD_GUARD_CODE = """
def _prefect_sandbox_quiet_forked_children():
    # A process forked by a cell (os.fork) is a copy of the kernel holding its sockets: it
    # would send the cell's busy/idle status and reply as if it were the kernel. It may send
    # the cell's outputs only, and it stops (no CPU, killed with the kernel) where its copy
    # of the cell ends, instead of carrying on as a second kernel that nothing can reach.
    import os
    import signal
    import sys

    kernel_pid = os.getpid()
    shell = get_ipython()
    session = getattr(getattr(shell, "kernel", None), "session", None)
    if session is None:
        return  # not ipykernel
    outputs = {"stream", "display_data", "update_display_data", "clear_output", "error"}
    send = session.send

    def send_from_kernel(stream, msg_or_type, *args, **kwargs):
        if os.getpid() != kernel_pid:
            msg_type = msg_or_type
            if not isinstance(msg_type, str):
                msg_type = msg_or_type["header"]["msg_type"]
            if msg_type not in outputs:
                return None
        return send(stream, msg_or_type, *args, **kwargs)

    def stop_forked_child(result):
        if os.getpid() == kernel_pid:
            return
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        parent = os.getppid()
        try:
            import ctypes

            # Killed when its parent ends (PR_SET_PDEATHSIG): a restart, not only a kill.
            ctypes.CDLL(None).prctl(1, signal.SIGKILL)
        except (OSError, AttributeError):
            pass
        if os.getppid() != parent:
            os._exit(1)
        os.kill(os.getpid(), signal.SIGSTOP)

    session.send = send_from_kernel
    shell.events.register("post_run_cell", stop_forked_child)


_prefect_sandbox_quiet_forked_children()
del _prefect_sandbox_quiet_forked_children
"""
"""Kernel start-up code (IPython's namespace): a process forked by a cell sends outputs
only, and stops where its copy of the cell ends, killed when its parent ends. Part of our
startup file; a backend that cannot place that file runs it in the kernel itself."""
