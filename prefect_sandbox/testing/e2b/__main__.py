"""``python -m prefect_sandbox.testing.e2b [--port PORT] [--reply-after-idle]
[--shared-ipython-dir] [--kernel-pythonpath DIR]``: the E2B emulator, in the foreground (the
options are `E2BEmulator`'s).

Prints ``E2B_API_KEY=...``, ``E2B_API_URL=...`` and ``E2B_SANDBOX_URL=...``, one per line, then
serves until Ctrl-C or SIGTERM, which kill every emulated sandbox. Manual: docs/backends/e2b.md.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from prefect_sandbox.testing.e2b.emulator import E2BEmulator
from prefect_sandbox.testing.server import serve_until_stopped


def main(argv: Sequence[str] | None = None) -> int:
    """Run the emulator until interrupted.

    Returns:
        The exit status, 0.
    """
    parser = argparse.ArgumentParser(prog="python -m prefect_sandbox.testing.e2b")
    parser.add_argument("--port", type=int, default=0, help="port on 127.0.0.1; 0 for a free one")
    parser.add_argument("--api-key", default=None, help="the key to accept; random by default")
    parser.add_argument(
        "--reply-after-idle",
        action="store_true",
        help="read every execute_reply after its idle, dropping a reply-only error",
    )
    parser.add_argument(
        "--shared-ipython-dir",
        action="store_true",
        help="one IPython folder for every sandbox's kernels, as the server on one machine",
    )
    parser.add_argument(
        "--kernel-pythonpath",
        type=Path,
        default=None,
        help="a folder first on the kernels' PYTHONPATH (one holding ipykernel 6.31)",
    )
    args = parser.parse_args(argv)
    os.environ.setdefault("JUPYTER_PLATFORM_DIRS", "1")
    emulator = E2BEmulator(
        api_key=args.api_key,
        port=args.port,
        reply_after_idle=args.reply_after_idle,
        shared_ipython_dir=args.shared_ipython_dir,
        kernel_pythonpath=args.kernel_pythonpath,
        log_level="info",
    )
    serve_until_stopped(emulator)
    return 0


if __name__ == "__main__":
    sys.exit(main())
