"""Truth, round three (issue 29), for what a server streams: the finish reason that comes before
llama-server's usage-only last chunk, a stream line still arriving when the timeout ends, a
10 MB line, and thinking tags split over the chunks. A scripted loopback server sends exactly
the bytes each test names; the CLI runs in-process with CliRunner."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from typer.testing import CliRunner

from llmrun.cli.app import app
from llmrun.runners.remote import MAX_SSE_LINE, SSELineTooLongError, SSEReader

from .stub_server import Handler, _Server


def sse_events(raw: Iterable[bytes]) -> Iterator[str | None]:
    """The `data` of each event in a server-sent event stream, as the remote runner reads it."""
    return SSEReader().events(raw)


def event(data: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(data)}\n\n".encode()


def delta(**fields: Any) -> bytes:
    return event({"choices": [{"index": 0, "finish_reason": None, "delta": fields}]})


def final(reason: str) -> bytes:
    return event({"choices": [{"index": 0, "finish_reason": reason, "delta": {}}]})


# llama-server's last chunk with stream_options.include_usage: no choices, only the figures
USAGE_ONLY = event(
    {
        "choices": [],
        "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
        "timings": {"prompt_n": 5, "prompt_ms": 1.0, "predicted_n": 3, "predicted_ms": 3.0},
    }
)
DONE = b"data: [DONE]\n\n"


@contextmanager
def scripted(*writes: bytes | float | tuple[bytes, float, int]) -> Iterator[str]:
    """A server whose streamed answer is `writes`: bytes are sent, a float is a pause, and
    (bytes, pause, n) sends the bytes n times with the pause between (until the client
    leaves)."""

    class Scripted(Handler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            try:
                for item in writes:
                    if isinstance(item, float):
                        time.sleep(item)
                        continue
                    piece, pause, n = item if isinstance(item, tuple) else (item, 0.0, 1)
                    for _ in range(n):
                        self.wfile.write(piece)
                        self.wfile.flush()
                        time.sleep(pause)
            except OSError:  # the client gave up, as it should
                pass
            self.close_connection = True

    server = _Server(("127.0.0.1", 0), Scripted)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def stats_of(stderr: str) -> dict[str, Any]:
    return json.loads(stderr.strip().splitlines()[-1])


# ---- 1. the finish reason survives the usage-only last chunk --------------------------------


@pytest.mark.parametrize("reason", ["length", "stop"])
def test_the_finish_reason_is_the_streams_not_the_usage_chunks(reason: str, cli: CliRunner) -> None:
    """llama-server sends `finish_reason` in one chunk and the usage in a last one without
    choices; `run -n 3` against it said `[stop]` where the stream said `length`."""
    script = (delta(content="a"), delta(content=" b"), delta(content=" c"), final(reason))
    with scripted(*script, USAGE_ONLY, DONE) as url:
        shown = cli.invoke(app, ["run", "--endpoint", url, "-n", "3", "hi"])
        data = cli.invoke(app, ["run", "--endpoint", url, "-n", "3", "--stats", "json", "hi"])
    assert shown.exit_code == 0 and data.exit_code == 0, shown.output + data.output
    assert shown.stdout == "a b c\n"
    assert f"output   3 tokens [{reason}]" in shown.stderr, shown.stderr
    stats = stats_of(data.stderr)
    assert stats["finish_reason"] == reason and stats["output_tokens"] == 3


@pytest.mark.parametrize("script", [(final("stop"),), (delta(content=""), final("stop"))])
def test_a_reply_without_a_token_has_no_ttft(script: tuple[bytes, ...], cli: CliRunner) -> None:
    """A stream that ends with no content had `ttft 0.0 ms`, `"ttft_s": 0.0` and "No output;
    the prompt phase took 0.0 ms": no token came, so there is no time to the first one, and the
    client saw no prompt phase (the local engine's zero-token run has one: it sampled an EOS)."""
    with scripted(0.05, *script, DONE) as url:
        shown = cli.invoke(app, ["run", "--endpoint", url, "-n", "4", "hi"])
        data = cli.invoke(app, ["run", "--endpoint", url, "-n", "4", "--stats", "json", "hi"])
    assert shown.exit_code == 0 and data.exit_code == 0, shown.output + data.output
    assert "ttft     0.0 ms" not in shown.stderr and "prompt phase" not in shown.stderr
    assert "ttft     - (no token arrived)" in shown.stderr, shown.stderr
    assert "No first token: the request ended after" in shown.stderr
    # no token, so no decode to time either (it read `decode 0.0 ms · -`)
    assert "decode   - (no token arrived)" in shown.stderr, shown.stderr
    stats = stats_of(data.stderr)
    assert stats["ttft_s"] is None and stats["first_token_s"] is None
    assert stats["decode_s"] is None and stats["output_tps"] is None
    assert stats["output_tokens"] == 0 and stats["e2e_s"] >= 0.05


# ---- 9. a long stream line is read, or named for what it is --------------------------------


def test_a_line_still_arriving_at_the_timeout_is_named_not_called_keep_alive(
    cli: CliRunner,
) -> None:
    """A server that trickles one line and never ends it is not sending keep-alive comments."""
    start = b'data: {"choices": [{"index": 0, "delta": {"content": "'
    with scripted(delta(content="Hi"), start, (b"x" * 512, 0.05, 1200)) as url:
        result = cli.invoke(app, ["run", "--endpoint", url, "--timeout", "1", "hi"])
    assert result.exit_code == 1
    assert result.stdout == "Hi\n"  # the text so far is kept
    assert "keep-alive" not in result.stderr, result.stderr
    assert "no whole event within 1 s (a stream line of " in result.stderr, result.stderr
    assert "so far, without its end)" in result.stderr


def test_an_event_left_open_at_the_timeout_is_named_too(cli: CliRunner) -> None:
    """`data:` lines, then only comments: the event never got its blank line."""
    opened = b'data: {"choices": []}\n'
    with scripted(delta(content="Hi"), opened, (b": keep-alive\n", 0.1, 600)) as url:
        result = cli.invoke(app, ["run", "--endpoint", url, "--timeout", "1", "hi"])
    assert result.exit_code == 1 and result.stdout == "Hi\n"
    assert "(an event of 15 characters so far, without the blank line that ends it)" in (
        result.stderr
    ), result.stderr


def test_a_10_mb_line_is_one_chunk_of_text(cli: CliRunner) -> None:
    """Under the 16 MiB cap a long line is an event like any other: read in time linear in its
    length, then used. Its parsing took 17 s on 2 cores before (quadratic: the whole line was
    split again at every read), so the 8 s timeout reported "only keep-alive comments"; it
    takes 0.3 s now."""
    text = "y" * 10_000_000
    with scripted(delta(content=text), final("stop"), USAGE_ONLY, DONE) as url:
        result = cli.invoke(
            app, ["run", "--endpoint", url, "--timeout", "8", "--stats", "json", "hi"]
        )
    assert result.exit_code == 0, result.stderr[-500:]
    assert result.stdout == text + "\n"
    assert stats_of(result.stderr)["finish_reason"] == "stop"


def test_the_reader_counts_what_is_unfinished_and_refuses_what_is_too_long() -> None:
    reader = SSEReader()
    events = reader.events([b"data: {", b'"a": 1', b"}\n", b"\n", b"data: x"])
    assert next(events) is None and reader.unfinished_chars == len("data: {") and reader.in_line
    assert next(events) is None and reader.unfinished_chars == len('data: {"a": 1')
    assert next(events) is None and reader.unfinished_chars == len('{"a": 1}')  # data held
    assert not reader.in_line  # a whole line came: the event waits for its blank line
    assert next(events) == '{"a": 1}' and reader.unfinished_chars == 0
    assert list(events) == [None, "x"]  # an unterminated last event is still used
    assert not reader.in_line and reader.unfinished_chars == 0
    line = [b"data: ", b"z" * (MAX_SSE_LINE + 1)]
    with pytest.raises(SSELineTooLongError, match="a stream line longer than 16 MiB"):
        list(sse_events(line))
    many = [b"data: " + b"z" * 2**20 + b"\n"] * 17  # data lines that never end their event
    with pytest.raises(SSELineTooLongError, match="a stream event longer than 16 MiB"):
        list(sse_events(many))


# ---- 3. thinking tags split over the chunks, end to end -------------------------------------

THOUGHT = "<think>\nWhy? Because.\n</think>\n\nIt is 42."


@pytest.mark.parametrize("cut", range(1, len("<think>")))
def test_a_split_opening_tag_never_reaches_stdout(cut: int, cli: CliRunner) -> None:
    """`<` + `think>` (and every other cut of the tag, and of the closing one): stdout gets the
    answer alone, stderr the thinking once, and the summary an answer after the thinking."""
    close = THOUGHT.index("</think>") + cut + 1
    chunks = [THOUGHT[:cut], THOUGHT[cut:close], THOUGHT[close:-3], THOUGHT[-3:]]
    script = [delta(content=c) for c in chunks]
    with scripted(*script, final("stop"), DONE) as url:
        plain = cli.invoke(app, ["run", "--endpoint", url, "hi"])
        kept = cli.invoke(app, ["run", "--endpoint", url, "--thinking-stdout", "-q", "hi"])
    assert plain.exit_code == 0 and kept.exit_code == 0, plain.output + kept.output
    assert plain.stdout == "\n\nIt is 42.\n", repr(plain.stdout)
    assert plain.stderr.startswith("<think>\nWhy? Because.\n</think>\n"), plain.stderr
    assert "first answer token at" in plain.stderr and "no answer after" not in plain.stderr
    assert kept.stdout == "<think>\nWhy? Because.\n</think>\n\n\nIt is 42.\n", repr(kept.stdout)
