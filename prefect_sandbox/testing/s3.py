"""A real S3 API for tests and benchmarks: moto's server in its own process, and a
fault-injecting proxy in front of it.

moto runs as a separate process (``python -m moto.server``; install ``moto[server]``) so that
the memory it holds for stored objects never counts against the caller's RSS. The proxy
forwards HTTP/1.1 requests to it and answers chosen ones with an error instead, to inject
failures mid-upload. Both listen on 127.0.0.1 only. Manual: docs/development.md.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import boto3

Rule = Callable[[str, str], bytes | None]
"""Given a request's method and target, the raw HTTP response to send instead, or None."""


__all__ = ["FaultProxy", "MotoServer", "Rule", "access_denied", "free_port"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class MotoServer:
    """moto's S3 server on 127.0.0.1 at a free port, in a child process."""

    def __init__(self) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    break
            except OSError:
                if time.monotonic() > deadline or self._process.poll() is not None:
                    self.stop()
                    raise RuntimeError("moto server did not start") from None
                time.sleep(0.1)

    def client(self, endpoint: str | None = None) -> Any:
        """A plain boto3 S3 client of this server (or of a proxy in front of it)."""
        return boto3.client(
            "s3",
            endpoint_url=endpoint or self.endpoint,
            aws_access_key_id="testing",
            aws_secret_access_key="testing-secret",
            region_name="us-east-1",
        )

    def stop(self) -> None:
        """Stop the server and wait for it."""
        self._process.terminate()
        self._process.wait(timeout=30)


def _read_request(conn: socket.socket, buffer: bytes) -> tuple[bytes, bytes] | None:
    """One whole request (head and body, by Content-Length) and what was read past it."""
    while b"\r\n\r\n" not in buffer:
        chunk = conn.recv(65536)
        if not chunk:
            return None
        buffer += chunk
    head, _, rest = buffer.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
        if name.strip().lower() == b"transfer-encoding":
            raise ValueError("chunked requests are not supported by the test proxy")
    while len(rest) < length:
        chunk = conn.recv(65536)
        if not chunk:
            return None
        rest += chunk
    return head + b"\r\n\r\n" + rest[:length], rest[length:]


class FaultProxy:
    """An HTTP proxy on 127.0.0.1 in front of ``upstream_port`` that applies ``rule``."""

    def __init__(self, upstream_port: int, rule: Rule) -> None:
        self._upstream = upstream_port
        self._rule = rule
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(16)
        self.endpoint = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._closing = False
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closing:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        upstream = socket.create_connection(("127.0.0.1", self._upstream))
        buffer = b""
        try:
            while True:
                request = _read_request(conn, buffer)
                if request is None:
                    return
                whole, buffer = request
                method, target = whole.split(b" ", 2)[:2]
                answer = self._rule(method.decode(), target.decode())
                if answer is not None:
                    conn.sendall(answer)
                    continue
                upstream.sendall(whole)
                conn.sendall(_read_response(upstream, has_body=method != b"HEAD"))
        except OSError:
            return
        finally:
            conn.close()
            upstream.close()

    def stop(self) -> None:
        """Stop accepting connections."""
        self._closing = True
        self._listener.close()
        self._thread.join(timeout=5)


def _read_response(upstream: socket.socket, has_body: bool) -> bytes:
    buffer = b""
    while True:
        while b"\r\n\r\n" not in buffer:
            chunk = upstream.recv(65536)
            if not chunk:
                raise OSError("upstream closed")
            buffer += chunk
        head, _, rest = buffer.partition(b"\r\n\r\n")
        # The client already sent its body: drop interim answers to "Expect: 100-continue".
        if not head.split(b" ", 2)[1].startswith(b"1"):
            break
        buffer = rest
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if has_body and name.strip().lower() == b"content-length":
            length = int(value.strip())
    while len(rest) < length:
        chunk = upstream.recv(65536)
        if not chunk:
            raise OSError("upstream closed")
        rest += chunk
    return head + b"\r\n\r\n" + rest[:length]


def access_denied() -> bytes:
    """A permanent S3 error (403 AccessDenied), which neither boto3 nor we retry."""
    body = (
        b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>AccessDenied</Code>"
        b"<Message>injected by the test proxy</Message></Error>"
    )
    return (
        b"HTTP/1.1 403 Forbidden\r\nContent-Type: application/xml\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
