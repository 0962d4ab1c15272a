"""`llmrun chat` on a real pseudo-terminal with the embedded model."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pexpect

from .conftest import HANG_S, ROOT, which_llmrun

TURN = re.compile(r"prompt (\d+) new \+ (\d+) reused · TTFT")
PROMPT = ">>> "


def spawn(env: dict[str, str], tmp_path: Path, *args: str) -> pexpect.spawn:
    env = dict(env, LLMRUN_HOME=str(tmp_path / "home"))
    return pexpect.spawn(
        which_llmrun(),
        ["chat", "--temp", "0", "-c", "2048", *args],
        env=env,
        encoding="utf-8",
        timeout=HANG_S,
        dimensions=(50, 200),
    )


def turn(child: pexpect.spawn, text: str) -> tuple[int, int]:
    """Send one message and return the reply's (new, reused) prompt tokens."""
    child.sendline(text)
    child.expect(TURN)
    new, reused = int(child.match.group(1)), int(child.match.group(2))
    child.expect(r"context .* (\d+)/\d+ tokens")
    child.expect_exact(PROMPT)
    return new, reused


def test_three_turns_prefill_only_what_is_new_then_save_and_ctrl_d(
    llmrun_env: dict[str, str], tmp_path: Path
) -> None:
    child = spawn(llmrun_env, tmp_path, "-n", "24", "-s", "You are terse.")
    child.expect_exact(PROMPT)
    first = turn(child, "My name is Ann. Say hello.")
    second = turn(child, "What is my name?")
    third = turn(child, "Thank you!")
    assert first[1] == 0
    for new, reused in (second, third):
        assert reused > 0 and new < reused  # only the new message was prefilled
    assert third[1] > second[1]
    child.sendline(f"/save {tmp_path}/chat.json")
    child.expect_exact("saved 3 turns")
    child.sendline("/stats all")
    child.expect("turns.*3 .*stop|length")
    child.expect_exact(PROMPT)
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    assert "Traceback" not in (child.before or "")
    saved = json.loads((tmp_path / "chat.json").read_text())
    assert saved["system"] == "You are terse."
    assert [t["user"] for t in saved["turns"]] == [
        "My name is Ann. Say hello.",
        "What is my name?",
        "Thank you!",
    ]
    stats = [t["stats"] for t in saved["turns"]]
    assert [(s["new_prompt_tokens"], s["reused_tokens"]) for s in stats] == [first, second, third]
    assert all(t["assistant"] for t in saved["turns"])


def test_ctrl_c_stops_a_reply_keeps_it_and_chat_goes_on(
    llmrun_env: dict[str, str], tmp_path: Path
) -> None:
    child = spawn(llmrun_env, tmp_path, "-n", "1500")
    child.expect_exact(PROMPT)
    child.sendline("Write a very long story about a dragon and a knight.")
    child.expect_exact("knight.\r\n")  # the echo of the message
    child.expect(r"\w+ \w+ \w+ \w+ \w+ \w+")  # the reply is streaming
    child.sendintr()
    child.expect_exact("[interrupted]")
    child.expect_exact(PROMPT)
    _, reused = turn(child, "Give the story a title.")
    assert reused > 0  # the interrupted reply is part of the conversation
    child.sendline("/stats")
    child.expect("prompt tok/s .*output tok/s")
    child.expect_exact(PROMPT)
    child.sendline("/reset")
    child.expect_exact("conversation cleared")
    child.expect_exact(PROMPT)
    _, reused_after = turn(child, "Hello")
    assert reused_after == 0
    child.sendline(f"/save {tmp_path}/chat.md")
    child.expect_exact("saved 3 turns")  # /reset cleared the context, not the record
    child.expect_exact(PROMPT)
    child.sendintr()  # Ctrl-C on an empty prompt (meant for a reply just ended) stays
    child.expect_exact("(to leave, press Ctrl-D or type /exit)")
    child.expect_exact(PROMPT)
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    md = (tmp_path / "chat.md").read_text()
    assert "## Turn 1 (before /reset)" in md and "## Turn 3" in md and "**User:** Hello" in md


