"""run, chat and bench against OpenAI-compatible servers: the real llama-cpp-python server with
the embedded model, and a loopback stub for the faults a real server rarely shows on demand."""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

import pexpect
import pytest
from typer.testing import CliRunner

from llmrun.cli.app import app

from .conftest import HANG_S, free_port, llama_server, served_completions, which_llmrun
from .stub_server import WORDS, bench_against_stub, stub_server


def one_line_error(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.startswith("llmrun: error:")]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    return lines[0]


# ---- the real server ---------------------------------------------------------------------


def test_run_measures_a_real_server_from_the_stream(
    cli: CliRunner, home: Path, server: str
) -> None:
    result = cli.invoke(
        app,
        ["run", "Name a color.", "--endpoint", server, "-n", "8", "--temp", "0", "--stats", "json"],
    )
    assert result.exit_code == 0, result.stderr
    assert result.stdout.strip()
    stats = json.loads(result.stderr.strip().splitlines()[-1])
    assert stats["endpoint"] == server and stats["finish_reason"] == "length"
    assert stats["output_tokens"] == 8 and len(stats["itl_ms"]) == 7
    assert stats["ttft_s"] > 0 and stats["output_tps"] > 0


def test_piped_chat_against_a_real_server(cli: CliRunner, home: Path, server: str) -> None:
    result = cli.invoke(
        app,
        ["chat", "--endpoint", server, "-n", "6", "--temp", "0"],
        input="Hello there.\nWhat did I say?\n",
    )
    assert result.exit_code == 0, result.stderr
    assert len(result.stdout.strip().splitlines()) >= 2


def test_serving_benchmark_and_interference_against_a_real_server(
    cli: CliRunner, home: Path, server: str
) -> None:
    result = cli.invoke(
        app,
        [
            "bench",
            "serve",
            "--endpoint",
            server,
            "--concurrency",
            "1,2",
            "--num-prompts",
            "3",
            "--input-len",
            "16",
            "--output-len",
            "4",
            "--slo",
            "ttft:60000,tpot:60000",
            "-o",
            "json",
        ],
    )
    assert result.exit_code == 0, result.stderr
    serve = json.loads(result.stdout)
    assert [r["concurrency"] for r in serve] == [1, 2]
    for r in serve:
        assert (r["completed"], r["failed"]) == (3, 0)
        for metric in ("ttft", "tpot", "itl", "e2el"):
            for stat in ("mean", "median", "std", "p50", "p90", "p99"):
                assert r[f"{stat}_{metric}_ms"] is not None, f"{stat}_{metric}_ms"
        assert r["request_throughput"] > 0 and r["output_throughput"] > 0
        assert r["goodput"] == r["request_throughput"]  # generous SLOs: every request counts
        assert r["mean_ttft_ms"] < r["mean_e2el_ms"]
    result = cli.invoke(
        app,
        [
            "bench",
            "interference",
            "--endpoint",
            server,
            "--input-len",
            "16",
            "--output-len",
            "4",
            "--prompt-len",
            "32",
            "--rate",
            "4",
            "-o",
            "json",
        ],
    )
    assert result.exit_code == 0, result.stderr
    (inter,) = json.loads(result.stdout)
    assert inter["test"] == "interference pp32 r4"
    assert inter["itl_p50_alone_ms"] > 0 and inter["itl_p50_loaded_ms"] > 0
    assert inter["itl_p50_ratio"] > 0 and inter["background_requests"] >= 1
    db = sqlite3.connect(home / "data" / "history.sqlite")
    assert db.execute("SELECT kind FROM runs").fetchall() == [("serving",)]


def test_server_killed_mid_stream_keeps_the_text(
    llmrun_env: dict[str, str], model_path: str, tmp_path: Path
) -> None:
    with llama_server(model_path) as (url, proc):
        out = tmp_path / "out.txt"
        cmd = (
            f"{which_llmrun()} run 'Write a long story about the sea.' --endpoint {url}"
            f" -n 1500 --temp 0 --no-dashboard > {out}"
        )
        child = pexpect.spawn("bash", ["-c", cmd], env=llmrun_env, encoding="utf-8", timeout=HANG_S)
        deadline = time.monotonic() + HANG_S
        while len(out.read_text() if out.exists() else "") < 40:  # wait for the text
            assert child.isalive() and time.monotonic() < deadline, "the server produced no text"
            child.expect([pexpect.TIMEOUT], timeout=0.1)
        kept = out.read_text()
        assert len(kept) >= 40, "the server produced no text"
        proc.kill()
        child.expect(pexpect.EOF)
        child.close()
    assert child.exitstatus == 1
    assert "the server closed the stream in the middle of the reply" in child.before
    assert "marked incomplete" in child.before and "Traceback" not in child.before
    assert out.read_text().startswith(kept)
    assert "[incomplete]" in child.before


