"""`llmrun run --json-schema FILE` and `--grammar FILE`: the answer held to a grammar.

The schema is made a grammar as `serve` makes `response_format`'s, with the same refusals by
name; a GBNF file goes to llama.cpp as it is. Both are parsed by llama.cpp's own parser before
the model loads, so a grammar it refuses is one line with its reason, exit 1.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from llmrun.cli.app import app
from llmrun.runners import grammar as grammar_module

from .fake import FakeRunner

CITY: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "capital": {"type": "boolean"},
    },
    "required": ["city", "capital"],
    "additionalProperties": False,
}


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_bytes(text.encode("utf-8", "surrogateescape"))  # \udce9: the byte 0xe9 alone
    return str(path)


def test_the_grammar_reaches_the_runners_sampling(
    cli: CliRunner, fake: FakeRunner, tmp_path: Path
) -> None:
    schema = write(tmp_path, "city.json", json.dumps(CITY))
    result = cli.invoke(app, ["run", "x", "--json-schema", schema])
    assert result.exit_code == 0, result.stderr
    grammar = fake.requests[0].sampling.grammar or ""
    assert "root ::=" in grammar and '\\"capital\\"' in grammar
    gbnf = write(tmp_path, "yn.gbnf", 'root ::= "yes" | "no"\n')
    assert cli.invoke(app, ["run", "x", "--grammar", gbnf]).exit_code == 0
    assert fake.requests[1].sampling.grammar == 'root ::= "yes" | "no"\n'
    assert cli.invoke(app, ["run", "x"]).exit_code == 0
    assert fake.requests[2].sampling.grammar is None


@pytest.mark.parametrize(
    ("name", "text", "words"),
    [
        (
            "min.json",
            '{"type": "integer", "minimum": 1}',
            "min.json: schema.minimum: not supported in structured output",
        ),
        ("bad.json", "{not json", "bad.json: not JSON"),
        (
            "long.json",
            '{"maxLength": ' + "9" * 5000 + "}",
            "long.json: a number of more than 4,300",
        ),
        # Python reads 1e999 as inf and NaN as nan: named as written, not "a count of at least 0"
        ("inf.json", '{"maxLength": 1e999}', "inf.json: holds 1e999, a number past the largest"),
        ("nan.json", '{"maxLength": NaN}', "nan.json: not valid JSON: NaN is not a JSON number"),
        (
            "half.json",
            '{"minLength": 2.5}',
            "schema.minLength: a whole count of at least 0, not 2.5",
        ),
        ("dq.json", '{"type": "string", "pattern": "^a**$"}', "schema.pattern: a pattern repeats"),
        ("d.json", '{"type": "string", "pattern": "^\\\\d+$"}', "schema.pattern: a pattern's"),
        ("broken.gbnf", 'root ::= "a" ((\n', "grammar parser refuses the grammar: expecting ')'"),
        ("nul.gbnf", 'root ::= "a" "\\x00"\n', "nul.gbnf: asks for the NUL character"),
        ("none.gbnf", "root ::= [^\\x00-\\U0010FFFF] # x\n", "none.gbnf: a character class that"),
        (
            "lt.gbnf",
            'root ::= <|im_end|> "<" ((\n',
            "grammar parser refuses the grammar: expecting ')'",
        ),
        ("bin.gbnf", "root ::= \x01" + "x" * 500, "end at ?xxxx"),
        (
            "deep.json",
            '{"type": "array", "items": ' * 600 + '{"type": "string"}' + "}" * 600,
            "deep.json: schema: nests too deep",
        ),
        # llama.cpp's parser recurses once per group: 30,000 crashed it (SIGSEGV)
        ("deep.gbnf", "root ::= " + "(" * 30000 + '"a"' + ")" * 30000, "nests 30,000 groups"),
        ("noroot.gbnf", 'start ::= "a" # root ::= "b"\n', "noroot.gbnf: it has no rule 'root'"),
        # llama.cpp aborted the process on the first token that spans "y" and !<[5]> ("yes")
        ("neg.gbnf", 'root ::= "y" !<[5]> "x"\n', "neg.gbnf: a negated token (!<...>) right after"),
        (
            "loop.json",
            json.dumps(
                {
                    "type": "object",
                    "properties": {"x": {"$ref": "#/$defs/a"}},
                    "$defs": {"a": {"$ref": "#/$defs/a"}},
                }
            ),
            "loop.json: schema: a $ref loop at #/$defs/a",
        ),
        (
            "left.json",
            json.dumps(
                {
                    "type": "object",
                    "properties": {"x": {"$ref": "#/$defs/a"}},
                    "$defs": {"a": {"anyOf": [{"$ref": "#/$defs/a"}, {"type": "null"}]}},
                }
            ),
            "left.json: schema: left recursion at #/$defs/a",
        ),
        # llama.cpp's parser allocated until the machine's memory ran out (24 GB, then SIGKILL)
        ("minmax.gbnf", 'root ::= "a"{5,2}\n', "minmax.gbnf: in rule 'root', the repetition {5,2}"),
        # its sampler followed every way to skip the copies: no output in 700 s, deaf to SIGTERM
        (
            "skips.gbnf",
            'root ::= x{0,1000}\nx ::= "a"{0,1000}\n',
            "skips.gbnf: in rule 'root', 80+ copies of what can match nothing (at most 8;",
        ),
        (
            "skips.json",
            json.dumps({"type": "string", "pattern": "^(a{0,999}){0,999}$"}),
            "skips.json: schema: in rule 'root', 80+ copies of what can match nothing",
        ),
        # 5,000 digits: past int()'s limit, an internal error before llama.cpp saw it
        (
            "huge.gbnf",
            'root ::= "a"{' + "9" * 5000 + "}\n",
            "huge.gbnf: llama.cpp's grammar parser",
        ),
        ("empty.gbnf", " \n", "empty.gbnf: the file is empty"),
        ("latin1.json", '{"enum": ["caf\udce9"]}', "latin1.json: not UTF-8 text (byte 14 is 0xe9)"),
        # llama.cpp parses these, then refuses them in its log, not on stderr: "not GBNF it reads"
        ("left.gbnf", 'root ::= x\nx ::= x "a" | "b"', "refuses the grammar: left recursion: a"),
        ("self.gbnf", "root ::= root", "refuses the grammar: left recursion: a rule can begin"),
        # the converter wrote a grammar for one bound, and the answer broke the other
        (
            "lengths.json",
            '{"type": "string", "minLength": 5, "maxLength": 2}',
            "schema: minLength 5 is above maxLength 2, so no value can be written",
        ),
        (
            "items.json",
            '{"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 0}',
            "schema: minItems 1 is above maxItems 0, so no value can be written",
        ),
        (
            "root.json",
            '{"type": "object", "properties": {"a": {"$ref": "#"}}}',
            "schema.properties.a.$ref: '#', the whole schema, is not supported",
        ),
    ],
)
def test_a_grammar_that_cannot_be_used_is_one_line_and_exit_1(
    cli: CliRunner, fake: FakeRunner, tmp_path: Path, name: str, text: str, words: str
) -> None:
    flag = "--grammar" if name.endswith(".gbnf") else "--json-schema"
    result = cli.invoke(app, ["run", "x", flag, write(tmp_path, name, text)])
    assert result.exit_code == 1, result.stderr
    assert result.stderr.startswith(f"llmrun: error: {flag} ")
    assert words in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert fake.requests == []


def test_a_missing_file_and_options_that_clash(
    cli: CliRunner, fake: FakeRunner, tmp_path: Path
) -> None:
    missing = str(tmp_path / "none.json")
    result = cli.invoke(app, ["run", "x", "--json-schema", missing])
    assert result.exit_code == 1
    assert result.stderr.startswith(
        f"llmrun: error: --json-schema: cannot read JSON schema {missing}: No such file"
    )
    schema = write(tmp_path, "city.json", json.dumps(CITY))
    gbnf = write(tmp_path, "yn.gbnf", 'root ::= "yes"\n')
    both = cli.invoke(app, ["run", "x", "--json-schema", schema, "--grammar", gbnf])
    assert both.exit_code == 2 and "one grammar at a time" in both.stderr
    drafted = cli.invoke(app, ["run", "x", "--grammar", gbnf, "--draft", "lookup", "--temp", "0"])
    assert drafted.exit_code != 0 and "--grammar: speculative decoding" in drafted.stderr
    remote = cli.invoke(app, ["run", "x", "--grammar", gbnf, "--endpoint", "http://127.0.0.1:9"])
    assert remote.exit_code != 0 and "--grammar: local-engine options" in remote.stderr
    stopped = cli.invoke(app, ["run", "x", "--json-schema", schema, "--stop", ","])
    assert stopped.exit_code == 2  # a stop string would cut the JSON and pass it as finished
    assert "--stop, --json-schema: a stop string cuts the answer" in stopped.stderr


def test_a_jsonl_lines_stop_beside_a_grammar_is_that_lines_error(
    cli: CliRunner, fake: FakeRunner, tmp_path: Path
) -> None:
    """--stop beside a grammar is refused; a JSONL line's "stop" is the same cut of the
    answer the grammar keeps whole: that line fails by name, the others are answered."""
    gbnf = write(tmp_path, "yn.gbnf", 'root ::= "yes" | "no"\n')
    lines = ['{"prompt": "a", "stop": ["e"]}', '{"prompt": "b", "stop": []}', '{"prompt": "c"}']
    jsonl = write(tmp_path, "p.jsonl", "\n".join(lines) + "\n")
    result = cli.invoke(app, ["run", "--jsonl", jsonl, "--grammar", gbnf])
    assert result.exit_code == 1, result.stderr
    assert f"{jsonl}:1: 'stop': not with --json-schema or --grammar" in result.stderr
    assert len(fake.requests) == 2 and all(not r.sampling.stop for r in fake.requests)


def test_the_answer_is_json_the_schema_accepts(
    cli: CliRunner, model_path: str, tmp_path: Path
) -> None:
    schema = write(tmp_path, "city.json", json.dumps(CITY))
    args = ["run", "Name a city as JSON.", "--json-schema", schema, "--temp", "0", "-n", "80"]
    result = cli.invoke(app, [*args, "-q"])
    assert result.exit_code == 0, result.stderr
    value = json.loads(result.stdout)
    assert set(value) == {"city", "capital"} and isinstance(value["capital"], bool)
    assert isinstance(value["city"], str) and len(value["city"]) <= 20


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("root ::= <[999999999]>\n", "<[999999999]> is no token of the model's 49,152"),
        ('root ::= "yes" <|im_end|>\n', "<|im_end|> ends the generation"),
        ('root ::= "yes" <[2]>\n', "<[2]> ends the generation"),
        ('root ::= <nosuchtoken> "x"\n', "<nosuchtoken> is not one token of the model's"),
    ],
)
def test_a_token_the_sampler_would_abort_on_is_one_line(
    cli: CliRunner, model_path: str, tmp_path: Path, text: str, words: str
) -> None:
    """llama.cpp's parser takes any token id, and its sampler aborted the process (SIGABRT) on
    an id past the vocabulary or on an end-of-generation token the grammar still expected."""
    gbnf = write(tmp_path, "t.gbnf", text)
    result = cli.invoke(app, ["run", "Say yes.", "--grammar", gbnf, "-n", "4", "-q"])
    assert result.exit_code == 1, result.stderr
    assert f"llmrun: error: the grammar (--json-schema, --grammar): {words}" in result.stderr


def test_a_negated_token_at_a_token_boundary_is_followed(
    cli: CliRunner, model_path: str, tmp_path: Path
) -> None:
    """At the start of the answer nothing spans the negated token: the grammar is kept."""
    gbnf = write(tmp_path, "neg.gbnf", 'root ::= !<[5]> "x"\n')
    result = cli.invoke(app, ["run", "Say yes.", "--grammar", gbnf, "-n", "6", "--temp", "0"])
    assert result.exit_code == 0, result.stderr
    assert result.stdout.rstrip("\n").endswith("x")


def test_a_gbnf_grammar_is_followed(cli: CliRunner, model_path: str, tmp_path: Path) -> None:
    gbnf = write(tmp_path, "yn.gbnf", 'root ::= "yes" | "no"\n')
    args = ["run", "Is the sky blue?", "--grammar", gbnf, "--temp", "0.8", "--seed", "3", "-q"]
    result = cli.invoke(app, args)
    assert result.exit_code == 0, result.stderr
    assert result.stdout.strip() in ("yes", "no")


def test_a_grammar_is_parsed_once_before_the_load_and_once_on_the_vocabulary(
    cli: CliRunner, model_path: str, tmp_path: Path
) -> None:
    """The early check parses the grammar without a vocabulary (it cannot sample); the model's
    parse is kept, and every request after the first gets a copy of it."""
    schema = write(tmp_path, "city.json", json.dumps(CITY))
    prompts = [a for i in range(3) for a in ("-f", write(tmp_path, f"{i}.txt", f"City {i}?"))]
    before = grammar_module.PARSES
    result = cli.invoke(app, ["run", *prompts, "--json-schema", schema, "-n", "4", "-q"])
    assert result.exit_code == 0, result.stderr
    assert grammar_module.PARSES - before == 2
