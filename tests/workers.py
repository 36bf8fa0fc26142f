"""What each pytest-xdist worker has of its own, so that workers running at once cannot meet
(docs/development.md, "Running the tests").

`isolate_worker` runs in a worker (``PYTEST_XDIST_WORKER`` set) before Prefect is imported:

- ``TMPDIR``: a folder of its own. Local sandboxes' runtime folders live under it, and the
  local backend lists its sandboxes from them: a worker's reaper, warm pool, orphan sweeps and
  "no sandbox left" checks see its own sandboxes only. Staging folders and working directories
  are made there too.
- ``PREFECT_HOME``: its own, so the temporary API server of a CLI run that names no
  ``PREFECT_API_URL`` keeps its SQLite database apart.

The rest is a worker's own without more: its Prefect API (`prefect_api`), its ``prefect
server`` stacks, E2B and Daytona emulators and moto servers are fixtures of its process at free
ports. Remote sandboxes carry their API's id (``prefect-api``), so a reaper leaves another API's
alone. Shared on purpose, safely: the uid claims (a lock), cgroups (named by sandbox id), the
Docker daemon (`DockerDaemon` counts its users) and the test image's build (a lock).
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

__all__ = ["WORKER", "WORKER_FOLDER", "isolate_worker"]

WORKER = os.environ.get("PYTEST_XDIST_WORKER")
"""This worker's id (``gw0``, ``gw1``...); None in a run without workers and in the controller."""


def isolate_worker() -> Path | None:
    """Give this worker its own ``TMPDIR`` and ``PREFECT_HOME`` (see the module's docstring).

    The folder is removed when the process exits, after what others registered to remove in
    it at exit (Prefect's test harness its database). A process the worker started that
    imports this module too (a Dask worker unpickling a test's flow) keeps the worker's.

    Returns:
        The worker's folder (its ``TMPDIR``), short enough for kernels' socket paths; None when
        this process is no worker, or a process of one.
    """
    if WORKER is None or Path(tempfile.gettempdir()).name.startswith(f"pst-{WORKER}-"):
        return None
    folder = Path(tempfile.mkdtemp(prefix=f"pst-{WORKER}-"))
    # Open to every user, as /tmp is: sandboxes run as uids of their own, and a test may put
    # a program for one there (a bwrap that answers slowly).
    folder.chmod(0o1777)
    (folder / "prefect-home").mkdir()
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    os.environ["TMPDIR"] = str(folder)
    os.environ["PREFECT_HOME"] = str(folder / "prefect-home")
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again
    return folder


WORKER_FOLDER = isolate_worker()
"""This worker's folder, made on import: conftest imports this module before anything imports
Prefect, whose settings are read when it is imported."""
