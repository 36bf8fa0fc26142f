"""Isolating a local kernel with bubblewrap (``bwrap``): what it sees, and the command line.

A kernel under bubblewrap runs in new namespaces (loopback-only network unless asked, its own
PIDs with a fresh ``/proc``, no capabilities) on an empty root holding, read-only, ``/usr``, the
files of ``/etc`` a Python program needs (no folder of keys) and its Python environments; a
fresh ``/tmp``, ``/dev/shm`` and ``HOME`` (each at most the memory limit); and, writable, only
what the sandbox owns. Host paths keep their names inside. It never runs as host root: when this
process is root, bwrap runs as a uid of the sandbox's own (`kernel.uids`) through
`_drop_root.py`, and the kernel is uid 0 of a user namespace mapped to that uid alone.
`sandbox_view` looks at this machine's filesystem; `bwrap_command` and `staged_command` are
pure; `check_bwrap` runs ``bwrap`` once per process to see it can make namespaces here. Manual:
docs/backends/local.md.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import json
import logging
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

from prefect_sandbox.sandbox.errors import SandboxUnavailableError

__all__ = [
    "ISOLATION_LEVELS",
    "SANDBOX_ENV",
    "SANDBOX_USER",
    "SECCOMP_REFUSED",
    "SOCKET_FAMILIES_ALLOWED",
    "Isolation",
    "SandboxView",
    "bwrap_command",
    "bwrap_sizes_tmpfs",
    "check_bwrap",
    "limited_command",
    "sandbox_user",
    "sandbox_view",
    "seccomp_filter",
    "staged_command",
]

Isolation = Literal["bubblewrap", "none"]
"""How a local kernel is kept from the host: ``bubblewrap`` namespaces, or ``none`` at all."""

ISOLATION_LEVELS: tuple[str, ...] = get_args(Isolation)

SANDBOX_HOME = "/home/sandbox"

CPU_HARD_MARGIN_S = 5
"""CPU seconds between the soft CPU limit (SIGXCPU) and the hard one (SIGKILL)."""

SANDBOX_ENV = {"HOME": SANDBOX_HOME, "TMPDIR": "/tmp"}
"""Variables an isolated kernel gets instead of the host's (its HOME and /tmp are its own)."""

SANDBOX_USER = (65534, 65534)
"""Host uid and gid (``nobody:nogroup``) a root process checks bwrap as, and runs a sandbox as
when it is given no uid of its own."""

# Where `_drop_root.py` mounts the paths bwrap binds, in a mount namespace of its own: a folder
# every user can reach (unlike a private TMPDIR), whatever TMPDIR says.
_STAGE = "/tmp/prefect-sandbox-stage"
_DROP_ROOT = Path(__file__).with_name("_drop_root.py")
# How many arguments each option of `bwrap_command` takes; the bind options' first is a host path.
_BWRAP_ARITY = {
    "--unshare-all": 0,
    "--share-net": 0,
    "--die-with-parent": 0,
    "--cap-drop": 1,
    "--uid": 1,
    "--gid": 1,
    "--setenv": 2,
    "--seccomp": 1,
    "--proc": 1,
    "--dev": 1,
    "--size": 1,
    "--tmpfs": 1,
    "--remount-ro": 1,
    "--symlink": 2,
    "--ro-bind": 2,
    "--bind": 2,
}
_BIND_OPTIONS = frozenset({"--bind", "--ro-bind"})

# Top-level folders of a merged-/usr system that are links into /usr (/bin -> usr/bin).
_USR_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")

# What of /etc a Python kernel reads: the dynamic loader, users and groups (getpass, pathlib's
# ~user), name resolution, time zones, locales, TLS certificates, fonts, MIME types. Not the
# rest: /etc can hold credentials (ssh host keys, shadow, tool configs), and of /etc/ssl and
# /etc/pki only the certificates, never the folders of private keys beside them.
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
    "/etc/ssl/certs",
    "/etc/ssl/openssl.cnf",
    "/etc/pki/tls/certs",
    "/etc/pki/tls/cert.pem",
    "/etc/pki/tls/openssl.cnf",
    "/etc/pki/ca-trust/extracted",
    "/etc/fonts",
    "/etc/mime.types",
    "/etc/matplotlibrc",
)

