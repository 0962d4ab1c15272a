"""llama.cpp's habits in run, chat and serve: its multi-letter flags work or are refused by
name (never read as short options run together), a missing model is said before any probe of
the machine, and figures measured on a busy machine carry the mark in every view."""

from __future__ import annotations

import dataclasses

import pytest
import typer.core
from typer.testing import CliRunner

from llmrun.cli import engine
from llmrun.cli.app import app, build_command
from llmrun.cli.chat import turn_line, turns_view
from llmrun.cli.options import LLAMA_CPP_SHORT_FLAGS, split_flag
from llmrun.cli.report import ran_busy
from llmrun.runners import system
from llmrun.runners.base import ChatMessage, Request, SamplingParams, generate
from llmrun.runners.config import EngineConfig
from llmrun.runners.conversation import Turn
from llmrun.runners.errors import ModelNotFoundError
from llmrun.runners.stats import GenerationStats
from llmrun.runners.system import logical_cpus

from .fake import FakeRunner

BUSY = logical_cpus() - 0.5


def _busy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(system, "background_override", BUSY)


def _declared(command: str) -> set[str]:
    built = build_command(command)
    ctx = typer.Context(built)
    return {
        flag
        for p in built.get_params(ctx)
        if isinstance(p, typer.core.TyperOption)
        for flag in (*p.opts, *p.secondary_opts)
    }


def _recording(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str | None, EngineConfig]]:
    seen: list[tuple[str | None, EngineConfig]] = []

    def factory(model: str | None, config: EngineConfig) -> FakeRunner:
        seen.append((model, config))
        return FakeRunner()

    monkeypatch.setattr(engine, "RUNNER_FACTORY", factory)
    return seen


@pytest.mark.parametrize("command", ["run", "chat", "serve"])
@pytest.mark.parametrize("flag", sorted(LLAMA_CPP_SHORT_FLAGS))
def test_every_llama_cpp_flag_of_several_letters_works_or_is_refused_by_name(
    cli: CliRunner, fake: FakeRunner, command: str, flag: str
) -> None:
    result = cli.invoke(app, [command, flag, "1", "hi"], input="")
    if flag in _declared(command):  # read as itself: whatever it says names this flag only
        assert "is not an option" not in result.stderr
        assert "No such option" not in result.stderr, result.stderr
        return
    assert result.exit_code == 2, result.stderr
    text = " ".join(result.stderr.replace("│", " ").split())
    assert f"{flag} (" in text and f"is not an option of llmrun {command}" in text, text


def test_the_flags_llama_cpp_users_type_reach_the_engine(
    cli: CliRunner, monkeypatch: pytest.MonkeyPatch, tmp_path: pytest.TempPathFactory
) -> None:
    seen = _recording(monkeypatch)
    model = tmp_path / "m.gguf"  # type: ignore[operator]
    model.write_bytes(b"GGUF")
    args = ["-ctk", "q8_0", "-ctv", "Q8_0", "-fa", "on", "-ub", "4", "-b", "8"]
    result = cli.invoke(app, ["run", "-hf", str(model), *args, "--no-dashboard", "hi"])
    assert result.exit_code == 0, result.stderr
    path, config = seen[-1]
    assert path == str(model)
    assert (config.cache_type_k, config.cache_type_v, config.flash_attn) == ("q8_0", "q8_0", "on")
    assert (config.n_ubatch, config.n_batch) == (4, 8)
    bad = cli.invoke(app, ["chat", "-ctk", "q9"], input="hi\n")
    assert bad.exit_code == 2
    assert bad.stderr.startswith("llmrun: error: -ctk/--cache-type-k: 'q9' is not one of f32")


@pytest.mark.parametrize("given", ["q2_K", "", "f16,q9"])
@pytest.mark.parametrize("flag", ["-ctk", "-ctv", "--cache-type-k"])
@pytest.mark.parametrize("command", [["run", "hi"], ["chat"], ["serve"], ["bench", "-r", "1"]])
def test_a_kv_cache_type_that_is_none_is_a_usage_error(
    command: list[str], flag: str, given: str, cli: CliRunner, fake: FakeRunner
) -> None:
    """`run -ctk q2_K` and `-ctk ''` were exit 1 (as a job's failure), `-fa bogus` exit 2;
    `bench -ctk q2_K` ran, skipped every test and said so, exit 1."""
    result = cli.invoke(app, [command[0], flag, given, *command[1:]], input="hi\n")
    assert result.exit_code == 2, result.stderr
    [line] = result.stderr.splitlines()
    assert line.startswith("llmrun: error: -ct"), line
    assert "f32, f16, bf16, q8_0" in line and not fake.requests


