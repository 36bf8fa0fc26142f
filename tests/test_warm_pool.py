"""The local backend's warm pool and its kernel started ahead: ready kernels handed out once
each, as fresh as cold ones.

How fast a pooled create is, is measured by bench/bench_warm_pool.py, not asserted here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from jupyter_client.asynchronous.client import AsyncKernelClient

from prefect_sandbox import LocalKernelBackend
from prefect_sandbox.flows import amodeling_pipeline
from prefect_sandbox.sandbox.backends.kernel import warm_pool as warm_pool_module
from prefect_sandbox.sandbox.backends.kernel.local import (
    LocalKernelConfig,
    _pool_key,
    kill_orphaned_pool_kernels,
)
from prefect_sandbox.sandbox.backends.kernel.warm_pool import WarmPool, close_warm_pools, warm_pool
from prefect_sandbox.sandbox.base import SandboxHandle
from prefect_sandbox.sandbox.labels import (
    FLOW_RUN_ID_LABEL,
    MARKER_LABEL,
    POOL_OWNER_LABEL,
    flow_run_labels,
)
from tests.conftest import kernel_processes, stream_text

OWNER = {MARKER_LABEL: "true", POOL_OWNER_LABEL: str(os.getpid())}


@pytest.fixture(autouse=True)
def _no_pool_outlives_its_test() -> Iterator[None]:
    before = {p.pid for p in kernel_processes()}
    yield
    close_warm_pools()
    assert {p.pid for p in kernel_processes()} == before


def _kernel_pid(handle: SandboxHandle) -> int:
    return int((Path(handle.connection["runtime_dir"]) / "kernel.pid").read_text())


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


# --- the pool itself, with plain values for sandboxes ------------------------------------------


def _handle(number: int) -> SandboxHandle:
    return SandboxHandle(backend="test", sandbox_id=f"s{number}", workdir="/")


class _Sandboxes:
    """Started and ended "sandboxes", numbered; ``dead`` ones fail the pool's liveness check."""

    def __init__(self, fail_from: int | None = None) -> None:
        self.started: list[SandboxHandle] = []
        self.ended: list[SandboxHandle] = []
        self.dead: set[str] = set()
        self.fail_from = fail_from
        self.release = threading.Event()
        self.release.set()
        self.waiting = threading.Event()
        """Set once a start waits on ``release``."""

    def start(self) -> SandboxHandle:
        if not self.release.is_set():
            self.waiting.set()
        self.release.wait(10)
        if self.fail_from is not None and len(self.started) >= self.fail_from:
            raise RuntimeError("cannot start")
        self.started.append(_handle(len(self.started)))
        return self.started[-1]

    def pool(self, size: int) -> WarmPool:
        return WarmPool(
            size,
            start=self.start,
            destroy=self.ended.append,
            alive=lambda handle: handle.sandbox_id not in self.dead,
        )


def test_a_pool_hands_each_sandbox_out_once_and_refills_to_its_size() -> None:
    sandboxes = _Sandboxes()
    pool = sandboxes.pool(2)
    assert pool.take() is None  # nothing is started before the first refill
    pool.refill()
    assert pool.wait_full(10)
    taken = [pool.take(), pool.take()]
    assert [h.sandbox_id for h in taken if h] == ["s0", "s1"]
    assert pool.take() is None
    pool.refill()
    assert pool.wait_full(10)
    assert [h.sandbox_id for h in pool.idle] == ["s2", "s3"]
    assert sandboxes.ended == []


def test_a_pool_skips_and_ends_dead_sandboxes() -> None:
    sandboxes = _Sandboxes()
    pool = sandboxes.pool(2)
    pool.refill()
    assert pool.wait_full(10)
    sandboxes.dead.add("s0")
    taken = pool.take()
    assert taken is not None and taken.sandbox_id == "s1"
    assert [h.sandbox_id for h in sandboxes.ended] == ["s0"]


def test_closing_a_pool_ends_idle_sandboxes_and_the_one_being_started() -> None:
    sandboxes = _Sandboxes()
    pool = sandboxes.pool(2)
    pool.refill()
    assert pool.wait_full(10)
    sandboxes.release.clear()
    assert pool.take() is not None
    pool.refill()
    assert sandboxes.waiting.wait(10)  # the refill's thread waits inside start()
    threading.Timer(0.2, sandboxes.release.set).start()
    assert pool.close(timeout_s=10) == 1
    assert [h.sandbox_id for h in sandboxes.ended] == ["s1", "s2"]
    assert pool.idle == []
    pool.refill()
    assert pool.take() is None


