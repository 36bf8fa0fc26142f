"""What a deployment run's own parameters may set: isolation is decided by whoever saves blocks and
deployments, not by whoever starts runs.

Anyone who may start a deployment's runs chooses its parameters (and job variables): trusted,
``backend={"isolation": "none"}`` or an input ``~/.ssh`` would read the worker's files. So in a
deployment run, before any sandbox starts, ``backend`` must be a saved block by reference (or
the deployment's own value); ``notebook`` and ``inputs`` the deployment's own or under
``PREFECT_SANDBOX_INPUT_ROOTS``; ``storage`` a saved ``S3Bucket`` block, the deployment's own,
or under ``PREFECT_SANDBOX_OUTPUT_ROOTS`` (a bucket by value would have the worker sign uploads
with its own keys); a sweep's ``task_runner`` no Dask address the deployment did not name; the
job variables no ``PREFECT_SANDBOX_*`` in ``env``. A refusal raises `ParameterRefusedError`
naming each parameter. The deployment's own parameters are trusted, read back from the API.
Manual: docs/isolation.md.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from prefect.client.orchestration import get_client
from prefect.context import FlowRunContext

from prefect_sandbox.flows.errors import ParameterRefusedError
from prefect_sandbox.s3uri import is_s3_uri
from prefect_sandbox.settings import PrefectSandboxSettings
from prefect_sandbox.tasks.storage import S3_BLOCK_PREFIX

__all__ = ["check_deployment_run", "refused_parameters"]

SETTINGS_PREFIX = "PREFECT_SANDBOX_"


def _is_reference(value: Any) -> bool:
    """Whether ``value`` is a saved block's reference and nothing else."""
    return isinstance(value, dict) and set(value) == {"$ref"} and isinstance(value["$ref"], dict)


def _under_root(path: str, roots: list[str]) -> bool:
    """Whether ``path`` (a local path, its links resolved, or an ``s3://`` URI) lies under one
    of ``roots``."""
    if is_s3_uri(path):
        return any(
            is_s3_uri(root) and (path == root or path.startswith(root.rstrip("/") + "/"))
            for root in roots
        )
    real = Path(os.path.realpath(path))
    return any(
        not is_s3_uri(root) and real.is_relative_to(os.path.realpath(root)) for root in roots
    )


def _refused_storage(storage: Any, deployed: Any, output_roots: list[str]) -> str | None:
    """Why a deployment run may not store in ``storage``; None when it may."""
    if storage is None or storage == deployed or _is_reference(storage):
        return None
    if isinstance(storage, str):
        if storage.startswith(S3_BLOCK_PREFIX) or _under_root(storage, output_roots):
            return None
        allowed = f"PREFECT_SANDBOX_OUTPUT_ROOTS ({', '.join(output_roots) or 'empty'})"
        return f"{storage!r} is not under a root of {allowed}"
    return (
        "a deployment run takes a saved S3Bucket block by reference "
        '({"$ref": {"block_document_id": ...}}) or a folder or s3:// URI under '
        "PREFECT_SANDBOX_OUTPUT_ROOTS, not a bucket by value: its endpoint and credentials "
        "are set by whoever saves blocks"
    )


def refused_parameters(
    given: Mapping[str, Any],
    deployed: Mapping[str, Any],
    job_variables: Mapping[str, Any],
    roots: list[str],
    output_roots: list[str],
) -> dict[str, str]:
    """The parts of a deployment run that its starter may not set, each with why.

    Args:
        given: the flow run's parameters as stored by the API (block references unresolved).
        deployed: the deployment's own parameters.
        job_variables: the flow run's own job variables (the deployment's are not included).
        roots: local folders and ``s3://`` prefixes paths may lie under
            (``PREFECT_SANDBOX_INPUT_ROOTS``).
        output_roots: local folders and ``s3://`` prefixes a ``storage`` given as text may lie
            under (``PREFECT_SANDBOX_OUTPUT_ROOTS``).

    Returns:
        Each refused parameter's name (``inputs[INDEX]``, ``job_variables.env.NAME``) to a
        sentence saying why; empty when the run may go ahead.
    """
    refused: dict[str, str] = {}
    backend = given.get("backend")
    if backend is not None and backend != deployed.get("backend") and not _is_reference(backend):
        refused["backend"] = (
            "a deployment run takes a saved backend block by reference "
            '({"$ref": {"block_document_id": ...}}), not its fields by value: its isolation, '
            "network and environment are set by whoever saves blocks"
        )
    inputs = given.get("inputs")
    paths = [("notebook", given.get("notebook"))]
    paths += [(f"inputs[{i}]", item) for i, item in enumerate(inputs or [])]
    # Paths the deployment itself sets are trusted as they are.
    deployed_paths = [deployed.get("notebook"), *(deployed.get("inputs") or [])]
    allowed = f"PREFECT_SANDBOX_INPUT_ROOTS ({', '.join(roots) or 'empty'})"
    for name, path in paths:
        if isinstance(path, str) and path not in deployed_paths and not _under_root(path, roots):
            refused[name] = f"{path!r} is not under a root of {allowed}"
    storage_refused = _refused_storage(given.get("storage"), deployed.get("storage"), output_roots)
    if storage_refused is not None:
        refused["storage"] = storage_refused
    runner = given.get("task_runner")
    if isinstance(runner, str) and runner != "dask" and runner != deployed.get("task_runner"):
        refused["task_runner"] = (
            f"{runner!r} would send the branches, their backend block's credentials "
            "included, to a Dask cluster the run chose; only the deployment may name one"
        )
    env = job_variables.get("env")
    for name in sorted(env) if isinstance(env, dict) else []:
        if str(name).upper().startswith(SETTINGS_PREFIX):
            refused[f"job_variables.env.{name}"] = (
                "a run's job variables may not set prefect-sandbox's settings; set them on "
                "the worker or in the deployment"
            )
    return refused


async def check_deployment_run() -> None:
    """Refuse a deployment run whose own parameters or job variables set what only saved
    blocks and the deployment may (see the module's docstring); nothing to do in any other run.

    Call it first thing in a flow, before any sandbox starts.

    Raises:
        ParameterRefusedError: names each refused parameter and why.
    """
    context = FlowRunContext.get()
    flow_run = context.flow_run if context is not None else None
    if flow_run is None or flow_run.deployment_id is None:
        return
    async with get_client() as client:
        deployment = await client.read_deployment(flow_run.deployment_id)
    settings = PrefectSandboxSettings()
    refused = refused_parameters(
        flow_run.parameters,
        deployment.parameters,
        flow_run.job_variables or {},
        settings.input_roots,
        settings.output_roots,
    )
    if refused:
        reasons = "; ".join(f"{name}: {why}" for name, why in refused.items())
        raise ParameterRefusedError(
            f"deployment run refused before any sandbox started: {reasons}",
            refused=list(refused),
        )
