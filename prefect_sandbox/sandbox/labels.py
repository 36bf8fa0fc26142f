"""Labels that tie a sandbox to its flow run, so hooks and reapers can find it.

Manual: docs/how-to/reaper.md.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from datetime import UTC, datetime

__all__ = [
    "API_LABEL",
    "CREATED_AT_LABEL",
    "FLOW_RUN_ID_LABEL",
    "FLOW_RUN_NAME_LABEL",
    "MARKER_LABEL",
    "POOL_OWNER_LABEL",
    "api_id",
    "created_at",
    "flow_run_labels",
    "with_created_at",
]

MARKER_LABEL = "prefect-sandbox"
FLOW_RUN_ID_LABEL = "prefect-flow-run-id"
FLOW_RUN_NAME_LABEL = "prefect-flow-run-name"
POOL_OWNER_LABEL = "prefect-sandbox-pool-owner"
"""On an idle kernel of a warm pool (with the marker, and no flow run id until it is handed
out): the pid of the process that owns the pool."""

CREATED_AT_LABEL = "prefect-sandbox-created-at"
"""When the sandbox was asked for, in UTC, as ISO 8601's basic format (``20261201T073747Z``):
letters and digits only, so every backend's label rules accept it."""

API_LABEL = "prefect-api"
"""Which Prefect API the flow run belongs to (`api_id`), so that a reaper asking another API
does not take the run for a missing one."""

_CREATED_AT_FORMAT = "%Y%m%dT%H%M%SZ"


def flow_run_labels(flow_run_id: str, flow_run_name: str) -> dict[str, str]:
    """Labels for a sandbox made by a flow run: its id, its name and our marker.

    Args:
        flow_run_id: the flow run's UUID as a string.
        flow_run_name: the flow run's name.

    Returns:
        Label name to value.
    """
    return {
        MARKER_LABEL: "true",
        FLOW_RUN_ID_LABEL: flow_run_id,
        FLOW_RUN_NAME_LABEL: flow_run_name,
    }


def with_created_at(labels: Mapping[str, str], now: datetime | None = None) -> dict[str, str]:
    """``labels`` plus `CREATED_AT_LABEL`, the time a sandbox is made, for the reaper's age.

    Args:
        labels: the sandbox's other labels.
        now: the creation time (timezone-aware); None for the current time.

    Returns:
        A new dict of label name to value.
    """
    when = (now or datetime.now(UTC)).astimezone(UTC)
    return {**labels, CREATED_AT_LABEL: when.strftime(_CREATED_AT_FORMAT)}


def created_at(labels: Mapping[str, str]) -> datetime | None:
    """When a sandbox was made, from its `CREATED_AT_LABEL`.

    Returns:
        A UTC datetime, to the second; None when the label is missing or not in that format.
    """
    value = labels.get(CREATED_AT_LABEL)
    if value is None:
        return None
    try:
        return datetime.strptime(value, _CREATED_AT_FORMAT).replace(tzinfo=UTC)
    except ValueError:
        return None


def api_id(address: str) -> str:
    """A short id of a Prefect API, for `API_LABEL`: 16 hex digits of the SHA-256 of its
    address, so that the address (a host name, a database URL) is not written in the label.

    Args:
        address: the API's URL, or what else tells one API from another (its database URL).

    Returns:
        16 lower-case hex digits.
    """
    return hashlib.sha256(address.rstrip("/").encode()).hexdigest()[:16]
