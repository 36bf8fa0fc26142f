"""Prefect blocks: backend settings and credentials."""

from prefect_sandbox.blocks.base import SandboxBackend
from prefect_sandbox.blocks.local import LocalKernelBackend

__all__ = ["LocalKernelBackend", "SandboxBackend"]
