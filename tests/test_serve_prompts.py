"""Where bench serve's and bench interference's prompts come from (issue 29, issue 31 item 5):
fresh prompts that share no prefix across levels, rounds and jobs, a shared prefix only on
purpose, the cached prompt tokens a server reports, and real prompts from a dataset file."""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import os
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from llmrun.cli.app import app
from llmrun.cli.bench.serve import serving_table
from llmrun.runners.errors import BadRequestError, CancelledError
from llmrun.runners.llamacpp import LlamaCppRunner
from llmrun.runners.remote import OpenAIRunner
from llmrun.runners.serving.load import (
    ServingLevel,
    interfere_remote,
    level_prompts,
    send,
    serve_remote,
)
from llmrun.runners.serving.local import round_prompts
from llmrun.runners.serving.options import InterferenceOptions, ServeOptions
from llmrun.runners.serving.prompts import (
    FreshPrompts,
    PromptSpec,
    read_dataset,
    valid_lengths,
)

from .stub_server import Handler, _Server, stub_server


def _options(**kw: object) -> ServeOptions:
    base: dict[str, object] = {
        "concurrency": (1, 2, 4),
        "request_rate": float("inf"),
        "num_prompts": 8,
        "input_len": 32,
        "output_len": 4,
        "range_ratio": 0.0,
        "warmup": 1,
        "percentiles": (50.0,),
    }
    return ServeOptions(**{**base, **kw})  # type: ignore[arg-type]


