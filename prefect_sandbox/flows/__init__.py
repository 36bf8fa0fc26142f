"""Prefect flows: run a notebook or a list of stages in one sandbox per flow run, or a notebook
once per parameter set (a sweep); run cells decided as a flow goes in a sandbox session; reap
the sandboxes whose flow run is over.

The flows and the session are imported from their module on first use (module
``__getattr__``, PEP 562), so a caller pays only for the flows it uses (the CLI's ``run`` does
not import the sweep). Manual: docs/concepts.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prefect_sandbox.flows.errors import (
    FixerError,
    GridError,
    ParameterRefusedError,
    PipelineFailedError,
    ReapFailedError,
    SessionFailedError,
    SweepFailedError,
)
from prefect_sandbox.flows.startup import allow_ephemeral_startup, use_local_server_if_asked
from prefect_sandbox.lazy import lazy_names

if TYPE_CHECKING:
    from prefect_sandbox.flows.pipeline import (
        amodeling_pipeline,
        arun_notebook,
        modeling_pipeline,
        run_notebook,
    )
    from prefect_sandbox.flows.reaper import areap_sandboxes, reap_sandboxes
    from prefect_sandbox.flows.session import (
        CellRun,
        SandboxSession,
        SyncSandboxSession,
        sandbox_session,
    )
    from prefect_sandbox.flows.sweep import asweep_notebook, sweep_notebook

# Before any flow call can start Prefect's temporary API server (see `allow_ephemeral_startup`),
# or, where asked, instead of it (see `use_local_server_if_asked`).
allow_ephemeral_startup()
use_local_server_if_asked()

_MODULES = {
    "pipeline": ["amodeling_pipeline", "arun_notebook", "modeling_pipeline", "run_notebook"],
    "reaper": ["areap_sandboxes", "reap_sandboxes"],
    "session": ["CellRun", "SandboxSession", "SyncSandboxSession", "sandbox_session"],
    "sweep": ["asweep_notebook", "sweep_notebook"],
}

__all__ = [
    "CellRun",
    "FixerError",
    "GridError",
    "ParameterRefusedError",
    "PipelineFailedError",
    "ReapFailedError",
    "SandboxSession",
    "SessionFailedError",
    "SweepFailedError",
    "SyncSandboxSession",
    "amodeling_pipeline",
    "areap_sandboxes",
    "arun_notebook",
    "asweep_notebook",
    "modeling_pipeline",
    "reap_sandboxes",
    "run_notebook",
    "sandbox_session",
    "sweep_notebook",
]


__getattr__, __dir__ = lazy_names(__name__, _MODULES, lambda: list(globals()))
