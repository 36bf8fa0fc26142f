"""A host uid of its own for each live local sandbox, when the flow runs as root.

The Linux kernel counts some resources per uid, for all processes of that uid together:
inotify instances (``fs.inotify.max_user_instances``, 128 by default), processes
(``RLIMIT_NPROC``), pipe pages, message-queue bytes. Sandboxes sharing one uid share those: one
could take them all and starve the others. So each sandbox takes a uid of a range (its group
is the same number) that no live sandbox holds. Claims are files named by the uid in
`CLAIMS_FOLDER`, machine-wide whatever ``TMPDIR`` says, made under a lock; a claim is released
at kill, after every process of the uid is killed. A claim whose sandbox's runtime folder is
gone (its process crashed unkilled) and whose uid runs nothing is taken over. The manual:
docs/isolation.md ("A uid per sandbox").
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

from prefect_sandbox.sandbox.errors import SandboxUnavailableError

__all__ = [
    "CLAIMS_FOLDER",
    "DEFAULT_UID_RANGE",
    "claim_uid",
    "claimed_uids",
    "parse_uid_range",
    "release_uid",
    "uid_processes",
]

DEFAULT_UID_RANGE = (0x7000_0000, 0x7000_FFFF)
"""65,536 uids from 1879048192 (0x70000000): past those that useradd (below 60000),
/etc/subuid's defaults (100000 onward, 65536 a user) and systemd-nspawn's containers (up to
0x6FFFFFFF) hand out, and below 2**31, where programs that take a uid for a signed int fail."""
CLAIMS_FOLDER = Path("/run/prefect-sandbox/uids")
_REAP_WAIT_S = 5.0


def parse_uid_range(text: str) -> tuple[int, int]:
    """``"FIRST-LAST"`` (inclusive) as ``(first, last)``.

    Raises:
        ValueError: not two numbers, first above last, 0 (root) in it, or past 2**32 - 2.
    """
    first_text, dash, last_text = text.strip().partition("-")
    try:
        first, last = int(first_text), int(last_text)
    except ValueError:
        raise ValueError(f"a uid range is FIRST-LAST, e.g. 1048576-1114111, not {text!r}") from None
    if not dash or not 0 < first <= last < 2**32 - 1:
        raise ValueError(f"a uid range is FIRST-LAST with 0 < FIRST <= LAST < 2**32-1: {text!r}")
    return first, last


def _process_uids() -> dict[int, int]:
    """This machine's live processes: pid to effective uid (the owner of ``/proc/PID``).

    Zombies are left out: they hold nothing of their uid's but a process slot until their
    parent reaps them, which for a sandbox's bwrap is this host's init, in its own time
    (1.5 s measured here).
    """
    uids = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            with contextlib.suppress(OSError):
                owner = os.stat(f"/proc/{name}").st_uid
                with open(f"/proc/{name}/stat", "rb") as stat:
                    if stat.read().rpartition(b")")[2].split()[0] != b"Z":
                        uids[int(name)] = owner
    return uids


def uid_processes(uid: int) -> list[int]:
    """Pids of this machine's processes whose effective uid is ``uid``."""
    return [pid for pid, owner in _process_uids().items() if owner == uid]


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    """The claims folder (root's alone), locked against other processes' claims."""
    CLAIMS_FOLDER.mkdir(mode=0o700, parents=True, exist_ok=True)
    with open(CLAIMS_FOLDER / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def claimed_uids() -> dict[int, str]:
    """The uids claimed now, each with the runtime folder of the sandbox that holds it."""
    claims = {}
    with contextlib.suppress(FileNotFoundError):
        for path in CLAIMS_FOLDER.iterdir():
            if path.name.isdigit():
                with contextlib.suppress(OSError, ValueError):
                    claims[int(path.name)] = json.loads(path.read_text())["runtime_dir"]
    return claims


def claim_uid(uid_range: tuple[int, int], sandbox_id: str, runtime_dir: Path) -> int:
    """Take a uid of ``uid_range`` that no live sandbox holds and no process runs as.

    Args:
        uid_range: the first and last uid that may be taken.
        sandbox_id: the sandbox that takes it (written in the claim).
        runtime_dir: the sandbox's runtime folder: while it exists, the claim holds.

    Returns:
        The uid, which is also its group's id.

    Raises:
        SandboxUnavailableError: every uid of the range is held by a live sandbox or runs a
            process; the message names the range and PREFECT_SANDBOX_UID_RANGE.
    """
    first, last = uid_range
    claim = json.dumps({"sandbox_id": sandbox_id, "runtime_dir": str(runtime_dir)})
    with _locked():
        claims = claimed_uids()
        stale = {uid for uid, folder in claims.items() if not Path(folder).exists()}
        running = set(_process_uids().values())
        for uid in range(first, last + 1):
            if (uid in claims and uid not in stale) or uid in running:
                continue
            (CLAIMS_FOLDER / str(uid)).write_text(claim)
            return uid
    raise SandboxUnavailableError(
        f"every uid of {first}-{last} is taken by a live local sandbox or runs a process: kill "
        "sandboxes (prefect-sandbox's reaper), or give PREFECT_SANDBOX_UID_RANGE more uids",
        operation="create",
    )


def release_uid(uid: int, sandbox_id: str) -> None:
    """Kill every process of ``uid``, wait (5 s at most) until they have exited, and drop its
    claim, if ``sandbox_id`` holds it.

    Idempotent: a uid already released, or taken over since, is left as it is.
    """
    path = CLAIMS_FOLDER / str(uid)
    with _locked():
        try:
            holder = json.loads(path.read_text())["sandbox_id"]
        except (OSError, ValueError, KeyError):
            return
        if holder != sandbox_id:
            return
        for pid in uid_processes(uid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + _REAP_WAIT_S
        while uid_processes(uid) and time.monotonic() < deadline:
            time.sleep(0.01)
        path.unlink()
