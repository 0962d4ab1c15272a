"""`llmrun serve` against the real engine: the OpenAI shapes, the phases in each answer, the
metrics, the faults (each request ends alone), the signals, and OpenAI's own Python client.

Every server here is a real `llmrun serve` process on 127.0.0.1 with the embedded model, on a
port it picks itself (--port 0) and names on its readiness line; waits are bounded and driven by
what the server says (its lines, /health), never by sleeping a fixed time.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import queue
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx2 as httpx
import pytest
from rich.console import Console
from typer.testing import CliRunner

from llmrun.cli.app import app
from llmrun.cli.serve import answered_line, render_serve
from llmrun.runners.serving.api_access import Access, parse_origins
from llmrun.runners.serving.api_engine import Answered, RequestTimings, Snapshot, StepRecord
from llmrun.runners.serving.server import OPEN_FILES_SPARE, open_files_for
from llmrun.runners.system import logical_cpus

from .conftest import BACKGROUND_ENV, HANG_S, which_llmrun
from .fake import FakeRunner

START_S = 180.0  # a loaded 2-core machine can take this long to load and bind
LONG = {"max_tokens": 400, "ignore_eos": True, "temperature": 0, "stream": True}


@dataclass
class Server:
    proc: subprocess.Popen[str]
    url: str
    lines: list[str] = field(default_factory=list)

    def get(self, path: str) -> Any:
        return httpx.get(self.url + path, timeout=HANG_S).json()

    def post(self, path: str, body: Any, **kw: Any) -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=HANG_S, **kw)

    def metric(self, name: str) -> float:
        """The sum of a metric's samples whose line starts with `name` (labels included)."""
        text = httpx.get(self.url + "/metrics", timeout=HANG_S).text
        return sum(
            float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name)
        )

    def wait_for(self, check: Callable[[], bool], what: str, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not check():
            assert time.monotonic() < deadline, f"the server never reached: {what}"
            time.sleep(0.05)


@contextlib.contextmanager
def llmrun_serve(
    env: dict[str, str], *args: str, open_files: int | None = None
) -> Iterator[Server]:
    """`llmrun serve` on a free port; `open_files`: its limit on open files (soft and hard)."""

    def limit(n: int | None = open_files) -> None:
        import resource

        assert n is not None
        resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))

    proc = subprocess.Popen(
        [which_llmrun(), "serve", "--port", "0", "-t", "1", "-c", "512", *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        preexec_fn=None if open_files is None else limit,
    )
    lines: list[str] = []
    ready: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            if "listening on" in line:
                ready.put(line)
        ready.put(None)

    threading.Thread(target=read, daemon=True).start()
    try:
        line = ready.get(timeout=START_S)
        assert line is not None, "".join(lines)
        url = line.split("listening on ", 1)[1].split()[0]
        yield Server(proc, url, lines)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)


@pytest.fixture(scope="module")
def serve_env(tmp_path_factory: pytest.TempPathFactory, model_path: str) -> dict[str, str]:
    """The servers' environment; requesting it marks a test `model` and `pty` (conftest)."""
    home = tmp_path_factory.mktemp("serve")
    env = dict(
        os.environ,
        NO_COLOR="1",
        HF_HUB_OFFLINE="1",
        HF_HOME=str(home / "hf"),
        LLMRUN_HOME=str(home / "llmrun"),
    )
    for name in ("LLMRUN_DEBUG", "LLMRUN_MODEL", "LLMRUN_ENDPOINT", "LLMRUN_THREADS"):
        env.pop(name, None)
    env[BACKGROUND_ENV] = "0"  # a quiet machine unless a test says otherwise
    return env


@pytest.fixture(scope="module")
def llmrun_server(serve_env: dict[str, str]) -> Iterator[Server]:
    with llmrun_serve(serve_env, "-np", "2", "--max-queue", "1", "--no-dashboard") as s:
        yield s


def chat(content: str, **kw: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], **kw}


