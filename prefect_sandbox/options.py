"""The arguments of a run and of a sweep, with every rule on them, in one place and without
Prefect.

`RunOptions` (``run-notebook``, ``prefect-sandbox run``) and `SweepOptions` (``sweep-notebook``,
``prefect-sandbox sweep``) are pydantic models that the CLI builds before it imports Prefect and
the flows build from their parameters (`check_options`), so both refuse a value with the same
message, naming the option as its caller spells it: the flows' parameter names by default, the
CLI's flags (`CLI_FLAGS`) under the context `CLI`; `one_line` gives a `ValidationError` as that
line. Rules that look at this machine (a file exists, an SDK is installed, ``E2B_API_KEY`` is
set) apply under `CLI` only, and not to paths a deployment's workers read: a flow finds a
missing file as it reads it and stores what the run made. Manual: docs/reference/cli.md.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Literal, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from prefect_sandbox.s3uri import is_s3_uri, parse_s3_uri
from prefect_sandbox.sandbox.backends import missing_extra
from prefect_sandbox.sandbox.base import checked_timeout_s
from prefect_sandbox.sandbox.errors import UnsafePathError
from prefect_sandbox.sandbox.paths import checked_relative_path

__all__ = [
    "CLI",
    "CLI_FLAGS",
    "BackendKind",
    "RunOptions",
    "SweepOptions",
    "check_options",
    "dask_address",
    "one_line",
]

BackendKind = Literal["local", "e2b", "daytona", "docker"]

CLI: Mapping[str, Any] = {"cli": True}
"""The validation context of the CLI: messages name its flags, and paths on this machine are
checked."""

CLI_FLAGS: Mapping[str, str] = {
    "notebook": "notebook",
    "inputs": "--input",
    "artifacts": "--artifact",
    "storage": "--out",
    "cell_timeout_s": "--cell-timeout",
    "backend": "--backend",
    "backend_block": "--backend-block",
    "docker_image": "--docker-image",
    "aws_credentials": "--aws-credentials",
    "max_live_sandboxes": "--max-live-sandboxes",
    "deployment": "--deployment",
    "task_runner": "--task-runner",
    "metrics_artifact": "--metrics-artifact",
}
"""Each field's flag (the notebook is the positional argument ``notebook``)."""

_SDKS: Mapping[str, tuple[str, str, tuple[str, ...]]] = {
    "e2b": ("E2B", "e2b", ("e2b_code_interpreter",)),
    "daytona": ("Daytona", "daytona", ("daytona",)),
    "docker": ("Docker", "docker", ("docker",)),
}
"""A backend kind's name for people, its extra and the SDK modules the extra installs."""


def _is_cli(info: ValidationInfo) -> bool:
    return bool(info.context and info.context.get("cli"))


def _name(info: ValidationInfo, field: str) -> str:
    """``field`` as the caller spells it: the CLI's flag, or the flows' parameter name."""
    return CLI_FLAGS[field] if _is_cli(info) else field


def dask_address(spec: str) -> str | None:
    """The Dask scheduler a task runner value names: None for ``"dask"`` (a local cluster the
    sweep starts), ``ADDRESS`` for ``"dask:ADDRESS"``.

    Raises:
        ValueError: another value.
    """
    kind, colon, address = spec.partition(":")
    if kind != "dask" or (colon and not address.strip()):
        raise ValueError(
            f"task runner {spec!r} is not 'dask' or 'dask:ADDRESS' (a Dask scheduler's address, "
            "e.g. dask:tcp://127.0.0.1:8786)"
        )
    return address.strip() or None


def _named(name: str, error: ValueError) -> ValueError:
    """``error`` as the same type, its message after the option's ``name``: an
    `UnsafePathError` stays one (with its ``path``), so a caller can tell it apart."""
    if isinstance(error, UnsafePathError):
        return UnsafePathError(f"{name} {error}", path=error.path)
    return ValueError(f"{name} {error}")


def _checked_s3_uri(name: str, uri: str) -> None:
    """Check an ``s3://`` URI given as ``name`` (`parse_s3_uri`).

    Raises:
        ValueError: it names no valid bucket; `UnsafePathError`: its key climbs.
    """
    try:
        parse_s3_uri(uri)
    except ValueError as exc:
        raise _named(name, exc) from None