def common_prefix(a: Sequence[object], b: Sequence[object]) -> int:
    """How many leading items two prompts share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _longest_shared(prompts: Sequence[Sequence[object]]) -> int:
    return max(common_prefix(a, b) for a, b in itertools.combinations(prompts, 2))


@contextmanager
def recording_stub() -> Iterator[tuple[str, list[str]]]:
    """The stub server, keeping every completion's prompt as it was sent."""
    sent: list[str] = []
    lock = threading.Lock()

    class Recording(Handler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            data = json.loads(body or b"{}")
            if isinstance(data, dict) and "prompt" in data:
                with lock:
                    sent.append(data["prompt"])
            # the body again for the stub, then the connection's own stream back: kept alive,
            # its next request is read there (left on the spent copy, a request that came next
            # on the connection went unrecorded: 7 of 8 prompts, in about a third of runs)
            stream, self.rfile = self.rfile, io.BytesIO(body)
            try:
                super().do_POST()
            finally:
                self.rfile = stream

    server = _Server(("127.0.0.1", 0), Recording)
    thread = threading.Thread(target=server.serve_forever, args=(0.01,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", sent
    finally:
        server.shutdown()
        server.server_close()


# ---- fresh prompts, no model -----------------------------------------------------------------


def test_ctrl_c_ends_the_counting_of_prompts(tmp_path: Path) -> None:
    """Preparing prompts asks the server once per prompt (a dataset whose entries the filters
    refuse, once per entry): the first Ctrl-C or SIGTERM ends it, not the second."""
    data = tmp_path / "many.jsonl"
    data.write_text('{"prompt": "x"}\n' * 2000)
    cancel = threading.Event()
    cancel.set()
    with stub_server() as url:
        runner = OpenAIRunner(url, model="stub")
        try:
            for options in (_options(), _options(dataset=read_dataset(data))):
                with pytest.raises(CancelledError):
                    level_prompts(runner, options, lambda: None, cancel)
        finally:
            runner.close()


def test_fresh_text_prompts_share_no_prefix_across_levels_and_warm_ups() -> None:
    with stub_server() as url:
        runner = OpenAIRunner(url, model="stub")
        try:
            made = level_prompts(runner, _options(), lambda: None, threading.Event())
            again = level_prompts(runner, _options(), lambda: None, threading.Event())
            other = level_prompts(runner, _options(seed=7), lambda: None, threading.Event())
        finally:
            runner.close()
    prompts = [p for warm, measured in made for p in [*warm, *measured]]
    assert len(prompts) == 3 * (8 + 1)
    words = [p.text.split() for p in prompts]
    assert _longest_shared(words) == 0  # not even the first word
    # the same lengths at every level, so levels stay comparable
    assert [len(p.text.split()) for p in made[0][1]] == [len(p.text.split()) for p in made[2][1]]
    assert again == made  # deterministic for a seed
    assert [p.text for _, m in other for p in m] != [p.text for _, m in made for p in m]


def test_fresh_prompts_past_one_word_per_request_share_at_most_one() -> None:
    fresh = FreshPrompts(1234, "serve")
    words = [fresh.text(16).split() for _ in range(500)]
    assert _longest_shared(words) == 1
    assert _longest_shared(words[:88]) == 0


def test_fresh_token_prompts_share_no_prefix() -> None:
    fresh = FreshPrompts(1234, "serve")
    prompts = [list(fresh.tokens(24, 49152)) for _ in range(300)]
    assert _longest_shared(prompts) == 0
    assert all(len(p) == 24 for p in prompts)
    assert FreshPrompts(1234, "serve").tokens(24, 49152) == tuple(prompts[0])


def test_serve_and_interference_prompts_differ_for_the_same_seed() -> None:
    serve, interference = FreshPrompts(1234, "serve"), FreshPrompts(1234, "interference")
    a = [serve.text(64).split() for _ in range(3)]
    b = [interference.text(64).split() for _ in range(3)]
    assert all(common_prefix(x, y) <= 1 for x in a for y in b)
    assert not {tuple(x) for x in a} & {tuple(y) for y in b}


def test_shared_prefix_is_shared_on_purpose_and_nothing_more() -> None:
    fresh = FreshPrompts(1234, "serve", shared_prefix=10)
    words = [fresh.text(20).split() for _ in range(40)]
    assert all(len(w) == 30 for w in words)
    shared = [common_prefix(a, b) for a, b in itertools.combinations(words, 2)]
    assert set(shared) == {10}
    tokens = [list(fresh.tokens(20, 1000)) for _ in range(40)]
    assert {common_prefix(a, b) for a, b in itertools.combinations(tokens, 2)} == {10}


def test_every_request_the_server_gets_is_its_own(cli: CliRunner) -> None:
    """End to end against a server: two levels of bench serve and an interference run, every
    prompt sent (warm-ups included) distinct from the first word on."""
    with recording_stub() as (url, sent):
        runner = OpenAIRunner(url, model="stub")
        try:
            levels = [
                e
                for e in serve_remote(
                    runner, _options(concurrency=(1, 2), num_prompts=4), cancel=threading.Event()
                )
                if isinstance(e, ServingLevel)
            ]
            found = list(
                interfere_remote(
                    runner,
                    InterferenceOptions(
                        rate=10.0, prompt_len=32, output_len=4, seed=1234, input_len=16
                    ),
                    cancel=threading.Event(),
                )
            )
        finally:
            runner.close()
    assert len(levels) == 2 and found
    assert len(sent) >= 2 * (4 + 1) + 3
    assert _longest_shared([s.split() for s in sent]) == 0


# ---- cached prompt tokens ----------------------------------------------------------------------


def test_cached_tokens_from_the_servers_answer() -> None:
    prompt = PromptSpec("a b c", 3, 4)
    with stub_server() as url:
        said, unsaid = OpenAIRunner(url, model="stub"), OpenAIRunner(url, model="nousage")
        try:
            assert send(said, prompt, threading.Event()).cached_tokens == 4  # timings.cache_n
            assert send(unsaid, prompt, threading.Event()).cached_tokens is None
        finally:
            said.close()
            unsaid.close()


def test_bench_serve_shows_and_records_cached_tokens(cli: CliRunner) -> None:
    with stub_server() as url:
        args = ["bench", "serve", "--endpoint", url, "-m", "stub", "--concurrency", "1"]
        result = cli.invoke(app, [*args, "--num-prompts", "2", "-o", "json", "--no-history"])
        runner = OpenAIRunner(url, model="stub")
        try:
            options = _options(concurrency=(1,), num_prompts=2)
            levels = [
                e
                for e in serve_remote(runner, options, cancel=threading.Event())
                if isinstance(e, ServingLevel)
            ]
        finally:
            runner.close()
    assert result.exit_code == 0, result.stderr
    (record,) = json.loads(result.stdout)
    assert record["total_cached_tokens"] == 2 * 4
    assert "shared_prefix" not in record and "dataset" not in record
    console = Console(record=True, width=120)
    console.print(serving_table(levels, (50.0,)))
    row = next(line for line in console.export_text().splitlines() if "cached" in line)
    assert "24 / 8" in row  # the stub: 12 prompt tokens a request, 4 of them cached


# ---- datasets ----------------------------------------------------------------------------------


def _sharegpt(path: Path, n: int = 6) -> Path:
    entries = [
        {
            "id": str(i),
            "conversations": [
                {"from": "human", "value": " ".join(["ask"] * (4 + i))},
                {"from": "gpt", "value": " ".join(["answer"] * (5 + i))},
            ],
        }
        for i in range(n)
    ]
    entries.append({"id": "short", "conversations": [{"from": "human", "value": "hi"}]})
    entries.append({"id": "tiny", "conversations": [{"value": "a b"}, {"value": "c d e f"}]})
    path.write_text(json.dumps(entries))
    return path


def _words(text: str) -> int:
    return len(text.split())


def test_sharegpt_is_read_and_sampled_as_vllm_does(tmp_path: Path) -> None:
    data = read_dataset(_sharegpt(tmp_path / "share.json"))
    assert data.kind == "sharegpt" and len(data.entries) == 7  # the one-turn entry skipped
    sampled = data.sample(_words, count=6, seed=3, output_len=64)
    assert sorted(p.input_tokens for p in sampled) == [4, 5, 6, 7, 8, 9]  # "a b": under 4
    assert all(p.max_tokens == p.input_tokens + 1 for p in sampled)  # the answer's length
    assert data.sample(_words, count=6, seed=3, output_len=64) == sampled
    assert [p.text for p in data.sample(_words, count=3, seed=4, output_len=64)] != [
        p.text for p in sampled[:3]
    ]
    with pytest.raises(BadRequestError, match="6 of its 7 prompts pass vLLM's length filters"):
        data.sample(_words, count=7, seed=3, output_len=64)


def test_a_given_output_len_overrides_the_datas_as_vllms_sharegpt_output_len(
    tmp_path: Path,
) -> None:
    data = read_dataset(_sharegpt(tmp_path / "share.json"))
    sampled = data.sample(_words, count=6, seed=3, output_len=32, fixed=True)
    assert {p.max_tokens for p in sampled} == {32}
    assert [p.text for p in sampled] == [
        p.text for p in data.sample(_words, count=6, seed=3, output_len=64)
    ]


def test_a_given_output_len_under_4_skips_vllms_output_filter(tmp_path: Path) -> None:
    """vLLM's --sharegpt-output-len skips its minimum on outputs (skip_min_output_len_check):
    --output-len 1 with --dataset keeps the prompts instead of refusing all of them."""
    data = read_dataset(_sharegpt(tmp_path / "share.json"))
    sampled = data.sample(_words, count=6, seed=3, output_len=1, fixed=True)
    assert {p.max_tokens for p in sampled} == {1}


def test_a_given_output_len_past_the_total_is_named(tmp_path: Path) -> None:
    """Every prompt fails the total length's filter because of --output-len: the error says
    so, not to ask for fewer prompts."""
    data = read_dataset(_sharegpt(tmp_path / "share.json"))
    with pytest.raises(BadRequestError, match="--output-len 2,045 leaves") as e:
        data.sample(_words, count=1, seed=3, output_len=2045, fixed=True)
    assert "fewer --num-prompts" not in str(e.value)


def test_vllms_length_filters() -> None:
    assert valid_lengths(4, 4) and valid_lengths(1024, 1024)
    assert not valid_lengths(3, 100) and not valid_lengths(100, 3)
    assert not valid_lengths(1025, 10) and not valid_lengths(1000, 1049)


def test_jsonl_dataset(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(
        '{"prompt": "one two three four five", "output_len": 8}\n\n'
        '{"prompt": "six seven eight nine", "max_tokens": 5}\n'
        '{"prompt": "ten eleven twelve thirteen"}\n'
    )
    data = read_dataset(path)
    assert data.kind == "jsonl"
    assert data.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    sampled = data.sample(_words, count=3, seed=1, output_len=6)
    assert sorted((p.input_tokens, p.max_tokens) for p in sampled) == [(4, 5), (4, 6), (5, 8)]


def test_a_fifo_dataset_is_refused_without_blocking(tmp_path: Path) -> None:
    """A pipe would block the open and could not be read three times (head, hash, prompts)."""
    fifo = tmp_path / "prompts.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(BadRequestError, match="not a regular file"):
        read_dataset(fifo)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "no prompts in it"),
        (b"\n\n  \n", "no prompts in it"),
        (b'{"prompt": "a b c d"}\n{"prompt": 3}\n', "line 2: 'prompt' is missing or not text"),
        (b'{"prompt": "a b c d"}\nnot json\n', "line 2: not JSON"),
        (b'["a"]\n', "entry 0: not an object with 'conversations'"),
        (b'{"prompt": "ok ok ok ok"}\n[1]\n', "line 2: not a JSON object"),
        (b'{"prompt": "a", "output_len": 0}\n', "line 1: 'output_len' is not a whole number"),
        (b'{"prompt": "a", "output_len": true}\n', "line 1: 'output_len' is not a whole number"),
        (b'{"prompt": "a", "max_tokens": "9"}\n', "line 1: 'max_tokens' is not a whole number"),
        (b'{"prompt": "\\ud800"}\n', "line 1: 'prompt' is missing or not text"),
        (
            b'{"prompt": "ok"}\n{"prompt": "\xff\xfe"}\n',
            "line 2: not UTF-8 text (byte 12 is 0xff)",
        ),
        (b"[" * 100_000, "not JSON"),
        (b'{"a":' * 100_000, "line 1: not JSON"),
        (b'{"conversations": 3}', "line 1: 'prompt' is missing"),
        (b'[{"conversations": 3}]', "entry 0: 'conversations' is not an array"),
        (b'[{"conversations": [{"value": 1}, {"value": "x"}]}]', "entry 0: conversations[0]"),
        (b'[{"conversations": ["a", "b"]}]', "entry 0: conversations[0]: 'value' is not text"),
        (b'[{"conversations": [{"value": "\xff"}, {}]}]', "not UTF-8 text (byte 31 is 0xff)"),
        # counted in the file, the BOM too (the decoder counted from after it)
        (b'\xef\xbb\xbf[{"conversations": [{"value": "\xff"}]}]', "(byte 34 is 0xff)"),
        (b'\xef\xbb\xbf{"prompt": "\xff"}\n', "line 1: not UTF-8 text (byte 15 is 0xff)"),
        (b"[1, 2", "line 1: not JSON"),
        (b'{"x": 1}', "line 1: 'prompt' is missing"),
        (
            b'{"prompt": "a", "output_len": ' + b"9" * 5000 + b"}\n",
            "line 1: holds a number of more",
        ),
        (
            b'[{"conversations": [{"value": ' + b"9" * 5000 + b"}]}]",
            "holds a number of more than 4,300 digits, past what llmrun reads",
        ),
    ],
)
def test_a_bad_dataset_is_one_line_naming_the_line_or_entry(
    tmp_path: Path, content: bytes, message: str
) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content)
    with pytest.raises(BadRequestError) as caught:
        read_dataset(path)
    text = str(caught.value)
    assert "\n" not in text
    assert text.startswith(f"--dataset {path}: ")  # the path as given, not its last part
    assert message in text