def test_hf_is_a_hub_repository_not_the_help(cli: CliRunner, fake: FakeRunner) -> None:
    result = cli.invoke(
        app, ["run", "-hf", "nobody/none-GGUF:Q4_K_M", "hi"], env={"HF_HUB_OFFLINE": "1"}
    )
    assert result.exit_code == 1, result.stdout  # not the help with 0
    assert "Usage" not in result.stdout and result.stderr.startswith("llmrun: error:")


def test_kv_cache_types_are_local_engine_options(cli: CliRunner, fake: FakeRunner) -> None:
    url = ["--endpoint", "http://127.0.0.1:9"]
    result = cli.invoke(app, ["run", *url, "-ctk", "q8_0", "hi"])
    assert result.exit_code == 2
    assert "-ctk/--cache-type-k: local-engine options" in result.stderr


def test_split_flag_skips_values_and_what_follows_the_separator() -> None:
    declared, values = {"-p", "-ngl"}, {"-p"}
    assert split_flag(["-p", "-fa", "x"], declared=declared, take_values=values) is None
    assert split_flag(["--", "-fa"], declared=declared, take_values=values) is None
    assert split_flag(["-ngl", "-fa=on"], declared=declared, take_values=values) == "-fa"
    assert split_flag(["serve", "-fa"], declared=set(), take_values=set(), names={"serve"}) is None


@pytest.mark.parametrize("command", ["run", "chat"])
@pytest.mark.usefixtures("every_core")  # its second half needs two CPUs
def test_a_missing_model_is_said_before_the_thread_choice(
    cli: CliRunner, fake: FakeRunner, monkeypatch: pytest.MonkeyPatch, command: str
) -> None:
    _busy(monkeypatch)
    prompt = ["hi"] if command == "run" else []
    result = cli.invoke(app, [command, "-m", "/nowhere/missing.gguf", *prompt], input="hi\n")
    assert result.exit_code == 1
    assert result.stderr.startswith("llmrun: error: model"), result.stderr
    assert "llmrun: threads" not in result.stderr
    if system.default_threads() > 1:  # a found model still gets the busy machine's threads
        found = cli.invoke(app, [command, *prompt], input="hi\n")
        assert "llmrun: threads 1 of" in found.stderr, found.stderr


def test_make_runner_prepares_the_settings_only_for_a_model_that_exists() -> None:
    prepared: list[EngineConfig] = []

    def prepare(config: EngineConfig) -> EngineConfig:
        prepared.append(config)
        return config

    with pytest.raises(ModelNotFoundError):
        engine.make_runner("/nowhere/missing.gguf", EngineConfig(), prepare=prepare)
    assert prepared == []


def _stats(background: float | None) -> GenerationStats:
    request = Request(messages=(ChatMessage("user", "hi"),), sampling=SamplingParams())
    stats = generate(FakeRunner(), request).stats
    return dataclasses.replace(stats, background_cpus=background)


def test_chat_turns_carry_the_busy_mark() -> None:
    quiet, loaded = _stats(0.0), _stats(BUSY)
    assert not ran_busy(quiet) and ran_busy(loaded)
    assert "busy" not in turn_line(quiet)
    assert turn_line(loaded).endswith(
        f"busy: others kept {BUSY:.1f} of {logical_cpus()} CPUs, unreliable"
    )
    table = turns_view([Turn("a", "b", quiet), Turn("c", "d", loaded)]).table
    assert table.caption is not None and "b: on a busy machine" in str(table.caption)
    assert [*table.columns[0].cells] == ["1", "2b"]
    alone = turns_view([Turn("a", "b", quiet)]).table
    assert "busy" not in str(alone.caption)


def test_several_requests_say_how_many_ran_on_a_busy_machine() -> None:
    from llmrun.cli.report import aggregate_table
    from llmrun.runners.stats import Aggregate

    from .test_dashboard import text_of

    quiet, loaded = _stats(0.0), _stats(BUSY)
    both = text_of(aggregate_table(Aggregate.of([quiet, loaded]), busy=1), width=60)
    assert "1 of 2 on a busy machine: unreliable" in " ".join(both.split())
    assert "busy" not in text_of(aggregate_table(Aggregate.of([quiet, quiet])), width=60)
