"""Issue 22, bench items: bounds on what bench serve and bench interference are asked to do,
signals during a measurement, and llama-bench's spellings."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from llmrun.runners.errors import BadRequestError
from llmrun.runners.serving import options as so

from .conftest import HANG_S, bench_pp8, which_llmrun


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("nan", "must be a number above 0"),
        ("-1", "must be a number above 0"),
        ("1e-9", "would wait hours"),
        ("abc", "is not a number"),
    ],
)
def test_request_rate_refuses_nan_and_endless_waits(text: str, says: str) -> None:
    with pytest.raises(BadRequestError, match=says):
        so.parse_rate(text)
    assert so.parse_rate("inf") == float("inf") and so.parse_rate("0.5") == 0.5


def _serve(**changes: object) -> so.ServeOptions:
    base: dict[str, object] = dict(
        concurrency=(1,),
        request_rate=float("inf"),
        num_prompts=16,
        input_len=128,
        output_len=8,
        range_ratio=0.0,
        warmup=0,
        percentiles=(50.0,),
    )
    return so.ServeOptions(**{**base, **changes})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        ({"num_prompts": 2_000_000}, "--num-prompts 2,000,000: at most"),
        ({"input_len": 100_000_000}, "--input-len 100,000,000: at most"),
        ({"num_prompts": 100_000, "input_len": 1_000_000}, "prompt tokens in all"),
        ({"output_len": 10**20}, "--output-len 100,000,000,000,000,000,000: at most 1,048,576"),
        ({"num_prompts": 100_000, "output_len": 1_000}, "output tokens in all"),
        ({"warmup": 10**20}, "--warmup 100,000,000,000,000,000,000: at most 100,000"),
        ({"request_rate": float("nan")}, "must be a number above 0"),
    ],
)
def test_serving_loads_are_bounded(changes: dict[str, object], says: str) -> None:
    with pytest.raises(BadRequestError, match=says):
        _serve(**changes)
    _serve()  # the defaults stand
    with pytest.raises(BadRequestError, match="--prompt-len 100,000,000"):
        so.InterferenceOptions(rate=2.0, prompt_len=100_000_000, output_len=8)
    with pytest.raises(BadRequestError, match="--output-len 10,000,000: at most"):
        so.InterferenceOptions(rate=2.0, prompt_len=8, output_len=10_000_000)
    with pytest.raises(BadRequestError, match="--rate"):
        so.InterferenceOptions(rate=float("nan"), prompt_len=8, output_len=8)


@pytest.mark.parametrize(
    ("args", "code"),
    [
        (["serve", "--num-prompts", "100000", "--input-len", "1000"], 1),  # read, then too much
        (["serve", "--num-prompts", "100000", "--output-len", "1000"], 1),
        (["serve", "--shared-prefix", "1048576"], 1),
        (["serve", "--request-rate", "nan"], 2),  # an option's value that cannot be read
        (["serve", "--request-rate", "1e-9"], 2),
        (["serve", "--policy", ""], 2),
        (["interference", "--policy", ""], 2),
    ],
)
def test_serving_refusals_are_one_line(
    args: list[str], code: int, llmrun_env: dict[str, str]
) -> None:
    done = subprocess.run(
        [which_llmrun(), "bench", *args],
        env=llmrun_env,
        capture_output=True,
        text=True,
        timeout=HANG_S,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == code, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    assert done.stdout == ""


def test_interference_lab_obeys_sigterm(llmrun_env: dict[str, str], model_path: str) -> None:
    """The engine's loop sees the cancel flag: a stream of 6,000 tokens stops at SIGTERM, and
    its cut baseline is not reported as one."""
    proc = subprocess.Popen(
        [
            which_llmrun(),
            "bench",
            "interference",
            "-m",
            model_path,
            "--policy",
            "prefill-first",
            "--output-len",
            "6000",
            "--rate",
            "0.01",
            "--prompt-len",
            "8",
            "-o",
            "json",
        ],
        env=llmrun_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + HANG_S
    maps = Path(f"/proc/{proc.pid}/maps")
    while model_path not in maps.read_text():  # loaded: the stream is next
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=HANG_S)
    assert proc.returncode == 143, err
    assert json.loads(out or "[]") == []  # no full-length stream: the loop stopped


def _bench(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [which_llmrun(), "bench", "-r", "1", "--no-history", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_S,
        stdin=subprocess.DEVNULL,
    )


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["-ot", "(.*)*(.*)*(.*)*Z=CPU"], "repeats a repetition"),
        (["-ot", "blk\\.0\\.ffn_.*=CPU,(x+)+y=CPU"], "repeats a repetition"),
        (["-ot", ".*.*.*.*.*.*.*Z=CPU"], "7 repetitions"),
        (["-ot", "(=CPU"], "is not a regular expression"),
        (["-ncmoe", "16777216"], "-ncmoe: 16777216 is out of range 0..512"),
    ],
)
def test_tensor_placement_bounds_are_one_line(
    args: list[str], says: str, llmrun_env: dict[str, str]
) -> None:
    done = _bench("-p", "8", "-n", "0", "-o", "json", *args, env=llmrun_env)
    assert done.returncode == 2 and says in done.stderr, done.stderr  # usage, as llama-bench's
    assert len(done.stderr.strip().splitlines()) == 1 and done.stdout == ""


def test_llama_bench_defaults_and_spellings_run(
    llmrun_env: dict[str, str], model_path: str
) -> None:
    """-dev auto is llama-bench's default; --n_prompt is its --n-prompt (any "--" option's _ is
    read as -); a pattern without nesting still places tensors."""
    done = _bench(
        "-m",
        model_path,
        "--n_prompt",
        "8",
        "--n_gen",
        "0",
        "-dev",
        "auto",
        "-ot",
        "blk\\.0\\.ffn_.*=CPU",
        "-o",
        "json",
        env=llmrun_env,
    )
    assert done.returncode == 0, done.stderr
    (row,) = json.loads(done.stdout)
    assert row["test"] == "pp8" and row["devices"] == "auto"
    assert row["tensor_buft_overrides"] == "blk\\.0\\.ffn_.*=CPU"


def _fake_models(monkeypatch: pytest.MonkeyPatch, seen: list[str | None] | None = None) -> None:
    from llmrun.cli import engine

    from .fake import FakeBenchRunner

    def make(model: str | None, config: object, tuned: bool) -> FakeBenchRunner:
        fake = FakeBenchRunner()
        if seen is not None:
            seen.append(model)
        fake.model_path = f"/fake/{model or 'a'}.gguf"
        return fake

    monkeypatch.setattr(engine, "BENCH_RUNNER_FACTORY", make)


KINDS = ["-p", "8", "-n", "2", "-pg", "8,2", "-d", "0,4", "-m", "a", "-m", "b"]


@pytest.mark.parametrize("fmt", ["md", "csv", "json", "jsonl", "sql"])
def test_every_format_takes_every_kind_of_row(
    fmt: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """pp, tg, pg (its own pp_ts/tg_ts), depth and two models in one output: every format
    carries every row and every figure, whatever kind of row comes first."""
    from typer.testing import CliRunner

    from llmrun.cli.app import app

    from .test_bench import parse

    monkeypatch.setenv("LLMRUN_HOME", str(tmp_path))
    _fake_models(monkeypatch)
    done = CliRunner().invoke(app, ["bench", "-r", "1", "--no-history", *KINDS, "-o", fmt])
    assert done.exit_code == 0, done.stderr
    rows = parse(fmt, done.stdout)
    assert len(rows) == 12  # (pp, tg, pg) x 2 depths x 2 models
    if fmt == "md":
        return
    pg = [r for r in rows if "+" in str(r["test"])]
    assert len(pg) == 4 and all(r["pp_ts"] not in (None, "") for r in pg)
    assert all(r["tg_ts"] not in (None, "") for r in pg)


def _llama_bench_fields() -> dict[str, str]:
    """The columns this llama.cpp's llama-bench creates: test::get_fields() in its source."""
    from . import llama_tools

    source = llama_tools.llama_cpp_dir() / "tools" / "llama-bench" / "llama-bench.cpp"
    text = source.read_text()
    start = text.index("get_fields() {")
    block = text[text.index("{", text.index("fields = {", start)) : text.index("};", start)]
    return {name: "TEXT" for name in re.findall(r'"(\w+)"', block)}


