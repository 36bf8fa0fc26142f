"""A Docker daemon and a kernel image for testing the Docker backend offline.

`build_test_image` makes a small Debian image with ipykernel and the examples' libraries
without pulling from any registry: ``debootstrap`` writes a minimal Debian root from the
machine's Debian mirror, ``docker import`` turns it into a base image, and a container of that
image pip-installs wheels downloaded on the host (mounted, never copied into a layer). The root
tarball and the wheels are cached (`default_cache_dir`), and an image whose tag (a hash of the
recipe) exists is never rebuilt. `DockerDaemon` starts ``dockerd`` when none answers; processes
using it at once (the test workers) share it, and the last to leave stops one they started.
``python -m prefect_sandbox.testing.docker`` builds the image and prints its tag (needs root,
``debootstrap``, a Docker daemon and pip's access to its index). Manual: docs/backends/docker.md.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib.util
import json
import logging
import math
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prefect_sandbox.testing.stopping import StopsOnExit

if TYPE_CHECKING:
    import docker

__all__ = [
    "DAEMON_STATE_FOLDER",
    "DEBIAN_SUITE",
    "IMAGE_REPOSITORY",
    "IMAGE_REQUIREMENTS",
    "DockerDaemon",
    "DockerUnavailable",
    "build_test_image",
    "debian_mirror",
    "default_cache_dir",
    "kernel_image_tag",
]

logger = logging.getLogger(__name__)

DEBIAN_SUITE = "bookworm"
"""The Debian release of the image; its Python (3.11) decides which wheels are downloaded."""
_PYTHON_VERSION = "3.11"
IMAGE_REPOSITORY = "prefect-sandbox-test-kernel"
IMAGE_REQUIREMENTS = (
    "ipykernel>=6.29",
    # The examples' libraries: the contract suite and the CO2 job use them.
    "pandas>=2.2",
    "numpy>=1.26",
    "matplotlib>=3.8",
    "statsmodels>=0.14",
)
_BASE_REPOSITORY = "prefect-sandbox-test-base"
_DEFAULT_MIRROR = "http://deb.debian.org/debian"
_DEBOOTSTRAP_ATTEMPTS = 3
_DAEMON_START_S = 60.0
_DAEMON_STOP_S = 30.0

# Run in a container of the base image with the wheels mounted, then committed: no registry, no
# network, and no copy of the wheels left in the image's layers.
_INSTALL = (
    "python3 -m venv /opt/kernel && "
    "/opt/kernel/bin/pip install --quiet --no-cache-dir --no-index --find-links /wheels"
)
_IMAGE_CHANGES = (
    "ENV PATH=/opt/kernel/bin:/usr/local/bin:/usr/bin:/bin",
    "ENV LANG=C.UTF-8",
    # Read-only roots in sandboxes: never try to write bytecode caches.
    "ENV PYTHONDONTWRITEBYTECODE=1",
)


class DockerUnavailable(RuntimeError):
    """Docker cannot run here (no daemon and none can be started, or no debootstrap)."""


def default_cache_dir() -> Path:
    """Where the Debian root tarball and the wheels are kept between builds.

    Returns:
        ``$XDG_CACHE_HOME/prefect-sandbox/docker``, else ``~/.cache/prefect-sandbox/docker``.
    """
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "prefect-sandbox" / "docker"


def debian_mirror(sources: Sequence[Path] | None = None) -> str:
    """The Debian archive this machine's apt uses, so debootstrap reaches the same mirror.

    Args:
        sources: apt source files to read; by default ``/etc/apt/sources.list`` and those in
            ``/etc/apt/sources.list.d/`` (one-line and deb822 formats).

    Returns:
        The first source URL that serves the main archive (not ``-security``), else
        ``http://deb.debian.org/debian``.
    """
    if sources is None:
        apt = Path("/etc/apt")
        sources = [apt / "sources.list", *sorted((apt / "sources.list.d").glob("*"))]
    for source in sources:
        try:
            text = source.read_text()
        except OSError:
            continue
        for match in re.finditer(
            r"^\s*(?:deb\s+(?:\[[^\]]*\]\s+)?|URIs:\s*)(\S+)", text, flags=re.MULTILINE
        ):
            url = match.group(1).rstrip("/")
            if url.endswith("/debian") and "security" not in url:
                return url
    return _DEFAULT_MIRROR


def kernel_image_tag(requirements: Sequence[str] = IMAGE_REQUIREMENTS) -> str:
    """The test image's name: its repository and a hash of the recipe that builds it.

    Args:
        requirements: pip requirements installed in the image.

    Returns:
        ``prefect-sandbox-test-kernel:<12 hex digits>``.
    """
    recipe = "\n".join([DEBIAN_SUITE, _PYTHON_VERSION, _INSTALL, *_IMAGE_CHANGES, *requirements])
    return f"{IMAGE_REPOSITORY}:{hashlib.sha256(recipe.encode()).hexdigest()[:12]}"


def build_test_image(
    client: docker.DockerClient,
    *,
    requirements: Sequence[str] = IMAGE_REQUIREMENTS,
    cache_dir: Path | None = None,
    mirror: str | None = None,
) -> str:
    """Build the test kernel image unless an image with its tag exists.

    Python lives in ``/opt/kernel`` (first on ``PATH``), so ``python -m ipykernel_launcher``
    starts a kernel. Steps already done are skipped: the image, the base image, the cached
    root tarball and wheels.

    Args:
        client: a Docker client whose daemon builds and keeps the image.
        requirements: pip requirements to install.
        cache_dir: where tarball and wheels are cached; `default_cache_dir` by default.
        mirror: the Debian mirror for debootstrap; `debian_mirror` by default.

    Returns:
        The image's tag (`kernel_image_tag`).

    Raises:
        DockerUnavailable: debootstrap is missing or failed, we are not root, or pip install
            failed.
        subprocess.CalledProcessError: pip download or tar failed.
    """
    tag = kernel_image_tag(requirements)
    if _image_exists(client, tag):
        return tag
    cache = cache_dir or default_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    # One build at a time per cache (two test sessions at once): the second finds the image.
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _image_exists(client, tag):
            _build(client, tag, requirements, cache, mirror or debian_mirror())
    return tag


def _image_exists(client: docker.DockerClient, tag: str) -> bool:
    import docker.errors

    try:
        client.images.get(tag)
    except docker.errors.ImageNotFound:
        return False
    return True


def _build(
    client: docker.DockerClient,
    tag: str,
    requirements: Sequence[str],
    cache: Path,
    mirror: str,
) -> None:
    """Make the base image if missing, then install ``requirements`` into ``tag``."""
    base = _base_image(client, cache, mirror)
    wheels = _wheels(cache, requirements)
    logger.info("installing %d requirements into %s", len(requirements), tag)
    container = client.containers.run(
        base,
        ["sh", "-c", f"{_INSTALL} {shlex.join(requirements)}"],
        volumes={str(wheels): {"bind": "/wheels", "mode": "ro"}},
        network_mode="none",
        detach=True,
    )
    try:
        status = container.wait()
        if status["StatusCode"] != 0:
            log = container.logs().decode(errors="replace")
            raise DockerUnavailable(f"pip install in the image failed:\n{log[-4000:]}")
        repository, _, version = tag.partition(":")
        container.commit(repository=repository, tag=version, changes=list(_IMAGE_CHANGES))
    finally:
        container.remove(force=True)


def _base_image(client: docker.DockerClient, cache: Path, mirror: str) -> str:
    """A plain Debian image with python3 and venv, imported from a debootstrap root."""
    tag = f"{_BASE_REPOSITORY}:{DEBIAN_SUITE}"
    if _image_exists(client, tag):
        return tag
    tarball = cache / f"rootfs-{DEBIAN_SUITE}.tar"
    if not tarball.exists():
        _debootstrap(tarball, mirror)
    logger.info("importing %s as %s", tarball, tag)
    repository, _, version = tag.partition(":")
    client.api.import_image_from_file(str(tarball), repository=repository, tag=version)
    return tag


def _debootstrap(tarball: Path, mirror: str) -> None:
    """Write a minimal Debian root with python3 and python3-venv to ``tarball``."""
    if shutil.which("debootstrap") is None:
        raise DockerUnavailable("debootstrap is not installed (apt-get install debootstrap)")
    if os.geteuid() != 0:
        raise DockerUnavailable("debootstrap needs root to build the test image's base")
    with tempfile.TemporaryDirectory(prefix="rootfs-", dir=tarball.parent) as work:
        root = Path(work) / "root"
        for attempt in range(1, _DEBOOTSTRAP_ATTEMPTS + 1):
            logger.info("debootstrap %s from %s (try %d)", DEBIAN_SUITE, mirror, attempt)
            shutil.rmtree(root, ignore_errors=True)
            done = subprocess.run(
                [
                    "debootstrap",
                    "--variant=minbase",
                    "--include=python3,python3-venv",
                    DEBIAN_SUITE,
                    str(root),
                    mirror,
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            if done.returncode == 0:
                break
            # A mirror's hiccup fails it now and then; the last try's output says why.
            logger.warning("debootstrap failed: %s", done.stdout[-2000:])
        else:
            raise DockerUnavailable(
                f"debootstrap from {mirror} failed {_DEBOOTSTRAP_ATTEMPTS} times: "
                f"{done.stdout[-2000:]}"
            )
        # Package lists and caches are dead weight in an image that installs nothing more.
        for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
            shutil.rmtree(root / junk, ignore_errors=True)
        partial = tarball.with_suffix(".partial")
        subprocess.run(
            ["tar", "-C", str(root), "--numeric-owner", "-cf", str(partial), "."], check=True
        )
        partial.rename(tarball)


def _wheels(cache: Path, requirements: Sequence[str]) -> Path:
    """Wheels of ``requirements`` for the image's Python and this machine's architecture."""
    key = hashlib.sha256("\n".join([_PYTHON_VERSION, *requirements]).encode()).hexdigest()[:12]
    folder = cache / f"wheels-{key}"
    if (folder / ".complete").exists():
        return folder
    python = _PYTHON_VERSION.replace(".", "")
    arch = platform.machine()
    # Bookworm's glibc is 2.36, so every older manylinux tag fits; pip must be told each one.
    platforms = [f"--platform=manylinux_2_{minor}_{arch}" for minor in range(36, 16, -1)]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--only-binary=:all:",
            f"--python-version={_PYTHON_VERSION}",
            "--implementation=cp",
            f"--abi=cp{python}",
            f"--platform=manylinux2014_{arch}",
            *platforms,
            "--dest",
            str(folder),
            *requirements,
        ],
        check=True,
    )
    (folder / ".complete").touch()
    return folder


DAEMON_STATE_FOLDER = Path("/run/prefect-sandbox")
"""Where `DockerDaemon` keeps, machine-wide whatever ``TMPDIR`` says, which ``dockerd`` one of
its objects started and which processes use it (``dockerd.json``, under ``dockerd.lock``), and
that daemon's log."""


