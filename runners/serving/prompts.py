"""Where `bench serve`'s and `bench interference`'s prompts come from: fresh random prompts (vLLM's
random dataset), a shared prefix on purpose, or a file of real prompts (ShareGPT JSON, JSONL).

Fresh: every request of every level, round and run gets its own prompt, its words (or tokens)
drawn from a seed derived from (--seed, the job, the request's place in the run), and its
opening made distinct from every other request's. A server that caches prompts (llama-server,
llmrun serve) then has nothing to answer from its cache: its TTFT is a prefill's. The
lengths are drawn once per request index, so every level measures the same lengths. Only
`--shared-prefix N` shares something, on purpose: N tokens (against a server, N words) before
every prompt, as vLLM's `--random-prefix-len`.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import random
import stat
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from llmrun.runners.errors import BadRequestError, long_integer, not_utf8

WORDS = (
    "time",
    "person",
    "year",
    "way",
    "day",
    "thing",
    "man",
    "world",
    "life",
    "hand",
    "part",
    "child",
    "eye",
    "woman",
    "place",
    "work",
    "week",
    "case",
    "point",
    "government",
    "company",
    "number",
    "group",
    "problem",
    "fact",
    "water",
    "room",
    "mother",
    "area",
    "money",
    "story",
    "month",
    "lot",
    "right",
    "study",
    "book",
    "word",
    "business",
    "issue",
    "side",
    "kind",
    "head",
    "house",
    "service",
    "friend",
    "father",
    "power",
    "hour",
    "game",
    "line",
    "end",
    "member",
    "law",
    "car",
    "city",
    "community",
    "name",
    "president",
    "team",
    "minute",
    "idea",
    "kid",
    "body",
    "information",
    "back",
    "parent",
    "face",
    "others",
    "level",
    "office",
    "door",
    "health",
    "art",
    "war",
    "history",
    "party",
    "result",
    "change",
    "morning",
    "reason",
    "research",
    "girl",
    "guy",
    "moment",
    "air",
    "teacher",
    "force",
    "education",
)
OPENING_WORDS = 3  # a text prompt's first words: its place in the run, as digits of base 88
OPENING_TOKENS = 2  # a token prompt's first tokens: its place, as digits of base n_vocab


def derived_seed(seed: int, *where: object) -> int:
    """A seed of its own for one place in a run: (--seed, the job, level, round, request...)."""
    digest = hashlib.sha256(repr((seed, *where)).encode()).digest()
    return int.from_bytes(digest[:8], "big")


@dataclass(frozen=True)
class PromptSpec:
    text: str
    input_tokens: int
    max_tokens: int


def random_lengths(
    count: int, *, input_len: int, output_len: int, range_ratio: float, seed: int
) -> list[tuple[int, int]]:
    """Each request's (prompt, output) length, uniform within ±range_ratio of the means as
    vLLM's random dataset; drawn once per request index, so every level has the same ones."""
    rng = random.Random(derived_seed(seed, "lengths"))

    def length(mean: int) -> int:
        low, high = max(1, round(mean * (1 - range_ratio))), max(1, round(mean * (1 + range_ratio)))
        return rng.randint(low, high)

    return [(length(input_len), length(output_len)) for _ in range(count)]


