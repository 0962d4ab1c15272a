"""Domain errors raised by engines and model resolution.

Each carries the facts needed for a one-line message; the CLI's error table turns them into
text and exit codes. Nothing here knows about the terminal.
"""

from __future__ import annotations

import math
import sys
from typing import Any

_JSON_KINDS = {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}


def json_kind(value: object, depth: int = 0) -> str:
    """What a JSON value is, in JSON's own words, for a message (never the value: it could be
    anything); an array's items' kinds too, `depth` arrays down (the data can nest without end)."""
    if isinstance(value, list) and depth > 0:
        held = sorted({json_kind(item, depth - 1) for item in value})
        return f"an array holding {' and '.join(held)}" if held else "an empty array"
    if value is None:
        return "null"
    return _JSON_KINDS.get(
        type(value), "a number" if isinstance(value, int | float) else type(value).__name__
    )


def long_integer() -> str:
    """The words for valid JSON that json.loads refuses with a plain ValueError: an integer of
    more digits than Python's int reads (RFC 8259 sets no limit; sys.get_int_max_str_digits)."""
    return f"a number of more than {sys.get_int_max_str_digits():,} digits, past what llmrun reads"


def cut(text: str, most: int) -> str:
    """Text for a message, past `most` characters cut with its length (a server's words, input
    said back): `first words... (200,000 characters)`."""
    return text if len(text) <= most else f"{text[:most].rstrip()}... ({len(text):,} characters)"


REF_CHARS = 200  # what a message quotes of a model reference or path, at most


def echo_cut(text: str) -> str:
    """Input quoted back in a message (a model reference, a path), `cut` to REF_CHARS, so that a
    100 KB argument is not said back whole (the cli's terminal_echo also takes out escapes)."""
    return cut(text, REF_CHARS)


def visible(text: str, most: int = REF_CHARS) -> str:
    """A value quoted in a message with its control and format characters shown as escapes
    (`\\x1b[31m`): a message's escapes are taken out on a terminal, so `-H $'\\e[31m'` was
    named as `-H :`, empty. Past `most` characters cut, with the length."""
    shown = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text[:most])
    return shown if len(text) <= most else f"{shown.rstrip()}... ({len(text):,} characters)"


def shown_short(text: str) -> str:
    """A value as written (a 400-digit number), past 24 characters its first 12 and its length:
    `100000000000…(401 characters)`."""
    return text if len(text) <= 24 else f"{text[:12]}…({len(text):,} characters)"


def _no_constant(name: str) -> Any:
    """Python reads NaN, Infinity and -Infinity; RFC 8259 has no such numbers."""
    raise BadRequestError(f"not valid JSON: {name} is not a JSON number (RFC 8259)")


def _finite(text: str) -> float:
    """RFC 8259 sets no range and Python reads 1e999 as inf: named as written, never as inf."""
    value = float(text)
    if math.isinf(value):
        raise BadRequestError(
            f"holds {shown_short(text)}, a number past the largest float (1.797e308)"
        )
    return value


# json.loads's hooks for JSON from a user's file (--jsonl, --json-schema): RFC 8259's numbers
# only, each one a float can hold
STRICT_JSON: dict[str, Any] = {"parse_constant": _no_constant, "parse_float": _finite}


def not_utf8(e: UnicodeDecodeError, before: int = 0) -> str:
    """The words for text that is not UTF-8, with the first byte that is not (counted from 0,
    with the `before` bytes the decoder never saw: utf-8-sig's BOM)."""
    return f"not UTF-8 text (byte {e.start + before:,} is {e.object[e.start]:#04x})"


class LlmrunError(Exception):
    """Base class of every error llmrun reports to its users without a traceback."""


class ModelNotFoundError(LlmrunError):
    def __init__(self, path: str, why: str = "") -> None:
        super().__init__(f"model file not found: {echo_cut(path)}" + (f" ({why})" if why else ""))
        self.path = path


DIRECTORY = "is a directory, not a GGUF file"  # InvalidModelFileError's problem for a folder
NOT_A_FILE = "is a device, a FIFO or a socket, not a GGUF file"  # and for /dev/zero, <(...)