def test_a_huge_line_is_refused_without_reading_it(tmp_path: Path) -> None:
    path = tmp_path / "huge.jsonl"
    with path.open("wb") as f:
        f.write(b'{"prompt": "fine fine fine fine"}\n{"prompt": "')
        f.write(b"x" * (17 * 1024 * 1024))
        f.write(b'"}\n')
    with pytest.raises(BadRequestError, match="line 2: longer than 16 MiB"):
        read_dataset(path)


def test_bench_serve_dataset_records_its_name_and_hash(cli: CliRunner, tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        "".join(
            json.dumps({"prompt": f"p{i} " + "w " * 6, "output_len": 4}) + "\n" for i in range(9)
        )
    )
    with recording_stub() as (url, sent):
        args = ["bench", "serve", "--endpoint", url, "-m", "stub", "--dataset", str(path)]
        result = cli.invoke(
            app, [*args, "--concurrency", "1,2", "--num-prompts", "3", "-o", "json", "--no-history"]
        )
    assert result.exit_code == 0, result.stderr
    records = json.loads(result.stdout)
    assert len(records) == 2
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    for record in records:
        assert record["dataset"] == "prompts.jsonl" and record["dataset_sha256"] == digest
        assert record["test"].endswith(f" ds={digest[:8]}")
    assert len(sent) == len(set(sent)) == 2 * (3 + 1)  # no prompt sent twice


