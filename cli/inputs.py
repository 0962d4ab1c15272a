"""Where `llmrun run` gets its prompts: arguments, stdin, -f files, --jsonl requests."""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmrun.runners.base import ChatMessage, Request, SamplingParams
from llmrun.runners.errors import (
    STRICT_JSON,
    BadRequestError,
    EmptyPromptError,
    OptionError,
    long_integer,
)
from llmrun.runners.files import output_file_problem, read_option_file
from llmrun.runners.limits import SAMPLING_SETTINGS, check_sampling

# A line's sampling keys: each setting's JSONL names (runners/limits.py), and its stop strings.
JSONL_SAMPLING_KEYS = {
    **{key: s.name for s in SAMPLING_SETTINGS.values() for key in s.jsonl},
    "stop": "stop",
}
JSONL_KEYS = {"id", "prompt", "messages", "system", "raw", *JSONL_SAMPLING_KEYS}
ROLES = {"system", "user", "assistant"}


@dataclass(frozen=True)
class Job:
    label: str  # how errors name this request: "prompt", "FILE", "FILE:LINE"
    request: Request | None
    error: str | None = None  # a line that could not be read; reported, then skipped
    given_id: str | int | None = None  # a JSONL line's own "id", returned as it was given

    @property
    def id(self) -> str | int:
        """How results name this request: the line's "id" where it has one, else the label."""
        return self.label if self.given_id is None else self.given_id


def make_request(text: str, *, system: str | None, raw: bool, sampling: SamplingParams) -> Request:
    if not text.strip():
        raise EmptyPromptError()
    if raw:
        prompt = f"{system}\n\n{text}" if system else text
        return Request(prompt=prompt, sampling=sampling)
    return Request.chat(text, system=system, sampling=sampling)


def combine(instruction: str, material: str) -> str:
    """An argument and piped material together: the material, then the instruction."""
    if not instruction:
        return material
    if not material.strip():
        return instruction
    return f"{material.rstrip()}\n\n{instruction}"


_WARNED: set[str] = set()


