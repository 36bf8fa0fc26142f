"""The sandbox backends, one module each, every one a `prefect_sandbox.sandbox.base.Sandbox`.

- `local`: `LocalKernelSandbox`, an ipykernel on this machine (no extra needed).
- `e2b`: `E2BSandbox`, an E2B cloud sandbox (``pip install 'prefect-sandbox[e2b]'``).
- `daytona`: `DaytonaSandbox`, a Daytona sandbox (``pip install 'prefect-sandbox[daytona]'``);
  `_daytona_runner` is the code it installs in the sandbox's interpreter.

Nothing is imported here, so importing one backend never imports another's SDK.
"""
