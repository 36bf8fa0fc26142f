"""prefect-sandbox: run notebook cells in a sandbox that lives for exactly one Prefect flow run.

The block classes are importable from here, so ``prefect block register -m prefect_sandbox``
registers them; flows and tasks live in `prefect_sandbox.flows` and `prefect_sandbox.tasks`.
They are imported on first use (module ``__getattr__``, PEP 562): importing the package, or
its Prefect-free parts (`prefect_sandbox.options`, the CLI's ``--help``), does not import
Prefect, which costs seconds. Where Prefect is imported already, as when it loads this package
as a collection (the ``prefect.collections`` entry point: its server, workers and block lookups
by slug), the blocks are imported at once, so Prefect's block registry knows them.
Manual: docs/index.md.
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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


def __getattr__(name: str) -> Any:
    """The block class ``name`` of `__all__`, imported from `prefect_sandbox.blocks` now."""
    if name in __all__:
        return getattr(importlib.import_module("prefect_sandbox.blocks"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])


if "prefect" in sys.modules:
    importlib.import_module("prefect_sandbox.blocks")
