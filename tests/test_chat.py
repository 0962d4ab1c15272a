"""Chat's conversation logic and its scripted (piped) form, with a fake runner."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from llmrun.cli import engine
from llmrun.cli.app import app
from llmrun.cli.chat import MAX_HISTORY_BYTES
from llmrun.runners.base import SamplingParams
from llmrun.runners.config import EngineConfig
from llmrun.runners.conversation import Conversation
from llmrun.runners.errors import BadRequestError, PromptTooLongError

from .fake import FakeRunner
from .hostile_files import plant


def test_turns_reuse_the_cache_and_the_oldest_are_dropped_first() -> None:
    runner = FakeRunner(reply="ok fine", n_ctx=60)
    conv = Conversation(runner, SamplingParams(max_tokens=10), system="be brief")
    first = conv.say("one two three four five")
    second = conv.say("six seven eight nine ten")
    assert first.stats and second.stats
    assert second.stats.reused_tokens == first.stats.prompt_tokens
    assert conv.used_tokens == second.stats.prompt_tokens + second.stats.output_tokens
    for _ in range(4):
        conv.say("a b c d e f g h")
    assert [t.in_context for t in conv.turns][:2] == [False, False]
    messages = conv.messages()
    assert messages[0].role == "system" and messages[0].content == "be brief"
    conv.make_room("next")
    assert runner.count_tokens(conv.request("next")) <= 60 - conv.reply_reserve
    with pytest.raises(PromptTooLongError):
        conv.make_room("word " * 80)


def test_save_as_json_and_markdown(tmp_path: Path) -> None:
    conv = Conversation(FakeRunner(reply="hello back"), SamplingParams(), system="sys")
    conv.say("hello")
    conv.save(tmp_path / "t.json")
    data = json.loads((tmp_path / "t.json").read_text())
    assert data["system"] == "sys" and data["turns"][0]["assistant"] == "hello back"
    assert data["turns"][0]["stats"]["prompt_tokens"] > 0
    conv.save(tmp_path / "t.md")
    md = (tmp_path / "t.md").read_text()
    assert "## Turn 1" in md and "**User:** hello" in md and "prompt tokens" in md
    with pytest.raises(BadRequestError, match=r"use a \.json or \.md file"):
        conv.save(tmp_path / "t.txt")


def test_piped_chat_prints_only_replies(cli: CliRunner, fake: FakeRunner, tmp_path: Path) -> None:
    script = (
        "first message\n"
        "second one\n"
        f"/save {tmp_path}/c.json\n"
        '"""\nline a\nline b\n"""\n'
        "/reset\n"
        "after reset\n"
    )
    result = cli.invoke(app, ["chat", "-s", "sys"], input=script)
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == [
        "first message",
        "first message second one",
        "first message second one line a line b",
        "after reset",
    ]
    saved = json.loads((tmp_path / "c.json").read_text())
    assert [t["user"] for t in saved["turns"]] == ["first message", "second one"]
    assert saved["turns"][1]["stats"]["reused_tokens"] > 0
    assert [m.content for m in fake.requests[-1].messages] == ["sys", "after reset"]


def test_piped_stats_are_the_plain_summary_lines_whole(
    cli: CliRunner, fake: FakeRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`/stats` in a piped chat drew the terminal's bars and cut its lines at 80 columns,
    padded with spaces; run's summary there is plain lines, one record each: so is chat's."""
    monkeypatch.setenv("COLUMNS", "40")  # a width a terminal would fold at: not a pipe's
    result = cli.invoke(app, ["chat"], input="hello\n/stats\n")
    assert result.exit_code == 0, result.output
    lines = result.stderr.splitlines()
    assert "█" not in result.stderr and not any(line.endswith(" ") for line in lines)
    assert [line[:9] for line in lines if line.startswith(("ttft ", "rates "))] == [
        "ttft     ",
        "rates    ",
    ]
    assert any(len(line) > 40 for line in lines), lines  # whole, not folded


def test_piped_chat_reports_failures_goes_on_and_exits_1(cli: CliRunner, fake: FakeRunner) -> None:
    fake._n_ctx = 20
    result = cli.invoke(app, ["chat"], input="/nope\n" + "w " * 40 + "\n/save x.txt\nhi\n")
    assert result.exit_code == 1  # a turn failed: a script learns it from the exit code
    assert result.stdout == "hi\n"
    assert "unknown command /nope" in result.stderr
    assert "the prompt is 41 tokens long but the context holds 20" in result.stderr
    assert "use a .json or .md file" in result.stderr


