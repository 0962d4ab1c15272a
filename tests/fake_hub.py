"""A loopback Hugging Face Hub (for HF_ENDPOINT) that misbehaves on request.

`mode` chooses how: "err500" answers every request with HTTP 500 and the request's
Authorization header in its words (a Hub that echoes the token); "hang" accepts the connection
and never answers; "many" lists `n_files` GGUF files (f000000-Q4.gguf, ...) and has none of
them. `requests` holds every request's path.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeHub(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, mode: str, n_files: int) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.mode = mode
        self.n_files = n_files
        self.requests: list[str] = []
        self.stop = threading.Event()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: FakeHub

    def log_message(self, format: str, *args: object) -> None:
        pass

    def _send(self, code: int, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if code == 404:
            self.send_header("X-Error-Code", "EntryNotFound")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_GET(self) -> None:
        self.server.requests.append(self.path)
        mode = self.server.mode
        if mode == "hang":
            self.server.stop.wait(120)
            return
        if mode == "err500":
            auth = self.headers.get("Authorization", "")
            self._send(500, json.dumps({"error": f"boom token={auth}"}).encode())
            return
        if "/tree/" in self.path:
            files = [f"f{i:06d}-Q4.gguf" for i in range(self.server.n_files)]
            listing = [{"type": "file", "path": f, "oid": "x", "size": 10} for f in files]
            self._send(200, json.dumps(listing).encode())
            return
        self._send(404, b'{"error": "not found"}')

    do_HEAD = do_GET


@contextmanager
def fake_hub(mode: str, n_files: int = 0) -> Iterator[FakeHub]:
    """A FakeHub serving on a free loopback port; its address is `url(server)`."""
    server = FakeHub(mode, n_files)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.stop.set()
        server.shutdown()
        server.server_close()


def url(server: FakeHub) -> str:
    host, port = server.server_address[:2]
    return f"http://{host!s}:{port}"
