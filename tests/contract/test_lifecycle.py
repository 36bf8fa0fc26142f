"""Contract: handles reach the same sandbox from other threads and processes; kill is final."""

from __future__ import annotations

import asyncio
import platform
import subprocess
import sys
import textwrap

import pytest

from prefect_sandbox.blocks.base import SandboxBackend
from prefect_sandbox.sandbox.base import Sandbox, SandboxHandle
from prefect_sandbox.sandbox.errors import SandboxNotFoundError
from tests.conftest import stream_text
from tests.contract.conftest import CONTRACT_LABELS


async def test_attach_from_another_thread_and_process(
    backend: SandboxBackend, sandbox: Sandbox
) -> None:
    await sandbox.run_cell("shared = ['main']")

    def in_thread() -> str:
        async def go() -> str:
            other = await backend.attach(sandbox.handle)
            try:
                result = await other.run_cell("shared.append('thread'); print(shared)")
            finally:
                await other.close()
            return stream_text(result.outputs)

        return asyncio.run(go())

    assert await asyncio.to_thread(in_thread) == "['main', 'thread']\n"

    script = textwrap.dedent(
        """
        import asyncio, importlib, json, sys
        from prefect_sandbox.sandbox.base import SandboxHandle

        async def main():
            given = json.loads(sys.stdin.read())
            module, name = given["backend_class"].rsplit(".", 1)
            backend_class = getattr(importlib.import_module(module), name)
            backend = backend_class.model_validate(given["backend"])
            box = await backend.attach(SandboxHandle.model_validate(given["handle"]))
            result = await box.run_cell("shared.append('process'); print(shared)")
            await box.close()
            print(result.outputs[0]["text"], end="")

        asyncio.run(main())
        """
    )
    given = {
        "backend_class": f"{type(backend).__module__}.{type(backend).__name__}",
        "backend": backend.model_dump(mode="json", context={"include_secrets": True}),
        "handle": sandbox.handle.model_dump(mode="json"),
    }
    import json

    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-c", script],
        input=json.dumps(given),
        capture_output=True,
        text=True,
        # A fresh interpreter imports Prefect and a vendor SDK (15 s and more on a busy
        # machine) before its first call, which the SDK itself allows 60 s.
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "['main', 'thread', 'process']\n"
    after = await sandbox.run_cell("print(len(shared))")
    assert stream_text(after.outputs) == "3\n"


async def test_kill_is_idempotent_and_final(backend: SandboxBackend) -> None:
    box = await backend.create(CONTRACT_LABELS)
    handle = box.handle
    listed = await backend.list_sandboxes(CONTRACT_LABELS)
    assert handle.sandbox_id in {h.sandbox_id for h in listed}
    assert await box.kill() is True
    assert await box.kill() is False
    with pytest.raises(SandboxNotFoundError, match=handle.sandbox_id):
        await backend.attach(handle)
    listed = await backend.list_sandboxes(CONTRACT_LABELS)
    assert handle.sandbox_id not in {h.sandbox_id for h in listed}


async def test_async_with_kills_on_exit(backend: SandboxBackend) -> None:
    async with await backend.create(CONTRACT_LABELS) as box:
        handle = box.handle
        assert (await box.run_cell("1 + 1")).status == "ok"
    with pytest.raises(SandboxNotFoundError):
        await backend.attach(handle)


@pytest.mark.shares_sandbox
async def test_the_handle_names_the_python_kernel_that_runs_the_cells(sandbox: Sandbox) -> None:
    kernel = sandbox.handle.kernel
    assert kernel is not None
    assert (kernel.kernelspec["language"], kernel.language_info["name"]) == ("python", "python")
    assert kernel.kernelspec["name"] and kernel.kernelspec["display_name"]
    if sandbox.handle.backend == "local":
        # Asked of the kernel itself: its kernel_info reply.
        assert kernel.language_info["version"] == platform.python_version()
    again = SandboxHandle.model_validate_json(sandbox.handle.model_dump_json())
    assert again.kernel == kernel
