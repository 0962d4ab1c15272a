"""Structured output: a JSON schema (serve's `response_format` and forced tool calls, run's
--json-schema) as a llama.cpp grammar (GBNF), and a GBNF grammar from outside (run's --grammar)
checked before llama.cpp's sampler can abort on it.

`{"type": "json_object"}` and `{"type": "json_schema", "json_schema": {"schema": ...}}` become a
GBNF grammar through llama-cpp-python's converter (`llama_cpp.llama_grammar`, a port of
llama.cpp's `json_schema_to_grammar.py`; the vendored llama.cpp's own C++ converter lives in its
`common` library, which the bindings do not export). llama.cpp's grammar sampler then masks
every token that would leave the grammar, so a finished answer is JSON the schema accepts.

The converter quietly ignores what it cannot express (a `minimum`, a `uniqueItems`, a `format`
it does not know, a `maxLength` beside a `pattern`); an answer would then break the schema it was
promised. So every keyword is checked first, and one the grammar cannot keep is refused by name
and path (`BadRequestError`: a 400 naming it, or run's one line).

A server parses each grammar once (`Grammars`): the request's check parses it, the engine's
sequence gets a copy of the parsed grammar.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import dataclasses
import itertools
import json
import math
import platform
import re
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from .errors import BadRequestError, json_kind
from .handles import GrammarSampler, Sampler
from .lists import whole

WHERE = "response_format"
# Keywords that ask nothing of the value: accepted anywhere.
ANNOTATIONS = frozenset(
    {
        "title",
        "description",
        "default",
        "examples",
        "$schema",
        "$id",
        "$comment",
        "deprecated",
        "readOnly",
        "writeOnly",
    }
)
TYPES = frozenset({"string", "number", "integer", "boolean", "null", "object", "array"})
FORMATS = frozenset({"date", "time", "date-time", "uuid", *(f"uuid{i}" for i in range(1, 6))})
# Keywords that constrain a value of one type: the converter reads them only in its branch for
# that type, so beside a list of types, a `$ref` or a union they would be ignored.
CONSTRAINTS = frozenset(
    {
        "properties",
        "required",
        "additionalProperties",
        "items",
        "prefixItems",
        "minItems",
        "maxItems",
        "pattern",
        "format",
        "minLength",
        "maxLength",
    }
)
# Keywords the grammar keeps (each as the converter reads it; their combinations are checked):
# the constraints of one type, and those that say which type or which schema.
KEPT = CONSTRAINTS | {"type", "enum", "const", "anyOf", "oneOf", "$ref", "$defs", "definitions"}


def response_grammar(value: Any) -> str | None:
    """The GBNF grammar a `response_format` asks for; None for `{"type": "text"}` (or null).
    BadRequestError naming what is wrong or not supported."""
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise BadRequestError(f"{WHERE}: an object with a 'type' (text, json_object, json_schema)")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":  # llama-server also takes a schema here
        schema = value.get("schema")
        return schema_grammar({"type": "object"} if schema is None else schema, f"{WHERE}.schema")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise BadRequestError(f"{WHERE}.json_schema: an object with 'name' and 'schema'")
        name = spec.get("name")
        if not isinstance(name, str) or not name:
            raise BadRequestError(f"{WHERE}.json_schema.name: a name is required")
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise BadRequestError(f"{WHERE}.json_schema.strict: true or false")
        schema = spec.get("schema")
        return schema_grammar({} if schema is None else schema, f"{WHERE}.json_schema.schema")
    raise BadRequestError(
        f"{WHERE}.type: {kind!r} is not served here (text, json_object, json_schema)"
    )


def schema_grammar(schema: Any, where: str) -> str:
    """A JSON schema's grammar, once every keyword in it is one the grammar keeps."""
    if not isinstance(schema, dict):
        raise BadRequestError(f"{where}: a JSON schema is an object")
    check_schema(schema, where)
    fix = lambda grammar: json_text_dot(paired_surrogates(grammar))  # noqa: E731
    return _within_limits(_converted(schema, where, fix), where)


def _converted(
    schema: dict[str, Any], where: str, fix: Callable[[str], str] = lambda grammar: grammar
) -> str:
    """The bindings' converter's grammar of a schema (then `fix`ed), once llama.cpp can take it:
    BadRequestError naming `where` when the converter cannot translate it or when what it wrote
    is at fault (`grammar_fault`)."""
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    try:
        grammar = fix(json_schema_to_gbnf(json.dumps(grouped(schema))))
    except Exception as e:  # its asserts and KeyErrors: a pattern it cannot read, ...
        reason = " ".join(str(e).split()) or type(e).__name__
        raise BadRequestError(f"{where}: cannot be made a grammar: {reason}") from None
    fault = grammar_fault(grammar)
    if fault is not None:
        raise BadRequestError(f"{where}: {fault}")
    return grammar


# A character past U+FFFF in an enum, a const or a property's name: the converter writes it as
# JSON does, a pair of \u escapes (😀 is \ud83d\ude00), which llama.cpp's grammar reads as two
# lone surrogates it cannot write. An escape's backslash is one not itself escaped.
_SURROGATE_PAIR = re.compile(
    r"(?<!\\)((?:\\\\)*)\\u(d[89ab][0-9a-f]{2})\\u(d[c-f][0-9a-f]{2})", re.IGNORECASE
)


def paired_surrogates(grammar: str) -> str:
    """The grammar with each escaped surrogate pair written as the one character it stands for
    (\\U0001f600)."""

    def joined(m: re.Match[str]) -> str:
        high, low = int(m.group(2), 16), int(m.group(3), 16)
        code = 0x10000 + ((high - 0xD800) << 10) + (low - 0xDC00)
        return f"{m.group(1)}\\U{code:08x}"

    return _SURROGATE_PAIR.sub(joined, grammar)