# Syscalls a notebook never needs that widen what the host's Linux kernel exposes, refused with
# EPERM (Docker's default profile and Flatpak refuse most of them too): kernel keyrings, eBPF,
# perf events, userfaultfd and io_uring (sources of exploits), modules and kexec, mounting, new
# namespaces (a user namespace would give the kernel capabilities over them), secret memory,
# LDT entries, Landlock, NUMA page moves and kcmp (which compares other processes' kernel
# objects).
SECCOMP_REFUSED = (
    "acct",
    "add_key",
    "bpf",
    "delete_module",
    "finit_module",
    "fsconfig",
    "fsmount",
    "fsopen",
    "fspick",
    "init_module",
    "io_uring_enter",
    "io_uring_register",
    "io_uring_setup",
    "kcmp",
    "kexec_file_load",
    "kexec_load",
    "keyctl",
    "landlock_add_rule",
    "landlock_create_ruleset",
    "landlock_restrict_self",
    "mbind",
    "memfd_secret",
    "modify_ldt",
    "mount",
    "move_mount",
    "move_pages",
    "name_to_handle_at",
    "open_by_handle_at",
    "open_tree",
    "perf_event_open",
    "pivot_root",
    "quotactl",
    "reboot",
    "request_key",
    "setns",
    "swapoff",
    "swapon",
    "syslog",
    "umount2",
    "unshare",
    "userfaultfd",
)
SOCKET_FAMILIES_ALLOWED = (
    socket.AF_UNIX,
    socket.AF_INET,
    socket.AF_INET6,
    # glibc's getaddrinfo and getifaddrs ask the kernel over netlink.
    socket.AF_NETLINK,
)
"""The address families ``socket`` and ``socketpair`` may make; any other (``AF_VSOCK``, which
network namespaces do not cover, ``AF_PACKET``, ``AF_BLUETOOTH``, ...) fails with EPERM."""
_AF_MAX = 64  # above every family Linux has (AF_MAX is 46 in 6.x)
_CLONE_NEWUSER = 0x10000000
# libseccomp's constants (seccomp.h): actions, the filter attribute for calls through another
# architecture's table (x32 numbers on x86_64 included), and comparisons.
_SCMP_ACT_ALLOW = 0x7FFF0000
_SCMP_ACT_ERRNO = 0x00050000
_SCMP_ACT_KILL_PROCESS = 0x80000000
_SCMP_FLTATR_ACT_BADARCH = 2
_SCMP_CMP_EQ = 4
_SCMP_CMP_GE = 5
_SCMP_CMP_MASKED_EQ = 7

logger = logging.getLogger(__name__)


class _ArgCompare(ctypes.Structure):
    """libseccomp's ``struct scmp_arg_cmp``."""

    _fields_ = [
        ("arg", ctypes.c_uint),
        ("op", ctypes.c_int),
        ("datum_a", ctypes.c_uint64),
        ("datum_b", ctypes.c_uint64),
    ]


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
        tmpfs_size_bytes: the most each of the kernel's ``/tmp``, ``HOME`` and ``/dev/shm``
            holds (they are memory); None for the system's default, half the host's RAM.
    """

    links: tuple[tuple[str, str], ...]
    read_only: tuple[str, ...]
    writable: tuple[str, ...]
    network: bool = False
    tmpfs_size_bytes: int | None = None


def sandbox_view(
    interpreter: str,
    *,
    read_only: Iterable[Path] = (),
    writable: Iterable[Path] = (),
    network: bool = False,
    tmpfs_size_bytes: int | None = None,
) -> SandboxView:
    """What a kernel run by ``interpreter`` needs to see of this machine, plus the given paths.

    Args:
        interpreter: the kernel's program (an absolute path, or a name looked up on ``PATH``).
        read_only: more paths the kernel may read (its connection file).
        writable: paths the kernel may write (its working directory, sockets, IPython folder).
        network: whether the kernel may use the host's network.
        tmpfs_size_bytes: the size of each of its memory-backed folders (see `SandboxView`).

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
        tmpfs_size_bytes=tmpfs_size_bytes,
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


