"""The contract suite's fixtures: one backend per parameter, a fresh sandbox per test.

Adding a backend means adding a parameter to `backend` (and its fake server), not copying tests.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from prefect_sandbox.blocks.base import SandboxBackend
from prefect_sandbox.blocks.local import LocalKernelBackend
from prefect_sandbox.sandbox.base import Sandbox

CONTRACT_LABELS = {"prefect-sandbox": "true", "suite": "contract"}


@pytest.fixture(params=["local"])
def backend(request: pytest.FixtureRequest) -> SandboxBackend:
    """A backend block under test, with short grace periods so timeouts test quickly."""
    if request.param == "local":
        return LocalKernelBackend(interrupt_grace_s=2.0)
    raise AssertionError(f"unknown backend {request.param}")


@pytest.fixture
async def sandbox(backend: SandboxBackend) -> AsyncIterator[Sandbox]:
    """A fresh sandbox of the backend under test, killed afterwards."""
    box = await backend.create(CONTRACT_LABELS)
    try:
        yield box
    finally:
        await box.kill()
