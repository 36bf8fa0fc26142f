"""`LocalKernelBackend`: the embedded default, a Jupyter kernel on the flow's own machine.

Manual: docs/backends/local.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field, model_validator

from prefect_sandbox.blocks.base import SandboxBackend, docs_page
from prefect_sandbox.sandbox.backends.kernel.isolation import Isolation
from prefect_sandbox.sandbox.backends.kernel.local import (
    BACKEND_SLUG,
    DEFAULT_MAX_PROCESSES,
    LocalKernelConfig,
    LocalKernelSandbox,
)
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

    With ``warm_pool_size`` above 0, each process keeps that many kernels of this block's
    settings started ahead of time, so that `create` takes milliseconds instead of a kernel
    start: the first create starts the pool (it is a cold start itself), and each create
    refills it in the background. A pooled kernel is as fresh as a cold one (nothing ran in
    it) and is handed out once: killed after its run, never returned. The pool's idle kernels
    end when the process exits, and die with it if it is killed. A block made without
    ``warm_pool_size`` takes ``PREFECT_SANDBOX_WARM_POOL_SIZE``.

    Example:
        ```python
        from prefect_sandbox import LocalKernelBackend

        backend = LocalKernelBackend.load("BLOCK_NAME")
        ```
    """

    _block_type_name = "Local Kernel Sandbox"
    _block_type_slug = "local-kernel-sandbox"
    _documentation_url = docs_page("backends/local/")  # type: ignore[assignment]
    _description = "Runs notebook cells in a local Jupyter kernel that lives for one flow run."
    _sandbox_class = LocalKernelSandbox
    backend_slug = BACKEND_SLUG

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
        description=(
            "Memory the whole sandbox may use, its /tmp, HOME and /dev/shm included, where "
            "the flow runs as root and the host has cgroups (past it Linux's OOM killer ends "
            "the kernel); also what each of its processes may allocate (past it MemoryError), "
            "and the most each of /tmp, HOME and /dev/shm holds. Empty for none."
        ),
    )
    max_processes: int | None = Field(
        default=DEFAULT_MAX_PROCESSES,
        gt=0,
        title="Process limit",
        description=(
            "Processes and threads the whole sandbox may have at once (a fork past it fails), "
            "where the flow runs as root and the host has cgroups. Empty for none."
        ),
    )
    cpu_limit: float | None = Field(
        default=None,
        gt=0,
        title="CPU limit (cores)",
        description=(
            "CPUs' worth of time the whole sandbox may use at once (0.5: half a core), where "
            "the flow runs as root and the host has cgroups. Empty for none."
        ),
    )
    cpu_time_limit_s: int | None = Field(
        default=None,
        gt=0,
        title="CPU-time limit (s)",
        description=(
            "CPU seconds each process of the sandbox may use, not a total; past it that "
            "process dies (the kernel: the sandbox dies). Empty for none."
        ),
    )

    warm_pool_size: int = Field(
        default=0,
        ge=0,
        title="Warm pool size",
        description=(
            "Kernels each process keeps started ahead of time, so a sandbox is ready in "
            "milliseconds; each is used for one run only. 0: none (a cold start each time)."
        ),
    )

    @model_validator(mode="before")
    @classmethod
    def _defaults_from_local_settings(cls, data: Any) -> Any:
        # PREFECT_SANDBOX_ISOLATION and _WARM_POOL_SIZE, for fields the block is made without.
        if not isinstance(data, dict):
            return data
        settings = PrefectSandboxSettings()
        defaults = {"isolation": settings.isolation, "warm_pool_size": settings.warm_pool_size}
        return {**defaults, **data}

    async def fill_warm_pool(self, timeout_s: float = 120.0) -> int:
        """Start this process's warm pool now and wait until it is full, e.g. as a worker starts.

        Args:
            timeout_s: the longest wait, in seconds; kernels not started by then keep starting
                in the background.

        Returns:
            How many ready kernels the pool holds; fewer if the timeout passed or a kernel
            failed to start (logged as a warning; `create` raises what stops it).

        Raises:
            ValueError: ``warm_pool_size`` is 0.
        """
        return await LocalKernelSandbox.fill_warm_pool(self._config(), timeout_s)

    def start_kernel_ahead(self) -> None:
        """Start the kernel of this process's next `create` with this block's settings now, in
        the background (`LocalKernelSandbox.start_ahead`), for a process with other work to do
        first; that `create` takes it. Nothing when ``max_live_sandboxes`` is set (a kernel
        must not be live before its slot) or ``warm_pool_size`` is (the pool serves)."""
        if self.max_live_sandboxes is None:
            LocalKernelSandbox.start_ahead(self._config())

    def _config(self) -> LocalKernelConfig:
        return LocalKernelConfig(
            **self._common_settings(),
            kernel_name=self.kernel_name,
            workdir_root=Path(self.workdir_root) if self.workdir_root else None,
            env=self.env,
            startup_timeout_s=self.startup_timeout_s,
            memory_limit_bytes=self.memory_limit_bytes,
            cpu_time_limit_s=self.cpu_time_limit_s,
            max_processes=self.max_processes,
            cpu_limit=self.cpu_limit,
            isolation=self.isolation,
            network=self.network,
            warm_pool_size=self.warm_pool_size,
            uid_range=PrefectSandboxSettings().uid_range,
        )
