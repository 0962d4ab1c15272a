"""What `bench serve` and `bench interference` measure, parsed once from the options' text."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from llmrun.runners.errors import BadRequestError, OptionError
from llmrun.runners.lists import MAX_VALUE, parse_values, real
from llmrun.runners.progress import Tally
from llmrun.runners.serving.batching import Policy
from llmrun.runners.serving.prompts import Dataset, random_lengths

DEFAULT_POLICIES = "prefill-first,chunked:64,decode-first"
# Below one request a minute on average a level would run for hours (1e-9: for ever).
MIN_RATE = 1 / 60
# A level's prompts are made before it starts; beyond these, making them alone would take minutes
# and gigabytes (2,000,000 prompts; 100,000,000 tokens each), with no way to stop it.
MAX_PROMPTS = 100_000
MAX_INPUT_LEN = 1_048_576
MAX_PROMPT_TOKENS = 50_000_000  # num_prompts x input_len, in all
# A request's output: its context holds it (the local engine sizes each sequence's by it: an
# uncapped --output-len hung in creating a context of 9 GB, deaf to SIGTERM), and every token's
# time is kept, so the level's output tokens in all have the prompts' cap too.
MAX_OUTPUT_LEN = MAX_INPUT_LEN


def parse_rate(text: str) -> float:
    rate = real(text)
    if rate is None:
        raise OptionError(f"--request-rate: '{text}' is not a number or inf")
    if math.isnan(rate) or rate <= 0:
        raise OptionError(
            f"--request-rate: '{text}' must be a number above 0 (inf: all requests at once)"
        )
    if rate < MIN_RATE:
        raise OptionError(
            f"--request-rate: {text} requests/s would wait hours between"
            f" requests; give at least {MIN_RATE:.4f} (one a minute)"
        )
    return rate


def check_prompts(
    num_prompts: int, input_len: int, shared_prefix: int = 0, output_len: int = 0, warmup: int = 0
) -> None:
    """Refuse a load whose prompts and answers could not be made, kept or timed in memory and
    time."""
    for name, count in (("--num-prompts", num_prompts), ("--warmup", warmup)):
        if count > MAX_PROMPTS:
            raise BadRequestError(f"{name} {count:,}: at most {MAX_PROMPTS:,}")
    if output_len > MAX_OUTPUT_LEN:
        raise BadRequestError(f"--output-len {output_len:,}: at most {MAX_OUTPUT_LEN:,} tokens")
    if num_prompts * output_len > MAX_PROMPT_TOKENS:
        raise BadRequestError(
            f"--num-prompts {num_prompts:,} x --output-len {output_len:,}: at"
            f" most {MAX_PROMPT_TOKENS:,} output tokens in all"
        )
    if input_len + shared_prefix > MAX_INPUT_LEN:
        named = (
            f"--shared-prefix {shared_prefix:,} + --input-len {input_len:,}"
            if shared_prefix
            else f"--input-len {input_len:,}"
        )
        raise BadRequestError(f"{named}: at most {MAX_INPUT_LEN:,} tokens")
    input_len += shared_prefix
    if num_prompts * input_len > MAX_PROMPT_TOKENS:
        raise BadRequestError(
            f"--num-prompts {num_prompts:,} x --input-len {input_len:,}: at"
            f" most {MAX_PROMPT_TOKENS:,} prompt tokens in all"
        )


def parse_percentiles(text: str) -> tuple[float, ...]:
    """`50,90,99` -> (50.0, 90.0, 99.0)."""
    read = [real(p) for p in text.split(",") if p.strip()]
    values = tuple(v for v in read if v is not None)
    if len(values) < len(read):
        raise OptionError(f"--percentiles: '{text}' should be numbers such as 50,90,99")
    if not values or any(not 0 <= v <= 100 for v in values):
        raise OptionError("--percentiles: give values between 0 and 100, such as 50,90,99")
    return values


MAX_SLO_S = 86_400.0


def parse_slo(text: str | None) -> dict[str, float]:
    """`ttft:500,tpot:50` (milliseconds) -> {"ttft": 0.5, "tpot": 0.05}."""
    slo: dict[str, float] = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        name, _, value = part.partition(":")
        name = name.strip().lower()
        if name not in ("ttft", "tpot", "e2el") or not value.strip():
            raise OptionError(f"--slo: '{part}' should be ttft:MS, tpot:MS or e2el:MS")
        slo[name] = (real(value) or math.nan) / 1000
        if not 0 < slo[name] <= MAX_SLO_S:  # NaN too; a bound past a day is no objective
            raise OptionError(
                f"--slo: '{value.strip()}' is not a number of milliseconds from 0 to a day"
                f" ({MAX_SLO_S * 1000:,.0f})"
            )
    return slo


def parse_concurrency(
    text: str, name: str = "--concurrency", maximum: int = MAX_VALUE
) -> tuple[int, ...]:
    return tuple(parse_values(text, name=name, minimum=1, maximum=maximum))


def parse_policies(text: str) -> tuple[Policy, ...]:
    chosen = tuple(Policy.parse(p) for p in text.split(",") if p.strip())
    if not chosen:
        raise OptionError("--policy: give one or more of prefill-first, chunked:B, decode-first")
    return chosen


@dataclass(frozen=True)
class Stage:
    """What is being measured now (a progress line): with a `tally`, counted while it runs."""

    text: str
    tally: Tally | None = None  # requests done of total, tokens for the estimate
    unit: str = "requests"


DEFAULT_INPUT_LEN = 128  # bench serve's --input-len and --output-len when not given
DEFAULT_OUTPUT_LEN = 64


@dataclass(frozen=True)
class ServeOptions:
    """The serving load (vLLM's random dataset and metrics), against a server or this engine."""

    concurrency: tuple[int, ...]
    request_rate: float  # requests per second, Poisson arrivals; inf: all at once
    num_prompts: int  # requests per level
    input_len: int  # mean prompt tokens
    output_len: int  # mean output tokens
    range_ratio: float  # lengths uniform within ±this share of the mean
    warmup: int  # untimed requests before each level
    percentiles: tuple[float, ...]
    slo: Mapping[str, float] = field(default_factory=dict)  # metric -> seconds
    seed: int = 1234
    policies: tuple[Policy, ...] = ()  # the local engine's scheduling policies
    shared_prefix: int = 0  # tokens every prompt starts with, on purpose (vLLM's random-prefix-len)
    dataset: Dataset | None = None  # real prompts and lengths, in place of random ones
    # --output-len given: with a dataset, every request's output length over the data's
    # (vLLM's --sharegpt-output-len); otherwise the data's, and output_len for a line without
    output_len_given: bool = False

    def __post_init__(self) -> None:
        check_prompts(
            self.num_prompts, self.input_len, self.shared_prefix, self.output_len, self.warmup
        )
        if math.isnan(self.request_rate) or self.request_rate < MIN_RATE:
            parse_rate(str(self.request_rate))

    def lengths(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """A level's fresh prompts' (prompt, output) lengths: its warm-up's (the means, at most
        16 out) and its measured ones' (drawn once: every level has the same)."""
        warm = [(self.input_len, min(self.output_len, 16))] * self.warmup
        measured = random_lengths(
            self.num_prompts,
            input_len=self.input_len,
            output_len=self.output_len,
            range_ratio=self.range_ratio,
            seed=self.seed,
        )
        return warm, measured


@dataclass(frozen=True)
class InterferenceOptions:
    """One decoding stream alone, then while long prompts arrive at `rate` per second."""

    rate: float  # long prompts per second
    prompt_len: int  # tokens per long prompt
    output_len: int  # the stream's tokens
    seed: int = 1234
    input_len: int = 128  # a server's steady client: its prompt (at most 64 tokens)
    num_prompts: int = 16  # the local engine: long prompts (at most 8)
    policies: tuple[Policy, ...] = ()  # the local engine's scheduling policies

    def __post_init__(self) -> None:
        if not math.isfinite(self.rate) or self.rate <= 0:
            raise BadRequestError(f"--rate: '{self.rate}' must be a number of prompts per second")
        if self.prompt_len > MAX_INPUT_LEN:
            raise BadRequestError(
                f"--prompt-len {self.prompt_len:,}: at most {MAX_INPUT_LEN:,} tokens"
            )
        if self.output_len > MAX_OUTPUT_LEN:
            raise BadRequestError(
                f"--output-len {self.output_len:,}: at most {MAX_OUTPUT_LEN:,} tokens"
            )
