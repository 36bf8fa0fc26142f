"""Prefect flows: run a notebook or a list of stages in one sandbox per flow run."""

from prefect_sandbox.flows.errors import PipelineFailedError
from prefect_sandbox.flows.pipeline import (
    amodeling_pipeline,
    arun_notebook,
    modeling_pipeline,
    run_notebook,
)

__all__ = [
    "PipelineFailedError",
    "amodeling_pipeline",
    "arun_notebook",
    "modeling_pipeline",
    "run_notebook",
]