def bwrap_command(
    bwrap_path: str,
    view: SandboxView,
    command: Sequence[str],
    *,
    seccomp_fd: int | None = None,
) -> list[str]:
    """The argv that runs ``command`` under bubblewrap, seeing only ``view`` of the host.

    Args:
        bwrap_path: the ``bwrap`` program.
        view: what the command sees (see `sandbox_view`).
        command: the kernel's argv.
        seccomp_fd: a descriptor bwrap inherits, holding a `seccomp_filter` program for the
            command; None for no filter.

    Returns:
        The argv. The command starts in new user, PID, IPC, UTS, cgroup and (unless
        ``view.network``) network namespaces, as uid and gid 0 of its user namespace (mapped
        to the user who runs ``bwrap``), with no capabilities, a new ``/proc`` whose ``sys``
        is read-only, a new ``/dev`` (read-only but for its devices and a fresh ``shm``), an
        empty ``/tmp`` and ``HOME``, and dies when the process that started ``bwrap`` dies
        (``--die-with-parent``: when that process's launching THREAD ends).
    """
    argv = [bwrap_path, "--unshare-all"]
    if view.network:
        argv.append("--share-net")
    # uid 0 inside maps to bwrap's own user in ONE user namespace, so /proc/self/uid_map names
    # the host uid (any other uid makes bwrap nest a second namespace, mapped from the first).
    argv += ["--die-with-parent", "--cap-drop", "ALL", "--uid", "0", "--gid", "0"]
    # The kernel's parent is bwrap's init, pid 1 in the new PID namespace; told so, ipykernel
    # starts no parent poller (which would take an init for a dead parent and exit at once).
    argv += ["--setenv", "JPY_PARENT_PID", "1"]
    if seccomp_fd is not None:
        argv += ["--seccomp", str(seccomp_fd)]
    # bwrap leaves /proc/sys writable where it could not check it; its own network's sysctls
    # belong to the sandbox's uid 0.
    argv += ["--proc", "/proc", "--ro-bind", "/proc/sys", "/proc/sys", "--dev", "/dev"]
    size = [] if view.tmpfs_size_bytes is None else ["--size", str(view.tmpfs_size_bytes)]
    for folder in ("/dev/shm", "/tmp", SANDBOX_HOME):
        argv += [*size, "--tmpfs", folder]
    argv += ["--remount-ro", "/dev"]
    for path, target in view.links:
        argv += ["--symlink", target, path]
    for path in view.read_only:
        argv += ["--ro-bind", path, path]
    for path in view.writable:
        argv += ["--bind", path, path]
    # The empty root (and the folders bwrap made in it to hold the mounts) becomes read-only.
    argv += ["--remount-ro", "/", "--", *command]
    return argv


def sandbox_user() -> tuple[int, int]:
    """The host uid and gid a sandbox runs as: `SANDBOX_USER` if this process is root, else
    this process's own (an unprivileged process cannot take another uid)."""
    if os.geteuid() == 0:
        return SANDBOX_USER
    return os.getuid(), os.getgid()


