"""The interface every sandbox backend block implements.

Manual: docs/backends/index.md.
"""

from __future__ import annotations

import copy
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar

from prefect.blocks.core import Block
from pydantic import Field, field_validator, model_validator
from pydantic.json_schema import GenerateJsonSchema, JsonSchemaMode

from prefect_sandbox.sandbox.base import (
    Sandbox,
    SandboxConfig,
    SandboxHandle,
    checked_timeout_s,
)
from prefect_sandbox.sandbox.errors import SandboxUnavailableError
from prefect_sandbox.sandbox.outputs import DEFAULT_MAX_OUTPUT_CHARS
from prefect_sandbox.sandbox.retries import async_retrying
from prefect_sandbox.settings import DEFAULT_CELL_TIMEOUT_S, PrefectSandboxSettings

__all__ = ["DOCS_URL", "SandboxBackend", "create_refused", "docs_page"]

DOCS_URL: str | None = None
"""Where the documentation site (``docs/``, built by MkDocs) is published, ``site_url`` in
``mkdocs.yml``; None while it is published nowhere. The blocks' "View Docs" link in the Prefect
UI points at its pages, and is left out while this is None."""


def create_refused(error: BaseException) -> bool:
    """Whether ``error`` is a create the service refused with 429, which made no sandbox."""
    return (
        isinstance(error, SandboxUnavailableError)
        and error.operation == "create"
        and error.status_code == 429
        and error.sandbox_id is None
    )


def docs_page(path: str) -> str | None:
    """The published address of a documentation page.

    Args:
        path: the page's path under ``docs/``, as MkDocs serves it (``backends/e2b/`` for
            ``docs/backends/e2b.md``).

    Returns:
        ``DOCS_URL`` followed by ``path``; None while `DOCS_URL` is.
    """
    return None if DOCS_URL is None else DOCS_URL + path