def test_a_failed_start_stops_the_refill_until_the_next() -> None:
    sandboxes = _Sandboxes(fail_from=1)
    pool = sandboxes.pool(3)
    pool.refill()
    assert not pool.wait_full(10)
    assert [h.sandbox_id for h in pool.idle] == ["s0"]
    sandboxes.fail_from = None
    pool.refill()
    assert pool.wait_full(10)


def _exit_with_pool_count() -> None:
    os._exit(len(warm_pool_module._pools))


def test_a_forked_child_has_none_of_its_parents_pools() -> None:
    sandboxes = _Sandboxes()
    pool, made = warm_pool("forked", lambda: sandboxes.pool(1))
    pool.refill()
    assert made and pool.wait_full(10)
    child = multiprocessing.get_context("fork").Process(target=_exit_with_pool_count)
    child.start()
    child.join(10)
    assert child.exitcode == 0
    assert warm_pool("forked", lambda: sandboxes.pool(1)) == (pool, False)
    assert close_warm_pools() == 1
    assert sandboxes.ended == sandboxes.started


def test_every_setting_and_the_host_env_key_a_pool_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    base = LocalKernelConfig(warm_pool_size=1)
    changed = {
        "interrupt_grace_s": 1.0,
        "max_output_chars": 10,
        "startup_timeout_s": 5.0,
        "kernel_name": "other",
        "workdir_root": Path("/elsewhere"),
        "env": {"SEED": "1"},
        "memory_limit_bytes": 1 << 30,
        "cpu_time_limit_s": 5,
        "isolation": "none",
        "network": True,
        "bwrap_path": "/opt/bwrap",
        "warm_pool_size": 2,
        "uid_range": (0x7100_0000, 0x7100_FFFF),
        "max_processes": 64,
        "cpu_limit": 0.5,
    }
    assert set(changed) == {setting.name for setting in dataclasses.fields(base)}
    keys = {_pool_key(base)}
    for name, value in changed.items():
        keys.add(_pool_key(dataclasses.replace(base, **{name: value})))
    assert len(keys) == len(changed) + 1
    same_env = dataclasses.replace(base, env={"B": "2", "A": "1"})
    assert _pool_key(same_env) == _pool_key(dataclasses.replace(base, env={"A": "1", "B": "2"}))
    monkeypatch.setenv("TZ", "Pacific/Auckland")  # a host variable kernels inherit
    assert _pool_key(base) not in keys


# --- real kernels --------------------------------------------------------------------------------


async def test_pooled_kernels_are_handed_out_once_with_the_runs_labels() -> None:
    backend = LocalKernelBackend(warm_pool_size=2)
    first_run = flow_run_labels(str(uuid.uuid4()), "first")
    cold = await backend.create(first_run)  # the pool is empty: a cold start, then it fills
    await cold.kill()
    assert await backend.fill_warm_pool(timeout_s=60) == 2
    idle = await backend.list_sandboxes(OWNER)
    assert len(idle) == 2 and all(FLOW_RUN_ID_LABEL not in h.labels for h in idle)

    runs = [flow_run_labels(str(uuid.uuid4()), f"run-{i}") for i in range(2)]
    boxes = [await backend.create(labels) for labels in runs]
    try:
        assert {box.handle.sandbox_id for box in boxes} == {h.sandbox_id for h in idle}
        assert len({_kernel_pid(box.handle) for box in boxes}) == 2
        for box, labels in zip(boxes, runs, strict=True):
            assert box.handle.labels == labels
            found = await backend.list_sandboxes({FLOW_RUN_ID_LABEL: labels[FLOW_RUN_ID_LABEL]})
            assert [h.sandbox_id for h in found] == [box.handle.sandbox_id]
            assert found[0].labels == labels
            assert (await box.run_cell("1 + 1")).outputs[0]["data"] == {"text/plain": "2"}
        # Both were taken: what the pool holds now is new kernels, refilled after them.
        assert await backend.fill_warm_pool(timeout_s=60) == 2
        refilled = await backend.list_sandboxes(OWNER)
        assert {h.sandbox_id for h in refilled}.isdisjoint(h.sandbox_id for h in idle)
    finally:
        for box in boxes:
            await box.kill()