def test_piped_chat_warns_before_the_context_overflows_and_drops_oldest(
    cli: CliRunner, fake: FakeRunner
) -> None:
    fake._n_ctx = 60
    fake.reply = "fine thanks"
    lines = [f"message number {i} with some words" for i in range(6)]
    result = cli.invoke(app, ["chat", "-s", "keep me", "-n", "5"], input="\n".join(lines) + "\n")
    assert result.exit_code == 0, result.stderr
    err = " ".join(result.stderr.split())
    warned = err.index("when a turn does not fit, the oldest turns are dropped")
    dropped = err.index("dropped the 1 oldest turn(s) so this one fits")
    assert warned < dropped  # said before it happened
    assert fake.requests[-1].messages[0].content == "keep me"
    assert len(result.stdout.splitlines()) == 6


def test_ollama_habits_in_chat(cli: CliRunner, fake: FakeRunner) -> None:
    script = (
        "/set parameter temperature 0.2\n/set parameter num_predict 7\n"
        "/set parameter stop END|STOP\n/set parameter repeat_last_n 16\n"
        "/show info\nhello\n/bye\nnot sent\n"
    )
    result = cli.invoke(app, ["chat"], input=script)
    assert result.exit_code == 0, result.stderr
    sp = fake.requests[-1].sampling
    assert (sp.temperature, sp.max_tokens, sp.stop) == (0.2, 7, ("END", "STOP"))
    assert sp.repeat_last_n == 16
    assert "temperature 0.2 · num_predict 7" in " ".join(result.stderr.split())
    assert [r.messages[-1].content for r in fake.requests] == ["hello"]  # /bye left


@pytest.mark.parametrize(
    ("line", "said", "value"),
    [
        ("/set parameter repeat_last_n +16", "repeat_last_n = 16", 16),
        ("/set parameter temperature 5e-1", "temperature = 0.5", 0.5),
        ("/set parameter top_p 0.123456789", "top_p = 0.123456789", 0.123456789),
        ("/set parameter stop |", "stop = none for", ()),  # it said `stop = |`
        ("/set parameter stop a|| b", "stop = 'a' | ' b' for", ("a", " b")),
    ],
)
def test_set_parameter_says_the_value_it_took(
    cli: CliRunner, fake: FakeRunner, line: str, said: str, value: object
) -> None:
    """Python reads more spellings of a number than it prints: the line says what is used."""
    result = cli.invoke(app, ["chat"], input=f"{line}\nhi\n")
    assert result.exit_code == 0, result.stderr
    assert said in result.stderr
    name = line.split()[2]
    assert getattr(fake.requests[-1].sampling, name) == value


@pytest.mark.parametrize(
    "line",
    [
        "/set parameter temperature -1",
        "/set parameter repeat_last_n 1.5",
        "/set parameter repeat_last_n -2",
        "/set parameter repeat_last_n \u0663",  # an Arabic-Indic 3: ASCII digits, as -n takes
        "/set parameter repeat_last_n 1_6",
        "/set parameter temperature \u0660.\u0665",
        "/set parameter bogus 1",
        "/set temperature 1",
        "/show nothing",
        "/unknown",
        "/save",  # its usage line was red, and the script still exited 0
    ],
)
def test_a_bad_command_in_a_script_exits_1(cli: CliRunner, fake: FakeRunner, line: str) -> None:
    result = cli.invoke(app, ["chat"], input=f"{line}\nhi\n")
    assert result.exit_code == 1, result.stderr
    assert result.stdout == "hi\n"  # the rest of the script still ran


@pytest.mark.parametrize("value", ["1.5", "\u0663", "x", "1e3"])
def test_a_whole_number_not_read_is_worded_as_the_command_line_words_it(
    cli: CliRunner, fake: FakeRunner, value: str
) -> None:
    """Unread (`x`, `٣`) and refused (`1.5`) whole numbers said "not an integer" and "not a
    whole number"; both say the command line's words now."""
    result = cli.invoke(app, ["chat"], input=f"/set parameter repeat_last_n {value}\nhi\n")
    assert f"/set parameter repeat_last_n: {value!r} is not a whole number" in result.output