class SandboxBackend(Block, ABC):
    """Settings of one kind of sandbox, and the factory for its sandboxes.

    Subclasses are the blocks users save: `LocalKernelBackend`, `DockerBackend`, `E2BBackend`,
    `DaytonaBackend`.
    Each names its `Sandbox` class and turns its fields into that class's config; the factories
    here call the class's own (`Sandbox.create`, `Sandbox.attach`, `Sandbox.list_handles`).
    Flows and tasks take a backend plus a `SandboxHandle`, never a live sandbox.

    ``cell_timeout_s``, ``max_output_chars`` and ``max_live_sandboxes``, when not given, take
    this process's `PrefectSandboxSettings` (``PREFECT_SANDBOX_CELL_TIMEOUT_S``,
    ``PREFECT_SANDBOX_MAX_OUTPUT_CHARS``, ``PREFECT_SANDBOX_MAX_LIVE_SANDBOXES``) as the block is
    made; the defaults below are those of an unset environment, and what the Prefect UI offers.
    """

    _sandbox_class: ClassVar[type[Sandbox]]
    """The backend's `Sandbox` class."""
    backend_slug: ClassVar[str]
    """The backend's slug, as its sandboxes' `SandboxHandle.backend` gives it (``"local"``,
    ``"e2b"``, ``"daytona"``, ``"docker"``); it names the backend's live-sandbox limit."""

    cell_timeout_s: float | None = Field(
        default=DEFAULT_CELL_TIMEOUT_S,
        title="Default cell timeout (s)",
        description="Seconds a cell may run before it is interrupted; -1 or empty for no limit.",
    )

    max_output_chars: int | None = Field(
        default=DEFAULT_MAX_OUTPUT_CHARS,
        gt=0,
        title="Max output characters per cell",
        description="Cap on each cell's stored and logged output; start and end are kept.",
    )

    interrupt_grace_s: float = Field(
        default=5.0,
        gt=0,
        title="Interrupt grace (s)",
        description=(
            "Seconds a timed-out cell gets to stop after an interrupt before the sandbox "
            "escalates (a second interrupt where it has one, then a restart, state lost)."
        ),
    )

    max_live_sandboxes: int | None = Field(
        default=None,
        gt=0,
        title="Max live sandboxes",
        description=(
            "Cap on this backend's sandboxes alive at once, across every flow run using this "
            "Prefect API (the global concurrency limit prefect-sandbox:<backend>, created with "
            "this value on first use, never rewritten by a run); a run waits for a free slot "
            "before it makes its sandbox. Empty for no cap."
        ),
    )

    @classmethod
    def model_json_schema(  # type: ignore[override]  # Prefect's Block signature, as it is
        cls,
        by_alias: bool = True,
        ref_template: str = "#/definitions/{model}",
        schema_generator: type[GenerateJsonSchema] = GenerateJsonSchema,
        mode: JsonSchemaMode = "validation",
    ) -> dict[str, Any]:
        """Prefect's block schema, with a backend's own fields (Docker's image, E2B's
        credentials and template) before the tuning fields every backend shares, here: the
        UI's block form orders its fields by their ``position``, which Prefect numbers in
        declaration order, the base class's fields first."""
        schema = super().model_json_schema(by_alias, ref_template, schema_generator, mode)
        properties: dict[str, Any] = schema.get("properties", {})
        shared = [name for name in properties if name in SandboxBackend.model_fields]
        order = [name for name in properties if name not in shared] + shared
        schema["properties"] = {
            name: {**properties[name], "position": position} for position, name in enumerate(order)
        }
        return schema

    def _common_settings(self) -> dict[str, Any]:
        """The `SandboxConfig` fields every backend's config takes from these blocks."""
        return {
            "interrupt_grace_s": self.interrupt_grace_s,
            "max_output_chars": self.max_output_chars,
        }

    @field_validator("cell_timeout_s")
    @classmethod
    def _check_cell_timeout(cls, value: float | None) -> float | None:
        checked_timeout_s(value, "cell_timeout_s")
        return value

    @model_validator(mode="before")
    @classmethod
    def _defaults_from_settings(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        settings = PrefectSandboxSettings()
        defaults = {
            "cell_timeout_s": settings.cell_timeout_s,
            "max_output_chars": settings.max_output_chars,
            "max_live_sandboxes": settings.max_live_sandboxes,
        }
        return {**defaults, **data}

    @abstractmethod
    def _config(self) -> SandboxConfig:
        """The settings of `_sandbox_class`, built from this block's fields.

        Raises:
            ValueError: a field holds a value the backend cannot use.
        """

    async def create(self, labels: Mapping[str, str]) -> Sandbox:
        """Make a new sandbox carrying ``labels`` (see `Sandbox.create`).

        A create the service refuses with 429 (its rate limit on creates, or E2B's quota of
        live sandboxes: nothing was made) is asked again after the ``Retry-After`` it names
        (else 1 s doubling, up to 30 s), for ``PREFECT_SANDBOX_CREATE_WAIT_S`` in all.

        Returns:
            The live sandbox.

        Raises:
            SandboxUnavailableError: still refused with 429 once that time is spent (its
                ``status_code``; the message says how long it was asked and what to set), or
                busy or unreachable through the backend's own retries.
            SandboxError: the backend could not make it.
        """
        wait_s = PrefectSandboxSettings().create_wait_s
        start = time.monotonic()
        retrying = async_retrying(
            attempts=sys.maxsize,
            retry_if=create_refused,
            first_delay_s=1.0,
            what=f"{self.backend_slug} create",
            deadline=start + wait_s,
        )
        try:
            async for attempt in retrying:
                with attempt:
                    return await self._sandbox_class.create(self._config(), labels)
        except SandboxUnavailableError as exc:
            if not create_refused(exc):
                raise
            refused = copy.copy(exc)
            refused.message = (
                f"{exc.message} (refused for {time.monotonic() - start:.0f} s of "
                f"PREFECT_SANDBOX_CREATE_WAIT_S={wait_s:g}: the service's rate limit on creates, "
                "or its quota of live sandboxes; set the block's max_live_sandboxes under the "
                "quota so that runs wait for a slot instead)"
            )
            refused.args = (refused.message,)
            raise refused from exc
        raise AssertionError("unreachable: tenacity reraises")

    async def attach(self, handle: SandboxHandle) -> Sandbox:
        """Reach the sandbox behind ``handle`` again (see `Sandbox.attach`).

        Raises:
            SandboxNotFoundError: it was killed or expired.
        """
        return await self._sandbox_class.attach(handle, self._config())

    async def list_sandboxes(self, labels: Mapping[str, str]) -> list[SandboxHandle]:
        """Handles of live sandboxes whose labels include ``labels``, for cleanup (see
        `Sandbox.list_handles`)."""
        return await self._sandbox_class.list_handles(self._config(), labels)
