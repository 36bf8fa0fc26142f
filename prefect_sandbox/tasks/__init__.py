"""Prefect tasks: create, upload, run a stage, download (fetch), store, kill.

Manual: docs/concepts.md.
"""

from prefect_sandbox.tasks.sandbox import (
    create_sandbox,
    download_artifacts,
    fetch_artifacts,
    kill_sandbox,
    run_stage,
    upload_inputs,
)
from prefect_sandbox.tasks.storage import store_artifacts

__all__ = [
    "create_sandbox",
    "download_artifacts",
    "fetch_artifacts",
    "kill_sandbox",
    "run_stage",
    "store_artifacts",
    "upload_inputs",
]
