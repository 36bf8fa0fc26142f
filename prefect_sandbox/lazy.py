"""Names of a package imported from its modules on first use (module ``__getattr__``,
PEP 562), so that a caller pays only for the modules it uses. Manual: docs/development.md.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_names"]


def lazy_names(
    package: str, modules: Mapping[str, list[str]], eager: Callable[[], list[str]]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A package's ``__getattr__`` and ``__dir__`` for names kept in its modules.

    Args:
        package: the package's ``__name__``.
        modules: each module's name (relative to the package) to the names it gives.
        eager: the names the package holds already (its ``globals`` keys).

    Returns:
        ``__getattr__``, which imports the module of a name on first use (AttributeError for
        another name), and ``__dir__``, the eager names and the lazy ones, sorted.
    """
    module_of = {name: module for module, names in modules.items() for name in names}

    def getattr_(name: str) -> Any:
        if name in module_of:
            return getattr(importlib.import_module(f"{package}.{module_of[name]}"), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def dir_() -> list[str]:
        return sorted({*eager(), *module_of})

    return getattr_, dir_