def staged_command(
    bwrap_argv: Sequence[str],
    user: tuple[int, int] = SANDBOX_USER,
    python: str = sys.executable,
) -> list[str]:
    """``bwrap_argv`` run as ``user`` rather than as root, when this process is root.

    Args:
        bwrap_argv: a `bwrap_command` argv.
        user: the host uid and gid bwrap runs as.
        python: the interpreter that runs `_drop_root.py`.

    Returns:
        ``bwrap_argv`` itself when this process is not root. Otherwise an argv that runs
        `_drop_root.py`, which mounts each path ``bwrap_argv`` binds at a staging folder only
        its own mount namespace sees, drops to ``user``, and runs ``bwrap_argv`` with
        those paths replaced by their staged names.
    """
    if os.geteuid() != 0:
        return list(bwrap_argv)
    argv = list(bwrap_argv)
    sources = []
    index = 1
    while argv[index] != "--":
        option = argv[index]
        if option in _BIND_OPTIONS:
            sources.append(argv[index + 1])
            argv[index + 1] = f"{_STAGE}/{len(sources) - 1}"
        index += 1 + _BWRAP_ARITY[option]
    uid, gid = user
    spec = {"stage": _STAGE, "sources": sources, "uid": uid, "gid": gid, "argv": argv}
    return [python, "-I", "-S", str(_DROP_ROOT), json.dumps(spec)]


@functools.cache
def seccomp_filter() -> bytes | None:
    """The seccomp program (classic BPF, for ``bwrap --seccomp``) a sandbox runs under.

    It refuses `SECCOMP_REFUSED`, ``clone`` with ``CLONE_NEWUSER``, and ``socket`` and
    ``socketpair`` of a family outside `SOCKET_FAMILIES_ALLOWED` (EPERM), answers ``clone3``
    ENOSYS (its flags cannot be checked; glibc then uses ``clone``), allows the rest, and kills
    the whole process (not only the calling thread, libseccomp's default, which left the cell
    running) that calls through another architecture's table: i386, or x32 numbers on x86_64.
    Made once per process with libseccomp (installed with most distributions, for systemd
    and apt).

    Returns:
        The program, or None when libseccomp cannot be loaded (logged once; the sandbox then
        runs without a filter).
    """
    name = ctypes.util.find_library("seccomp")
    try:
        lib = ctypes.CDLL(name or "libseccomp.so.2")
    except OSError:
        logger.warning("libseccomp not found: sandboxes run without a seccomp filter")
        return None
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [
        ctypes.c_void_p,
        ctypes.c_uint32,
        ctypes.c_int,
        ctypes.c_uint,
        ctypes.POINTER(_ArgCompare),
    ]
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.seccomp_attr_set.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32]
    context = lib.seccomp_init(_SCMP_ACT_ALLOW)
    try:
        if lib.seccomp_attr_set(context, _SCMP_FLTATR_ACT_BADARCH, _SCMP_ACT_KILL_PROCESS):
            raise OSError("libseccomp refused to kill the process on a foreign architecture")
        for call, error, compare in _seccomp_rules():
            number = lib.seccomp_syscall_resolve_name(call.encode())
            if number < 0:  # not a syscall of this architecture
                continue
            array = (_ArgCompare * len(compare))(*compare) if compare else None
            if lib.seccomp_rule_add_array(
                context, _SCMP_ACT_ERRNO | error, number, len(compare), array
            ):
                raise OSError(f"libseccomp refused a rule for {call}")
        with tempfile.TemporaryFile() as program:
            if lib.seccomp_export_bpf(context, program.fileno()):
                raise OSError("libseccomp could not export its program")
            program.seek(0)
            return program.read()
    finally:
        lib.seccomp_release(context)


