"""A loopback OpenAI-compatible stub that misbehaves on request, for the fault tests.

The model named in a request chooses the behaviour: "stub" streams a reply with usage and
llama.cpp-style timings; "missing" answers 404, "boom" 500, "malformed" sends a broken line,
"slow" waits before answering, "cut" drops the connection mid-stream, "badnumbers" sends strings
and lists where usage and timings hold numbers, "listusage" sends lists for the objects,
"nousage" sends neither, "thinker" streams reasoning_content deltas before the answer (and
"thinktags" <think> tags inside the content); both end their answer with the
chat_template_kwargs they were sent. With an API key (or Basic credentials) set, every request without
it gets 401. Not a stand-in for llama.cpp: the real server is tested too.
"""

from __future__ import annotations

import base64
import json
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

WORDS = ["Hello", " from", " the", " stub", " server", "."]


class Handler(BaseHTTPRequestHandler):
    api_key: str | None = None
    basic: str | None = None  # "user:password"
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        pass

    def _json(self, status: int, data: Any) -> None:
        body = json.dumps(data).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _authorized(self) -> bool:
        if self.basic:
            expected = "Basic " + base64.b64encode(self.basic.encode()).decode()
            if self.headers.get("Authorization") != expected:
                self._json(401, {"error": {"message": "Basic auth required", "code": 401}})
                return False
        if self.api_key and self.headers.get("Authorization") != f"Bearer {self.api_key}":
            self._json(401, {"error": {"message": "Invalid API key", "code": 401}})
            return False
        return True

    def do_GET(self) -> None:
        if not self._authorized():
            return
        if self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": "stub", "object": "model"}]})
        else:
            self._json(404, {"error": {"message": f"no route {self.path}"}})

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length) or b"{}")
        if not self._authorized():
            return
        if not self.path.endswith(("/chat/completions", "/completions")):
            return self._json(404, {"error": {"message": f"no route {self.path}"}})
        model = body.get("model")
        if model == "missing":
            return self._json(404, {"error": {"message": "The model `missing` does not exist."}})
        if model == "boom":
            return self._json(500, {"error": {"message": "internal failure in the stub"}})
        if model == "slow":
            time.sleep(3)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        chat = self.path.endswith("/chat/completions")
        if model in ("thinker", "thinktags"):
            return self._think(model, body)
        for i, word in enumerate(WORDS):
            choice: dict[str, object] = {"index": 0, "finish_reason": None}
            choice.update({"delta": {"content": word}} if chat else {"text": word})
            self.wfile.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
            self.wfile.flush()
            time.sleep(0.01)
            if model == "malformed" and i == 1:
                self.wfile.write(b"data: {this is not json\n\n")
                self.wfile.flush()
                return
            if model == "cut" and i == 2:
                self.close_connection = True
                self.connection.shutdown(2)
                return
        final: dict[str, object] = {
            "choices": [{"index": 0, "finish_reason": "stop", "delta": {}, "text": ""}],
            "usage": {"prompt_tokens": 12, "completion_tokens": len(WORDS), "total_tokens": 18},
            "timings": {"prompt_n": 8, "prompt_ms": 4.0, "predicted_n": len(WORDS),
                        "predicted_ms": 50.0, "cache_n": 4},
        }  # fmt: skip
        if model == "badnumbers":
            final["usage"] = {
                "prompt_tokens": "twelve",
                "completion_tokens": [6],
                "total_tokens": None,
            }
            final["timings"] = {"prompt_n": "8", "prompt_ms": "fast", "predicted_ms": float("nan")}
        elif model == "listusage":
            final["usage"], final["timings"] = [1, 2], []
        elif model == "nousage":
            del final["usage"], final["timings"]
        self.wfile.write(f"data: {json.dumps(final)}\n\ndata: [DONE]\n\n".encode())
        self.wfile.flush()

    def _think(self, model: str, body: dict[str, Any]) -> None:
        kwargs = json.dumps(body.get("chat_template_kwargs"))
        thoughts = ["Let", " me", " think", "."]
        answer = ["It", " is", " 42", f" {kwargs}"]
        deltas: list[dict[str, Any]]
        if model == "thinker":
            deltas = [{"reasoning_content": w} for w in thoughts]
        else:
            deltas = [{"content": w} for w in ["<think>", *thoughts, "</think>"]]
        deltas += [{"content": w} for w in answer]
        for delta in deltas:
            choice = {"index": 0, "finish_reason": None, "delta": delta}
            self.wfile.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
            self.wfile.flush()
            time.sleep(0.01)
        final = {"choices": [{"index": 0, "finish_reason": "stop", "delta": {}}],
                 "usage": {"prompt_tokens": 5, "completion_tokens": len(deltas),
                           "completion_tokens_details": {"reasoning_tokens": len(thoughts)}}}  # fmt: skip
        self.wfile.write(f"data: {json.dumps(final)}\n\ndata: [DONE]\n\n".encode())
        self.wfile.flush()


class _Server(ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        """A client that hung up mid-reply is what the broken-stream tests do on purpose: not
        worth a traceback on the stderr that the test is reading."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)  # type: ignore[arg-type]


@contextmanager
def stub_server(api_key: str | None = None, basic: str | None = None) -> Iterator[str]:
    handler = type("KeyedHandler", (Handler,), {"api_key": api_key, "basic": basic})
    server = _Server(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
