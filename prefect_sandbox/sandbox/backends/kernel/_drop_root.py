"""Run bubblewrap as an unprivileged user when the flow runs as root (a script, stdlib only).

Run as ``python -I -S _drop_root.py SPEC`` by a root process; SPEC is JSON with ``sources``
(host paths), ``stage`` (a folder), ``uid``, ``gid`` and ``argv`` (bwrap's). Bubblewrap run by
root maps the sandbox's user to host root; run by another uid it maps it to that uid, which then
cannot reach what it may not (a Python under ``/root``, the sandbox's private folders). So this
script, still root, (1) makes ``stage`` (empty, root-only, left for the next run) and enters a
private mount namespace of its own; (2) mounts a small tmpfs on ``stage`` and bind-mounts source
N on ``stage/N``; (3) drops to ``uid:gid`` with no supplementary groups and executes ``argv``,
which names ``stage/N`` where it would name source N. Exit status 126 with a message on stderr
when a step fails. Manual: docs/backends/local.md.
"""

import contextlib
import ctypes
import json
import os
import stat
import sys

_CLONE_NEWNS = 0x00020000
_MS_NOSUID = 0x2
_MS_NODEV = 0x4
_MS_BIND = 0x1000
_MS_REC = 0x4000
_MS_PRIVATE = 0x40000


def _call(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _make_stage(stage: str) -> None:
    """Make the staging folder, or check that the one there is root's alone (not a link)."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(stage, 0o755)
    info = os.lstat(stage)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != 0 or info.st_mode & 0o022:
        raise OSError(f"{stage} is not a folder that root alone may write; remove it")


def main() -> int:
    """Stage the sources, drop to the user, run bwrap (see the module docstring)."""
    spec = json.loads(sys.argv[1])
    libc = ctypes.CDLL(None, use_errno=True)
    stage = spec["stage"]
    try:
        _make_stage(stage)
        _call(libc.unshare(_CLONE_NEWNS), "unshare(CLONE_NEWNS)")
        _call(
            libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None), "mount --make-rprivate /"
        )
        sources = [os.open(path, os.O_PATH) for path in spec["sources"]]
        _call(
            libc.mount(
                b"tmpfs", stage.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, b"mode=0755,size=64k"
            ),
            f"mount tmpfs on {stage}",
        )
        for index, source in enumerate(sources):
            target = os.path.join(stage, str(index))
            if stat.S_ISDIR(os.fstat(source).st_mode):
                os.mkdir(target)
            else:
                os.close(os.open(target, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
            _call(
                libc.mount(
                    f"/proc/self/fd/{source}".encode(),
                    target.encode(),
                    None,
                    _MS_BIND | _MS_REC,
                    None,
                ),
                f"bind {spec['sources'][index]}",
            )
            os.close(source)
        os.setgroups([])
        os.setresgid(spec["gid"], spec["gid"], spec["gid"])
        os.setresuid(spec["uid"], spec["uid"], spec["uid"])
        os.execv(spec["argv"][0], spec["argv"])
    except OSError as exc:
        print(f"prefect-sandbox: cannot start bwrap as uid {spec['uid']}: {exc}", file=sys.stderr)
    return 126


if __name__ == "__main__":
    sys.exit(main())
