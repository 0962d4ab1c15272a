"""Structured output in `llmrun serve`: `response_format` through llama.cpp's grammar sampler.

A schema whose keywords the grammar keeps gives an answer that is JSON the schema accepts, every
time (sampled with several seeds, streamed and whole, through OpenAI's own client's `parse()`);
a keyword it would not keep is refused by name, before anything is generated.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx2 as httpx
import pytest

from llmrun.runners.errors import BadRequestError
from llmrun.runners.grammar import response_grammar, schema_grammar

from .conftest import HANG_S
from .test_serve import Server, chat, llmrun_serve, serve_env, sse_events  # noqa: F401  (fixture)

CHAT = "/v1/chat/completions"
# Every string and array is bounded: the grammar's answer is short, so it must end with `stop`.
PERSON: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer"},
        "city": {"enum": ["Paris", "Lima", "Oslo"]},
        "likes": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
        "nick": {"anyOf": [{"type": "string", "maxLength": 8}, {"type": "null"}]},
    },
    "required": ["name", "age", "city", "likes", "nick"],
    "additionalProperties": False,
}


def json_schema(schema: dict[str, Any], name: str = "person") -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def check_person(value: Any) -> None:
    """PERSON's constraints, checked by hand (the jsonschema package is not a dependency)."""
    assert isinstance(value, dict) and set(value) == set(PERSON["properties"]), value
    assert isinstance(value["name"], str) and len(value["name"]) <= 12
    assert isinstance(value["age"], int) and not isinstance(value["age"], bool)
    assert value["city"] in ("Paris", "Lima", "Oslo")
    assert isinstance(value["likes"], list) and len(value["likes"]) <= 3
    assert all(isinstance(x, bool) for x in value["likes"])
    assert value["nick"] is None or (isinstance(value["nick"], str) and len(value["nick"]) <= 8)


# ---- the schema's keywords (no model) ---------------------------------------------------------


def test_text_asks_for_no_grammar_and_json_asks_for_one() -> None:
    assert response_grammar(None) is None
    assert response_grammar({"type": "text"}) is None
    assert "root ::=" in (response_grammar({"type": "json_object"}) or "")
    grammar = response_grammar(json_schema(PERSON)) or ""
    assert "root ::=" in grammar and '\\"city\\"' in grammar


@pytest.mark.parametrize(
    ("schema", "words"),
    [
        ({"type": "integer", "minimum": 0}, "schema.minimum: not supported"),
        ({"type": "array", "uniqueItems": True}, "schema.uniqueItems: not supported"),
        (
            {"type": "object", "properties": {"a": {"type": "number", "multipleOf": 2}}},
            "schema.properties.a.multipleOf: not supported",
        ),
        ({"allOf": [{"type": "object"}]}, "schema.allOf: not supported"),
        ({"not": {"type": "null"}}, "schema.not: not supported"),
        ({"type": "string", "format": "email"}, 'format: "email" is not supported'),
        ({"type": "string", "pattern": "^a+$", "maxLength": 3}, "pattern, maxLength together"),
        (
            {"type": ["string", "null"], "maxLength": 3},
            "maxLength with a list of types is not supported",
        ),
        (
            {"type": "object", "properties": {}, "required": ["x"]},
            "required: x not among the properties",
        ),
        ({"$ref": "https://example.com/s.json"}, "only references inside the schema"),
        ({"$ref": "#/$defs/missing"}, "names nothing in the schema"),
        ({"type": "text"}, 'type: "text" is not a JSON schema type'),
        ({"type": "string", "pattern": "a+"}, "cannot be made a grammar"),
        # a keyword's value of the wrong JSON type: TypeError tracebacks (500s) before
        ({"type": "array", "prefixItems": True}, "prefixItems: a list of schemas, not true"),
        ({"type": "array", "prefixItems": "ab"}, 'prefixItems: a list of schemas, not "ab"'),
        ({"type": {}}, "type: an object is not a JSON schema type"),
        ({"type": ["string", ["null"]]}, "type: an array is not a JSON schema type"),
        ({"type": "string", "format": []}, "format: an array is not supported"),
        ({"items": list(range(10**5))}, "schema.items.0: a schema is an object, not 0"),
        ({"anyOf": ["x" * 10**5]}, "anyOf.0: a schema is an object, not a string"),
        # what the grammar would write is no JSON: `Infinity`, a raw quote, tab or backslash
        ({"enum": [1e999]}, "enum: a number past the floats (1e999) or NaN is no JSON value"),
        # a count past the floats (1e999 reads as inf) was "a count of at least 0"
        ({"maxItems": 1e999}, "maxItems: a whole count of at least 0, not a number past the"),
        ({"minLength": "3"}, 'minLength: a whole count of at least 0, not "3"'),
        ({"type": "object", "properties": {"a": {"const": [-1e999]}}}, "properties.a.const: a"),
        *(
            ({"type": "string", "pattern": p}, "pattern: a pattern that can write a quote")
            for p in ("^\\\\$", '^a"$', "^\\t$", "^[\\n-\\r]$", "^[\u0001-\u0002]$", "^\t$")
        ),
        # no regular expression: the converter wrote a grammar for something else, or none
        *(
            ({"type": "string", "pattern": p}, "pattern: not a regular expression")
            for p in ("^[z-a]$", "^((((a$", "^a{2,1}$", "^a{1000}{1000}$")
        ),
        # the converter's loop never moved past these: a request held a thread for ever
        *(
            ({"type": "string", "pattern": p}, f"pattern: a '{p[-2]}' that closes nothing")
            for p in ("^a]$", "^[^]]$", "^[]a]$", "^a}$")
        ),
        ({"type": "string", "pattern": "^\\x$"}, "pattern: a pattern's escape \\x"),
        ({"type": "string", "pattern": "^\\u12$"}, "pattern: a pattern's escape \\u12"),
    ],
)
def test_a_keyword_the_grammar_would_not_keep_is_refused_by_name(
    schema: dict[str, Any], words: str
) -> None:
    with pytest.raises(BadRequestError, match=r"response_format\.json_schema\.schema") as e:
        response_grammar(json_schema(schema))
    assert words in str(e.value)