def open_stream(url: str, body: dict[str, Any], *, wait_for_data: bool = True) -> socket.socket:
    """A streaming request on a raw socket (so the test decides when the client goes away);
    returns once the first token's event arrived, or at once."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=HANG_S)
    payload = json.dumps(body).encode()
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
        b"application/json\r\nContent-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload
    )
    seen = b""
    while wait_for_data and b'"content":"' not in seen.replace(b'"content":""', b""):
        chunk = sock.recv(65536)
        assert chunk, seen
        seen += chunk
    return sock


def sse_events(response: httpx.Response) -> list[Any]:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[6:]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


# ---- the OpenAI shapes and the phases ------------------------------------------------------


def test_chat_answer_has_openai_shape_and_its_phases(llmrun_server: Server) -> None:
    r = llmrun_server.post(
        "/v1/chat/completions", chat("Name a color.", max_tokens=8, temperature=0)
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert (
        isinstance(body["created"], int)
        and body["model"] == llmrun_server.get("/v1/models")["data"][0]["id"]
    )
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["message"]["content"]
    assert choice["finish_reason"] in ("stop", "length")
    usage, t = body["usage"], body["timings"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert t["prompt_tokens"] == usage["prompt_tokens"]
    # the end-of-generation token that ended an answer counts in completion_tokens (OpenAI's
    # definition), not among the text's output_tokens
    ended = choice["finish_reason"] == "stop"
    assert t["output_tokens"] + ended == usage["completion_tokens"] == t["predicted_n"]
    assert t["prefill_tokens"] == t["prompt_tokens"] - t["reused_tokens"]
    assert sum(c["tokens"] for c in t["prefill_chunks"]) == t["prefill_tokens"]
    # TTFT holds its parts: template+tokenize, queue, step wait, prefill (and the first sample).
    parts = t["template_tokenize_ms"] + t["queue_ms"] + t["step_wait_ms"] + t["prefill_ms"]
    assert min(t["queue_ms"], t["step_wait_ms"]) >= 0
    assert t["ttft_ms"] >= parts - 0.01
    assert t["itl_p99_ms"] >= t["itl_p50_ms"] > 0
    assert "seed" in t


def test_streaming_with_include_usage_ends_with_usage_and_timings(llmrun_server: Server) -> None:
    body = {
        "prompt": "The capital of France is",
        "max_tokens": 6,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream(
        "POST", llmrun_server.url + "/v1/completions", json=body, timeout=HANG_S
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    usage_chunk, final = events[-2], events[-3]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 6
    assert usage_chunk["timings"]["output_tokens"] == 6
    assert final["choices"][0]["finish_reason"] == "length" and "timings" in final
    assert all(e["object"] == "text_completion" and e["id"] == final["id"] for e in events[:-1])
    text = "".join(e["choices"][0]["text"] for e in events[:-2])
    assert text.strip()


def test_a_shared_prefix_is_reused_and_changes_nothing(llmrun_server: Server) -> None:
    body = chat("Write one sentence about the sea.", max_tokens=10, temperature=0)
    first = llmrun_server.post("/v1/chat/completions", body).json()
    second = llmrun_server.post("/v1/chat/completions", body).json()
    assert second["timings"]["reused_tokens"] == second["timings"]["prompt_tokens"] - 1
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert second["choices"][0]["message"] == first["choices"][0]["message"]


def test_seeds_and_stop_strings_per_request(llmrun_server: Server) -> None:
    sampled = chat("Tell me a short story.", max_tokens=12, temperature=1.0, seed=7)
    a = llmrun_server.post("/v1/chat/completions", sampled).json()
    b = llmrun_server.post("/v1/chat/completions", sampled).json()
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]
    assert a["timings"]["seed"] == 7
    random = llmrun_server.post("/v1/chat/completions", {**sampled, "seed": -1}).json()
    assert random["timings"]["seed"] not in (None, -1)  # llama-server's -1: a random seed
    greedy = chat("Count from one to ten in words.", max_tokens=24, temperature=0)
    full = llmrun_server.post("/v1/chat/completions", greedy).json()["choices"][0]["message"][
        "content"
    ]
    words = full.split()
    assert len(words) > 3, full
    stop = words[2]
    cut = llmrun_server.post("/v1/chat/completions", {**greedy, "stop": [stop]}).json()["choices"][
        0
    ]
    assert cut["finish_reason"] == "stop"
    assert cut["message"]["content"] == full[: full.index(stop)]


def test_models_health_tokenize_and_metrics(llmrun_server: Server) -> None:
    models = llmrun_server.get("/v1/models")
    assert models["object"] == "list" and models["data"][0]["object"] == "model"
    assert models["data"][0]["meta"]["n_seq"] == 2
    health = llmrun_server.get("/health")
    assert health["status"] == "ok" and health["slots_idle"] + health["slots_processing"] == 2
    tokens = llmrun_server.post("/tokenize", {"content": "hello world"}).json()["tokens"]
    assert tokens and all(isinstance(t, int) for t in tokens)
    llmrun_server.post("/v1/completions", {"prompt": tokens, "max_tokens": 3, "temperature": 0})
    text = httpx.get(llmrun_server.url + "/metrics", timeout=HANG_S).text
    for name in (
        "llmrun_requests_total",
        "llmrun_requests_in_flight",
        "llmrun_requests_queued",
        "llmrun_queue_wait_seconds_bucket",
        "llmrun_ttft_seconds_bucket",
        "llmrun_prefill_seconds_bucket",
        "llmrun_itl_seconds_bucket",
        "llmrun_prompt_tokens_total",
        "llmrun_generated_tokens_total",
        "llmrun_step_prefill_tokens_bucket",
        "llmrun_step_decode_tokens_bucket",
    ):
        assert f"\n{name}" in text, name
    assert llmrun_server.metric("llmrun_ttft_seconds_count") > 0
    assert llmrun_server.metric("llmrun_step_prefill_tokens_sum") > 0
    assert llmrun_server.metric("llmrun_step_decode_tokens_sum") > 0


# ---- faults: each request ends with its own error --------------------------------------------


@pytest.mark.parametrize(
    ("payload", "words"),
    [
        (b'{"messages": [', "malformed JSON"),
        (json.dumps(chat("hi", temperature="hot")).encode(), "temperature"),
        (json.dumps(chat("hi", max_tokens=True)).encode(), "max_tokens"),
        (
            json.dumps(chat("hi", temperature=500)).encode(),
            "temperature 500.0 is out of range 0..100",
        ),
        (json.dumps({"messages": []}).encode(), "messages"),
        (json.dumps({"prompt": [10**9]}).encode(), "not in the vocabulary"),
        (
            json.dumps(chat("hi", tools=[{"type": "function"}])).encode(),
            "tools.0.function: an object with a name",
        ),
        (json.dumps(chat("hi", logit_bias={"1": 5})).encode(), "logit_bias"),
    ],
)
def test_bad_requests_get_400_with_the_reason(
    llmrun_server: Server, payload: bytes, words: str
) -> None:
    route = "/v1/completions" if b'"prompt"' in payload else "/v1/chat/completions"
    r = httpx.post(
        llmrun_server.url + route,
        content=payload,
        timeout=HANG_S,
        headers={"Content-Type": "application/json"},
    )
    assert r.status_code == 400
    assert words in r.json()["error"]["message"]
    assert llmrun_server.get("/health")["status"] == "ok"


def test_a_sampling_value_out_of_range_names_its_field_in_param(llmrun_server: Server) -> None:
    """OpenAI's error body names the field at fault in `param`: every sampling setting's range
    error does, by the name the request gave it."""
    bodies = {
        "max_tokens": chat("hi", max_tokens=0),
        "max_completion_tokens": chat("hi", max_completion_tokens=0),
        "temperature": chat("hi", temperature=-1),
        "top_k": chat("hi", top_k=-1),
        "top_p": chat("hi", top_p=1.5),
        "min_p": chat("hi", min_p=2),
        "repeat_penalty": chat("hi", repeat_penalty=-1),
        "repetition_penalty": chat("hi", repetition_penalty=-1),
        "repeat_last_n": chat("hi", repeat_last_n=-2),
        "seed": chat("hi", seed=-5),
    }
    for param, body in bodies.items():
        error = llmrun_server.post("/v1/chat/completions", body).json()["error"]
        assert "out of range" in error["message"] and error["param"] == param, error
    legacy = llmrun_server.post("/v1/completions", {"prompt": "hi", "temperature": 500})
    assert legacy.json()["error"]["param"] == "temperature"


def test_a_prompt_longer_than_the_context_gets_400(llmrun_server: Server) -> None:
    r = llmrun_server.post("/v1/chat/completions", chat("word " * 700, max_tokens=4))
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert "tokens long but the context holds 512" in message


def test_generated_tokens_count_what_usage_counts(llmrun_server: Server) -> None:
    """llmrun_generated_tokens_total left out the end token that usage.completion_tokens (and
    llama-server's tokens_predicted) count: 89 against 93 after six answers that ended on it."""
    before = llmrun_server.metric("llmrun_generated_tokens_total")
    r = llmrun_server.post("/v1/chat/completions", chat("Say hi.", max_tokens=200, temperature=0))
    answer = r.json()
    assert answer["choices"][0]["finish_reason"] == "stop", answer  # ended on the end token
    got = llmrun_server.metric("llmrun_generated_tokens_total") - before
    assert got == answer["usage"]["completion_tokens"] == answer["timings"]["output_tokens"] + 1


def test_a_disconnected_client_frees_its_sequence_and_the_rest_carry_on(
    llmrun_server: Server,
) -> None:
    cancelled = llmrun_server.metric('llmrun_requests_total{outcome="cancelled"')
    generated = llmrun_server.metric("llmrun_generated_tokens_total")
    gone = open_stream(llmrun_server.url, chat("Tell me about rivers.", **LONG))
    gone.close()
    llmrun_server.wait_for(
        lambda: llmrun_server.metric('llmrun_requests_total{outcome="cancelled"') > cancelled,
        "the request counted as cancelled",
    )
    llmrun_server.wait_for(
        lambda: llmrun_server.get("/health")["slots_processing"] == 0, "both slots free"
    )
    # The engine stopped it long before its 400 tokens.
    assert llmrun_server.metric("llmrun_generated_tokens_total") - generated < 400
    after = llmrun_server.post("/v1/chat/completions", chat("Name a fruit.", max_tokens=4))
    assert after.status_code == 200


def test_a_full_queue_gets_503_with_retry_after(llmrun_server: Server) -> None:
    running = [open_stream(llmrun_server.url, chat(f"Story number {i}.", **LONG)) for i in range(2)]
    waiting = open_stream(llmrun_server.url, chat("Story number 3.", **LONG), wait_for_data=False)
    try:
        llmrun_server.wait_for(
            lambda: llmrun_server.get("/health")["queued"] == 1, "one request queued"
        )
        r = llmrun_server.post("/v1/chat/completions", chat("One more.", max_tokens=2))
        assert r.status_code == 503
        assert r.headers["Retry-After"].isdigit()
        assert "busy" in r.json()["error"]["message"]
    finally:
        for sock in (*running, waiting):
            sock.close()
    llmrun_server.wait_for(
        lambda: (h := llmrun_server.get("/health"))["slots_processing"] == 0 and h["queued"] == 0,
        "the slots and the queue empty",
    )
    assert llmrun_server.post("/v1/chat/completions", chat("Hi.", max_tokens=2)).status_code == 200


# ---- clients ---------------------------------------------------------------------------------


def test_openai_python_client(llmrun_server: Server) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=llmrun_server.url + "/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=6,
        temperature=0,
    )
    assert reply.choices[0].message.content and reply.usage is not None
    assert reply.usage.completion_tokens <= 6
    pieces, usage = [], None
    for chunk in client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        usage = chunk.usage or usage
    assert "".join(pieces) == reply.choices[0].message.content
    assert usage is not None and usage.completion_tokens == reply.usage.completion_tokens
    done = client.completions.create(model=model, prompt="One, two,", max_tokens=4, temperature=0)
    assert done.choices[0].text and done.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "x"}], temperature=500
        )