@pytest.mark.parametrize("made_by", ["llama-bench.cpp", "llmrun"])
def test_sql_goes_into_a_table_llama_bench_made_and_keeps_every_figure(
    made_by: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, llmrun_env: dict[str, str]
) -> None:
    """`llama-bench -o sql | sqlite3 db`, then llmrun's SQL of other kinds of rows, twice: each
    goes in (llama-bench's columns into its table, llmrun's figures beside it), none dropped."""
    import shutil
    import sqlite3

    from typer.testing import CliRunner

    from llmrun.cli.app import app

    monkeypatch.setenv("LLMRUN_HOME", str(tmp_path))
    _fake_models(monkeypatch)
    schema = _llama_bench_fields()  # llmrun fills every column llama-bench fills, as it does
    db = tmp_path / "bench.sqlite"
    columns = ",\n".join(f"  {name} {kind}" for name, kind in schema.items())
    made = f"CREATE TABLE IF NOT EXISTS llama_bench (\n{columns}\n);\n"  # llama-bench's own
    if made_by == "llmrun":  # llmrun's table takes llama-bench's INSERT, all its columns
        values = ", ".join("1" for _ in schema)
        made = f"{made}INSERT INTO llama_bench ({', '.join(schema)}) VALUES ({values});\n"
        made += "DELETE FROM llama_bench;\n"
        done = CliRunner().invoke(
            app, ["bench", "-r", "1", "--no-history", "-p", "8", "-n", "0", "-o", "sql"]
        )
        made = done.stdout + made

    def into_db(sql: str) -> None:
        if shutil.which("sqlite3"):
            done = subprocess.run(
                ["sqlite3", str(db)], input=sql, capture_output=True, text=True, timeout=HANG_S
            )
            assert done.returncode == 0 and not done.stderr, done.stderr
        else:
            with sqlite3.connect(db) as conn:
                conn.executescript(sql)

    into_db(made)
    for shape in (["-p", "8", "-n", "0"], ["-pg", "8,2", "-p", "0", "-n", "0"]):
        done = CliRunner().invoke(app, ["bench", "-r", "1", "--no-history", *shape, "-o", "sql"])
        assert done.exit_code == 0, done.stderr
        into_db(done.stdout)
    conn = sqlite3.connect(db)
    tests = [row[0] for row in conn.execute("SELECT n_prompt || '/' || n_gen FROM llama_bench")]
    assert tests == ["8/0", "8/2"]
    figures = [
        json.loads(text)
        for (text,) in conn.execute(
            "SELECT figures FROM llama_bench_llmrun JOIN llama_bench ON bench_rowid ="
            " llama_bench.rowid ORDER BY bench_rowid"
        )
    ]
    assert "pp_ts" not in figures[0] and figures[0]["ttft_ms"] > 0
    assert figures[1]["pp_ts"] > 0 and figures[1]["tg_ts"] > 0