class DockerDaemon(StopsOnExit):
    """A Docker daemon that answers: the running one, or a ``dockerd`` started here.

    ``with DockerDaemon() as daemon:`` gives ``daemon.client``. Objects in any number of
    processes at once (pytest-xdist's workers, two test sessions) share one daemon: each enters
    as a user of it, under a machine-wide lock, and a ``dockerd`` that one of them started is
    stopped when the last of them leaves. One that was already running is left alone.

    Raises:
        DockerUnavailable: (on entry) the SDK is missing, or no daemon answers and none could be
            started (no ``dockerd``, not root, or it did not answer within a minute).
    """

    def __init__(self, log_path: Path | None = None) -> None:
        self._log_path = log_path or DAEMON_STATE_FOLDER / "dockerd.log"
        self._process: subprocess.Popen[bytes] | None = None
        self._user: dict[str, int | str] | None = None
        self.client: docker.DockerClient

    def __enter__(self) -> DockerDaemon:
        if importlib.util.find_spec("docker") is None:
            raise DockerUnavailable(
                "the docker SDK is not installed (pip install 'prefect-sandbox[docker]')"
            )
        reason = _ping(self)
        if reason is None and os.geteuid() != 0:
            return self  # not root: it could not have been started here, nor stopped
        dockerd = shutil.which("dockerd")
        if reason is not None and (dockerd is None or os.geteuid() != 0):
            raise DockerUnavailable(
                f"no Docker daemon answers ({reason}) and none can be started here "
                f"({'not root' if dockerd else 'no dockerd; apt-get install docker.io'})"
            )
        with _daemon_state() as state:
            if _ping(self) is not None:
                assert dockerd is not None
                state["pid"] = self._start(dockerd)
            self._user = {"pid": os.getpid(), "id": uuid.uuid4().hex}
            state["users"] = [*state.get("users", []), self._user]
        return self

    def _start(self, dockerd: str) -> int:
        """Start ``dockerd`` in a session of its own and wait until it answers; its pid.

        Started outside this process's group and TMPDIR: it serves other processes too, and
        outlives this one while they use it.
        """
        env = {name: value for name, value in os.environ.items() if name != "TMPDIR"}
        self._log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self._log_path, "ab") as log:
            self._process = subprocess.Popen(
                [dockerd],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                env=env,
                start_new_session=True,
            )
        deadline = time.monotonic() + _DAEMON_START_S
        while (reason := _ping(self)) is not None:
            if self._process.poll() is not None or time.monotonic() > deadline:
                _stop_dockerd(self._process.pid, self._process)
                self._process = None
                raise DockerUnavailable(f"dockerd did not start ({reason}); see {self._log_path}")
            time.sleep(0.5)
        return self._process.pid

    def stop(self) -> None:
        """Leave the daemon: stop it if one of its users started it and no other user is
        left (a user whose process is gone does not count); idempotent."""
        if self._user is None:
            return
        with _daemon_state() as state:
            users = [
                user
                for user in state.get("users", [])
                if user != self._user and _alive(int(user["pid"]))
            ]
            state["users"] = users
            pid = state.get("pid")
            if not users and pid is not None:
                _stop_dockerd(int(pid), self._process)
                state.pop("pid")
        self._user = None
        self._process = None


