"""The emulators behave as the vendors do, checked with the vendors' real SDKs alone (no code
of ours in between), so they cannot hide a bug of ours that the real service would show.

Facts from the protocol notes (shared/protocols/e2b.md, daytona.md) and the vendors' sources:
Daytona's interpreter is a plain Python worker process, its toolbox takes the sandbox's absolute
paths; E2B's code interpreter sets per-execution environment variables, moves a new context to
its working directory, and has no JavaScript kernel in the emulator, so it refuses one.
"""

from __future__ import annotations

import asyncio
import textwrap
import time
from collections.abc import AsyncIterator

import httpx
import pytest
from daytona import AsyncDaytona, AsyncSandbox, DaytonaConfig, DaytonaError, DaytonaTimeoutError
from e2b_code_interpreter import AsyncSandbox as E2BAsyncSandbox
from e2b_code_interpreter import SandboxException

from prefect_sandbox.testing.daytona import DaytonaEmulator, Fault
from prefect_sandbox.testing.e2b import E2BEmulator
from tests.conftest import kernel_processes

# -- Daytona -------------------------------------------------------------------------------


@pytest.fixture
async def daytona_sandbox(daytona_env: DaytonaEmulator) -> AsyncIterator[AsyncSandbox]:
    """A sandbox of the Daytona emulator, through the real SDK only."""
    config = DaytonaConfig(
        api_key=daytona_env.api_key, api_url=daytona_env.api_url, target=daytona_env.target
    )
    client = AsyncDaytona(config)
    sandbox = await client.create()
    try:
        yield sandbox
    finally:
        await client.delete(sandbox)
        await client.close()


async def test_daytona_runs_code_in_plain_python_not_ipython(daytona_sandbox: AsyncSandbox) -> None:
    run = daytona_sandbox.code_interpreter.run_code
    assert (await run("x = 6 * 7\nprint(x)")).stdout == "42\n"
    # State stays; a last expression shows nothing (no execute_result in plain exec).
    assert (await run("x")).stdout == ""
    plain_python_errors = {
        "%env A=1": "SyntaxError",
        "!echo hi": "SyntaxError",
        "import asyncio\nawait asyncio.sleep(0)": "SyntaxError",
        "get_ipython()": "NameError",
        "display(1)": "NameError",
    }
    for code, ename in plain_python_errors.items():
        result = await run(code)
        assert result.error is not None, code
        assert result.error.name == ename, code
    # The worker keeps only the cell's own frames, renamed as the daemon renames them.
    failing = await run(
        textwrap.dedent("""
        def inner():
            raise ValueError('deep')
        inner()
        """)
    )
    assert failing.error is not None
    assert failing.error.traceback == (
        'Traceback (most recent call last):\n  File "<stdin>", line 4\n'
        '  File "<stdin>", line 3\nValueError: deep\n'
    )
    # Only what goes through sys.stdout is streamed: a raw write to fd 1 is not a chunk.
    raw = await run("import os, sys\nos.write(1, b'raw\\n')\nprint('kept')")
    assert raw.stdout == "kept\n"


async def test_daytona_interrupt_and_exit_as_the_worker_reports_them(
    daytona_sandbox: AsyncSandbox,
) -> None:
    run = daytona_sandbox.code_interpreter.run_code
    # SystemExit ends the execution quietly; the interpreter lives on.
    assert (await run("x = 1\nraise SystemExit(3)")).error is None
    assert (await run("print(x)")).stdout == "1\n"
    # An execution past its deadline: SIGINT, then the daemon closes with 4008.
    with pytest.raises(DaytonaError, match="timed out"):
        await run("import time\ntime.sleep(30)", timeout=1)
    assert (await run("print(x + 1)")).stdout == "2\n"