def test_bench_serve_bad_dataset_is_one_line_and_exit_1(cli: CliRunner, tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "fine fine fine fine"}\n{"prompt": null}\n')
    result = cli.invoke(app, ["bench", "serve", "--dataset", str(path), "--endpoint", "x"])
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "line 2: 'prompt' is missing or not text" in lines[0]
    missing = cli.invoke(app, ["bench", "serve", "--dataset", str(tmp_path / "none.json")])
    assert missing.exit_code == 2


def test_a_dataset_path_click_would_misname_is_one_clear_line(
    cli: CliRunner, tmp_path: Path
) -> None:
    """An empty path is not "a directory", and a loop of symbolic links is not missing."""
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    for given, says in (("", "an empty path names no file"), (str(tmp_path / "a"), "a loop")):
        result = cli.invoke(app, ["bench", "serve", "--dataset", given], env={"COLUMNS": "300"})
        assert result.exit_code == 2, result.output
        assert says in result.stderr and "is a directory" not in result.stderr
    for given, says in ((str(tmp_path), "is a directory"), (str(tmp_path / "no"), "does not")):
        result = cli.invoke(app, ["bench", "serve", "--dataset", given], env={"COLUMNS": "300"})
        assert result.exit_code == 2 and says in result.stderr, result.output


