"""LocalKernelSandbox on real ipykernels: state, outputs, errors, timeouts, files, env, attach."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import os
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from prefect_sandbox.sandbox.errors import (
    FileTransferError,
    SandboxDiedError,
    SandboxNotFoundError,
    UnsafePathError,
)
from prefect_sandbox.sandbox.local import (
    HOST_ENV_ALLOW_LIST,
    LocalKernelConfig,
    LocalKernelSandbox,
)
from tests.conftest import kernel_processes, stream_text


async def test_state_persists_across_cells(shared_sandbox: LocalKernelSandbox) -> None:
    await shared_sandbox.run_cell("import math\nradius = 2")
    result = await shared_sandbox.run_cell("print(round(math.pi * radius**2, 3))")
    assert result.status == "ok"
    assert stream_text(result.outputs) == "12.566\n"


async def test_outputs_of_each_type_arrive_in_order(shared_sandbox: LocalKernelSandbox) -> None:
    seen: list[str] = []
    code = textwrap.dedent(
        """
        import sys
        from IPython.display import display, HTML
        print("out 1")
        print("out 2")
        sys.stdout.flush()
        print("err", file=sys.stderr)
        sys.stderr.flush()
        display(HTML("<b>bold</b>"))
        {"answer": 42}
        """
    )
    result = await shared_sandbox.run_cell(code, on_output=lambda o: seen.append(o["output_type"]))
    kinds = [o["output_type"] for o in result.outputs]
    assert kinds == ["stream", "stream", "display_data", "execute_result"]
    assert result.outputs[0] == {
        "output_type": "stream",
        "name": "stdout",
        "text": "out 1\nout 2\n",
    }
    assert result.outputs[1]["name"] == "stderr"
    assert result.outputs[2]["data"]["text/html"] == "<b>bold</b>"
    assert result.outputs[3]["data"]["text/plain"] == "{'answer': 42}"
    assert result.outputs[3]["execution_count"] == result.execution_count
    assert seen[-2:] == ["display_data", "execute_result"]
    assert seen.count("stream") >= 2

    error = await shared_sandbox.run_cell("raise ValueError('bad value')")
    assert error.status == "error"
    assert error.error is not None
    assert (error.error.ename, error.error.evalue) == ("ValueError", "bad value")
    assert error.outputs[-1]["output_type"] == "error"
    assert error.outputs[-1]["traceback"]


async def test_h20_compile_errors_and_reply_only_errors(sandbox: LocalKernelSandbox) -> None:
    assert (await sandbox.run_cell("x = 1")).status == "ok"
    syntax = await sandbox.run_cell("def f(:\n    pass")
    assert syntax.error is not None and syntax.error.ename == "SyntaxError"
    assert "line 1" in syntax.error.evalue
    # H20's c3 ("    y = 2") runs in IPython, whose leading_indent transformer dedents a cell
    # before compiling; a body that really is mis-indented is an IndentationError.
    dedented = await sandbox.run_cell("    y = 2")
    assert dedented.status == "ok"
    indent = await sandbox.run_cell("if x:\ny = 3")
    assert indent.error is not None and indent.error.ename == "IndentationError"
    # %not_a_magic: ipykernel reports UsageError in execute_reply, with no iopub error message.
    magic = await sandbox.run_cell("%not_a_magic")
    assert magic.status == "error"
    assert magic.error is not None and magic.error.ename == "UsageError"
    assert [o["ename"] for o in magic.outputs if o["output_type"] == "error"] == ["UsageError"]
    after = await sandbox.run_cell("print(x)")
    assert stream_text(after.outputs) == "1\n"


async def test_h01_timeout_interrupts_and_state_survives(sandbox: LocalKernelSandbox) -> None:
    await sandbox.run_cell("x = 41")
    start = time.monotonic()
    result = await sandbox.run_cell("while True: pass", timeout_s=1.0)
    elapsed = time.monotonic() - start
    assert result.status == "timeout"
    assert result.interrupted and not result.state_lost
    assert 1.0 <= elapsed < 1.0 + 3.0
    assert result.error is not None and result.error.ename == "CellTimeoutError"
    assert any(o.get("ename") == "KeyboardInterrupt" for o in result.outputs)
    start = time.monotonic()
    after = await sandbox.run_cell("print(x + 1)")
    assert time.monotonic() - start < 2.0
    assert stream_text(after.outputs) == "42\n"
    kernel = psutil.Process(
        int((Path(sandbox.handle.connection["runtime_dir"]) / "kernel.pid").read_text())
    )
    assert kernel.cpu_percent(interval=0.5) < 5.0


async def test_timeout_that_ignores_sigint_restarts_the_kernel(sandbox: LocalKernelSandbox) -> None:
    code = (
        "import signal, time\n"
        "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        "while True: time.sleep(0.01)"
    )
    await sandbox.run_cell("x = 1")
    start = time.monotonic()
    result = await sandbox.run_cell(code, timeout_s=0.5)
    assert result.status == "timeout"
    assert result.state_lost and not result.interrupted
    assert time.monotonic() - start < 0.5 + 3.0 + 10.0
    after = await sandbox.run_cell("'x' in globals()")
    assert after.outputs[0]["data"]["text/plain"] == "False"


async def test_invalid_timeout_is_a_value_error(shared_sandbox: LocalKernelSandbox) -> None:
    with pytest.raises(ValueError, match="timeout_s"):
        await shared_sandbox.run_cell("1", timeout_s=0)


async def test_h08_stdin_is_refused_at_once(shared_sandbox: LocalKernelSandbox) -> None:
    for code in ["name = input('Name: ')", "import getpass; pw = getpass.getpass()"]:
        start = time.monotonic()
        result = await shared_sandbox.run_cell(code, timeout_s=5)
        assert time.monotonic() - start < 2.0
        assert result.error is not None and result.error.ename == "StdinNotImplementedError"
    start = time.monotonic()
    cat = await shared_sandbox.run_cell(
        "import subprocess; print(subprocess.run(['cat'], capture_output=True).returncode)",
        timeout_s=5,
    )
    assert time.monotonic() - start < 2.0
    assert stream_text(cat.outputs) == "0\n"
    assert stream_text((await shared_sandbox.run_cell("print('ok')")).outputs) == "ok\n"


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


async def test_h10_figure_without_show_is_one_png(sandbox: LocalKernelSandbox) -> None:
    first = await sandbox.run_cell(
        "import matplotlib.pyplot as plt; fig, ax = plt.subplots(); "
        "ax.plot([1, 2, 3], [3, 1, 2]); ax.set_title('no-show')"
    )
    images = [o for o in first.outputs if "image/png" in o.get("data", {})]
    assert len(images) == 1
    width, height = _png_size(base64.b64decode(images[0]["data"]["image/png"]))
    assert width > 0 and height > 0
    second = await sandbox.run_cell("print('x')")
    assert not [o for o in second.outputs if "image/png" in o.get("data", {})]


async def test_h10_savefig_with_agg_is_a_file_not_an_image(
    sandbox: LocalKernelSandbox, tmp_path: Path
) -> None:
    result = await sandbox.run_cell(
        "import matplotlib; matplotlib.use('Agg'); import matplotlib.pyplot as plt; "
        "plt.plot([1, 2]); plt.savefig('saved.png')"
    )
    assert result.status == "ok"
    assert not [o for o in result.outputs if "image/png" in o.get("data", {})]
    size = await sandbox.download("saved.png", tmp_path / "saved.png")
    inside = Path(sandbox.handle.workdir) / "saved.png"
    assert size == inside.stat().st_size
    assert (tmp_path / "saved.png").read_bytes() == inside.read_bytes()


async def test_h12_dataframe_display_then_result(shared_sandbox: LocalKernelSandbox) -> None:
    result = await shared_sandbox.run_cell(
        "import pandas as pd\n"
        "df = pd.DataFrame({'k': ['a', 'b', 'a'], 'v': [1, 2, 3]}).groupby('k').sum()\n"
        "display(df)\n"
        "df"
    )
    assert [o["output_type"] for o in result.outputs] == ["display_data", "execute_result"]
    assert result.outputs[1]["execution_count"] == result.execution_count is not None
    for output in result.outputs:
        assert "<table" in output["data"]["text/html"]
        assert "&lt;table" not in output["data"]["text/html"]
        lines = output["data"]["text/plain"].splitlines()
        assert [line.split() for line in lines[-2:]] == [["a", "4"], ["b", "2"]]


async def test_files_round_trip_and_escapes_are_refused(
    sandbox: LocalKernelSandbox, tmp_path: Path
) -> None:
    names = ["my data (v2).csv", "données_年.csv"]
    for name in names:
        (tmp_path / name).write_bytes(name.encode() * 100)
        await sandbox.upload(tmp_path / name, f"inputs/{name}")
    listing = await sandbox.run_cell("import os; print(sorted(os.listdir('inputs')))")
    assert stream_text(listing.outputs) == f"{sorted(names)}\n"
    files = await sandbox.list_files("inputs/*.csv")
    assert [f.path for f in files] == sorted(f"inputs/{n}" for n in names)
    for name in names:
        back = tmp_path / "back" / name
        await sandbox.download(f"inputs/{name}", back)
        assert (
            hashlib.sha256(back.read_bytes()).digest()
            == hashlib.sha256((tmp_path / name).read_bytes()).digest()
        )

    await sandbox.run_cell("import os; os.symlink('/etc/passwd', 'link.txt')")
    for bad in ["../escape.txt", "/etc/passwd", "a/../../x"]:
        with pytest.raises(UnsafePathError):
            await sandbox.upload(tmp_path / names[0], bad)
        with pytest.raises(UnsafePathError):
            await sandbox.download(bad, tmp_path / "never")
    with pytest.raises(UnsafePathError, match=r"link\.txt"):
        await sandbox.download("link.txt", tmp_path / "never")
    with pytest.raises(UnsafePathError):
        await sandbox.list_files("../*")
    assert not (tmp_path / "never").exists()
    with pytest.raises(FileTransferError, match=r"missing\.txt"):
        await sandbox.download("missing.txt", tmp_path / "never")


async def test_kernel_env_holds_only_what_it_was_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "host-secret-value")
    monkeypatch.setenv("E2B_API_KEY", "e2b-host-key")
    box = await LocalKernelSandbox.create(LocalKernelConfig(env={"MODEL_SEED": "7"}))
    try:
        result = await box.run_cell("import os, json; print(json.dumps(dict(os.environ)))")
    finally:
        await box.kill()
    import json

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
    assert set(env) <= set(HOST_ENV_ALLOW_LIST) | {"MODEL_SEED"} | added_by_jupyter


async def test_attach_from_another_thread_and_process(sandbox: LocalKernelSandbox) -> None:
    await sandbox.run_cell("shared = ['main']")

    def in_thread() -> str:
        async def go() -> str:
            other = await LocalKernelSandbox.attach(sandbox.handle, LocalKernelConfig())
            try:
                result = await other.run_cell("shared.append('thread'); print(shared)")
            finally:
                await other.close()
            return stream_text(result.outputs)

        return asyncio.run(go())

    assert await asyncio.to_thread(in_thread) == "['main', 'thread']\n"

    script = textwrap.dedent(
        """
        import asyncio, sys
        from prefect_sandbox.sandbox.base import SandboxHandle
        from prefect_sandbox.sandbox.local import LocalKernelConfig, LocalKernelSandbox

        async def main():
            handle = SandboxHandle.model_validate_json(sys.stdin.read())
            box = await LocalKernelSandbox.attach(handle, LocalKernelConfig())
            result = await box.run_cell("shared.append('process'); print(shared)")
            await box.close()
            print(result.outputs[0]["text"], end="")

        asyncio.run(main())
        """
    )
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-c", script],
        input=sandbox.handle.model_dump_json(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "['main', 'thread', 'process']\n"
    after = await sandbox.run_cell("print(len(shared))")
    assert stream_text(after.outputs) == "3\n"


async def test_kill_is_idempotent_and_leaves_no_kernel() -> None:
    before = {p.pid for p in kernel_processes()}
    box = await LocalKernelSandbox.create(LocalKernelConfig())
    await box.run_cell("import subprocess; child = subprocess.Popen(['sleep', '300'])")
    pid_file = Path(box.handle.connection["runtime_dir"]) / "kernel.pid"
    kernel = psutil.Process(int(pid_file.read_text()))
    sleeper = next(c for c in kernel.children() if c.name() == "sleep")
    workdir = Path(box.handle.workdir)
    assert await box.kill() is True
    assert await box.kill() is False
    assert {p.pid for p in kernel_processes()} == before
    assert not psutil.pid_exists(kernel.pid)
    sleeper_gone = not psutil.pid_exists(sleeper.pid) or sleeper.status() == psutil.STATUS_ZOMBIE
    assert sleeper_gone
    assert not workdir.exists()
    with pytest.raises(SandboxNotFoundError, match=box.handle.sandbox_id):
        await LocalKernelSandbox.attach(box.handle, LocalKernelConfig())
    assert box.handle.sandbox_id not in {h.sandbox_id for h in LocalKernelSandbox.list_handles()}


async def test_dead_kernel_is_reported_not_waited_out(sandbox: LocalKernelSandbox) -> None:
    start = time.monotonic()
    with pytest.raises(SandboxDiedError) as info:
        await sandbox.run_cell("import os; os._exit(3)", timeout_s=60)
    assert time.monotonic() - start < 10
    assert info.value.exit_code == 3
    assert info.value.state_lost
    with pytest.raises(SandboxDiedError):
        await sandbox.run_cell("print('after')")


async def test_list_handles_finds_sandboxes_by_label() -> None:
    box = await LocalKernelSandbox.create(LocalKernelConfig(), {"prefect-flow-run-id": "run-1"})
    try:
        found = LocalKernelSandbox.list_handles({"prefect-flow-run-id": "run-1"})
        assert [h.sandbox_id for h in found] == [box.handle.sandbox_id]
        assert LocalKernelSandbox.list_handles({"prefect-flow-run-id": "other"}) == []
    finally:
        await box.kill()


async def test_workdir_root_and_unknown_kernel(tmp_path: Path) -> None:
    box = await LocalKernelSandbox.create(LocalKernelConfig(workdir_root=tmp_path / "home"))
    try:
        result = await box.run_cell("import os; print(os.getcwd())")
        assert Path(stream_text(result.outputs).strip()).parent == tmp_path / "home"
    finally:
        await box.kill()
    from prefect_sandbox.sandbox.errors import SandboxError

    with pytest.raises(SandboxError, match="no-such-kernel"):
        await LocalKernelSandbox.create(LocalKernelConfig(kernel_name="no-such-kernel"))
    assert os.listdir(tmp_path / "home") == []