def test_a_paste_of_several_lines_is_one_message(
    llmrun_env: dict[str, str], tmp_path: Path
) -> None:
    child = spawn(llmrun_env, tmp_path, "-n", "4")
    child.expect_exact(PROMPT)
    # What a terminal sends for a bracketed paste of three lines, then Enter.
    child.send("\x1b[200~first line\nsecond line\nthird line\x1b[201~")
    child.send("\r")
    child.expect(TURN)
    child.expect_exact(PROMPT)
    child.sendline(f"/save {tmp_path}/paste.json")
    child.expect_exact("saved 1 turns")  # one turn, not three
    child.expect_exact(PROMPT)
    child.sendeof()
    child.expect(pexpect.EOF)
    turns = json.loads((tmp_path / "paste.json").read_text())["turns"]
    assert [t["user"] for t in turns] == ["first line\nsecond line\nthird line"]


def test_stdout_to_a_file_gets_the_replies_alone(
    llmrun_env: dict[str, str], tmp_path: Path
) -> None:
    out = tmp_path / "replies.txt"
    env = dict(llmrun_env, LLMRUN_HOME=str(tmp_path / "home"))
    child = pexpect.spawn(
        "bash",
        ["-c", f"{which_llmrun()} chat --temp 0 -n 12 > {out}"],
        env=env,
        encoding="utf-8",
        timeout=HANG_S,
        dimensions=(50, 200),
    )
    child.expect_exact(PROMPT)  # the prompt is on the terminal (stderr)
    child.sendline("Say hello.")
    child.expect(TURN)
    child.expect_exact(PROMPT)
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    replies = out.read_text()
    assert replies.strip() and ">>>" not in replies and "TTFT" not in replies
    assert replies.endswith("\n") and not replies.endswith("\n\n")


def test_ctrl_c_during_a_long_prefill_leaves_the_conversation_as_it_was(
    llmrun_env: dict[str, str], tmp_path: Path
) -> None:
    """The paste's cost is not paid again by the next question: it left the conversation,
    and the cache still holds what came before it."""
    child = spawn(llmrun_env, tmp_path, "-n", "8", "-b", "16", "-t", "1", "-c", "4096")
    child.expect_exact(PROMPT)
    first = turn(child, "Hi, my name is Ann.")
    # three times the long prompt: seconds of prefill on a fast CPU too, so that the Ctrl-C
    # sent at its first progress line lands in it (one copy was over before it, at times)
    paste = "\n\n".join([(ROOT / "examples" / "long_prompt.txt").read_text()] * 3)
    child.send(f"\x1b[200~{paste}\x1b[201~")
    child.send("\r")
    child.expect(r"(\d+)/(\d{3,}) tokens")  # prefilling the paste, chunk by chunk
    child.sendintr()
    child.expect_exact("[interrupted] before the reply began")
    child.expect_exact(PROMPT)
    new, reused = turn(child, "What is my name?")
    assert reused >= sum(first) and new < 40, (first, new, reused)
    child.sendline(f"/save {tmp_path}/chat.json")
    child.expect_exact("saved 3 turns")  # the stopped message stays in the record
    # at the prompt: readline has the terminal (a Ctrl-D typed before it did reached the line
    # discipline in canonical mode and was lost to readline, and chat waited for input)
    child.expect_exact(PROMPT)
    child.sendeof()
    child.expect(pexpect.EOF)


def test_sigterm_or_sighup_ends_the_chat_during_a_reply_and_at_the_prompt(
    llmrun_env: dict[str, str], tmp_path: Path
) -> None:
    """SIGTERM on a terminal did what Ctrl-C does there: it stopped the reply and the chat
    went on, and at the prompt it only cleared the line; the chat never ended (only a piped
    one exited 143). Now SIGTERM ends it with 143 and SIGHUP with 129, the reply kept."""
    import signal

    for signum, code, during in (
        (signal.SIGTERM, 143, True),
        (signal.SIGTERM, 143, False),
        (signal.SIGHUP, 129, False),
    ):
        child = spawn(llmrun_env, tmp_path, "-n", "1500")
        child.expect_exact(PROMPT)
        if during:
            child.sendline("Write a very long story about a dragon and a knight.")
            child.expect(r"\w+ \w+ \w+ \w+ \w+ \w+")  # the reply is streaming
        child.kill(signum)
        child.expect(pexpect.EOF)
        child.close()
        assert child.signalstatus is None and child.exitstatus == code, (signum, during)
        assert "Traceback" not in (child.before or "")
