"""`DockerBackend`: a Docker container per sandbox, on the flow's own machine.

Needs the docker SDK (``pip install 'prefect-sandbox[docker]'``) and a Docker daemon on the
machine that runs the flow. Manual: docs/backends/docker.md.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from prefect_sandbox.blocks.base import SandboxBackend, docs_page
from prefect_sandbox.sandbox.backends.kernel.docker import (
    BACKEND_SLUG,
    DockerSandbox,
    DockerSandboxConfig,
)
from prefect_sandbox.settings import PrefectSandboxSettings

__all__ = ["DockerBackend"]


class DockerBackend(SandboxBackend):
    """Runs cells in an ipykernel inside a Docker container that lives for one flow run.

    Each container has no network by default, a read-only root with a fresh ``/tmp``, its
    working directory at ``/work``, no capabilities, a non-root user, limits on memory,
    CPUs and processes, and only the environment variables set here. Containers carry the flow
    run's labels, so the flow's hooks and a reaper find and remove them. The image must start a
    kernel with ``python -m ipykernel_launcher``; ``python -m prefect_sandbox.testing.docker``
    builds one offline.

    Example:
        ```python
        from prefect_sandbox import DockerBackend

        backend = DockerBackend.load("BLOCK_NAME")
        ```
    """

    _block_type_name = "Docker Sandbox"
    _block_type_slug = "docker-sandbox"
    # Docker's organisation avatar, served square by GitHub.
    _documentation_url = docs_page("backends/docker/")  # type: ignore[assignment]
    _description = "Runs notebook cells in a Docker container that lives for one flow run."
    _sandbox_class = DockerSandbox
    backend_slug = BACKEND_SLUG

    image: str = Field(
        title="Image",
        description="The image to run; python on its PATH must have ipykernel installed.",
    )
    docker_host: str | None = Field(
        default=None,
        title="Docker host",
        description=(
            "The daemon's address, e.g. unix:///var/run/docker.sock; empty for DOCKER_HOST "
            "or the default. It must be on the machine that runs the flow."
        ),
    )
    cpus: float | None = Field(
        default=None, gt=0, title="CPUs", description="CPUs a container may use; empty for all."
    )
    memory_limit_bytes: int | None = Field(
        default=2 << 30,
        gt=0,
        title="Memory limit (bytes)",
        description="Memory of a container, /tmp included; past it the kernel dies.",
    )
    pids_limit: int | None = Field(
        default=512,
        gt=0,
        title="Process limit",
        description="Processes and threads a container may run at once; empty for no limit.",
    )
    network_mode: str = Field(
        default="none",
        title="Network mode",
        description="Docker's network mode: none (no network at all), bridge, a network name.",
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        title="Environment variables",
        description="The only variables the kernel gets, besides HOME=/tmp and the image's.",
    )
    workdir_root: str | None = Field(
        default=None,
        title="Working directory root",
        description=(
            "Host folder under which each sandbox's working directory is made; "
            "empty for a fresh temporary directory."
        ),
    )
    startup_timeout_s: float = Field(
        default=60.0,
        gt=0,
        title="Start-up timeout (s)",
        description="Seconds a container may take to start its kernel and answer.",
    )

    def _config(self) -> DockerSandboxConfig:
        return DockerSandboxConfig(
            **self._common_settings(),
            image=self.image,
            docker_host=self.docker_host,
            cpus=self.cpus,
            memory_limit_bytes=self.memory_limit_bytes,
            pids_limit=self.pids_limit,
            network_mode=self.network_mode,
            env=self.env,
            workdir_root=Path(self.workdir_root) if self.workdir_root else None,
            startup_timeout_s=self.startup_timeout_s,
            uid_range=PrefectSandboxSettings().uid_range,
        )
