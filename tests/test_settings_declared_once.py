"""Each sampling setting is declared once (runners/limits.py `SAMPLING_SETTINGS`): its range
and its names in JSONL lines and HTTP bodies. The command line's options, `run --jsonl` and
`llmrun serve` all read it from there, so they cannot drift apart."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import click
import pytest
from typer.testing import CliRunner

from llmrun.cli import inputs, options
from llmrun.cli.app import PATH_KINDS, app
from llmrun.runners.base import SamplingParams
from llmrun.runners.config import EngineConfig
from llmrun.runners.limits import (
    SAMPLING_SETTINGS,
    SettingError,
    check_engine,
    check_sampling,
    engine_ranges,
)
from llmrun.runners.serving import api_models

# The command line's option of each setting (SamplingOptions' field), where it has one.
OPTION_OF = {"temperature": "temp"}


def _typer_option(field: str) -> typing.Any:
    hints = typing.get_type_hints(options.SamplingOptions, include_extras=True)
    return typing.get_args(hints[field])[1]


def test_every_setting_is_a_field_of_sampling_params() -> None:
    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    assert set(SAMPLING_SETTINGS) <= fields


@pytest.mark.parametrize("name", sorted(SAMPLING_SETTINGS))
def test_the_options_range_is_the_settings(name: str) -> None:
    field = OPTION_OF.get(name, name)
    if field not in {f.name for f in dataclasses.fields(options.SamplingOptions)}:
        pytest.skip(f"{name} has no command-line option")
    declared = _typer_option(field)
    s = SAMPLING_SETTINGS[name]
    assert (declared.min, declared.max) == (s.low, s.high)


@pytest.mark.parametrize("name", sorted(SAMPLING_SETTINGS))
def test_jsonl_and_http_read_the_settings_names(name: str) -> None:
    s = SAMPLING_SETTINGS[name]
    for key in s.jsonl:
        assert inputs.JSONL_SAMPLING_KEYS[key] == name
    body_fields = api_models.ChatBody.model_fields
    for key in s.http:
        assert key in body_fields, f"{key} is not a field of the request body"


@pytest.mark.parametrize("name", sorted(SAMPLING_SETTINGS))
def test_every_source_refuses_the_same_values(name: str) -> None:
    """Just past the range: refused by the checker, by the JSONL reader and by the server's
    body alike (the option refuses it as a usage error, by Typer's range)."""
    s = SAMPLING_SETTINGS[name]
    _refused_by_every_source(name, s.high + (1 if s.whole else 0.5))


def _refused_by_every_source(name: str, value: typing.Any) -> None:
    """`value` for setting `name` is a SettingError from the checker, from every JSONL key and
    from every HTTP body field, and a click range error from the command-line option."""
    s = SAMPLING_SETTINGS[name]
    with pytest.raises(SettingError):
        check_sampling(dataclasses.replace(SamplingParams(), **{name: value}))
    for key in s.jsonl:
        with pytest.raises(SettingError):
            inputs.parse_jsonl_line(
                f'{{"prompt": "x", "{key}": {value!r}}}',
                system=None,
                raw=False,
                sampling=SamplingParams(),
            )
    for key in s.http:
        body = api_models.ChatBody.model_validate(
            {"messages": [{"role": "user", "content": "x"}], key: value}
        )
        with pytest.raises(SettingError):
            body.sampling(SamplingParams())
    field = OPTION_OF.get(name, name)
    if field in {f.name for f in dataclasses.fields(options.SamplingOptions)}:
        declared = _typer_option(field)
        kind: typing.Any = click.IntRange if s.whole else click.FloatRange
        with pytest.raises(click.BadParameter):
            kind(declared.min, declared.max).convert(value, None, None)


@pytest.mark.parametrize("name", sorted(set(SAMPLING_SETTINGS) - {"seed"}))  # HTTP -1: random
def test_every_source_refuses_the_same_values_below(name: str) -> None:
    s = SAMPLING_SETTINGS[name]
    _refused_by_every_source(name, s.low - (1 if s.whole else 0.5))


@pytest.mark.parametrize("penalty", [0, 0.0, -1.0, 1e-40, 0.005])
def test_a_repeat_penalty_of_zero_is_refused_everywhere(penalty: float) -> None:
    """llama.cpp divides a seen token's logit by the penalty: `repeat_penalty: 0` (HTTP,
    --repeat-penalty 0, a JSONL line) was taken and gave an empty answer, finish_reason stop;
    a penalty that float32 holds as 0 (1e-40) does the same."""
    _refused_by_every_source("repeat_penalty", penalty)


def test_the_repeat_penalty_option_refuses_zero_as_a_usage_error(
    cli: CliRunner, fake: typing.Any
) -> None:
    result = cli.invoke(app, ["run", "--repeat-penalty", "0", "hi"])
    assert result.exit_code == 2, result.stderr
    assert "--repeat-penalty" in result.stderr and "0.01<=x<=100" in result.stderr
    assert not fake.requests
    ok = cli.invoke(app, ["run", "--repeat-penalty", "0.01", "hi"])
    assert ok.exit_code == 0, ok.stderr
    assert fake.requests[-1].sampling.repeat_penalty == 0.01


# The command line's option of each engine setting (EngineConfig's field).
ENGINE_OPTIONS = {
    "n_ctx": options.Ctx,
    "n_batch": options.Batch,
    "n_ubatch": options.Ubatch,
    "n_threads": options.Threads,
    "n_threads_batch": options.ThreadsBatch,
    "n_gpu_layers": options.GpuLayers,
}


def test_every_engine_setting_has_its_option() -> None:
    assert set(engine_ranges()) == set(ENGINE_OPTIONS)
    assert set(engine_ranges()) <= {f.name for f in dataclasses.fields(EngineConfig)}


@pytest.mark.parametrize("name", sorted(ENGINE_OPTIONS))
def test_the_engine_options_range_is_the_settings(name: str) -> None:
    """The option refuses what check_engine refuses (a usage error); a command may raise
    its floor (serve's -c starts at 1) but never its ceiling."""
    declared = typing.get_args(ENGINE_OPTIONS[name])[1]
    low, high = engine_ranges()[name]
    assert declared.max == high and low <= declared.min <= high
    with pytest.raises(SettingError):
        past: dict[str, typing.Any] = {name: high + 1}
        check_engine(dataclasses.replace(EngineConfig(), **past))
    with pytest.raises(click.BadParameter):
        click.IntRange(declared.min, declared.max).convert(high + 1, None, None)


ENGINE_FLAGS = {
    "-t": "n_threads",
    "-tb": "n_threads_batch",
    "-c": "n_ctx",
    "-b": "n_batch",
    "-ub": "n_ubatch",
    "-ngl": "n_gpu_layers",
}
# Which command takes which engine setting (bench serve and interference load with the
# engine's own choice of context and batch: their prompts set them).
TAKES = {
    "run": ("-t", "-tb", "-c", "-b", "-ub", "-ngl"),
    "chat": ("-t", "-tb", "-c", "-b", "-ub", "-ngl"),
    "serve": ("-t", "-tb", "-c", "-b", "-ngl"),
    "bench serve": ("-t", "-tb"),
    "bench interference": ("-t", "-tb"),
}


@pytest.mark.parametrize("command", list(TAKES))
def test_each_command_takes_the_engine_settings_it_says(command: str) -> None:
    known = CliRunner().invoke(app, [*command.split(), "--help"], env={"COLUMNS": "200"})
    takes = {f for f in ENGINE_FLAGS if f" {f} " in known.output or f" {f}," in known.output}
    assert takes == set(TAKES[command])


@pytest.mark.parametrize(
    ("command", "option"), [(c, o) for c, options in TAKES.items() for o in options]
)
def test_every_command_refuses_an_engine_setting_past_its_range(command: str, option: str) -> None:
    """Where a command takes the option, past its range is a usage error (exit 2) that
    names the range, before anything loads."""
    name = ENGINE_FLAGS[option]
    argv = [*command.split(), option, "99999999999"]
    result = CliRunner().invoke(app, argv, env={"COLUMNS": "200"})
    assert result.exit_code == 2, result.output
    high = engine_ranges()[name][1]  # the least may be the command's own (serve: -c 1)
    assert "99999999999 is not in the range " in result.output
    assert f"<=x<={high}." in result.output


def _every_option() -> list[tuple[str, typing.Any]]:
    """(command, click parameter) for every option of every command and subcommand."""
    from llmrun.cli.app import COMMANDS, build_command

    found = []
    for name in COMMANDS:
        group = build_command(name)
        subs = getattr(group, "commands", {})
        for path, command in [(name, group), *((f"{name} {s}", c) for s, c in subs.items())]:
            found += [(path, param) for param in command.params]
    return found


def test_no_option_says_its_default_twice() -> None:
    """An option whose help says its default "(default: ...)" shows no typer default beside
    it (run -np printed "(default: 1, one after another)" and then "[default: 1]")."""
    twice = [
        f"{path} {p.opts[0]}"
        for path, p in _every_option()
        if "(default" in (getattr(p, "help", "") or "")
        and p.show_default is not False
        and not getattr(p, "is_flag", False)
        and p.default is not None
    ]
    assert twice == []


def _kind(param: typing.Any) -> str:
    return str(getattr(param.type, "name", ""))


def _float_ranges() -> list[tuple[str, str]]:
    """(command, flag) for every option with a range of floats, in every command."""
    return [(path, p.opts[0]) for path, p in _every_option() if _kind(p) == "float range"]


def test_every_float_range_is_found() -> None:
    assert ("run", "--temp") in _float_ranges() and len(_float_ranges()) > 10


@pytest.mark.parametrize(("command", "flag"), _float_ranges())
def test_nan_for_a_number_with_a_range_is_a_usage_error(command: str, flag: str) -> None:
    """NaN compares false with both ends, so a range check alone lets it through: it is a
    usage error (exit 2) that names the option and the range, before anything loads."""
    result = CliRunner().invoke(app, [*command.split(), flag, "nan"], env={"COLUMNS": "200"})
    assert result.exit_code == 2, result.output
    assert "nan is not in the range " in result.output and "<=x" in result.output


# Numbers without an upper end, and why that is safe: every other one has a range, because a
# huge value reached sqlite (history -n 2**64: OverflowError), an allocation (bench serve
# --warmup 10**20) or a context of 9 GB that ignored SIGTERM (--output-len).
UNBOUNDED = {
    ("bench", "-r"): "repetitions run until Ctrl-C, which keeps what they measured (llama-bench)",
    ("bench interference", "--rate"): "any rate past the prompts' count is all at once",
}


def _numbers() -> list[tuple[str, str, typing.Any]]:
    """(command, flag, upper end or None) for every whole or real number option."""
    kinds = ("int", "int range", "float", "float range")  # typer's click: "int", not "integer"
    return [
        (path, p.opts[0], getattr(p.type, "max", None))
        for path, p in _every_option()
        if _kind(p) in kinds
    ]


def test_every_number_has_an_upper_end_or_a_reason() -> None:
    unbounded = {(path, flag) for path, flag, high in _numbers() if high is None}
    assert unbounded == set(UNBOUNDED)
    assert len(_numbers()) > 40


@pytest.mark.parametrize(
    ("command", "flag", "high"), [n for n in _numbers() if n[2] is not None], ids=str
)
def test_a_number_past_its_upper_end_is_a_usage_error(command: str, flag: str, high: float) -> None:
    past = high + 1 if isinstance(high, int) else high * 2 + 1
    result = CliRunner().invoke(app, [*command.split(), flag, str(past)], env={"COLUMNS": "200"})
    assert result.exit_code == 2, (flag, result.output)
    assert f"{past} is not in the range" in result.output, result.output


@pytest.mark.parametrize(("command", "flag", "high"), _numbers(), ids=str)
def test_a_number_of_400_digits_is_past_every_option_and_is_not_echoed_whole(
    command: str, flag: str, high: float
) -> None:
    """A 400-digit value said "'9999…' is not a whole number", every digit echoed (a whole
    number it is; past what any option takes). A real number's option reads it as a float
    and says it is out of range."""
    value = "9" * 400
    result = CliRunner().invoke(app, [*command.split(), flag, value], env={"COLUMNS": "200"})
    assert result.exit_code == 2, (flag, result.output)
    assert value not in result.output, result.output
    said = " ".join(result.output.split())
    assert "is past any value it takes" in said or "is not in the range" in said, said


def _paths() -> list[tuple[str, str]]:
    return [(path, p.opts[0]) for path, p in _every_option() if _kind(p) in PATH_KINDS]


@pytest.mark.parametrize(("command", "flag"), _paths())
def test_an_empty_path_is_a_usage_error_that_names_no_folder(command: str, flag: str) -> None:
    """click's Path read '' as '.': `run -f ''` said `cannot read prompt file .: Is a
    directory`, and `--stats-file ''` failed only after the whole run."""
    result = CliRunner().invoke(app, [*command.split(), flag, ""], env={"COLUMNS": "200"})
    assert result.exit_code == 2, result.output
    assert "an empty path names no file" in result.output, result.output


def test_every_path_option_is_found() -> None:
    assert {("run", "-f"), ("run", "--stats-file"), ("bench", "--ppl")} <= set(_paths())


# Options that name a file to write, taken as text (checked by the command, not by click).
OUTPUT_PATHS = [
    ("run", "--stats-file"),
    ("bench", "--plot"),
    ("bench interference", "--plot"),
    ("history", "--export-sql"),
]
# A model path says "model file not found" for any name it cannot open; --draft also needs
# --temp 0 first.
NOT_READ_AS_FILES = {("run", "--draft-model"), ("chat", "--draft-model")}


@pytest.mark.parametrize(
    ("command", "flag"),
    [p for p in dict.fromkeys(_paths() + OUTPUT_PATHS) if p not in NOT_READ_AS_FILES],
)
def test_a_name_over_255_bytes_is_the_options_own_error(
    command: str, flag: str, tmp_path: Path
) -> None:
    """`--stats-file`, `bench --plot` and `--export-sql` with a 300-byte name said
    `llmrun: error: File name too long: <the whole path>`, naming no option; every path
    option says it as its other failures: the option, the path, then the reason."""
    long = str(tmp_path / ("a" * 300 + ".png"))
    prompt = ["hi"] if command == "run" and flag not in ("-f", "--jsonl") else []
    result = CliRunner().invoke(app, [*command.split(), flag, long, *prompt], input="")
    assert result.exit_code == 1, result.output
    [line] = result.stderr.splitlines()
    assert line.startswith(f"llmrun: error: {flag}"), line
    assert line.endswith("File name too long"), line


@pytest.mark.parametrize(("command", "flag", "high"), _numbers(), ids=str)
def test_a_value_that_is_no_number_is_named_so(command: str, flag: str, high: object) -> None:
    """typer's click said `'2.5' is not a valid int range.`"""
    whole = any(p.opts[0] == flag and "int" in p.type.name for p in _command(command).params)
    odd = ("²", "\u0663", "\uff13", "1_0")  # not ASCII digits, or Python's own spelling
    for given in ("2.5x", *odd) if not whole else ("2.5", *odd):
        result = CliRunner().invoke(app, [*command.split(), flag, given], env={"COLUMNS": "200"})
        assert result.exit_code == 2, result.output
        words = "a whole number" if whole else "a number"
        assert f"{given!r} is not {words}." in result.output, result.output


def _command(path: str) -> typing.Any:
    from llmrun.cli.app import build_command

    name, _, sub = path.partition(" ")
    command = build_command(name)
    return command.commands[sub] if sub else command  # type: ignore[union-attr]


def test_every_choice_is_read_in_any_case() -> None:
    """`-fa ON` and `--policy CHUNKED:8` passed while `--energy OFF` and `-o CSV` were refused."""
    choices = [(path, p) for path, p in _every_option() if _kind(p) == "choice"]
    assert {"--energy", "--output"} <= {p.opts[-1] for _, p in choices}
    for path, param in choices:
        for choice in param.type.choices:
            given = str(getattr(choice, "value", choice))
            assert param.type.convert(given.upper(), param, None) == param.type.convert(
                given, param, None
            ), (path, param.opts)


def test_serve_takes_flash_attention_and_no_warmup(monkeypatch: pytest.MonkeyPatch) -> None:
    """`serve -fa off --no-warmup` (llama-server's flags) was a usage error, though run's, chat's
    and the docs' table of shared options have both; they reach the engine's settings."""
    import llmrun.cli.serve as serve_command

    seen: list[typing.Any] = []
    monkeypatch.setattr(serve_command, "_serve", lambda settings, dashboard: seen.append(settings))
    result = CliRunner().invoke(app, ["serve", "-fa", "off", "--no-warmup"])
    assert result.exit_code == 0, result.output
    assert seen[0].engine.flash_attn == "off" and seen[0].engine.warmup is False
    result = CliRunner().invoke(app, ["serve"])
    assert seen[1].engine.flash_attn is None and seen[1].engine.warmup is True
