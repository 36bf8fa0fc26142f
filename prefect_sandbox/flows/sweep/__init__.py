"""The sweep flow: `asweep_notebook` / `sweep_notebook` run one notebook once per parameter set.

Each parameter set of the grid is a *branch*: one flow run of ``run-notebook``
(`arun_notebook`), with its own sandbox, its own folder and its own ``summary.json``. Branches
run concurrently; one that fails does not stop the others. When all have ended, the sweep reads
each branch's ``summary.json`` and metrics file back from storage (never from the sandbox, which
is gone), stores ``sweep.json`` and publishes a table artifact (key ``sweep-summary``).

Three modes:

- **Subflows** (the default, ``deployment`` empty): branches are subflows in the sweep's own
  process and event loop. Cheap: no worker, no process start, no result round trip; right when
  the sandboxes do the heavy work (E2B, Daytona, Docker) or the machine has the cores for
  local kernels.
- **Deployment runs** (``deployment="NAME"`` of a ``run-notebook`` deployment): each branch is a
  `prefect.deployments.arun_deployment` child run that the deployment's work pool hands to any
  of its workers, so branches spread over many processes and machines. Right when one machine
  cannot hold the branches' kernels, or when branches need the workers' environment. The
  sweep waits for each child run and reads its results back from storage, which must then be
  one every worker and the sweep can reach (S3, or a shared folder); blocks sent to the
  workers (``backend``, an `S3Bucket` ``storage``) must be saved ones, sent by reference.
- **Tasks on Dask** (``task_runner="dask"`` or ``"dask:ADDRESS"``): each branch is a task on
  a Dask cluster's worker processes (a `LocalCluster` the sweep starts, or a running one), its
  flow run a subflow of that task. Branches spread over processes without a work pool or
  deployment; the sweep gets each branch's state back from Dask. Right when the sweep's one
  process (its event loop, its GIL) is the limit, or a Dask cluster is at hand. See
  `prefect_sandbox.flows.dask` for how workers reach the API.

The caps on sandboxes alive at once are Prefect global concurrency limits
(`prefect_sandbox.flows.limits`): the backend's, when its block has ``max_live_sandboxes``, and
with ``max_live_sandboxes`` one of the sweep's own, each held by a branch from its sandbox's
creation to its kill, whatever mode: the sweep schedules nothing itself. Storage layout, in
every mode::

    local folder OUT:   OUT/<sweep-run-folder>/sweep.json
                        OUT/<sweep-run-folder>/<branch-run-folder>/summary.json, ...
    S3 (bucket folder F):
                        F/sweep-notebook/<sweep-run-folder>/sweep.json
                        F/sweep-notebook/<sweep-run-folder>/run-notebook/<branch-run-folder>/...

where a run folder is a flow-run name's slug and 8 hex digits of its id, and a branch's flow
run is named ``<sweep-run-name>-<index>``. (In deployment mode with an `S3Bucket` block, a saved
block cannot be handed a sub-folder, so branches are stored where ``run-notebook`` stores
under that block, ``F/run-notebook/<branch-run-folder>/``; ``sweep.json`` lists each location.)

Cancelling the sweep's task (the CLI does so on SIGINT and SIGTERM, and the sweep itself when
its flow run is set Cancelling through the API or UI, seen within
``PREFECT_SANDBOX_CANCEL_POLL_S``: `prefect_sandbox.flows.cancelling`) cancels every branch: a
subflow kills its sandbox and stores what it made; a deployment run is set Cancelling, so its
worker stops it and its hooks kill its sandbox; a Dask task that has not started is dropped,
and one that runs, which Dask cannot stop, has its sandbox killed, so its cell ends and it
stores what it made (ending Failed). The sweep then stores ``sweep.json`` and ends
Cancelled. The sweep's own cancellation and crash hooks cancel branches still running.

The package's modules: `grid` (parameter sets, grid and parameters files), `model` (the mode,
the branches' shared arguments, a branch), `launchers` (one class per mode, and the one path
that stops a branch's run), `deployment` (deployment runs through the API), `collection`
(running branches side by side, reading back what they left), `table` (the table artifact),
`flow` (the flow); a branch's metrics are read by `prefect_sandbox.flows.metrics`, which a run
shares. Each name below but those metrics' is imported from its module on first use (module
``__getattr__``, PEP 562), so reading a grid (the CLI) imports no flow or launcher.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

# The metrics' own module (shared with `arun_notebook`'s runs) imports nothing of Prefect's.
from prefect_sandbox.flows.metrics import METRICS_MAX_BYTES, metrics_of
from prefect_sandbox.lazy import lazy_names

if TYPE_CHECKING:
    from prefect_sandbox.flows.sweep.flow import asweep_notebook, sweep_notebook
    from prefect_sandbox.flows.sweep.grid import (
        MAX_BRANCHES,
        expand_grid,
        read_grid,
        read_parameters_file,
    )
    from prefect_sandbox.flows.sweep.launchers import cancel_branches
    from prefect_sandbox.flows.sweep.model import SWEEP_NAME
    from prefect_sandbox.flows.sweep.table import METRIC_COLUMNS, TABLE_ROWS_SHOWN, sweep_table

_MODULES = {
    "flow": ["asweep_notebook", "sweep_notebook"],
    "grid": ["MAX_BRANCHES", "expand_grid", "read_grid", "read_parameters_file"],
    "launchers": ["cancel_branches"],
    "model": ["SWEEP_NAME"],
    "table": ["METRIC_COLUMNS", "TABLE_ROWS_SHOWN", "sweep_table"],
}

__all__ = [
    "MAX_BRANCHES",
    "METRICS_MAX_BYTES",
    "METRIC_COLUMNS",
    "SWEEP_NAME",
    "TABLE_ROWS_SHOWN",
    "asweep_notebook",
    "cancel_branches",
    "expand_grid",
    "metrics_of",
    "read_grid",
    "read_parameters_file",
    "sweep_notebook",
    "sweep_table",
]


__getattr__, __dir__ = lazy_names(__name__, _MODULES, lambda: list(globals()))