async def test_a_pooled_kernel_is_as_fresh_as_a_cold_one() -> None:
    backend = LocalKernelBackend(warm_pool_size=1)
    cold = await backend.create({"run": "cold"})
    try:
        await backend.fill_warm_pool(timeout_s=60)
        used = await backend.create({"run": "first"})
        try:
            await used.run_cell(
                "import os; secret = 41; os.environ['LEAK'] = '1'; open('left.txt', 'w').write('x')"
            )
        finally:
            await used.kill()
        await backend.fill_warm_pool(timeout_s=60)
        look = (
            "import os, json\n"
            "print(json.dumps([os.listdir('.'), 'secret' in dir(), os.environ.get('LEAK'), "
            "len(In)]))"
        )
        pooled = await backend.create({"run": "second"})
        try:
            assert pooled.handle.sandbox_id != used.handle.sandbox_id
            seen = await pooled.run_cell(look)
            expected = await cold.run_cell(look)
        finally:
            await pooled.kill()
    finally:
        await cold.kill()
    # Nothing ran in it before its first cell: the same count, names, env and files as cold.
    assert seen.execution_count == expected.execution_count == 1
    assert json.loads(stream_text(seen.outputs)) == json.loads(stream_text(expected.outputs))
    assert json.loads(stream_text(seen.outputs)) == [[], False, None, 2]


async def test_a_pool_only_hands_out_kernels_of_the_same_settings() -> None:
    one = LocalKernelBackend(warm_pool_size=1, isolation="none", env={"SEED": "1"})
    two = LocalKernelBackend(warm_pool_size=1, isolation="none", env={"SEED": "2"})
    await one.fill_warm_pool(timeout_s=60)
    (pooled_one,) = await one.list_sandboxes(OWNER)
    box = await two.create({"run": "two"})
    try:
        assert box.handle.sandbox_id != pooled_one.sandbox_id
        seed = await box.run_cell("import os; print(os.environ['SEED'])")
        assert stream_text(seed.outputs) == "2\n"
    finally:
        await box.kill()
    box = await one.create({"run": "one"})
    try:
        assert box.handle.sandbox_id == pooled_one.sandbox_id
        seed = await box.run_cell("import os; print(os.environ['SEED'])")
        assert stream_text(seed.outputs) == "1\n"
    finally:
        await box.kill()


async def test_a_dead_or_broken_pooled_kernel_is_ended_and_a_new_one_started() -> None:
    backend = LocalKernelBackend(warm_pool_size=2, isolation="none")
    await backend.fill_warm_pool(timeout_s=60)
    dead, broken = await backend.list_sandboxes(OWNER)
    os.killpg(_kernel_pid(dead), signal.SIGKILL)
    deadline = time.monotonic() + 60
    while not _gone(_kernel_pid(dead)) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    (Path(broken.connection["runtime_dir"]) / "connection.json").unlink()
    box = await backend.create({"run": "after"})
    try:
        assert box.handle.sandbox_id not in {dead.sandbox_id, broken.sandbox_id}
        assert (await box.run_cell("1 + 1")).outputs[0]["data"] == {"text/plain": "2"}
    finally:
        await box.kill()
    assert not any(Path(h.connection["runtime_dir"]).exists() for h in (dead, broken))


def _connected_kernel_clients() -> set[int]:
    """This process's kernel clients whose sockets are still open (by id)."""
    gc.collect()
    return {
        id(obj)
        for obj in gc.get_objects()
        if isinstance(obj, AsyncKernelClient) and obj.channels_running
    }


async def test_a_pooled_kernel_dying_as_it_is_handed_out_leaves_no_socket_open() -> None:
    backend = LocalKernelBackend(warm_pool_size=1, isolation="none")
    await backend.fill_warm_pool(timeout_s=60)
    (pooled,) = await backend.list_sandboxes(OWNER)
    pid = _kernel_pid(pooled)
    os.kill(pid, signal.SIGSTOP)  # it cannot answer: the hand-out waits in its handshake
    before = _connected_kernel_clients()
    creating = asyncio.create_task(backend.create({"run": "after"}))
    # Relabelled for the taker: the hand-out has begun; it dies before it can answer.
    deadline = time.monotonic() + 30
    while pooled.sandbox_id not in {
        h.sandbox_id for h in await backend.list_sandboxes({"run": "after"})
    }:
        assert time.monotonic() < deadline, "the pooled kernel was never handed out"
        await asyncio.sleep(0.02)
    os.killpg(pid, signal.SIGKILL)
    box = await creating
    try:
        assert box.handle.sandbox_id != pooled.sandbox_id
        assert (await box.run_cell("1 + 1")).outputs[0]["data"] == {"text/plain": "2"}
    finally:
        await box.kill()
    assert not Path(pooled.connection["runtime_dir"]).exists()
    close_warm_pools()  # its refill, which connects to the kernel it starts, is done
    # The failed hand-out closed the sockets it opened, as the cold start's kill did its own.
    assert _connected_kernel_clients() <= before