def test_llama_cpp_spellings_and_a_seed_like_system_prompt(
    cli: CliRunner, fake: FakeRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[EngineConfig] = []

    def factory(model: str, config: EngineConfig) -> FakeRunner:
        seen.append(config)
        return fake

    monkeypatch.setattr(engine, "RUNNER_FACTORY", factory)
    result = cli.invoke(
        app,
        ["run", "--n-predict", "2", "--ctx-size", "128", "-tb", "2", "-s", "42", "one two three"],
    )
    assert result.exit_code == 0, result.stderr
    assert fake.requests[-1].sampling.max_tokens == 2
    assert (seen[0].n_ctx, seen[0].n_threads_batch) == (128, 2)
    assert "-s 42 sets the system prompt here; llama.cpp's seed is --seed" in result.stderr
    quiet = cli.invoke(app, ["run", "-s", "be brief", "hi"])
    assert "seed" not in quiet.stderr


def test_reset_and_system_changes_stay_in_the_record(
    cli: CliRunner, fake: FakeRunner, tmp_path: Path
) -> None:
    script = (
        f"first\n/reset\n/system be brief\nsecond\n/stats all\n"
        f"/save {tmp_path / 't.json'}\n/save {tmp_path / 't.md'}\n"
    )
    result = cli.invoke(app, ["chat"], input=script, env={"COLUMNS": "120"})
    assert result.exit_code == 0, result.stderr
    saved = json.loads((tmp_path / "t.json").read_text())
    assert [t["user"] for t in saved["turns"]] == ["first", "second"]  # /reset erased nothing
    assert [t["cleared_by_reset"] for t in saved["turns"]] == [True, False]
    assert [t["system"] for t in saved["turns"]] == [None, "be brief"]
    md = (tmp_path / "t.md").read_text()
    assert md.index("## Turn 1 (before /reset)") < md.index("**System:** be brief")
    assert md.index("**System:** be brief") < md.index("## Turn 2")  # where it changed
    assert "cleared" in result.stderr  # /stats all shows the cleared turn
    assert [m.content for m in fake.requests[-1].messages] == ["be brief", "second"]


def test_a_broken_cache_prefix_is_explained() -> None:
    from llmrun.runners.stats import GenerationStats

    conv = Conversation(FakeRunner(), SamplingParams())
    base = dict(template_tokenize_s=0, prefill_s=0, first_sample_s=0, itl_s=(), e2e_s=0, load_s=0)
    conv.record("a", "x", GenerationStats("stop", 20, 0, 10, **base))  # type: ignore[arg-type]
    kept = conv.record("b", "y", GenerationStats("stop", 40, 29, 5, **base))  # type: ignore[arg-type]
    broke = conv.record("c", "z", GenerationStats("stop", 60, 20, 5, **base))  # type: ignore[arg-type]
    assert kept.note == ""  # 30 held, 29 reused: the end-of-turn markers, as designed
    assert broke.note.startswith("25 of the 45 cached tokens were prefilled again")


def test_the_rest_of_ollamas_chat_commands(cli: CliRunner, fake: FakeRunner) -> None:
    script = (
        "/?\n/? shortcuts\n/set system Be brief.\n/show system\n/set verbose\nhello\n"
        "/set quiet\n/set nothink\n/set parameter seed 7\n/show parameters\n"
        "/show modelfile\n/set wordwrap\n/clear\nagain\n/bye\n"
    )
    result = cli.invoke(app, ["chat"], input=script)
    assert result.exit_code == 0, result.stderr
    err = " ".join(result.stderr.split())
    assert "/show parameters the sampling settings" in err and "Ctrl-Z suspend" in err
    assert "system prompt: Be brief." in err
    assert "seed 7" in err and "think off" in err
    assert "FROM /fake/model.gguf" in err and "PARAMETER seed 7" in err
    assert 'SYSTEM """Be brief."""' in err
    first, second = fake.requests
    assert first.messages[0].content == "Be brief." and first.sampling.think is None
    assert second.sampling.think is False and second.sampling.seed == 7
    assert [m.content for m in second.messages] == ["Be brief.", "again"]  # /clear forgot


def test_load_and_set_format_say_what_to_do_instead(cli: CliRunner, fake: FakeRunner) -> None:
    result = cli.invoke(app, ["chat"], input="/load llama3\n/set format json\nhi\n")
    assert result.exit_code == 1
    assert "llmrun chat -m llama3" in result.stderr and "ask for JSON" in result.stderr
    assert result.stdout == "hi\n"


@pytest.mark.parametrize("width", [40, 60, 80, 120])
def test_help_fits_the_width_with_hanging_descriptions(width: int) -> None:
    import io

    from rich.console import Console

    from llmrun.cli.chat import HELP, SHORTCUTS, help_view

    for entries in (HELP, SHORTCUTS):
        console = Console(file=io.StringIO(), width=width, color_system=None)
        console.print(help_view(entries))
        out = console.file.getvalue()  # type: ignore[attr-defined]
        for line in out.splitlines():
            assert len(line) <= width
            assert line.startswith(("/", " ", '"""', "Ctrl", "Up")), (width, out)
        flat = " ".join(out.split())
        for name, what in entries:
            assert " ".join(f"{name} {what}".split()) in flat or (
                name in flat and " ".join(what.split()) in flat
            )


def test_a_context_llama_cpp_changed_is_said_and_bad_numbers_in_words(
    cli: CliRunner, fake: FakeRunner
) -> None:
    chat = cli.invoke(app, ["chat", "-c", "64"], input="/set parameter temperature abc\nhi\n")
    assert "-c 64: llama.cpp sized the context to 256 tokens" in " ".join(chat.stderr.split())
    assert "'abc' is not a number" in chat.stderr and "could not convert" not in chat.stderr
    run = cli.invoke(app, ["run", "-c", "64", "hi"])
    assert run.exit_code == 0, run.stderr
    assert "-c 64: llama.cpp sized the context to 256 tokens" in " ".join(run.stderr.split())
    same = cli.invoke(app, ["run", "-c", "256", "hi"])
    assert "sized the context" not in same.stderr


@pytest.mark.parametrize("kind", ["fifo", "folder", "huge", "plain"])
def test_a_chat_history_that_is_no_file_is_neither_read_nor_kept(
    kind: str, llmrun_env: dict[str, str]
) -> None:
    """readline opens the line history blocking and reads it whole: a FIFO there hung the
    chat before its first prompt (SIGTERM too), and the save at exit waited on it again."""
    import subprocess
    import sys

    history = Path(llmrun_env["LLMRUN_HOME"]) / "state" / "chat_history"
    plant(history, kind, cap=MAX_HISTORY_BYTES)
    if kind == "plain":
        history.write_text("an old line\n")
    code = "from llmrun.cli.chat import _readline; r = _readline(); print(r.get_current_history_length())"
    done = subprocess.run(
        [sys.executable, "-c", code], env=llmrun_env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    if kind == "plain":
        assert done.stdout.split() == ["1"] and done.stderr == ""
        assert history.read_text().splitlines() == ["an old line"]  # kept at exit
    else:
        assert done.stdout.split() == ["0"]
        assert "is not a chat history llmrun reads (a regular file of at most 16 MiB)" in (
            done.stderr
        )


ESCAPES = "\x1b]0;PWN\x07\x1b[41mRED"


def test_typed_text_and_stored_values_are_said_back_without_escapes(
    cli: CliRunner, fake: FakeRunner
) -> None:
    """What a person types or pastes is quoted back in messages: its escape sequences must not
    reach the terminal (set the window title, recolour the screen)."""
    script = (
        f"/set system be {ESCAPES}\n/show system\n/show modelfile\n/system\n"
        f"/nosuch{ESCAPES}\n/set parameter {ESCAPES} 1\n/set parameter top_k {ESCAPES}\n"
        f"/set parameter stop {ESCAPES}\n/load {ESCAPES}\nhi\n"
    )
    result = cli.invoke(app, ["chat"], input=script)
    assert "\x1b" not in result.stderr
    err = " ".join(result.stderr.split())
    assert "system prompt: be RED" in err
    assert "unknown command /nosuch" in err and "llmrun chat -m" in err


def test_long_input_said_back_is_cut_with_its_length(cli: CliRunner, fake: FakeRunner) -> None:
    """`/load` of a 200,000-character paste said all of it back; so did a 5,000-digit number."""
    digits = "9" * 5000
    script = f"/load {'x' * 200_000}\n/set parameter top_k {digits}\n/nosuch{'y' * 500}\nhi\n"
    result = cli.invoke(app, ["chat"], input=script)
    assert "x" * 61 not in result.stderr and "9" * 61 not in result.stderr
    assert "y" * 61 not in result.stderr
    err = " ".join(result.stderr.split())
    assert "(200,000 characters)" in err and "(507 characters)" in err


def test_a_model_file_name_with_escapes_is_shown_clean(cli: CliRunner, fake: FakeRunner) -> None:
    """A model file's name (`chat -m`) and its metadata in the banner, /show info and
    /show modelfile: as `run` shows them, without escape sequences."""
    import dataclasses

    from llmrun.cli.chat import banner
    from llmrun.runners.base import ModelLoaded

    from .fake import FAKE_MODEL, FAKE_SETTINGS

    model = dataclasses.replace(
        FAKE_MODEL,
        path=f"/tmp/x/ok{ESCAPES}.gguf",
        name=f"ok{ESCAPES}",
        architecture=f"llama{ESCAPES}",
    )
    fake._loaded = ModelLoaded(model, FAKE_SETTINGS, 0.5)
    assert "\x1b" not in banner(fake._loaded, 256) and "okRED" in banner(fake._loaded, 256)
    result = cli.invoke(app, ["chat"], input="/show info\n/show modelfile\nhi\n")
    assert result.exit_code == 0, result.stderr
    assert "\x1b" not in result.stderr
    assert "FROM /tmp/x/okRED.gguf" in result.stderr and "okRED · llamaRED" in result.stderr