def _ping(daemon: DockerDaemon) -> str | None:
    """Connect ``daemon.client`` to the daemon; None if it answers, else why not."""
    import docker

    try:
        daemon.client = docker.from_env()
        daemon.client.ping()
    except docker.errors.DockerException as exc:
        return str(exc)
    return None


@contextlib.contextmanager
def _daemon_state() -> Iterator[dict[str, Any]]:
    """`DAEMON_STATE_FOLDER`'s ``dockerd.json``, read and written back under its lock."""
    DAEMON_STATE_FOLDER.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = DAEMON_STATE_FOLDER / "dockerd.json"
    with open(DAEMON_STATE_FOLDER / "dockerd.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            state: dict[str, Any] = json.loads(path.read_text())
        except (FileNotFoundError, ValueError):
            state = {}
        if "pid" in state and not _is_dockerd(int(state["pid"])):
            state = {}  # that daemon is gone (stopped, or the machine restarted)
        yield state
        partial = path.with_suffix(".partial")
        partial.write_text(json.dumps(state))
        partial.replace(path)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (not gone, not a zombie)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return stat.rpartition(b")")[2].split()[0] != b"Z"


def _is_dockerd(pid: int) -> bool:
    """Whether process ``pid`` runs and is a ``dockerd``."""
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
    except OSError:
        return False
    return _alive(pid) and Path(os.fsdecode(command)).name == "dockerd"


def _stop_dockerd(pid: int, process: subprocess.Popen[bytes] | None) -> None:
    """SIGTERM ``dockerd`` (``process`` when this process started it, to reap it), wait until
    it is gone, SIGKILL it after `_DAEMON_STOP_S`."""
    if not _is_dockerd(pid):
        return
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + _DAEMON_STOP_S
    while _alive(pid) if process is None else process.poll() is None:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            deadline = math.inf
        time.sleep(0.1)


def main(argv: Sequence[str] | None = None) -> int:
    """Build the test image (``python -m prefect_sandbox.testing.docker``); print its tag."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache-dir", type=Path, default=None, help="tarball and wheel cache")
    parser.add_argument("--mirror", default=None, help="Debian mirror for debootstrap")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    start = time.monotonic()
    with DockerDaemon() as daemon:
        tag = build_test_image(daemon.client, cache_dir=args.cache_dir, mirror=args.mirror)
    logger.info("%s ready in %.1f s", tag, time.monotonic() - start)
    print(tag)
    return 0


if __name__ == "__main__":
    sys.exit(main())
