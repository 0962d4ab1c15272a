"""Grammars llama.cpp cannot take are refused before the engine sees them, naming the field.

The bindings' converter copies a pattern's escapes it does not translate (\\d, \\w, \\., \\-) into
the grammar, where llama.cpp's parser refuses them; a pattern that asks for the NUL character
gives a grammar llama.cpp's sampler can never follow (it aborted the whole server); and what the
parser refuses for any other reason ended the request as a 500 once the engine admitted it.
Each is a 400 naming the request's field, and the server goes on serving.
"""

from __future__ import annotations

import ctypes
import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from llmrun.runners import grammar as grammar_module
from llmrun.runners.base import Request, SamplingParams
from llmrun.runners.errors import BadRequestError
from llmrun.runners.grammar import (
    MAX_CHOICES,
    Grammars,
    grammar_fault,
    negated_token_after_text,
    repetition_fault,
    schema_grammar,
)
from llmrun.runners.library import llama_lib
from llmrun.runners.llamacpp import LlamaCppRunner
from llmrun.runners.serving.batching import Arrival, BatchedEngine
from llmrun.runners.serving.policy import Policy

from .test_serve import Server, chat, llmrun_serve, serve_env  # noqa: F401  (fixture)

CHAT = "/v1/chat/completions"
WHERE = "response_format.json_schema.schema"


def code_schema(pattern: str) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": pattern}},
        "required": ["code"],
    }


def json_schema(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "code", "schema": schema}}


@pytest.mark.parametrize(
    ("pattern", "words"),
    [
        (r"^\d{3}-\d{4}$", r"escape \d is not one llama.cpp's grammar reads"),
        (r"^[a-z]+@x\.com$", r"escape \. is not one"),
        (r"^[\d-z]$", r"escape \d is not one"),
        (r"^\w+$", r"escape \w is not one"),
        (r"^a\fb$", r"escape \f is not one"),
        ("^\x00$", "the NUL character"),
        (r"^\u0000$", "the NUL character"),
        (r"^[\x00]$", "the NUL character"),
        (r"^[\x00-\x00]$", "the NUL character"),
        ("^\ud800$", "a lone surrogate"),
        ("^a**$", "repeats a repetition"),
        ("^a?+$", "repeats a repetition"),
        (r"^\$", "did not translate into a grammar llama.cpp reads"),
        # llama.cpp reads these, but the answer would hold a raw newline, tab or backslash
        (r"^\x41\n\t$", "a pattern that can write a quote, a backslash or a control"),
        (r"^[\]\\]$", "a pattern that can write a quote, a backslash or a control"),
    ],
)
def test_a_pattern_llama_cpp_cannot_take_is_refused_by_its_path(pattern: str, words: str) -> None:
    with pytest.raises(BadRequestError) as e:
        schema_grammar(code_schema(pattern), WHERE)
    assert str(e.value).startswith(f"{WHERE}.properties.code.pattern: ")
    assert words in str(e.value)


@pytest.mark.parametrize("value", ['say "hi"', "a\\b", "two\nlines", ["ok", "tab\there"]])
def test_a_value_the_converter_would_write_unescaped_is_refused(value: Any) -> None:
    """The converter puts `json.dumps(value)` into a grammar literal as it is, so its escapes
    are read as the grammar's: a const "a\\nb" would make the model write a raw newline."""
    key = "enum" if isinstance(value, list) else "const"
    with pytest.raises(BadRequestError, match=rf"^{WHERE}\.{key}: a string with a quote"):
        schema_grammar({key: value}, WHERE)
    assert "root ::=" in schema_grammar({"const": "café"}, WHERE)  # past ASCII: kept


@pytest.mark.parametrize(
    "pattern", [r"^[0-9]{3}-[.]$", r"^[^\x00-\x1f]+$", r"^[\]a]$", r"^\($", r"^[^@]+@.+$"]
)
def test_patterns_llama_cpp_reads_are_kept(pattern: str) -> None:
    assert "root ::=" in schema_grammar(code_schema(pattern), WHERE)