async def test_daytona_closes_4008_for_an_interrupt_from_outside_long_before_the_timeout(
    daytona_env: DaytonaEmulator, daytona_sandbox: AsyncSandbox
) -> None:
    # The daemon closes with 4008 whenever its worker says "interrupted", whoever sent the
    # SIGINT; the SDK calls that a timeout. The worker lives on, state kept.
    run = daytona_sandbox.code_interpreter.run_code
    await run("x = 1")
    daytona_env.inject(Fault("run_code", interrupt_after_s=1.0))
    start = time.monotonic()
    with pytest.raises(DaytonaTimeoutError, match="timed out"):
        await run("import time\ntime.sleep(30)", timeout=600)
    assert 1.0 <= time.monotonic() - start < 20
    assert (await run("print(x)")).stdout == "1\n"
    # Code that catches it ends as it likes: closed 1000, no error.
    daytona_env.inject(Fault("run_code", interrupt_after_s=1.0))
    caught = "import time\ntry:\n    time.sleep(30)\nexcept KeyboardInterrupt:\n    print('caught')"
    assert (await run(caught)).stdout == "caught\n"


async def test_daytona_run_code_sets_envs_for_that_execution_only(
    daytona_sandbox: AsyncSandbox,
) -> None:
    run = daytona_sandbox.code_interpreter.run_code
    code = "import os\nprint(os.environ.get('PREFECT_SANDBOX_ENV'))"
    assert (await run(code, envs={"PREFECT_SANDBOX_ENV": "set"})).stdout == "set\n"
    assert (await run(code)).stdout == "None\n"


async def test_daytona_toolbox_takes_the_sandboxs_absolute_paths(
    daytona_sandbox: AsyncSandbox,
) -> None:
    home = "/home/daytona"
    await daytona_sandbox.fs.create_folder(f"{home}/data", "755")
    await daytona_sandbox.fs.upload_file(b"a,b\n1,2\n", f"{home}/data/table.csv")
    assert await daytona_sandbox.fs.download_file(f"{home}/data/table.csv") == b"a,b\n1,2\n"
    # Relative paths start at the work directory, which is the home.
    assert await daytona_sandbox.fs.download_file("data/table.csv") == b"a,b\n1,2\n"
    context = await daytona_sandbox.code_interpreter.create_context(cwd=f"{home}/data")
    assert context.cwd == f"{home}/data"
    listed = await daytona_sandbox.code_interpreter.run_code(
        "import os\nprint(sorted(os.listdir('.')))", context=context
    )
    assert listed.stdout == "['table.csv']\n"
    with pytest.raises(DaytonaError):
        await daytona_sandbox.code_interpreter.create_context(cwd=f"{home}/missing")


async def test_daytona_lists_and_deletes_files(daytona_sandbox: AsyncSandbox) -> None:
    fs = daytona_sandbox.fs
    await fs.upload_file(b"12345", "/home/daytona/out/a.txt")
    await fs.upload_file(b"1", "/home/daytona/out/sub/b.txt")
    entries = {info.name: info for info in await fs.list_files("/home/daytona/out")}
    assert sorted(entries) == ["a.txt", "sub"]
    assert (entries["a.txt"].size, entries["a.txt"].is_dir) == (5, False)
    assert entries["sub"].is_dir and entries["sub"].mode.startswith("d")
    assert (await fs.get_file_info("out/a.txt")).size == 5
    with pytest.raises(DaytonaError):
        await fs.delete_file("/home/daytona/out/sub")  # a folder needs recursive=True
    await fs.delete_file("/home/daytona/out/a.txt")
    await fs.delete_file("/home/daytona/out/sub", recursive=True)
    assert await fs.list_files("/home/daytona/out") == []
    with pytest.raises(DaytonaError):
        await fs.delete_file("/home/daytona/out/a.txt")


# -- E2B -------------------------------------------------------------------------------------


@pytest.fixture
async def e2b_sandbox(e2b_emulator: E2BEmulator) -> AsyncIterator[E2BAsyncSandbox]:
    """A sandbox of the E2B emulator, through the real SDK only."""
    sandbox = await E2BAsyncSandbox.create(
        api_key=e2b_emulator.api_key, api_url=e2b_emulator.url, sandbox_url=e2b_emulator.url
    )
    try:
        yield sandbox
    finally:
        await sandbox.kill()


