"""`E2BCredentials` and `E2BBackend`: cells in E2B cloud sandboxes (the ``e2b`` extra).

Manual: docs/backends/e2b.md.
"""

from __future__ import annotations

import os
from typing import Any, Self

from prefect.blocks.abstract import CredentialsBlock
from pydantic import Field, SecretStr

from prefect_sandbox.blocks.base import SandboxBackend, docs_page
from prefect_sandbox.sandbox.backends.e2b import (
    BACKEND_SLUG,
    DEFAULT_INTERRUPT_SETTLE_S,
    DEFAULT_WORKDIR,
    E2BConfig,
    E2BSandbox,
    import_sdk,
)

__all__ = ["E2BBackend", "E2BCredentials"]

# GitHub serves an organisation's square avatar at this address.
_DOCS_URL = docs_page("backends/e2b/")


class E2BCredentials(CredentialsBlock):
    """An E2B API key and, optionally, where E2B's API and sandboxes are reached.

    Empty endpoint settings fall back to the SDK's environment variables (``E2B_DOMAIN``,
    ``E2B_API_URL``, ``E2B_SANDBOX_URL``) and then to E2B's cloud.

    Example:
        ```python
        from prefect_sandbox import E2BCredentials

        credentials = E2BCredentials.load("BLOCK_NAME")
        ```
    """

    _block_type_name = "E2B Credentials"
    _block_type_slug = "e2b-credentials"
    _documentation_url = _DOCS_URL  # type: ignore[assignment]
    _description = "An API key for E2B cloud sandboxes, and optional endpoint settings."

    api_key: SecretStr = Field(
        title="API key",
        description="The E2B API key (e2b_...), from the E2B dashboard.",
    )
    domain: str | None = Field(
        default=None,
        title="Domain",
        description="E2B's domain, e.g. e2b.app; empty for the SDK's default.",
    )
    api_url: str | None = Field(
        default=None,
        title="API URL",
        description="Base URL of the control-plane API; empty to derive it from the domain.",
    )
    sandbox_url: str | None = Field(
        default=None,
        title="Sandbox URL",
        description="Base URL for every sandbox port (e.g. the offline emulator's); empty "
        "for E2B's per-sandbox hosts.",
    )
    request_timeout_s: float | None = Field(
        default=None,
        gt=0,
        title="Request timeout (s)",
        description="Seconds an API call may take; empty for the SDK's default (60 s).",
    )

    @classmethod
    def from_environment(cls) -> Self:
        """The credentials the SDK's variables give: ``E2B_API_KEY`` (required),
        ``E2B_API_URL``, ``E2B_SANDBOX_URL`` and ``E2B_DOMAIN``.

        Raises:
            KeyError: ``E2B_API_KEY`` is not set.
        """
        return cls(
            api_key=SecretStr(os.environ["E2B_API_KEY"]),
            api_url=os.environ.get("E2B_API_URL"),
            sandbox_url=os.environ.get("E2B_SANDBOX_URL"),
            domain=os.environ.get("E2B_DOMAIN"),
        )

    def get_client(self) -> Any:
        """An ``e2b_code_interpreter.E2B`` client bound to these credentials.

        Raises:
            BackendNotInstalledError: the ``e2b`` extra is not installed.
        """
        sdk = import_sdk()
        options: dict[str, Any] = {"api_key": self.api_key.get_secret_value()}
        for name, value in (
            ("domain", self.domain),
            ("api_url", self.api_url),
            ("sandbox_url", self.sandbox_url),
            ("request_timeout", self.request_timeout_s),
        ):
            if value is not None:
                options[name] = value
        return sdk.E2B(**options)


class E2BBackend(SandboxBackend):
    """Runs cells in an E2B cloud sandbox (a Firecracker micro-VM) that lives for one flow run.

    Each sandbox carries the flow run's id and name and our marker as metadata, and a lifetime
    renewed before and during each cell: a sandbox whose flow died expires on its own.

    Example:
        ```python
        from prefect_sandbox import E2BBackend

        backend = E2BBackend.load("BLOCK_NAME")
        ```
    """

    _block_type_name = "E2B Sandbox"
    _block_type_slug = "e2b-sandbox"
    _documentation_url = _DOCS_URL  # type: ignore[assignment]
    _description = "Runs notebook cells in an E2B cloud sandbox that lives for one flow run."
    _sandbox_class = E2BSandbox
    backend_slug = BACKEND_SLUG

    credentials: E2BCredentials = Field(
        title="Credentials", description="The E2B credentials block to use."
    )
    template: str | None = Field(
        default=None,
        title="Template",
        description="The sandbox template; empty for code-interpreter-v1.",
    )
    lifetime_s: int = Field(
        default=600,
        gt=0,
        title="Lifetime (s)",
        description="Seconds a sandbox lives unless renewed; renewed before and during cells.",
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        title="Environment variables",
        description="Variables set in the whole sandbox.",
    )
    metadata: dict[str, str] = Field(
        default_factory=dict,
        title="Metadata",
        description="Metadata for each sandbox, besides the flow run's id, name and marker.",
    )
    allow_internet_access: bool | None = Field(
        default=None,
        title="Allow internet access",
        description="False cuts sandboxes off the internet; empty for E2B's default.",
    )
    workdir: str = Field(
        default=DEFAULT_WORKDIR,
        title="Working directory",
        description="Absolute path inside the sandbox where cells run and files go.",
    )
    request_retries: int = Field(
        default=3,
        ge=0,
        title="Request retries",
        description=(
            "Retries of an idempotent request (a file transfer or listing) that met a transient "
            "error, after the first try."
        ),
    )
    interrupt_settle_s: float = Field(
        default=DEFAULT_INTERRUPT_SETTLE_S,
        gt=0,
        title="Interrupt settle time",
        description=(
            "Seconds between closing a timed-out cell and the probe that checks the kernel is "
            "idle (E2B interrupts the kernel that long after); doubled after each probe that "
            "gets no answer, until interrupt_grace_s runs out."
        ),
    )

    def _config(self) -> E2BConfig:
        return E2BConfig(
            **self._common_settings(),
            client_factory=self.credentials.get_client,
            template=self.template,
            lifetime_s=self.lifetime_s,
            env=self.env,
            metadata=self.metadata,
            allow_internet_access=self.allow_internet_access,
            workdir=self.workdir,
            request_retries=self.request_retries,
            interrupt_settle_s=self.interrupt_settle_s,
        )