@pytest.mark.parametrize(("n_prompt", "n_gen"), [(8, 4), (0, 4)])
def test_pg_decodes_as_many_tokens_as_llama_bench(
    runner: object, n_prompt: int, n_gen: int
) -> None:
    """llama-bench's test_gen decodes n_gen tokens after the prompt: -pg 8,4 is pp8 + 4 decode
    steps (llmrun's pg took 3, so pg read as pp + 3/4 tg)."""
    import random
    import threading

    from llmrun.runners.bench import measure
    from llmrun.runners.bench.sweep import Shape

    steps = measure._repetition(
        runner,  # type: ignore[arg-type]
        Shape(n_prompt, n_gen),
        random.Random(1),
        threading.Event(),
    )
    while True:  # one repetition from a cleared cache, the shares it yields passed over
        try:
            next(steps)
        except StopIteration as end:
            finished, _ = end.value
            break
    assert len(finished.stats.itl_s) == n_gen


def test_ubatch_above_batch_runs_and_is_recorded_as_asked(
    llmrun_env: dict[str, str], model_path: str
) -> None:
    """-b 64 -ub 128 runs (llama.cpp clamps ubatch to batch), and -b 64 alone records
    llama-bench's ubatch 512, as llama-bench does, so compare-llama-bench.py pairs them."""
    for extra, ubatch in ((["-ub", "128"], 128), ([], 512)):
        done = _bench(
            "-m",
            model_path,
            "--no-tuned",
            "-p",
            "8",
            "-n",
            "0",
            "-b",
            "64",
            *extra,
            "-o",
            "json",
            env=llmrun_env,
        )
        assert done.returncode == 0, done.stderr
        (row,) = json.loads(done.stdout)
        assert (row["n_batch"], row["n_ubatch"]) == (64, ubatch)


def test_ppl_change_only_between_models_scoring_the_same_tokens() -> None:
    from llmrun.runners.bench.run import Scored, ppl_change

    first = Scored("a", 10.0, 255, 49152)
    assert ppl_change(Scored("b", 12.0, 255, 49152), first) == pytest.approx(0.2)
    assert ppl_change(Scored("c", 5.0, 240, 32000), first) is None  # another vocabulary
    assert ppl_change(Scored("d", 5.0, 240, 49152), first) is None  # another tokenization


