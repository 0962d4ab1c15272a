"""A loopback OpenAI-compatible stub that misbehaves on request, for the fault tests.

The model named in a request chooses the behaviour: "stub" streams a reply with usage and
llama.cpp-style timings; "missing" answers 404, "boom" 500, "malformed" sends a broken line,
"slow" waits before answering, "cut" drops the connection mid-stream, "badnumbers" sends strings
and lists where usage and timings hold numbers, "listusage" sends lists for the objects,
"nousage" sends neither, "thinker" streams reasoning_content deltas before the answer (and
"thinktags" <think> tags inside the content); both end their answer with the
chat_template_kwargs they were sent. With an API key (or Basic credentials) set, every request without
it gets 401. Not a stand-in for llama.cpp: the real server is tested too.

Hostile servers (issue 22): "escapes" streams clear-screen, window-title and colour sequences
in the content and the reasoning; "keepalive" sends only SSE comments, forever; "liar" reports
10^24 tok/s, a prefill longer than the request and 500 thinking tokens of 2; "echo" sends the
request's Authorization header back in its reply, and "echo401" in a 401's message; "whatwg"
writes the stream as the WHATWG standard allows but few servers do (CR and CRLF line ends, a
BOM, `event:`/`id:`/`retry:` fields, one JSON split over two `data:` lines, no space after the
colon, no blank line at the end). "whole" answers with one JSON object, not a stream; "moved"
redirects elsewhere; "endless" ignores max_tokens and never stops; "html" answers with a web
page; each name in MALFORMED sends one event of the wrong shape first. `models_answer` replaces the /v1/models answer.
`get_answers` maps a GET route (/props) to its raw body, or to ENDLESS: a JSON body that never
ends, sent in chunks until the client hangs up (TRICKLE: the same, a byte at a time, slowly);
`post_answers` maps a POST route (/tokenize) to its raw body. `figures` replaces the usage and
timings of the usual stream's last event (its keys: "usage", "timings"; a RawJSON in them is
written as its text).
"""

from __future__ import annotations

import base64
import json
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from typer.testing import CliRunner, Result

WORDS = ["Hello", " from", " the", " stub", " server", "."]


class RawJSON(str):
    """A value in `figures` written as this JSON text, unquoted: a number json.dumps cannot
    write (an integer of 5,000 digits)."""


def dumps(value: Any) -> str:
    """json.dumps, with each RawJSON in `value` written as its text."""
    text = json.dumps(value)
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, RawJSON):
            text = text.replace(json.dumps(item), item, 1)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return text


ENDLESS = b"["  # as a get_answers value: this, for ever
TRICKLE = b" "  # as a get_answers value: this, a byte every 0.2 s, for ever


