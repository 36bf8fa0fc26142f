"""What only the local kernel promises: its environment, its processes and their limits.

Behaviour every backend shares is in tests/contract/.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from jupyter_client.asynchronous import AsyncKernelClient

from prefect_sandbox.sandbox.backends.kernel.isolation import Isolation
from prefect_sandbox.sandbox.backends.kernel.jupyter import STREAM_MESSAGE_CHARS
from prefect_sandbox.sandbox.backends.kernel.local import (
    HOST_ENV_ALLOW_LIST,
    LocalKernelConfig,
    LocalKernelSandbox,
)
from prefect_sandbox.sandbox.errors import SandboxDiedError, SandboxError, SandboxUnavailableError
from tests.conftest import kernel_processes, stream_text
from tests.contract.test_forks import forked_child

GIB = 1 << 30

# Processes, signals and limits work differently under bwrap (a PID namespace, bwrap between
# this process and the kernel): these tests run with and without it.
both_isolations = pytest.mark.parametrize("isolation", ["bubblewrap", "none"])


def _kernel_process(box: LocalKernelSandbox) -> psutil.Process:
    """The ipykernel process itself (under bubblewrap, kernel.pid is bwrap's, its ancestor)."""
    pid_file = Path(box.handle.connection["runtime_dir"]) / "kernel.pid"
    launched = psutil.Process(int(pid_file.read_text()))
    return next(
        process
        for process in [launched, *launched.children(recursive=True)]
        if "ipykernel" in " ".join(process.cmdline())
    )


def _gone(process: psutil.Process) -> bool:
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


async def test_kernel_env_holds_only_what_it_was_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "host-secret-value")
    monkeypatch.setenv("E2B_API_KEY", "e2b-host-key")
    box = await LocalKernelSandbox.create(LocalKernelConfig(env={"MODEL_SEED": "7"}))
    try:
        result = await box.run_cell("import os, json; print(json.dumps(dict(os.environ)))")
    finally:
        await box.kill()
    env = json.loads(stream_text(result.outputs))
    assert env["MODEL_SEED"] == "7"
    assert "host-secret-value" not in str(env) and "e2b-host-key" not in str(env)
    # Besides the allow-list and the user's variables, only what jupyter_client and ipykernel
    # set for every kernel (parent pid, terminal and pager settings, the inline backend).
    added_by_jupyter = {
        "JPY_PARENT_PID",
        "TERM",
        "CLICOLOR",
        "CLICOLOR_FORCE",
        "FORCE_COLOR",
        "PAGER",
        "GIT_PAGER",
        "MPLBACKEND",
        "PYDEVD_USE_FRAME_EVAL",
    }
    ours = {"IPYTHONDIR"}
    # bwrap sets PWD to the directory the kernel starts in, as a shell does.
    ours |= {"PWD"}
    assert set(env) <= set(HOST_ENV_ALLOW_LIST) | {"MODEL_SEED"} | added_by_jupyter | ours


async def test_one_sandboxs_history_is_not_visible_in_the_next() -> None:
    first = await LocalKernelSandbox.create(LocalKernelConfig())
    try:
        await first.run_cell("token = 'history-canary-' + 'f00d'")
        # IPython writes history from a saving thread; ask it to write now.
        await first.run_cell("get_ipython().history_manager.writeout_cache()")
    finally:
        await first.kill()
    second = await LocalKernelSandbox.create(LocalKernelConfig())
    try:
        result = await second.run_cell("%history -g history-canary")
        own = await second.run_cell("import IPython; print(IPython.paths.get_ipython_dir())")
        where = await second.run_cell("print(get_ipython().history_manager.hist_file)")
    finally:
        await second.kill()
    assert result.status == "ok"
    assert "f00d" not in stream_text(result.outputs)
    # In memory, as nbclient keeps it: no SQLite commit per cell.
    assert stream_text(where.outputs).strip() == ":memory:"
    assert stream_text(own.outputs).strip() == str(
        Path(second.handle.connection["runtime_dir"]) / "ipython"
    )


@both_isolations
async def test_interrupted_kernel_is_idle_afterwards(isolation: Isolation) -> None:
    box = await LocalKernelSandbox.create(
        LocalKernelConfig(interrupt_grace_s=2.0, isolation=isolation)
    )
    try:
        result = await box.run_cell("while True: pass", timeout_s=0.5)
        assert result.interrupted
        assert stream_text((await box.run_cell("print(1)")).outputs) == "1\n"
        assert _kernel_process(box).cpu_percent(interval=0.5) < 5.0
    finally:
        await box.kill()


