"""Each sampling setting is declared once (runners/limits.py `SAMPLING_SETTINGS`): its range
and its names in JSONL lines and HTTP bodies. The command line's options, `run --jsonl` and
`llmrun serve` all read it from there, so they cannot drift apart."""

from __future__ import annotations

import dataclasses
import typing

import click
import pytest

from llmrun.cli import inputs, options
from llmrun.runners.base import SamplingParams
from llmrun.runners.limits import SAMPLING_SETTINGS, SettingError, check_sampling
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
    past: typing.Any = s.high + (1 if s.whole else 0.5)
    with pytest.raises(SettingError):
        check_sampling(dataclasses.replace(SamplingParams(), **{name: past}))
    for key in s.jsonl:
        with pytest.raises(SettingError):
            inputs.parse_jsonl_line(
                f'{{"prompt": "x", "{key}": {past}}}',
                system=None,
                raw=False,
                sampling=SamplingParams(),
            )
    for key in s.http:
        body = api_models.ChatBody.model_validate(
            {"messages": [{"role": "user", "content": "x"}], key: past}
        )
        with pytest.raises(SettingError):
            body.sampling(SamplingParams())
    field = OPTION_OF.get(name, name)
    if field in {f.name for f in dataclasses.fields(options.SamplingOptions)}:
        declared = _typer_option(field)
        kind: typing.Any = click.IntRange if s.whole else click.FloatRange
        with pytest.raises(click.BadParameter):
            kind(declared.min, declared.max).convert(past, None, None)
