"""A multi-turn conversation on one runner: history, the context-overflow policy, transcripts.

The runner keeps the KV cache of the previous request, so each turn is sent as the whole
conversation and only what is new gets prefilled. When a turn would not fit the context, the
oldest turns are dropped (the system prompt stays): the policy is stated here and in the README.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .base import ChatMessage, Request, Runner, SamplingParams, generate
from .errors import BadRequestError, PromptTooLongError
from .files import atomic_write
from .stats import GenerationStats

WARN_FRACTION = 0.75  # warn once the context is this full


@dataclass
class Turn:
    user: str
    reply: str = ""
    stats: GenerationStats | None = None
    in_context: bool = True  # False once dropped by the overflow policy or cleared by /reset
    system: str | None = None  # the system prompt this turn ran with
    cleared: bool = False  # before a /reset: kept for transcripts and /stats, not in context
    note: str = ""  # why the KV cache prefix broke, where it did

    @property
    def interrupted(self) -> bool:
        return self.stats is not None and self.stats.interrupted


@dataclass
class Conversation:
    runner: Runner
    sampling: SamplingParams
    system: str | None = None
    turns: list[Turn] = field(default_factory=list)
    # The turns the last `begin` dropped: a cause the note after a re-prefill can name.
    _dropped_now: list[Turn] = field(default_factory=list, init=False, repr=False)

    @property
    def n_ctx(self) -> int:
        """The context size that ran (a server that does not say: 0, and it decides)."""
        return self.runner.load().settings.n_ctx

    @property
    def reply_reserve(self) -> int:
        """Tokens kept free for the reply: --max-tokens, at most a quarter of the context."""
        return min(self.sampling.max_tokens, self.n_ctx // 4)

    @property
    def used_tokens(self) -> int:
        """Tokens in the context after the last turn (its prompt plus its reply)."""
        for turn in reversed(self.turns):
            if turn.cleared:
                return 0  # /reset emptied the context
            if turn.stats is not None and turn.in_context:
                return turn.stats.prompt_tokens + turn.stats.output_tokens
        return 0

    @property
    def nearly_full(self) -> bool:
        return self.n_ctx > 0 and self.used_tokens >= WARN_FRACTION * self.n_ctx

    def messages(
        self, user: str | None = None, *, without: tuple[Turn, ...] = ()
    ) -> tuple[ChatMessage, ...]:
        """The conversation as sent: the system prompt, the turns in the context (but those in
        `without`), and `user` as the new message."""
        out: list[ChatMessage] = []
        if self.system:
            out.append(ChatMessage("system", self.system))
        for turn in self.turns:
            if turn.in_context and not any(turn is t for t in without):
                out += [ChatMessage("user", turn.user), ChatMessage("assistant", turn.reply)]
        if user is not None:
            out.append(ChatMessage("user", user))
        return tuple(out)

    def request(self, user: str) -> Request:
        return Request(messages=self.messages(user), sampling=self.sampling)

    def make_room(self, user: str) -> int:
        """Drop the oldest turns until `user` plus the reply reserve fits; returns how many.

        Raises PromptTooLongError when even the system prompt and this message alone do not
        fit; the conversation is then left as it was (no turn dropped), so the chat goes on.
        """
        self._dropped_now = []
        if self.n_ctx <= 0:  # a server that does not say its context size enforces it itself
            return 0
        limit = self.n_ctx - self.reply_reserve
        kept = [t for t in self.turns if t.in_context]
        for n in range(len(kept) + 1):
            without = tuple(kept[:n])
            request = Request(messages=self.messages(user, without=without), sampling=self.sampling)
            needed = self.runner.count_tokens(request)
            if needed <= limit or (n == len(kept) and needed + 1 <= self.n_ctx):
                break  # the last case fits with less room for the reply than reserved
        else:
            raise PromptTooLongError(needed, self.n_ctx)
        for turn in kept[:n]:
            turn.in_context = False
        self._dropped_now = kept[:n]
        return n

    # ---- a turn -----------------------------------------------------------------------

    def begin(self, user: str) -> tuple[Request, int]:
        """Room for a new message (the oldest turns dropped as the policy says) and the request
        that sends the conversation with it; also how many turns were dropped."""
        dropped = self.make_room(user)
        return self.request(user), dropped

    def record(self, user: str, reply: str, stats: GenerationStats | None) -> Turn:
        """Keep a finished (or interrupted: stats None or marked so) turn in the history."""
        turn = Turn(user, reply, stats, system=self.system, note=self._prefix_note(stats))
        self.turns.append(turn)
        return turn

    def _prefix_note(self, stats: GenerationStats | None) -> str:
        """Why fewer tokens were reused than the cache held after the last turn, said rather
        than left as a mystery: the system prompt changed (`/set system`), the oldest turns
        were dropped to make room, or else the template renders the last reply with other
        tokens than were generated (emoji, odd spacing). Everything from there on is prefilled
        again."""
        dropped, self._dropped_now = self._dropped_now, []
        last = next(
            (
                t
                for t in reversed(self.turns)
                if t.stats and (t.in_context or any(t is d for d in dropped))
            ),
            None,
        )
        if stats is None or last is None or last.stats is None or stats.reused_tokens == 0:
            return ""
        held = last.stats.prompt_tokens + last.stats.output_tokens
        lost = held - stats.reused_tokens
        if lost <= 2:  # the end-of-turn markers are rendered anew by design
            return ""
        if last.system != self.system:
            why = "the system prompt changed since the last turn (/set system)"
        elif dropped:
            n = len(dropped)
            turns = "the oldest turn was" if n == 1 else f"the {n} oldest turns were"
            why = f"{turns} dropped to make room for this one"
        else:
            why = (
                "the chat template renders the previous reply with other tokens than were generated"
            )
        return f"{lost} of the {held} cached tokens were prefilled again: {why}"

    def say(self, user: str, *, cancel: threading.Event | None = None) -> Turn:
        """One whole turn without a terminal: begin, run to the end, record."""
        request, _ = self.begin(user)
        finished = generate(self.runner, request, cancel=cancel)
        return self.record(user, finished.text, finished.stats)

    def reset(self) -> None:
        """Take every turn out of the context (the system prompt stays) and clear the KV cache.
        The turns stay in transcripts and /stats, marked as cleared."""
        for turn in self.turns:
            turn.in_context, turn.cleared = False, True
        self.runner.reset()

    # ---- transcripts -------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        loaded = self.runner.loaded
        return {
            "model": loaded.name if loaded else None,
            "system": self.system,
            "n_ctx": self.n_ctx,
            "turns": [
                {
                    "user": t.user,
                    "assistant": t.reply,
                    "in_context": t.in_context,
                    "cleared_by_reset": t.cleared,
                    "system": t.system,
                    "note": t.note or None,
                    "stats": t.stats.to_dict() if t.stats else None,
                }
                for t in self.turns
            ],
        }

    def to_markdown(self) -> str:
        data = self.to_dict()
        lines = [f"# Chat with {data['model'] or 'a model'}", ""]
        system: str | None = None
        for i, t in enumerate(self.turns, 1):
            if t.system != system:  # where it changed, not the current one on top
                system = t.system
                lines += [f"**System:** {system or '(none from here on)'}", ""]
            cleared = " (before /reset)" if t.cleared else ""
            lines += [
                f"## Turn {i}{cleared}",
                "",
                f"**User:** {t.user}",
                "",
                "**Assistant:**",
                "",
                t.reply,
                "",
            ]
            if t.note:
                lines += [f"*Note: {t.note}.*", ""]
            if t.stats is not None:
                s = t.stats
                flags = ("" if t.in_context or t.cleared else ", dropped from the context") + (
                    ", interrupted" if t.interrupted else ""
                )
                lines += [
                    f"*{s.prompt_tokens} prompt tokens ({s.new_prompt_tokens} new,"
                    f" {s.reused_tokens} reused), TTFT {_ms(s.ttft_s)},"
                    f" prompt {s.prompt_tps or 0:.1f} tok/s, {s.output_tokens} output tokens,"
                    f" output {s.output_tps or 0:.1f} tok/s{flags}*",
                    "",
                ]
        return "\n".join(lines)

    def save(self, path: Path) -> None:
        """Write the transcript with per-turn stats: JSON for .json, Markdown for .md."""
        suffix = path.suffix.lower()
        if suffix == ".json":
            text = json.dumps(self.to_dict(), ensure_ascii=False, indent=2) + "\n"
        elif suffix in (".md", ".markdown"):
            text = self.to_markdown()
        else:
            raise BadRequestError(
                f"cannot save as '{suffix or path.name}': use a .json or .md file"
            )
        try:
            atomic_write(path, text)  # a full disk leaves the old transcript whole
        except OSError as e:
            raise BadRequestError(f"cannot write {path}: {e.strerror or e}") from None


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f} ms"
