"""The interface every sandbox backend block implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping

from prefect.blocks.core import Block
from pydantic import Field

from prefect_sandbox.sandbox.base import Sandbox, SandboxHandle
from prefect_sandbox.sandbox.outputs import DEFAULT_MAX_OUTPUT_BYTES

__all__ = ["SandboxBackend"]


class SandboxBackend(Block, ABC):
    """Settings of one kind of sandbox, and the factory for its sandboxes.

    Subclasses are the blocks users save: `LocalKernelBackend`, and later the E2B and Daytona
    backends. Flows and tasks take a backend plus a `SandboxHandle`, never a live sandbox.
    """

    cell_timeout_s: float | None = Field(
        default=600.0,
        gt=0,
        title="Default cell timeout (s)",
        description="Seconds a cell may run before it is interrupted; empty for no limit.",
    )

    max_output_bytes: int | None = Field(
        default=DEFAULT_MAX_OUTPUT_BYTES,
        gt=0,
        title="Max output bytes per cell",
        description="Cap on each cell's stored and logged output; start and end are kept.",
    )

    @abstractmethod
    async def create(self, labels: Mapping[str, str]) -> Sandbox:
        """Make a new sandbox carrying ``labels``.

        Returns:
            The live sandbox.

        Raises:
            SandboxError: the backend could not make it.
        """

    @abstractmethod
    async def attach(self, handle: SandboxHandle) -> Sandbox:
        """Reach the sandbox behind ``handle`` again.

        Raises:
            SandboxNotFoundError: it was killed or expired.
        """

    @abstractmethod
    async def list_sandboxes(self, labels: Mapping[str, str]) -> list[SandboxHandle]:
        """Handles of live sandboxes whose labels include ``labels`` (for cleanup)."""