def _digits(k: int, base: int, width: int) -> list[int]:
    """k's digits in `base`, least significant first: the first `base` values all differ in
    the first digit, the first base**2 in the first two."""
    return [k // base**i % base for i in range(width)]


@dataclass
class FreshPrompts:
    """A run's random prompts, each new one its own: its opening (the first words or tokens)
    is its place in the run written in digits, least significant first, so no two of the
    first 88 text prompts (n_vocab token prompts) share even their first word (token), and
    any two share at most OPENING - 1; the rest is drawn from the seed of its place. Only
    `shared_prefix` words (tokens) are the same in every prompt, on purpose."""

    seed: int
    job: str  # "serve", "interference": one job's prompts are not another's
    shared_prefix: int = 0
    issued: int = 0  # prompts made so far: the next one's place in the run
    _order: tuple[str, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        order = list(WORDS)
        random.Random(derived_seed(self.seed, self.job, "opening")).shuffle(order)
        self._order = tuple(order)

    def _next(self) -> tuple[int, random.Random]:
        k, self.issued = self.issued, self.issued + 1
        return k, random.Random(derived_seed(self.seed, self.job, k))

    def text(self, n_words: int) -> str:
        """A prompt of the shared prefix's words and then `n_words` words of its own."""
        k, rng = self._next()
        prefix_rng = random.Random(derived_seed(self.seed, "prefix"))
        prefix = [prefix_rng.choice(WORDS) for _ in range(self.shared_prefix)]
        width = min(OPENING_WORDS, n_words)
        opening = [self._order[d] for d in _digits(k, len(WORDS), width)]
        rest = [rng.choice(WORDS) for _ in range(n_words - width)]
        return " ".join(prefix + opening + rest)

    def tokens(self, n_tokens: int, n_vocab: int) -> tuple[int, ...]:
        """Token ids as vLLM's random dataset draws them: the shared prefix, then `n_tokens`
        of its own."""
        k, rng = self._next()
        prefix_rng = random.Random(derived_seed(self.seed, "prefix"))
        prefix = [prefix_rng.randrange(n_vocab) for _ in range(self.shared_prefix)]
        offsets = random.Random(derived_seed(self.seed, self.job, "opening"))
        width = min(OPENING_TOKENS, n_tokens)
        opening = [(offsets.randrange(n_vocab) + d) % n_vocab for d in _digits(k, n_vocab, width)]
        rest = [rng.randrange(n_vocab) for _ in range(n_tokens - width)]
        return tuple(prefix + opening + rest)


def text_prompts(
    count_tokens: Callable[[str], int],
    fresh: FreshPrompts,
    lengths: Sequence[tuple[int, int]],
    progress: Callable[[], None] | None = None,
) -> list[PromptSpec]:
    """A fresh text prompt per (words, output tokens), its tokens counted by `count_tokens`
    (the server's tokenizer where it has one)."""
    out = []
    for n_in, n_out in lengths:
        text = fresh.text(n_in)
        out.append(PromptSpec(text, count_tokens(text), n_out))
        if progress is not None:
            progress()
    return out


# ---- datasets: real prompts from a file ------------------------------------------------------

# vLLM's filters (benchmarks' is_valid_sequence): prompts and outputs of at least 4 tokens,
# prompts of at most 1,024 and prompt + output of at most 2,048.
MIN_TOKENS, MAX_PROMPT_TOKENS, MAX_TOTAL_TOKENS = 4, 1024, 2048
MAX_LINE_BYTES = 16 * 1024 * 1024  # a JSONL line; past it the line is refused, not read
MAX_JSON_BYTES = 4 * 1024 * 1024 * 1024  # a ShareGPT file is read whole (ShareGPT V3: 0.7 GB)


def valid_lengths(prompt_tokens: int, output_tokens: int, *, given_output: bool = False) -> bool:
    """vLLM's filter of a dataset's requests; an output length given for all of them is
    not held to the minimum (vLLM's skip_min_output_len_check)."""
    return (
        prompt_tokens >= MIN_TOKENS
        and (given_output or output_tokens >= MIN_TOKENS)
        and prompt_tokens <= MAX_PROMPT_TOKENS
        and prompt_tokens + output_tokens <= MAX_TOTAL_TOKENS
    )


@dataclass(frozen=True)
class Entry:
    """One request of a dataset: its prompt, and its output length or the answer that gives
    it (ShareGPT's reply, counted in tokens)."""

    prompt: str
    answer: str | None = None
    output_len: int | None = None


@dataclass(frozen=True)
class Dataset:
    """A file of prompts, as read: its kind ("sharegpt", "jsonl"), sha256 and entries."""

    path: Path
    kind: str
    sha256: str
    entries: tuple[Entry, ...]

    @property
    def name(self) -> str:
        return self.path.name

    def record(self) -> dict[str, str]:
        return {"dataset": self.name, "dataset_kind": self.kind, "dataset_sha256": self.sha256}

    def sample(
        self,
        count_tokens: Callable[[str], int],
        *,
        count: int,
        seed: int,
        output_len: int,
        fixed: bool = False,
        progress: Callable[[], None] | None = None,
    ) -> list[PromptSpec]:
        """`count` requests as vLLM samples them: the entries shuffled with the seed, each
        counted in tokens and kept if vLLM's filters pass it, until there are enough. A JSONL
        line without an output length gets `output_len`; `fixed`: every entry does (vLLM's
        --sharegpt-output-len overrides the data's lengths so)."""
        order = list(range(len(self.entries)))
        random.Random(seed).shuffle(order)
        out: list[PromptSpec] = []
        for i in order:
            if len(out) >= count:
                break
            entry = self.entries[i]
            n_in, n_out = count_tokens(entry.prompt), output_len
            if not fixed and entry.output_len is not None:
                n_out = entry.output_len
            elif not fixed and entry.answer is not None:
                n_out = count_tokens(entry.answer)
            if valid_lengths(n_in, n_out, given_output=fixed):
                out.append(PromptSpec(entry.prompt, n_in, n_out))
                if progress is not None:
                    progress()
        if len(out) < count:
            hint = "fewer --num-prompts, or levels"
            room = max(0, MAX_TOTAL_TOKENS - output_len)
            if fixed and room < MAX_PROMPT_TOKENS:  # the given length takes the prompts' room
                hint = f"--output-len {output_len:,} leaves {room:,} prompt tokens" + (
                    f"; a smaller one, {hint}" if room >= MIN_TOKENS else "; a smaller one"
                )
            raise BadRequestError(
                f"--dataset {self.name}: {len(out)} of its {len(self.entries)} prompts pass"
                f" vLLM's length filters ({MIN_TOKENS} to {MAX_PROMPT_TOKENS:,} prompt tokens,"
                f" {MIN_TOKENS} or more output tokens, {MAX_TOTAL_TOKENS:,} in all);"
                f" {count} needed ({hint})"
            )
        return out


def _fail(path: Path, where: str, why: str) -> BadRequestError:
    return BadRequestError(f"--dataset {path}: {where}{why}")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _text(value: object) -> str | None:
    """A prompt's text if it is text a request can carry (no lone surrogates from \\ud800)."""
    if not isinstance(value, str):
        return None
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return None
    return value


def read_dataset(path: Path) -> Dataset:
    """ShareGPT JSON (a list of {"conversations": [...]}) or JSONL ({"prompt": ..., and
    optionally "output_len" or "max_tokens"} a line), told apart by the first character. A
    file that is neither raises one line naming the line or entry at fault."""
    try:
        if not stat.S_ISREG(path.stat().st_mode):  # a FIFO or a device: read three times here
            raise _fail(path, "", "not a regular file (a pipe or a device cannot be sampled)")
        with path.open("rb") as f:
            head = f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
        kind = "sharegpt" if head.startswith(b"[") else "jsonl"
        entries = _sharegpt(path) if kind == "sharegpt" else list(_jsonl(path))
        sha256 = _sha256(path)  # after the checks: a file they refuse is not read whole
    except OSError as e:
        raise _fail(path, "", f"cannot read it ({e.strerror or e})") from None
    if not entries:
        raise _fail(path, "", "no prompts in it (ShareGPT JSON or JSONL with 'prompt')")
    return Dataset(path, kind, sha256, tuple(entries))


def _loads(text: str, path: Path, line: str = "") -> object:
    """The JSON of a whole file, or of one JSONL `line` ("line N: "), refused in one line when
    it cannot be read: a syntax error placed by its line in a file, by its column in a line."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        if not line:
            raise _fail(path, f"line {e.lineno}: ", f"not JSON ({e.msg})") from None
        raise _fail(path, line, f"not JSON ({e.msg}, column {e.colno})") from None
    except ValueError:  # valid JSON: an integer of more digits than Python's int reads
        raise _fail(path, line, f"holds {long_integer()}") from None
    except RecursionError:
        raise _fail(path, line, "not JSON (nested too deeply)") from None


def _sharegpt(path: Path) -> list[Entry]:
    """vLLM's sharegpt loader: entries with two turns or more; the first is the prompt, the
    second the answer whose length in tokens is the output's."""
    if path.stat().st_size > MAX_JSON_BYTES:
        raise _fail(path, "", f"larger than {MAX_JSON_BYTES >> 30} GiB")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise _fail(path, "", not_utf8(e, 3 if raw.startswith(codecs.BOM_UTF8) else 0)) from None
    data = _loads(text, path)
    if not isinstance(data, list):
        raise _fail(path, "", "ShareGPT JSON is an array of {'conversations': [...]}")
    entries = []
    for i, item in enumerate(data):
        where = f"entry {i}: "
        if not isinstance(item, dict):
            raise _fail(path, where, "not an object with 'conversations'")
        turns = item.get("conversations")
        if turns is None:
            continue  # vLLM skips entries without conversations
        if not isinstance(turns, list):
            raise _fail(path, where, "'conversations' is not an array")
        if len(turns) < 2:
            continue  # and those without an answer
        texts = []
        for t, turn in enumerate(turns[:2]):
            value = _text(turn.get("value")) if isinstance(turn, dict) else None
            if value is None:
                raise _fail(path, where, f"conversations[{t}]: 'value' is not text")
            texts.append(value)
        entries.append(Entry(texts[0], answer=texts[1]))
    return entries


def _jsonl(path: Path) -> Iterator[Entry]:
    """One object a line: "prompt", and optionally "output_len" (or "max_tokens")."""
    with path.open("rb") as f:
        for n, line in enumerate(iter(lambda: f.readline(MAX_LINE_BYTES + 1), b""), 1):
            where = f"line {n}: "
            if len(line) > MAX_LINE_BYTES:
                raise _fail(path, where, f"longer than {MAX_LINE_BYTES >> 20} MiB")
            try:
                text = line.decode("utf-8-sig" if n == 1 else "utf-8")
            except UnicodeDecodeError as e:
                why = not_utf8(e, 3 if n == 1 and line.startswith(codecs.BOM_UTF8) else 0)
                raise _fail(path, where, why) from None
            if not text.strip():
                continue
            yield _jsonl_entry(_loads(text, path, where), path, where)


def _jsonl_entry(item: object, path: Path, where: str) -> Entry:
    if not isinstance(item, dict):
        raise _fail(path, where, "not a JSON object with 'prompt'")
    prompt = _text(item.get("prompt"))
    if prompt is None:
        raise _fail(path, where, "'prompt' is missing or not text")
    names = [k for k in ("output_len", "max_tokens") if k in item]
    if not names:
        return Entry(prompt)
    value = item[names[0]]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _fail(path, where, f"'{names[0]}' is not a whole number above 0")
    return Entry(prompt, output_len=value)