def test_a_comma_list_of_models_is_split_as_llama_bench_does(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from typer.testing import CliRunner

    from llmrun.cli.app import app

    monkeypatch.setenv("LLMRUN_HOME", str(tmp_path))
    seen: list[str | None] = []
    _fake_models(monkeypatch, seen)
    done = CliRunner().invoke(
        app,
        [
            "bench",
            "-r",
            "1",
            "--no-history",
            "-p",
            "8",
            "-n",
            "0",
            "-m",
            "a.gguf,b.gguf",
            "-o",
            "json",
        ],
    )
    assert done.exit_code == 0, done.stderr
    assert seen == ["a.gguf", "b.gguf"] and len(json.loads(done.stdout)) == 2


def test_output_none_prints_no_records(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """llama-bench's -o none and -oe none: accepted, and nothing on that stream."""
    from typer.testing import CliRunner

    from llmrun.cli.app import app

    monkeypatch.setenv("LLMRUN_HOME", str(tmp_path))
    _fake_models(monkeypatch)
    done = CliRunner().invoke(
        app, ["bench", "-r", "1", "--no-history", "-p", "8", "-n", "0", "-o", "none", "-oe", "none"]
    )
    assert done.exit_code == 0, done.stderr
    assert done.stdout == ""
    assert "pp8" in done.stderr  # the display went to stderr, as with any -o


def test_model_filename_is_recorded_as_given(llmrun_env: dict[str, str], model_path: str) -> None:
    """llama-bench keeps -m as given, and compare-llama-bench.py pairs on it."""
    folder, name = Path(model_path).parent, Path(model_path).name
    done = subprocess.run(
        bench_pp8(name, "--no-history"),
        env=llmrun_env,
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=HANG_S,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stderr
    assert [r["model_filename"] for r in json.loads(done.stdout)] == [name]


def test_a_later_failure_keeps_the_finished_rows(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """-m good -m /nonexistent.gguf: the good model's rows printed and stored, then one error
    line, exit 1 (they were all lost)."""
    from typer.testing import CliRunner

    from llmrun.cli import engine
    from llmrun.cli.app import app
    from llmrun.runners.errors import ModelNotFoundError
    from llmrun.runners.history import History

    from .fake import FakeBenchRunner

    monkeypatch.setenv("LLMRUN_HOME", str(tmp_path))

    def make(model: str | None, config: object, tuned: bool) -> FakeBenchRunner:
        if model == "/nonexistent.gguf":
            raise ModelNotFoundError(model)
        return FakeBenchRunner()

    monkeypatch.setattr(engine, "BENCH_RUNNER_FACTORY", make)
    done = CliRunner().invoke(
        app,
        [
            "bench",
            "-r",
            "1",
            "-p",
            "8",
            "-n",
            "0",
            "-m",
            "good",
            "-m",
            "/nonexistent.gguf",
            "-o",
            "json",
        ],
    )
    assert done.exit_code == 1
    assert [r["test"] for r in json.loads(done.stdout)] == ["pp8"]
    assert done.stderr.count("error") == 1 and "nonexistent" in done.stderr
    with History() as history:
        assert len(history.runs()) == 1


def test_a_perplexity_text_too_short_is_refused_before_any_test(
    llmrun_env: dict[str, str], model_path: str, tmp_path: Path
) -> None:
    """A text too short for one window is refused once the model is ready, before the speed
    tests run (it was found only after them, their time spent for a command that failed)."""
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    done = _bench(
        "-m", model_path, "-p", "8", "-n", "0", "--ppl", str(empty), "-o", "json", env=llmrun_env
    )
    assert done.returncode == 1
    assert done.stdout.strip() in ("", "[]")  # no test ran
    assert done.stderr.strip().splitlines()[-1].startswith("llmrun: error: perplexity needs")


@pytest.mark.parametrize("ctx", ["1", "3"])
def test_perplexity_windows_too_small_are_a_usage_error_before_any_test(
    ctx: str, tmp_path: Path
) -> None:
    """`--ppl FILE -c 3` ran the speed tests, then said the text had too few tokens for a
    window of 3 (it had 201): windows of fewer than 4 tokens are refused, and named as -c."""
    from typer.testing import CliRunner

    from llmrun.cli.app import app

    text = tmp_path / "fox.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 20)
    done = CliRunner().invoke(
        app, ["bench", "-r", "1", "-p", "0", "-n", "1", "--ppl", str(text), "-c", ctx]
    )
    assert done.exit_code == 2, done.output
    assert done.stderr == (
        f"llmrun: error: -c/--ctx {ctx}: perplexity's windows need 4 tokens or more (the second"
        " half of each is scored)\n"
    )


def test_a_full_stderr_never_costs_the_records(llmrun_env: dict[str, str], model_path: str) -> None:
    """bench -o json 2>/dev/full: the records on stdout and in the history all the same."""
    with open("/dev/full", "w") as full:
        done = subprocess.run(
            bench_pp8(model_path),
            env=llmrun_env,
            stdout=subprocess.PIPE,
            stderr=full,
            text=True,
            timeout=HANG_S,
        )
    assert done.returncode == 0
    assert [r["test"] for r in json.loads(done.stdout)] == ["pp8"]
    stored = subprocess.run(
        [which_llmrun(), "history"], env=llmrun_env, capture_output=True, text=True, timeout=HANG_S
    )
    assert "pp8" in stored.stdout
