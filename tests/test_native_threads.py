"""The exit wait that keeps the E2B SDK's native threads from aborting a finished process."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import textwrap
import threading

from prefect_sandbox.sandbox.backends.native_threads import wait_for_quiet_threads


def _hash_outside_the_gil(iterations: int, done: threading.Event) -> threading.Thread:
    """A thread that runs one C call without the GIL (PBKDF2 releases it), then sets ``done``."""

    def work() -> None:
        hashlib.pbkdf2_hmac("sha256", b"key", b"salt", iterations)
        done.set()

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    return thread


def test_the_wait_lasts_until_a_thread_outside_the_gil_has_finished() -> None:
    done = threading.Event()
    thread = _hash_outside_the_gil(1_000_000, done)
    wait_for_quiet_threads(limit_s=120)
    assert done.is_set()
    thread.join()


def test_the_wait_gives_up_after_its_limit() -> None:
    done = threading.Event()
    thread = _hash_outside_the_gil(4_000_000, done)
    waited = wait_for_quiet_threads(limit_s=0.05)
    assert not done.is_set()
    assert 0.05 <= waited < 1.0
    thread.join()


def test_using_e2b_makes_the_exit_wait_for_a_busy_thread() -> None:
    # A daemon thread still running at exit is stopped by finalization, its last line unprinted,
    # unless the exit waits: the E2B SDK's import registers that wait.
    script = textwrap.dedent(
        """
        import hashlib, threading
        from prefect_sandbox.sandbox.backends.e2b import import_sdk

        import_sdk()

        def work():
            hashlib.pbkdf2_hmac("sha256", b"key", b"salt", 200_000)
            print("finished", flush=True)

        threading.Thread(target=work, daemon=True).start()
        print("exiting", flush=True)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True
    )
    assert done.stdout == "exiting\nfinished\n"