async def test_closing_the_pools_ends_their_idle_kernels() -> None:
    backend = LocalKernelBackend(warm_pool_size=2, isolation="none")
    await backend.fill_warm_pool(timeout_s=60)
    idle = await backend.list_sandboxes(OWNER)
    pids = [_kernel_pid(handle) for handle in idle]
    assert close_warm_pools() == 2
    assert await backend.list_sandboxes(OWNER) == []
    assert all(_gone(pid) for pid in pids)
    assert not any(Path(h.connection["runtime_dir"]).exists() for h in idle)
    assert not any(Path(h.workdir).exists() for h in idle)


_OWNER_SCRIPT = """
import asyncio, json, sys
from prefect_sandbox import LocalKernelBackend
from prefect_sandbox.sandbox.labels import POOL_OWNER_LABEL

async def main():
    backend = LocalKernelBackend(warm_pool_size=2, isolation=ISOLATION)
    await backend.fill_warm_pool(timeout_s=60)
    idle = await backend.list_sandboxes({POOL_OWNER_LABEL: str(__import__("os").getpid())})
    print(json.dumps([h.model_dump(mode="json") for h in idle]), flush=True)

asyncio.run(main())
if sys.argv[1] == "wait":
    sys.stdin.read()
"""


def _start_owner(isolation: str, mode: str) -> tuple[subprocess.Popen[str], list[SandboxHandle]]:
    script = textwrap.dedent(_OWNER_SCRIPT).replace("ISOLATION", repr(isolation))
    owner = subprocess.Popen(
        [sys.executable, "-c", script, mode],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert owner.stdout is not None
    line = owner.stdout.readline()
    idle = [SandboxHandle.model_validate(h) for h in json.loads(line)]
    assert len(idle) == 2
    assert {h.labels[POOL_OWNER_LABEL] for h in idle} == {str(owner.pid)}
    return owner, idle


def _stop_owner(owner: subprocess.Popen[str]) -> None:
    owner.kill()
    owner.wait()
    for stream in (owner.stdin, owner.stdout):
        if stream is not None:
            stream.close()


async def test_a_process_that_exits_ends_its_pools_idle_kernels() -> None:
    owner, idle = await asyncio.to_thread(_start_owner, "bubblewrap", "exit")
    try:
        pids = [_kernel_pid(handle) for handle in idle]
        assert owner.wait(timeout=60) == 0
    finally:
        _stop_owner(owner)
    assert all(_gone(pid) for pid in pids)
    assert not any(Path(h.connection["runtime_dir"]).exists() for h in idle)
    assert not any(Path(h.workdir).exists() for h in idle)


async def test_a_process_that_exits_mid_refill_leaves_no_kernel_behind() -> None:
    script = textwrap.dedent(
        """
        import asyncio, time
        from prefect_sandbox import LocalKernelBackend

        async def main():
            box = await LocalKernelBackend(warm_pool_size=2).create({"run": "only"})
            await box.kill()

        asyncio.run(main())
        time.sleep(0.2)  # the refill is starting a kernel as the process exits
        """
    )
    owner = await asyncio.create_subprocess_exec(sys.executable, "-c", script)
    assert await asyncio.wait_for(owner.wait(), 60) == 0
    assert await LocalKernelBackend().list_sandboxes({POOL_OWNER_LABEL: str(owner.pid)}) == []


@pytest.mark.parametrize("isolation", ["bubblewrap", "none"])
async def test_a_sigkilled_owners_idle_kernels_die_and_are_found_and_ended(
    isolation: str,
) -> None:
    owner, idle = await asyncio.to_thread(_start_owner, isolation, "wait")
    pids = [_kernel_pid(handle) for handle in idle]
    trees = [[psutil.Process(pid), *psutil.Process(pid).children(recursive=True)] for pid in pids]
    try:
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=10)
        deadline = time.monotonic() + 60
        processes = [process for tree in trees for process in tree]
        while time.monotonic() < deadline and not all(_gone(p.pid) for p in processes):
            await asyncio.sleep(0.1)
        assert all(_gone(p.pid) for p in processes), "a pooled kernel outlived its owner"
        # Its folders stay behind, labelled with the dead owner's pid, until they are ended.
        orphans = await LocalKernelBackend().list_sandboxes({POOL_OWNER_LABEL: str(owner.pid)})
        assert {h.sandbox_id for h in orphans} == {h.sandbox_id for h in idle}
        ended = kill_orphaned_pool_kernels()
        assert {h.sandbox_id for h in idle} <= {h.sandbox_id for h in ended}
        assert await LocalKernelBackend().list_sandboxes({POOL_OWNER_LABEL: str(owner.pid)}) == []
        assert not any(Path(h.workdir).exists() for h in idle)
    finally:
        _stop_owner(owner)


