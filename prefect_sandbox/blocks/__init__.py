"""Prefect blocks: backend settings and credentials.

Manual: docs/backends/index.md.
"""

from prefect_sandbox.blocks.base import SandboxBackend
from prefect_sandbox.blocks.daytona import DaytonaBackend, DaytonaCredentials
from prefect_sandbox.blocks.docker import DockerBackend
from prefect_sandbox.blocks.e2b import E2BBackend, E2BCredentials
from prefect_sandbox.blocks.local import LocalKernelBackend

__all__ = [
    "BackendBlock",
    "DaytonaBackend",
    "DaytonaCredentials",
    "DockerBackend",
    "E2BBackend",
    "E2BCredentials",
    "LocalKernelBackend",
    "SandboxBackend",
]

BackendBlock = LocalKernelBackend | E2BBackend | DaytonaBackend | DockerBackend
"""The backend blocks a flow's ``backend`` parameter accepts (the UI offers each as a choice)."""
