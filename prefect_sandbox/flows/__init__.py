"""Prefect flows: run a notebook or a list of stages in one sandbox per flow run; reap the
sandboxes whose flow run is over."""

from prefect_sandbox.flows.errors import PipelineFailedError, ReapFailedError
from prefect_sandbox.flows.pipeline import (
    amodeling_pipeline,
    arun_notebook,
    modeling_pipeline,
    run_notebook,
)
from prefect_sandbox.flows.reaper import areap_sandboxes, reap_sandboxes

__all__ = [
    "PipelineFailedError",
    "ReapFailedError",
    "amodeling_pipeline",
    "areap_sandboxes",
    "arun_notebook",
    "modeling_pipeline",
    "reap_sandboxes",
    "run_notebook",
]
