"""Labels that tie a sandbox to its flow run, so hooks and reapers can find it."""

from __future__ import annotations

__all__ = [
    "FLOW_RUN_ID_LABEL",
    "FLOW_RUN_NAME_LABEL",
    "MARKER_LABEL",
    "POOL_OWNER_LABEL",
    "flow_run_labels",
]

MARKER_LABEL = "prefect-sandbox"
FLOW_RUN_ID_LABEL = "prefect-flow-run-id"
FLOW_RUN_NAME_LABEL = "prefect-flow-run-name"
POOL_OWNER_LABEL = "prefect-sandbox-pool-owner"
"""On an idle kernel of a warm pool (with the marker, and no flow run id until it is handed
out): the pid of the process that owns the pool."""


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