def test_run_endpoint_shows_the_servers_own_prefill(llmrun_server: Server) -> None:
    result = CliRunner().invoke(
        app,
        [
            "run",
            "Name a color.",
            "--endpoint",
            llmrun_server.url,
            "-n",
            "6",
            "--temp",
            "0",
            "--stats",
            "json",
        ],
    )
    assert result.exit_code == 0, result.stderr
    stats = json.loads(result.stderr.strip().splitlines()[-1])
    assert stats["server_prompt_ms"] is not None and stats["server_prompt_ms"] > 0
    assert stats["server_prompt_n"] + (stats["server_cache_n"] or 0) == stats["prompt_tokens"]
    assert stats["server_predicted_n"] == stats["output_tokens"]


def test_interference_against_a_prompt_cache_measures_every_prefill_from_nothing(
    serve_env: dict[str, str],
) -> None:
    """`bench interference --endpoint` sends the steady client's prompt twice (alone, then
    under load): against a server that caches prompts, the same prompt twice would be a
    loaded TTFT without its prefill. Each steady request is a prompt of its own, after an
    unmeasured warm-up."""
    with llmrun_serve(serve_env, "-np", "4", "--no-dashboard") as s:
        result = CliRunner().invoke(
            app,
            [
                "bench",
                "interference",
                "--endpoint",
                s.url,
                "--input-len",
                "24",
                "--prompt-len",
                "32",
                "--rate",
                "2",
                "-o",
                "json",
            ],
        )
        assert result.exit_code == 0, result.stderr
        (record,) = json.loads(result.stdout)
        assert record["ttft_alone_ms"] > 0 and record["ttft_loaded_ms"] > 0

        def answered_lines() -> list[str]:
            return [line for line in list(s.lines) if " completions 200 " in line]

        sent = 3 + record["background_requests"]
        s.wait_for(lambda: len(answered_lines()) >= sent, "every request logged")
        answered = answered_lines()
        steady = [line for line in answered if "out 4 " in line or "out 64 " in line]
        assert len(steady) == 3, answered  # the warm-up, alone, under load
        reused = [int(line.split("(reused ")[1].split(")")[0]) for line in answered]
        assert len(answered) == sent and max(reused) <= 2, answered  # no prompt twice


