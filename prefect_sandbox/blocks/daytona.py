"""`DaytonaCredentials` and `DaytonaBackend`: sandboxes in Daytona's cloud.

Needs the daytona SDK: ``pip install 'prefect-sandbox[daytona]'``.
Manual: docs/backends/daytona.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from prefect.blocks.abstract import CredentialsBlock
from pydantic import Field, SecretStr, model_validator

from prefect_sandbox.blocks.base import SandboxBackend, docs_page
from prefect_sandbox.sandbox.backends.daytona import (
    BACKEND_SLUG,
    DaytonaSandbox,
    DaytonaSandboxConfig,
    import_sdk,
)

if TYPE_CHECKING:
    from daytona import AsyncDaytona

__all__ = ["DaytonaBackend", "DaytonaCredentials"]

# GitHub serves an organisation's square avatar at this address.
_DOCS_URL = docs_page("backends/daytona/")


class DaytonaCredentials(CredentialsBlock):
    """An API key for Daytona, and where its API is.

    Example:
        ```python
        from prefect_sandbox import DaytonaCredentials

        credentials = DaytonaCredentials.load("BLOCK_NAME")
        ```
    """

    _block_type_name = "Daytona Credentials"
    _block_type_slug = "daytona-credentials"
    _documentation_url = _DOCS_URL  # type: ignore[assignment]
    _description = "An API key for Daytona sandboxes, and the API's URL and region."

    api_key: SecretStr = Field(
        title="API key", description="A Daytona API key, from the Daytona dashboard."
    )
    api_url: str | None = Field(
        default=None,
        title="API URL",
        description="The Daytona API's URL; empty for https://app.daytona.io/api.",
    )
    target: str | None = Field(
        default=None,
        title="Target",
        description="The region sandboxes run in; empty for the organization's default.",
    )

    def get_client(self, *args: Any, **kwargs: Any) -> AsyncDaytona:
        """A new async Daytona client; close it (``await client.close()``) when done.

        Raises:
            BackendNotInstalledError: the ``daytona`` extra is not installed.
        """
        sdk = import_sdk()
        config = sdk.DaytonaConfig(
            api_key=self.api_key.get_secret_value(), api_url=self.api_url, target=self.target
        )
        client: AsyncDaytona = sdk.AsyncDaytona(config)
        return client


class DaytonaBackend(SandboxBackend):
    """Runs cells in a Daytona sandbox: a container in Daytona's cloud, one per flow run.

    Cells run in one stateful Python interpreter of the sandbox; figures, ``display()`` and
    results come back as in Jupyter. Every sandbox is labelled with the flow run and deleted
    when the flow ends; the auto-stop and auto-delete intervals and the lifetime are Daytona's
    own safety nets for when a flow cannot clean up.

    Example:
        ```python
        from prefect_sandbox import DaytonaBackend

        backend = DaytonaBackend.load("BLOCK_NAME")
        ```
    """

    _block_type_name = "Daytona Sandbox"
    _block_type_slug = "daytona-sandbox"
    _documentation_url = _DOCS_URL  # type: ignore[assignment]
    _description = "Runs notebook cells in a Daytona sandbox that lives for one flow run."
    _sandbox_class = DaytonaSandbox
    backend_slug = BACKEND_SLUG

    credentials: DaytonaCredentials | None = Field(
        default=None,
        title="Credentials",
        description=(
            "The Daytona API key block; empty to use the environment variables "
            "DAYTONA_API_KEY, DAYTONA_API_URL and DAYTONA_TARGET."
        ),
    )
    snapshot: str | None = Field(
        default=None,
        title="Snapshot",
        description="The snapshot sandboxes start from; empty for Daytona's default.",
    )
    image: str | None = Field(
        default=None,
        title="Image",
        description="A container image to build sandboxes from, instead of a snapshot.",
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        title="Environment variables",
        description="Variables set in the sandbox.",
    )
    labels: dict[str, str] = Field(
        default_factory=dict,
        title="Labels",
        description="Labels every sandbox gets, besides the flow run's id and name.",
    )
    auto_stop_interval_min: int = Field(
        default=15,
        ge=0,
        title="Auto-stop interval (min)",
        description=(
            "Minutes without activity before Daytona stops a sandbox; 0 never. A running "
            "cell counts as activity."
        ),
    )
    auto_delete_interval_min: int | None = Field(
        default=0,
        ge=0,
        title="Auto-delete interval (min)",
        description="Minutes after a stop before Daytona deletes the sandbox; empty never.",
    )
    max_lifetime_s: int | None = Field(
        default=None,
        gt=0,
        title="Maximum lifetime (s)",
        description=(
            "Seconds after creation when Daytona deletes a sandbox, running or not, rounded up "
            "to whole minutes; never renewed. Empty for no limit."
        ),
    )
    network_block_all: bool = Field(
        default=False,
        title="Block all network access",
        description="Cut the sandbox off from the network.",
    )
    network_allow_list: str | None = Field(
        default=None,
        title="Network allow list",
        description="Comma-separated CIDR ranges the sandbox may reach; empty for any.",
    )
    cpu: int | None = Field(
        default=None, gt=0, title="CPUs", description="vCPUs per sandbox (with an image only)."
    )
    memory_gib: int | None = Field(
        default=None,
        gt=0,
        title="Memory (GiB)",
        description="Memory per sandbox, in GiB (with an image only).",
    )
    disk_gib: int | None = Field(
        default=None,
        gt=0,
        title="Disk (GiB)",
        description="Disk per sandbox, in GiB (with an image only).",
    )
    gpu: int | None = Field(
        default=None, gt=0, title="GPUs", description="GPUs per sandbox (with an image only)."
    )
    create_timeout_s: float = Field(
        default=120.0,
        gt=0,
        title="Create timeout (s)",
        description="Seconds creating a sandbox may take, until it has started.",
    )
    activity_refresh_s: float | None = Field(
        default=None,
        gt=0,
        title="Keep-alive period (s)",
        description=(
            "Seconds between keep-alive calls while a cell runs; empty for a quarter of the "
            "auto-stop interval."
        ),
    )

    @model_validator(mode="after")
    def _check(self) -> DaytonaBackend:
        self._config()
        return self

    def _config(self) -> DaytonaSandboxConfig:
        return DaytonaSandboxConfig(
            **self._common_settings(),
            client_factory=self.credentials.get_client if self.credentials else None,
            snapshot=self.snapshot,
            image=self.image,
            env=self.env,
            labels=self.labels,
            auto_stop_interval_min=self.auto_stop_interval_min,
            auto_delete_interval_min=self.auto_delete_interval_min,
            max_lifetime_s=self.max_lifetime_s,
            network_block_all=self.network_block_all,
            network_allow_list=self.network_allow_list,
            cpu=self.cpu,
            memory_gib=self.memory_gib,
            disk_gib=self.disk_gib,
            gpu=self.gpu,
            create_timeout_s=self.create_timeout_s,
            activity_refresh_s=self.activity_refresh_s,
        )
