"""Prefect flows: run a notebook or a list of stages in one sandbox per flow run, or a notebook
once per parameter set (a sweep); reap the sandboxes whose flow run is over."""

from prefect_sandbox.flows.errors import (
    GridError,
    ParameterRefusedError,
    PipelineFailedError,
    ReapFailedError,
    SweepFailedError,
)
from prefect_sandbox.flows.pipeline import (
    amodeling_pipeline,
    arun_notebook,
    modeling_pipeline,
    run_notebook,
)
from prefect_sandbox.flows.reaper import areap_sandboxes, reap_sandboxes
from prefect_sandbox.flows.sweep import asweep_notebook, sweep_notebook

__all__ = [
    "GridError",
    "ParameterRefusedError",
    "PipelineFailedError",
    "ReapFailedError",
    "SweepFailedError",
    "amodeling_pipeline",
    "areap_sandboxes",
    "arun_notebook",
    "asweep_notebook",
    "modeling_pipeline",
    "reap_sandboxes",
    "run_notebook",
    "sweep_notebook",
]