# ---- signals ---------------------------------------------------------------------------------


def test_sigterm_drains_the_requests_in_flight_then_exits_143(serve_env: dict[str, str]) -> None:
    with llmrun_serve(serve_env, "-np", "1") as s:
        body = {
            "messages": [{"role": "user", "content": "Count to twenty."}],
            "max_tokens": 16,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
        }
        sock = open_stream(s.url, body)
        s.proc.send_signal(signal.SIGTERM)
        received = b""
        while not received.endswith(b"0\r\n\r\n"):  # the chunked body's end
            chunk = sock.recv(65536)
            if not chunk:
                break
            received += chunk
        sock.close()
        assert b"data: [DONE]" in received
        assert b'"finish_reason":"length"' in received
        assert s.proc.wait(120) == 143
        assert any("stopped (SIGTERM)" in line for line in s.lines)


def stopped_listening(server: Server) -> None:
    """Until the server refuses new connections: its shutdown has begun (it closes its
    listening socket first), so the signal that started it was handled."""
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    deadline = time.monotonic() + HANG_S
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, int(port)), timeout=HANG_S).close()
        except ConnectionRefusedError:
            return
        time.sleep(0.02)
    raise AssertionError("the server still listens")


def read_to_the_end(sock: socket.socket) -> bytes:
    """What the server sends until it closes the connection."""
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received