@both_isolations
async def test_kill_takes_the_kernels_children_and_files(isolation: Isolation) -> None:
    before = {p.pid for p in kernel_processes()}
    box = await LocalKernelSandbox.create(LocalKernelConfig(isolation=isolation))
    await box.run_cell("import subprocess; child = subprocess.Popen(['sleep', '300'])")
    kernel = _kernel_process(box)
    sleeper = next(c for c in kernel.children(recursive=True) if c.name() == "sleep")
    workdir = Path(box.handle.workdir)
    assert await box.kill() is True
    assert {p.pid for p in kernel_processes()} == before
    assert _gone(kernel) and _gone(sleeper)
    assert not workdir.exists()
    assert not Path(box.handle.connection["runtime_dir"]).exists()


@both_isolations
async def test_a_sigkilled_flow_process_leaves_no_kernel_behind(isolation: Isolation) -> None:
    script = textwrap.dedent(
        """
        import asyncio, json, pathlib, time
        import psutil
        from prefect_sandbox.sandbox.backends.kernel.local import (
            LocalKernelConfig,
            LocalKernelSandbox,
        )

        async def main():
            box = await LocalKernelSandbox.create(LocalKernelConfig(isolation=ISOLATION))
            await box.run_cell("import subprocess; child = subprocess.Popen(['sleep', '300'])")
            runtime_dir = box.handle.connection["runtime_dir"]
            # Host pids: inside its PID namespace an isolated kernel sees other numbers.
            launched = psutil.Process(int(pathlib.Path(runtime_dir, "kernel.pid").read_text()))
            tree = [launched, *launched.children(recursive=True)]
            kernel = next(p for p in tree if "ipykernel" in " ".join(p.cmdline()))
            sleeper = next(p for p in tree if p.name() == "sleep")
            pids = f"{kernel.pid} {sleeper.pid}"
            print(json.dumps([runtime_dir, box.handle.workdir, pids]), flush=True)
            time.sleep(300)

        asyncio.run(main())
        """
    ).replace("ISOLATION", repr(isolation))
    runtime_dir = workdir = ""
    holder = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None
        line = await asyncio.to_thread(holder.stdout.readline)
        runtime_dir, workdir, pids = json.loads(line)
        kernel_pid, sleeper_pid = (int(pid) for pid in pids.split())
        kernel, sleeper = psutil.Process(kernel_pid), psutil.Process(sleeper_pid)
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=10)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (_gone(kernel) and _gone(sleeper)):
            await asyncio.sleep(0.1)
        assert _gone(kernel), "kernel outlived the process that started it"
        assert _gone(sleeper), "the kernel's child outlived the process that started it"
    finally:
        holder.kill()
        holder.wait()
        assert holder.stdout is not None
        holder.stdout.close()
        # The SIGKILLed process could not remove its sandbox's folders.
        for folder in (runtime_dir, workdir):
            if folder:
                shutil.rmtree(folder, ignore_errors=True)


@both_isolations
async def test_memory_bomb_ends_in_memory_error_not_a_dead_host(isolation: Isolation) -> None:
    box = await LocalKernelSandbox.create(
        LocalKernelConfig(memory_limit_bytes=3 * GIB, isolation=isolation)
    )
    try:
        bomb = await box.run_cell("hog = bytearray(16 * 2**30)")
        assert bomb.error is not None and bomb.error.ename == "MemoryError"
        assert stream_text((await box.run_cell("print('still here')")).outputs) == "still here\n"
    finally:
        await box.kill()


@both_isolations
async def test_cpu_time_limit_ends_the_kernel_and_says_so(isolation: Isolation) -> None:
    box = await LocalKernelSandbox.create(
        LocalKernelConfig(cpu_time_limit_s=3, isolation=isolation)
    )
    try:
        # The limit ends the kernel, not the cell's timeout (which returns a timeout result);
        # no bound on the wall time: 3 s of CPU took 27-32 s with two CPU burners beside.
        with pytest.raises(SandboxDiedError) as info:
            await box.run_cell("while True: pass", timeout_s=600)
        assert info.value.signal in (signal.SIGXCPU, signal.SIGKILL)
    finally:
        await box.kill()


