"""The running `fedctl up`'s control socket: how `fedctl site add --emulate` asks it to start a
site, so the new site's processes are its children like the rest (Ctrl-C stops them all) and
the join credential never leaves the process that made it.

One JSON object per connection each way, over a Unix socket only its user can open.
"""

from __future__ import annotations

import json
import os
import socket
import socketserver
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from core.config import Config

REQUEST_TIMEOUT_S = 120.0  # a site's agent starts, probes its workers and joins within this
MAX_MESSAGE_BYTES = 64 * 1024

Handler = Callable[[dict[str, Any]], dict[str, Any]]


class NotRunning(OSError):
    """No `fedctl up` of this config answers on its control socket."""


def _runtime_dir() -> Path:
    return Path(os.environ.get("XDG_RUNTIME_DIR") or "/tmp")


def socket_path(config: Config) -> Path:
    """One per gateway port: two federations on one machine have two sockets."""
    return _runtime_dir() / f"inference-federation-{config.gateway.port}.sock"


def tls_dir(config: Config) -> Path:
    """Where the embedded federation of this config keeps the CA made for its run, and the
    operator's certificate `fedctl` commands on this machine use (its user's only)."""
    return _runtime_dir() / f"inference-federation-{config.gateway.port}.tls"


def join_token_path(config: Config) -> Path:
    """Where the embedded plaintext (--insecure) federation of this config keeps its join
    credential (mode 0600): its schedulers and agents read it, and so does `fedctl site add --agent`."""
    return _runtime_dir() / f"inference-federation-{config.gateway.port}.join-token"


class ControlServer:
    """Serves `handle(request) -> reply` on the socket from a thread; errors become replies."""

    def __init__(self, path: Path, handle: Handler) -> None:
        self.path = path
        path.unlink(missing_ok=True)  # left by a `fedctl up` that was killed

        class _Connection(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                try:
                    request = json.loads(self.rfile.readline(MAX_MESSAGE_BYTES))
                    reply = handle(request) if isinstance(request, dict) else {"error": "expected a JSON object"}
                except ValueError as exc:
                    reply = {"error": str(exc)}
                self.wfile.write(json.dumps(reply).encode() + b"\n")

        old_umask = os.umask(0o177)  # the socket is its user's only
        try:
            self._server = socketserver.ThreadingUnixStreamServer(str(path), _Connection)
        finally:
            os.umask(old_umask)
        self._thread = threading.Thread(target=self._server.serve_forever, name="fedctl control", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        if self._thread.is_alive():  # shutdown() waits for a serve_forever() that never ran otherwise
            self._server.shutdown()
        self._server.server_close()
        self.path.unlink(missing_ok=True)


def request(path: Path, message: dict[str, Any]) -> dict[str, Any]:
    """Ask the running `fedctl up`; its reply (a dict with "error" when it refused)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(REQUEST_TIMEOUT_S)
        try:
            sock.connect(str(path))
        except (FileNotFoundError, ConnectionRefusedError):
            raise NotRunning(f"no `fedctl up` answers at {path}") from None
        sock.sendall(json.dumps(message).encode() + b"\n")
        reply = sock.makefile("rb").readline(MAX_MESSAGE_BYTES)
    return json.loads(reply) if reply else {"error": "fedctl up closed the connection without an answer"}
