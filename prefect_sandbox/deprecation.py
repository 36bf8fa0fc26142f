"""Old names kept working for one release after a rename, each with a `DeprecationWarning`.

The names were made consistent in one step (issue 21); the table of old and new names is in the
documentation's Concepts page. Block fields keep their old names through pydantic's
``validation_alias`` (a saved block document still loads) and need nothing here.
"""

from __future__ import annotations

import warnings
from typing import Any, TypeVar

__all__ = ["renamed_argument", "renamed_attribute"]

T = TypeVar("T")


def _warn(old: str, new: str, stacklevel: int) -> None:
    warnings.warn(
        f"{old} is deprecated and will be removed in a later release; use {new}",
        DeprecationWarning,
        stacklevel=stacklevel + 1,
    )


def renamed_argument(old: str, old_value: T | None, new: str, new_value: T | None) -> T | None:
    """The value of an argument given by its new name or, with a warning, by its old one.

    Args:
        old: the argument's old name; ``old_value`` its value (None: not given).
        new: its new name; ``new_value`` its value (None: not given).

    Returns:
        ``new_value``, else ``old_value``.

    Raises:
        ValueError: both were given.
    """
    if old_value is None:
        return new_value
    if new_value is not None:
        raise ValueError(f"give {new} only: {old} is its deprecated name")
    _warn(old, new, stacklevel=2)
    return old_value


def renamed_attribute(old: str, new: str) -> Any:
    """A read-only property ``old`` that warns and returns the attribute ``new``.

    Args:
        old: the attribute's old name, as the warning gives it (``"StoredArtifact.bytes"``).
        new: the attribute it now reads.

    Returns:
        The property, to assign in the class body.
    """

    def getter(self: Any) -> Any:
        _warn(old, new, stacklevel=2)
        return getattr(self, new)

    getter.__doc__ = f"Deprecated: the old name of ``{new}``."
    return property(getter)