def test_a_patterns_top_level_alternatives_stay_inside_the_strings_quotes() -> None:
    grammar = schema_grammar({"type": "string", "pattern": "^yes|no$"}, WHERE)
    assert grammar.startswith('root ::= "\\"" ("ye" "s" | "n" "o") "\\""'), grammar
    enum = schema_grammar({"enum": ["^a|b$"]}, WHERE)  # a value, not a pattern: as it is
    assert "^a|b$" in enum


@pytest.mark.parametrize("name", ["default", "enum", "const", "examples", "x"])
def test_a_property_is_a_schema_whatever_its_name(name: str) -> None:
    """The walk that groups a pattern's alternatives skipped every key named like a value
    keyword, property names included: `"default": {"pattern": "^a|b$"}` made a grammar for
    `"a` or `b"`, not a JSON string."""
    schema = {"type": "object", "properties": {name: {"type": "string", "pattern": "^a|b$"}}}
    rules = schema_grammar({**schema, "required": [name]}, WHERE).splitlines()
    assert f'{name} ::= "\\"" ("a" | "b") "\\"" space' in rules, rules


@pytest.mark.parametrize(
    ("grammar", "copies"),
    [
        ("root ::= x{0,9}\nx ::= [a-z]{0,100}\n", 9),  # a count of what can be empty
        ("root ::= " + "[a-z]? " * 48, 16),  # written out alike: a third each
        ("root ::= y{0,3}\ny ::= x{0,3}\nx ::= [a-z]?\n", 12),  # through rules: 3 x (3 + 1)
        ('root ::= (x{0,4}){0,4}\nx ::= "a"?\n', 20),  # in a count: copies of copies
        ("root ::= x{0,8}\nx ::= [a-z]{0,100}\n", None),
        ("root ::= " + "[a-z]? " * 24, None),  # 0.3 s for 8 tokens
        ("root ::= [0-9] " + "[0-9]? " * 9, None),  # up to ten digits, written out
        ('root ::= ws ws ws ws ws ws ws ws ws "x"\nws ::= [ ]?\n', None),
        ('root ::= x x x x x x x x x x\nx ::= "a"?\n', None),
        ('root ::= x{0,120}\nx ::= "a"{1,10}\n', None),  # never empty: one way to read it
        ("root ::= [a-z]{0,3200}\n", None),
        ('root ::= item ("," item)*\nitem ::= [a-z]+ | ""\n', None),
        ('root ::= list\nlist ::= "[" (v ("," list)?)? "]"\nv ::= [0-9]*\n', None),
        ('root ::= "a"{' + "9" * 5000 + "}\n", None),  # past int()'s digits: llama.cpp refuses it
        (
            'root ::= x? "," x? "," x? "," x? "," x? "," x? "," x? "," x? "," x? "," x?\nx ::= "a"?',
            None,
        ),
    ],
)
def test_copies_of_what_can_match_nothing_are_counted(grammar: str, copies: int | None) -> None:
    """llama.cpp's sampler follows every way to skip such copies: `x{0,16}` of `[a-z]{0,100}`
    took 11 s for 8 tokens, `x{0,24}` more than a minute, `x{0,1000}` never ended."""
    fault = repetition_fault(grammar)
    if copies is None:
        assert fault is None, fault
    else:
        assert fault is not None and f"{copies} copies of what can match nothing" in fault, fault


def test_a_schema_whose_grammar_repeats_what_can_be_empty_is_refused_and_one_that_does_not_kept() -> (
    None
):
    with pytest.raises(BadRequestError, match="16 copies of what can match nothing"):
        schema_grammar(code_schema("^([a-z]{0,100}){0,16}$"), WHERE)
    for pattern in ("^([a-z]{0,100}){0,8}$", "^(a?){2,3}$", "^(ab?)*c$", "^[a-z]{0,1000}$"):
        assert "root ::=" in schema_grammar(code_schema(pattern), WHERE)
    properties = {f"p{i}": {"type": "string", "maxLength": 50} for i in range(40)}  # optional
    assert "root ::=" in schema_grammar({"type": "object", "properties": properties}, WHERE)


