"""Thinking told apart from the answer: the parser, the remote path and the local one."""

from __future__ import annotations

import io
import json
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmrun.cli.session import TextOut, drive
from llmrun.runners.base import Event, Finished, Request, SamplingParams, Token, generate
from llmrun.runners.reasoning import ShownSplitter, TokenTagger, opens_thinking
from llmrun.runners.remote import OpenAIRunner

from .conftest import HANG_S, which_llmrun
from .stub_server import stub_server

# recorded token streams: a tag split over tokens, gpt-oss's channels, a template-opened block
QWEN = ["<", "think", ">\n", "The", " user", " asks", ".", "\n</", "think", ">\n\n", "Hi", "!"]
GPT_OSS = [
    "<|channel|>analysis<|message|>",
    "User",
    " greets",
    ".",
    "<|end|>",
    "<|start|>assistant<|channel|>final<|message|>",
    "Hello",
    ".",
]
OPENED = ["Let", " me", " see", ".", "</think>", "\n", "Yes", "."]


def tagged(pieces: list[str], *, thinking: bool = False) -> tuple[int, int | None, str, str]:
    tagger = TokenTagger(thinking=thinking)
    for piece in pieces:
        tagger.tag(piece)
    splitter = ShownSplitter(thinking=thinking)  # what run and chat show, tags with thinking
    parts = [s for p in pieces for s in splitter.feed(p, flagged=False)] + splitter.flush()
    return (
        tagger.thinking_tokens,
        tagger.first_answer,
        "".join(text for thinking, text in parts if thinking),
        "".join(text for thinking, text in parts if not thinking),
    )


def test_the_parser_splits_recorded_streams() -> None:
    assert tagged(QWEN) == (10, 10, "<think>\nThe user asks.\n</think>", "\n\nHi!")
    channel = "<|channel|>analysis<|message|>"
    assert tagged(GPT_OSS) == (5, 6, f"{channel}User greets.<|end|>", "Hello.")
    assert tagged(OPENED, thinking=True) == (5, 6, "Let me see.</think>", "\nYes.")
    assert tagged(["Just", " an", " answer", " <b>"]) == (0, None, "", "Just an answer <b>")
    assert opens_thinking("<|im_start|>assistant\n<think>\n") and not opens_thinking("Hi")


@pytest.mark.parametrize("model", ["thinker", "thinktags"])
def test_a_server_that_thinks_gets_the_split(model: str) -> None:
    with stub_server() as url:
        runner = OpenAIRunner(url, model=model)
        request = Request.chat("Why?", sampling=SamplingParams(max_tokens=20, think=True))
        done = generate(runner, request)
        runner.close()
    s = done.stats
    assert s.thinking_tokens == 4  # the server's reasoning_tokens, or the tagged chunks
    assert s.first_answer_s is not None and s.first_answer_s > s.ttft_s  # type: ignore[operator]
    assert s.answer_tokens == s.output_tokens - 4 and (s.answer_tps or 0) > 0
    assert done.text.endswith('{"enable_thinking": true}')  # --think reached the template


def test_the_cli_hides_thinking_and_reports_time_to_first_answer(
    llmrun_env: dict[str, str],
) -> None:
    with stub_server() as url:
        done = subprocess.run(
            [
                which_llmrun(),
                "run",
                "--endpoint",
                url,
                "-m",
                "thinker",
                "--hide-thinking",
                "--no-think",
                "--stats",
                "json",
                "Why?",
            ],
            env=llmrun_env,
            capture_output=True,
            text=True,
            timeout=HANG_S,
        )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("It is 42") and "think" not in done.stdout.split("{")[0]
    assert '{"enable_thinking": false}' in done.stdout
    stats = json.loads(done.stderr.strip().splitlines()[-1])
    assert stats["thinking_tokens"] == 4 and stats["first_answer_s"] > stats["ttft_s"]


def test_a_local_template_that_opens_thinking_sends_the_output_through_the_parser(
    llmrun_env: dict[str, str], tmp_path: Path
) -> None:
    template = tmp_path / "think.jinja"
    template.write_text(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "<|im_start|>assistant\n<think>\n"
    )
    done = subprocess.run(
        [
            which_llmrun(),
            "run",
            "--chat-template-file",
            str(template),
            "-n",
            "12",
            "--temp",
            "0",
            "--no-dashboard",
            "--stats",
            "json",
            "Count to five.",
        ],
        env=llmrun_env,
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert done.returncode == 0, done.stderr
    stats = json.loads(done.stderr.strip().splitlines()[-1])
    # The embedded model never closes the block the template opened: all of it is thinking.
    assert stats["thinking_tokens"] == stats["output_tokens"] > 0
    assert stats["first_answer_s"] is None and stats["answer_tokens"] == 0
    assert stats["thinking_s"] is not None and stats["thinking_s"] > 0  # timed locally too


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


class _Thinker:
    def stream(self, request: Request, *, cancel: object = None) -> Iterator[Event]:
        yield Token(0, "hmm", 0.0, thinking=True)
        yield Token(1, "yes", 0.1)
        yield Finished(stats=None, text="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("no_color", "hide", "expected"),
    [(False, False, "\x1b[2mhmm\x1b[22myes"), (True, False, "hmmyes"), (False, True, "yes")],
)
def test_thinking_is_dimmed_on_a_terminal_or_hidden(
    monkeypatch: pytest.MonkeyPatch, no_color: bool, hide: bool, expected: str
) -> None:
    if no_color:
        monkeypatch.setenv("NO_COLOR", "1")
    else:
        monkeypatch.delenv("NO_COLOR", raising=False)
    tty = _Tty()
    drive(
        _Thinker(),  # type: ignore[arg-type]
        Request(prompt="x"),
        out=TextOut(tty),
        view=None,
        cancel=threading.Event(),
        hide_thinking=hide,
    )
    assert tty.getvalue() == expected


@pytest.mark.parametrize("model", ["thinker", "thinktags"])
def test_a_pipe_gets_the_answer_alone_and_the_thinking_on_stderr_or_delimited(
    llmrun_env: dict[str, str], model: str
) -> None:
    def run(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [which_llmrun(), "run", "--endpoint", url, "-m", model, "-q", *extra, "Why?"],
            env=llmrun_env,
            capture_output=True,
            text=True,
            timeout=HANG_S,
            stdin=subprocess.DEVNULL,
        )

    with stub_server() as url:
        plain, kept = run(), run("--thinking-stdout")
    assert plain.returncode == 0 and kept.returncode == 0, plain.stderr + kept.stderr
    assert plain.stdout.lstrip().startswith("It is 42"), plain.stdout  # the answer alone
    thought = plain.stderr.strip()
    assert thought and thought not in plain.stdout  # the thinking went to stderr
    assert kept.stdout.startswith("<think>"), kept.stdout
    after = kept.stdout.split("</think>", 1)[1]
    assert after.startswith("\nIt is 42"), kept.stdout  # the answer on a line of its own
    assert "Let me think." in kept.stdout.split("</think>", 1)[0] and "Let me think." in thought
