"""Trust, round two (issue 22), for what a server sends: server-sent events as the WHATWG HTML
standard defines them, answers of the wrong JSON shape, keep-alive comments, figures that cannot
be true, escape sequences, and our own credentials echoed back. The stub (tests/stub_server.py)
plays each hostile server; the CLI runs in-process with CliRunner."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from llmrun.cli.app import app
from llmrun.runners.history import History
from llmrun.runners.remote import parse_endpoint, redact_url

from .stub_server import ENDLESS, MALFORMED, TRICKLE, RawJSON, stub_server
from .test_truth_stream import sse_events

ESC_OR_CONTROL = [chr(c) for c in (*range(0x00, 0x09), *range(0x0B, 0x20), *range(0x7F, 0xA0))]


def test_sse_is_parsed_as_the_whatwg_standard_says() -> None:
    def events(*pieces: bytes) -> list[str]:
        return [e for e in sse_events(pieces) if e is not None]

    # The standard's own examples (HTML 9.2.6): comments, multi-line data, a space kept.
    assert events(
        b": test stream\n\ndata: first event\nid: 1\n\ndata:second event\nid\n\n"
        b"data:  third event\n\n"
    ) == ["first event", "second event", " third event"]
    assert events(b"data: YHOO\ndata: +2\ndata: 10\n\n") == ["YHOO\n+2\n10"]
    # Its example of empty data: "", then one newline; the unterminated last block is kept here
    # (the standard discards it), since servers that leave out the last blank line exist.
    assert events(b"data\n\ndata\ndata\n\ndata:") == ["", "\n", ""]
    # Line ends of every kind, split anywhere, a BOM once, UTF-8 split across reads.
    assert events(b"\xef\xbb", b"\xbfdata: a\r", b"\n\r\ndata: \xc3", b"\xa9\r\rdata: b") == [
        "a",
        "\u00e9",
        "b",
    ]
    assert events(b"event: x\nretry: 5\nfoo: bar\ndata: c\n\n") == ["c"]


def test_a_stream_in_the_whatwg_forms_servers_rarely_use(cli: CliRunner) -> None:
    with stub_server() as url:
        result = cli.invoke(app, ["run", "--endpoint", url, "-m", "whatwg", "hi"])
    assert result.exit_code == 0, result.output
    assert result.stdout == "Hello, world\n"


@pytest.mark.parametrize(
    ("answer", "said"),
    [
        (["stub"], "an array holding a string"),
        ("stub", "a string"),
        ({"data": {"id": "x"}}, "an object whose 'data' is an object"),
        (7, "a number"),
    ],
)
def test_a_models_answer_of_the_wrong_shape_is_one_line(
    answer: object, said: str, cli: CliRunner
) -> None:
    """Named in JSON's words, as the server's own refusals of a request are."""
    with stub_server(models_answer=answer) as url:
        result = cli.invoke(app, ["run", "--endpoint", url, "hi"])
    assert result.exit_code == 1
    assert result.stderr.count("\n") == 1
    assert f"/v1/models answered with {said}, not OpenAI's" in result.stderr
    assert "internal error" not in result.stderr


def test_a_model_id_past_256_characters_is_not_taken(cli: CliRunner, tmp_path: Path) -> None:
    """A /v1/models id is shown in every summary and stored in every record: one of 5 MB was
    printed whole on stderr and in the stats JSON. Past 256 characters it is refused in one
    line (the server's other models can still be named with -m); 256 is a name."""
    long_id, sane = "x" * 5_000_000, "o/" + "n" * 254
    stats_file = tmp_path / "s.jsonl"
    with stub_server(models_answer={"data": [{"id": long_id}, {"id": "stub"}]}) as url:
        refused = cli.invoke(app, ["run", "--endpoint", url, "--stats-file", str(stats_file), "hi"])
        named = cli.invoke(app, ["run", "--endpoint", url, "-m", "stub", "--stats", "json", "hi"])
    with stub_server(models_answer={"data": [{"id": sane}]}) as url:
        taken = cli.invoke(app, ["run", "--endpoint", url, "--stats", "json", "hi"])
    assert refused.exit_code == 1 and refused.stderr.count("\n") == 1
    assert len(refused.stderr) < 400 and not stats_file.exists()
    assert "a first model id of 5,000,000 characters, not a name (at most 256" in refused.stderr
    assert named.exit_code == 0, named.output
    assert json.loads(named.stderr.splitlines()[-1])["server_model"] == "stub"
    assert taken.exit_code == 0, taken.output
    assert json.loads(taken.stderr.splitlines()[-1])["server_model"] == sane


def test_a_servers_long_words_are_cut_with_a_mark() -> None:
    """Its error mid-stream was shown whole (a 1 MB message, 1 MB on stderr); its error bodies
    were cut at 300 characters without a mark."""
    from llmrun.runners.remote import _parse, server_words

    said = _parse({"error": {"message": "no " * 500_000}}).error
    assert said is not None and len(said) < 400
    assert said.endswith("no no... (1,499,999 characters)")
    assert server_words("a\n b\tc") == "a b c"


def test_a_models_answer_that_never_ends_is_read_no_further_than_16_mib(cli: CliRunner) -> None:
    with stub_server(get_answers={"/v1/models": ENDLESS}) as url:
        result = cli.invoke(app, ["run", "--endpoint", url, "hi"])
    assert result.exit_code == 1
    assert (
        result.stderr.count("\n") == 1 and "/v1/models answered with over 16 MiB" in result.stderr
    )


def test_answers_that_trickle_in_are_given_up_whole_not_per_read(
    cli: CliRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """httpx's timeout is per read: a byte every 0.2 s never tripped it, so a /props or a
    /v1/models that trickled held run until 16 MiB came (weeks)."""
    import llmrun.runners.remote as remote

    monkeypatch.setattr(remote, "SIDE_REQUEST_S", 1.0)
    with stub_server(get_answers={"/props": TRICKLE}) as url:
        props = cli.invoke(app, ["run", "--endpoint", url, "hi"])
    assert props.exit_code == 0, props.output  # the context size is left unknown
    with stub_server(get_answers={"/v1/models": TRICKLE}) as url:
        models = cli.invoke(app, ["run", "--endpoint", url, "--timeout", "1", "hi"])
    assert models.exit_code == 1
    assert ": no answer within 1 s (raise --timeout" in models.stderr


@pytest.mark.parametrize(
    "props",
    [ENDLESS, b"[" * 100_000 + b"]" * 100_000, b'{"default_generation_settings": 7}', b"\xff"],
    ids=["endless", "deep", "wrong-shape", "not-utf8"],
)
def test_a_props_answer_of_any_kind_only_leaves_the_context_size_unknown(
    props: bytes, cli: CliRunner
) -> None:
    """llama.cpp's /props is asked for the context size alone, as a courtesy: whatever comes
    back, however long or deep, the run goes on without it."""
    with stub_server(get_answers={"/props": props}) as url:
        result = cli.invoke(app, ["run", "--endpoint", url, "hi"])
    assert result.exit_code == 0, result.output
    assert result.stdout == "Hello from the stub server.\n"


@pytest.mark.parametrize("columns", ["40", "80"])
def test_a_piped_chats_messages_are_whole_lines(
    columns: str, cli: CliRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """rich would break a message at its idea of the width (80 on a pipe): a log or a script
    reading stderr gets each message as one line, as from run."""
    monkeypatch.setenv("COLUMNS", columns)
    with stub_server() as url:
        result = cli.invoke(
            app, ["chat", "--endpoint", url, "-m", "cut"], input="hello\n/set nowordwrap\n"
        )
    assert result.exit_code == 1
    lines = result.stderr.splitlines()
    assert lines[0].startswith("llmrun: error: ") and lines[0].endswith("marked incomplete)")
    assert lines[1].startswith("/set wordwrap: ") and lines[1].endswith("stays as written")


@pytest.mark.parametrize("model", sorted(MALFORMED))
def test_a_stream_event_of_the_wrong_shape_is_named(model: str, cli: CliRunner) -> None:
    """OpenAI's chunk holds a list of choice objects, each content a string or null: an event
    of another shape is refused as `data: 5` is, not read as an empty reply that stopped."""
    with stub_server() as url:
        result = cli.invoke(app, ["run", "--endpoint", url, "-m", model, "hi"])
    assert result.exit_code == 1
    assert result.stdout == ""
    assert "malformed stream event: " in result.stderr and "[stop]" not in result.stderr


def test_content_in_parts_is_its_text_and_a_wrong_shape_is_named_briefly() -> None:
    """Some servers stream content as a list of parts (Mistral's, thinking parts beside): the
    text parts are the text. A shape nested 900 deep was spelt out level by level (52 KB)."""
    from llmrun.runners.remote import _parse

    parts = [{"type": "thinking", "thinking": [{"type": "text", "text": "hm"}]}]
    parts += [{"type": "text", "text": "Hi"}, {"type": "text", "text": "!"}]
    assert _parse({"choices": [{"delta": {"content": parts}}]}).text == "Hi!"
    assert _parse({"choices": [{"delta": {"content": []}}]}).text == ""
    deep: list[object] = []
    for _ in range(900):
        deep = [deep]
    said = _parse({"choices": deep}).error
    assert said == "malformed stream event: choices is an array holding an array"


@pytest.mark.parametrize("command", [["run", "hi"], ["bench", "serve", "--num-prompts", "1"]])
def test_a_web_page_in_place_of_the_api_is_named(command: list[str], cli: CliRunner) -> None:
    """Named before any text is read, and on whole lines (bench serve's failed-request line was
    broken at 80 columns on a pipe)."""
    with stub_server() as url:
        result = cli.invoke(app, [*command, "--endpoint", url, "-m", "html"])
    assert result.exit_code == 1
    said = [line for line in result.stderr.splitlines() if "web page" in line]
    assert said and all(line.endswith("the server's OpenAI-compatible API?)") for line in said)


def test_a_line_console_breaks_no_text_off_a_terminal() -> None:
    import io

    from rich.table import Table
    from rich.text import Text

    from llmrun.cli.errors import LineConsole

    message = "word " * 40
    pipe = io.StringIO()
    # rich calls a pipe a terminal where FORCE_COLOR is set (CI): the text stays whole there too
    console = LineConsole(file=pipe, width=80, force_terminal=True)
    console.print(message.strip(), style="yellow")
    console.print(Text(message.strip()))
    table = Table("a", "b")
    table.add_row(message, message)
    console.print(table)
    lines = Text.from_ansi(pipe.getvalue()).plain.splitlines()
    assert lines[:2] == [message.strip()] * 2
    assert max(len(line) for line in lines[2:]) <= 80  # a table keeps the width

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal = Tty()
    LineConsole(file=terminal, width=80, force_terminal=True).print(message.strip())
    assert len(Text.from_ansi(terminal.getvalue()).plain.splitlines()) == 3  # a terminal wraps


def test_keep_alive_comments_do_not_hold_off_the_timeout(cli: CliRunner) -> None:
    with stub_server() as url:
        result = cli.invoke(
            app, ["run", "--endpoint", url, "-m", "keepalive", "--timeout", "1", "hi"]
        )
    assert result.exit_code == 1
    assert result.stdout == "Hi\n"  # the text so far is kept
    assert "no reply for 1 s (the server sent only keep-alive comments)" in result.stderr


def test_a_model_id_that_echoes_the_key_is_shown_and_stored_scrubbed(
    tmp_path: Path, cli: CliRunner
) -> None:
    key = "SEKRITKEY123"  # a server that lists the Authorization header it got as its model
    stats_file = tmp_path / "s.jsonl"
    listing = {"data": [{"id": f"model-{key}", "object": "model"}]}
    with stub_server(api_key=key, models_answer=listing) as url:
        keyed = ["--endpoint", url, "--api-key", key]
        runs = [
            cli.invoke(app, ["run", *keyed, "--stats-file", str(stats_file), *args, "hi"])
            for args in ([], ["--json"], ["--stats", "json"])
        ]
        bench = cli.invoke(
            app,
            [
                *("bench", "serve", *keyed, "--num-prompts", "2", "--max-concurrency", "1"),
                *("--input-len", "4", "--output-len", "4", "-o", "json"),
            ],
        )
    for result in [*runs, bench]:
        assert result.exit_code == 0, result.output
        assert key not in result.stdout + result.stderr
    assert json.loads(runs[1].stdout)["stats"]["server_model"] == "model-***"
    assert "model-***" in bench.stderr  # the header line names the model, scrubbed
    assert "model-***" in stats_file.read_text() and key not in stats_file.read_text()
    with History() as h:
        stored = json.dumps(h.runs())
    assert "model-***" in stored and key not in stored


def test_a_servers_escape_sequences_never_reach_the_terminal(
    cli: CliRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    import llmrun.cli.session as session

    monkeypatch.setattr(session, "_isatty", lambda stream: True)  # stdout is a terminal
    with stub_server() as url:
        result = cli.invoke(app, ["chat", "--endpoint", url, "-m", "escapes"], input="Hi\n")
        piped = cli.invoke(app, ["run", "--endpoint", url, "-m", "escapes", "--json", "hi"])
    assert result.exit_code == 0, result.output
    assert "Hi" in result.stdout and "there[2J!" in result.stdout
    assert not [
        c
        for c in result.stdout.replace(session.DIM, "").replace(session.UNDIM, "")
        if c in ESC_OR_CONTROL
    ], repr(result.stdout)
    assert "\x1b[2J" in json.loads(piped.stdout)["text"]  # data for a program stays as sent


def test_bench_serve_shows_no_escape_sequence_of_the_servers_on_a_terminal(
    llmrun_env: dict[str, str],
) -> None:
    """A model name and an HTTP 500's message holding a window title (OSC) and a colour (CSI)
    reached the terminal raw: in the `server ... model ...` header, the `failed requests:`
    line, and the csv rows on a stdout that is a terminal. A pipe still gets them as sent."""
    import subprocess

    import pexpect

    from .conftest import HANG_S, which_llmrun
    from .stub_server import Handler, _Server

    hostile = "\x1b]0;PWNED\x07\x1b[31mRED\x1b[0m"

    class Failing(Handler):
        models_answer: Any = {"data": [{"id": hostile + "model"}]}  # noqa: RUF012

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self._json(500, {"error": {"message": "boom " + hostile}})

    server = _Server(("127.0.0.1", 0), Failing)
    threading.Thread(target=server.serve_forever, args=(0.01,), daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    args = ["bench", "serve", "--endpoint", url, "--num-prompts", "2", "--warmup", "0"]
    args += ["--max-concurrency", "1", "--input-len", "4", "--output-len", "4", "-o", "csv"]
    try:
        child = pexpect.spawn(
            which_llmrun(), args, env=llmrun_env, encoding="utf-8", timeout=HANG_S
        )
        child.expect(pexpect.EOF)
        child.close()
        piped = subprocess.run(
            [which_llmrun(), *args], env=llmrun_env, capture_output=True, text=True, timeout=HANG_S
        )
    finally:
        server.shutdown()
        server.server_close()
    shown = child.before
    assert child.exitstatus == 1, shown  # every request failed
    assert "model RED" in shown and "failed requests:" in shown and "boom RED" in shown
    assert "serve c1" in shown  # the csv row
    for raw in ("\x1b]", "\x07", "\x1b[31m"):
        assert raw not in shown, repr(shown)
    assert hostile in piped.stdout  # data for a program stays as sent


PROXY_VARIABLES = [f"{s}_proxy" for s in ("http", "https", "all", "no")]


@pytest.fixture
def no_proxy_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """No proxy variable of the machine's in the way (lower or upper case)."""
    for name in PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)


@pytest.mark.parametrize("command", [["run", "hi"], ["bench", "serve", "--num-prompts", "1"]])
@pytest.mark.parametrize(
    ("variable", "value", "says"),
    [
        ("HTTPS_PROXY", "socks5://127.0.0.1:1", "a SOCKS proxy, which needs the socksio package"),
        ("HTTP_PROXY", "::::", "not a URL httpx can read (Invalid port"),
        ("ALL_PROXY", "socks4://x", "a proxy scheme httpx cannot use (it takes http, https"),
        ("HTTP_PROXY", "http://\x1b[31mevil:1", "not a URL httpx can read"),
        ("https_proxy", "http://u:proxypw@[::1", "not a URL httpx can read"),
        ("SSL_CERT_FILE", "/dev/zero", "not a regular file of CA certificates"),
        ("SSL_CERT_FILE", "FIFO", "not a regular file of CA certificates"),
        ("SSL_CERT_FILE", "NOT_PEM", "no CA certificates llmrun can use"),
        ("SSL_CERT_FILE", "/nonexistent/ca.pem", "No such file or directory"),
    ],
)
def test_proxy_and_certificate_variables_httpx_cannot_use_are_named(
    variable: str,
    value: str,
    says: str,
    command: list[str],
    cli: CliRunner,
    tmp_path: Path,
    no_proxy_set: None,
) -> None:
    """Each was `internal error: ImportError/InvalidURL/ValueError` (an escape sequence in the
    value shown raw), an SSLError blamed on "writing the output", or, for a FIFO, a silent
    hang: now one line naming the variable, its value made safe, exit 1."""
    import importlib.util
    import os

    if "socks5" in value and importlib.util.find_spec("socksio") is not None:
        pytest.skip("socksio is installed: a SOCKS proxy is one httpx can use")
    if value == "FIFO":
        value = str(tmp_path / "fifo")
        os.mkfifo(value)
    if value == "NOT_PEM":
        value = str(tmp_path / "ca.pem")
        Path(value).write_text("no certificate here\n")
    with stub_server() as url:
        result = cli.invoke(
            app, [*command[:2], "--endpoint", url, *command[2:]], env={variable: value}
        )
    assert result.exit_code == 1, result.output
    (line,) = result.stderr.strip().splitlines()
    shown = value.replace("\x1b[31m", "").replace("u:proxypw@", "***@")
    assert line.startswith(f"llmrun: error: {variable}='{shown}"), line
    assert says in line, line
    assert "internal error" not in line and "\x1b" not in line and "proxypw" not in line


def test_a_dead_proxy_is_named_not_the_server(
    cli: CliRunner, monkeypatch: pytest.MonkeyPatch, no_proxy_set: None
) -> None:
    """HTTP_PROXY at a port nothing listens on was reported as the server refusing the
    connection; the proxy's password is not shown, and NO_PROXY still reaches the server."""
    from .conftest import free_port

    proxy = f"http://alice:proxypw@127.0.0.1:{free_port()}"
    with stub_server() as url:
        dead = cli.invoke(app, ["run", "--endpoint", url, "hi"], env={"http_proxy": proxy})
        monkeypatch.setenv("NO_PROXY", "127.0.0.1")
        direct = cli.invoke(app, ["run", "--endpoint", url, "hi"], env={"http_proxy": proxy})
    assert dead.exit_code == 1
    (line,) = dead.stderr.strip().splitlines()
    assert "cannot connect to the proxy http://127.0.0.1:" in line, line
    assert "(http_proxy) (connection refused) (check http_proxy" in line, line
    assert "proxypw" not in dead.output and "server is running" not in line
    assert direct.exit_code == 0, direct.output


def test_escape_sequences_in_a_file_name_are_not_shown(tmp_path: Path, cli: CliRunner) -> None:
    name = tmp_path / "evil\x1b]0;pwned\x07\x1b[2J.gguf"
    for args in (
        ["run", "-m", str(name), "hi"],
        ["run", "-f", str(name), "hi"],
        ["run", "--jsonl", str(name)],
    ):
        result = cli.invoke(app, args)
        assert result.exit_code == 1
        assert "evil" in result.stderr and not set(result.stderr) & set(ESC_OR_CONTROL[:-1]), repr(
            result.stderr
        )


def test_a_servers_impossible_figures_are_left_out_and_named(cli: CliRunner) -> None:
    with stub_server() as url:
        result = cli.invoke(app, ["run", "--endpoint", url, "-m", "liar", "--stats", "json", "hi"])
        text = cli.invoke(app, ["run", "--endpoint", url, "-m", "liar", "hi"])
    assert result.exit_code == 0, result.output
    stats = json.loads(result.stderr.splitlines()[-1])  # after the thinking (on stderr)
    assert stats["thinking_tokens"] <= stats["output_tokens"] == 2
    assert stats["server_prompt_ms"] is None and stats["server_predicted_ms"] is None
    notes = " ".join(stats["server_implausible"])
    assert "reasoning_tokens 500" in notes and "prompt_ms" in notes and "decode of 2" in notes
    assert "e+2" not in text.stderr and "warning  the server's figures" in text.stderr


def test_counts_no_request_could_have_are_left_out_and_named(cli: CliRunner) -> None:
    """A count is a whole number of 0 to what the request could hold: the prompt's UTF-8 bytes
    and room for a template, twice the tokens asked for. Past that it was shown and stored
    as a measurement (10^30 prompt tokens; a 400-digit number crashed the float check)."""
    figures = {
        "usage": {"prompt_tokens": 10**30, "completion_tokens": -5},
        "timings": {"prompt_n": 10**400, "prompt_ms": 1.0, "cache_n": 2.5, "predicted_n": 10**9},
    }
    with stub_server(figures=figures) as url:
        result = cli.invoke(app, ["run", "--endpoint", url, "--stats", "json", "hi"])
        text = cli.invoke(app, ["run", "--endpoint", url, "hi"])
    assert result.exit_code == 0, result.output
    stats = json.loads(result.stderr.splitlines()[-1])
    assert stats["prompt_tokens"] == 0 and stats["output_tokens"] == 6  # the chunks
    assert stats["server_prompt_n"] is stats["server_cache_n"] is None
    assert stats["server_predicted_n"] is None
    notes = " ".join(stats["server_implausible"])
    for said in (
        "prompt_tokens 100000000000... (31 digits) is no count of 0 to 8,194",
        "completion_tokens -5 is no count",
        "prompt_n 100000000000... (401 digits)",
        "cache_n 2.5 is no count",
        "predicted_n 1000000000 is no count of 0 to 1,040",
    ):
        assert said in notes, notes
    assert "0000000000000000" not in text.stderr and "not reported by the server" in text.stderr


def test_a_number_too_long_for_pythons_int_is_no_count_not_a_malformed_event(
    cli: CliRunner,
) -> None:
    """RFC 8259 sets no limit on a number's digits, but Python's int reads at most 4,300 of
    them (ValueError): a usage count of 5,000 digits made the last event "malformed", and the
    run an incomplete one. It is valid JSON: the count is one no request could have, left
    out and named as the others are."""
    huge = "9" * 5000
    figures = {
        "usage": {"prompt_tokens": RawJSON(huge), "completion_tokens": 6},
        "timings": {"prompt_n": RawJSON("-" + huge), "prompt_ms": RawJSON(huge)},
    }
    with stub_server(figures=figures) as url:
        result = cli.invoke(app, ["run", "--endpoint", url, "--stats", "json", "hi"])
    assert result.exit_code == 0, result.output
    assert "malformed" not in result.stderr
    stats = json.loads(result.stderr.splitlines()[-1])
    assert stats["output_tokens"] == 6 and stats["prompt_tokens"] == 0
    assert stats.get("server_prompt_n") is stats.get("server_prompt_ms") is None
    notes = " ".join(stats["server_implausible"])
    assert "prompt_tokens 999999999999... (5,000 digits) is no count" in notes, notes
    assert "prompt_n -99999999999... (5,000 digits) is no count" in notes, notes  # no sign
    listing = b'{"data": [{"id": "stub", "created": ' + huge.encode() + b"}]}"
    with stub_server(get_answers={"/v1/models": listing}) as url:
        result = cli.invoke(app, ["run", "--endpoint", url, "hi"])
    assert result.exit_code == 0, result.output  # it was "/v1/models did not answer with JSON"


def test_the_note_counts_digits_not_the_minus_sign() -> None:
    """`-10**30` has 31 digits: the note said 32, as it said 5,001 for 5,000."""
    from llmrun.runners.remote import _checked, server_json

    notes: list[str] = []
    for value in (-(10**30), 10**30, server_json("-" + "9" * 5000)):
        assert _checked("prompt_n", value, 100, notes) is None
    assert [note.split("... ")[1] for note in notes] == [
        "(31 digits) is no count of 0 to 100",
        "(31 digits) is no count of 0 to 100",
        "(5,000 digits) is no count of 0 to 100",
    ]


def test_every_reader_of_server_json_takes_any_number_of_digits() -> None:
    from llmrun.runners.remote import LongInteger, _count, _number, server_json

    read = server_json(b'{"a": [' + b"1" * 4301 + b", -" + b"2" * 5000 + b", 7, 2.5]}")
    long, negative, seven, half = read["a"]
    assert isinstance(long, LongInteger) and long.text == "1" * 4301
    assert isinstance(negative, LongInteger) and negative.text == "-" + "2" * 5000
    assert _number(long) is _count(long) is _number(negative) is None
    assert (seven, half) == (7, 2.5) and type(seven) is int
    with pytest.raises(ValueError):
        server_json("{not json")


def test_a_long_integer_reads_as_its_text_in_words_copies_and_pickles() -> None:
    """A LongInteger is a float at infinity: `str` gave "inf", so a server whose error message
    was a number of 5,000 digits was reported as `HTTP 500 from ...: inf`; and deepcopy or
    pickle called its constructor with the float, an AttributeError."""
    import copy
    import pickle

    import httpx2 as httpx

    from llmrun.runners.remote import LongInteger, _parse, _server_message, server_json

    digits = "7" * 5000
    cut = f"{'7' * 300}... (5,000 characters)"
    long = server_json(digits)
    assert isinstance(long, LongInteger)
    assert str(long) == repr(long) == f"{long}" == cut
    assert str([long]) == f"[{cut}]"
    for again in (copy.deepcopy(long), pickle.loads(pickle.dumps(long)), copy.copy(long)):
        assert isinstance(again, LongInteger) and again.text == digits and again == long
    body = b'{"error": {"message": ' + digits.encode() + b"}}"
    assert _server_message(httpx.Response(500, content=body)) == cut
    error = _parse(server_json(body)).error
    assert error == f"the server reported an error mid-stream: {cut}", error
    negative = server_json("-" + digits)
    assert str(negative) == f"-{'7' * 299}... (5,001 characters)"


def test_server_json_hooks_integers_only_once_one_proved_too_long(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A parse_int hook on every integer made a 16 MiB /tokenize reply about 3 times slower
    to read than json.loads (measured by hand; no test times it): the hook is used only once
    an integer proved too long for Python's int."""
    from llmrun.runners import remote

    seen: list[str] = []
    hook = remote._integer

    def counted(text: str) -> Any:
        seen.append(text)
        return hook(text)

    monkeypatch.setattr(remote, "_integer", counted)
    assert remote.server_json(b"[" + b",".join([b"123456"] * 1000) + b"]")[-1] == 123456
    assert seen == []  # json.loads alone read it
    long = "9" * 5000
    assert str(remote.server_json(f'{{"n": {long}, "m": 7}}')["n"]).startswith("999")
    assert len(seen) == 2  # read again with the hook: both integers


@pytest.mark.parametrize(
    "answer",
    [
        b'{"tokens": -1000}',
        b'{"tokens": 1' + b"0" * 30 + b"}",
        b'{"tokens": 5.5}',
        b'{"tokens": [0' + b",0" * 99 + b"]}",
    ],
    ids=["negative", "huge", "fraction", "more-than-bytes"],
)
def test_a_tokenizers_impossible_count_is_no_count(answer: bytes, cli: CliRunner) -> None:
    """`bench serve` counts its prompts with the server's /tokenize when the stream's usage has
    no prompt_tokens: -1000 made -2000 input tokens and a negative throughput, 10^30 made
    2e30, both stored. Such a count is no count: the words are counted, as for a server
    without a tokenizer."""
    args = ("--num-prompts", "2", "--concurrency", "1", "--input-len", "8", "--output-len", "4")
    with stub_server(post_answers={"/tokenize": answer}) as url:
        result = cli.invoke(
            app, ["bench", "serve", "--endpoint", url, "-m", "nousage", *args, "-o", "json"]
        )
    with stub_server(post_answers={"/tokenize": b'{"tokens": 7}'}) as url:
        sane = cli.invoke(
            app, ["bench", "serve", "--endpoint", url, "-m", "nousage", *args, "-o", "json"]
        )
    assert result.exit_code == sane.exit_code == 0, result.output + sane.output
    (row,) = json.loads(result.stdout)
    assert row["total_input_tokens"] == 16  # 8 words each
    assert row["total_token_throughput"] > row["output_throughput"] > 0
    assert json.loads(sane.stdout)[0]["total_input_tokens"] == 14  # a count it could give
    with History() as h:
        stored = json.dumps(h.runs())
    assert "-2000" not in stored and "e+30" not in stored


@pytest.mark.parametrize("query", ["api_key", "key", "token", "access_token", "sig", "X-Api-Key"])
def test_a_key_in_the_url_query_is_never_shown(query: str, tmp_path: Path, cli: CliRunner) -> None:
    secret = "s3cr3tvalue"
    stats_file = tmp_path / "s.jsonl"
    with stub_server() as url:
        endpoint = f"{url}/v1?{query}={secret}&api-version=2024"
        shown = [
            cli.invoke(
                app, ["run", "--endpoint", endpoint, "--stats-file", str(stats_file), *args, "hi"]
            )
            for args in ([], ["--json"], ["--stats", "json"], ["-m", "boom"], ["-m", "echo"])
        ]
        bench = cli.invoke(
            app,
            [
                "bench",
                "--endpoint",
                endpoint,
                "--num-prompts",
                "2",
                "--input-len",
                "4",
                "--output-len",
                "4",
                "--warmup",
                "0",
                "-o",
                "json",
            ],
        )
    assert shown[0].exit_code == 0, shown[0].output
    assert "api-version=2024" in shown[2].stderr and f"{query}=***" in shown[2].stderr
    for result in [*shown, bench]:
        assert secret not in result.stdout + result.stderr
    assert secret not in stats_file.read_text()
    with History() as h:
        assert secret not in json.dumps(h.runs())


def test_echoed_credentials_come_back_redacted(cli: CliRunner) -> None:
    import base64

    password = "hunter2pass"
    basic = base64.b64encode(f"alice:{password}".encode()).decode()
    with stub_server(basic=f"alice:{password}") as url:
        endpoint = url.replace("http://", f"http://alice:{password}@")
        results = [
            cli.invoke(app, ["run", "--endpoint", endpoint, "-m", m, "--json", "hi"])
            for m in ("echo", "echo401")
        ]
    assert "you sent Basic ***" in json.loads(results[0].stdout)["text"]
    assert results[1].exit_code == 1 and "Authorization: Basic ***" in results[1].stderr
    for result in results:
        assert password not in result.output and basic not in result.output
        assert basic.rstrip("=") not in result.output


@pytest.mark.parametrize(
    "key", ["sk-SECRET\r\nX-Injected: 1", "sk-SECRET\u043a\u043b", "sk-SECRET ", "\tsk-SECRET"]
)
@pytest.mark.parametrize("command", ["run", "chat", "bench serve"])
def test_an_api_key_no_header_can_carry_is_refused_without_showing_it(
    key: str, command: str, cli: CliRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """h11 refuses such a header with a message that shows its bytes: the key is refused
    before any request, as a usage error, from the option or the environment alike."""
    args = {"run": ["hi"], "chat": [], "bench serve": ["--num-prompts", "1", "--warmup", "0"]}
    line = [*command.split(), "--endpoint"]
    with stub_server() as url:
        typed = cli.invoke(app, [*line, url, "--api-key", key, *args[command]], input="hi\n")
        monkeypatch.setenv("LLMRUN_API_KEY", key)
        from_env = cli.invoke(app, [*line, url, *args[command]], input="hi\n")
    for result in (typed, from_env):
        assert result.exit_code == 2, result.output
        assert "SECRET" not in result.output and "internal error" not in result.output
        assert result.stderr.count("\n") == 1 and "the API key (--api-key, LLMRUN_API_KEY)" in (
            result.stderr
        )


def test_secrets_are_taken_out_as_python_escapes_them_too() -> None:
    from llmrun.runners.remote import Connection

    conn = Connection("http://127.0.0.1:9/v1?token=t\u00f6k\x7fn")
    for shown in ("t\u00f6k\\x7fn", "t\\xc3\\xb6k\\x7fn"):
        assert conn.scrub(f"Illegal header value b'{shown}'") == "Illegal header value b'***'"


def test_a_port_past_65535_is_named(cli: CliRunner) -> None:
    result = cli.invoke(app, ["run", "--endpoint", "http://127.0.0.1:99999/v1", "hi"])
    assert result.exit_code == 2  # a value --endpoint cannot read: a usage error
    assert result.stderr.startswith("llmrun: error: a port past 65535: 'http://127.0.0.1:99999/v1'")


def test_redaction_of_free_text() -> None:
    text = redact_url("GET http://u:p@h/v1?api_key=K&model=m: 401 {'authorization': 'Bearer T'}")
    assert text == "GET http://***@h/v1?api_key=***&model=m: 401 {'authorization': 'Bearer ***'}"
    ep = parse_endpoint("https://h/v1/?key=K&x=1")
    assert ep.api == "https://h/v1" and ep.params == (("key", "K"), ("x", "1"))
    assert ep.shown == "https://h/v1?key=***&x=1" and ep.secrets == ("K",)


def test_a_reply_not_streamed_and_a_redirect(cli: CliRunner) -> None:
    with stub_server() as url:
        whole = cli.invoke(app, ["run", "--endpoint", url, "-m", "whole", "--stats", "json", "hi"])
        moved = cli.invoke(app, ["run", "--endpoint", url, "-m", "moved", "hi"])
    assert whole.exit_code == 0, whole.output
    assert whole.stdout == "All at once.\n"
    stats = json.loads(whole.stderr.splitlines()[-1])
    assert stats["finish_reason"] == "length" and stats["output_tokens"] == 4
    assert moved.exit_code == 1 and moved.stderr.count("\n") == 1
    assert "redirected to http://elsewhere.example/v1/chat/completions?key=***" in moved.stderr


def test_a_server_that_ignores_max_tokens_is_stopped(cli: CliRunner) -> None:
    with stub_server() as url:
        result = cli.invoke(app, ["run", "--endpoint", url, "-m", "endless", "-n", "5", "hi"])
    assert result.exit_code == 1
    assert result.stdout.count("more") == 2 * 5 + 17
    assert "sent over twice the 5 tokens asked for" in result.stderr
