"""Offline emulators of the sandbox vendors' APIs, for testing flows without an account.

They speak the vendors' wire protocols on 127.0.0.1, so the vendors' real SDKs talk to them,
and run code in real local Jupyter kernels. See `prefect_sandbox.testing.daytona`.
"""
