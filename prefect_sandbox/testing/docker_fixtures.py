"""Pytest plugin: a Docker daemon and the test kernel image for tests marked ``docker``.

Use it with ``pytest_plugins = ["prefect_sandbox.testing.docker_fixtures"]``. When the
collected tests include one marked ``docker`` (or using the ``docker_image`` fixture), the
daemon is started if none answers and the image is built if missing, once, in a thread started
after collection: other tests run meanwhile (a first build takes a minute or more, on every fresh
CI machine), and a module with a Docker test waits for it before its first test, outside that
test's timeout. A daemon started here is stopped at the end of the session.

Where Docker cannot run, those tests skip with the reason; with ``PREFECT_SANDBOX_REQUIRE_DOCKER=1``
(CI sets it) they fail instead, so a machine that should run them never passes silently.
Manual: docs/development.md.
"""

from __future__ import annotations

import os
import subprocess
import threading
from collections.abc import Generator, Iterator

import pytest

from prefect_sandbox.testing.docker import DockerDaemon, DockerUnavailable, build_test_image

__all__ = ["docker_image"]

REQUIRE_VARIABLE = "PREFECT_SANDBOX_REQUIRE_DOCKER"


class _DockerState:
    """What collection found: the daemon and image tag, or why Docker cannot run."""

    def __init__(self) -> None:
        self.daemon: DockerDaemon | None = None
        self.image: str | None = None
        self.problem: str | None = None
        self.setting_up: threading.Thread | None = None
        self.modules: set[str] = set()
        """The test modules (node ids) with a Docker test: each waits for the set-up before its
        first test, so that nothing a module set up (a shared sandbox of another backend, with
        a lifetime) sits idle through a build."""

    def wait(self) -> None:
        """Wait until the daemon and image are set up, or known not to be."""
        if self.setting_up is not None:
            self.setting_up.join()


_STATE_KEY = pytest.StashKey[_DockerState]()


def _wants_docker(item: pytest.Item) -> bool:
    return item.get_closest_marker("docker") is not None or "docker_image" in getattr(
        item, "fixturenames", ()
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "docker: needs a Docker daemon and the test kernel image")
    config.stash[_STATE_KEY] = _DockerState()


def pytest_collection_finish(session: pytest.Session) -> None:
    state = session.config.stash[_STATE_KEY]
    state.modules = {_module(item) for item in session.items if _wants_docker(item)}
    if not state.modules:
        return
    state.setting_up = threading.Thread(
        target=_set_up, args=(state,), name="prefect-sandbox-docker-set-up", daemon=True
    )
    state.setting_up.start()


def _set_up(state: _DockerState) -> None:
    """Start or join the daemon and build the image, recording either or why not (a thread)."""
    daemon = DockerDaemon()
    try:
        daemon.__enter__()
    except DockerUnavailable as exc:
        state.problem = str(exc)
        return
    state.daemon = daemon
    import docker.errors

    try:
        state.image = build_test_image(daemon.client)
    except (
        DockerUnavailable,
        subprocess.CalledProcessError,
        docker.errors.DockerException,
        OSError,
    ) as exc:
        state.problem = f"the test kernel image cannot be built: {exc}"


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, object, object]:
    # Outside pytest-timeout's wrapper, whose timer starts with the test's set-up: the wait for
    # a first build is not the test's time.
    state = item.config.stash[_STATE_KEY]
    if _module(item) in state.modules:
        state.wait()
    return (yield)


def _module(item: pytest.Item) -> str:
    return item.nodeid.split("::")[0]


def pytest_unconfigure(config: pytest.Config) -> None:
    state = config.stash.get(_STATE_KEY, None)
    if state is None:
        return
    state.wait()
    if state.daemon is not None:
        state.daemon.__exit__(None, None, None)


@pytest.fixture(scope="session")
def docker_image(request: pytest.FixtureRequest) -> Iterator[str]:
    """The tag of the test kernel image (`build_test_image`), on a running daemon.

    Skips the test when Docker cannot run here, or fails it if ``PREFECT_SANDBOX_REQUIRE_DOCKER``
    is set.
    """
    state = request.config.stash[_STATE_KEY]
    state.wait()
    if state.image is None:
        reason = f"Docker cannot run here: {state.problem or 'not set up'}"
        if os.environ.get(REQUIRE_VARIABLE):
            pytest.fail(f"{reason} ({REQUIRE_VARIABLE} is set)")
        pytest.skip(reason)
    yield state.image
