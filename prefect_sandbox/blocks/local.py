"""`LocalKernelBackend`: the embedded default, a Jupyter kernel on the flow's own machine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field, model_validator

from prefect_sandbox.blocks.base import SandboxBackend
from prefect_sandbox.sandbox.backends.local import (
    BACKEND_SLUG,
    LocalKernelConfig,
    LocalKernelSandbox,
)
from prefect_sandbox.sandbox.isolation import Isolation
from prefect_sandbox.settings import PrefectSandboxSettings

__all__ = ["LocalKernelBackend"]


class LocalKernelBackend(SandboxBackend):
    """Runs cells in an ipykernel on the machine that runs the flow. Needs no account.

    Each sandbox is a fresh kernel process in its own working directory. The kernel gets no
    stdin and none of the host's environment beyond ``PATH``, ``HOME``, locale and ``TZ``, plus
    the variables set here (under bubblewrap ``HOME`` is an empty folder of its own).

    By default it runs under bubblewrap (``isolation="bubblewrap"``, needs the ``bwrap``
    program): it sees only its working directory, the system's ``/usr`` and its
    Python environment, its own processes, and no network but loopback, so a cell cannot read
    the user's files or Prefect's database, reach the Prefect API, or touch other sandboxes.
    It still shares this machine's kernel; for a stronger boundary use Docker, E2B or Daytona.
    Creating a sandbox fails with `SandboxUnavailableError` where bubblewrap cannot run;
    ``isolation="none"`` runs the kernel as a plain process of this user, with no boundary.
    A block made without ``isolation`` takes ``PREFECT_SANDBOX_ISOLATION`` (see
    `PrefectSandboxSettings`).

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
    _sandbox_class = LocalKernelSandbox
    backend_slug = BACKEND_SLUG

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

    isolation: Isolation = Field(
        default="bubblewrap",
        title="Isolation",
        description=(
            "bubblewrap: the kernel sees only its working directory, /usr and its Python "
            "environment, its own processes, and no network (needs the bwrap program). "
            "none: a plain process of this user that can read everything the user can."
        ),
    )
    network: bool = Field(
        default=False,
        title="Network",
        description=(
            "Under bubblewrap, let the kernel use this machine's network (its ports, the "
            "Prefect API, the internet); off, it has only its own loopback."
        ),
    )

    @model_validator(mode="before")
    @classmethod
    def _isolation_from_settings(cls, data: Any) -> Any:
        # PREFECT_SANDBOX_ISOLATION, when the block is made without an isolation.
        if isinstance(data, dict) and "isolation" not in data:
            return {**data, "isolation": PrefectSandboxSettings().isolation}
        return data

    def _config(self) -> LocalKernelConfig:
        return LocalKernelConfig(
            **self._common_settings(),
            kernel_name=self.kernel_name,
            workdir_root=Path(self.workdir_root) if self.workdir_root else None,
            env=self.env,
            startup_timeout_s=self.startup_timeout_s,
            memory_limit_bytes=self.memory_limit_bytes,
            cpu_time_limit_s=self.cpu_time_limit_s,
            isolation=self.isolation,
            network=self.network,
        )
