"""``python -m prefect_sandbox.testing.daytona``: run the Daytona emulator in the foreground.

Prints ``DAYTONA_API_KEY=...``, ``DAYTONA_API_URL=...`` and ``DAYTONA_TARGET=...``, one per
line, then serves until interrupted (Ctrl-C or SIGTERM), deleting its sandboxes on the way out.
Manual: docs/backends/daytona.md.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from prefect_sandbox.testing.daytona.emulator import DaytonaEmulator
from prefect_sandbox.testing.server import serve_until_stopped


def main(argv: Sequence[str] | None = None) -> int:
    """Run the emulator until interrupted.

    Returns:
        The exit status, 0.
    """
    parser = argparse.ArgumentParser(
        prog="python -m prefect_sandbox.testing.daytona", description=__doc__
    )
    parser.add_argument("--port", type=int, default=0, help="port on 127.0.0.1; 0 for a free one")
    parser.add_argument("--api-key", default=None, help="the API key to accept; random if unset")
    parser.add_argument("--target", default="us", help="the region to report")
    args = parser.parse_args(argv)
    serve_until_stopped(DaytonaEmulator(api_key=args.api_key, target=args.target, port=args.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
