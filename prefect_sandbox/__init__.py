"""prefect-sandbox: run notebook cells in a sandbox that lives for exactly one Prefect flow run.

The block classes are importable from here, so ``prefect block register -m prefect_sandbox``
registers them; flows and tasks live in `prefect_sandbox.flows` and `prefect_sandbox.tasks`.
"""

from prefect_sandbox.blocks import (
    DaytonaBackend,
    DaytonaCredentials,
    DockerBackend,
    E2BBackend,
    E2BCredentials,
    LocalKernelBackend,
)

__all__ = [
    "DaytonaBackend",
    "DaytonaCredentials",
    "DockerBackend",
    "E2BBackend",
    "E2BCredentials",
    "LocalKernelBackend",
]
