"""``python -m prefect_sandbox.testing.e2b [--port PORT]``: the E2B emulator, in the foreground.

Prints ``E2B_API_KEY=...``, ``E2B_API_URL=...`` and ``E2B_SANDBOX_URL=...``, one per line, then
serves until Ctrl-C or SIGTERM, which kill every emulated sandbox.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

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
    args = parser.parse_args(argv)
    os.environ.setdefault("JUPYTER_PLATFORM_DIRS", "1")
    serve_until_stopped(E2BEmulator(api_key=args.api_key, port=args.port, log_level="info"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