@pytest.mark.parametrize(
    ("signals", "drain", "code"),
    [
        ((signal.SIGTERM,), "1", 143),  # past --drain-timeout
        ((signal.SIGTERM, signal.SIGTERM), "600", 143),  # a second SIGTERM
        ((signal.SIGINT,), "600", 130),
        ((signal.SIGHUP,), "600", 129),
    ],
    ids=["sigterm-past-the-drain", "second-sigterm", "ctrl-c", "sighup"],
)
def test_a_shutdown_ends_the_requests_in_flight_with_an_error_not_silently(
    serve_env: dict[str, str], signals: tuple[signal.Signals, ...], drain: str, code: int
) -> None:
    """A stream cut by the server's shutdown ends with an error event in OpenAI's shape, a last
    chunk with a finish reason, and [DONE]; a whole answer with a 503. Nothing is cut silently,
    and no traceback reaches the log."""
    body = chat("Tell me about rivers.", max_tokens=1500, ignore_eos=True, temperature=0)
    with llmrun_serve(serve_env, "-np", "2", "-c", "2048", "--drain-timeout", drain) as s:
        streaming = open_stream(s.url, {**body, "stream": True})
        whole: dict[str, httpx.Response] = {}

        def ask() -> None:
            whole["r"] = httpx.post(s.url + "/v1/chat/completions", json=body, timeout=HANG_S)

        asking = threading.Thread(target=ask)
        asking.start()
        s.wait_for(lambda: s.get("/health")["slots_processing"] == 2, "both requests running")
        for sig in signals:  # each after the last one's handler ran: two at once are one
            s.proc.send_signal(sig)
            stopped_listening(s)
        received = read_to_the_end(streaming)
        streaming.close()
        asking.join(120)
        assert s.proc.wait(120) == code
    events = [
        line[len(b"data: ") :] for line in received.split(b"\n") if line.startswith(b"data: ")
    ]
    assert events[-1] == b"[DONE]", received[-500:]
    error, last = json.loads(events[-3]), json.loads(events[-2])
    assert error["error"]["message"] == "the server is shutting down"
    assert error["error"]["code"] == 503 and error["error"]["type"] == "server_error"
    assert last["choices"][0]["finish_reason"] == "error"
    assert whole["r"].status_code == 503
    assert whole["r"].json()["error"]["message"] == "the server is shutting down"
    log = "".join(s.lines)
    assert "Traceback" not in log and "CancelledError" not in log, log
    assert "client disconnected" not in log, log


