"""Pytest fixtures for the Daytona emulator.

Use them with ``pytest_plugins = ["prefect_sandbox.testing.daytona.fixtures"]`` in a
``conftest.py``. Manual: docs/development.md.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from prefect_sandbox.testing.daytona.emulator import DaytonaEmulator

__all__ = ["daytona_emulator"]


@pytest.fixture(scope="session")
def daytona_emulator() -> Iterator[DaytonaEmulator]:
    """A running Daytona emulator for the session; stopped, with its sandboxes, at the end."""
    with DaytonaEmulator() as emulator:
        yield emulator