def test_shared_prefix_is_for_random_prompts_only(cli: CliRunner, tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "fine fine fine fine"}\n')
    result = cli.invoke(app, ["bench", "serve", "--dataset", str(path), "--shared-prefix", "4"])
    assert result.exit_code == 2
    assert "--shared-prefix: random prompts only" in result.stderr


@pytest.mark.parametrize("flag", ["--input-len", "--range-ratio"])
def test_random_lengths_options_are_refused_with_a_dataset(
    cli: CliRunner, tmp_path: Path, flag: str
) -> None:
    """With --dataset the lengths come from the data: --input-len and --range-ratio would be
    silently ignored, so they are a usage error naming both flags."""
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "fine fine fine fine"}\n')
    result = cli.invoke(
        app, ["bench", "serve", "--dataset", str(path), flag, "0.5" if "ratio" in flag else "64"]
    )
    assert result.exit_code == 2, result.output
    assert f"{flag}: random prompts only, not with --dataset" in result.stderr


# ---- this machine's engine ---------------------------------------------------------------------


def test_local_rounds_get_fresh_token_prompts(runner: LlamaCppRunner, tmp_path: Path) -> None:
    made, per_seq = round_prompts(runner, _options(shared_prefix=5))
    rounds = [made() for _ in range(3)]  # three rounds (levels or policies)
    prompts = [list(t) for warm, measured in rounds for t, _ in [*warm, *measured]]
    assert len(prompts) == 3 * (1 + 8)
    assert {common_prefix(a, b) for a, b in itertools.combinations(prompts, 2)} == {5}
    assert per_seq >= max(len(p) + n for w, m in rounds for p, n in [*w, *m])
    path = tmp_path / "p.jsonl"
    path.write_text(
        "".join(
            json.dumps({"prompt": f"Question {i}: why is the sky blue?"}) + "\n" for i in range(9)
        )
    )
    made, _ = round_prompts(runner, _options(dataset=read_dataset(path)))
    warm, measured = made()
    assert len(warm) == 1 and len(measured) == 8
    assert all(n == 4 for _, n in measured)  # no output length in the file: --output-len