def test_the_wait_for_the_step_in_progress_is_not_queue_but_step_wait(
    llmrun_server: Server,
) -> None:
    """With a sequence free, a request that arrives while another's prefill step runs waits
    for that step: the wait is its step_wait_ms, not its queue_ms (the wait for a sequence,
    figures.py's queue, as bench serve's), and the docs define both so."""
    long = {"prompt": list(range(1000, 1450)), "max_tokens": 1, "temperature": 0}
    answers: dict[str, Any] = {}

    def prefill() -> None:
        answers["long"] = llmrun_server.post("/v1/completions", long).json()["timings"]

    prefilling = threading.Thread(target=prefill)
    prefilling.start()
    llmrun_server.wait_for(
        lambda: llmrun_server.get("/health")["slots_processing"] == 1, "the long prompt admitted"
    )
    short = llmrun_server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 1}).json()
    prefilling.join(120)
    timings, step = short["timings"], answers["long"]["prefill_ms"]
    assert answers["long"]["prefill_tokens"] > 400 and len(answers["long"]["prefill_chunks"]) == 1
    assert timings["step_wait_ms"] > 0.3 * step, (timings, step)
    assert timings["queue_ms"] < 0.1 * timings["step_wait_ms"], timings  # a sequence was free
    docs = (Path(__file__).resolve().parent.parent / "docs" / "serving.md").read_text()
    rows = {
        line.split("|")[1].strip(): line for line in docs.splitlines() if line.startswith("| `")
    }
    assert "the wait for a free sequence, and nothing else" in rows["`queue_ms`"]
    assert "the step in progress" in rows["`step_wait_ms`"]


@pytest.mark.usefixtures("every_core")  # -tb 2
def test_metrics_and_log_say_the_threads_and_a_busy_machine(serve_env: dict[str, str]) -> None:
    load = logical_cpus() - 0.5  # other processes' load, faked (tests/inject)
    env = {**serve_env, BACKGROUND_ENV: str(load)}
    with llmrun_serve(env, "-np", "1", "-tb", "2", "--no-dashboard") as s:
        assert "threads 1/2)" in s.lines[-1]  # the ready line: as llama.cpp's context has them
        assert (s.metric("llmrun_engine_threads "), s.metric("llmrun_engine_threads_batch ")) == (
            1,
            2,
        )
        assert s.metric("llmrun_background_cpus ") == load
        assert s.metric("llmrun_machine_busy ") == 1
        s.wait_for(lambda: any("warning: other processes keep" in x for x in s.lines), "busy")
        line = next(x for x in s.lines if "warning: other processes keep" in x)
        assert f"keep {load:.1f} of {logical_cpus()} CPUs busy" in line and "try " in line


def test_ctrl_c_exits_130(serve_env: dict[str, str]) -> None:
    with llmrun_serve(serve_env, "-np", "1") as s:
        s.proc.send_signal(signal.SIGINT)
        assert s.proc.wait(60) == 130


