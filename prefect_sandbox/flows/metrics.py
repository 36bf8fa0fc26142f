"""A run's key metrics: the top-level values of the JSON file a notebook stores as its metrics
(``metrics.json`` for a run, a sweep's ``metrics_artifact`` for its branches), kept in a run's
``summary.json`` and a sweep's ``sweep.json``. Pure functions; the flows read the file.
Manual: docs/how-to/sweeps.md.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from prefect_sandbox.sandbox.outputs import cap_text

__all__ = [
    "METRICS_KEPT",
    "METRICS_MAX_BYTES",
    "METRIC_TEXT_CHARS",
    "Metric",
    "metrics_of",
    "read_metrics",
]

METRICS_KEPT = 50
"""Metrics kept per branch in ``sweep.json`` at most."""
METRICS_MAX_BYTES = 1 << 20
"""A stored metrics file larger than this is not read (it is a notebook's output: untrusted)."""
METRIC_TEXT_CHARS = 100
"""Characters of a metric's name, or of its value when a string, kept at most."""

Metric = float | int | bool | str | None


def metrics_of(data: bytes) -> tuple[dict[str, Metric], str | None]:
    """The key metrics in a branch's stored metrics file: its top-level numbers, booleans,
    nulls and strings, in order, at most `METRICS_KEPT`, names and strings cut at
    `METRIC_TEXT_CHARS` characters.

    Args:
        data: the file's content (a notebook wrote it: anything).

    Returns:
        The metrics, and why there are none when the file is no JSON object (else None).
    """
    try:
        value = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        return {}, f"not JSON: {cap_text(str(exc), 200)}"
    if not isinstance(value, dict):
        return {}, f"a JSON {type(value).__name__}, not an object"
    kept: dict[str, Metric] = {}
    for name, item in value.items():
        if len(kept) == METRICS_KEPT:
            break
        if isinstance(item, str):
            item = item[:METRIC_TEXT_CHARS]
        elif item is not None and not isinstance(item, bool | int | float):
            continue
        kept[name[:METRIC_TEXT_CHARS]] = item
    return kept, None


def read_metrics(
    size_bytes: int, read: Callable[[], bytes]
) -> tuple[dict[str, Metric], str | None]:
    """The key metrics of a stored metrics file of ``size_bytes`` bytes, which ``read``
    returns; one over `METRICS_MAX_BYTES` is not read.

    Returns:
        The metrics (`metrics_of`), and why there are none when the file is too large or no
        JSON object (else None).

    Raises:
        What ``read`` raises.
    """
    if size_bytes > METRICS_MAX_BYTES:
        return {}, f"{size_bytes} bytes, over {METRICS_MAX_BYTES}"
    return metrics_of(read())