class Handler(BaseHTTPRequestHandler):
    api_key: str | None = None
    basic: str | None = None  # "user:password"
    models_answer: Any = None  # what /v1/models answers instead of the usual listing
    get_answers: dict[str, bytes] = {}  # noqa: RUF012 (a class default, replaced per server)
    post_answers: dict[str, bytes] = {}  # noqa: RUF012
    figures: dict[str, Any] | None = None  # the usual stream's usage and timings, replaced
    protocol_version = "HTTP/1.1"
    # Nagle's algorithm held each event until the client's delayed ACK (about 40 ms on a
    # kept-alive connection, none on a new one): timings the tests read depended on it
    disable_nagle_algorithm = True

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

    def _endless(self, slow: bool) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        piece = TRICKLE if slow else ENDLESS * 65536
        chunk = b"%x\r\n%s\r\n" % (len(piece), piece)
        while True:  # until the client hangs up (ConnectionError, which _Server keeps quiet)
            self.wfile.write(chunk)
            if slow:
                time.sleep(0.2)

    def do_GET(self) -> None:
        if not self._authorized():
            return
        route = self.path.split("?")[0]
        if route in self.get_answers:
            body = self.get_answers[route]
            if body is ENDLESS or body is TRICKLE:
                return self._endless(slow=body is TRICKLE)
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        elif route == "/v1/models":
            listing = {"object": "list", "data": [{"id": "stub", "object": "model"}]}
            self._json(200, listing if self.models_answer is None else self.models_answer)
        else:
            self._json(404, {"error": {"message": f"no route {self.path}"}})

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length) or b"{}")
        if not self._authorized():
            return
        route = self.path.split("?")[0]
        if route in self.post_answers:
            answer = self.post_answers[route]
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)
            return None
        if not route.endswith(("/chat/completions", "/completions")):
            return self._json(404, {"error": {"message": f"no route {self.path}"}})
        model = body.get("model")
        if model == "missing":
            return self._json(404, {"error": {"message": "The model `missing` does not exist."}})
        if model == "boom":
            return self._json(500, {"error": {"message": "internal failure in the stub"}})
        if model == "slow":
            time.sleep(3)
        if model == "whole":  # ignores "stream": true and answers with one JSON object
            return self._json(
                200,
                {
                    "choices": [
                        {
                            "index": 0,
                            "finish_reason": "length",
                            "message": {"role": "assistant", "content": "All at once."},
                        }
                    ],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 4},
                },
            )
        if model == "html":  # a web page where the API should be
            page = b"<!doctype html><html><body>Welcome</body></html>"
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()
            self.wfile.write(page)
            return None
        if model == "moved":
            self.send_response(307)
            self.send_header("Location", "http://elsewhere.example/v1/chat/completions?key=K9x")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return None
        if model == "echo401":
            auth = self.headers.get("Authorization")
            return self._json(
                401, {"error": {"message": f"bad header Authorization: {auth} for {self.path}"}}
            )
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        chat = route.endswith("/chat/completions")
        if model in ("thinker", "thinktags"):
            return self._think(model, body)
        if model in HOSTILE:
            return HOSTILE[model](self)
        time.sleep(0.01)  # the stub's prefill: its first word comes after it, as a server's
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
            "timings": {
                "prompt_n": 8,
                "prompt_ms": 4.0,
                "predicted_n": len(WORDS),
                "predicted_ms": 50.0,
                "cache_n": 4,
            },
        }
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
        elif self.figures is not None:
            final.update(self.figures)
        self.wfile.write(f"data: {dumps(final)}\n\ndata: [DONE]\n\n".encode())
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
        final = {
            "choices": [{"index": 0, "finish_reason": "stop", "delta": {}}],
            "usage": {
                "prompt_tokens": 5,
                "completion_tokens": len(deltas),
                "completion_tokens_details": {"reasoning_tokens": len(thoughts)},
            },
        }
        self.wfile.write(f"data: {json.dumps(final)}\n\ndata: [DONE]\n\n".encode())
        self.wfile.flush()


def _send(handler: Handler, *events: dict[str, Any], done: bool = True) -> None:
    for event in events:
        handler.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
        handler.wfile.flush()
        time.sleep(0.01)
    if done:
        handler.wfile.write(b"data: [DONE]\n\n")
        handler.wfile.flush()


def _delta(**delta: Any) -> dict[str, Any]:
    return {"choices": [{"index": 0, "finish_reason": None, "delta": delta}]}


FINAL: dict[str, Any] = {"choices": [{"index": 0, "finish_reason": "stop", "delta": {}}]}
ESCAPES = "\x1b[2J\x1b[H\x1b]0;pwned\x07\x1b[31mred\x9b1m\r\x08"


def _escapes(h: Handler) -> None:
    _send(
        h,
        _delta(reasoning_content=f"think{ESCAPES}ing"),
        _delta(content=f"Hi{ESCAPES}"),
        _delta(content=" there\x1b"),
        _delta(content="[2J!"),
        FINAL,
    )


