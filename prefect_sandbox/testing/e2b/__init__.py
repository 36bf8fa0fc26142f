"""An offline emulator of E2B that the real ``e2b-code-interpreter`` SDK talks to.

Run your own flows against it without an E2B account::

    $ python -m prefect_sandbox.testing.e2b
    E2B_API_KEY=e2b_emulator_...
    E2B_API_URL=http://127.0.0.1:41234
    E2B_SANDBOX_URL=http://127.0.0.1:41234

Export those three lines in another shell and run, for instance,
``prefect-sandbox run NOTEBOOK --backend e2b``; or, in Python::

    from prefect_sandbox.testing.e2b import E2BEmulator

    with E2BEmulator() as emulator:
        credentials = E2BCredentials(
            api_key=emulator.api_key, api_url=emulator.url, sandbox_url=emulator.url
        )

Laid out as the Daytona emulator is: `state` (sandboxes, files, code contexts; no HTTP),
`app` (the routes), `wire` (pure wire formats), `emulator` (the server); `channel` runs cells
over Jupyter's channels by the rules of E2B's code interpreter server, `profile` is its
template's IPython profile; faults come from `prefect_sandbox.testing.faults`, shared by both
emulators. Cells run in real local ipykernels, so the emulator is no security boundary; it has
Python kernels only.
"""

from prefect_sandbox.testing.e2b.emulator import OPERATIONS, E2BEmulator
from prefect_sandbox.testing.faults import Fault, RequestRecord

__all__ = ["OPERATIONS", "E2BEmulator", "Fault", "RequestRecord"]