def test_limits_must_be_positive() -> None:
    for name in ("memory_limit_bytes", "cpu_time_limit_s", "max_output_chars"):
        with pytest.raises(ValueError, match=name):
            LocalKernelConfig(**{name: 0})


async def test_list_handles_finds_sandboxes_by_label() -> None:
    box = await LocalKernelSandbox.create(LocalKernelConfig(), {"prefect-flow-run-id": "run-1"})
    try:
        found = await LocalKernelSandbox.list_handles(
            LocalKernelConfig(), {"prefect-flow-run-id": "run-1"}
        )
        assert [h.sandbox_id for h in found] == [box.handle.sandbox_id]
        assert (
            await LocalKernelSandbox.list_handles(
                LocalKernelConfig(), {"prefect-flow-run-id": "other"}
            )
            == []
        )
    finally:
        await box.kill()


async def test_workdir_root_and_unknown_kernel(tmp_path: Path) -> None:
    box = await LocalKernelSandbox.create(LocalKernelConfig(workdir_root=tmp_path / "home"))
    try:
        result = await box.run_cell("import os; print(os.getcwd())")
        assert Path(stream_text(result.outputs).strip()).parent == tmp_path / "home"
    finally:
        await box.kill()
    with pytest.raises(SandboxError, match="no-such-kernel"):
        await LocalKernelSandbox.create(LocalKernelConfig(kernel_name="no-such-kernel"))
    assert os.listdir(tmp_path / "home") == []


async def test_a_kernel_that_is_not_python_is_refused_before_it_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec_dir = tmp_path / "jupyter" / "kernels" / "ir"
    spec_dir.mkdir(parents=True)
    started = tmp_path / "started"
    spec = {"argv": ["touch", str(started)], "display_name": "R", "language": "R"}
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    with pytest.raises(SandboxError) as info:
        await LocalKernelSandbox.create(
            LocalKernelConfig(kernel_name="ir", workdir_root=tmp_path / "home")
        )
    assert str(info.value) == "Jupyter kernel 'ir' runs 'R', not Python (setting kernel_name)"
    assert not started.exists() and os.listdir(tmp_path / "home") == []


async def test_a_flood_of_stdout_reaches_the_client_in_bounded_messages() -> None:
    # ipykernel alone would send this cell's 16 MB as one message (it flushes every 0.2 s).
    box = await LocalKernelSandbox.create(LocalKernelConfig())
    observer = AsyncKernelClient()
    observer.load_connection_file(
        str(Path(box.handle.connection["runtime_dir"]) / "connection.json")
    )
    observer.start_channels(shell=False, iopub=True, stdin=False, hb=False, control=False)
    try:
        await asyncio.sleep(0.5)  # let the observer's subscription take effect
        code = "import sys\nfor _ in range(256): sys.stdout.write('y' * 65535 + '\\n')"
        result = await box.run_cell(code)
        sizes = []
        while True:
            msg = await observer.get_iopub_msg(timeout=5)
            if msg["header"]["msg_type"] == "stream":
                sizes.append(len(msg["content"]["text"]))
            elif msg["header"]["msg_type"] == "status" and (
                msg["parent_header"].get("msg_id") == result.msg_id
                and msg["content"]["execution_state"] == "idle"
            ):
                break
    finally:
        observer.stop_channels()
        await box.kill()
    assert result.status == "ok"
    assert sum(sizes) == 256 * 65536
    assert len(sizes) >= 256 * 65536 // (STREAM_MESSAGE_CHARS + 65536)
    assert max(sizes) <= STREAM_MESSAGE_CHARS + 65536


