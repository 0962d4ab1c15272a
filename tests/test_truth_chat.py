"""Chat keeps its promises (issue 29): a message longer than the context is an error and the
conversation goes on whole; the note after a re-prefill names its real cause; keys typed during
a reply leave no escape-sequence debris in the next prompt; `/save` through a symbolic link
writes the link's target and keeps the link."""

from __future__ import annotations

import contextlib
import errno
import os
import select
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from llmrun.cli import session
from llmrun.cli.app import app
from llmrun.runners.base import SamplingParams
from llmrun.runners.conversation import Conversation
from llmrun.runners.errors import PromptTooLongError
from llmrun.runners.files import atomic_write

from .fake import FakeRunner

# ---- a message longer than the context ----------------------------------------------------


def test_a_message_that_cannot_fit_drops_no_turn() -> None:
    conv = Conversation(FakeRunner(reply="ok fine", n_ctx=60), SamplingParams(max_tokens=10))
    conv.say("one two three")
    conv.say("four five six")
    before = conv.messages()
    with pytest.raises(PromptTooLongError):
        conv.begin("word " * 80)
    assert [t.in_context for t in conv.turns] == [True, True]
    assert conv.messages() == before  # the next question still has the conversation
    turn = conv.say("seven")
    assert turn.stats is not None and turn.stats.reused_tokens > 0 and not turn.note


def test_piped_chat_goes_on_whole_after_a_message_too_long(
    cli: CliRunner, fake: FakeRunner
) -> None:
    script = "first question\n" + "word " * 300 + "\nsecond question\n/stats all\n"
    result = cli.invoke(app, ["chat", "-c", "256"], input=script)
    assert "the prompt is" in result.stderr and "does not fit" not in result.stdout
    last = fake.requests[-1].messages
    assert [m.content for m in last if m.role == "user"] == ["first question", "second question"]
    rows = [ln.split() for ln in result.stderr.splitlines() if ln.strip()[:1].isdigit()]
    assert [row[0] for row in rows] == ["1", "2"], result.stderr  # no "1d": none dropped


# ---- the note after a re-prefill names its cause -------------------------------------------


def test_the_note_names_set_system_a_dropped_turn_or_the_template() -> None:
    conv = Conversation(FakeRunner(reply="ok fine", n_ctx=80), SamplingParams(max_tokens=10))
    conv.system = "be brief"
    conv.say("one two three")
    assert not conv.say("four five six").note  # the cache held all of it
    conv.system = "be very long-winded indeed"  # what /set system does
    note = conv.say("seven eight").note
    assert "cached tokens were prefilled again: the system prompt changed" in note, note
    assert "chat template" not in note
    for _ in range(8):  # until the oldest turns are dropped to make room
        turn = conv.say("a b c d e f g h i j")
        if not all(t.in_context for t in conv.turns):
            break
    assert "oldest turns were dropped to make room for this one" in turn.note, turn.note
    template = Conversation(FakeRunner(reply="a b c d e", n_ctx=200), SamplingParams())
    template.say("x")
    note = template.say("y").note  # the fake's cache holds the prompt, not the reply
    assert "the chat template renders the previous reply" in note, note


# ---- keys typed during a reply ---------------------------------------------------------------

KEYS = {
    "\x1b[A\x1b[D\x1b[C\x1b[B": "",  # arrows (CSI)
    "\x1bOA\x1bOD": "",  # arrows in application mode (SS3)
    "\x1b[15~\x1b[1;5C\x1b[3~": "",  # F5, Ctrl+Right, Delete
    "\x1b]11;rgb:0000/0000/0000\x07\x1bP1$r0m\x1b\\": "",  # a terminal's answers (OSC, DCS)
    "\x9bA\x8fB": "",  # 8-bit CSI and SS3
    "ab\x1b[1;": "ab",  # a sequence cut off at the end of what was read
    "\x1b[200~two\nlines\x1b[201~": "two lines",  # bracketed paste: the text stays
    "hello\x1b[A wörld 日本\r": "hello wörld 日本 ",
}


@pytest.mark.parametrize("keys", list(KEYS))
def test_key_sequences_are_dropped_whole(keys: str) -> None:
    assert session.typed_text(keys) == KEYS[keys]


@contextlib.contextmanager
def pseudo_terminal(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[int, int]]:
    """A real terminal (a pty) as the one the person types into; yields the keyboard's end
    and the terminal's."""
    import pty

    keyboard, terminal = pty.openpty()
    monkeypatch.setattr(session, "_terminal_fd", lambda: terminal)
    try:
        yield keyboard, terminal
    finally:
        os.close(keyboard)
        os.close(terminal)


@pytest.mark.skipif(os.name != "posix", reason="a pseudo-terminal")
def test_arrow_keys_during_a_reply_leave_nothing_in_the_next_prompt(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pseudo_terminal(monkeypatch) as (keyboard, terminal):
        with session.KeysHeld(keep=True) as keys:
            os.write(keyboard, b"\x1b[A\x1b[D\x1b[C\x1b[Bnext \x1bOAone\x1b[1;5D")
            assert select.select([terminal], [], [], 10)[0]
        assert keys.typed == "next one"


# ---- /save through a symbolic link -----------------------------------------------------------


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_save_through_a_link_to_a_full_device_is_an_error_and_keeps_the_link(
    tmp_path: Path, cli: CliRunner, fake: FakeRunner
) -> None:
    link = tmp_path / "chat.md"
    link.symlink_to("/dev/full")
    result = cli.invoke(app, ["chat"], input=f"hello\n/save {link}\n")
    assert result.exit_code == 1
    assert "saved" not in result.stderr and "No space left on device" in result.stderr
    assert link.is_symlink() and os.readlink(link) == "/dev/full"
    with pytest.raises(OSError) as failed:
        atomic_write(link, "text")
    assert failed.value.errno == errno.ENOSPC and link.is_symlink()


def test_save_through_a_link_writes_the_target_with_its_mode(tmp_path: Path) -> None:
    target = tmp_path / "kept" / "chat.md"
    target.parent.mkdir()
    target.write_text("old\n")
    target.chmod(0o640)
    link = tmp_path / "chat.md"
    link.symlink_to(target)
    conv = Conversation(FakeRunner(reply="hello back"), SamplingParams())
    conv.say("hello")
    conv.save(link)
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert "**User:** hello" in target.read_text()
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    assert sorted(p.name for p in target.parent.iterdir()) == ["chat.md"]  # no temporary left
    dangling = tmp_path / "new.json"
    dangling.symlink_to(tmp_path / "kept" / "new.json")  # a link to a file not yet there
    conv.save(dangling)
    assert dangling.is_symlink() and (tmp_path / "kept" / "new.json").read_text().startswith("{")
