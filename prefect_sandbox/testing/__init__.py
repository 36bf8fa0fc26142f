"""Offline emulators of sandbox vendors' APIs, for tests of flows that use them.

They ship with the package so users can run their own flows against them without an account;
see `prefect_sandbox.testing.e2b`.
"""