async def test_raw_oversized_messages_are_counted_not_read_into_host_memory() -> None:
    # A cell bypasses print's bounded stream messages: raw display, update and stream messages
    # of 4 MiB each straight onto iopub, also from a thread after the cell ends. With a cap of
    # 10,000 characters, none of them is decoded on the host: each is counted and named.
    box = await LocalKernelSandbox.create(LocalKernelConfig(max_output_chars=10_000))
    big = 4 << 20
    code = textwrap.dedent(f"""
        import threading
        from IPython.display import publish_display_data
        kernel = get_ipython().kernel
        parent = kernel.get_parent()
        def raw(msg_type, content):
            kernel.session.send(kernel.iopub_socket, msg_type, content, parent=parent)
        for i in range(8):
            publish_display_data({{'text/plain': 'D' * {big}}})
        raw('update_display_data', {{'data': {{'text/plain': 'U' * {big}}}, 'metadata': {{}},
            'transient': {{'display_id': 'x'}}}})
        raw('stream', {{'name': 'stdout', 'text': 'S' * {big}}})
        publish_display_data({{'text/plain': 'small one'}})
        late = threading.Timer(0.5, raw, ('display_data', {{'data': {{'text/plain': 'L' * {big}}},
            'metadata': {{}}}}))
        late.start()
        print('after the flood')
    """)
    try:
        tracemalloc.start()
        result = await box.run_cell(code)
        _, peak_bytes = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        await box.run_cell("late.join()")
        late = await box.take_late_outputs()
    finally:
        await box.kill()
    assert result.status == "ok", result.error
    texts = [o.get("text", "") for o in result.outputs] + [
        str(o.get("data", {}).get("text/plain", "")) for o in result.outputs
    ]
    assert "after the flood\n" in "".join(texts) and "small one" in texts
    marker = next(text for text in texts if "output truncated" in text)
    assert "8 display_data (too large to read)" in marker
    assert "1 update_display_data (too large to read)" in marker
    assert "1 stream (too large to read)" in marker
    assert result.omitted_chars > 10 * big
    # No message was ever whole in Python: the old reader held all 8 displays decoded (64 MiB).
    assert peak_bytes < big, peak_bytes
    [late_outputs] = late.values()
    assert "1 display_data (too large to read)" in late_outputs[0]["text"]


async def test_a_slow_output_callback_keeps_up_with_thousands_of_flushed_writes() -> None:
    # 20,000 flushed progress updates are 20,000 iopub messages. One call per message at 5 ms
    # (a log record each) would take 100 s: the cell would run into its timeout and lose state.
    calls: list[str] = []

    def slow_callback(output: dict[str, object]) -> None:
        calls.append(str(output.get("text", "")))
        time.sleep(0.005)

    code = (
        "import sys\nfor i in range(20000):\n"
        "    sys.stdout.write(f'\\rstep {i}'); sys.stdout.flush()\nprint('\\nend')"
    )
    box = await LocalKernelSandbox.create(LocalKernelConfig(interrupt_grace_s=2.0))
    try:
        result = await box.run_cell(code, timeout_s=30, on_output=slow_callback)
        after = await box.run_cell("print(i)")
    finally:
        await box.kill()
    assert result.status == "ok" and not result.state_lost
    assert stream_text(result.outputs) == "step 19999\nend\n"
    assert stream_text(after.outputs) == "19999\n"
    assert len(calls) < 2000
    # Every write reaches the callback exactly once, in order.
    assert "".join(calls) == "".join(f"\rstep {i}" for i in range(20000)) + "\nend\n"


async def test_the_kernel_never_drops_output_for_a_slow_reader() -> None:
    # zmq's default send high-water mark (1,000 messages) makes the kernel DROP iopub output
    # once a reader on a loaded machine falls that far behind.
    code = "import zmq\nprint(get_ipython().kernel.iopub_thread.socket.getsockopt(zmq.SNDHWM))"
    box = await LocalKernelSandbox.create(LocalKernelConfig())
    try:
        result = await box.run_cell(code)
    finally:
        await box.kill()
    assert stream_text(result.outputs) == "0\n"


async def test_a_cell_that_ended_in_time_is_not_interrupted_while_its_output_is_read() -> None:
    # The callback holds the reader past the deadline; the kernel had long replied by then.
    stalled: list[dict[str, object]] = []

    def stall_once(output: dict[str, object]) -> None:
        if not stalled:
            time.sleep(2.0)
        stalled.append(output)

    box = await LocalKernelSandbox.create(LocalKernelConfig(interrupt_grace_s=1.0))
    try:
        result = await box.run_cell(
            "x = 41\nprint('hi')\nx += 1", timeout_s=0.5, on_output=stall_once
        )
        after = await box.run_cell("print(x)")
    finally:
        await box.kill()
    assert result.status == "ok" and not result.interrupted and not result.state_lost
    assert stream_text(result.outputs) == "hi\n"
    assert stream_text(after.outputs) == "42\n"


