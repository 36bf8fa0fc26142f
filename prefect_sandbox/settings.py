"""Per-process settings, from ``PREFECT_SANDBOX_*`` environment variables (pydantic-settings).

Blocks hold what a user saves per deployment; these settings hold the defaults of one process:
the flows, the blocks and the CLI read them when they are given nothing, and an explicit
argument (a flow parameter, a block field, a CLI flag) always wins. They are read where they
are used, by building `PrefectSandboxSettings()` there, never at import: a variable set before
a run counts, whatever was imported earlier. docs/reference/settings.md lists every variable.

``none`` (any case) sets a limit to None: no limit (``-1`` too, for the cell timeout).
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from prefect_sandbox.sandbox.backends.kernel.isolation import Isolation
from prefect_sandbox.sandbox.backends.kernel.uids import DEFAULT_UID_RANGE, parse_uid_range
from prefect_sandbox.sandbox.base import checked_timeout_s
from prefect_sandbox.sandbox.outputs import DEFAULT_MAX_OUTPUT_CHARS
from prefect_sandbox.sandbox.paths import (
    DEFAULT_MAX_ARTIFACT_BYTES,
    DEFAULT_MAX_TOTAL_ARTIFACT_BYTES,
)

__all__ = [
    "DEFAULT_CELL_TIMEOUT_S",
    "DEFAULT_EPHEMERAL_STARTUP_TIMEOUT_S",
    "DEFAULT_LOCAL_SERVER_IDLE_STOP_S",
    "DEFAULT_STORAGE",
    "PrefectSandboxSettings",
]

DEFAULT_CELL_TIMEOUT_S = 600.0
"""Seconds a cell may run when neither a block, an argument nor the environment says."""
DEFAULT_EPHEMERAL_STARTUP_TIMEOUT_S = 90
"""Seconds Prefect's temporary API server may take to start: it takes 6-11 s on an idle 2-core
machine and over 20 s (Prefect's default) on a busy one."""
DEFAULT_LOCAL_SERVER_IDLE_STOP_S = 1800.0
"""Seconds the local Prefect server kept for the user stays up unused (30 minutes)."""
DEFAULT_STORAGE = "prefect-sandbox-output"
"""The folder flows and the CLI store files under when neither they nor the environment say."""


class PrefectSandboxSettings(BaseSettings):
    """Defaults for one process, each read from ``PREFECT_SANDBOX_<FIELD NAME>``.

    Raises:
        pydantic.ValidationError: a variable holds a value its field refuses (it names it).

    Example:
        ```python
        from prefect_sandbox.settings import PrefectSandboxSettings

        timeout_s = PrefectSandboxSettings().cell_timeout_s
        ```
    """

    model_config = SettingsConfigDict(env_prefix="PREFECT_SANDBOX_", validate_default=True)

    backend_block: str | None = Field(
        default=None,
        description=(
            "The saved backend block the flows (and the CLI without --backend) use when given "
            "none, as <block-type-slug>/<block-name>, e.g. e2b-sandbox/prod; unset: a local "
            "kernel with the defaults below."
        ),
    )

    @field_validator("backend_block")
    @classmethod
    def _block_slug_and_name(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"[a-z0-9-]+/\S.*", value):
            raise ValueError("must be <block-type-slug>/<block-name>, e.g. e2b-sandbox/prod")
        return value

    cell_timeout_s: float | None = Field(
        default=DEFAULT_CELL_TIMEOUT_S,
        description=(
            "Seconds a cell may run: the default of every backend block's cell_timeout_s "
            "(a flow's cell_timeout_s or the CLI's --cell-timeout wins over it); -1 or none: "
            "no limit."
        ),
    )
    max_output_chars: int | None = Field(
        default=DEFAULT_MAX_OUTPUT_CHARS,
        gt=0,
        description=(
            "Cap on each cell's stored and logged output, in characters of text: the default "
            "of every backend block's max_output_chars; none: no cap."
        ),
    )

    max_live_sandboxes: int | None = Field(
        default=None,
        gt=0,
        description=(
            "Cap on sandboxes of one backend alive at once, across every flow run using this "
            "Prefect API: the default of every backend block's max_live_sandboxes; none or "
            "unset: no cap."
        ),
    )

    max_artifact_bytes: int | None = Field(
        default=DEFAULT_MAX_ARTIFACT_BYTES,
        gt=0,
        description=(
            "The largest file collected from a sandbox as an artifact, in bytes (default 1 GiB); "
            "a larger one is skipped with a warning naming it. none: no cap."
        ),
    )

    max_total_artifact_bytes: int | None = Field(
        default=DEFAULT_MAX_TOTAL_ARTIFACT_BYTES,
        gt=0,
        description=(
            "The most bytes of artifacts one run collects from its sandbox, all files together "
            "(default 4 GiB); a file past it is skipped with a warning naming it, and smaller "
            "ones that still fit are collected. none: no cap."
        ),
    )

    @field_validator(
        "cell_timeout_s",
        "max_output_chars",
        "max_live_sandboxes",
        "max_artifact_bytes",
        "max_total_artifact_bytes",
        "local_server_idle_stop_s",
        mode="before",
    )
    @classmethod
    def _none_is_no_limit(cls, value: object) -> object:
        return None if isinstance(value, str) and value.strip().lower() == "none" else value

    @field_validator("cell_timeout_s")
    @classmethod
    def _check_cell_timeout(cls, value: float | None) -> float | None:
        checked_timeout_s(value, "cell_timeout_s")
        return value

    storage: str = Field(
        default=DEFAULT_STORAGE,
        min_length=1,
        description=(
            "Where the flows and the CLI store files when given no storage / --out: a folder, "
            "s3://bucket/prefix, or s3-bucket/<name> for a saved S3Bucket block."
        ),
    )
    isolation: Isolation = Field(
        default="bubblewrap",
        description=(
            "How local kernels are isolated when their block does not say: bubblewrap (own "
            "mount, PID and network namespaces) or none (a plain process of this user)."
        ),
    )
    cancel_poll_s: float = Field(
        default=5.0,
        gt=0,
        description=(
            "Seconds between a pipeline's reads of its flow run's state: a Cancelling state "
            "set through the API or UI stops the run (its cell cancelled, what it made stored, "
            "the run Cancelled) within this, plus the kill and storing, wherever it runs."
        ),
    )
    setup_attempts: int = Field(
        default=3,
        ge=1,
        description=(
            "How many sandboxes a run may make to get one set up: a transient failure before "
            "the first cell (the create, its code context or first execution, the inputs' "
            "upload) kills that sandbox and makes a fresh one, after a back-off, up to this "
            "many set-ups in all; 1: none again."
        ),
    )
    create_wait_s: float = Field(
        default=300.0,
        gt=0,
        description=(
            "Seconds a run keeps asking for its sandbox while the service refuses creates "
            "with 429 (its rate limit on creates, or E2B's quota of live sandboxes reached): "
            "each try waits the Retry-After the service names, else 1 s doubling up to 30 s. "
            "No sandbox was made, so these tries are not set-ups; the refusal that outlasts "
            "this fails the run."
        ),
    )
    transfer_retry_budget_s: float = Field(
        default=120.0,
        gt=0,
        description=(
            "Seconds a run may spend, all its artifacts together, waiting out rate limits "
            "(429) and other transient failures of listing and downloading its artifacts "
            "once the backend's own retries gave up; a file still not fetched then is named "
            "in summary.json's warnings."
        ),
    )
    warm_pool_size: int = Field(
        default=0,
        ge=0,
        description=(
            "How many ready local kernels each process keeps per kernel configuration when "
            "its block does not say: the default of LocalKernelBackend's warm_pool_size; "
            "0: none, every sandbox is a cold start."
        ),
    )
    ephemeral_startup_timeout_s: int = Field(
        default=DEFAULT_EPHEMERAL_STARTUP_TIMEOUT_S,
        gt=0,
        description=(
            "Seconds Prefect's temporary API server (started when PREFECT_API_URL is unset) "
            "may take to start, for the CLI and for flows called from Python; read when "
            "prefect_sandbox.flows is imported. Prefect's own "
            "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS wins when set."
        ),
    )
    local_server: Literal["cli", "always", "never"] = Field(
        default="cli",
        description=(
            "Which runs with no PREFECT_API_URL use the local Prefect server kept for the user "
            "(started on first use, found again by later runs, stopped after "
            "PREFECT_SANDBOX_LOCAL_SERVER_IDLE_STOP_S idle): cli, the prefect-sandbox command's; "
            "always, flows called from Python too (read when prefect_sandbox.flows is "
            "imported); never, none (each run starts Prefect's temporary server)."
        ),
    )
    local_server_idle_stop_s: float | None = Field(
        default=DEFAULT_LOCAL_SERVER_IDLE_STOP_S,
        gt=0,
        description=(
            "Seconds the local Prefect server stays up with no request and no run starting, "
            "before it stops itself; read by the run that starts it. none: it stays until "
            "`prefect-sandbox server stop`."
        ),
    )
    input_roots: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description=(
            "Folders on this machine, and s3:// prefixes, under which a deployment run's own "
            "parameters may name its notebook and inputs, comma-separated, e.g. "
            "/srv/notebooks,s3://team-data/inputs; a path is checked with its links resolved. "
            "Empty: none (only paths the deployment itself sets). Runs that are not deployment "
            "runs (the CLI, a flow called from Python) read what they are given."
        ),
    )

    output_roots: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description=(
            "Folders on this machine, and s3:// prefixes, under which a deployment run's own "
            "parameters may name its storage as a folder or an s3:// URI, comma-separated, e.g. "
            "/srv/results,s3://team-results/runs; a folder is checked with its links resolved. "
            "Empty: none (only a saved S3Bucket block, or the storage the deployment sets). "
            "Runs that are not deployment runs store where they are told."
        ),
    )

    uid_range: Annotated[tuple[int, int], NoDecode] = Field(
        default=DEFAULT_UID_RANGE,
        description=(
            "The host uids, FIRST-LAST, that local sandboxes take one each of when the flow "
            "runs as root (under bubblewrap): no two live sandboxes share one, so neither can "
            "use up the other's per-uid kernel counts. Default 1879048192-1879113727."
        ),
    )

    @field_validator("uid_range", mode="before")
    @classmethod
    def _parse_uid_range(cls, value: object) -> object:
        return parse_uid_range(value) if isinstance(value, str) else value

    @field_validator("input_roots", "output_roots", mode="before")
    @classmethod
    def _comma_separated(cls, value: object) -> object:
        if isinstance(value, str):
            return [root.strip() for root in value.split(",") if root.strip()]
        return value
