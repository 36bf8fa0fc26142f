"""The emulated interpreter worker: a plain Python process, as Daytona's daemon runs one per
interpreter context (not a Jupyter kernel: no IPython, no magics, no ``!cmd``, no top-level
``await``, no ``display``).

Run as a script (``python worker.py``) in the context's working directory. It follows the
protocol of Daytona's ``repl_worker.py``, our own code written from what the daemon does: one
JSON command a line on stdin (``{"id", "code", "envs"?}``), run in turn in one namespace; one
JSON chunk a line on stdout (``stdout``/``stderr`` text at each newline or 1024 characters, an
``error`` with the code's own frames, a last ``control`` chunk); SIGINT interrupts the code,
SIGTERM ends the process; anything else written to fd 1 is dropped, as the daemon drops it. The
protocol in full: docs/development.md.
"""

from __future__ import annotations

import builtins
import contextlib
import io
import json
import os
import signal
import sys
import traceback
from types import FrameType, TracebackType
from typing import Any

_FLUSH_CHARS = 1024
_CODE_FILENAME = "<string>"


def _send(chunk: dict[str, Any]) -> None:
    # Looked up each time: code may rebind sys.__stdout__ as it likes, as it may on Daytona.
    stream = sys.__stdout__
    assert stream is not None
    stream.write(json.dumps(chunk) + "\n")
    stream.flush()


class _Chunks(io.TextIOBase):
    """A text stream that sends what is written as chunks of one kind."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.pending: list[str] = []
        self.size = 0

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return "utf-8"

    def write(self, text: str) -> int:
        if not text:
            return 0
        text = str(text)
        self.pending.append(text)
        self.size += len(text)
        if "\n" in text or self.size >= _FLUSH_CHARS:
            self.flush()
        return len(text)

    def flush(self) -> None:
        if self.pending:
            text, self.pending, self.size = "".join(self.pending), [], 0
            _send({"type": self.kind, "text": text})


def _traceback_text(error: BaseException, tb: TracebackType | None) -> str:
    frames = [frame for frame in traceback.extract_tb(tb) if frame.filename == _CODE_FILENAME]
    last = f"{type(error).__name__}: {error}\n"
    if not frames:
        return last
    lines = ["Traceback (most recent call last):\n"]
    for frame in frames:
        lines.append(f'  File "<stdin>", line {frame.lineno}\n')
        if frame.line:
            lines.append(f"    {frame.line}\n")
    return "".join(lines) + last


class _Worker:
    def __init__(self) -> None:
        self.namespace: dict[str, Any] = {
            "__name__": "__main__",
            "__doc__": None,
            "__package__": None,
            "__builtins__": builtins,
        }
        self.stopping = False
        signal.signal(signal.SIGINT, self._on_sigint)
        signal.signal(signal.SIGTERM, self._on_sigterm)

    @staticmethod
    def _on_sigint(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt("Execution interrupted")

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        self.stopping = True
        raise KeyboardInterrupt("Shutting down")

    def run_command(self, code: str, envs: dict[str, Any] | None) -> None:
        stdout, stderr = _Chunks("stdout"), _Chunks("stderr")
        control, error = "completed", None
        saved = {str(name): os.environ.get(str(name)) for name in envs or {}}
        for name, value in (envs or {}).items():
            if value is None:
                os.environ.pop(str(name), None)
            else:
                os.environ[str(name)] = str(value)
        try:
            with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
                exec(compile(code, _CODE_FILENAME, "exec"), self.namespace)
        except KeyboardInterrupt:
            control = "interrupted"
        except SystemExit:
            pass
        except Exception as exc:
            error = {
                "type": "error",
                "name": type(exc).__name__,
                "value": str(exc),
                "traceback": _traceback_text(exc, exc.__traceback__),
            }
        finally:
            stdout.flush()
            stderr.flush()
            for name, old in saved.items():
                if old is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = old
            if error is not None:
                _send(error)
            _send({"type": "control", "text": control})

    def serve(self) -> None:
        while not self.stopping:
            try:
                line = sys.stdin.readline()
                if not line:
                    return
                if not line.strip():
                    continue
                self._handle(line)
            except KeyboardInterrupt:
                continue
            except Exception as exc:
                print(f"worker loop failed: {exc}", file=sys.__stderr__)
                return

    def _handle(self, line: str) -> None:
        try:
            command = json.loads(line)
            envs = command.get("envs")
            if envs is not None and not isinstance(envs, dict):
                raise ValueError("envs must be an object")
            self.run_command(command.get("code", ""), envs)
        except Exception as exc:
            _send({"type": "error", "name": type(exc).__name__, "value": str(exc), "traceback": ""})


if __name__ == "__main__":
    _Worker().serve()
