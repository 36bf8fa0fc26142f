"""Limits for a local sandbox as a whole: a cgroup of its own, made before its kernel starts and
removed at kill, in our subtree ``prefect-sandbox/`` of each hierarchy.

cgroup v2 (one hierarchy, ``/sys/fs/cgroup/cgroup.controllers``) or v1's ``memory``, ``pids``
and ``cpu`` controllers, each mounted apart under ``/sys/fs/cgroup`` (as on these machines, where
v2 is only the empty ``unified``). Memory counts every page the sandbox's processes charge, its
tmpfs (``/tmp``, ``/dev/shm``, ``HOME``) included; past it the kernel's OOM killer ends a process of
the sandbox. Writing a cgroup needs root; elsewhere the per-process rlimits are all there is, and
`SandboxCgroup.applied` says which limits applied. The manual: docs/backends/local.md ("Limits").
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["CGROUP_ROOT", "SandboxCgroup", "make_cgroup"]

CGROUP_ROOT = Path("/sys/fs/cgroup")
_SUBTREE = "prefect-sandbox"
_V1_CONTROLLERS = ("memory", "pids", "cpu")
_CPU_PERIOD_US = 100_000
_EMPTY_WAIT_S = 5.0


@dataclass(frozen=True)
class SandboxCgroup:
    """One sandbox's cgroup: a folder per hierarchy, and what each limit became.

    Attributes:
        folders: the cgroup's folders (one under v2; one per controller under v1).
        version: 1 or 2.
        applied: each limit set (``memory``, ``processes``, ``cpu``) to how it applies, e.g.
            ``"whole sandbox (cgroup v1): 1073741824 bytes"``.
    """

    folders: tuple[Path, ...]
    version: int
    applied: dict[str, str] = field(default_factory=dict)

    def kill_and_remove(self) -> None:
        """SIGKILL every process left in the cgroup, wait (5 s at most) until it is empty, and
        remove its folders. Idempotent."""
        deadline = time.monotonic() + _EMPTY_WAIT_S
        while True:
            pids = self._pids()
            if not pids or time.monotonic() > deadline:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.01)
        for folder in self.folders:
            with contextlib.suppress(FileNotFoundError):
                folder.rmdir()

    def out_of_memory(self) -> bool:
        """Whether the kernel's OOM killer ended a process of this cgroup (its ``oom_kill``
        count: v2's ``memory.events``, v1's ``memory.oom_control``, Linux 4.13 and later)."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        for folder in self.folders:
            with contextlib.suppress(OSError):
                for line in (folder / name).read_text().splitlines():
                    key, _, value = line.partition(" ")
                    if key == "oom_kill" and int(value) > 0:
                        return True
        return False

    def _pids(self) -> set[int]:
        pids: set[int] = set()
        for folder in self.folders:
            with contextlib.suppress(OSError):
                pids.update(int(pid) for pid in (folder / "cgroup.procs").read_text().split())
        return pids


def _hierarchies() -> tuple[int, dict[str, Path]] | None:
    """The cgroup version here and, per controller we use, the folder our subtree goes in;
    None when this process cannot make cgroups (not root, or no controller mounted)."""
    if os.geteuid() != 0:
        return None
    controllers_file = CGROUP_ROOT / "cgroup.controllers"
    if controllers_file.exists():
        offered = set(controllers_file.read_text().split())
        found = {name: CGROUP_ROOT for name in _V1_CONTROLLERS if name in offered}
        return (2, found) if found else None
    found = {
        name: CGROUP_ROOT / name
        for name in _V1_CONTROLLERS
        if (CGROUP_ROOT / name / "cgroup.procs").exists()
    }
    return (1, found) if found else None


def make_cgroup(
    sandbox_id: str,
    *,
    memory_limit_bytes: int | None,
    max_processes: int | None,
    cpu_limit: float | None,
) -> SandboxCgroup | None:
    """Make the sandbox's cgroup with its limits set; None where cgroups cannot be made here.

    Args:
        sandbox_id: names the cgroup, ``prefect-sandbox/<sandbox_id>``.
        memory_limit_bytes: memory for all the sandbox's processes and tmpfs together.
        max_processes: processes and threads alive at once in the sandbox.
        cpu_limit: CPUs' worth of time the sandbox may use (1.5: one and a half cores).

    Returns:
        The cgroup (empty: a process joins it by writing its pid in ``cgroup.procs``).

    Raises:
        OSError: the cgroup or a limit could not be written.
    """
    found = _hierarchies()
    if found is None:
        return None
    version, bases = found
    folders: dict[str, Path] = {}
    for name, base in bases.items():
        subtree = base / _SUBTREE
        subtree.mkdir(exist_ok=True)
        if version == 2:
            # Controllers reach a child only when its parent hands them down.
            wanted = " ".join(f"+{c}" for c in bases)
            (base / "cgroup.subtree_control").write_text(wanted)
            (subtree / "cgroup.subtree_control").write_text(wanted)
        folder = subtree / sandbox_id
        folder.mkdir(exist_ok=True)
        folders[name] = folder
    cgroup = SandboxCgroup(tuple(dict.fromkeys(folders.values())), version)
    where = f"whole sandbox (cgroup v{version})"
    try:
        if memory_limit_bytes is not None and "memory" in folders:
            limit = "memory.max" if version == 2 else "memory.limit_in_bytes"
            (folders["memory"] / limit).write_text(str(memory_limit_bytes))
            # Swap counts too where the host accounts it (v1: only with swapaccount=1).
            swap = "memory.swap.max" if version == 2 else "memory.memsw.limit_in_bytes"
            if (folders["memory"] / swap).exists():
                (folders["memory"] / swap).write_text(
                    "0" if version == 2 else str(memory_limit_bytes)
                )
            cgroup.applied["memory"] = f"{where}: {memory_limit_bytes} bytes"
        if max_processes is not None and "pids" in folders:
            (folders["pids"] / "pids.max").write_text(str(max_processes))
            cgroup.applied["processes"] = f"{where}: {max_processes} processes and threads"
        if cpu_limit is not None and "cpu" in folders:
            quota = max(1000, round(cpu_limit * _CPU_PERIOD_US))
            if version == 2:
                (folders["cpu"] / "cpu.max").write_text(f"{quota} {_CPU_PERIOD_US}")
            else:
                (folders["cpu"] / "cpu.cfs_period_us").write_text(str(_CPU_PERIOD_US))
                (folders["cpu"] / "cpu.cfs_quota_us").write_text(str(quota))
            cgroup.applied["cpu"] = f"{where}: {cpu_limit} CPUs"
    except OSError:
        cgroup.kill_and_remove()
        raise
    return cgroup
