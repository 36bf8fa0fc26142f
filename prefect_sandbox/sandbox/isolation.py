"""Isolating a local kernel with bubblewrap (``bwrap``): what it sees, and the command line.

A kernel under bubblewrap runs in new namespaces: its own network with only loopback (unless
the sandbox asks for the network), its own PIDs with a fresh ``/proc``, no capabilities. Its
filesystem is an empty root holding, read-only, ``/usr``, the files of ``/etc`` a Python
program needs, and the Python environments the kernel runs from; a fresh ``/tmp`` and an empty
``HOME``; and, writable, only what the sandbox owns (its working directory, its sockets). Host
paths keep their names inside, so the working directory is the same path on both sides.

`sandbox_view` looks at this machine's filesystem; `bwrap_command` is pure; `check_bwrap`
runs ``bwrap`` once per process to see that it can make namespaces here.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

from prefect_sandbox.sandbox.errors import SandboxUnavailableError

__all__ = [
    "ISOLATION_LEVELS",
    "SANDBOX_ENV",
    "Isolation",
    "SandboxView",
    "bwrap_command",
    "check_bwrap",
    "limited_command",
    "sandbox_view",
]

Isolation = Literal["bubblewrap", "none"]
"""How a local kernel is kept from the host: ``bubblewrap`` namespaces, or ``none`` at all."""

ISOLATION_LEVELS: tuple[str, ...] = get_args(Isolation)

SANDBOX_HOME = "/home/sandbox"

CPU_HARD_MARGIN_S = 5
"""CPU seconds between the soft CPU limit (SIGXCPU) and the hard one (SIGKILL)."""

SANDBOX_ENV = {"HOME": SANDBOX_HOME, "TMPDIR": "/tmp"}
"""Variables an isolated kernel gets instead of the host's (its HOME and /tmp are its own)."""

# Top-level folders of a merged-/usr system that are links into /usr (/bin -> usr/bin).
_USR_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")

# What of /etc a Python kernel reads: the dynamic loader, users and groups (getpass, pathlib's
# ~user), name resolution, time zones, locales, TLS certificates, fonts, MIME types. Not the
# rest: /etc can hold credentials (ssh host keys, shadow, tool configs).
_ETC_FILES = (
    "/etc/alternatives",
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/passwd",
    "/etc/group",
    "/etc/nsswitch.conf",
    "/etc/host.conf",
    "/etc/hosts",
    "/etc/resolv.conf",
    "/etc/gai.conf",
    "/etc/protocols",
    "/etc/services",
    "/etc/localtime",
    "/etc/timezone",
    "/etc/locale.alias",
    "/etc/locale.conf",
    "/etc/default/locale",
    "/etc/ssl",
    "/etc/ca-certificates",
    "/etc/ca-certificates.conf",
    "/etc/pki",
    "/etc/fonts",
    "/etc/mime.types",
    "/etc/matplotlibrc",
)

INSTALL_HINT = (
    "install bubblewrap (Debian/Ubuntu: `apt-get install bubblewrap`; Fedora: `dnf install "
    "bubblewrap`), or set isolation='none' on the backend to run cells without isolation, "
    "knowing that they can then read the host's files, processes and network"
)


@dataclass(frozen=True)
class SandboxView:
    """The host paths an isolated kernel sees, each at its own name.

    Attributes:
        links: symbolic links to recreate inside, as (path, target) pairs (``/bin -> usr/bin``).
        read_only: folders and files mounted read-only.
        writable: folders and files mounted read-write (the sandbox's own).
        network: whether the kernel shares the host's network; if not, it has only loopback.
    """

    links: tuple[tuple[str, str], ...]
    read_only: tuple[str, ...]
    writable: tuple[str, ...]
    network: bool = False


def sandbox_view(
    interpreter: str,
    *,
    read_only: Iterable[Path] = (),
    writable: Iterable[Path] = (),
    network: bool = False,
) -> SandboxView:
    """What a kernel run by ``interpreter`` needs to see of this machine, plus the given paths.

    Args:
        interpreter: the kernel's program (an absolute path, or a name looked up on ``PATH``).
        read_only: more paths the kernel may read (its connection file).
        writable: paths the kernel may write (its working directory, sockets, IPython folder).
        network: whether the kernel may use the host's network.

    Returns:
        The view: system and Python paths that exist here, read-only, then ``read_only`` and
        ``writable`` as given. Paths inside another read-only path are left out.
    """
    links, system = _system_view(interpreter)
    return SandboxView(
        links=links,
        read_only=system + tuple(str(path) for path in read_only if str(path) not in system),
        writable=tuple(str(path) for path in writable),
        network=network,
    )


