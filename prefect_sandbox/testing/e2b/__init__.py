"""An offline emulator of E2B that the real ``e2b-code-interpreter`` SDK talks to.

``python -m prefect_sandbox.testing.e2b`` serves it and prints the ``E2B_API_KEY``,
``E2B_API_URL`` and ``E2B_SANDBOX_URL`` that point the SDK (and ``prefect-sandbox run --backend
e2b``) at it; in Python, `E2BEmulator` is a context manager whose ``api_key`` and ``url`` go
into an `E2BCredentials` block. Laid out as the Daytona emulator is: `state` (sandboxes, files,
code contexts; no HTTP), `app` (the routes), `wire` (pure wire formats), `emulator` (the
server); `channel` runs cells by the rules of E2B's code interpreter server, `profile` is its
template's IPython profile; faults come from `prefect_sandbox.testing.faults`. Cells run in real
local ipykernels, so the emulator is no security boundary; it has Python kernels only. Manual:
docs/backends/e2b.md.
"""

from prefect_sandbox.testing.e2b.emulator import OPERATIONS, E2BEmulator
from prefect_sandbox.testing.faults import Fault, RequestRecord

__all__ = ["OPERATIONS", "E2BEmulator", "Fault", "RequestRecord"]
