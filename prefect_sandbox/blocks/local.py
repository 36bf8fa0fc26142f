"""`LocalKernelBackend`: the embedded default, a Jupyter kernel on the flow's own machine."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from pydantic import Field

from prefect_sandbox.blocks.base import SandboxBackend
from prefect_sandbox.sandbox.backends.local import LocalKernelConfig, LocalKernelSandbox
from prefect_sandbox.sandbox.base import SandboxHandle

__all__ = ["LocalKernelBackend"]


class LocalKernelBackend(SandboxBackend):
    """Runs cells in an ipykernel on the machine that runs the flow. Needs no account.

    Each sandbox is a fresh kernel process in its own working directory. The kernel gets no
    stdin and none of the host's environment beyond ``PATH``, ``HOME``, locale and ``TZ``, plus
    the variables set here. It is no security boundary against hostile code: use E2B or
    Daytona for that.

    Example:
        ```python
        from prefect_sandbox import LocalKernelBackend

        backend = LocalKernelBackend.load("BLOCK_NAME")
        ```
    """

    _block_type_name = "Local Kernel Sandbox"
    _block_type_slug = "local-kernel-sandbox"
    _logo_url = "https://jupyter.org/assets/homepage/main-logo.svg"  # type: ignore[assignment]
    _documentation_url = "https://jupyter-client.readthedocs.io/en/stable/"  # type: ignore[assignment]
    _description = "Runs notebook cells in a local Jupyter kernel that lives for one flow run."

    kernel_name: str = Field(
        default="python3",
        title="Kernel name",
        description="The Jupyter kernelspec to start; python3 is this Python's ipykernel.",
    )
    workdir_root: str | None = Field(
        default=None,
        title="Working directory root",
        description=(
            "Folder under which each sandbox gets its own working directory; "
            "empty for a fresh temporary directory."
        ),
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        title="Environment variables",
        description="Variables the kernel gets, besides PATH, HOME, locale and TZ.",
    )
    startup_timeout_s: float = Field(
        default=60.0,
        gt=0,
        title="Start-up timeout (s)",
        description="Seconds a kernel may take to start and answer.",
    )
    interrupt_grace_s: float = Field(
        default=5.0,
        gt=0,
        title="Interrupt grace (s)",
        description="Seconds a timed-out cell gets to stop after an interrupt before a restart.",
    )

    memory_limit_bytes: int | None = Field(
        default=None,
        gt=0,
        title="Memory limit (bytes)",
        description="Address-space limit of the kernel and its children; empty for none.",
    )
    cpu_time_limit_s: int | None = Field(
        default=None,
        gt=0,
        title="CPU-time limit (s)",
        description="CPU seconds the kernel may use in all; past it the kernel dies.",
    )

    def _config(self) -> LocalKernelConfig:
        return LocalKernelConfig(
            kernel_name=self.kernel_name,
            workdir_root=Path(self.workdir_root) if self.workdir_root else None,
            env=self.env,
            startup_timeout_s=self.startup_timeout_s,
            interrupt_grace_s=self.interrupt_grace_s,
            max_output_bytes=self.max_output_bytes,
            memory_limit_bytes=self.memory_limit_bytes,
            cpu_time_limit_s=self.cpu_time_limit_s,
        )

    async def create(self, labels: Mapping[str, str]) -> LocalKernelSandbox:
        """Start a kernel (see `LocalKernelSandbox.create`)."""
        return await LocalKernelSandbox.create(self._config(), labels)

    async def attach(self, handle: SandboxHandle) -> LocalKernelSandbox:
        """Reach a kernel again (see `LocalKernelSandbox.attach`)."""
        return await LocalKernelSandbox.attach(handle, self._config())

    async def list_sandboxes(self, labels: Mapping[str, str]) -> list[SandboxHandle]:
        """Handles of this machine's live local sandboxes carrying ``labels``."""
        return LocalKernelSandbox.list_handles(labels)
