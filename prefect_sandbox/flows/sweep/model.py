"""A sweep's working values: its mode, the arguments every branch shares, and one branch while
it runs. Manual: docs/how-to/sweeps.md.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Literal, cast
from uuid import UUID

from prefect.client.schemas.objects import State
from prefect_aws import S3Bucket

from prefect_sandbox.blocks import BackendBlock
from prefect_sandbox.blocks.base import SandboxBackend
from prefect_sandbox.flows.limits import LiveLimit

__all__ = ["RUN_NOTEBOOK", "SWEEP_NAME", "Branch", "BranchOptions", "Mode", "sweep_mode"]

SWEEP_NAME = "sweep.json"
RUN_NOTEBOOK = "run-notebook"
"""The flow each branch runs (`arun_notebook`), and the flow of a sweep's deployment."""

Mode = Literal["subflow", "dask", "deployment"]
"""How the branches run: subflows in the sweep's process, tasks on a Dask cluster, or flow runs
of a ``run-notebook`` deployment."""


def sweep_mode(deployment: str | None, task_runner: str | None) -> Mode:
    """The mode the sweep's ``deployment`` and ``task_runner`` parameters choose (checked
    already: `prefect_sandbox.options.SweepOptions` refuses both at once)."""
    if deployment is not None:
        return "deployment"
    return "subflow" if task_runner is None else "dask"


@dataclass(frozen=True)
class BranchOptions:
    """The `arun_notebook` arguments every branch of a sweep shares (all but ``parameters``),
    and the sweep's own limit each branch's sandbox also holds a slot of, if any."""

    notebook: str
    inputs: list[str] | None
    artifacts: list[str] | None
    backend: SandboxBackend | None
    storage: S3Bucket | str
    cell_timeout_s: float | None
    sweep_limit: LiveLimit | None = None
    stage_heading_level: int = 1

    def arguments(self) -> dict[str, Any]:
        """The options as `arun_notebook`'s keyword arguments (the limit is not one; the
        heading level only when not the default, so a deployment made before it had that
        parameter still takes the runs)."""
        arguments = {
            "notebook": self.notebook,
            "inputs": self.inputs,
            "artifacts": self.artifacts,
            "backend": cast(BackendBlock | None, self.backend),
            "storage": self.storage,
            "cell_timeout_s": self.cell_timeout_s,
        }
        if self.stage_heading_level != 1:
            arguments["stage_heading_level"] = self.stage_heading_level
        return arguments

    def with_absolute_paths(self) -> BranchOptions:
        """These options with relative local paths (notebook, inputs, storage folder) made
        absolute, for a process with a working directory of its own (a Dask worker)."""

        def absolute(path: str) -> str:
            return path if path.startswith("s3://") else os.path.abspath(path)

        storage = self.storage
        return dataclasses.replace(
            self,
            notebook=absolute(self.notebook),
            inputs=None if self.inputs is None else [absolute(path) for path in self.inputs],
            storage=absolute(storage) if isinstance(storage, str) else storage,
        )


@dataclass
class Branch:
    """One branch while it runs: what its launcher learnt of its flow run."""

    index: int
    parameters: dict[str, Any]
    name: str
    flow_run_id: UUID | None = None
    state: State[Any] | None = None
    error: str | None = None
    """An error raised outside the branch's flow run (e.g. the deployment is unknown)."""

    def ended(self, state: State[Any] | None) -> None:
        """Record the branch's flow run's state (None: unknown), and its flow run id."""
        self.state = state
        if state is not None and state.state_details.flow_run_id is not None:
            self.flow_run_id = state.state_details.flow_run_id
