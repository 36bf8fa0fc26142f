"""Offline emulators of the sandbox vendors' APIs, and a real S3 API, for testing flows
without an account.

The emulators speak the vendors' wire protocols on 127.0.0.1, so the vendors' real SDKs talk to
them, and run code in real local processes (Jupyter kernels for E2B, plain Python workers for
Daytona, as each vendor does): see `prefect_sandbox.testing.e2b` and
`prefect_sandbox.testing.daytona`. `prefect_sandbox.testing.s3` runs moto's S3 server.
Manual: docs/development.md.
"""