def each_schema(schema: Any, fn: Callable[[dict[str, Any]], dict[str, Any]]) -> Any:
    """A copy of a checked schema with `fn` applied to each schema in it, innermost first, found
    through the keywords that hold schemas only: a property named `default` or `enum` is a
    schema, an `enum`'s or an annotation's value is JSON and stays as written."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in (*SUBSCHEMAS, *SUBSCHEMA_LISTS):
        value = out.get(key)
        if isinstance(value, (dict, list)):
            out[key] = (
                [each_schema(v, fn) for v in value]
                if isinstance(value, list)
                else (each_schema(value, fn))
            )
    for key in (*SUBSCHEMA_MAPS, "$defs", "definitions"):
        if isinstance(out.get(key), dict):
            out[key] = {name: each_schema(sub, fn) for name, sub in out[key].items()}
    return fn(out)


def grouped(schema: Any) -> Any:
    """The schema as the converter reads it right. Each pattern whose top level has
    alternatives (`^a|b$`) is written as one group (`^(a|b)$`): the converter puts the
    alternatives beside the string's quotes, which makes a grammar for `"a` or `b"`, not JSON.
    A `$ref` beside `$defs` (pydantic's recursive models: `{"$ref": "#/$defs/Node", "$defs":
    ...}`) becomes a choice of one: the converter follows a `$ref` and never looks beside it,
    so the refs inside those definitions stayed unresolved (a KeyError)."""
    return each_schema(schema, _grouped)


def _grouped(schema: dict[str, Any]) -> dict[str, Any]:
    if isinstance(schema.get("$ref"), str) and ("$defs" in schema or "definitions" in schema):
        schema = {"anyOf": [{"$ref": schema.pop("$ref")}], **schema}
    pattern = schema.get("pattern")
    if isinstance(pattern, str):
        pattern = _json_safe_negations(pattern)
        if _has_top_level_bar(pattern):
            pattern = f"^({pattern.removeprefix('^').removesuffix('$')})$"
        schema["pattern"] = pattern
    return schema


# What a JSON string may hold unescaped excludes the quote, the backslash and U+0000-U+001F.
# The converter copies a pattern's characters into the string as they are: a negated class
# (`[^@]`) and `.` also allow those, so each is narrowed to the characters written unescaped
# (as GBNF class text), and a pattern that names one of them is refused (`_unescaped_in`).
_NOT_IN_JSON_TEXT = '"\\\\\\x00-\\x1F'
_CONVERTER_DOT = "[^\\x0A\\x0D]"


# A pattern's escape, or a class up to its first unescaped `]` (even right after `[`, as the
# converter reads one); with `{...}`, a quantifier too: what is left is the bare characters.
_ESCAPE_OR_CLASS = re.compile(r"\\.|\[(\^?)(?:\\.|[^\]\\])*\]?", re.S)
_ESCAPE_CLASS_OR_COUNT = re.compile(r"\\.|\[(?:\\.|[^\]\\])*\]?|\{(?:\\.|[^}\\])*\}?", re.S)


def _json_safe_negations(pattern: str) -> str:
    """The pattern with every negated class (`[^...]`) also excluding `_NOT_IN_JSON_TEXT`."""
    negated = lambda m: "[^" + _NOT_IN_JSON_TEXT + m[0][2:] if m[1] else m[0]  # noqa: E731
    return _ESCAPE_OR_CLASS.sub(negated, pattern)


def json_text_dot(grammar: str) -> str:
    """The grammar with the converter's `.` (any character but \\n and \\r) narrowed to the
    characters a JSON string holds unescaped."""
    return grammar.replace(_CONVERTER_DOT, "[^" + _NOT_IN_JSON_TEXT + "]")


def _has_top_level_bar(pattern: str) -> bool:
    depth = 0
    for c in _ESCAPE_OR_CLASS.sub("", pattern):
        depth += (c == "(") - (c == ")")
        if c == "|" and depth == 0:
            return True
    return False


# The escapes llama.cpp's GBNF parser reads (`parse_char`): the converter copies a pattern's
# other escapes (\d in a class, \w, \., \-, \1, \f) into the grammar, which the parser refuses.
_HEX_ESCAPES = {"x": 2, "u": 4, "U": 8}
_CHAR_ESCAPES = {"t": 9, "r": 13, "n": 10, "\\": 92, '"': 34, "[": 91, "]": 93}
_HEX = frozenset("0123456789abcdefABCDEF")


REPEATED = "a pattern repeats a repetition (a** or a?+), which llama.cpp's grammar cannot read"
NUL = "asks for the NUL character, which llama.cpp's grammar cannot write"
UNREAD = "a pattern the converter did not translate into a grammar llama.cpp reads"
NOTHING = "a character class that no character matches, which llama.cpp's grammar cannot write"
SURROGATE = "a lone surrogate (\\ud800-\\udfff) is not a character llama.cpp can write"


def grammar_fault(grammar: str) -> str | None:
    """What in a converted grammar llama.cpp cannot take, in words (None: nothing found).

    Its parser refuses an escape it does not know; and its sampler can never write the NUL
    character (a token's text ends at the first one), so a grammar whose only way on is a NUL
    leaves no token to sample and llama.cpp aborts the process. A lone surrogate cannot be
    encoded for it at all."""
    i, n = 0, len(grammar)
    end: str | None = None  # inside a literal ('"') or a character class (']')
    codes: list[int] = []  # the class's characters so far
    spans: list[tuple[int, int]] = []  # the class's characters as ranges
    dash = False  # the last character opened a range
    negated = quantified = False  # the last item outside literals was a repetition
    while i < n:
        c = grammar[i]
        if end is None:
            if c in "*+?{":
                if quantified:
                    return REPEATED
                quantified = True
                i = grammar.find("}", i) + 1 if c == "{" else i + 1
                if i == 0:
                    return UNREAD
                continue
            if c == "\\":
                return UNREAD
            if not c.isspace():
                quantified = False
            if c in '"[':
                end, codes, spans = ('"' if c == '"' else "]"), [], []
                negated = c == "[" and grammar[i + 1 : i + 2] == "^"
                i += 2 if negated else 1
            else:
                i += 1
            continue
        if c == end:
            if end == "]" and not negated and codes and not any(codes):
                return NUL
            if end == "]" and (_covers_all(spans) if negated else not spans):
                return NOTHING
            end = None
            i += 1
            continue
        if c == "\\":
            e = grammar[i + 1 : i + 2]
            if e in _HEX_ESCAPES:
                digits = grammar[i + 2 : i + 2 + _HEX_ESCAPES[e]]
                if len(digits) < _HEX_ESCAPES[e] or not set(digits) <= _HEX:
                    return f"a pattern's escape \\{e}{digits} is not one llama.cpp's grammar reads"
                code, i = int(digits, 16), i + 2 + len(digits)
            elif e in _CHAR_ESCAPES:
                code, i = _CHAR_ESCAPES[e], i + 2
            else:
                return (
                    f"a pattern's escape \\{e} is not one llama.cpp's grammar reads (write the"
                    " characters out: [0-9] for \\d, [.] for \\.)"
                )
        elif end == "]" and c == "-" and codes and grammar[i + 1 : i + 2] != "]":
            i, dash = i + 1, True  # a range's dash: its ends are the class's characters
            continue
        else:
            code, i = ord(c), i + 1
        if 0xD800 <= code <= 0xDFFF:
            return SURROGATE
        if end == '"' and code == 0:
            return NUL
        codes.append(code)
        spans.append((spans.pop()[0], code) if dash else (code, code))
        dash = False
    return UNREAD if end is not None else None


# A GBNF grammar's items that hold text of their own: a literal, a character class, a comment, a
# token reference (<[id]> or <text>, ! before it for any other token).
_GBNF_ITEM = re.compile(r'"(?:\\.|[^"\\])*"?|\[(?:\\.|[^\]\\])*\]?|#[^\r\n]*|!?<[^>]*>?', re.S)
_TOKEN_ID = re.compile(r"<\[([0-9]+)\]>")


def check_gbnf(grammar: str, where: str) -> None:
    """A GBNF grammar from outside (run --grammar) held to the limits a schema's grammar is
    held to, and with the rule llama.cpp starts from: BadRequestError naming what is wrong."""
    _within_limits(grammar, where, "")
    text = _GBNF_ITEM.sub(" ", grammar)
    if not re.search(r"(?:^|\s)root\s*::=", text):
        raise BadRequestError(f"{where}: it has no rule 'root' (llama.cpp starts from root ::=)")


def gbnf_fault(grammar: str) -> str | None:
    """What in a GBNF grammar given as it is (run --grammar) would leave llama.cpp's sampler no
    token to sample, or that its sampler would throw on, both of which abort the process: a
    NUL, a lone surrogate, a character class no character matches, a negated token reference
    right after text (None: nothing found). Its syntax is llama.cpp's parser's to judge."""
    fault = grammar_fault(_GBNF_ITEM.sub(lambda m: "" if m[0][0] == "#" else m[0], grammar))
    return fault if fault in (NUL, NOTHING, SURROGATE) else _negation_fault(grammar)


def _negation_fault(grammar: str) -> str | None:
    if not any(m[0].startswith("!<") for m in _GBNF_ITEM.finditer(grammar)):
        return None
    if (where := negated_token_after_text(grammar)) is None:
        return None
    return (
        f"a negated token (!<...>) right after text ({where}): llama.cpp checks it by the"
        " token's id alone, and a token that spans the text and it aborts the process (put"
        " !<...> at the start or after another token)"
    )


# A GBNF grammar's pieces, for the token check below: a literal, a character class, a token
# reference, `.`, a rule's name (with its `::=`), a repetition, a group's parentheses, `|`.
_GBNF_PIECE = re.compile(
    r'(?P<lit>"(?:\\.|[^"\\])*")|(?P<cls>\[(?:\\.|[^\]\\])*\])|(?P<tok>!?<[^>]*>)'
    r"|(?P<any>\.)|(?P<rule>[A-Za-z0-9-]+\s*::=)|(?P<ref>[A-Za-z0-9-]+)"
    r"|(?P<rep>[*+?]|\{\s*[0-9]*\s*(?:,\s*[0-9]*\s*)?\})|(?P<sym>[()|])|#[^\r\n]*|\s+",
    re.S,
)


@dataclasses.dataclass(frozen=True)
class _Shape:
    """What an item of a grammar may be, as far as token references go: whether it may match
    nothing, may begin with a negated token reference (!<...>), may end with text."""

    empty: bool
    begins_not: bool
    ends_text: bool


_TEXT = _Shape(False, False, True)


def _then(a: _Shape, b: _Shape) -> _Shape:
    return _Shape(
        a.empty and b.empty,
        a.begins_not or (a.empty and b.begins_not),
        b.ends_text or (b.empty and a.ends_text),
    )


def _either(a: _Shape, b: _Shape) -> _Shape:
    return _Shape(a.empty or b.empty, a.begins_not or b.begins_not, a.ends_text or b.ends_text)


def negated_token_after_text(grammar: str) -> str | None:
    """A negated token reference (!<[id]>, !<text>) that the grammar may ask for right after
    text: the rule and the reference, or None. llama.cpp 0.3.36 checks a token against such a
    reference by its id alone, so a token whose text ends what comes before and goes on (\"yes\"
    where the grammar asks for "y" !<[5]>) passes the check and then matches nothing: its
    sampler throws through the C API and the process aborts. At the start of the answer, or
    after another token reference, a token boundary is certain and nothing spans it. The
    grammar must be one llama.cpp's parser takes."""
    rules: dict[str, list[tuple[str | None, str]]] = {
        rule: [("sym", "|"), *body]  # (an empty alternative first: this check may overreach)
        for rule, body in gbnf_rules(grammar).items()
    }
    shapes = {rule: _Shape(False, False, False) for rule in rules}
    found: list[str] = []

    def shape_of(items: list[tuple[str | None, str]], rule: str, check: bool) -> _Shape:
        """The shape of alternatives, the items up to a ')' popped off the end of `items`
        (reversed: the next item is last)."""
        alternatives: _Shape | None = None
        seq = _Shape(True, False, False)
        while items:
            kind, text = items.pop()
            if kind == "sym" and text == ")":
                break
            if kind == "sym" and text == "|":
                alternatives = seq if alternatives is None else _either(alternatives, seq)
                seq = _Shape(True, False, False)
                continue
            if kind == "sym":  # "("
                item = shape_of(items, rule, check)
            elif kind == "tok":
                item = _Shape(False, text.startswith("!"), False)
            elif kind == "lit":
                item = _TEXT if len(text) > 2 else _Shape(True, False, False)
            elif kind == "ref":
                item = shapes.get(text, _Shape(False, False, False))
            else:  # a class, "."
                item = _TEXT
            while items and items[-1][0] == "rep":
                rep = items.pop()[1]
                least, most = _REPEATS.get(rep) or _range(rep)
                if check and most > 1 and item.ends_text and item.begins_not and not found:
                    found.append(f"in rule '{rule}', a repetition")
                item = _Shape(item.empty or least == 0, item.begins_not, item.ends_text)
            if check and seq.ends_text and item.begins_not and not found:
                found.append(f"in rule '{rule}'")
            seq = _then(seq, item)
        return seq if alternatives is None else _either(alternatives, seq)

    while True:  # until nothing changes: the flags only ever turn one way, so this ends
        new = {rule: shape_of(list(reversed(body)), rule, False) for rule, body in rules.items()}
        if new == shapes:
            break
        shapes = new
    for rule, body in rules.items():
        shape_of(list(reversed(body)), rule, True)
        if found:
            return found[0]
    return None


def gbnf_rules(grammar: str) -> dict[str, list[tuple[str, str]]]:
    """A GBNF grammar's rules, each as its pieces in order (kind, text); a rule defined twice
    is one rule of alternatives."""
    rules: dict[str, list[tuple[str, str]]] = {}
    name = ""
    for m in _GBNF_PIECE.finditer(grammar):
        kind = m.lastgroup
        if kind == "rule":
            name = m[0].partition(":")[0].strip()
            if name in rules:
                rules[name].append(("sym", "|"))
            rules.setdefault(name, [])
        elif kind is not None:
            rules.setdefault(name, []).append((kind, m[0]))
    return rules


_REPEATS = {"*": (0, math.inf), "+": (1, math.inf), "?": (0, 1)}
_COUNT_DIGITS = 18  # a count of more digits reads as 10**18: past anything (and int()'s limit)


def _range(rep: str) -> tuple[int, float]:
    """A {m}, {m,}, {m,n} repetition's least and most (inf when open)."""
    low, comma, high = (part.strip() for part in rep.strip("{}").partition(","))

    def count(text: str) -> int:
        return int(text) if len(text) <= _COUNT_DIGITS else 10**_COUNT_DIGITS

    least = count(low) if low else 0
    return least, ((count(high) if high else math.inf) if comma else least)


def _token_fault(lib: Any, vocab: Any, grammar: str) -> str | None:
    """A token the grammar asks for that llama.cpp's sampler would abort the process on: an id
    past the vocabulary (no token matches it), or an end-of-generation token (the sampler
    refuses one while the grammar still expects it)."""
    n_vocab = int(lib.llama_vocab_n_tokens(vocab))
    negation = _negation_fault(grammar)
    if negation is not None:
        return negation
    # the tokens it asks for (<[id]> or <text>; !<...> asks for any other one)
    for ref in (m[0] for m in _GBNF_ITEM.finditer(grammar) if m[0][0] == "<"):
        if (by_id := _TOKEN_ID.fullmatch(ref)) is not None:
            token = whole(by_id[1])  # None past 100 digits (int() fails past 4,300)
            if token is None or token >= n_vocab:
                return f"{ref} is no token of the model's {n_vocab:,}"
        else:
            data = ref.encode()
            found = (lib.llama_token * 2)()
            if lib.llama_tokenize(vocab, data, len(data), found, 2, False, True) != 1:
                return f"{ref} is not one token of the model's vocabulary"  # as llama.cpp's parser
            token = found[0]
        if lib.llama_vocab_is_eog(vocab, token):
            return (
                f"{ref} ends the generation, which llama.cpp's grammar cannot ask for (the"
                " answer ends by itself where the grammar is complete)"
            )
    return None


def without_token_texts(grammar: str) -> str:
    """The grammar with each token named by its text (<|im_end|>) named by an id instead, so
    that its shape can be parsed before a vocabulary is loaded."""
    return _GBNF_ITEM.sub(
        lambda m: "<[0]>" if m[0].lstrip("!")[:2] not in ("<[", "") and m[0][0] in "<!" else m[0],
        grammar,
    )


def _covers_all(spans: list[tuple[int, int]]) -> bool:
    """Whether ranges of code points hold every character llama.cpp can write (a negated class
    of them matches none)."""
    reach = 0  # every character up to here is covered
    for lo, hi in sorted(spans):
        if lo > reach + 1 and not (reach + 1 >= 0xD800 and lo <= 0xE000):
            return False
        reach = max(reach, hi)
    return reach >= 0x10FFFF


PARSES = 0  # grammars handed to llama.cpp's parser in this process (the tests count them)


_refused = threading.local()  # .left_recursion: this thread's last parse was refused for it
LEFT_RECURSION = (
    "left recursion: a rule can begin with itself before any text"
    " (put text before the rule's own name)"
)


def _parse(lib: Any, vocab: Any, grammar: str) -> Any:
    """A grammar sampler from llama.cpp's parser (None: refused; the parser says why on C's
    stderr, but a grammar it parsed and then refuses for left recursion is said in the log).
    Every parse of llmrun's goes through here."""
    from .library import log_since, logged

    global PARSES
    PARSES += 1
    before = logged()
    ptr = lib.llama_sampler_init_grammar(vocab, grammar.encode(), b"root") or None
    said = log_since(before) if ptr is None else []
    _refused.left_recursion = any("left recursion detected" in line for line in said)
    return ptr


def parses(vocab: Any, grammar: str) -> bool:
    """Whether llama.cpp's own parser takes the grammar (`vocab` None: one without token
    references can be parsed before a model is loaded). The parser says why not on stderr."""
    from .library import llama_lib

    lib = llama_lib()
    ptr = _parse(lib, vocab, grammar)
    if ptr is not None:
        lib.llama_sampler_free(ptr)
    return ptr is not None


class _CStderr:
    """C's own `stderr` stream, pointed at a temporary file while llama.cpp's grammar parser
    runs: the parser writes its refusal there (the reason, then the whole grammar), not to the
    log callback. Only C's stdio is redirected, never file descriptor 2, so what Python writes
    to stderr meanwhile (a server's log, its live view) is untouched; another thread's C
    stdio writes in that moment land in the file and are dropped. Only where the C library's
    `stderr` is a variable it reads again (glibc's `stderr`, macOS's `__stderrp`): musl declares
    it `FILE *const`, so there the parser's print stays on stderr and the reason is unknown.
    One per process (`_c_stderr`): the swap is serialized by its lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.libc: Any = None
        self.stream: Any = None  # the `stderr` variable of the C library
        name = _writable_stderr()
        if name is None:
            return
        with contextlib.suppress(OSError, AttributeError, ValueError):
            libc = ctypes.CDLL(None)
            self.stream = ctypes.c_void_p.in_dll(libc, name)
            libc.tmpfile.restype, libc.tmpfile.argtypes = ctypes.c_void_p, []
            for fn in (libc.fflush, libc.rewind, libc.fclose):
                fn.argtypes = [ctypes.c_void_p]
            sz = ctypes.c_size_t
            libc.fread.restype, libc.fread.argtypes = sz, [ctypes.c_char_p, sz, sz, ctypes.c_void_p]
            self.libc = libc

    def parse(self, lib: Any, vocab: Any, grammar: str) -> tuple[Any, str]:
        """_parse's sampler, and the parser's reason when it refuses ("" when not known)."""
        libc = self.libc
        if libc is None or self.stream is None:
            return self._unheard(lib, vocab, grammar)
        with self.lock:
            caught = libc.tmpfile()
            if not caught:
                return self._unheard(lib, vocab, grammar)
            try:
                saved, self.stream.value = self.stream.value, caught
                try:
                    ptr = _parse(lib, vocab, grammar)
                finally:
                    self.stream.value = saved
                libc.fflush(caught)
                libc.rewind(caught)
                buffer = ctypes.create_string_buffer(4096)
                n = libc.fread(buffer, 1, len(buffer), caught)  # before .raw is read
                said = buffer.raw[:n]
            finally:
                libc.fclose(caught)
        return ptr, "" if ptr is not None else refusal_reason(said.decode("utf-8", "replace"))

    @staticmethod
    def _unheard(lib: Any, vocab: Any, grammar: str) -> tuple[Any, str]:
        """A parse whose stderr cannot be caught: the log's reason alone."""
        ptr = _parse(lib, vocab, grammar)
        return ptr, "" if ptr is not None else refusal_reason("")


def refusal_reason(said: str) -> str:
    """Why this thread's last parse was refused: left recursion, which llama.cpp says in its
    log after parsing, else the parser's own words on stderr (`said`), in one line of at most
    100 characters; "" when neither says."""
    left, _refused.left_recursion = getattr(_refused, "left_recursion", False), False
    if left:
        return LEFT_RECURSION
    first = next((ln for ln in said.splitlines() if "error parsing grammar:" in ln), "")
    reason = " ".join(first.partition("error parsing grammar:")[2].split())
    reason = "".join(c if c.isprintable() else "?" for c in reason)  # it quotes the grammar
    return reason if len(reason) <= 100 else reason[:99] + "…"


def _writable_stderr() -> str | None:
    """The C library's `stderr` variable that its stdio reads each time, by name; None where
    writing it is not safe (musl's is `FILE *const`; other libraries are not known)."""
    if sys.platform == "darwin":
        return "__stderrp"
    if sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc":
        return "stderr"
    return None


_C_STDERR: _CStderr | None = None
_C_STDERR_MADE = threading.Lock()


def _c_stderr() -> _CStderr:
    """The process's one _CStderr: two would each swap `stderr` under their own lock."""
    global _C_STDERR
    with _C_STDERR_MADE:
        if _C_STDERR is None:
            _C_STDERR = _CStderr()
        return _C_STDERR


class Grammars:
    """The grammars parsed on one loaded model's vocabulary (a server's, or `run`'s and `chat`'s,
    kept on the model's handle), each parsed once: a request's check
    parses its grammar (or finds it here), and the engine's sequence gets a copy of the parsed
    grammar (`llama_sampler_clone` copies its rules and state; nothing is parsed again). A
    grammar llama.cpp refuses is kept as its reason, so asking again parses and prints nothing.
    Safe from any thread; `close` before the model is freed (the parsed grammars point into its
    vocabulary)."""

    SIZE = 16  # distinct grammars kept (the oldest one goes)

    def __init__(self, lib: Any, vocab: Any) -> None:
        self.lib, self.vocab = lib, vocab
        self._lock = threading.Lock()  # held for lookups and copies, never for a parse
        self._parsed: collections.OrderedDict[str, tuple[Any, str]] = collections.OrderedDict()
        self._closed = False

    def _get(self, grammar: str, copy: bool) -> tuple[Any, str]:
        """(the parsed grammar, or a copy of it when `copy`; None when refused, with the
        parser's reason), parsing it when it is not kept here."""
        with self._lock:
            found = self._parsed.get(grammar)
            if found is not None:
                self._parsed.move_to_end(grammar)
                return self._copied(found, copy)
        parsed = _c_stderr().parse(self.lib, self.vocab, grammar)  # other requests go on
        with self._lock:
            found = self._parsed.get(grammar)
            if found is not None:  # another request parsed it meanwhile: that one is kept
                self._free(parsed)
                return self._copied(found, copy)
            if self._closed:  # nothing is kept now: the caller's copy, or only the verdict
                if copy or parsed[0] is None:
                    return parsed
                self._free(parsed)
                return True, ""
            self._parsed[grammar] = parsed
            while len(self._parsed) > self.SIZE:
                self._free(self._parsed.popitem(last=False)[1])
            return self._copied(parsed, copy)

    def _free(self, parsed: tuple[Any, str]) -> None:
        if parsed[0] is not None:
            self.lib.llama_sampler_free(parsed[0])

    def _copied(self, found: tuple[Any, str], copy: bool) -> tuple[Any, str]:
        ptr, reason = found
        if ptr is None or not copy:
            return ptr, reason
        return self.lib.llama_sampler_clone(ptr), reason

    def check(self, grammar: str, where: str) -> None:
        """BadRequestError naming `where` when llama.cpp's own parser refuses the grammar (the last
        gate before the engine), with the parser's reason and without its print on stderr."""
        ptr, reason = self._get(grammar, copy=False)
        if ptr is None:
            raise BadRequestError(
                f"{where}: llama.cpp's grammar parser refuses the grammar made from it: "
                + (reason or "a pattern it cannot read?")
            )

    def fresh(self, grammar: str) -> Any:
        """A new grammar sampler for one sequence, the caller's to free (None: llama.cpp
        refuses the grammar)."""
        return self._get(grammar, copy=True)[0]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for parsed in self._parsed.values():
                self._free(parsed)
            self._parsed.clear()


# llama.cpp's grammar parser recurses once per parenthesis with no limit of its own: the
# converter writes a count N (maxLength, maxItems, a pattern's {0,N}) as N nested groups, and
# 20,000 of them crashed the server (SIGSEGV); at 2,000 it refused the grammar after a dump.
MAX_REPEAT = 1000  # the largest count a schema may ask for (llama.cpp's own converter: 2000)
# The grammar sampler follows every alternative still open at each token, over the whole
# vocabulary: an enum of 20,000 values took 45 s for 6 tokens of the embedded model (4,000:
# 2 s a token), and in serve that holds every other sequence's step as well.
MAX_CHOICES = 1000
MAX_GRAMMAR_DEPTH = 1000  # parentheses open at once
MAX_GRAMMAR_BYTES = 1 << 20
_QUANTIFIER = re.compile(r"\{\s*([0-9]+)\s*(?:,\s*([0-9]*)\s*)?\}")


def _within_limits(grammar: str, where: str, hint: str = ": ask for fewer repetitions") -> str:
    """The grammar, once its size and nesting are ones llama.cpp's parser survives (it
    recurses once per group: 30,000 nested groups crash it). Parentheses inside literals,
    character classes and comments are text, not groups."""
    if len(grammar) > MAX_GRAMMAR_BYTES:
        raise BadRequestError(
            f"{where}: its grammar would take {len(grammar):,} bytes (at most"
            f" {MAX_GRAMMAR_BYTES:,}){hint}"
        )
    bare = _GBNF_ITEM.sub("", grammar)
    deepest = max(itertools.accumulate(((c == "(") - (c == ")") for c in bare), initial=0))
    if deepest > MAX_GRAMMAR_DEPTH:
        raise BadRequestError(
            f"{where}: its grammar nests {deepest:,} groups deep (at most {MAX_GRAMMAR_DEPTH:,})"
            + hint
        )
    fault = repetition_fault(grammar)
    if fault is not None:
        raise BadRequestError(f"{where}: {fault}")
    return grammar


# llama.cpp's grammar sampler follows every way the text so far can be read. A repeated item
# that can match nothing is read in as many ways as there are copies to skip, and each way
# multiplies with the next: `x{0,16}` of an `x ::= [a-z]{0,100}` took 11 s for 8 tokens of the
# embedded model, `x{0,24}` more than a minute, `x{0,1000}` never ended, and neither SIGTERM nor
# Ctrl-C stops a process inside that C call. So the skippable copies are counted (a count of
# them in a group of them multiplies) and held to MAX_EMPTY_REPEATS; `x{0,8}` took 0.1 s.
# Items written alike side by side (`[a-z]? [a-z]?`) weigh a third each: 24 of them took 0.3 s,
# 48 more than a minute. `x*` of such an x is llama.cpp's own refusal (left recursion).
MAX_EMPTY_REPEATS = 8
ALIKE_PER_COPY = 3
_CAP = 10 * MAX_EMPTY_REPEATS  # past the limit, how far past does not matter


def repetition_fault(grammar: str) -> str | None:
    """What in a GBNF grammar's repetitions llama.cpp cannot take (None: nothing found): a
    count whose least is above its most (`{5,2}`: the parser allocated until the machine's
    memory ran out), or more than MAX_EMPTY_REPEATS copies of what can match nothing."""
    rules = gbnf_rules(grammar)
    for name, body in rules.items():
        for kind, text in body:
            if kind == "rep" and (bounds := _REPEATS.get(text) or _range(text))[0] > bounds[1]:
                return (
                    f"in rule '{name}', the repetition {text} asks for at least {bounds[0]:,}"
                    f" and at most {bounds[1]:,}"
                )
    dependents: dict[str, set[str]] = {rule: set() for rule in rules}
    for rule, body in rules.items():
        for kind, text in body:
            if kind == "ref" and text in dependents:
                dependents[text].add(rule)
    weighed = dict.fromkeys(rules, (False, 0))
    worst: dict[str, int] = {}
    keys: dict[object, int] = {}
    todo = collections.deque(_after_what_they_name(rules))
    queued = set(todo)
    while todo:  # both figures only grow, and the weights are capped: this ends
        rule = todo.popleft()
        queued.discard(rule)
        new = _weighed(rules[rule], weighed, worst, rule, keys)
        if new != weighed[rule]:
            weighed[rule] = new
            todo.extend(d for d in dependents[rule] if d not in queued)
            queued.update(dependents[rule])
    rule, weight = max(worst.items(), key=lambda kv: kv[1], default=("", 0))
    if weight > MAX_EMPTY_REPEATS:
        return (
            f"in rule '{rule}', {weight:,}{'+' if weight >= _CAP else ''} copies of what can"
            f" match nothing (at most {MAX_EMPTY_REPEATS}; alike ones side by side count a"
            f" third each): llama.cpp's sampler follows every way to skip them and takes"
            " minutes (repeat what is never empty: [a-z]{1,100}, not [a-z]{0,100})"
        )
    return None


def _after_what_they_name(rules: dict[str, list[tuple[str, str]]]) -> list[str]:
    """The rules, each after the rules it names where no loop says otherwise (without
    recursion: a chain of rules may be thousands long), so that most are weighed once."""
    order: list[str] = []
    seen: set[str] = set()
    for top in rules:
        stack = [(top, iter(rules[top]))]
        seen.add(top)
        while stack:
            rule, pieces = stack[-1]
            for kind, text in pieces:
                if kind == "ref" and text in rules and text not in seen:
                    seen.add(text)
                    stack.append((text, iter(rules[text])))
                    break
            else:
                stack.pop()
                order.append(rule)
    return order


def _weighed(
    body: list[tuple[str, str]],
    rules: dict[str, tuple[bool, int]],
    worst: dict[str, int],
    rule: str,
    keys: dict[object, int],
) -> tuple[bool, int]:
    """Whether a rule's body can match nothing, and how many skippable copies it holds then
    (the rules it names as `rules` says so far); the most that stand side by side anywhere in
    it go into `worst`. Each item is known by a number (`keys`: the same number for items
    written alike). Without recursion: groups nest 1,000 deep."""

    def run_ends(f: list[Any]) -> int:
        run = min(_CAP, f[3] + _alike(f[4]))
        worst[rule] = max(worst.get(rule, 0), run)
        return run

    # each open group: its alternatives' (empty, weight); whether its sequence so far is empty,
    # the skippable copies at its end and those items' numbers; the numbers of all its items
    frames: list[list[Any]] = [[False, 0, True, 0, [], []]]
    i = 0
    while i < len(body):
        kind, text = body[i]
        i += 1
        if (kind, text) == ("sym", "("):
            frames.append([False, 0, True, 0, [], []])
            continue
        f = frames[-1]
        if kind == "sym":  # "|" or ")": the sequence ends
            run = run_ends(f)
            f[:4] = [f[0] or f[2], f[1] + run if f[2] else f[1], True, 0]
            f[4] = []
            f[5].append(-1)
            if text == "|":
                continue
            f = frames.pop() if len(frames) > 1 else [False, 0, True, 0, [], []]
            empty, weight = f[0], f[1]
            key: object = tuple(f[5])
        elif kind == "ref":
            empty, weight = rules.get(text, (False, 0))
            key = (kind, text)
        else:  # text ('""' is none), a class, a token, `.`
            empty, weight, key = text == '""', 0, (kind, text)
        reps = []
        while i < len(body) and body[i][0] == "rep":
            reps.append(body[i][1])
            least, most = _REPEATS.get(body[i][1]) or _range(body[i][1])
            i += 1
            if empty and most != math.inf and (least == 0 or most > 1):
                weight = int(min(most, _CAP)) * (weight + 1)  # each copy can be skipped
            empty = empty or least == 0
        number = keys.setdefault((key, *reps), len(keys))
        f = frames[-1]
        f[5].append(number)
        if empty:  # side by side with the skippable copies before it
            f[3] = min(_CAP, f[3] + weight)
            f[4].append(number)
        else:
            run_ends(f)
            f[2], f[3], f[4] = False, 0, []
    f = frames[0]
    run = run_ends(f)
    if not (f[0] or f[2]):
        return False, 0
    return True, min(_CAP, f[1] + (run if f[2] else 0))


def _alike(numbers: list[int]) -> int:
    """What the skippable items side by side that are written alike weigh, where two or more
    are: a third of a copy each."""
    most = max(collections.Counter(numbers).values(), default=0)
    return most // ALIKE_PER_COPY if most > 1 else 0


def check_schema(root: dict[str, Any], where: str) -> None:
    """Refuse, by path, every keyword the grammar would not keep."""
    try:  # the check recurses once per level: a schema nested past Python's limit is refused
        _check_schema(root, where, root)
        loop = _ref_loop(root)
    except RecursionError:
        raise BadRequestError(
            f"{where}: nests too deep to be made a grammar (a few hundred levels at most)"
        ) from None
    if loop is not None:
        refs, bare = loop
        path = " -> ".join(refs)
        raise BadRequestError(
            f"{where}: a $ref loop at {refs[0]} ({path}): the schema names itself and nothing"
            " else, so no value can be written"
            if bare
            else f"{where}: left recursion at {refs[0]} ({path}): the schema can begin with"
            " itself before any text, which llama.cpp's grammar cannot take (begin the"
            " recursion inside an object or an array)"
        )


NOWHERE = object()  # what a $ref that names nothing in the schema points at


def _ref_target(root: dict[str, Any], ref: str) -> Any:
    """The schema a local `#/...` ref names; NOWHERE when it names nothing."""
    target: Any = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(target, dict) or part not in target:
            return NOWHERE
        target = target[part]
    return target


def _leading_refs(schema: Any) -> tuple[list[str], bool]:
    """The $refs a value of `schema` may begin with before any of its own text (the grammar's
    rule for it starts with theirs), and whether `schema` is a bare $ref."""
    if not isinstance(schema, dict):
        return [], False
    if isinstance(schema.get("$ref"), str):
        return [schema["$ref"]], True
    found: list[str] = []
    for key in ("anyOf", "oneOf"):
        for option in schema.get(key) or []:
            found += _leading_refs(option)[0]
    return found, False


SUBSCHEMAS = ("items", "additionalProperties", "not")  # a key that holds one schema
SUBSCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf")  # a list of schemas
SUBSCHEMA_MAPS = ("properties",)  # a name -> schema map ($defs are reached by their refs)


def _refs_in(schema: Any) -> list[str]:
    """The $refs a value of `schema` may use: in the keys that hold schemas, never in an
    annotation's or a value's JSON, nor in `$defs` (a definition counts where it is named)."""
    if not isinstance(schema, dict):
        return []
    found = [schema["$ref"]] if isinstance(schema.get("$ref"), str) else []
    for key in SUBSCHEMAS:
        found += _refs_in(schema.get(key))
    for key in SUBSCHEMA_LISTS:
        value = schema.get(key)
        found += [r for sub in value for r in _refs_in(sub)] if isinstance(value, list) else []
    for key in SUBSCHEMA_MAPS:
        value = schema.get(key)
        found += [r for s in value.values() for r in _refs_in(s)] if isinstance(value, dict) else []
    return found


def _reachable_refs(root: dict[str, Any]) -> list[str]:
    """Every $ref a value of `root` may reach, through the definitions it names, in order."""
    seen: dict[str, None] = {}
    todo = _refs_in(root)
    while todo:
        ref = todo.pop(0)
        if ref not in seen:
            seen[ref] = None
            todo += _refs_in(_ref_target(root, ref))
    return list(seen)


def _ref_loop(root: dict[str, Any]) -> tuple[list[str], bool] | None:
    """A cycle of $refs each of which the one before may begin with (a grammar rule that
    begins with itself: left recursion, which llama.cpp refuses), as the refs in order with
    the first again at the end, and whether every schema on it is a bare $ref (a loop that
    names nothing else); None without one. The refs were checked to resolve."""
    edges: dict[str, tuple[list[str], bool]] = {}
    done: set[str] = set()
    stack: list[str] = []  # the refs being followed, each begun by the one before

    def visit(ref: str) -> list[str] | None:
        if ref in stack:
            return [*stack[stack.index(ref) :], ref]
        if ref in done:
            return None
        stack.append(ref)
        edges[ref] = _leading_refs(_ref_target(root, ref))
        for nxt in edges[ref][0]:
            cycle = visit(nxt)
            if cycle is not None:
                return cycle
        stack.pop()
        done.add(ref)
        return None

    for start in _reachable_refs(root):
        cycle = visit(start)
        if cycle is not None:
            return cycle, all(edges[r][1] for r in cycle[:-1])
    return None


def _check_schema(schema: Any, where: str, root: dict[str, Any]) -> None:
    if not isinstance(schema, dict):
        raise BadRequestError(f"{where}: a schema is an object, not {_said(schema)}")
    for key in schema:
        if key not in KEPT and key not in ANNOTATIONS:
            raise BadRequestError(
                f"{where}.{key}: not supported in structured output (the grammar cannot keep it)"
            )
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind] if kind is not None else []
    for k in kinds:
        if not isinstance(k, str) or k not in TYPES:
            raise BadRequestError(f"{where}.type: {_said(k)} is not a JSON schema type")
    present = CONSTRAINTS & set(schema)
    for shadow in ("$ref", "anyOf", "oneOf", "enum", "const"):
        if shadow in schema and present:
            raise BadRequestError(
                f"{where}: {', '.join(sorted(present))} beside {shadow} is not supported"
                " in structured output (put it in the schemas it chooses from)"
            )
    if isinstance(kind, list) and present:
        raise BadRequestError(
            f"{where}: {', '.join(sorted(present))} with a list of types is not supported;"
            " use anyOf with one schema per type"
        )
    _check_strings(schema, where)
    _check_arrays(schema, where, root)
    _check_objects(schema, where, root)
    for key in ("anyOf", "oneOf"):
        if key in schema:
            options = schema[key]
            if not isinstance(options, list) or not options:
                raise BadRequestError(f"{where}.{key}: a non-empty list of schemas")
            _few_choices(options, f"{where}.{key}")
            for i, sub in enumerate(options):
                _check_schema(sub, f"{where}.{key}.{i}", root)
    for key in ("$defs", "definitions"):
        defs = schema.get(key, {})
        if not isinstance(defs, dict):
            raise BadRequestError(f"{where}.{key}: an object of schemas")
        for name, sub in defs.items():
            _check_schema(sub, f"{where}.{key}.{name}", root)
    if "$ref" in schema:
        ref = schema["$ref"]
        if ref == "#":  # the converter resolves #/... paths only
            raise BadRequestError(
                f"{where}.$ref: '#', the whole schema, is not supported in structured output;"
                " put the part that recurs under $defs and name it (#/$defs/NAME)"
            )
        if not isinstance(ref, str) or not ref.startswith("#/"):
            raise BadRequestError(
                f"{where}.$ref: only references inside the schema (#/...) are supported"
            )
        if _ref_target(root, ref) is NOWHERE:
            raise BadRequestError(f"{where}.$ref: {ref} names nothing in the schema")
    if "enum" in schema:
        if not isinstance(schema["enum"], list) or not schema["enum"]:
            raise BadRequestError(f"{where}.enum: a non-empty list of values")
        _few_choices(schema["enum"], f"{where}.enum")
    for key in ("enum", "const"):
        if key in schema and _not_finite(schema[key]):
            raise BadRequestError(
                f"{where}.{key}: a number past the floats (1e999) or NaN is no JSON value (the"
                " grammar would write Infinity)"
            )
        if key in schema and _escaped_text(schema[key]):
            raise BadRequestError(
                f"{where}.{key}: a string with a quote, a backslash or a control character is"
                " not supported in structured output (the converter puts its JSON escapes into"
                " the grammar unescaped: the answer would not be that JSON)"
            )