def test_the_count_of_copies_reads_a_large_grammar_in_one_pass() -> None:
    """Weighing every rule again until none changed took 3.6 s for a schema of 100 array
    properties and stopped before it settled past 64 of them; each rule is weighed after the
    rules it names now, and again only when one of those changes."""
    chain = "root ::= r0\n" + "".join(f'r{i} ::= "a" r{i + 1}?\n' for i in range(3000))
    weighed: list[str] = []
    real = grammar_module._weighed

    def counted(body: Any, rules: Any, worst: Any, rule: str, keys: Any) -> Any:
        weighed.append(rule)
        return real(body, rules, worst, rule, keys)

    grammar_module._weighed = counted
    try:
        assert repetition_fault(chain + 'r3000 ::= x{0,9}\nx ::= "a"?\n') is not None
    finally:
        grammar_module._weighed = real
    assert len(weighed) < 2 * 3003, len(weighed)


def test_a_character_past_u_ffff_is_one_character_not_two_surrogates() -> None:
    """The converter writes 😀 in an enum, a const or a property's name as JSON does, a pair of
    \\u escapes, which llama.cpp reads as two lone surrogates: such a schema was refused."""
    grammar = schema_grammar({"type": "object", "properties": {"😀": {"enum": ["👍", "é"]}}}, WHERE)
    assert "\\U0001f600" in grammar and "\\U0001f44d" in grammar and "\\u00e9" in grammar
    assert grammar_fault(grammar) is None
    with pytest.raises(BadRequestError, match="a lone surrogate"):  # a lone one still is
        schema_grammar(code_schema("^\ud800$"), WHERE)


def test_a_schema_nested_past_pythons_limit_is_refused_by_name() -> None:
    deep: dict[str, Any] = {"type": "string"}
    for _ in range(600):
        deep = {"type": "array", "items": deep}
    with pytest.raises(BadRequestError, match=rf"^{WHERE}: nests too deep"):
        schema_grammar(deep, WHERE)
    enum: list[Any] = []
    for _ in range(1500):
        enum = [enum]
    with pytest.raises(BadRequestError, match=rf"^{WHERE}: nests too deep"):
        schema_grammar({"enum": enum}, WHERE)


def test_a_choice_among_thousands_is_refused_by_its_path() -> None:
    """Grammar sampling follows every open alternative at each token: an enum of 20,000 values
    took 45 s for 6 tokens, holding every other sequence of the server meanwhile."""
    many = [f"v{i}" for i in range(MAX_CHOICES + 1)]
    with pytest.raises(BadRequestError, match=rf"^{WHERE}.enum: 1,001 choices; at most 1,000"):
        schema_grammar({"enum": many}, WHERE)
    options = [{"const": v} for v in many]
    with pytest.raises(BadRequestError, match=rf"^{WHERE}.properties.a.anyOf: 1,001 choices"):
        schema_grammar({"type": "object", "properties": {"a": {"anyOf": options}}}, WHERE)
    assert "root ::=" in schema_grammar({"enum": many[:MAX_CHOICES]}, WHERE)


def test_the_grammar_check_reads_escapes_as_llama_cpp_does() -> None:
    assert grammar_fault(r'root ::= "\x41\u00e9\U0001F600\t\r\n\\\"\[\]" [^\x00-\x1f]') is None
    assert grammar_fault(r'root ::= "\x4"') is not None  # too few hex digits
    assert grammar_fault(r"root ::= [\x00-\x1f]") is None  # NUL among others: fine


