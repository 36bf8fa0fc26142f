"""Prefect blocks: backend settings and credentials."""

from prefect_sandbox.blocks.base import SandboxBackend
from prefect_sandbox.blocks.daytona import DaytonaBackend, DaytonaCredentials
from prefect_sandbox.blocks.local import LocalKernelBackend

__all__ = ["DaytonaBackend", "DaytonaCredentials", "LocalKernelBackend", "SandboxBackend"]