def repair_utf8(text: str, source: str = "stdin") -> str:
    """Bytes that were not UTF-8 (kept as surrogate escapes) become U+FFFD, with one warning."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        pass
    raw = text.encode("utf-8", errors="surrogateescape")
    try:  # valid UTF-8 that an ASCII locale (LC_ALL=C, PYTHONUTF8=0) decoded as escapes
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        pass
    repaired = raw.decode("utf-8", errors="replace")
    if source not in _WARNED:
        _WARNED.add(source)
        print(
            f"llmrun: warning: {source} is not valid UTF-8; bytes replaced with U+FFFD",
            file=sys.stderr,
            flush=True,
        )
    return repaired.encode("utf-8", errors="replace").decode("utf-8")


MAX_PROMPT_FILE_BYTES = 256 * 2**20  # beyond any context; /dev/zero never ends
TOO_MUCH_STDIN = "stdin is larger than 256 MiB, or does not end"


def read_stdin_if_piped() -> str:
    """A piped prompt, read to the same cap as a prompt file (characters, here): `< /dev/zero`
    is one line, not all the memory there is."""
    if sys.stdin is None or sys.stdin.isatty():
        return ""
    try:
        text = sys.stdin.read(MAX_PROMPT_FILE_BYTES + 2)  # the cap's characters and a "\n"
    except (OSError, ValueError):
        return ""
    if len(text.removesuffix("\n")) > MAX_PROMPT_FILE_BYTES:
        raise BadRequestError(TOO_MUCH_STDIN)
    return repair_utf8(text)


def read_stdin_line() -> str | None:
    """One line of a piped chat without its newline (None at the end), within the same cap."""
    line = sys.stdin.readline(MAX_PROMPT_FILE_BYTES + 2)  # the cap's characters and "\n"
    if len(line.removesuffix("\n")) > MAX_PROMPT_FILE_BYTES:
        raise BadRequestError(f"{TOO_MUCH_STDIN} (one line)")
    return repair_utf8(line.rstrip("\n")) if line else None


def output_file(flag: str, path: Path, example: str) -> Path:
    """A file an option names for a run's results (--stats-file, --plot), checked before the
    run: a name that cannot take them failed only after the whole run (a FIFO with no reader
    hung there), and the results were lost. One line naming the option, exit 1."""
    why = output_file_problem(path)
    if why is None:
        return path
    hint = f"; give a file name such as {example}" if why.no_file else ""
    raise BadRequestError(f"{flag} {path}: {why.text}{hint}")


def read_text(path: Path, flag: str, what: str) -> str:
    """A prompt or JSONL file's text: bytes that are not UTF-8 become U+FFFD, with one
    warning."""
    data = read_option_file(path, flag, MAX_PROMPT_FILE_BYTES, what)
    return repair_utf8(data.decode("utf-8", errors="surrogateescape"), str(path))


def collect_jobs(
    *,
    words: list[str],
    files: list[Path],
    jsonl: Path | None,
    system: str | None,
    raw: bool,
    sampling: SamplingParams,
) -> list[Job]:
    """Every request a `run` invocation asks for, in order."""
    instruction = repair_utf8(" ".join(words), "the prompt argument").strip()
    if system is not None:
        system = repair_utf8(system, "-s/--system")
    jobs: list[Job] = []
    for path in files:
        text = combine(instruction, read_text(path, "-f/--file", "prompt file"))
        if not text.strip():
            raise EmptyPromptError(f"prompt file {path}")
        jobs.append(Job(str(path), make_request(text, system=system, raw=raw, sampling=sampling)))
    if jsonl is not None:
        if instruction and not files:  # each line holds its request: the words would go nowhere
            raise OptionError(
                "--jsonl: each line is a whole request, so the prompt argument or -p would be"
                " dropped (with -f, it goes before each file's text)"
            )
        jobs.extend(read_jsonl(jsonl, system=system, raw=raw, sampling=sampling))
    if not files and jsonl is None:
        text = combine(instruction, read_stdin_if_piped())
        jobs.append(Job("prompt", make_request(text, system=system, raw=raw, sampling=sampling)))
    return jobs


def read_jsonl(path: Path, *, system: str | None, raw: bool, sampling: SamplingParams) -> list[Job]:
    jobs = []
    # JSON Lines: lines end with \n (\r\n tolerated); str.splitlines would also cut at U+2028,
    # U+0085 or a form feed, which JSON allows raw inside a string. A leading BOM is ignored.
    text = read_text(path, "--jsonl", "JSONL file").removeprefix("\ufeff")
    for n, line in enumerate(text.split("\n"), start=1):
        line = line.removesuffix("\r")
        if not line.strip():
            continue
        label = f"{path}:{n}"
        try:
            request, given_id = parse_jsonl_line(line, system=system, raw=raw, sampling=sampling)
            jobs.append(Job(label, request, given_id=given_id))
        except (BadRequestError, EmptyPromptError) as e:
            jobs.append(Job(label, None, error=str(e)))
    if not jobs:  # `<(zcat missing.gz)` too: its input lost, with no word, and exit 0
        raise EmptyPromptError(f"JSONL file {path}", 'one request per line: {"prompt": ...}')
    return jobs


def parse_jsonl_line(
    line: str, *, system: str | None, raw: bool, sampling: SamplingParams
) -> tuple[Request, str | int | None]:
    """One JSON Lines request and its "id" (None without one)."""
    try:
        obj: Any = json.loads(line, **STRICT_JSON)
    except json.JSONDecodeError as e:
        raise BadRequestError(
            f"not valid JSON: {e.msg.removesuffix(' at')} (column {e.colno})"
        ) from None
    except RecursionError:
        raise BadRequestError("not valid JSON (nested too deeply)") from None
    except ValueError:  # valid JSON, but an integer json.loads refuses: this line fails alone
        raise BadRequestError(f"holds {long_integer()}") from None
    try:  # RFC 8259 8.2: a \\uD800 escape without its pair decodes to no character
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise BadRequestError(
            "a \\u escape is half of a surrogate pair (not a character); send the pair or the"
            " character itself"
        ) from None
    if not isinstance(obj, dict):
        raise BadRequestError("a line must be a JSON object with 'prompt' or 'messages'")
    unknown = sorted(set(obj) - JSONL_KEYS)
    if unknown:
        raise BadRequestError(f"unknown key {unknown[0]!r}; known: {', '.join(sorted(JSONL_KEYS))}")
    overrides: dict[str, Any] = {}
    for key, field in JSONL_SAMPLING_KEYS.items():
        if key in obj:
            value = obj[key]
            if field == "stop":
                if isinstance(value, str):
                    value = (value,)
                elif isinstance(value, list):
                    value = tuple(value)
                elif value is not None:
                    raise BadRequestError("'stop' must be a string or a list of strings")
                else:
                    value = ()
            elif not isinstance(value, (int, float)) or isinstance(value, bool):
                raise BadRequestError(f"{key!r} must be a number")
            overrides[field] = value
    line_sampling = dataclasses.replace(sampling, **overrides)
    check_sampling(line_sampling)
    if line_sampling.grammar is not None and line_sampling.stop:  # as run's --stop is
        raise BadRequestError(
            "'stop': not with --json-schema or --grammar (a stop string cuts the answer the"
            " grammar keeps whole)"
        )
    line_system = obj.get("system", system)
    if line_system is not None and not isinstance(line_system, str):
        raise BadRequestError("'system' must be a string")
    if "raw" in obj and not isinstance(obj["raw"], bool):
        raise BadRequestError("'raw' must be true or false")
    given_id = obj.get("id")
    if given_id is not None and (
        not isinstance(given_id, (str, int)) or isinstance(given_id, bool)
    ):
        raise BadRequestError("'id' must be a string or an integer")
    if "messages" in obj:
        messages = obj["messages"]
        if not isinstance(messages, list) or not messages:
            raise BadRequestError("'messages' must be a non-empty list")
        parsed = []
        for m in messages:
            if (
                not isinstance(m, dict)
                or m.get("role") not in ROLES
                or not isinstance(m.get("content"), str)
            ):
                raise BadRequestError(
                    "each message needs a 'role' (system, user, assistant) and a 'content' string"
                )
            parsed.append(ChatMessage(m["role"], m["content"]))
        if line_system and parsed[0].role != "system":
            parsed.insert(0, ChatMessage("system", line_system))
        return Request(messages=tuple(parsed), sampling=line_sampling), given_id
    prompt = obj.get("prompt")
    if not isinstance(prompt, str):
        raise BadRequestError("a line needs a 'prompt' string or a 'messages' list")
    request = make_request(
        prompt, system=line_system, raw=bool(obj.get("raw", raw)), sampling=line_sampling
    )
    return request, given_id