def test_llama_cpps_own_parser_is_the_last_gate(runner: LlamaCppRunner) -> None:
    grammars = Grammars(llama_lib(), runner.vocab())
    with pytest.raises(BadRequestError, match=rf"^{WHERE}: llama.cpp's grammar parser refuses"):
        grammars.check('root ::= "a" ((', WHERE)
    grammars.check(schema_grammar(code_schema("^[a-z]+$"), WHERE), WHERE)


def in_property(defs: dict[str, Any]) -> dict[str, Any]:
    """A schema whose property x is #/$defs/a, with these $defs."""
    return {
        "type": "object",
        "properties": {"x": {"$ref": "#/$defs/a"}},
        "required": ["x"],
        "$defs": defs,
    }


REF_LOOP = in_property({"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}})
LEFT_RECURSION = in_property({"a": {"anyOf": [{"$ref": "#/$defs/a"}, {"type": "string"}]}})


def test_a_ref_loop_and_left_recursion_are_named() -> None:
    """The converter makes both into a rule that begins with itself, which llama.cpp refuses
    (it said only that its parser refused "a pattern it cannot read?")."""
    with pytest.raises(BadRequestError) as e:
        schema_grammar(REF_LOOP, WHERE)
    assert str(e.value).startswith(
        f"{WHERE}: a $ref loop at #/$defs/a (#/$defs/a -> #/$defs/b -> #/$defs/a)"
    )
    with pytest.raises(BadRequestError) as e:
        schema_grammar({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, WHERE)
    assert str(e.value).startswith(f"{WHERE}: a $ref loop at #/$defs/a")
    with pytest.raises(BadRequestError) as e:
        schema_grammar(LEFT_RECURSION, WHERE)
    assert str(e.value).startswith(f"{WHERE}: left recursion at #/$defs/a (#/$defs/a -> #/$defs/a)")
    # recursion inside an array or an object begins with its bracket: a grammar llama.cpp takes
    for inside in (
        {"type": "array", "items": {"$ref": "#/$defs/a"}},
        {"type": "object", "properties": {"k": {"$ref": "#/$defs/a"}}},
        {"anyOf": [{"type": "array", "items": {"$ref": "#/$defs/a"}}, {"type": "null"}]},
    ):
        assert "root ::=" in schema_grammar(in_property({"a": inside}), WHERE)


# pydantic's schema of a recursive model: the root a $ref beside the $defs that use it
PYDANTIC_NODE = {
    "$defs": {
        "Node": {
            "properties": {"children": {"items": {"$ref": "#/$defs/Node"}, "type": "array"}},
            "required": ["children"],
            "type": "object",
        }
    },
    "$ref": "#/$defs/Node",
}


def test_a_left_recursion_reason_is_read_once() -> None:
    """llama.cpp says left recursion in its log, after parsing: the reason belongs to the parse
    that was refused, not to whatever the thread asks next."""
    from llmrun.runners.grammar import LEFT_RECURSION, parses, refusal_reason

    assert not parses(None, "root ::= root")
    assert refusal_reason("") == LEFT_RECURSION
    said = "parse: error parsing grammar: expecting name at x"
    assert refusal_reason(said) == "expecting name at x"


def test_a_root_ref_beside_its_defs_is_made_a_grammar() -> None:
    """The converter follows a $ref and never looks beside it, so the refs inside the $defs
    were never resolved: `cannot be made a grammar: '#/$defs/Node'`, for the schema pydantic
    writes for every recursive model, in run, response_format and a forced tool call."""
    from llmrun.runners.serving.tools import tool_plan

    grammar = schema_grammar(PYDANTIC_NODE, WHERE)
    assert "Node-children-item ::= Node" in grammar and "root ::= alternative-0" in grammar
    plan = tool_plan(
        [{"type": "function", "function": {"name": "t", "parameters": PYDANTIC_NODE}}], "required"
    )
    assert plan is not None and "Node-children-item ::= Node" in (plan.grammar() or "")


def test_refs_are_followed_only_where_a_value_can_use_them() -> None:
    """A $ref in an annotation's JSON is not a schema (it once reached the loop finder and
    raised a bare KeyError: an internal error in run, a 500 in serve), and a loop in a
    definition nothing names writes no rule, so it is not refused."""
    with pytest.raises(BadRequestError) as e:
        schema_grammar({"type": "string", "description": {"$ref": "#/nope"}}, WHERE)
    assert str(e.value).startswith(f"{WHERE}: cannot be made a grammar")
    unused = {"type": "string", "$defs": {"a": {"$ref": "#/$defs/a"}}}
    assert "root ::=" in schema_grammar(unused, WHERE)
    # a loop reached only through a definition that the root names is still found
    through = in_property({"b": {"type": "object", "properties": {"k": {"$ref": "#/$defs/a"}}}})
    through["properties"]["x"] = {"$ref": "#/$defs/b"}
    through["$defs"]["a"] = {"$ref": "#/$defs/c"}
    through["$defs"]["c"] = {"$ref": "#/$defs/a"}
    with pytest.raises(BadRequestError) as e:
        schema_grammar(through, WHERE)
    assert "a $ref loop at #/$defs/a" in str(e.value)


@pytest.mark.parametrize(
    ("grammar", "where"),
    [
        ('root ::= "y" !<[5]> "x"', "in rule 'root'"),
        ('root ::= [a-z] ( "q" | !<[3]> )', "in rule 'root'"),
        ('root ::= a b\na ::= "q" | ""\nb ::= !<[3]>', "in rule 'root'"),
        ('root ::= (!<[5]> "x")*', "in rule 'root', a repetition"),
        ('root ::= (!<[5]> "x"){2,}', "in rule 'root', a repetition"),
        ('root ::= !<[5]> "x"', None),  # the answer's start: a token boundary
        ('root ::= <[7]> !<[5]> "x"', None),  # after a token: one too
        ('root ::= (!<[5]> "x")?', None),
        ('root ::= "" !<[3]> # "a" !<[3]>', None),
        ('root ::= "y" <[5]> "x"', None),  # a token by its id: only that one token matches
        ('root ::= "y!<[5]>" "x"', None),
    ],
)
def test_a_negated_token_right_after_text_is_found(grammar: str, where: str | None) -> None:
    """llama.cpp 0.3.36 checks a candidate against !<[5]> by its id alone: a token that ends
    the text before it and goes on passes, then leaves the grammar no stack, and its sampler's
    exception aborts the process."""
    assert negated_token_after_text(grammar) == where


# ---- each grammar parsed once --------------------------------------------------------------


def test_a_grammar_is_parsed_once_and_its_copies_are_free(runner: LlamaCppRunner) -> None:
    lib = llama_lib()
    grammars = Grammars(lib, runner.vocab())
    grammar = schema_grammar(code_schema("^[a-z]+$"), WHERE)
    try:
        before = grammar_module.PARSES
        grammars.check(grammar, WHERE)
        copies = [grammars.fresh(grammar) for _ in range(3)]
        assert grammar_module.PARSES - before == 1
        addresses = {ctypes.cast(ptr, ctypes.c_void_p).value for ptr in copies}
        assert None not in addresses and len(addresses) == 3  # three grammars of their own
        for ptr in copies:
            lib.llama_sampler_free(ptr)
    finally:
        grammars.close()


def test_a_refused_grammar_is_one_reason_and_nothing_on_stderr(
    runner: LlamaCppRunner, capfd: pytest.CaptureFixture[str]
) -> None:
    """llama.cpp's parser prints its refusal, and the whole grammar, on C's stderr: a server
    printed it for every request that sent the grammar. Now it is the 400's reason, once."""
    grammars = Grammars(llama_lib(), runner.vocab())
    try:
        before = grammar_module.PARSES
        for _ in range(3):
            with pytest.raises(BadRequestError) as e:
                grammars.check('root ::= "a" ((', WHERE)
            assert str(e.value) == (
                f"{WHERE}: llama.cpp's grammar parser refuses the grammar made from it:"
                " expecting ')' at"
            )
        assert grammar_module.PARSES - before == 1
        assert grammars.fresh('root ::= "a" ((') is None
    finally:
        grammars.close()
    assert "error parsing grammar" not in capfd.readouterr().err


def test_one_stderr_swap_for_the_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two swappers, each under its own lock, could leave C's stderr on a closed file: the
    first callers, from many threads at once, all get the one."""
    monkeypatch.setattr(grammar_module, "_C_STDERR", None)
    start = threading.Barrier(8)
    got: list[object] = []

    def first_call() -> None:
        start.wait()
        got.append(grammar_module._c_stderr())

    threads = [threading.Thread(target=first_call) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 8 and len({id(g) for g in got}) == 1


@pytest.mark.parametrize(
    ("platform_name", "libc", "expected"),
    [
        ("linux", ("glibc", "2.36"), "stderr"),
        ("linux", ("", ""), None),  # musl: `FILE *const stderr`, never written
        ("darwin", ("", ""), "__stderrp"),
        ("freebsd14", ("", ""), None),
    ],
)
def test_stderr_is_swapped_only_where_the_c_library_reads_the_variable(
    monkeypatch: pytest.MonkeyPatch, platform_name: str, libc: tuple[str, str], expected: str | None
) -> None:
    monkeypatch.setattr(grammar_module.sys, "platform", platform_name)
    monkeypatch.setattr(grammar_module.platform, "libc_ver", lambda: libc)
    assert grammar_module._writable_stderr() == expected


def test_without_the_swap_a_refusal_is_still_one_400(
    runner: LlamaCppRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(grammar_module, "_C_STDERR", None)
    monkeypatch.setattr(grammar_module, "_writable_stderr", lambda: None)
    grammars = Grammars(llama_lib(), runner.vocab())
    try:
        with pytest.raises(BadRequestError) as e:
            grammars.check('root ::= "a" ((', WHERE)
        assert str(e.value).endswith("a pattern it cannot read?")
    finally:
        grammars.close()


def test_refusals_parsed_from_many_threads_each_keep_their_reason(
    runner: LlamaCppRunner, capfd: pytest.CaptureFixture[str]
) -> None:
    grammars = Grammars(llama_lib(), runner.vocab())
    reasons: list[str] = []

    def refuse(i: int) -> None:
        try:
            grammars.check(f'root ::= "{i}" ((', WHERE)
        except BadRequestError as e:
            reasons.append(str(e))

    try:
        threads = [threading.Thread(target=refuse, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        grammars.close()
    assert len(reasons) == 8 and all(r.endswith("expecting ')' at") for r in reasons)
    assert "error parsing grammar" not in capfd.readouterr().err


def test_the_engine_copies_the_grammar_its_check_parsed(runner: LlamaCppRunner) -> None:
    grammar = schema_grammar(code_schema("^[a-z]+$"), WHERE)
    prompt = tuple(runner.request_tokens(Request.chat("Write a word.")))
    sampling = SamplingParams(max_tokens=6, temperature=0)
    with BatchedEngine(runner, n_seq=1, n_ctx_per_seq=256) as engine:
        before = grammar_module.PARSES
        engine.grammars.check(grammar, WHERE)
        for _ in range(2):
            (result,), _ = engine.run(
                [Arrival(0.0, prompt, 6, False, sampling, grammar)], Policy("prefill-first")
            )
            assert result.finish in ("stop", "length"), result.error
        assert grammar_module.PARSES - before == 1


# ---- on a real `llmrun serve` ------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(serve_env: dict[str, str]) -> Iterator[Server]:  # noqa: F811
    with llmrun_serve(serve_env, "--no-dashboard") as s:
        yield s


def forced_tool(parameters: dict[str, Any]) -> dict[str, Any]:
    return {
        "tools": [{"type": "function", "function": {"name": "f", "parameters": parameters}}],
        "tool_choice": "required",
    }


@pytest.mark.parametrize(
    ("fields", "where"),
    [
        (
            {"response_format": json_schema({"type": "string", "pattern": "^a**$"})},
            f"{WHERE}.pattern: a pattern repeats",
        ),
        ({"response_format": json_schema(code_schema("^\x00$"))}, f"{WHERE}.properties.code"),
        (
            forced_tool({"type": "object", "properties": {"a": {"pattern": "^a?+$"}}}),
            "tools.0.function.parameters.properties.a.pattern",
        ),
        ({"response_format": json_schema({"enum": ["\x00"]})}, f"{WHERE}.enum"),
        ({"response_format": json_schema(REF_LOOP)}, f"{WHERE}: a $ref loop at #/$defs/a"),
        (
            forced_tool(LEFT_RECURSION),
            "tools.0.function.parameters: left recursion at #/$defs/a",
        ),
    ],
)
def test_a_grammar_llama_cpp_refuses_is_a_400_naming_the_field(
    server: Server, fields: dict[str, Any], where: str
) -> None:
    r = server.post(CHAT, chat("Write the code.", max_tokens=8, temperature=0, **fields))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith(where)
    again = server.post(CHAT, chat("Hi", max_tokens=2, temperature=0))
    assert again.status_code == 200, again.text  # the server lived through it


def test_a_pattern_with_alternatives_gives_a_json_string(server: Server) -> None:
    schema = {"type": "string", "pattern": "^yes|no$"}
    body = chat("Yes or no?", max_tokens=8, temperature=0, response_format=json_schema(schema))
    r = server.post(CHAT, body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert json.loads(choice["message"]["content"]) in ("yes", "no")


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"response_format": {"type": "json_object"}}, "response_format"),
        (
            {
                "response_format": json_schema(
                    {
                        "type": "object",
                        "properties": {"name": {"type": "string", "maxLength": 12}},
                        "required": ["name"],
                        "additionalProperties": False,
                    }
                )
            },
            "response_format",
        ),
        (forced_tool({"type": "object", "properties": {"a": {"type": "string"}}}), "tools"),
    ],
)
def test_a_stop_string_beside_a_grammar_is_a_400_naming_stop(
    server: Server, fields: dict[str, Any], field: str
) -> None:
    """A stop string inside the grammar's JSON would cut it and end the answer with `stop`,
    the reason a finished, valid answer gets (issue 31: valid JSON every time, or a clear
    finish_reason): so `stop` is refused beside a grammar."""
    body = chat("Give a city as JSON.", max_tokens=60, temperature=0, stop=[","], **fields)
    r = server.post(CHAT, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith(f"stop: not served together with {field}")
    free = server.post(CHAT, chat("Hi", max_tokens=2, temperature=0, stop=[","]))
    assert free.status_code == 200, free.text  # stop without a grammar stays served


def test_the_servers_own_stop_strings_stay_out_of_a_grammars_json(
    serve_env: dict[str, str],  # noqa: F811
) -> None:
    """`serve --stop ,` sets every request's default stop strings; one with a grammar did not
    ask for them, and a comma inside its JSON would cut it: they do not apply there."""
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "country": {"type": "string", "maxLength": 12},
        },
        "required": ["name", "country"],
        "additionalProperties": False,
    }
    body = chat(
        "Give a city as JSON.",
        max_tokens=60,
        temperature=0,
        response_format=json_schema(schema),
    )
    with llmrun_serve(serve_env, "--no-dashboard", "--stop", ",") as s:
        r = s.post(CHAT, body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    assert set(json.loads(choice["message"]["content"])) == {"name", "country"}
