"""`llmrun bench` with the embedded model and tiny sizes."""

from __future__ import annotations

import csv
import io
import json
import re
import sqlite3
import subprocess
from pathlib import Path

import pexpect
import pytest
from typer.testing import CliRunner

from llmrun.cli import engine
from llmrun.cli.app import app
from llmrun.runners.bench import localscore as ls
from llmrun.runners.bench import sweep as sw
from llmrun.runners.bench import tuning
from llmrun.runners.bench.tuned import TUNED_FIELDS, apply_tuning, save_tuned
from llmrun.runners.config import EngineConfig
from llmrun.runners.errors import BadRequestError
from llmrun.runners.llamacpp import LlamaCppRunner

from .conftest import HANG_S, which_llmrun
from .fake import FakeBenchRunner

LLAMA_BENCH_FIELDS = {
    "build_commit",
    "cpu_info",
    "gpu_info",
    "backends",
    "model_filename",
    "model_type",
    "model_size",
    "model_n_params",
    "n_batch",
    "n_ubatch",
    "n_threads",
    "type_k",
    "type_v",
    "n_gpu_layers",
    "flash_attn",
    "n_prompt",
    "n_gen",
    "n_depth",
    "test_time",
    "avg_ns",
    "stddev_ns",
    "avg_ts",
    "stddev_ts",
    "samples_ns",
    "samples_ts",
}
OURS = {
    "ttft_ms",
    "load_ms",
    "itl_p50_ms",
    "itl_p99_ms",
    "engine_avg_ts",
    "bw_util",
    "prefill_gflops",
    "mem_bw_gbs",
}
TINY = ["bench", "-r", "2", "-p", "16", "-n", "4", "-t", "1,2"]


def test_lists_and_ranges_as_llama_bench_reads_them() -> None:
    assert sw.parse_values("1,2", name="-t") == [1, 2]
    assert sw.parse_values("8-512*4", name="-b") == [8, 32, 128, 512]
    assert sw.parse_values("0-24+8", name="-d") == [0, 8, 16, 24]
    for bad in ("x", "4-1", "1-8*1"):
        with pytest.raises(BadRequestError):
            sw.parse_values(bad, name="-b")


