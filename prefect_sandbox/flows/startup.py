"""Which Prefect API a run with no ``PREFECT_API_URL`` gets: the local server kept for the user
(`use_local_server_if_asked`, `point_prefect_at`), or Prefect's temporary server with its
start-up allowance (`allow_ephemeral_startup`), for the flows and the CLI alike.

With no ``PREFECT_API_URL``, the first flow call starts a temporary API server
(``prefect.server.api.server.SubprocessASGIServer.start``) and waits for it no longer than
Prefect's setting ``PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS`` (default 20 s), read from
the current settings context at that moment. On a busy 2-core machine the server takes longer,
so the flows would fail with "Timed out while attempting to connect to ephemeral Prefect API
server" before any sandbox starts. The local server (`prefect_sandbox.local_server`) has no
fixed allowance: it is waited for while its process lives and uses CPU. Manual:
docs/troubleshooting.md.
"""

from __future__ import annotations

import os
import sys
import warnings

from prefect_sandbox._compat import global_settings_context, set_global_settings_context
from prefect_sandbox.settings import PrefectSandboxSettings

__all__ = ["allow_ephemeral_startup", "point_prefect_at", "use_local_server_if_asked"]


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


def point_prefect_at(url: str) -> None:
    """Make ``url`` this process's Prefect API, and its children's: ``PREFECT_API_URL`` in
    Prefect's process-wide settings context (built at import, so a variable set now would
    not count) and in the environment."""
    from prefect.context import SettingsContext
    from prefect.settings import PREFECT_API_URL

    os.environ["PREFECT_API_URL"] = url
    current = global_settings_context()
    set_global_settings_context(
        SettingsContext(
            profile=current.profile,
            settings=current.settings.copy_with_update(updates={PREFECT_API_URL: url}),
        )
    )


def use_local_server_if_asked() -> None:
    """With ``PREFECT_SANDBOX_LOCAL_SERVER=always`` and no ``PREFECT_API_URL``, point this
    process at the local Prefect server kept for the user (`prefect_sandbox.local_server`),
    starting it if none runs and waiting until it answers (lines on stderr say how it goes).
    Called when `prefect_sandbox.flows` is imported; a no-op otherwise, or when a bad
    ``PREFECT_SANDBOX_*`` value leaves the setting unread (a flow run reports that).

    Raises:
        LocalServerError: the server did not start (the message names its log and the fix).
    """
    from prefect.settings import PREFECT_API_URL
    from pydantic import ValidationError

    from prefect_sandbox.local_server import LocalServer

    try:
        mode = PrefectSandboxSettings().local_server
    except ValidationError:
        return
    if mode != "always" or PREFECT_API_URL.value():
        return
    server = LocalServer()
    state, started = server.find_or_start()
    if started:
        _say(f"starting the local Prefect server at {state.url} (log: {server.log_path})")
    server.wait_until_ready(state, lambda line: _say(f"the local Prefect server is {line}"))
    point_prefect_at(state.url)


def _say(line: str) -> None:
    print(f"prefect-sandbox: {line}", file=sys.stderr, flush=True)
