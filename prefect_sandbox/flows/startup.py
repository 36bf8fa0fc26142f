"""The start-up allowance of Prefect's temporary API server, for the flows and the CLI alike.

With no ``PREFECT_API_URL``, the first flow call starts a temporary API server
(``prefect.server.api.server.SubprocessASGIServer.start``) and waits for it no longer than
Prefect's setting ``PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS`` (default 20 s), read from
the current settings context at that moment. On a busy 2-core machine the server takes longer,
so the flows would fail with "Timed out while attempting to connect to ephemeral Prefect API
server" before any sandbox starts. Manual: docs/troubleshooting.md.
"""

from __future__ import annotations

import warnings

from prefect_sandbox._compat import global_settings_context, set_global_settings_context
from prefect_sandbox.settings import PrefectSandboxSettings

__all__ = ["allow_ephemeral_startup"]


def allow_ephemeral_startup() -> None:
    """Give the temporary API server ``PREFECT_SANDBOX_EPHEMERAL_STARTUP_TIMEOUT_S`` seconds to
    start (`PrefectSandboxSettings.ephemeral_startup_timeout_s`), unless the user set Prefect's
    own setting (environment or profile), which wins.

    Prefect built its process-wide settings context when it was imported, so a variable set now
    would not count: the allowance goes into that context instead, which every later flow call
    reads unless a ``temporary_settings`` block around it says otherwise. Called when
    `prefect_sandbox.flows` is imported; calling it again is harmless.

    A ``PREFECT_SANDBOX_*`` variable with a bad value leaves Prefect's allowance as it is, with
    a `UserWarning` naming it: importing the flows does not fail, a flow run reading that
    setting does.
    """
    from prefect.context import SettingsContext
    from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS
    from pydantic import ValidationError

    current = global_settings_context()
    if "startup_timeout_seconds" in current.settings.server.ephemeral.model_fields_set:
        return
    try:
        allowance = PrefectSandboxSettings().ephemeral_startup_timeout_s
    except ValidationError as exc:
        warnings.warn(
            f"Prefect's temporary API server keeps its own start-up allowance: {exc}",
            stacklevel=2,
        )
        return
    set_global_settings_context(
        SettingsContext(
            profile=current.profile,
            settings=current.settings.copy_with_update(
                updates={PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS: allowance}
            ),
        )
    )