class InvalidModelFileError(LlmrunError):
    """The file exists but is not a GGUF file llama.cpp can load (wrong magic, truncated, ...)."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = path
        self.problem = problem


class ModelLoadError(LlmrunError):
    """llama.cpp refused the file; `detail` is the last thing its log said."""

    def __init__(self, path: str, detail: str) -> None:
        super().__init__(f"llama.cpp could not load {path}: {detail}")
        self.path = path
        self.detail = detail


class ContextError(ModelLoadError):
    """The weights loaded, and llama.cpp refused a context on them: its words name the setting
    (a quantized V cache without flash attention, more sequences than it holds), not the file."""

    def __init__(self, path: str, detail: str) -> None:
        LlmrunError.__init__(self, f"llama.cpp could not create a context on {path}: {detail}")
        self.path = path
        self.detail = detail


class CancelledError(LlmrunError):
    """Ctrl-C (or SIGTERM) ended long work before it had anything to show."""


class LoadCancelledError(CancelledError):
    """Ctrl-C (or SIGTERM) while the weights were loading."""

    def __init__(self, path: str) -> None:
        super().__init__(f"loading {path} was interrupted")
        self.path = path


class HubError(LlmrunError):
    """A Hugging Face Hub reference could not be resolved to a local file."""


LISTED_NAMES = 10  # what a message lists of a repository's files, at most


def some_names(names: list[str], most: int = LISTED_NAMES) -> str:
    """Names for a message, the first `most` of them and how many more: a repository of
    200,000 files made one 3.4 MB line."""
    shown = ", ".join(echo_cut(n) for n in names[:most])
    return shown + (f" and {len(names) - most:,} more" if len(names) > most else "")


class AmbiguousModelError(HubError):
    def __init__(self, ref: str, candidates: list[str]) -> None:
        super().__init__(f"{echo_cut(ref)} matches several files: {some_names(candidates)}")
        self.ref = ref
        self.candidates = candidates


class EmptyPromptError(LlmrunError):
    def __init__(self, where: str = "the prompt", hint: str | None = None) -> None:
        super().__init__(f"{where} is empty")
        self.where = where
        self.hint = hint  # what to do instead, where the CLI's general one does not fit


class ChatTemplateError(LlmrunError):
    """The chat template (the model's, or --chat-template-file's) fails to render the
    conversation."""

    def __init__(self, problem: str, whose: str = "the model's chat template") -> None:
        super().__init__(f"{whose} fails: {problem}")
        self.problem = problem


class ChatTemplateTooLargeError(ChatTemplateError):
    """The model's own chat template is past the cap a --chat-template-file has: refused before
    Jinja parses it (a 14 MB one took a minute and 680 MB, deaf to SIGTERM)."""

    def __init__(self, size_bytes: int, max_bytes: int) -> None:
        LlmrunError.__init__(
            self,
            f"the model's chat template is too large ({size_bytes:,} bytes, over the"
            f" {max_bytes >> 20} MiB limit)",
        )
        self.problem = "too large"


class PromptTooLongError(LlmrunError):
    """A prompt that leaves no room in the context for one token of output."""

    def __init__(self, prompt_tokens: int, n_ctx: int) -> None:
        super().__init__(
            f"the prompt is {prompt_tokens} tokens long but the context holds {n_ctx}"
            if prompt_tokens > n_ctx
            else f"the prompt is {prompt_tokens} tokens long and the context holds {n_ctx}:"
            " no room is left for a token of output"
        )
        self.prompt_tokens = prompt_tokens
        self.n_ctx = n_ctx


class BadRequestError(LlmrunError):
    """A request line or option that cannot be run (malformed JSONL, unknown role, ...)."""

    param: str | None = None  # the HTTP request's field at fault, where one is (OpenAI's `param`)


NO_MODEL = "-m/--model: an empty name names no model (leave -m out for the embedded one)"


class OptionError(BadRequestError):
    """A command-line value that cannot be read as its option's syntax (a llama-bench list, a
    policy, a duration, a draft): a usage error, exit 2, like a number that is none."""


class EnvironmentSettingError(BadRequestError):
    """A variable of the environment that the HTTP client reads (HTTP_PROXY, HTTPS_PROXY,
    ALL_PROXY, NO_PROXY, SSL_CERT_FILE, SSL_CERT_DIR) holds what it cannot use: exit 1, as an
    LLMRUN_HOME that names a file (no option of llmrun's: not a usage error)."""


class EngineError(LlmrunError):
    """llama.cpp failed in the middle of a request."""


class EngineAbortError(EngineError):
    """llama.cpp hit one of its own assertions (GGML_ASSERT): the process cannot go on."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"llama.cpp aborted: {reason}")
        self.reason = reason


class ServerError(LlmrunError):
    """An OpenAI-compatible server could not be reached or answered with an error."""

    def __init__(self, endpoint: str, problem: str) -> None:
        super().__init__(f"{endpoint}: {problem}")
        self.endpoint = endpoint
        self.problem = problem


class ServerUnreachableError(ServerError):
    """Nothing answered: connection refused, unknown host, or a connect timeout."""


class ProxyUnreachableError(ServerUnreachableError):
    """The proxy the environment routes the server's requests through (HTTP_PROXY,
    HTTPS_PROXY, ALL_PROXY) could not be reached or failed: the proxy is named, not the server."""

    def __init__(self, endpoint: str, problem: str, variable: str) -> None:
        super().__init__(endpoint, problem)
        self.variable = variable


class BadEndpointError(OptionError):
    """An endpoint that is not an http(s) URL (shown with its credentials redacted): a usage
    error, exit 2, as a value --rpc cannot read is."""

    def __init__(self, shown: str, why: str = "") -> None:
        what = why or "not an http(s) URL such as http://127.0.0.1:8080"
        super().__init__(f"{what}: '{shown}'")
        self.shown = shown


class ServerTimeoutError(ServerError):
    """The server accepted the request but sent nothing within the read timeout."""

    def __init__(self, endpoint: str, timeout_s: float) -> None:
        super().__init__(endpoint, f"no answer within {timeout_s:g} s")
        self.timeout_s = timeout_s


class DefaultModelMissingError(LlmrunError):
    def __init__(self) -> None:
        super().__init__("the embedded default model is not installed")


class NoServerModelError(ServerError):
    """The server lists no model and none was named."""

    def __init__(self, endpoint: str) -> None:
        super().__init__(endpoint, "/v1/models lists no model")
