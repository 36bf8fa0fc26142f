"""The contract suite's fixtures: one backend per parameter, a fresh sandbox per test, or one
per backend for a module's tests marked ``shares_sandbox``.

Adding a backend means adding a parameter to `backend` (and its fake server), not copying tests.
A test shares its module's sandbox only where it reads nothing but what it set itself (its own
variable names and files), and changes nothing a later test could meet: no kill, restart,
timeout, interrupt, limit, thread or child left running, replaced ``sys.stdout`` or plotting
backend. The rest get a fresh one.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest

from prefect_sandbox.blocks.base import SandboxBackend
from prefect_sandbox.blocks.daytona import DaytonaBackend
from prefect_sandbox.blocks.docker import DockerBackend
from prefect_sandbox.blocks.e2b import E2BBackend, E2BCredentials
from prefect_sandbox.blocks.local import LocalKernelBackend
from prefect_sandbox.sandbox.backends.kernel.warm_pool import close_warm_pools
from prefect_sandbox.sandbox.base import Sandbox

CONTRACT_LABELS = {"prefect-sandbox": "true", "suite": "contract"}

# What a backend cannot observe, so the suite asserts its documented fallback instead.
LIMITS: dict[str, frozenset[str]] = {
    "e2b": frozenset(
        {
            # E2B's code interpreter says a kernel restarted, not its exit code or signal;
            # exit() is still seen, as our display hooks in the kernel report it.
            "exit_status",
            # Its server drops output that no running cell owns.
            "late_output",
            # It speaks no Jupyter protocol to us, so a cell has no execute_request id.
            "msg_id",
            # A deadline closes the execute stream, so the kernel's KeyboardInterrupt never
            # arrives; the cell ends with our CellTimeoutError output instead.
            "interrupt_output",
            # Its template shows every image saved to a path (PIL's Image.save, which
            # matplotlib's savefig uses for PNG) as a display_data.
            "quiet_image_save",
            # envd's file listing has no inode: hard links to one file are told apart only
            # by a link's resolved target, so each hard link is collected as its own file.
            "hard_links",
        }
    ),
    "daytona": frozenset(
        {
            # Daytona's daemon only closes the execution with 1001 "worker process ended";
            # exit() is still seen, as our runner inside the interpreter catches it.
            "exit_status",
            # Its interpreter drops what threads print between cells.
            "late_output",
            # Its interpreter speaks no Jupyter protocol, so a cell has no execute_request id.
            "msg_id",
            # It streams what goes through sys.stdout and sys.stderr only; what is written to
            # file descriptors 1 and 2 (os.write, C code, child processes) is dropped.
            "fd_output",
            # Its runner takes a few magics, not IPython's shell: no %%capture, In or _i.
            "ipython_shell",
            # Its interpreter is no Jupyter kernel: a comm goes nowhere, so no widget state.
            "widget_state",
        }
    ),
}


GRACE_S = 2.0
"""The contract backends' ``interrupt_grace_s``, short so that a kernel that ignores SIGINT is
restarted soon; a test marked ``interrupt_grace(seconds)`` gets that instead."""


def _interrupt_grace_s(request: pytest.FixtureRequest) -> float:
    marker = request.node.get_closest_marker("interrupt_grace")
    return GRACE_S if marker is None else float(marker.args[0])


def cannot(sandbox: Sandbox, what: str) -> bool:
    """Whether the sandbox's backend cannot observe ``what`` (a key of `LIMITS`)."""
    return what in LIMITS.get(sandbox.handle.backend, frozenset())


@pytest.fixture(
    params=[
        "local",
        "local-none",
        "local-pooled",
        "e2b",
        "daytona",
        pytest.param("docker", marks=pytest.mark.docker),
    ]
)
def backend(request: pytest.FixtureRequest) -> SandboxBackend:
    """A backend block under test, with short grace periods so timeouts test quickly.

    ``local`` is the local kernel as it runs by default, under bubblewrap; ``local-none`` the
    same without isolation; ``local-pooled`` the default kernel taken from a warm pool (all
    but the first create), so a pooled kernel keeps every promise a cold one does. ``e2b`` and
    ``daytona`` drive the vendors' real SDKs against the
    session's offline emulators; ``docker`` runs the offline-built test kernel image on this
    machine's daemon.
    """
    grace_s = _interrupt_grace_s(request)
    if request.param == "local":
        return LocalKernelBackend(interrupt_grace_s=grace_s)
    if request.param == "local-none":
        return LocalKernelBackend(interrupt_grace_s=grace_s, isolation="none")
    if request.param == "local-pooled":
        return LocalKernelBackend(interrupt_grace_s=grace_s, warm_pool_size=1)
    if request.param == "e2b":
        emulator = request.getfixturevalue("e2b_emulator")
        credentials = E2BCredentials(
            api_key=emulator.api_key, api_url=emulator.url, sandbox_url=emulator.url
        )
        return E2BBackend(credentials=credentials, interrupt_grace_s=grace_s, lifetime_s=120)
    if request.param == "daytona":
        # The real daytona SDK against the emulator, found through DAYTONA_* variables.
        request.getfixturevalue("daytona_env")
        return DaytonaBackend(interrupt_grace_s=grace_s)
    if request.param == "docker":
        return DockerBackend(
            image=request.getfixturevalue("docker_image"), interrupt_grace_s=grace_s
        )
    raise AssertionError(f"unknown backend {request.param}")


@pytest.fixture(scope="package", autouse=True)
def _warm_pools_end_with_the_suite() -> Iterator[None]:
    """``local-pooled``'s pool lives across the suite's tests, and ends with it."""
    yield
    close_warm_pools()


@pytest.fixture(scope="module")
async def _module_sandboxes() -> AsyncIterator[dict[str, Sandbox]]:
    """The sandboxes this module's ``shares_sandbox`` tests share, by backend parameter; killed
    with the module."""
    shared: dict[str, Sandbox] = {}
    try:
        yield shared
    finally:
        for box in shared.values():
            await box.kill()


@pytest.fixture
async def sandbox(
    backend: SandboxBackend,
    request: pytest.FixtureRequest,
    _module_sandboxes: dict[str, Sandbox],
) -> AsyncIterator[Sandbox]:
    """A fresh sandbox of the backend under test, killed afterwards; for a test marked
    ``shares_sandbox``, its module's sandbox of that backend, with no late output left of an
    earlier test."""
    if request.node.get_closest_marker("shares_sandbox") is None:
        box = await backend.create(CONTRACT_LABELS)
        try:
            yield box
        finally:
            await box.kill()
        return
    name = request.node.callspec.params["backend"]
    if name not in _module_sandboxes:
        _module_sandboxes[name] = await backend.create(CONTRACT_LABELS)
    await _module_sandboxes[name].take_late_outputs()
    yield _module_sandboxes[name]