def _keepalive(h: Handler) -> None:
    _send(h, _delta(content="Hi"), done=False)
    try:
        for _ in range(600):
            h.wfile.write(b": keep-alive\n\n")
            h.wfile.flush()
            time.sleep(0.2)
    except OSError:  # the client gave up, as it should
        h.close_connection = True


def _liar(h: Handler) -> None:
    final = {
        **FINAL,
        "usage": {
            "prompt_tokens": 5,
            "completion_tokens": 2,
            "completion_tokens_details": {"reasoning_tokens": 500},
        },
        "timings": {"prompt_n": 5, "prompt_ms": 1e9, "predicted_n": 2, "predicted_ms": 2e-21},
    }
    _send(h, _delta(reasoning_content="hmm"), _delta(content="ok"), final)


def _echo(h: Handler) -> None:
    auth = h.headers.get("Authorization")
    _send(h, _delta(content=f"you sent {auth} to {h.path}"), FINAL)


def _whatwg(h: Handler) -> None:
    event = json.dumps(_delta(content="Hello, world"))
    cut = event.index('"delta"')
    h.wfile.write(b"\xef\xbb\xbf: comment\r\nevent: message\r\nid: 1\r\nretry: 100\r\n")
    h.wfile.write(f"data:{event[:cut]}\rdata: {event[cut:]}\r\r".encode())
    h.wfile.write(f"data: {json.dumps(FINAL)}\n\ndata: [DONE]".encode())
    h.wfile.flush()
    h.close_connection = True  # the end of the stream is the end of the connection


def _endless(h: Handler) -> None:
    try:
        for _ in range(100000):  # max_tokens ignored
            _send(h, _delta(content=" more"), done=False)
    except OSError:
        h.close_connection = True


MALFORMED: dict[
    str, dict[str, Any]
] = {  # a stream event of the wrong shape, then an answer that would pass
    "choices-string": {"choices": "abc"},
    "choices-of-null": {"choices": [None]},
    "content-number": {"choices": [{"index": 0, "delta": {"content": 5}}]},
}


def _malformed(event: dict[str, Any]) -> Callable[[Handler], None]:
    return lambda h: _send(h, event, _delta(content="ok"), FINAL)


HOSTILE = {
    **{name: _malformed(event) for name, event in MALFORMED.items()},
    "endless": _endless,
    "escapes": _escapes,
    "keepalive": _keepalive,
    "liar": _liar,
    "echo": _echo,
    "whatwg": _whatwg,
}


class _Server(ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        """A client that hung up mid-reply is what the broken-stream tests do on purpose: not
        worth a traceback on the stderr that the test is reading."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)  # type: ignore[arg-type]


@contextmanager
def stub_server(
    api_key: str | None = None,
    basic: str | None = None,
    models_answer: Any = None,
    get_answers: dict[str, bytes] | None = None,
    post_answers: dict[str, bytes] | None = None,
    figures: dict[str, Any] | None = None,
) -> Iterator[str]:
    handler = type(
        "KeyedHandler",
        (Handler,),
        {
            "api_key": api_key,
            "basic": basic,
            "models_answer": models_answer,
            "get_answers": get_answers or {},
            "post_answers": post_answers or {},
            "figures": figures,
        },
    )
    server = _Server(("127.0.0.1", 0), handler)
    # shutdown() waits for the loop's next poll: socketserver's default of 0.5 s made every
    # test with a stub wait that long at its end
    thread = threading.Thread(target=server.serve_forever, args=(0.01,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def bench_against_stub(
    cli: CliRunner, *args: str, model: str | None = None, command: str = "serve"
) -> Result:
    """`llmrun bench serve` (or `bench interference`) against a fresh stub, its records as
    JSON on stdout; `model` names the stub's behaviour (default: the server's first)."""
    from llmrun.cli.app import app

    named = ["-m", model] if model is not None else []
    with stub_server() as url:
        return cli.invoke(app, ["bench", command, "--endpoint", url, *named, "-o", "json", *args])
