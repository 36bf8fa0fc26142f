"""The contract suite's fixtures: one backend per parameter, a fresh sandbox per test.

Adding a backend means adding a parameter to `backend` (and its fake server), not copying tests.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from prefect_sandbox.blocks.base import SandboxBackend
from prefect_sandbox.blocks.daytona import DaytonaBackend
from prefect_sandbox.blocks.local import LocalKernelBackend
from prefect_sandbox.sandbox.base import Sandbox

CONTRACT_LABELS = {"prefect-sandbox": "true", "suite": "contract"}

EXIT_STATUS_SEEN = frozenset({"local"})
"""Backends that see how a dead interpreter ended. Daytona's daemon only closes the execution
with 1001 "worker process ended"; ``exit()`` is seen everywhere, as the runner catches it."""

LATE_OUTPUT_KEPT = frozenset({"local"})
"""Backends that keep what threads print between cells. Daytona's interpreter drops it."""


@pytest.fixture(params=["local", "daytona"])
def backend(request: pytest.FixtureRequest) -> SandboxBackend:
    """A backend block under test, with short grace periods so timeouts test quickly."""
    if request.param == "local":
        return LocalKernelBackend(interrupt_grace_s=2.0)
    if request.param == "daytona":
        # The real daytona SDK against the emulator, found through DAYTONA_* variables.
        request.getfixturevalue("daytona_env")
        return DaytonaBackend(interrupt_grace_s=2.0)
    raise AssertionError(f"unknown backend {request.param}")


@pytest.fixture
async def sandbox(backend: SandboxBackend) -> AsyncIterator[Sandbox]:
    """A fresh sandbox of the backend under test, killed afterwards."""
    box = await backend.create(CONTRACT_LABELS)
    try:
        yield box
    finally:
        await box.kill()
