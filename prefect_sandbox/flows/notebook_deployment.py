"""A deployment of ``run-notebook`` made for one notebook: its Run form has a typed field per
notebook parameter.

The generic ``run-notebook`` deployment takes ``parameters`` as a free-form dict. This one's
parameter schema (Prefect's ``parameter_openapi_schema``, which the UI draws as the Run form and
the server validates each new flow run against) is the flow's own, with ``notebook`` defaulting to
the notebook's path and ``parameters`` an object of the notebook's parameters
(`prefect_sandbox.sandbox.parameter_schema`): types, defaults and comments. A run whose
parameter has the wrong type is refused by the server as it is created (HTTP 409, ``Validation
failed for field 'parameters.NAME'``), before any worker takes it. The flow and its
entrypoint are those of ``run-notebook``; see docs/how-to/deployments.md.
"""

from __future__ import annotations

import copy
import os
import re
from pathlib import Path
from typing import Any
from uuid import UUID

from prefect.client.orchestration import get_client
from prefect.utilities.asyncutils import run_coro_as_sync
from prefect.utilities.callables import parameter_schema

from prefect_sandbox.flows.pipeline import arun_notebook
from prefect_sandbox.sandbox.notebook import read_notebook
from prefect_sandbox.sandbox.parameter_schema import notebook_parameters_schema

__all__ = [
    "adeploy_notebook",
    "default_deployment_name",
    "deploy_notebook",
    "notebook_deployment_schema",
]

ENTRYPOINT = "prefect_sandbox.flows.pipeline:arun_notebook"
"""The deployments' entrypoint: the ``run-notebook`` flow in the installed package."""


def notebook_deployment_schema(notebook: str | Path) -> dict[str, Any]:
    """The ``run-notebook`` flow's parameter schema, typed for one notebook.

    Args:
        notebook: the .ipynb whose cell tagged ``parameters`` gives the fields.

    Returns:
        A JSON Schema (Prefect's ``ParameterSchema`` as a dict): ``notebook`` defaults to the
        path given, ``parameters`` is `notebook_parameters_schema` of the notebook (with the
        flow's description of that parameter), every other field is the flow's.

    Raises:
        NotebookError: the notebook cannot be read, or its parameters cell is not valid Python.
    """
    schema = parameter_schema(arun_notebook).model_dump(mode="json", exclude_none=True)
    fields = schema["properties"]
    fields["notebook"]["default"] = str(notebook)
    typed = notebook_parameters_schema(read_notebook(Path(notebook)))
    described = fields["parameters"].get("description")
    fields["parameters"] = {
        **copy.deepcopy(typed),
        "description": f"{described} Typed from the notebook {Path(notebook).name}.",
        "position": fields["parameters"]["position"],
    }
    return schema


def default_deployment_name(notebook: str | Path) -> str:
    """The notebook's file name without ``.ipynb``, as a slug: ``CO2 Forecast.ipynb`` ->
    ``co2-forecast``."""
    return re.sub(r"[^A-Za-z0-9_-]+", "-", Path(notebook).stem).strip("-").lower() or "notebook"


async def adeploy_notebook(
    notebook: str | Path,
    work_pool_name: str,
    *,
    name: str | None = None,
    inputs: list[str] | None = None,
    artifacts: list[str] | None = None,
    storage: str | None = None,
    cell_timeout_s: float | None = None,
    description: str | None = None,
) -> UUID:
    """Create (or update) a deployment of ``run-notebook`` for one notebook, whose Run form has
    the notebook's parameters as typed fields (`notebook_deployment_schema`).

    Args:
        notebook: the .ipynb, as the deployment's ``notebook``; a relative path (like the
            others here) resolves from the folder the deployment is made from, where its runs
            start, as with ``prefect deploy`` and no pull steps.
        work_pool_name: the work pool whose workers run it (e.g. a process pool).
        name: the deployment's name (``run-notebook/NAME``); default the notebook's file name
            without ``.ipynb``, as a slug.
        inputs: files or folders to upload, or ``s3://`` URIs.
        artifacts: glob patterns of files to collect.
        storage: a folder, ``s3://bucket/prefix`` or ``s3-bucket/NAME``.
        cell_timeout_s: seconds each cell may run; -1 for none.
        description: the deployment's description; default one naming the notebook.

    Returns:
        The deployment's id.

    Raises:
        NotebookError: the notebook cannot be read, or its parameters cell is not valid Python.
        prefect.exceptions.PrefectHTTPStatusError: the API refused the deployment (an unknown
            work pool).
    """
    path = str(notebook)
    schema = notebook_deployment_schema(path)
    parameters: dict[str, Any] = {"notebook": path}
    if inputs:
        parameters["inputs"] = list(inputs)
    if artifacts:
        parameters["artifacts"] = list(artifacts)
    if storage:
        parameters["storage"] = storage
    if cell_timeout_s is not None:
        parameters["cell_timeout_s"] = cell_timeout_s
    async with get_client() as client:
        flow_id = await client.create_flow(arun_notebook)
        return await client.create_deployment(
            flow_id=flow_id,
            name=name or default_deployment_name(notebook),
            description=description
            or f"Run {Path(path).name} stage by stage in a sandbox; its parameters are typed "
            "fields of the Run form.",
            work_pool_name=work_pool_name,
            entrypoint=ENTRYPOINT,
            # As `prefect deploy` does: runs start in the folder the deployment was made from.
            pull_steps=[
                {"prefect.deployments.steps.set_working_directory": {"directory": os.getcwd()}}
            ],
            parameters=parameters,
            parameter_openapi_schema=schema,
            enforce_parameter_schema=True,
        )


def deploy_notebook(
    notebook: str | Path,
    work_pool_name: str,
    *,
    name: str | None = None,
    inputs: list[str] | None = None,
    artifacts: list[str] | None = None,
    storage: str | None = None,
    cell_timeout_s: float | None = None,
    description: str | None = None,
) -> UUID:
    """`adeploy_notebook` from plain Python: the same arguments, return and errors."""
    return run_coro_as_sync(
        adeploy_notebook(
            notebook,
            work_pool_name,
            name=name,
            inputs=inputs,
            artifacts=artifacts,
            storage=storage,
            cell_timeout_s=cell_timeout_s,
            description=description,
        )
    )
