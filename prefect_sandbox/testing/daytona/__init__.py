"""An offline emulator of Daytona's API that the real daytona SDK talks to.

``python -m prefect_sandbox.testing.daytona`` runs it in the foreground and prints the
``DAYTONA_API_KEY``, ``DAYTONA_API_URL`` and ``DAYTONA_TARGET`` settings that point the SDK (and
``prefect-sandbox run --backend daytona``) at it. In tests, use `DaytonaEmulator` directly or
the ``daytona_emulator`` fixture of `prefect_sandbox.testing.daytona.fixtures`. It emulates the
control plane (create, get, list by labels, delete, start, stop, keep-alive), the toolbox (work
directory, folders, shell commands, interpreter contexts and WebSocket, bulk upload and
download), auto-stop, auto-delete and lifetimes, and injects faults (`Fault`). Code runs in
plain local Python worker processes, as Daytona's daemon runs it: it is no security boundary.
Unset ``HTTP(S)_PROXY`` (or set ``NO_PROXY=127.0.0.1``) so the SDK reaches it directly. Manual:
docs/backends/daytona.md.
"""

from prefect_sandbox.testing.daytona.app import OPERATIONS
from prefect_sandbox.testing.daytona.emulator import DaytonaEmulator
from prefect_sandbox.testing.faults import Fault, RequestRecord

__all__ = ["OPERATIONS", "DaytonaEmulator", "Fault", "RequestRecord"]
