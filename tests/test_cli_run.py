"""`llmrun run` shapes with a fake runner: inputs, outputs, stats, exit codes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from llmrun.cli.app import app

from .fake import FakeRunner


def test_argument_prompt_streams_text_and_stats(cli: CliRunner, fake: FakeRunner) -> None:
    result = cli.invoke(app, ["run", "hello", "there"])
    assert result.exit_code == 0, result.stderr
    assert result.stdout == "hello there\n"
    assert "prompt   " in result.stderr and "ttft" in result.stderr and "tok/s" in result.stderr
    assert "\x1b[" not in result.stdout
    assert fake.closed


def test_stdin_is_material_and_argument_the_instruction(cli: CliRunner, fake: FakeRunner) -> None:
    result = cli.invoke(app, ["run", "Summarize", "-s", "Be brief"], input="the material\n")
    assert result.exit_code == 0, result.stderr
    messages = fake.requests[0].messages
    assert [m.role for m in messages] == ["system", "user"]
    assert messages[0].content == "Be brief"
    assert messages[1].content == "the material\n\nSummarize"


def test_raw_sends_plain_completion(cli: CliRunner, fake: FakeRunner) -> None:
    result = cli.invoke(app, ["run", "--raw", "Once upon"])
    assert result.exit_code == 0
    assert fake.requests[0].prompt == "Once upon" and not fake.requests[0].messages


def test_sampling_and_engine_options_reach_the_runner(cli: CliRunner, fake: FakeRunner) -> None:
    args = [
        "run",
        "x",
        "-n",
        "3",
        "--temp",
        "0.2",
        "--top-k",
        "5",
        "--top-p",
        "0.5",
        "--min-p",
        "0.1",
        "--repeat-penalty",
        "1.1",
        "--repeat-last-n",
        "32",
        "--seed",
        "7",
        "--stop",
        "END",
        "--stop",
        "STOP",
    ]
    result = cli.invoke(app, args)
    assert result.exit_code == 0, result.stderr
    sp = fake.requests[0].sampling
    assert (sp.max_tokens, sp.temperature, sp.top_k, sp.top_p, sp.min_p) == (3, 0.2, 5, 0.5, 0.1)
    assert (sp.repeat_penalty, sp.repeat_last_n, sp.seed) == (1.1, 32, 7)
    assert sp.stop == ("END", "STOP")


def test_several_files_one_load_and_an_aggregate(
    cli: CliRunner, fake: FakeRunner, tmp_path: Path
) -> None:
    for name in "abc":
        (tmp_path / f"{name}.txt").write_text(f"prompt {name}")
    files = [arg for n in "abc" for arg in ("-f", str(tmp_path / f"{n}.txt"))]
    result = cli.invoke(app, ["run", *files])
    assert result.exit_code == 0, result.stderr
    assert len(fake.requests) == 3
    assert "prompt a" in result.stdout and "prompt c" in result.stdout
    assert "3 requests" in result.stderr and "TTFT" in result.stderr and "p90" in result.stderr


def test_stats_json_and_stats_file(cli: CliRunner, fake: FakeRunner, tmp_path: Path) -> None:
    stats_file = tmp_path / "stats.jsonl"
    stats_file.write_text('{"earlier": true}\n')
    result = cli.invoke(
        app, ["run", "one two three", "--stats", "json", "--stats-file", str(stats_file)]
    )
    assert result.exit_code == 0, result.stderr
    record = json.loads(result.stderr.strip().splitlines()[-1])
    for key in (
        "prompt_tokens",
        "reused_tokens",
        "prefill_s",
        "prompt_tps",
        "ttft_s",
        "template_tokenize_s",
        "first_sample_s",
        "output_tokens",
        "output_tps",
        "itl_p50_s",
        "itl_p99_s",
        "e2e_s",
        "load_s",
        "finish_reason",
        "model",
        "settings",
    ):
        assert key in record, key
    assert record["output_tokens"] == 3 and record["finish_reason"] == "stop"
    lines = stats_file.read_text().splitlines()
    assert len(lines) == 2 and json.loads(lines[1])["id"] == "prompt"


def test_json_output_on_stdout(cli: CliRunner, fake: FakeRunner) -> None:
    result = cli.invoke(app, ["run", "alpha beta", "--json", "-q"])
    assert result.exit_code == 0
    record = json.loads(result.stdout)
    assert record["text"] == "alpha beta" and record["stats"]["output_tokens"] == 2
    assert result.stderr == ""


def test_jsonl_bad_line_is_named_good_lines_answered(
    cli: CliRunner, fake: FakeRunner, tmp_path: Path
) -> None:
    path = tmp_path / "reqs.jsonl"
    path.write_text(
        '{"prompt": "first one", "max_tokens": 1}\n'
        "{not json\n"
        '{"messages": [{"role": "user", "content": "third here"}], "temperature": 0}\n'
        '{"prompt": "x", "colour": 1}\n'
        '{"prompt": "x", "id": ' + "9" * 5000 + "}\n"  # valid JSON: an internal error ended all
    )
    result = cli.invoke(app, ["run", "--jsonl", str(path), "--stats", "json"])
    assert result.exit_code == 1
    assert result.stdout.split() == ["first", "third", "here"]
    assert f"llmrun: error: {path}:2: not valid JSON" in result.stderr
    assert f"{path}:4: unknown key 'colour'" in result.stderr
    assert f"{path}:5: holds a number of more than 4,300 digits, past what" in result.stderr
    assert fake.requests[0].sampling.max_tokens == 1
    assert fake.requests[1].sampling.temperature == 0


def test_empty_prompt_and_usage_errors(cli: CliRunner, fake: FakeRunner) -> None:
    result = cli.invoke(app, ["run"], input="")
    assert result.exit_code == 1
    assert result.stderr.startswith("llmrun: error: the prompt is empty")
    assert cli.invoke(app, ["run", "x", "--temp", "hot"]).exit_code == 2
    assert cli.invoke(app, ["run", "x", "--no-such-flag"]).exit_code == 2


@pytest.mark.parametrize("command", ["run", "chat"])
def test_an_empty_stop_is_a_usage_error_naming_the_option(
    cli: CliRunner, fake: FakeRunner, command: str
) -> None:
    """An empty --stop would stop before the first token: a bad option value (exit 2)."""
    args = [command, "x"] if command == "run" else [command]
    result = cli.invoke(app, [*args, "--stop", "END", "--stop", ""], input="hi\n")
    assert result.exit_code == 2, result.stderr
    assert (
        result.stderr.strip() == "llmrun: error: --stop: an empty string; give the text to stop at"
    )
    assert not fake.requests


def test_prompt_too_long_names_the_option(cli: CliRunner, fake: FakeRunner) -> None:
    result = cli.invoke(app, ["run", "word " * 300])
    assert result.exit_code == 1
    assert result.stderr.strip() == (
        "llmrun: error: the prompt is 301 tokens long but the context holds 256 "
        "(raise -c/--ctx above 301 or shorten the prompt)"
    )
    # a prompt that fills the context exactly fits, but leaves no room for the answer
    result = cli.invoke(app, ["run", "word " * 255])
    assert result.exit_code == 1
    assert result.stderr.strip() == (
        "llmrun: error: the prompt is 256 tokens long and the context holds 256: no room is left"
        " for a token of output (raise -c/--ctx above 256 or shorten the prompt)"
    )


def test_quiet(cli: CliRunner, fake: FakeRunner) -> None:
    result = cli.invoke(app, ["run", "-q", "hi"])
    assert result.exit_code == 0 and result.stderr == "" and result.stdout == "hi\n"


def test_the_context_note_comes_after_the_texts_line(cli: CliRunner, fake: FakeRunner) -> None:
    result = cli.invoke(app, ["run", "hello there", "-c", "64"])  # the fake's context is 256
    assert result.exit_code == 0, result.stderr
    note = "note: -c 64: llama.cpp sized the context to 256 tokens"
    assert note in result.stderr
    assert f"\n{note}" in result.output and "there" + note not in result.output


def test_dash_p_is_the_prompt_as_in_llama_cli(cli: CliRunner, fake: FakeRunner) -> None:
    """`llama-cli -p TEXT` carries over (it was "No such option: -p"); -p and the argument
    together are one prompt given twice, a usage error."""
    result = cli.invoke(app, ["run", "-p", "first one", "-n", "2"])
    assert result.exit_code == 0, result.stderr
    assert result.stdout.split() == ["first", "one"]
    both = cli.invoke(app, ["run", "-p", "a", "b"])
    assert both.exit_code == 2
    assert "-p/--prompt: give the prompt once, as -p or as the argument" in both.stderr


@pytest.mark.parametrize("text", ["", "\n\n  \n", "\ufeff\r\n"])
def test_a_jsonl_file_with_no_request_is_an_error_not_a_quiet_exit_0(
    cli: CliRunner, fake: FakeRunner, tmp_path: Path, text: str
) -> None:
    """An empty --jsonl (or `<(zcat missing.gz)`, whose input is lost) ran nothing, said
    nothing and exited 0, as -f and the grammar files never did."""
    path = tmp_path / "none.jsonl"
    path.write_text(text)
    result = cli.invoke(app, ["run", "--jsonl", str(path)])
    assert result.exit_code == 1
    assert result.stderr == (
        f'llmrun: error: JSONL file {path} is empty (one request per line: {{"prompt": ...}})\n'
    )
    assert fake.requests == []


@pytest.mark.parametrize("words", [["Summarize"], ["-p", "Summarize"]])
def test_prompt_words_beside_jsonl_alone_are_refused_not_dropped(
    cli: CliRunner, fake: FakeRunner, tmp_path: Path, words: list[str]
) -> None:
    """Each JSONL line is a whole request: the words went nowhere, silently. With -f they
    still go before each file's text."""
    path = tmp_path / "one.jsonl"
    path.write_text('{"prompt": "hi"}\n')
    result = cli.invoke(app, ["run", *words, "--jsonl", str(path)])
    assert result.exit_code == 2
    assert "--jsonl: each line is a whole request, so the prompt argument or -p" in result.stderr
    doc = tmp_path / "doc.txt"
    doc.write_text("the text")
    result = cli.invoke(app, ["run", *words, "-f", str(doc), "--jsonl", str(path)])
    assert result.exit_code == 0, result.stderr
    file_request, line_request = fake.requests
    said = str(file_request.messages)
    assert "Summarize" in said and "the text" in said
    assert "Summarize" not in str(line_request.messages) + str(line_request.prompt)
