"""Kernel start-up code: a cell's stdout and stderr reach us in ``stream`` messages of bounded size.

ipykernel sends buffered stdout/stderr every 0.2 s, so a fast cell's 100 MB of prints would reach
us as ONE 100 MB message, held whole in memory by jupyter_client. A write that fills the buffer
past the limit waits for it to be sent, which bounds each message. Part of a local kernel's
startup file; run by `run_code` (``main``, with ``{"limit": characters}``).
Manual: docs/development.md.
"""

from __future__ import annotations

import json
import sys
from typing import Any


def main(args_json: str) -> None:
    """Bound the kernel's ``OutStream`` s; a stream that is not ipykernel's is left alone."""
    limit: int = json.loads(args_json)["limit"]
    for stream in (sys.stdout, sys.stderr):
        if not hasattr(stream, "pub_thread"):
            continue  # not ipykernel's OutStream
        unsent = [0]

        def write(
            text: str, _write: Any = stream.write, _stream: Any = stream, _unsent: Any = unsent
        ) -> int:
            count: int = _write(text)
            _unsent[0] += len(text)
            if _unsent[0] >= limit:
                _unsent[0] = 0
                _stream.flush()
            return count

        stream.write = write  # type: ignore[method-assign]