async def test_e2b_code_context_starts_in_its_cwd_and_leaks_no_kernel(
    e2b_sandbox: E2BAsyncSandbox,
) -> None:
    before = {p.pid for p in kernel_processes()}
    await e2b_sandbox.files.make_dir("/home/user/project")
    for cwd, expected in [
        ("/home/user/project", "/home/user/project"),
        ("/tmp", "/tmp"),
        # As the server's %cd, a folder that is not there leaves the kernel at home.
        ("/home/user/missing", "/home/user"),
    ]:
        context = await e2b_sandbox.create_code_context(cwd=cwd)
        assert context.cwd == cwd
        execution = await e2b_sandbox.run_code(
            "import os\nprint(os.getcwd())\nprint(open('probe.txt', 'w').write('x'))",
            context=context,
        )
        assert execution.error is None, execution.error
        # The kernel's own cwd is a folder of the emulator; the file lands where E2B puts it.
        assert await e2b_sandbox.files.exists(f"{expected}/probe.txt")
        assert execution.execution_count == 1
        await e2b_sandbox.remove_code_context(context)
    # Every context's kernel ended with it; none was left by a context made or refused.
    assert {p.pid for p in kernel_processes()} - before == set()


async def test_e2b_run_code_sets_envs_for_that_execution_only(
    e2b_sandbox: E2BAsyncSandbox,
) -> None:
    code = "import os\nprint(os.environ.get('PREFECT_SANDBOX_ENV'))"
    first = await e2b_sandbox.run_code(code, envs={"PREFECT_SANDBOX_ENV": "set"})
    assert first.logs.stdout == ["set\n"]
    second = await e2b_sandbox.run_code(code)
    assert second.logs.stdout == ["None\n"]
    # Setting and removing them is the server's own work: no execution of the user's.
    assert (first.execution_count, second.execution_count) == (1, 2)


async def test_e2b_refuses_a_language_it_has_no_kernel_for(
    e2b_sandbox: E2BAsyncSandbox,
) -> None:
    for language in ("javascript", "js", "r"):
        with pytest.raises(SandboxException, match="500"):
            await e2b_sandbox.run_code("console.log(1)", language=language)
        with pytest.raises(SandboxException, match="500"):
            await e2b_sandbox.create_code_context(language=language)
    assert (await e2b_sandbox.run_code("print(1)", language="python")).logs.stdout == ["1\n"]


async def test_e2b_listing_a_folder_with_a_name_that_is_not_utf8_fails_whole(
    e2b_sandbox: E2BAsyncSandbox,
) -> None:
    # envd (Go) puts a file name's bytes in a proto3 string; connect-go's marshalling refuses
    # one that is not UTF-8, so the whole ListDir fails with "internal", the good names too.
    await e2b_sandbox.files.make_dir("/home/user/names")
    await e2b_sandbox.files.write("/home/user/names/clean.csv", "a,b\n")
    assert [e.name for e in await e2b_sandbox.files.list("/home/user/names")] == ["clean.csv"]
    # The kernel's own paths are the emulator's folders: the name is made relative to its cwd.
    context = await e2b_sandbox.create_code_context(cwd="/home/user/names")
    made = await e2b_sandbox.run_code(
        "import os\nopen(os.fsdecode(b'r\\xe9sum\\xe9.csv'), 'w').write('x')", context=context
    )
    assert made.error is None, made.error
    with pytest.raises(SandboxException, match=r"EntryInfo\.name contains invalid UTF-8"):
        await e2b_sandbox.files.list("/home/user/names")


