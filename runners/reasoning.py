"""Thinking and answer, told apart in a model's output as it streams.

Reasoning models write their thinking before the answer: between `<think>` and `</think>`
(DeepSeek-R1, Qwen3, SmolLM3), or in gpt-oss's channels (`<|channel|>analysis<|message|>` ...
`<|end|>`, then `<|channel|>final<|message|>`). Some chat templates open the thinking block in the
prompt itself, so the output starts inside it and only the closing tag appears. A tag can be
split over several tokens (`</th` + `ink>`), so the splitter holds back text that could still
become one.
"""

from __future__ import annotations

# (opening, closing) markers of a thinking block; every marker and header begins with "<"
MARKERS = (("<think>", "</think>"), ("<|channel|>analysis<|message|>", "<|end|>"))
# Text between thinking and answer that belongs to neither (gpt-oss's answer header)
ANSWER_HEADERS = ("<|start|>assistant<|channel|>final<|message|>", "<|channel|>final<|message|>")


def opens_thinking(prompt: str) -> bool:
    """Whether a rendered prompt ends inside an open thinking block (the template opened it)."""
    tail = prompt.rstrip()
    return any(tail.endswith(opening) for opening, _ in MARKERS)


def _partial_suffix(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that begins one of the tags. Every tag begins
    with `<`, so only the suffixes that start at a `<` are tried (this runs once per token)."""
    longest = max(len(t) for t in tags)
    at = text.find("<", max(0, len(text) - longest + 1))
    while at >= 0:
        suffix = text[at:]
        if any(t.startswith(suffix) for t in tags):
            return len(text) - at
        at = text.find("<", at + 1)
    return 0


class ShownSplitter:
    """The text to show, routed: `feed(text, flagged=...)` returns (thinking, text) segments in
    order, each certain now; tags stay with the thinking they open or close, so a program that
    reads the answer alone never gets a `<think` fragment. Text that could still become a tag
    (`<`, `<thi`, `</think`) is held back until the next token settles it. `TokenTagger`'s
    counts split the same way, so what is shown and what is counted agree.

    `flagged` is the runner's own tag of the token. It matters only where no tag is in the text:
    thinking that a chat template opened in the prompt, or a server's separate reasoning channel
    (its tokens are flagged and carry no tags); that thinking ends at a closing tag or at the
    first token not flagged. gpt-oss's answer header belongs to neither and is not shown."""

    def __init__(self, *, thinking: bool = False) -> None:
        self.thinking = thinking  # inside a thinking block (`thinking`: the prompt opened one)
        self.seen_thinking = thinking
        self.closing = MARKERS[0][1]
        self._by_flag = False  # thinking that began without a tag in the text
        self._pending = ""

    @property
    def holding(self) -> bool:
        """Whether text is held back as the possible start of a tag."""
        return bool(self._pending)

    def feed(self, text: str, *, flagged: bool) -> list[tuple[bool, str]]:
        out: list[tuple[bool, str]] = []
        if self.thinking and self._by_flag and not flagged:
            _add(out, True, self._pending)  # the runner says the thinking is over
            self._pending, self.thinking, self._by_flag = "", False, False
        elif (
            flagged and not self.thinking and not any(o in self._pending + text for o, _ in MARKERS)
        ):
            _add(out, False, self._pending)
            self._pending, self.thinking, self._by_flag = "", True, True
            self.seen_thinking = True
            self.closing = MARKERS[0][1]
        if not self._pending and "<" not in text:  # no tag can begin here: the common case
            _add(out, self.thinking, text)
            return out
        self._pending += text
        while self._pending:
            pending = self._pending
            if self.thinking:
                cut = pending.find(self.closing)
                if cut >= 0:
                    end = cut + len(self.closing)
                    _add(out, True, pending[:end])
                    self._pending, self.thinking, self._by_flag = pending[end:], False, False
                    continue
                keep = _partial_suffix(pending, (self.closing,))
                _add(out, True, pending[: len(pending) - keep])
                self._pending = pending[len(pending) - keep :]
                break
            found = [(pending.find(o), o, c) for o, c in MARKERS if o in pending]
            headers = [(pending.find(h), h) for h in ANSWER_HEADERS if h in pending]
            if headers and (not found or min(headers)[0] < min(found)[0]):
                at, header = min(headers)
                _add(out, False, pending[:at])
                self._pending = pending[at + len(header) :]
                continue
            if found:
                at, opening, closing = min(found)
                _add(out, False, pending[:at])
                _add(out, True, opening)
                self._pending = pending[at + len(opening) :]
                self.thinking, self.closing, self.seen_thinking = True, closing, True
                continue
            keep = _partial_suffix(pending, tuple(o for o, _ in MARKERS) + ANSWER_HEADERS)
            _add(out, False, pending[: len(pending) - keep])
            self._pending = pending[len(pending) - keep :]
            break
        return out

    def flush(self) -> list[tuple[bool, str]]:
        """The held-back rest at the end: a tag that never completed is text of its block."""
        out: list[tuple[bool, str]] = []
        _add(out, self.thinking, self._pending)
        self._pending = ""
        return out


def _add(out: list[tuple[bool, str]], thinking: bool, text: str) -> None:
    if not text:
        return
    if out and out[-1][0] == thinking:
        out[-1] = (thinking, out[-1][1] + text)
    else:
        out.append((thinking, text))


class TokenTagger:
    """Tags each output token as thinking or answer as it streams, and keeps the counts.

    `tag(text)` gives the live tag (a token carrying a tag, or part of one, counts with the
    block it opens or closes). Tokens whose text is held back as a possible tag are settled by
    what follows: with the thinking if they turn out to open it, with the answer otherwise.
    The first answer token is the first with answer text after thinking: text before the
    thinking in the same token does not count."""

    def __init__(self, *, thinking: bool = False) -> None:
        self.splitter = ShownSplitter(thinking=thinking)
        self.thinking_tokens = 0
        self.first_answer: int | None = None  # index of the first token with answer text
        self.seen_thinking = thinking
        self._limbo = 0  # tokens with no visible text yet, outside thinking
        self._index = 0

    def tag(self, text: str) -> bool:
        before = self.splitter.thinking
        segments = self.splitter.feed(text, flagged=False)
        after = self.splitter.thinking
        index = self._index
        self._index += 1
        answer, thought = "", False
        for thinking, piece in segments:
            if thinking:
                thought = self.seen_thinking = True
            else:
                answer += piece
                if self.seen_thinking and self.first_answer is None and piece.strip():
                    self.first_answer = index
        if before or after or thought:
            self.thinking_tokens += 1 + (self._limbo if not before else 0)
            self._limbo = 0
            return not answer.strip() or before
        if answer.strip() and not self.splitter.holding:
            self._limbo = 0
        else:
            self._limbo += 1
        return False
