"""Thinking and answer told apart whatever the tokens (issue 29): every way of cutting a reply
into up to three tokens, and into single characters, must show the same stdout and stderr and
give the same counts as the reply in one piece. The runner below tags tokens the way the local
engine and the remote one do (`TokenTagger`), and `drive` shows them."""

from __future__ import annotations

import io
import itertools
import re
import threading
from collections.abc import Iterator

import pytest

from llmrun.cli.session import DIM, UNDIM, TextOut, Thinking, drive
from llmrun.runners.base import Event, Finished, Request, Token
from llmrun.runners.reasoning import TokenTagger


class TaggingRunner:
    """Streams the given tokens, tagged by a TokenTagger as the engines tag them."""

    def __init__(self, tokens: list[str], *, opened: bool = False) -> None:
        self.tokens = tokens
        self.tagger = TokenTagger(thinking=opened)

    def stream(self, request: Request, *, cancel: object = None) -> Iterator[Event]:
        for i, text in enumerate(self.tokens):
            yield Token(i, text, float(i), thinking=self.tagger.tag(text))
        yield Finished(stats=None, text="".join(self.tokens))  # type: ignore[arg-type]


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


DIMMED = re.compile(re.escape(DIM) + "(.*?)" + re.escape(UNDIM), re.DOTALL)


def shown(
    tokens: list[str], route: str, *, opened: bool = False
) -> tuple[str, str, int, int | None]:
    """stdout, stderr, thinking tokens and the first answer token's index. On a terminal the
    dimmed text is the thinking: it comes back in place of stderr (with the newline that the
    stderr route ends the thinking with)."""
    out = Terminal() if route == "terminal" else io.StringIO()
    err = io.StringIO()
    thinking = {
        "stderr": Thinking(sink=TextOut(err)),
        "stdout": Thinking(delimit=True),
        "hidden": Thinking(hide=True),
        "terminal": Thinking(),
    }[route]
    runner = TaggingRunner(tokens, opened=opened)
    drive(
        runner,  # type: ignore[arg-type]
        Request(prompt="x"),
        out=TextOut(out),
        view=None,
        cancel=threading.Event(),
        thinking=thinking,
    )
    text, thought = out.getvalue(), err.getvalue()
    if route == "terminal":
        thought = "".join(DIMMED.findall(text)) + "\n"
        text = DIMMED.sub("", text)
    return text, thought, runner.tagger.thinking_tokens, runner.tagger.first_answer


def cuttings(text: str) -> Iterator[list[str]]:
    """Every way to cut `text` into up to three tokens, then one token per character."""
    n = len(text)
    for k in (0, 1, 2):
        for cuts in itertools.combinations(range(1, n), k):
            bounds = [0, *cuts, n]
            yield [text[a:b] for a, b in itertools.pairwise(bounds)]
    yield list(text)


def expected_counts(tokens: list[str], *, opened: bool) -> tuple[int, int | None]:
    """By the characters: a token with any character of a thinking block (its tags included)
    is a thinking token; the first answer token is the first with a visible answer character
    after the first block ends."""
    text = "".join(tokens)
    inside = [False] * len(text)
    blocks = [(0, text.index("</think>") + 8)] if opened else []
    blocks += [m.span() for m in re.finditer(r"<think>.*?</think>", text, re.DOTALL)]
    blocks += [
        m.span() for m in re.finditer(r"<\|channel\|>analysis<\|message\|>.*?<\|end\|>", text)
    ]
    for a, b in blocks:
        inside[a:b] = [True] * (b - a)
    end = min(b for _, b in blocks)
    thinking, first, at = 0, None, 0
    for i, token in enumerate(tokens):
        span = range(at, at + len(token))
        at += len(token)
        thinking += any(inside[j] for j in span)
        visible = [j for j in span if j >= end and not inside[j] and not text[j].isspace()]
        if first is None and visible:
            first = i
    return thinking, first


CASES = {
    # reply: (stdout with the thinking on stderr, stderr, stdout with --thinking-stdout)
    "<think>\nWhy? Because.\n</think>\n\nIt is 42.": (
        "\n\nIt is 42.",
        "<think>\nWhy? Because.\n</think>\n",
        "<think>\nWhy? Because.\n</think>\n\n\nIt is 42.",
    ),
    # the answer first, then thinking, then more answer: never glued to the thinking
    "Hi<think>x y</think>Bye": ("HiBye", "<think>x y</think>\n", "Hi\n<think>x y</think>\nBye"),
    # gpt-oss: its answer header belongs to neither
    "<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant<|channel|>final<|message|>Ok.": (
        "Ok.",
        "<|channel|>analysis<|message|>Hm.<|end|>\n",
        "<|channel|>analysis<|message|>Hm.<|end|>\nOk.",
    ),
}


@pytest.mark.parametrize("reply", list(CASES))
def test_every_cut_of_a_reply_shows_and_counts_the_same(
    reply: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("TERM", "xterm-256color")
    piped, thought, delimited = CASES[reply]
    for tokens in cuttings(reply):
        assert shown(tokens, "stderr")[:2] == (piped, thought), tokens
        assert shown(tokens, "stdout")[:2] == (delimited, ""), tokens
        assert shown(tokens, "hidden")[:2] == (piped, ""), tokens
        assert shown(tokens, "terminal")[:2] == (piped, thought), tokens  # dimmed in place
        counts = shown(tokens, "hidden")[2:]
        if reply.startswith("<|channel|>"):
            continue  # the header tokens are neither: counted as the engine always did
        assert counts == expected_counts(tokens, opened=False), tokens


def test_every_cut_of_a_reply_whose_thinking_the_template_opened() -> None:
    reply = "Let me see.</think>\nYes."
    for tokens in cuttings(reply):
        assert shown(tokens, "stderr", opened=True)[:2] == ("\nYes.", "Let me see.</think>\n")
        assert shown(tokens, "stdout", opened=True)[:2] == (
            "<think>\nLet me see.</think>\n\nYes.",
            "",
        ), tokens
        counts = shown(tokens, "hidden", opened=True)[2:]
        assert counts == expected_counts(tokens, opened=True), tokens


def test_text_like_a_tag_that_is_not_one_stays_in_the_answer() -> None:
    reply = "An <b>x</b> <thi"  # ends on what could have begun a tag
    for tokens in cuttings(reply):
        assert shown(tokens, "stderr")[:3] == (reply, "", 0), tokens