def parse(fmt: str, text: str) -> list[dict[str, object]]:
    if fmt == "json":
        return list(json.loads(text))
    if fmt == "jsonl":
        return [json.loads(line) for line in text.splitlines()]
    if fmt == "csv":
        return list(csv.DictReader(io.StringIO(text)))
    if fmt == "sql":
        db = sqlite3.connect(":memory:")
        db.row_factory = sqlite3.Row
        db.executescript(text)
        rows = db.execute(
            "SELECT llama_bench.*, figures FROM llama_bench LEFT JOIN"
            " llama_bench_llmrun ON bench_rowid = llama_bench.rowid"
        )
        return [
            {
                **{k: row[k] for k in row.keys() if k != "figures"},  # noqa: SIM118 (a Row)
                **json.loads(row["figures"] or "{}"),
            }
            for row in rows
        ]
    lines = [ln for ln in text.splitlines() if ln.startswith("|")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    return [
        dict(zip(head, (c.strip() for c in ln.strip("|").split("|")), strict=True))
        for ln in lines[2:]
    ]


@pytest.mark.parametrize("fmt", ["json", "jsonl", "csv", "sql", "md"])
@pytest.mark.usefixtures("every_core")  # -t 1,2
def test_every_format_parses_back_with_both_sweep_values(
    cli: CliRunner, home: Path, fmt: str, model_path: str, ram_bandwidth: None
) -> None:
    result = cli.invoke(app, [*TINY, "-o", fmt, "--no-history"])
    assert result.exit_code == 0, result.stderr
    rows = parse(fmt, result.stdout)
    assert len(rows) == 4  # pp16 and tg4, at 1 and 2 threads
    if fmt == "md":
        assert {r["test"] for r in rows} == {"pp16", "tg4"}
        assert {r["threads"] for r in rows} == {"1", "2"}
        assert all(re.fullmatch(r"[\d.]+ ± [\d.]+", str(r["t/s"])) for r in rows)
        return
    assert set(rows[0]) >= LLAMA_BENCH_FIELDS | OURS
    assert {(str(r["n_threads"]), str(r["n_prompt"]), str(r["n_gen"])) for r in rows} == {
        (t, p, g) for t in "12" for p, g in (("16", "0"), ("0", "4"))
    }
    pp = next(r for r in rows if str(r["n_gen"]) == "0")
    tg = next(r for r in rows if str(r["n_prompt"]) == "0")
    assert float(pp["ttft_ms"]) > 0 and float(pp["prefill_gflops"]) > 0  # type: ignore[arg-type]
    assert float(tg["itl_p50_ms"]) > 0 and 0 < float(tg["bw_util"]) < 1.5  # type: ignore[arg-type]
    assert float(pp["avg_ts"]) > 0 and float(pp["load_ms"]) > 0  # type: ignore[arg-type]


def test_skipped_values_are_reported_and_the_rest_runs(
    cli: CliRunner, home: Path, model_path: str
) -> None:
    result = cli.invoke(
        app,
        [
            "bench",
            "-r",
            "1",
            "-p",
            "16",
            "-n",
            "0",
            "-b",
            "32,128",
            "-c",
            "64",
            "-ngl",
            "0,999",
            "-o",
            "jsonl",
            "--no-history",
        ],
    )
    assert result.exit_code == 0, result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    # -ngl 999 is "all layers", as in llama.cpp (none on this CPU-only build)
    assert [
        (r["n_batch"], r["type_k"], r["n_gpu_layers"], r["n_gpu_layers_offloaded"]) for r in rows
    ] == [(32, "f16", 0, 0), (32, "f16", 999, 0)]
    err = " ".join(result.stderr.split())
    assert "batch 128 is larger than the context (64 tokens)" in err


def test_compare_finds_the_previous_run_and_history_lists_both(
    cli: CliRunner, home: Path, model_path: str
) -> None:
    first = cli.invoke(app, ["bench", "-r", "2", "-p", "16", "-n", "0", "-o", "json"])
    assert first.exit_code == 0, first.stderr
    second = cli.invoke(app, ["bench", "-r", "2", "-p", "16", "-n", "0", "-o", "json", "--compare"])
    assert second.exit_code == 0, second.stderr
    err = " ".join(second.stderr.replace("│", " ").split())  # a long verdict wraps its cell
    assert "against the previous run" in err and "(run 1)" in err, err
    verdicts = r"(faster|slower|would resolve 2 %|already resolve 2 %|may be noise\))"
    assert re.search(verdicts + r" \(run 1\)", err), err
    assert (home / "data" / "history.sqlite").exists()
    listing = cli.invoke(app, ["history", "-n", "5"], env={"COLUMNS": "200"})
    assert listing.exit_code == 0
    assert "run 2" in listing.stdout and "run 1" in listing.stdout


def test_pg_depth_and_chunk_sizes(cli: CliRunner, home: Path, model_path: str) -> None:
    result = cli.invoke(
        app,
        [
            "bench",
            "-r",
            "1",
            "-p",
            "48",
            "-n",
            "0",
            "--pg",
            "16,4",
            "-d",
            "0,32",
            "-b",
            "16,48",
            "--no-history",
            "-o",
            "json",
        ],
        env={"COLUMNS": "120"},
    )
    assert result.exit_code == 0, result.stderr
    rows = json.loads(result.stdout)
    tests = {(r["test"], r["n_batch"]) for r in rows}
    assert ("pp48 @ d32", 16) in tests and ("pp16+tg4", 48) in tests
    pg = next(r for r in rows if r["test"] == "pp16+tg4")
    assert pg["pp_ts"] > 0 and pg["tg_ts"] > 0  # the two phases of a pg test, kept apart
    err = " ".join(result.stderr.split())
    assert "chunked prefill" in err
    assert "pp48: all 2 chunk sizes agree on the next token" in err


def test_scenarios_give_a_score(cli: CliRunner, home: Path, model_path: str) -> None:
    result = cli.invoke(
        app,
        [
            "bench",
            "--scenarios",
            "--scenario-scale",
            "0.004",
            "-r",
            "1",
            "--no-history",
            "-o",
            "jsonl",
        ],
    )
    assert result.exit_code == 0, result.stderr
    assert len(result.stdout.splitlines()) == len(ls.LOCALSCORE_SCENARIOS)
    scores = {json.loads(line)["localscore"] for line in result.stdout.splitlines()}
    assert len(scores) == 1 and scores.pop() > 0  # the score is in the structured output too
    assert re.search(r"score\s+[\d,.]+\s+\(LocalScore's formula", result.stderr)


def test_tune_saves_settings_for_each_workload_that_run_then_uses(
    cli: CliRunner, home: Path, monkeypatch: pytest.MonkeyPatch, model_path: str
) -> None:
    """The search on the real engine, kept small: pp8 and tg4 at depth 8 (pp32 and tg8 at 16
    took 51 s here where these take 21 s; the sizes change no step of the search), one thread
    (two threads of llama.cpp on the 2 busy cores of a test machine took 35 s a setting), two
    batch pairs and one paired round; more threads are searched on a fake (test_faults.py)."""
    monkeypatch.setattr(tuning, "SHAPES", (sw.Shape(8, 0), sw.Shape(0, 4, 8)))
    monkeypatch.setattr(tuning, "REPS", 2)
    monkeypatch.setattr(tuning, "default_threads", lambda: 1)
    monkeypatch.setattr(tuning, "logical_cpus", lambda: 1)
    monkeypatch.setattr(tuning, "BATCH_PAIRS", ((256, 256), (512, 512)))
    monkeypatch.setattr(tuning, "PAIRED_ROUNDS", 1)
    result = cli.invoke(app, ["tune"])
    assert result.exit_code == 0, result.stderr
    saved = json.loads((home / "config" / "tuned.json").read_text())
    (entry,) = saved.values()
    assert set(entry) == {"chat", "document"}
    for found in entry.values():
        assert set(found) == set(TUNED_FIELDS)
    assert "fastest for chat:" in result.stderr and "fastest for document:" in result.stderr
    assert "llmrun's defaults" in result.stderr  # the baseline row, once
    config = apply_tuning(EngineConfig(n_batch=64), model_path)
    assert config.tuned and config.n_batch == 64 and config.n_ubatch == entry["chat"]["n_ubatch"]
    document = apply_tuning(EngineConfig(workload="document"), model_path)
    assert document.n_threads_batch == entry["document"]["n_threads_batch"]
    assert apply_tuning(EngineConfig(), "/elsewhere.gguf") == EngineConfig()
    only_chat = cli.invoke(app, ["tune", "--workload", "chat"])
    assert only_chat.exit_code == 0 and "fastest for document" not in only_chat.stderr
    (kept,) = json.loads((home / "config" / "tuned.json").read_text()).values()
    assert kept["document"] == entry["document"]  # tuning chat again kept the document entry


def test_the_noise_rule_keeps_the_incumbent_on_a_tie() -> None:
    assert tuning.beats([110, 111, 112], [100, 101, 102])
    assert not tuning.beats([110, 111, 112], [100, 101, 111])  # overlaps its best: a tie
    assert not tuning.beats([], [100])


@pytest.mark.usefixtures("every_core")  # -t 2
def test_run_reports_tuned_settings(
    llmrun_env: dict[str, str], home: Path, model_path: str
) -> None:
    save_tuned(model_path, {"n_threads": 1, "n_batch": 128, "n_ubatch": 64, "flash_attn": "off"})
    env = dict(llmrun_env, LLMRUN_HOME=str(home))
    result = subprocess.run(
        [which_llmrun(), "run", "hi", "-n", "3", "--stats", "json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert result.returncode == 0, result.stderr
    settings = json.loads(result.stderr.strip().splitlines()[-1])["settings"]
    assert settings["tuned"] is True
    assert (settings["n_threads"], settings["n_batch"], settings["n_ubatch"]) == (1, 128, 64)
    explicit = subprocess.run(
        [which_llmrun(), "run", "hi", "-n", "3", "--stats", "json", "-t", "2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert json.loads(explicit.stderr.strip().splitlines()[-1])["settings"]["n_threads"] == 2


def test_ctrl_c_keeps_finished_results(llmrun_env: dict[str, str], tmp_path: Path) -> None:
    env = dict(llmrun_env, LLMRUN_HOME=str(tmp_path / "home"))
    out = tmp_path / "out.jsonl"
    cmd = f"{which_llmrun()} bench -r 3 -p 16 -n 300 -t 1,2 -o jsonl > {out}"
    child = pexpect.spawn(
        "bash", ["-c", cmd], env=env, encoding="utf-8", timeout=HANG_S, dimensions=(40, 120)
    )
    child.expect(r"tg300")  # the progress bar has moved past pp16 to the generation test
    child.sendintr()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 130
    assert "llmrun: interrupted: keeping the 1 finished results" in child.before
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["test"] for r in rows] == ["pp16"]
    db = sqlite3.connect(tmp_path / "home" / "data" / "history.sqlite")
    assert db.execute("SELECT count(*) FROM results").fetchone() == (1,)


def test_plot_and_system_report(
    cli: CliRunner, home: Path, tmp_path: Path, model_path: str
) -> None:
    png = tmp_path / "bench.png"
    result = cli.invoke(
        app,
        [
            "bench",
            "-r",
            "1",
            "-p",
            "16",
            "-n",
            "4",
            "-b",
            "8,16",
            "-d",
            "0,8",
            "--plot",
            str(png),
            "--no-history",
            "-o",
            "csv",
        ],
    )
    assert result.exit_code == 0, result.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    err = " ".join(result.stderr.split())
    for expected in (
        "cores",
        "logical",
        "RAM",
        "(streaming copy)",
        "llama-cpp-python",
        "llama Q4_1",
        "135M params",
        "GB/s",
    ):
        assert expected in err, expected
    bad = cli.invoke(
        app,
        [
            "bench",
            "-r",
            "1",
            "-p",
            "8",
            "-n",
            "0",
            "--no-history",
            "--plot",
            str(tmp_path / "no" / "dir.png"),
        ],
    )
    assert bad.exit_code == 1 and "there is no folder" in bad.stderr


def test_sweeps_reload_the_weights_only_for_gpu_layers(runner: LlamaCppRunner) -> None:
    weights = runner._model
    try:
        runner.reconfigure(EngineConfig(n_ctx=512, n_threads=1, n_batch=64))
        assert runner._model is weights and runner.loaded is not None
        assert (runner.loaded.settings.n_threads, runner.loaded.settings.n_batch) == (1, 64)
        runner.reconfigure(EngineConfig(n_ctx=512, repack=False, n_gpu_layers=1))
        assert runner.loaded is not None  # a load-affecting change loads the weights again
    finally:
        runner.reconfigure(EngineConfig(n_ctx=2048))


def test_a_closed_stdout_loses_no_result(llmrun_env: dict[str, str], tmp_path: Path) -> None:
    env = dict(llmrun_env, LLMRUN_HOME=str(tmp_path / "home"))
    cmd = f'{which_llmrun()} bench -r 1 -p 8 -n 4 -o json | true; echo "status=${{PIPESTATUS[0]}}"'
    result = subprocess.run(
        ["bash", "-c", cmd], env=env, capture_output=True, text=True, timeout=HANG_S
    )
    assert "status=141" in result.stdout
    assert "Traceback" not in result.stderr and "error" not in result.stderr
    db = sqlite3.connect(tmp_path / "home" / "data" / "history.sqlite")
    assert db.execute("SELECT count(*) FROM results").fetchone() == (2,)


def test_tune_has_no_options_for_what_it_searches(cli: CliRunner, home: Path) -> None:
    result = cli.invoke(app, ["tune", "-t", "2"])
    assert result.exit_code == 2 and "No such option" in result.stderr


def test_bench_measures_any_bench_runner_from_the_factory(
    cli: CliRunner, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeBenchRunner()
    monkeypatch.setattr(engine, "BENCH_RUNNER_FACTORY", lambda model, config, tuned: fake)
    result = cli.invoke(
        app, ["bench", "-p", "8", "-n", "4", "-r", "2", "-t", "1,2", "--no-history", "-o", "json"]
    )
    assert result.exit_code == 0, result.stderr
    rows = json.loads(result.stdout)
    assert sorted(r["test"] for r in rows) == ["pp8", "pp8", "tg4", "tg4"]
    assert {c.n_threads for c in fake.configs} == {1, 2}  # the sweep reached the runner
    assert all(r["avg_ts"] > 0 and len(r["samples_ts"]) == 2 for r in rows)