class RunOptions(BaseModel):
    """The arguments of one run of a notebook (``run-notebook``, ``prefect-sandbox run``).

    The fields carry the flows' parameter names; `CLI_FLAGS` gives each one's flag. The CLI
    alone sets ``backend`` to a kind, ``backend_block``, ``docker_image`` and
    ``aws_credentials``: the flows take a backend block and a storage value instead.

    Raises:
        ValidationError: a rule below is broken; each error's message is one sentence that
            names the option (`one_line`).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    notebook: str | None = None
    """The .ipynb to run (None for stages given as code, ``modeling-pipeline``)."""
    inputs: list[str] = []
    """Local files or folders, or ``s3://`` objects or prefixes, to upload first."""
    artifacts: list[str] = []
    """Glob patterns, relative to the sandbox's working directory, of files to store."""
    storage: str | None = None
    """A local folder, an ``s3://bucket/prefix`` URI or ``s3-bucket/NAME``; None for the
    default (a block given to a flow is not checked here)."""
    cell_timeout_s: float | None = None
    """Seconds each cell may run, -1 for no limit, None for the backend's."""
    backend: BackendKind | None = None
    """The kind of backend the CLI builds or loads; None for the default."""
    backend_block: str | None = None
    """A saved backend block's name, of kind ``backend`` (``local`` when None)."""
    docker_image: str | None = None
    """The image of a ``docker`` backend made without a block."""
    aws_credentials: str | None = None
    """A saved ``AwsCredentials`` block for an ``s3://`` storage; None for the AWS
    environment."""

    @field_validator("cell_timeout_s")
    @classmethod
    def _timeout(cls, value: float | None, info: ValidationInfo) -> float | None:
        checked_timeout_s(value, _name(info, "cell_timeout_s"))
        return value

    @field_validator("artifacts")
    @classmethod
    def _artifacts(cls, value: list[str], info: ValidationInfo) -> list[str]:
        for pattern in value:
            try:
                checked_relative_path(pattern)
            except UnsafePathError as exc:
                raise _named(_name(info, "artifacts"), exc) from None
        return value

    @field_validator("inputs")
    @classmethod
    def _inputs(cls, value: list[str], info: ValidationInfo) -> list[str]:
        for item in value:
            if is_s3_uri(item):
                _checked_s3_uri(_name(info, "inputs"), item)
        return value

    @field_validator("storage")
    @classmethod
    def _storage(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value and is_s3_uri(value):
            _checked_s3_uri(_name(info, "storage"), value)
        return value

    @model_validator(mode="after")
    def _run_rules(self, info: ValidationInfo) -> Self:
        problem = self._backend_problem(info) or self._storage_problem(info)
        if problem is None and _is_cli(info):
            problem = self._local_problem(info)
        if problem:
            raise ValueError(problem)
        return self

    def _remote(self) -> bool:
        """Whether the notebook and inputs are paths on other machines (a sweep's deployment)."""
        return False

    def _backend_problem(self, info: ValidationInfo) -> str | None:
        """The rules on ``backend``, ``backend_block`` and ``docker_image``."""
        name = _name(info, "backend")
        if self.backend is not None and self.backend in _SDKS and _is_cli(info):
            person, extra, modules = _SDKS[self.backend]
            missing = missing_extra(f"the {person} backend", extra, modules)
            if missing:
                return f"{name} {self.backend}: {missing}"
        image = _name(info, "docker_image")
        block = _name(info, "backend_block")
        if self.backend == "docker" and not self.backend_block and not self.docker_image:
            return f"{name} docker needs {block} NAME or {image} IMAGE"
        if self.backend != "docker" and self.docker_image:
            return f"{image} needs {name} docker"
        if self._remote() and self.backend and not self.backend_block:
            return f"{_name(info, 'deployment')} needs a saved backend: {block} NAME (or no {name})"
        e2b_key = os.environ.get("E2B_API_KEY")
        if self.backend == "e2b" and not self.backend_block and _is_cli(info) and not e2b_key:
            return f"{name} e2b needs {block} NAME or the E2B_API_KEY variable"
        return None

    def _storage_problem(self, info: ValidationInfo) -> str | None:
        """The rules on ``aws_credentials`` beside ``storage``."""
        if not self.aws_credentials:
            return None
        if self._remote():
            return (
                f"{_name(info, 'deployment')} sends {_name(info, 'storage')} to the workers as "
                "text: they use their AWS environment"
            )
        if not (self.storage and is_s3_uri(self.storage)):
            return f"{_name(info, 'aws_credentials')} needs an s3:// {_name(info, 'storage')}"
        return None

    def _local_problem(self, info: ValidationInfo) -> str | None:
        """The rules on paths of this machine: the notebook, the inputs, the output folder."""
        if not self._remote():
            if self.notebook is not None and not os.path.isfile(self.notebook):
                return f"{_name(info, 'notebook')} {self.notebook!r} is not a file"
            for item in self.inputs:
                if not is_s3_uri(item) and not os.path.exists(item):
                    return f"{_name(info, 'inputs')} {item!r} does not exist"
        out = self.storage
        if out and not is_s3_uri(out) and os.path.exists(out) and not os.path.isdir(out):
            return f"{_name(info, 'storage')} {out!r} is not a folder"
        return None


class SweepOptions(RunOptions):
    """The arguments of a sweep (``sweep-notebook``, ``prefect-sandbox sweep``): a run's, and
    how its branches run.

    Raises:
        ValidationError: as `RunOptions`, or a rule on the fields below is broken.
    """

    max_live_sandboxes: int | None = None
    """The sweep's sandboxes alive at once at most (subflow and Dask modes; a backend block's
    ``max_live_sandboxes`` caps them across runs)."""
    deployment: str | None = None
    """A ``run-notebook`` deployment whose runs are the branches; None for subflows."""
    task_runner: str | None = None
    """``"dask"`` or ``"dask:ADDRESS"``: branches as tasks on Dask; None for subflows."""
    metrics_artifact: str | None = "metrics.json"
    """The JSON file each branch's metrics are read from; None or ``""`` for none."""

    @field_validator("max_live_sandboxes")
    @classmethod
    def _cap(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and value < 1:
            raise ValueError(f"{_name(info, 'max_live_sandboxes')} must be 1 or more; got {value}")
        return value

    @field_validator("task_runner")
    @classmethod
    def _runner(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None:
            return None
        name = _name(info, "task_runner")
        try:
            dask_address(value)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
        missing = missing_extra("the Dask task runner", "dask", ("distributed", "prefect_dask"))
        if missing:
            raise ValueError(f"{name}: {missing}")
        return value

    @field_validator("metrics_artifact")
    @classmethod
    def _metrics(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value:
            try:
                checked_relative_path(value)
            except UnsafePathError as exc:
                raise _named(_name(info, "metrics_artifact"), exc) from None
        return value

    @model_validator(mode="after")
    def _sweep_rules(self, info: ValidationInfo) -> Self:
        deployment = _name(info, "deployment")
        if self.deployment is not None and self.max_live_sandboxes is not None:
            raise ValueError(
                f"{_name(info, 'max_live_sandboxes')} is not sent to a deployment's runs (their "
                "backend is a saved block): set max_live_sandboxes on that block"
            )
        if self.deployment is not None and self.task_runner is not None:
            raise ValueError(
                f"{_name(info, 'task_runner')} and {deployment} exclude each other: a "
                "deployment's runs go to its work pool's workers"
            )
        return self

    def _remote(self) -> bool:
        return self.deployment is not None


def one_line(error: ValidationError, names: Mapping[str, str] | None = None) -> str:
    """A `ValidationError` of the options as one line: each rule's message (it names its
    option), or, for pydantic's own errors (a wrong type), the option's name and pydantic's
    message; several are joined with ``"; "``.

    Args:
        error: raised by validating `RunOptions` or `SweepOptions`.
        names: each field's name in the caller's words (`CLI_FLAGS`); None for the fields'.
    """
    lines = []
    for problem in error.errors():
        cause = (problem.get("ctx") or {}).get("error")
        if isinstance(cause, ValueError):
            lines.append(str(cause))
            continue
        field = str(problem["loc"][0]) if problem["loc"] else ""
        lines.append(f"{(names or {}).get(field, field)}: {problem['msg']}")
    return "; ".join(lines)


def check_options(model: type[RunOptions], **values: Any) -> None:
    """Validate a flow's parameters with ``model``, as the flows do before any sandbox starts.

    Args:
        model: `RunOptions` or `SweepOptions`.
        values: the flow's parameters that the model has fields for, as the flow got them:
            ``inputs`` or ``artifacts`` None counts as empty, and a ``storage`` that is not
            text (a block) is left unchecked.

    Raises:
        ValueError: the rule's own error when one is broken (an `UnsafePathError` for a path
            that climbs), else one `ValueError` whose line (`one_line`) names each parameter
            at fault.
    """
    for name in ("inputs", "artifacts"):
        if name in values and values[name] is None:
            values[name] = []
    if not isinstance(values.get("storage"), str):
        values.pop("storage", None)
    try:
        model.model_validate(values)
    except ValidationError as exc:
        problems = exc.errors()
        cause = (problems[0].get("ctx") or {}).get("error") if len(problems) == 1 else None
        if isinstance(cause, ValueError):
            raise cause from None
        raise ValueError(one_line(exc)) from None