async def test_an_idle_sent_by_another_holder_of_the_sockets_does_not_end_the_cell() -> None:
    """An idle status for the running cell that is not the kernel's (here the kernel sends one
    itself mid-cell, as a forked copy that holds its sockets would) does not end the cell: it
    ends with the kernel's reply, with what it printed after."""
    box = await LocalKernelSandbox.create(LocalKernelConfig(isolation="none"))
    try:
        result = await box.run_cell(
            "kernel = get_ipython().kernel\n"
            "kernel.session.send(kernel.iopub_socket, 'status', {'execution_state': 'idle'},"
            " parent=kernel.get_parent(), ident=kernel._topic('status'))\n"
            "import time\n"
            "time.sleep(1.5)\n"
            "print('after the stray idle')",
            timeout_s=30,
        )
        assert result.status == "ok"
        assert stream_text(result.outputs) == "after the stray idle\n"
    finally:
        await box.kill()


async def test_a_forked_child_stopped_at_its_cells_end_ends_with_a_restart() -> None:
    box = await LocalKernelSandbox.create(LocalKernelConfig(isolation="none"))
    try:
        child = await forked_child(box)
        await box.restart()
        child.wait(timeout=30)
        assert not child.is_running()
    finally:
        await box.kill()


async def test_a_kernel_slow_to_end_after_exit_is_reported_ended_until_restarted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Beside two CPU burners a pooled kernel took over 5 s to end after exit(); the cell then
    # returned as if it ran, and the next cell went to a kernel whose loop had stopped.
    monkeypatch.setattr("prefect_sandbox.sandbox.backends.kernel.jupyter._EXIT_WAIT_S", 1.0)
    box = await LocalKernelSandbox.create(LocalKernelConfig(isolation="none"))
    try:
        slow_exit = "import atexit, time; atexit.register(time.sleep, 20); exit()"
        with pytest.raises(SandboxDiedError, match=r"called exit\(\).*not ended 1 s later"):
            await box.run_cell(slow_exit, timeout_s=60)
        assert _kernel_process(box).is_running()
        with pytest.raises(SandboxDiedError, match="called exit"):
            await box.run_cell("print('after')", timeout_s=60)
        await box.restart()
        result = await box.run_cell("print('fresh')", timeout_s=60)
        assert stream_text(result.outputs) == "fresh\n"
    finally:
        await box.kill()


async def test_a_tmpdir_too_long_for_ipc_sockets_is_named_in_a_sandbox_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The IPC sockets' paths under it would pass the 107-byte limit of Unix socket paths.
    long_tmp = tmp_path / ("t" * max(1, 90 - len(str(tmp_path))))
    long_tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(long_tmp))
    monkeypatch.setattr(tempfile, "tempdir", str(long_tmp))
    with pytest.raises(SandboxUnavailableError) as caught:
        await LocalKernelSandbox.create(LocalKernelConfig())
    message = str(caught.value)
    assert f"TMPDIR={long_tmp}" in message
    assert "107-byte limit" in message
    assert caught.value.operation == "create"
    # Refused before anything started: no kernel, no runtime or work folder.
    assert kernel_processes() == []
    assert [p.name for p in long_tmp.iterdir()] == [f"prefect-sandbox-{os.getuid()}"]
    assert list((long_tmp / f"prefect-sandbox-{os.getuid()}").iterdir()) == []


async def test_many_simultaneous_timeouts_under_load_are_each_reported_as_timeouts() -> None:
    # Issue 20: under load a few of 60 timeouts at once came back as "kernel sent no
    # execute_reply within 5.0 s". Here 12 kernels spin their cores at once (load well above
    # the machine's cores) and all pass their deadline together.
    count = 12
    made = await asyncio.gather(
        *(LocalKernelSandbox.create(LocalKernelConfig()) for _ in range(count)),
        return_exceptions=True,
    )
    boxes = [box for box in made if isinstance(box, LocalKernelSandbox)]
    try:
        assert len(boxes) == count, made
        await asyncio.gather(*(box.run_cell("x = 41") for box in boxes))
        results = await asyncio.gather(
            *(box.run_cell("while True: pass", timeout_s=1.0) for box in boxes),
            return_exceptions=True,
        )
        assert [type(r).__name__ for r in results if isinstance(r, BaseException)] == []
        after = await asyncio.gather(*(box.run_cell("print(x + 1)") for box in boxes))
        for result, later in zip(results, after, strict=True):
            assert not isinstance(result, BaseException)
            assert result.status == "timeout"
            assert result.error is not None and result.error.ename == "CellTimeoutError"
            # Stopped by the interrupt, x survives; a kernel restarted for it says so.
            assert stream_text(later.outputs) == ("" if result.state_lost else "42\n")
    finally:
        await asyncio.gather(*(box.kill() for box in boxes))