async def test_e2b_first_execution_on_each_connection_gets_envds_variables(
    e2b_emulator: E2BEmulator,
) -> None:
    sandbox = await E2BAsyncSandbox.create(
        api_key=e2b_emulator.api_key,
        api_url=e2b_emulator.url,
        sandbox_url=e2b_emulator.url,
        envs={"PREFECT_SANDBOX_GIVEN": "at create"},
    )
    try:
        # envd serves them; the kernel's own environment does not have them.
        async with httpx.AsyncClient() as client:
            served = await client.get(
                f"{e2b_emulator.url}/envs",
                headers={
                    "E2b-Sandbox-Id": sandbox.sandbox_id,
                    "X-Access-Token": sandbox._envd_access_token or "",
                },
            )
        assert served.json()["PREFECT_SANDBOX_GIVEN"] == "at create"
        assert served.json()["E2B_SANDBOX"] == "true"
        context = await sandbox.create_code_context()
        # The lines before the first execution move a cell magic off the first line...
        first = await sandbox.run_code("%%capture cap\nprint(1)", context=context)
        # The UsageError comes only in the execute_reply, which the server may read after the
        # idle that ends the execution (as on the real server): then only its stderr line shows.
        reported = first.error.name if first.error is not None else "".join(first.logs.stderr)
        assert "UsageError" in reported
        await sandbox.restart_code_context(context)
        # ... and the user's line 1 down, again after each restart.
        first = await sandbox.run_code("raise ValueError('line 1')", context=context)
        assert first.error is not None and first.error.name == "ValueError"
        # Four variables and a blank line: line 6 (as seen on the real server).
        assert "----> 6 raise ValueError" in first.error.traceback
        second = await sandbox.run_code(
            "import os\nprint(os.environ['PREFECT_SANDBOX_GIVEN'])", context=context
        )
        assert (second.logs.stdout, second.execution_count) == (["at create\n"], 2)
    finally:
        await sandbox.kill()


async def test_e2b_an_aborted_request_never_ends_its_stream(e2b_sandbox: E2BAsyncSandbox) -> None:
    started = asyncio.Event()
    cell = asyncio.create_task(
        e2b_sandbox.run_code(
            "x = 1\nimport time\nprint('started', flush=True)\nwhile True: time.sleep(0.1)",
            on_stdout=lambda _: started.set(),
            timeout=0,
        )
    )
    await asyncio.wait_for(started.wait(), 30)
    cell.cancel()
    await asyncio.wait({cell})
    # Sent at once, it reaches the kernel before the interrupt does: ipykernel aborts it, and
    # the server, which knows only "abort", never ends its stream (keepalives only).
    probe = asyncio.create_task(e2b_sandbox.run_code("print('probe')", timeout=0))
    done, _ = await asyncio.wait({probe}, timeout=6)
    assert not done
    probe.cancel()
    await asyncio.wait({probe})
    await asyncio.sleep(1.0)
    # The interrupt stopped the cell, not the kernel: its state is there.
    after = await e2b_sandbox.run_code("print(x)")
    assert (after.logs.stdout, after.error) == (["1\n"], None)


async def test_e2b_exit_is_passed_on_as_nothing_and_the_kernel_comes_back(
    e2b_sandbox: E2BAsyncSandbox,
) -> None:
    assert (await e2b_sandbox.run_code("x = 1")).error is None
    ended = await e2b_sandbox.run_code("print('bye')\nexit()")
    assert (ended.logs.stdout, ended.error, ended.results) == (["bye\n"], None, [])
    # Jupyter's restarter brings a fresh kernel within seconds (a cell meanwhile may still run
    # in the dying one, or end with ContextRestarting).
    deadline = asyncio.get_running_loop().time() + 60
    while True:
        probe = await e2b_sandbox.run_code("print('x' in globals())")
        if probe.logs.stdout == ["False\n"]:
            break
        assert asyncio.get_running_loop().time() < deadline, probe
        await asyncio.sleep(0.5)


async def test_e2b_errors_and_displays_as_the_template_makes_them(
    e2b_sandbox: E2BAsyncSandbox,
) -> None:
    failed = await e2b_sandbox.run_code("def f():\n    1 / 0\nf()")
    assert failed.error is not None
    traceback = failed.error.traceback
    # NoColor, and the lines joined with nothing between them.
    assert "\x1b" not in traceback
    assert "-" * 75 + "ZeroDivisionError" in traceback
    shown = await e2b_sandbox.run_code(
        "from PIL import Image\n"
        "Image.new('RGB', (2, 2)).save('tiny.png')\n"
        "display([1, 2])\n"
        "{'a': [1, 2]}"
    )
    image, listed, value = shown.results
    assert image.png and not image.is_main_result
    assert (listed.json, listed.is_main_result) == ([1, 2], False)
    assert (value.json, value.text, value.is_main_result) == ({"a": [1, 2]}, "{'a': [1, 2]}", True)
    assert await e2b_sandbox.files.exists("/home/user/tiny.png")
