"""The private or internal APIs of Prefect and prefect-aws that this package reaches.

Each is reached here only, so that a release that moves one breaks one function, named in one
place; CPython's are in `prefect_sandbox.sandbox._compat`. Every import is inside its function:
importing this module imports no Prefect. Manual: docs/development.md.

- ``Block._block_document_id`` / ``_block_document_name``: a saved block's id and name
  (Prefect 3 has no public accessor).
- ``S3Bucket._join_bucket_folder``: prefect-aws's rule for a key under the block's folder.
- ``_sync=True``: forces the blocking call of prefect-aws's ``S3Bucket`` methods, which
  dispatch on the run context (``async_dispatch``), for code that runs in a thread.
- ``prefect.server.api.server.SubprocessASGIServer``: the temporary API server Prefect starts
  when no ``PREFECT_API_URL`` is set; one instance per process.
- ``prefect.context.GLOBAL_SETTINGS_CONTEXT``: the settings every later flow call reads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from uuid import UUID

if TYPE_CHECKING:
    from prefect.blocks.core import Block
    from prefect.context import SettingsContext
    from prefect_aws import S3Bucket

__all__ = [
    "block_document_id",
    "block_document_name",
    "called_blocking",
    "global_settings_context",
    "join_bucket_folder",
    "set_global_settings_context",
    "temporary_api_server_url",
]


def block_document_id(block: Block) -> UUID | None:
    """The id of ``block``'s saved document; None for a block never saved or loaded."""
    return block._block_document_id


def block_document_name(block: Block) -> str | None:
    """The name ``block`` was saved or loaded under; None for a block never saved."""
    return block._block_document_name


def join_bucket_folder(bucket: S3Bucket, key: str) -> str:
    """``key`` under ``bucket``'s ``bucket_folder``, as prefect-aws writes and reads it."""
    return bucket._join_bucket_folder(key)


def called_blocking(method: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """Call a method Prefect's ``async_dispatch`` made (prefect-aws's ``S3Bucket.read_path``,
    ``upload_from_path``...) blocking, whatever the caller's run context: inside a flow run
    it would return a coroutine.

    Returns:
        What the blocking method returns; it raises what that raises.
    """
    return method(*args, _sync=True, **kwargs)


def temporary_api_server_url() -> str:
    """Start this process's temporary Prefect API server unless it runs already (as
    Prefect's ``get_client`` would, with no ``PREFECT_API_URL``), and return its API URL.
    """
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer()
    server.start()
    return server.api_url


def global_settings_context() -> SettingsContext:
    """The process-wide settings context Prefect built when it was imported."""
    import prefect.context

    return prefect.context.GLOBAL_SETTINGS_CONTEXT


def set_global_settings_context(context: SettingsContext) -> None:
    """Replace the process-wide settings context: every later flow call reads it, unless a
    ``temporary_settings`` block around the call says otherwise."""
    import prefect.context

    prefect.context.GLOBAL_SETTINGS_CONTEXT = context