def test_any_character_and_negated_classes_write_only_what_json_holds_unescaped() -> None:
    """The converter's `.` and `[^@]` allowed a raw quote, backslash or newline inside the
    string: an answer that stopped there was no JSON."""
    schema = {"type": "string", "pattern": "^[^@]+@.+$"}
    grammar = response_grammar(json_schema(schema)) or ""
    assert 'dot ::= [^"\\\\\\x00-\\x1F]' in grammar
    assert '[^"\\\\\\x00-\\x1F@]+' in grammar and "[^@]" not in grammar


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ({"type": "xml"}, "response_format.type: 'xml' is not served here"),
        ({"type": "json_schema"}, "response_format.json_schema: an object"),
        ({"type": "json_schema", "json_schema": {"schema": {}}}, "name: a name is required"),
        ([1], "an object with a 'type'"),
    ],
)
def test_a_malformed_response_format_is_refused(value: Any, words: str) -> None:
    with pytest.raises(BadRequestError) as e:
        response_grammar(value)
    assert words in str(e.value)


# ---- on a real `llmrun serve` ------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(serve_env: dict[str, str]) -> Iterator[Server]:  # noqa: F811
    with llmrun_serve(serve_env, "-np", "2", "--no-dashboard") as s:
        yield s


ASK = "Describe a made-up person as JSON."


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_sampled_answer_is_json_the_schema_accepts(server: Server, seed: int) -> None:
    body = chat(
        ASK, max_tokens=200, temperature=1.0, seed=seed, response_format=json_schema(PERSON)
    )
    r = server.post(CHAT, body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    check_person(json.loads(choice["message"]["content"]))


def test_a_streamed_answer_is_json_the_schema_accepts(server: Server) -> None:
    body = chat(
        ASK, max_tokens=200, temperature=0, stream=True, response_format=json_schema(PERSON)
    )
    with httpx.stream("POST", server.url + CHAT, json=body, timeout=HANG_S) as r:
        assert r.status_code == 200
        events = [e for e in sse_events(r) if e != "[DONE]"]
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    check_person(json.loads(text))


def test_json_object_gives_an_object_or_says_it_was_cut(server: Server) -> None:
    for max_tokens in (64, 5):
        body = chat(
            ASK, max_tokens=max_tokens, temperature=0, response_format={"type": "json_object"}
        )
        choice = server.post(CHAT, body).json()["choices"][0]
        text = choice["message"]["content"]
        if choice["finish_reason"] == "stop":
            assert isinstance(json.loads(text), dict)
        else:  # cut by max_tokens: said so, never passed off as finished
            assert choice["finish_reason"] == "length" and text.lstrip().startswith("{")
    assert choice["finish_reason"] == "length"  # 5 tokens cannot hold an object and its end


def test_a_completion_follows_the_schema_too(server: Server) -> None:
    body = {
        "prompt": "A person as JSON: ",
        "max_tokens": 200,
        "temperature": 0,
        "response_format": json_schema(PERSON),
    }
    choice = server.post("/v1/completions", body).json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    check_person(json.loads(choice["text"]))


def test_an_unsupported_keyword_gets_400_naming_it(server: Server) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 9}}}
    r = server.post(CHAT, chat(ASK, response_format=json_schema(schema)))
    assert r.status_code == 400
    error = r.json()["error"]
    assert "response_format.json_schema.schema.properties.n.maximum" in error["message"]


def test_openais_client_parses_the_answer_into_its_model(server: Server) -> None:
    openai = pytest.importorskip("openai")
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=16)
        country: str = Field(max_length=16)
        capital: bool

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    completion = client.chat.completions.parse(
        model=server.get("/v1/models")["data"][0]["id"],
        messages=[{"role": "user", "content": "Name a city as JSON."}],
        response_format=City,
        max_tokens=120,
        temperature=0,
    )
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, City)
    assert message.parsed == City.model_validate_json(message.content or "")


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "string", "maxLength": 20000},  # crashed llama.cpp's parser (SIGSEGV)
        {"type": "string", "pattern": "^a{0,20000}$"},
        {"type": "array", "items": {"type": "string"}, "maxItems": 1_000_000_000},  # ~8 GB
    ],
)
def test_repetitions_llama_cpps_parser_cannot_take_are_refused(schema: dict[str, Any]) -> None:
    with pytest.raises(BadRequestError, match=r"repetition|at most|nests|bytes"):
        schema_grammar(schema, "response_format.json_schema.schema")
