"""The sweep flow: `asweep_notebook` / `sweep_notebook` run one notebook once per parameter set.

Each parameter set is a *branch*: one ``run-notebook`` flow run with its own sandbox, folder and
``summary.json``, run as a subflow, a deployment run or a task on Dask. Branches are independent
(one that fails stops no other); the sweep schedules nothing itself, the caps on live sandboxes
being Prefect global concurrency limits each branch holds (`prefect_sandbox.flows.limits`), and
it reads what each left back from storage, never from a sandbox, into ``sweep.json`` and the
``sweep-summary`` table. Modules: `grid` (parameter sets, grid files), `model` (mode, shared
arguments, a branch), `launchers` (one class per mode, and the one path that stops a branch),
`deployment`, `collection` (branches side by side, reading back), `table`, `flow`. Names are
imported on first use (PEP 562), so reading a grid (the CLI) imports no flow or launcher.
Manual: docs/how-to/sweeps.md.
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