@functools.cache
def _system_view(interpreter: str) -> tuple[tuple[tuple[str, str], ...], tuple[str, ...]]:
    """The links and read-only paths of `sandbox_view` that do not depend on the sandbox.

    Looked up once per process and interpreter: the system's layout does not change under us.
    """
    links = []
    system = [Path("/usr")]
    for name in _USR_LINKS:
        path = Path(name)
        if path.is_symlink():
            links.append((name, str(path.readlink())))
        elif path.is_dir():
            system.append(path)
    system += [Path(name) for name in _ETC_FILES]
    prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    program = shutil.which(interpreter) or interpreter
    # The interpreter's prefix (``<prefix>/bin/python``), both as named and as resolved.
    for path in (Path(program), Path(program).resolve()):
        if path.is_absolute() and len(path.parts) > 3:
            prefixes.add(str(path.parent.parent))
    python = [Path(prefix) for prefix in sorted(prefixes)]
    python += [path.resolve() for path in python]
    kept: list[Path] = []
    for path in [*system, *python]:
        if path.exists() and not any(path.is_relative_to(other) for other in kept):
            kept.append(path)
    return tuple(links), tuple(str(path) for path in kept)


def bwrap_command(bwrap_path: str, view: SandboxView, command: Sequence[str]) -> list[str]:
    """The argv that runs ``command`` under bubblewrap, seeing only ``view`` of the host.

    Args:
        bwrap_path: the ``bwrap`` program.
        view: what the command sees (see `sandbox_view`).
        command: the kernel's argv.

    Returns:
        The argv. The command starts in new user, PID, IPC, UTS, cgroup and (unless
        ``view.network``) network namespaces, with no capabilities, a new ``/proc`` and
        ``/dev``, an empty ``/tmp`` and ``HOME``, and dies when the process that started
        ``bwrap`` dies (``--die-with-parent``: when that process's launching THREAD ends).
    """
    argv = [bwrap_path, "--unshare-all"]
    if view.network:
        argv.append("--share-net")
    argv += ["--die-with-parent", "--cap-drop", "ALL"]
    # The kernel's parent is bwrap's init, pid 1 in the new PID namespace; told so, ipykernel
    # starts no parent poller (which would take an init for a dead parent and exit at once).
    argv += ["--setenv", "JPY_PARENT_PID", "1"]
    argv += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--tmpfs", SANDBOX_HOME]
    for path, target in view.links:
        argv += ["--symlink", target, path]
    for path in view.read_only:
        argv += ["--ro-bind", path, path]
    for path in view.writable:
        argv += ["--bind", path, path]
    # The empty root (and the folders bwrap made in it to hold the mounts) becomes read-only.
    argv += ["--remount-ro", "/", "--", *command]
    return argv


def limited_command(
    command: Sequence[str], *, memory_limit_bytes: int | None, cpu_time_limit_s: int | None
) -> list[str]:
    """``command`` run by ``/bin/sh`` after setting its rlimits, with SIGINT ignored.

    The limits are set before ``command`` starts, so the processes it forks inherit them
    (setting them from outside after the start would race with those forks). SIGINT is
    ignored because an interrupt goes to the whole process group, and ``bwrap`` dies of it;
    ipykernel ignores SIGINT too, except while it runs a cell, and the cell's children reset
    it on ``exec``.

    Args:
        command: the argv to run.
        memory_limit_bytes: address-space limit (``RLIMIT_AS``), rounded down to KiB; None
            for none.
        cpu_time_limit_s: CPU seconds (``RLIMIT_CPU``): SIGXCPU at this, SIGKILL
            `CPU_HARD_MARGIN_S` later; None for none.

    Returns:
        The argv.
    """
    # The shell exports PWD; the kernel gets only the environment it was given.
    script = 'trap "" INT; unset PWD'
    if memory_limit_bytes is not None:
        script += f"; ulimit -v {memory_limit_bytes // 1024}"
    if cpu_time_limit_s is not None:
        hard = cpu_time_limit_s + CPU_HARD_MARGIN_S
        script += f"; ulimit -S -t {cpu_time_limit_s}; ulimit -H -t {hard}"
    return ["/bin/sh", "-c", script + '; exec "$@"', "sh", *command]


@functools.cache
def check_bwrap(bwrap_path: str) -> str:
    """Check once per process that ``bwrap`` is there and can make namespaces here.

    Args:
        bwrap_path: the ``bwrap`` program, a path or a name on ``PATH``.

    Returns:
        The program's full path.

    Raises:
        SandboxUnavailableError: it is missing, or cannot make namespaces (a container without
            user namespaces, a kernel that forbids them). The message says how to fix that.
    """
    found = shutil.which(bwrap_path)
    if found is None:
        raise SandboxUnavailableError(
            f"isolation='bubblewrap' needs bubblewrap, but {bwrap_path!r} is not installed: "
            + INSTALL_HINT,
            operation="create",
        )
    view = SandboxView(links=(), read_only=("/",), writable=())
    done = subprocess.run(
        bwrap_command(found, view, ["true"]),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    if done.returncode != 0:
        reason = done.stderr.strip() or f"exit code {done.returncode}"
        raise SandboxUnavailableError(
            f"isolation='bubblewrap': {found} cannot make a sandbox here ({reason}); "
            + INSTALL_HINT,
            operation="create",
        )
    return found