def test_a_port_in_use_is_one_line(serve_env: dict[str, str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        result = subprocess.run(
            [which_llmrun(), "serve", "--port", str(port)],
            env=serve_env,
            capture_output=True,
            text=True,
            timeout=HANG_S,
        )
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"llmrun: error: cannot listen on 127.0.0.1:{port}: Address already in use"
    ]


# ---- the live view and the log (pure functions) -----------------------------------------------


def _timings() -> RequestTimings:
    return RequestTimings(
        prompt_tokens=40,
        reused_tokens=8,
        output_tokens=3,
        template_tokenize_ms=1.0,
        queue_ms=2.0,
        prefill_ms=30.0,
        prefill_chunks=((16, 15.0), (16, 15.0)),
        ttft_ms=34.0,
        decode_ms=20.0,
        itl_ms=(9.0, 11.0),
        finish_reason="stop",
        seed=None,
    )


@pytest.mark.parametrize("width", [100, 48])
def test_live_view_renders_the_engine_state(width: int) -> None:
    steps = tuple(
        StepRecord(end_s=1.0 + i * 0.01, duration_s=0.01, n_decode=3, n_prefill=16)
        for i in range(10)
    )
    snap = Snapshot(
        decoding=3,
        prefilling=1,
        queued=2,
        n_seq=4,
        policy="chunked:64",
        steps=steps,
        recent_itl_ms=(9.0, 10.0, 12.0),
        served=5,
        output_tokens=70,
    )
    out = io.StringIO()
    Console(file=out, width=width, color_system=None).print(render_serve(snap))
    text = " ".join(out.getvalue().split())
    assert "3 decoding" in text and "1 prefilling" in text and "2 queued" in text
    assert "16.0 prefill + 3.0 decode tokens" in text
    assert "tok/s generated" in text and "p99" in text
    assert all(len(line) <= width for line in out.getvalue().splitlines())
    idle = Snapshot(
        decoding=0,
        prefilling=0,
        queued=0,
        n_seq=4,
        policy="chunked:64",
        steps=(),
        recent_itl_ms=(),
        served=0,
        output_tokens=0,
    )
    out = io.StringIO()
    Console(file=out, width=width, color_system=None).print(render_serve(idle))
    assert "idle" in out.getvalue() and "ITL" not in out.getvalue()


def test_log_line_names_every_phase() -> None:
    line = answered_line(Answered("chat", 200, _timings()))
    for words in (
        "chat 200 stop",
        "prompt 40 (reused 8)",
        "out 3",
        "queue 2.0",
        "template 1.0",
        "prefill 30.0 (2 chunks)",
        "ttft 34.0",
        "decode 20.0",
        "itl p50 10.0",
    ):
        assert words in line, words
    assert answered_line(Answered("chat", 503, None, "busy")) == "chat 503 busy"


def test_timings_json_names() -> None:
    t = _timings().to_dict()
    assert t["prefill_tokens"] == 32 and t["prefill_chunks"] == [
        {"tokens": 16, "ms": 15.0},
        {"tokens": 16, "ms": 15.0},
    ]
    assert t["itl_p50_ms"] == 10.0 and t["decode_tps"] == 100.0
    assert json.loads(json.dumps(t)) == t


def test_a_bad_policy_is_one_line_before_any_model_loads(fake: FakeRunner) -> None:
    result = CliRunner().invoke(app, ["serve", "--policy", "fastest", "--port", "0"])
    assert result.exit_code == 2  # an option's value that cannot be read: a usage error
    assert result.stderr.strip().splitlines() == [
        "llmrun: error: --policy: 'fastest' is not prefill-first, decode-first or chunked:B"
    ]
    assert fake.loaded is None


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--max-connections", "0"], "--max-connections: '0' is not a whole number"),
        (["--max-connections", "-1"], "--max-connections: '-1' is not a whole number"),
        (["--max-connections", "2.5"], "--max-connections: '2.5' is not a whole number"),
        (["--max-connections", "many"], "--max-connections: 'many' is not a whole number"),
        (["--allow-origin", "http://app.example/"], "--allow-origin: 'http://app.example/' is not"),
        (["--allow-origin", "app.example"], "--allow-origin: 'app.example' is not an origin"),
        (["--allow-origin", "https://*.*.example"], "--allow-origin: 'https://*.*.example' is not"),
        (["--allow-origin", "https://app.example/*"], "--allow-origin: 'https://app.example/*'"),
        (["--allow-origin", "http://a\nb"], "--allow-origin: 'http://a\\nb' is not an origin"),
        (["--alias", "a\nb"], "--alias 'a\\nb': give a name of printable text"),
        (["--alias", " "], "--alias ' ': give a name of printable text"),
    ],
)
def test_bad_connection_caps_and_origins_are_usage_errors(
    fake: FakeRunner, args: list[str], words: str
) -> None:
    result = CliRunner().invoke(app, ["serve", "--port", "0", *args])
    assert result.exit_code == 2
    assert result.stderr.startswith(f"llmrun: error: {words}") and result.stderr.count("\n") == 1
    assert fake.loaded is None


def test_allowed_origins_are_compared_as_browsers_send_them() -> None:
    assert not Access().origin_allowed("https://evil.example")
    assert Access(parse_origins(["*"])).origin_allowed("https://evil.example")
    given = Access(parse_origins(["HTTP://App.Example:80", "https://b.example:8443"]))
    assert given.origin_allowed("http://app.example") and given.origin_allowed(
        "https://b.example:8443"
    )
    assert not given.origin_allowed("https://app.example")
    assert not given.origin_allowed("https://b.example")


