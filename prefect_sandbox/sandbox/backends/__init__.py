"""The sandbox backends, one module each, every one a `prefect_sandbox.sandbox.base.Sandbox`.

- `kernel`: the host-kernel backends, `kernel.local` (`LocalKernelSandbox`, an ipykernel on this
  machine, no extra needed) and `kernel.docker` (`DockerSandbox`, an ipykernel in a Docker
  container, ``pip install 'prefect-sandbox[docker]'``), with the machinery they share.
- `e2b`: `E2BSandbox`, an E2B cloud sandbox (``pip install 'prefect-sandbox[e2b]'``).
- `daytona`: `DaytonaSandbox`, a Daytona sandbox (``pip install 'prefect-sandbox[daytona]'``);
  `prefect_sandbox.sandbox.kernel_side.daytona_runner` is the code it installs in the sandbox's
  interpreter.
- `native_threads`: waits, at exit, for a vendor SDK's native threads (E2B's).

No backend is imported here, so importing one never imports another's SDK.
Manual: docs/backends/index.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.util
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from types import ModuleType
from typing import Any, ParamSpec, TypeVar

from prefect_sandbox.sandbox.errors import (
    BackendNotInstalledError,
    SandboxError,
    SandboxNotFoundError,
    portable_chain,
)

__all__ = [
    "cancel_and_wait",
    "extra_hint",
    "import_extra",
    "kill_after_failed_setup",
    "missing_extra",
    "run_to_end_in_thread",
    "translated",
    "translated_async",
]

logger = logging.getLogger(__name__)

_P = ParamSpec("_P")
_T = TypeVar("_T")


def extra_hint(what: str, extra: str) -> str:
    """The message for a missing extra: ``what`` (``"the Daytona backend"``) needs ``extra``,
    and the command that installs it."""
    return f"{what} needs the {extra} extra: pip install 'prefect-sandbox[{extra}]'"


def missing_extra(what: str, extra: str, modules: tuple[str, ...]) -> str | None:
    """Say (`extra_hint`) that ``extra`` is not installed when one of ``modules`` cannot be
    found, without importing any (`importlib.util.find_spec`: an SDK's import costs seconds);
    None when all can be."""
    for module in modules:
        if importlib.util.find_spec(module) is None:
            return extra_hint(what, extra)
    return None


def import_extra(module: str, *, extra: str, backend: str) -> ModuleType:
    """Import a backend's SDK, which comes with one of the package's extras.

    Args:
        module: the SDK's module name (``"daytona"``).
        extra: the extra that installs it (``"daytona"``).
        backend: the backend's name for people (``"Daytona"``).

    Returns:
        The imported module.

    Raises:
        BackendNotInstalledError: it is not installed; the message says what to install.
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise BackendNotInstalledError(
            extra_hint(f"the {backend} backend", extra), extra=extra
        ) from exc


async def cancel_and_wait(task: asyncio.Task[Any]) -> None:
    """Cancel a task and wait for it to end; what it raises then no longer matters."""
    task.cancel()
    await asyncio.wait({task})
    if not task.cancelled():
        task.exception()


async def run_to_end_in_thread(func: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> _T:
    """Run a blocking call in a thread, off the event loop, and see it end even if cancelled.

    For calls that start or end processes or containers: the event loop they would block is
    also reading other sandboxes' output (a sweep's branches share one). A cancellation waits
    for the call to end before it is raised, so that what the call started is recorded, for
    the caller's clean-up to end; a bare `asyncio.to_thread` would leave it running unseen.

    Returns:
        What ``func`` returns.

    Raises:
        What ``func`` raises; `asyncio.CancelledError` once it has ended, if cancelled meanwhile.
    """
    call = asyncio.ensure_future(asyncio.to_thread(func, *args, **kwargs))
    try:
        return await asyncio.shield(call)
    except asyncio.CancelledError:
        # anyio's cancel scopes cancel every await again until the scope is left.
        while not call.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait({call})
        if not call.cancelled():
            call.exception()  # retrieved: the cancellation is what the caller gets
        raise


async def kill_after_failed_setup(
    kill: Callable[[], Awaitable[object]], *, backend: str, sandbox_id: str, left_for: str
) -> None:
    """Kill a sandbox whose set-up failed after it was made, logging the attempt and its end.

    A failure to kill is a warning naming the sandbox, never raised: the set-up's own error is
    what the caller raises next.

    Args:
        kill: the backend's kill, already retrying what is transient.
        backend: the backend's name for people (``"E2B"``).
        sandbox_id: the sandbox made.
        left_for: what ends a sandbox left alive (its lifetime, the reaper), for the warning.
    """
    logger.info("%s sandbox %s: set-up failed; killing it", backend, sandbox_id)
    try:
        await kill()
    except SandboxNotFoundError:
        logger.info("%s sandbox %s was already gone", backend, sandbox_id)
    except SandboxError as exc:
        logger.warning(
            "%s sandbox %s, whose set-up failed, could not be killed (%s); %s",
            backend,
            sandbox_id,
            exc,
            left_for,
        )


@contextlib.contextmanager
def translated(translate: Callable[[Exception], SandboxError | None]) -> Iterator[None]:
    """Raise what a backend's error mapper makes of an exception, ``from`` it.

    Our own errors pass unchanged but for their chain, made portable (`portable_chain`: the
    vendor's exceptions in it become `ForeignError` stand-ins); anything the mapper returns
    None for (a bug, not the vendor's or the transport's failure) passes unchanged.

    Args:
        translate: the backend's one translation function, its call details bound.
    """
    with portable_chain():
        try:
            yield
        except SandboxError:
            raise
        except Exception as exc:
            mapped = translate(exc)
            if mapped is None:
                raise
            raise mapped from exc


@contextlib.asynccontextmanager
async def translated_async(
    translate: Callable[[Exception], Awaitable[SandboxError | None]],
) -> AsyncIterator[None]:
    """`translated`, for a mapper that must ask the backend what an error means (is the
    sandbox still there?)."""
    try:
        yield
    except Exception as exc:
        mapped = None if isinstance(exc, SandboxError) else await translate(exc)
        # Asked first, as it awaits; then raised as `translated` raises it.
        with translated(lambda _: mapped):
            raise
