"""The guard process of a local kernel: kills the kernel's whole process group if we die.

ipykernel's parent poller ends the kernel when its parent dies, but not the kernel's own
children; this guard, in a session of its own, kills the whole group, and exits once the group
is gone. It also writes what the kernel's processes print (on its stdin, a pipe) to kernel.log,
up to a byte budget in all, and drops the rest, so that no cell can fill the host's disk there.
Run as ``python -I -S -c SOURCE JSON``; the JSON: ``{"parent": pid, "group": pgid, "log": path,
"log_bytes": n}``. Manual: docs/development.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import sys
from typing import BinaryIO

_READ_BYTES = 1 << 16
_POLL_S = 0.5
_FULL = b"\n[prefect-sandbox: kernel.log is full; the rest is not kept]\n"


class _Log:
    """kernel.log, written up to ``log_bytes`` in all (what it held already counts)."""

    def __init__(self, file: BinaryIO, log_bytes: int) -> None:
        self.file = file
        self.room = log_bytes - os.fstat(file.fileno()).st_size

    def keep(self, data: bytes) -> None:
        if self.room > 0:
            self.file.write(data[: self.room])
            if len(data) >= self.room:
                self.file.write(_FULL)
            self.file.flush()
        self.room -= len(data)


def main(args_json: str) -> None:
    """Watch the group and the parent until either is gone, logging stdin meanwhile."""
    args = json.loads(args_json)
    parent, group = int(args["parent"]), int(args["group"])
    log = _Log(open(args["log"], "ab"), int(args["log_bytes"]))  # noqa: SIM115
    reading = True
    while True:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            break
        if os.getppid() != parent:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)
            break
        if select.select([0] if reading else [], [], [], _POLL_S)[0]:
            data = os.read(0, _READ_BYTES)
            reading = bool(data)  # at the end, all writers gone: watch the group alone
            log.keep(data)
    os.set_blocking(0, False)
    try:
        while reading and (data := os.read(0, _READ_BYTES)):
            log.keep(data)
    except BlockingIOError:
        pass


if __name__ == "__main__":
    main(sys.argv[1])