def _said(value: Any) -> str:
    """A value for a message: a short JSON scalar as written, anything else by its kind (1e999,
    which Python reads as inf, as what it is, never as Infinity)."""
    if isinstance(value, float) and math.isinf(value):
        return "a number past the largest float"
    said = "" if isinstance(value, list | dict) else json.dumps(value)
    return said if 0 < len(said) <= 40 else json_kind(value)


def _few_choices(options: list[Any], where: str) -> None:
    if len(options) > MAX_CHOICES:
        raise BadRequestError(
            f"{where}: {len(options):,} choices; at most {MAX_CHOICES:,} (the grammar sampler"
            " follows each at every token)"
        )


def _scalars(value: Any) -> Iterator[Any]:
    """Every scalar in a JSON value, an object's keys included."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield k
            yield from _scalars(v)
    elif isinstance(value, list):
        for v in value:
            yield from _scalars(v)
    else:
        yield value


def _not_finite(value: Any) -> bool:
    """Whether a JSON value holds a float that JSON cannot write (Python reads 1e999 as inf)."""
    return any(isinstance(x, float) and not math.isfinite(x) for x in _scalars(value))


def _escaped_text(value: Any) -> bool:
    """Whether a JSON value holds a string that JSON writes with an escape other than \\uXXXX
    for a character past ASCII (a quote, a backslash, a control character)."""
    return any(
        isinstance(x, str) and any(c in '"\\' or ord(c) < 0x20 or c == "\x7f" for c in x)
        for x in _scalars(value)
    )


def _check_strings(schema: dict[str, Any], where: str) -> None:
    shapes: list[str] = [k for k in ("pattern", "format") if k in schema]
    lengths: list[str] = [k for k in ("minLength", "maxLength") if k in schema]
    if len(shapes) > 1 or (shapes and lengths):
        both = ", ".join(shapes + lengths)
        raise BadRequestError(f"{where}: {both} together are not supported in structured output")
    fmt = schema.get("format")
    if fmt is not None and (not isinstance(fmt, str) or fmt not in FORMATS):
        raise BadRequestError(
            f"{where}.format: {_said(fmt)} is not supported in structured output"
            " (only date, time, date-time, uuid)"
        )
    _counts(schema, "minLength", "maxLength", where)
    pattern = schema.get("pattern")
    if pattern is not None and not isinstance(pattern, str):
        raise BadRequestError(f"{where}.pattern: a regular expression (a string)")
    if isinstance(pattern, str):
        for low, high in _QUANTIFIER.findall(pattern):
            ends = (whole(low), whole(high or "0"))  # None: more digits than int() takes
            if None in ends or max(e or 0 for e in ends) > MAX_REPEAT:
                raise BadRequestError(
                    f"{where}.pattern: a repetition of at most {MAX_REPEAT:,} (the grammar"
                    " spells it out)"
                )
        # a `]` or `}` outside a class and a quantifier: the converter's loop never moves past one
        stray = next((c for c in _ESCAPE_CLASS_OR_COUNT.sub("", pattern) if c in "]}"), None)
        if stray is not None:
            raise BadRequestError(
                f"{where}.pattern: a '{stray}' that closes nothing is not supported in"
                " structured output (escape it: \\{stray})"
            )
        # the pattern's own grammar, made alone, so what llama.cpp cannot take is named by its path
        _converted({"type": "string", "pattern": pattern}, f"{where}.pattern")
        _check_pattern_text(pattern, f"{where}.pattern")


def _check_arrays(schema: dict[str, Any], where: str, root: dict[str, Any]) -> None:
    items, prefix = schema.get("items"), schema.get("prefixItems")
    if items is not None and prefix is not None:
        raise BadRequestError(f"{where}: items beside prefixItems is not supported")
    if prefix is not None and not isinstance(prefix, list):
        raise BadRequestError(f"{where}.prefixItems: a list of schemas, not {_said(prefix)}")
    tuple_items = prefix if prefix is not None else items if isinstance(items, list) else None
    counts = [k for k in ("minItems", "maxItems") if k in schema]
    if tuple_items is not None:
        if counts:
            raise BadRequestError(f"{where}: {counts[0]} with a tuple of items is not supported")
        for i, sub in enumerate(tuple_items):
            _check_schema(sub, f"{where}.{'prefixItems' if prefix else 'items'}.{i}", root)
    elif items is not None:
        _check_schema(items, f"{where}.items", root)
    _counts(schema, "minItems", "maxItems", where)


def _counts(schema: dict[str, Any], least: str, most: str, where: str) -> None:
    """Refuse a count that is none, or more than the grammar can spell out, and a least count
    above the most: the converter would write a grammar for one of them, and the answer would
    break the schema it was asked for."""
    for key in (k for k in (least, most) if k in schema):
        value = schema[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise BadRequestError(f"{where}.{key}: a whole count of at least 0, not {_said(value)}")
        if value > MAX_REPEAT:
            raise BadRequestError(
                f"{where}.{key}: at most {MAX_REPEAT:,} (the grammar spells it out)"
            )
    if least in schema and most in schema and schema[least] > schema[most]:
        raise BadRequestError(
            f"{where}: {least} {schema[least]} is above {most} {schema[most]}, so no value can"
            " be written"
        )


_ESCAPED_IN_JSON = frozenset({*range(0x20), ord('"'), ord("\\")})
_SAFE_CATEGORIES = {"CATEGORY_DIGIT", "CATEGORY_WORD", "CATEGORY_UNI_DIGIT", "CATEGORY_UNI_WORD"}


def _check_pattern_text(pattern: str, where: str) -> None:
    """Refuse a pattern that is no regular expression (a reversed range, unbalanced brackets, a
    repetition of a repetition: the converter wrote a grammar for something else, or none the
    model could follow) or that can write a character JSON escapes (the converter puts it in
    the string as it is: the answer would not be JSON)."""
    from . import re_adapter as sre

    try:
        parsed = sre.parse(pattern)
    except (re.error, RecursionError, OverflowError) as e:
        raise BadRequestError(f"{where}: not a regular expression ({e})") from None
    if _unescaped_in(parsed.data):
        raise BadRequestError(
            f"{where}: a pattern that can write a quote, a backslash or a control character is"
            " not supported in structured output (the converter puts it in the string"
            " unescaped: the answer would not be JSON)"
        )


def _unescaped_in(items: Any) -> bool:
    """Whether a parsed pattern names a character JSON writes escaped (negated classes and `.`
    are narrowed in the grammar instead)."""
    for op, arg in items:
        name = str(op)
        if name == "LITERAL" and arg in _ESCAPED_IN_JSON:
            return True
        if name == "RANGE" and any(arg[0] <= c <= arg[1] for c in _ESCAPED_IN_JSON):
            return True
        if name == "CATEGORY" and str(arg) not in _SAFE_CATEGORIES:
            return True
        if name == "IN" and not (arg and str(arg[0][0]) == "NEGATE") and _unescaped_in(arg):
            return True
        if name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT") and _unescaped_in(arg[2]):
            return True
        if name == "SUBPATTERN" and _unescaped_in(arg[-1]):
            return True
        if name == "BRANCH" and any(_unescaped_in(b) for b in arg[1]):
            return True
    return False


def _check_objects(schema: dict[str, Any], where: str, root: dict[str, Any]) -> None:
    props = schema.get("properties", {})
    if not isinstance(props, dict):
        raise BadRequestError(f"{where}.properties: an object of schemas")
    for name, sub in props.items():
        _check_schema(sub, f"{where}.properties.{name}", root)
    extra = schema.get("additionalProperties")
    if isinstance(extra, dict):
        _check_schema(extra, f"{where}.additionalProperties", root)
    elif extra is not None and not isinstance(extra, bool):
        raise BadRequestError(f"{where}.additionalProperties: true, false or a schema")
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise BadRequestError(f"{where}.required: a list of property names")
    missing = [r for r in required if r not in props]
    if missing:
        raise BadRequestError(
            f"{where}.required: {', '.join(missing)} not among the properties (structured"
            " output can only write properties the schema describes)"
        )


def add_grammar(
    chain: Sampler, vocab: Any, grammar: str, where: str = WHERE, parsed: Grammars | None = None
) -> Sampler:
    """`chain` (which the new sampler owns) held to the grammar as llama.cpp's
    `common_sampler` does: the chain samples, the grammar checks only the chosen token, and
    masks every candidate only when it refuses it (`GrammarSampler`). `chain` must have seen
    the prompt already (a grammar sampler accepts only the answer's tokens). BadRequestError
    when llama.cpp cannot parse it. With `parsed` (a server's), the grammar is parsed once
    there and copied here."""
    lib = chain.lib
    fault = _token_fault(lib, vocab, grammar)
    grammar_ptr = None
    if fault is None:
        grammar_ptr = _parse(lib, vocab, grammar) if parsed is None else parsed.fresh(grammar)
    if not grammar_ptr:
        chain.close()
        raise BadRequestError(f"{where}: " + (fault or "llama.cpp's grammar parser refuses it"))
    try:
        return GrammarSampler(chain, grammar_ptr, int(lib.llama_vocab_n_tokens(vocab)))
    except BaseException:  # neither handle was taken: free both
        lib.llama_sampler_free(grammar_ptr)
        chain.close()
        raise