def test_allowed_origins_take_one_wildcard_as_ollama_origins_does() -> None:
    """OLLAMA_ORIGINS' patterns (`chrome-extension://*`, `http://host:*`) mean what they say
    here too, rather than a literal `*` that no browser ever sends."""
    given = Access(
        parse_origins(["chrome-extension://*", "HTTPS://*.App.Example:443", "http://10.0.0.5:*"])
    )
    for origin in (
        "chrome-extension://abcdef",
        "https://a.app.example",
        "https://b.app.example:443",
        "http://10.0.0.5:3000",
    ):
        assert given.origin_allowed(origin), origin
    for origin in (
        "moz-extension://abcdef",
        "https://app.example",
        "https://evil.example",
        "https://a.app.example.evil.example",
        "http://a.app.example",
        "http://10.0.0.55:3000",
        "http://10.0.0.5",
        "chrome-extension://",
    ):
        assert not given.origin_allowed(origin), origin


def test_a_cap_over_the_open_files_limit_raises_it() -> None:
    resource = pytest.importorskip("resource")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 512 + OPEN_FILES_SPARE:
        pytest.skip(f"the hard limit on open files is {hard}")
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
        open_files_for(512)
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == 512 + OPEN_FILES_SPARE
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_cap_over_the_hard_open_files_limit_is_lowered_to_what_fits() -> None:
    resource = pytest.importorskip("resource")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        pytest.skip("no hard limit on open files")
    try:
        fit = open_files_for(hard + 10)
        assert fit == hard - min(OPEN_FILES_SPARE, hard // 2)
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == hard
        assert open_files_for(5) == 5
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_help_lists_the_server_options(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    for option in (
        "--host",
        "--port",
        "-np",
        "--policy",
        "--max-queue",
        "--drain-timeout",
        "--max-connections",
        "--allow-origin",
        "trailing slash",
    ):
        assert option in result.stdout


def test_live_view_on_a_terminal_then_nothing_left_of_it(serve_env: dict[str, str]) -> None:
    """On a terminal: the panel while serving, the request's line above it, and at SIGTERM the
    panel gone (no stale rows), the lines kept."""
    pexpect = pytest.importorskip("pexpect")
    pyte = pytest.importorskip("pyte")
    screen = pyte.Screen(80, 30)
    stream = pyte.ByteStream(screen)
    raw = bytearray()
    child = pexpect.spawn(
        which_llmrun(),
        ["serve", "--port", "0", "-np", "1", "-c", "512", "-t", "1"],
        env=serve_env,
        dimensions=(30, 80),
    )

    def until(seen: Callable[[], bool]) -> None:
        """Read the terminal until `seen` (bounded); EOF ends the reading."""
        deadline = time.monotonic() + START_S
        while not seen():
            assert time.monotonic() < deadline, "\n".join(screen.display)
            try:
                data = child.read_nonblocking(65536, timeout=1)
            except pexpect.TIMEOUT:
                continue
            except pexpect.EOF:
                return
            raw.extend(data)
            stream.feed(data)

    try:
        until(lambda: b")\r\n" in raw.partition(b"listening on ")[2])
        url = raw.split(b"listening on ", 1)[1].split()[0].decode()
        body = {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}
        assert httpx.post(url + "/v1/completions", json=body, timeout=HANG_S).status_code == 200
        until(lambda: any("1 requests" in line for line in screen.display))
        assert any("sequences" in line for line in screen.display)
        child.kill(signal.SIGTERM)
        until(lambda: False)  # to the end
    finally:
        child.close(force=True)
    assert child.exitstatus == 143
    shown = "\n".join(screen.display)
    assert "listening on" in shown and "stopped (SIGTERM)" in shown
    assert "completions 200 length" in shown
    assert "decoding ·" not in shown and "per step" not in shown


def test_serves_lines_name_a_model_file_with_escapes_clean(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The id serve lists is the model file's name: `listening on ... (NAME, ...)` put a name's
    escape sequences on the terminal (window title, colours)."""
    from llmrun.cli.serve import _line
    from llmrun.runners.serving.server import model_id

    name = model_id("/tmp/x/ok\x1b]0;PWN\x07\x1b[41mRED.gguf")
    _line(f"llmrun serve: listening on http://127.0.0.1:8080 ({name}, 1 sequences)")
    err = capsys.readouterr().err
    assert "\x1b" not in err and "(okRED, 1 sequences)" in err