@pytest.fixture
def slow_bwrap() -> Iterator[Path]:
    """A bwrap that answers only after `SLOW_BWRAP_S` (a loaded machine, a cold disk), in a
    folder the kernel's user (nobody, when the tests run as root) may read."""
    folder = Path(tempfile.mkdtemp(prefix="prefect-sandbox-test-"))
    folder.chmod(0o755)
    bwrap = folder / "bwrap"
    bwrap.write_text(f'#!/bin/sh\nsleep {SLOW_BWRAP_S}\nexec {shutil.which("bwrap")} "$@"\n')
    bwrap.chmod(0o755)
    yield bwrap
    shutil.rmtree(folder)


SLOW_BWRAP_S = 2.0


async def test_other_kernels_output_keeps_flowing_while_a_kernel_launches(
    slow_bwrap: Path,
) -> None:
    # A sweep's subflow branches share one event loop: one branch starting its kernel must not
    # stall the others' output. Here bwrap's checks and the launch wait on a slow bwrap, and
    # must wait off the event loop.
    printers = [
        await LocalKernelSandbox.create(LocalKernelConfig(isolation="none")) for _ in range(2)
    ]
    arrivals: list[list[float]] = [[] for _ in printers]
    printing = [asyncio.Event() for _ in printers]

    def arrived(index: int) -> Callable[[dict[str, Any]], None]:
        def record(output: dict[str, Any]) -> None:
            arrivals[index].append(time.monotonic())
            printing[index].set()

        return record

    loop = "import os, time\nwhile not os.path.exists('stop'):\n    print('.'); time.sleep(0.02)"
    cells = [
        asyncio.create_task(box.run_cell(loop, timeout_s=300, on_output=arrived(index)))
        for index, box in enumerate(printers)
    ]
    launched = None
    try:
        await asyncio.wait_for(asyncio.gather(*(event.wait() for event in printing)), 60)
        started = time.monotonic()
        launched = await LocalKernelSandbox.create(LocalKernelConfig(bwrap_path=str(slow_bwrap)))
        ended = time.monotonic()
    finally:
        for box in printers:
            (Path(box.handle.workdir) / "stop").touch()
        results = await asyncio.gather(*cells)
        for box in [*printers, *([launched] if launched else [])]:
            await box.kill()
    assert all(result.status == "ok" for result in results)
    launch_s = ended - started
    # Two checks and the launch each wait on bwrap; the loop was free all along.
    assert launch_s >= 3 * SLOW_BWRAP_S
    for stamps in arrivals:
        during = [started, *(t for t in stamps if started < t < ended), ended]
        longest_gap = max(later - earlier for earlier, later in itertools.pairwise(during))
        assert longest_gap < launch_s / 3, (longest_gap, launch_s)


def test_a_kill_goes_on_past_a_kernel_slow_to_exit_and_the_next_launch_reaps_it(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from prefect_sandbox.sandbox.backends.kernel import local

    monkeypatch.setattr(local, "_REAP_WAIT_S", 0.2)
    # In this process's own group, so the kill's SIGKILL to the kernel's group misses it: it
    # stands for a killed kernel that a loaded host has not run to its exit yet.
    slow = subprocess.Popen(["sleep", "60"])
    monkeypatch.setitem(local._launched, "local-slow", slow)
    monkeypatch.setattr(local, "_slow_to_exit", [])
    try:
        local._kill_process_group("local-slow", slow.pid)  # raised TimeoutExpired before
        assert "local-slow" not in local._launched and slow in local._slow_to_exit
        assert f"kernel of sandbox local-slow (pid {slow.pid}) had not exited" in caplog.text
        slow.kill()
        deadline = time.monotonic() + 10
        while slow in local._slow_to_exit and time.monotonic() < deadline:
            local._forget_killed_elsewhere()
            time.sleep(0.05)
        assert slow not in local._slow_to_exit and slow.returncode == -signal.SIGKILL
    finally:
        slow.kill()
        slow.wait()
