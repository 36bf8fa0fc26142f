"""`SandboxDaskTaskRunner`: the sandbox tasks on a Dask cluster (the ``dask`` extra).

prefect-dask sends each task with the flow process's Prefect context, and a worker builds its
API client from it. Under Prefect's temporary API server (no ``PREFECT_API_URL``) that setting
travels empty and each worker would start a temporary server of its own on the same SQLite
database, so the runner hands the workers the flow process's server address instead (127.0.0.1:
a cluster beyond this machine needs a Prefect server). The context also carries the flow run's
parameters, which Prefect dumps with secrets revealed; the runner sends them masked, as the UI
shows them. Tasks pass `SandboxHandle` values, never live sandboxes, so each stage may run on
another worker; a local kernel dies with the worker process that made it. Manual:
docs/how-to/dask.md.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any

from prefect.client.schemas.objects import RunInput
from prefect.context import FlowRunContext
from prefect.settings import (
    PREFECT_API_URL,
    PREFECT_SERVER_EPHEMERAL_ENABLED,
    temporary_settings,
)
from prefect.tasks import Task

from prefect_sandbox._compat import temporary_api_server_url
from prefect_sandbox.options import dask_address
from prefect_sandbox.sandbox.backends import extra_hint
from prefect_sandbox.sandbox.errors import BackendNotInstalledError

try:
    from distributed import LocalCluster
    from distributed.deploy.utils import nprocesses_nthreads
    from prefect_dask.task_runners import DaskTaskRunner, PrefectDaskFuture
except ImportError as exc:
    raise BackendNotInstalledError(
        extra_hint("the Dask task runner", "dask"), extra="dask"
    ) from exc

__all__ = ["BRANCHES_PER_WORKER", "SandboxDaskTaskRunner", "dask_task_runner", "started"]

BRANCHES_PER_WORKER = 4
"""Threads of each worker process of the cluster ``"dask"`` starts: a branch's thread mostly
waits on its sandbox, whose kernel is a process of its own, so one worker runs several."""


class SandboxDaskTaskRunner(DaskTaskRunner):
    """prefect-dask's `DaskTaskRunner`, made safe for sandbox flows on Prefect's temporary API.

    It takes the same arguments (``cluster``, ``address``, ``cluster_class``,
    ``cluster_kwargs``, ...). Each task it submits carries, in place of what prefect-dask sends:

    - the flow process's temporary API server's address, when ``PREFECT_API_URL`` is unset, so
      workers on this machine report to it rather than each starting a server of its own;
    - the flow run's parameters with their secrets masked.

    Example:
        ```python
        from prefect import flow
        from prefect_sandbox.flows.dask import SandboxDaskTaskRunner

        runner = SandboxDaskTaskRunner(
            cluster_kwargs={"n_workers": 2, "threads_per_worker": 1, "processes": True}
        )

        @flow(task_runner=runner)
        def staged(backend, stages): ...
        ```

    Raises:
        BackendNotInstalledError: (on import) the ``dask`` extra is not installed.
    """

    def submit(  # type: ignore[override]
        self,
        task: Task[Any, Any],
        parameters: dict[str, Any],
        wait_for: Iterable[PrefectDaskFuture[Any]] | None = None,
        dependencies: dict[str, set[RunInput]] | None = None,
    ) -> PrefectDaskFuture[Any]:
        """Submit ``task`` to the cluster, with the context workers should see (see above)."""
        with _context_for_workers():
            return super().submit(task, parameters, wait_for, dependencies)


@contextlib.contextmanager
def _context_for_workers() -> Iterator[None]:
    """Within: Prefect's context as a worker should get it (the API's address, masked
    parameters); prefect-dask serializes the context at submission."""
    with contextlib.ExitStack() as stack:
        url = temporary_server_url()
        if url is not None:
            stack.enter_context(temporary_settings({PREFECT_API_URL: url}))
        flow_run = FlowRunContext.get()
        if flow_run is not None and flow_run.parameters:
            masked = flow_run.model_dump(
                include={"parameters"}, context={"include_secrets": False}
            )["parameters"]
            stack.enter_context(flow_run.model_copy(update={"parameters": masked}))
        yield


def temporary_server_url() -> str | None:
    """The API URL of this process's temporary Prefect server, when ``PREFECT_API_URL`` is
    unset and temporary servers are allowed; None otherwise.

    Starts the server if this process has none yet (as Prefect's ``get_client`` would); a
    flow run has already started it.
    """
    if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        return None
    return temporary_api_server_url()


def dask_task_runner(spec: str) -> SandboxDaskTaskRunner:
    """The task runner a ``--task-runner`` value names.

    Args:
        spec: ``"dask"``: a `distributed.LocalCluster` of worker processes on this machine
            (as many as Dask starts by default for its cores, `BRANCHES_PER_WORKER` threads
            each, no dashboard, the scheduler's HTTP endpoints on a free port), started for
            the run and closed after it;
            ``"dask:ADDRESS"``: the running scheduler at ADDRESS (``tcp://host:8786``).

    Returns:
        A task runner, not started.

    Raises:
        ValueError: another value (`prefect_sandbox.options.dask_address`).
    """
    address = dask_address(spec)
    if address:
        return SandboxDaskTaskRunner(address=address)
    processes, _ = nprocesses_nthreads()
    return SandboxDaskTaskRunner(
        cluster_class=LocalCluster,
        cluster_kwargs={
            "n_workers": processes,
            "processes": True,
            "threads_per_worker": BRANCHES_PER_WORKER,
            "dashboard_address": None,
            # The scheduler's HTTP endpoints (/health, /metrics) on a free port: Dask's 8787,
            # when another cluster on this machine holds it, costs a UserWarning.
            "scheduler_kwargs": {"dashboard_address": ":0"},
        },
    )


@contextlib.asynccontextmanager
async def started(runner: SandboxDaskTaskRunner) -> AsyncIterator[SandboxDaskTaskRunner]:
    """Within: ``runner`` started outside a flow's own task runner slot (a sweep submits its
    branches to it directly), its cluster started or reached; closed after. Both happen in a
    thread, off the event loop: a `LocalCluster` takes seconds to start and to close.
    """
    runner.__enter__()  # type: ignore[no-untyped-call]
    try:
        await asyncio.to_thread(lambda: runner.client)
        yield runner
    finally:
        await asyncio.to_thread(runner.__exit__, None, None, None)