@pytest.mark.usefixtures("prefect_api")
async def test_a_flow_run_takes_a_pooled_kernel_and_kills_it_after(tmp_path: Path) -> None:
    backend = LocalKernelBackend(warm_pool_size=1)
    await backend.fill_warm_pool(timeout_s=60)
    (pooled,) = await backend.list_sandboxes(OWNER)
    pooled_pid = _kernel_pid(pooled)
    result = await amodeling_pipeline(
        stages={"main": ["import os; print(sorted(os.listdir('.')))"]},
        backend=backend,
        storage=str(tmp_path),
    )
    assert result.status == "completed"
    # The run's kernel was the pooled one: killed with the run, as a cold one is.
    assert not Path(pooled.connection["runtime_dir"]).exists()
    assert _gone(pooled_pid)
    await backend.fill_warm_pool(timeout_s=60)
    (refilled,) = await backend.list_sandboxes(OWNER)
    assert refilled.sandbox_id != pooled.sandbox_id


# --- a kernel started ahead (the command line's, while it imports Prefect) ---------------------


async def _idle_kernels(backend: LocalKernelBackend, count: int) -> list[SandboxHandle]:
    """This process's idle (pooled or started-ahead) kernels, once ``count`` are there."""
    deadline = time.monotonic() + 60
    while len(idle := await backend.list_sandboxes(OWNER)) < count:
        assert time.monotonic() < deadline, f"{len(idle)} of {count} kernels started"
        await asyncio.sleep(0.1)
    return idle


async def test_a_kernel_started_ahead_is_taken_once_by_a_create_of_its_settings() -> None:
    backend = LocalKernelBackend(isolation="none")
    backend.start_kernel_ahead()
    backend.start_kernel_ahead()  # the second does nothing
    (ahead,) = await _idle_kernels(backend, 1)
    other = await LocalKernelBackend(isolation="none", env={"SEED": "2"}).create({"run": "other"})
    try:
        assert other.handle.sandbox_id != ahead.sandbox_id
    finally:
        await other.kill()
    run = flow_run_labels(str(uuid.uuid4()), "first")
    box = await backend.create(run)
    try:
        assert box.handle.sandbox_id == ahead.sandbox_id
        assert box.handle.labels == run
        assert (await box.run_cell("1 + 1")).outputs[0]["data"] == {"text/plain": "2"}
        # Not refilled: the next create starts its own kernel, and none is left idle.
        again = await backend.create({"run": "second"})
        await again.kill()
        assert again.handle.sandbox_id != ahead.sandbox_id
        assert await backend.list_sandboxes(OWNER) == []
    finally:
        await box.kill()


async def test_a_kernel_started_ahead_and_never_taken_ends_with_its_process() -> None:
    script = textwrap.dedent(
        """
        import time
        from prefect_sandbox import LocalKernelBackend

        LocalKernelBackend().start_kernel_ahead()
        time.sleep(0.2)  # the kernel is starting as the process exits
        """
    )
    owner = await asyncio.create_subprocess_exec(sys.executable, "-c", script)
    assert await asyncio.wait_for(owner.wait(), 60) == 0
    assert await LocalKernelBackend().list_sandboxes({POOL_OWNER_LABEL: str(owner.pid)}) == []