def _seccomp_rules() -> list[tuple[str, int, list[_ArgCompare]]]:
    """Each rule of `seccomp_filter`: (syscall, errno it answers, comparisons all true)."""
    rules: list[tuple[str, int, list[_ArgCompare]]] = [
        (call, errno.EPERM, []) for call in SECCOMP_REFUSED
    ]
    new_user = _ArgCompare(0, _SCMP_CMP_MASKED_EQ, _CLONE_NEWUSER, _CLONE_NEWUSER)
    rules += [("clone", errno.EPERM, [new_user]), ("clone3", errno.ENOSYS, [])]
    # One rule per refused family, and one for every value above them: the kernel reads the
    # family as an int, so a value with high bits set is refused too, as no family has them.
    families = [
        [_ArgCompare(0, _SCMP_CMP_EQ, family, 0)]
        for family in range(_AF_MAX)
        if family not in SOCKET_FAMILIES_ALLOWED
    ]
    families.append([_ArgCompare(0, _SCMP_CMP_GE, _AF_MAX, 0)])
    rules += [
        (call, errno.EPERM, family) for call in ("socket", "socketpair") for family in families
    ]
    return rules


def limited_command(
    command: Sequence[str],
    *,
    memory_limit_bytes: int | None,
    cpu_time_limit_s: int | None,
    cgroup_folders: Sequence[str] = (),
) -> list[str]:
    """``command`` run by ``/bin/sh`` after setting its rlimits, with SIGINT ignored.

    The limits are set before ``command`` starts, so the processes it forks inherit them
    (setting them from outside after the start would race with those forks): each process
    gets the whole limit, not a share of one. The memory limit is not ``RLIMIT_AS``: glibc
    reserves 64 MiB of address space per thread that allocates, so a kernel with its handful
    of threads needs over 512 MiB of address space while using a tenth of it. SIGINT is
    ignored because an interrupt goes to the whole process group, and ``bwrap`` dies of it;
    ipykernel ignores SIGINT too, except while it runs a cell, and the cell's children reset
    it on ``exec``.

    Args:
        command: the argv to run.
        memory_limit_bytes: the memory each process may allocate (``RLIMIT_DATA``: its heap
            and private writable mappings, not address space merely reserved nor files
            mapped), rounded down to KiB; None for none.
        cpu_time_limit_s: CPU seconds (``RLIMIT_CPU``): SIGXCPU at this, SIGKILL
            `CPU_HARD_MARGIN_S` later; None for none.
        cgroup_folders: cgroups the shell joins before ``command`` starts (so every process
            of the sandbox is in them from its first); it exits 125 if it cannot.

    Returns:
        The argv.
    """
    # The shell exports PWD; the kernel gets only the environment it was given.
    script = 'trap "" INT; unset PWD'
    for folder in cgroup_folders:
        script += f"; echo $$ > {shlex.quote(folder + '/cgroup.procs')} || exit 125"
    if memory_limit_bytes is not None:
        script += f"; ulimit -d {memory_limit_bytes // 1024}"
    if cpu_time_limit_s is not None:
        hard = cpu_time_limit_s + CPU_HARD_MARGIN_S
        script += f"; ulimit -S -t {cpu_time_limit_s}; ulimit -H -t {hard}"
    return ["/bin/sh", "-c", script + '; exec "$@"', "sh", *command]


@functools.cache
def bwrap_sizes_tmpfs(bwrap_path: str) -> bool:
    """Whether this ``bwrap`` takes ``--size`` (bubblewrap 0.7.0 and later), once per process.

    Args:
        bwrap_path: the ``bwrap`` program (a full path, as `check_bwrap` returns).

    Returns:
        True if ``bwrap --version`` names 0.7 or later; older ones leave a sandbox's memory
        folders at the system's default size (logged once).
    """
    done = subprocess.run(
        [bwrap_path, "--version"], capture_output=True, text=True, timeout=30, check=False
    )
    found = re.search(r"(\d+)\.(\d+)", done.stdout)
    if found is not None and (int(found[1]), int(found[2])) >= (0, 7):
        return True
    logger.warning(
        "%s is older than bubblewrap 0.7: sandboxes' /tmp, HOME and /dev/shm are not sized "
        "by memory_limit_bytes",
        bwrap_path,
    )
    return False


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
        staged_command(bwrap_command(found, view, ["true"])),
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
