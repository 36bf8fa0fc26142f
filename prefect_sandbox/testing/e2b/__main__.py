"""``python -m prefect_sandbox.testing.e2b [--port PORT]``: the E2B emulator, in the foreground.

Prints ``E2B_API_KEY=...``, ``E2B_API_URL=...`` and ``E2B_SANDBOX_URL=...``, one per line, then
serves until Ctrl-C or SIGTERM, which kill every emulated sandbox.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from prefect_sandbox.testing.e2b.server import E2BEmulator


def main() -> None:
    """Parse the arguments and serve until interrupted."""
    parser = argparse.ArgumentParser(prog="python -m prefect_sandbox.testing.e2b")
    parser.add_argument("--port", type=int, default=0, help="port on 127.0.0.1; 0 for a free one")
    parser.add_argument("--api-key", default=None, help="the key to accept; random by default")
    args = parser.parse_args()
    os.environ.setdefault("JUPYTER_PLATFORM_DIRS", "1")
    emulator = E2BEmulator(api_key=args.api_key, port=args.port, log_level="info")

    # uvicorn re-raises SIGTERM after its shutdown, under the handler found before it started:
    # exit through Python then, so the sandboxes' files are removed on the way out.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))

    def announce() -> None:
        for name, value in emulator.settings.items():
            print(f"{name}={value}", flush=True)

    emulator.serve_forever(on_ready=announce)


if __name__ == "__main__":
    main()