# ---- faults, from the stub ---------------------------------------------------------------


def test_connection_refused(cli: CliRunner, home: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    for args in (["run", "hi"], ["chat"], ["bench", "serve", "--num-prompts", "1"]):
        result = cli.invoke(app, [*args, "--endpoint", url], input="hi\n")
        assert result.exit_code == 1, args
        line = one_line_error(result.stderr)
        assert f"{url}: cannot connect (connection refused)" in line


def test_stream_with_usage_and_server_timings(cli: CliRunner, home: Path) -> None:
    with stub_server() as url:
        result = cli.invoke(app, ["run", "hi", "--endpoint", url, "--no-dashboard"])
        as_json = cli.invoke(app, ["run", "hi", "--endpoint", url, "--stats", "json"])
    assert result.exit_code == 0, result.stderr
    assert result.stdout == "".join(WORDS) + "\n"
    err = " ".join(result.stderr.split())
    assert "prompt 12 tokens (8 new, 4 cached)" in err
    assert "server prefill 4.0 ms for 8 tokens (4 cached)" in err
    assert "decode 50.0 ms for 6 tokens · 100.0 tok/s" in err  # 5 decode steps in 50 ms
    assert "of the TTFT was network and queueing" in err
    stats = json.loads(as_json.stderr.strip().splitlines()[-1])
    assert stats["server_prompt_ms"] == 4.0 and stats["network_queue_ms"] is not None
    assert stats["output_tokens"] == 6 and stats["reused_tokens"] == 4


def test_raw_prompts_use_the_completions_route(cli: CliRunner, home: Path) -> None:
    with stub_server() as url:
        result = cli.invoke(app, ["run", "--raw", "Once upon", "--endpoint", url, "-q"])
    assert result.exit_code == 0, result.stderr
    assert result.stdout == "".join(WORDS) + "\n"


@pytest.mark.parametrize(
    ("model", "args", "expected"),
    [
        ("missing", [], "HTTP 404 from /v1/chat/completions: The model `missing` does not exist."),
        ("boom", [], "HTTP 500 from /v1/chat/completions: internal failure in the stub"),
        ("slow", ["--timeout", "0.5"], "no answer within 0.5 s (raise --timeout"),
    ],
)
def test_http_errors_and_timeouts_are_one_line(
    cli: CliRunner, home: Path, model: str, args: list[str], expected: str
) -> None:
    with stub_server() as url:
        start = time.monotonic()
        result = cli.invoke(app, ["run", "hi", "--endpoint", url, "-m", model, *args])
    assert time.monotonic() - start < 60  # no hang (the slow stub answers after 3 s anyway)
    assert result.exit_code == 1
    assert expected in one_line_error(result.stderr)


def test_api_key_is_sent_and_never_printed(cli: CliRunner, home: Path) -> None:
    with stub_server(api_key="right-key") as url:
        wrong = cli.invoke(app, ["run", "hi", "--endpoint", url, "--api-key", "wrong-key-123"])
        right = cli.invoke(
            app,
            ["run", "hi", "--endpoint", url, "--stats", "json"],
            env={"LLMRUN_API_KEY": "right-key"},
        )
    assert wrong.exit_code == 1
    assert "HTTP 401 from /v1/models: Invalid API key" in one_line_error(wrong.stderr)
    assert "wrong-key-123" not in wrong.stderr + wrong.stdout
    assert right.exit_code == 0, right.stderr
    assert "right-key" not in right.stderr + right.stdout


@pytest.mark.parametrize(
    ("model", "problem", "kept"),
    [
        ("malformed", "malformed stream line", "Hello from"),
        ("cut", "the stream ended before the server finished the reply", "Hello from the"),
    ],
)
def test_broken_streams_keep_the_text_and_are_marked(
    cli: CliRunner, home: Path, model: str, problem: str, kept: str
) -> None:
    with stub_server() as url:
        result = cli.invoke(app, ["run", "hi", "--endpoint", url, "-m", model, "--no-dashboard"])
    assert result.exit_code == 1
    assert result.stdout.startswith(kept)
    assert problem in one_line_error(result.stderr)
    assert "[incomplete]" in result.stderr


def test_serving_benchmark_counts_failed_requests(cli: CliRunner, home: Path) -> None:
    result = bench_against_stub(
        cli, "--concurrency", "2", "--num-prompts", "3", "--warmup", "0", model="boom"
    )
    # every request failed: the row is printed, not stored, and the run is an error (it was
    # exit 0 with a table of empty figures)
    assert result.exit_code == 1, result.stderr
    (row,) = json.loads(result.stdout)
    assert (row["completed"], row["failed"]) == (0, 3)
    assert any("internal failure in the stub" in e for e in row["errors"])
    assert "failed requests" in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("llmrun: error: every request failed, nothing was measured: "), last
    assert "internal failure in the stub" in last
    stored = cli.invoke(app, ["history"])
    assert "no bench runs stored yet" in stored.stdout.lower(), stored.output


def test_local_options_are_refused_with_an_endpoint(cli: CliRunner, home: Path) -> None:
    threads = (["-t", "4", "-tb", "2"], "-t/--threads, -tb/--threads-batch")
    batch = (["-b", "64", "--no-repack"], "-b/--batch, --repack/--no-repack")
    cases = [
        (["run", "hi"], threads),
        (["run", "hi"], batch),
        (["chat"], threads),
        (["chat"], batch),
        (["bench", "serve"], threads),
        (["bench", "interference"], threads),
    ]
    for command, (flags, expected) in cases:  # one rule for every command, not ignored
        result = cli.invoke(
            app, [*command, "--endpoint", "http://127.0.0.1:9", *flags], input="hi\n"
        )
        assert result.exit_code == 2, (command, flags)
        assert f"{expected}: local-engine options" in one_line_error(result.stderr)


def test_ctrl_c_keeps_the_serving_level_in_progress(
    llmrun_env: dict[str, str], server: str, tmp_path: Path
) -> None:
    out = tmp_path / "out.json"
    cmd = (
        f"{which_llmrun()} bench serve --endpoint {server} --concurrency 1,2 --num-prompts 40"
        f" --input-len 16 --output-len 32 --warmup 0 -o json > {out}"
    )
    child = pexpect.spawn(
        "bash", ["-c", cmd], env=llmrun_env, encoding="utf-8", timeout=HANG_S, dimensions=(30, 120)
    )
    child.expect(r"c=1 rate=inf\s+\d+/40 requests")
    started = served_completions(server)
    deadline = time.monotonic() + HANG_S
    while served_completions(server) < started + 2:  # one at a time: the first reply is done
        assert child.isalive() and time.monotonic() < deadline, "no request was answered"
        child.expect([pexpect.TIMEOUT], timeout=0.1)
    child.sendintr()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 130 and "Traceback" not in child.before
    (row,) = json.loads(out.read_text())
    assert row["interrupted"] is True and row["concurrency"] == 1
    assert 0 < row["completed"] < 40 and row["failed"] == 0


@pytest.mark.parametrize(
    ("model", "sent"),
    [("/models/x.gguf", None), ("Qwen.GGUF", None), ("llama3", "llama3")],
)
def test_a_local_model_from_the_environment_is_not_a_servers_name(
    model: str, sent: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """LLMRUN_MODEL=/x.gguf with --endpoint was sent as the server's model name (HTTP 404):
    a GGUF file here is the local engine's; a name from the variable is still the server's,
    and a typed -m always is."""
    import llmrun.cli
    from llmrun.cli.engine import remote_runner

    monkeypatch.setattr(llmrun.cli, "from_environment", frozenset({"-m", "--model"}))
    runner = remote_runner("http://127.0.0.1:9", model=model, api_key=None, timeout_s=5)
    assert runner.model_name == sent
    monkeypatch.setattr(llmrun.cli, "from_environment", frozenset())
    typed = remote_runner("http://127.0.0.1:9", model=model, api_key=None, timeout_s=5)
    assert typed.model_name == model
