"""Issue 22 items 1, 7 and 8: `llmrun bench` without flags runs and records llama-bench's
defaults, so llama.cpp's compare-llama-bench.py pairs the two tools' runs of one command line;
llmrun's own settings are one flag (--tuned) away; and llama-bench's spellings and values that
were refused (-r 0, every long option, -fitt/-fitc) are taken as llama-bench takes them."""

from __future__ import annotations

import ast
import json
import re
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import typer.main
from typer._click.core import ParameterSource

from llmrun.cli.app import app
from llmrun.runners import devices as dv
from llmrun.runners.bench.results import llmrun_build

from . import llama_tools
from .conftest import HANG_S, which_llmrun

COMMANDLINE = ParameterSource.COMMANDLINE


def _source() -> str:
    return (llama_tools.llama_cpp_dir() / "tools" / "llama-bench" / "llama-bench.cpp").read_text()


def _llama_bench_default(field: str) -> str:
    """One value of llama-bench's cmd_params_defaults, as its source spells it."""
    found = re.search(rf"/\* {field} +\*/ +(.+?),?\n", _source())
    assert found, field
    return found.group(1).strip()


def _bench(*args: str, env: dict[str, str], cwd: Path | None = None) -> Any:
    return subprocess.run(
        [which_llmrun(), "bench", "--no-history", *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=HANG_S,
        stdin=subprocess.DEVNULL,
    )


def test_no_flags_run_and_record_llama_bench_defaults(
    llmrun_env: dict[str, str], model_path: str
) -> None:
    """-b, -ub, -ngl and -fa as llama-bench.cpp declares its defaults, recorded as it records
    them; --tuned is llmrun's own (nothing tuned here: its defaults), and the header says which."""
    assert _llama_bench_default("n_batch") == "{ 2048 }"
    assert _llama_bench_default("n_ubatch") == "{ 512 }"
    assert _llama_bench_default("n_gpu_layers") == "{ -1 }"
    assert _llama_bench_default("flash_attn") == "{ LLAMA_FLASH_ATTN_TYPE_AUTO }"
    assert _llama_bench_default("reps") == "5"
    done = _bench("-m", model_path, "-p", "8", "-n", "0", "-r", "1", "-o", "json", env=llmrun_env)
    assert done.returncode == 0, done.stderr
    (row,) = json.loads(done.stdout)
    assert (row["n_batch"], row["n_ubatch"], row["n_gpu_layers"], row["flash_attn"]) == (
        2048,
        512,
        -1,
        -1,
    )
    assert row["n_ctx"] < 2048  # the context the test needs, as llama-bench's: the batch capped
    assert "llama-bench's defaults" in " ".join(done.stderr.split()) and not row["tuned"]
    own = _bench(
        "-m", model_path, "-p", "8", "-n", "0", "-r", "1", "-o", "json", "--tuned", env=llmrun_env
    )
    assert own.returncode == 0, own.stderr
    (row,) = json.loads(own.stdout)
    assert (row["n_batch"], row["n_ubatch"], row["n_gpu_layers"]) == (512, 512, 0)  # CPU build
    assert "llmrun's defaults (nothing tuned for this model)" in " ".join(own.stderr.split())


def _key_properties(script: Path) -> list[str]:
    """LLAMA_BENCH_KEY_PROPERTIES as compare-llama-bench.py declares them: the fields it pairs
    runs on."""
    for node in ast.parse(script.read_text()).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == (
            "LLAMA_BENCH_KEY_PROPERTIES"
        ):
            return list(ast.literal_eval(node.value))
    raise AssertionError("no LLAMA_BENCH_KEY_PROPERTIES")


@pytest.mark.parametrize("cpu", ["this CPU", "an AMX CPU"])
def test_a_llama_bench_run_and_an_llmrun_run_of_one_command_line_pair(
    llmrun_env: dict[str, str], model_path: str, llama_bench_path: Path, tmp_path: Path, cpu: str
) -> None:
    """The usual order: llama-bench's SQL into a database, then llmrun's, with no extra flag;
    every key field agrees test by test, and compare-llama-bench.py compares the two builds.
    llama-bench gets the flags this CPU needs (llmrun's probe asked, or its answer on an Intel
    Xeon with AMX faked: repacking off, else llama-bench dies there with SIGSEGV)."""
    if cpu != "this CPU":
        llama_tools.answer_probe(model_path, safe=False)
    folder, name = Path(model_path).parent, Path(model_path).name  # -m as given: a bare name
    line = ["-m", name, "-p", "16", "-n", "4", "-r", "1", "-o", "sql"]
    flags = llama_tools.cpu_flags("llama-bench", model_path)
    assert flags == ([] if llama_tools.repack_safe(model_path) else ["--repack", "0"])
    theirs = subprocess.run(
        [str(llama_bench_path), *line, *flags],
        env=llmrun_env,
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=HANG_S,
        stdin=subprocess.DEVNULL,
    )
    assert theirs.returncode == 0, theirs.stderr
    ours = _bench(*line, env=llmrun_env, cwd=folder)
    assert ours.returncode == 0, ours.stderr
    script = llama_tools.compare_script()
    keys = _key_properties(script)
    db = tmp_path / "llama-bench.sqlite"
    with sqlite3.connect(db) as con:
        con.executescript(theirs.stdout)
        con.executescript(ours.stdout)
        rows = con.execute(f"SELECT build_commit, {', '.join(keys)} FROM llama_bench").fetchall()
    # no hand step: llama-bench's build records the commit llmrun loads (built with it, as the
    # sdist has no .git), and llmrun's rows carry it in capitals, so the two stay apart
    commit = dv.build_commit(dv.query().commit())
    assert {r[0] for r in rows} == {commit, llmrun_build(commit)} and commit != "unknown", (
        f"{llama_bench_path} records another commit: built before tests/llama_tools.py gave the"
        " build LLAMA_BUILD_COMMIT? remove its build folder (.venv/llama-tools/VERSION/build)"
    )
    with sqlite3.connect(db) as con:
        # llama-bench ran with repacking as this CPU needs (llmrun's SQL leaves the column out,
        # for older tables; its JSON records say it, test_llama_bench.py)
        repack = con.execute("SELECT repack FROM llama_bench WHERE build_commit = ?", (commit,))
        assert {r[0] for r in repack} == {int(not flags)}
    by_tool: dict[bool, list[tuple[Any, ...]]] = {True: [], False: []}
    for build, *fields in rows:
        by_tool[build == commit].append(tuple(fields))
    assert len(by_tool[True]) == 2 and sorted(by_tool[True]) == sorted(by_tool[False]), keys
    done = subprocess.run(
        [sys.executable, str(script), "-i", str(db), "-b", commit, "-c", llmrun_build(commit)],
        capture_output=True,
        text=True,
        timeout=HANG_S,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert "No comparable data" not in done.stdout + done.stderr
    tests = [ln.split("|")[3].strip() for ln in done.stdout.splitlines() if "Q4_1" in ln]
    assert tests == ["pp16", "tg4"], done.stdout


def _fake(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from llmrun.cli import engine

    from .fake import FakeBenchRunner

    monkeypatch.setenv("LLMRUN_HOME", str(tmp_path))
    monkeypatch.setattr(
        engine, "BENCH_RUNNER_FACTORY", lambda model, config, tuned: FakeBenchRunner()
    )


@pytest.mark.parametrize("fmt", ["md", "csv", "json", "jsonl", "sql", "none"])
def test_zero_repetitions_record_rows_of_nothing_as_llama_bench(
    fmt: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """llama-bench's -r 0 runs the warm-up and records each test with no samples and 0 t/s;
    such a run measured nothing, so it is kept out of the history."""
    from typer.testing import CliRunner

    from llmrun.runners.history import History

    from .test_bench import parse

    _fake(monkeypatch, tmp_path)
    done = CliRunner().invoke(
        app, ["bench", "-r", "0", "-p", "8", "-n", "2", "-pg", "8,2", "-o", fmt]
    )
    assert done.exit_code == 0, done.stderr
    if fmt in ("json", "jsonl", "csv", "sql"):
        rows = parse(fmt, done.stdout)
        assert [r["test"] for r in rows] == ["pp8", "tg2", "pp8+tg2"]
        assert all(float(str(r["avg_ts"])) == 0 == float(str(r["avg_ns"])) for r in rows)
    if fmt == "json":
        assert all(r["samples_ns"] == [] for r in json.loads(done.stdout))
    with History() as history:
        assert history.runs() == []
    if fmt == "none":  # the same run with one repetition is stored
        stored = CliRunner().invoke(app, ["bench", "-r", "1", "-p", "8", "-n", "0", "-o", fmt])
        assert stored.exit_code == 0, stored.stderr
        with History() as history:
            assert len(history.runs()) == 1
    refused = CliRunner().invoke(app, ["bench", "-r", "-1", "-p", "8", "-n", "0"])
    assert refused.exit_code == 2


def test_every_option_llama_bench_parses_is_one_of_bench_s(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, llama_cpp_source: Path
) -> None:
    """Each spelling in llama-bench.cpp's parser (but --rpc: no RPC servers here), and each long
    one with `_` for `-`, as llama-bench reads them, parses to the same option."""
    from typer.testing import CliRunner

    group = typer.main.get_command(app).commands["bench"]  # type: ignore[attr-defined]
    params = {o: p for p in group.params for o in (*p.opts, *p.secondary_opts)}
    names = set(re.findall(r'arg == "(--?[a-zA-Z][\w-]*)"', _source()))
    assert {"--n-prompt", "--n-depth", "--fit-ctx", "-fitc", "--cpu-strict"} <= names
    for name in sorted(names - {"--rpc", "-rpc", "-h", "--help"}):
        param = params.get(name)
        assert param is not None, name
        for spelling in {name, name[:2] + name[2:].replace("-", "_")}:  # -fitc stays -fitc
            args = [spelling] if param.is_flag else [spelling, "7"]
            with group.make_context("bench", args, resilient_parsing=True) as ctx:
                assert ctx.get_parameter_source(param.name) is COMMANDLINE, spelling
    _fake(monkeypatch, tmp_path)
    assert CliRunner().invoke(app, ["bench", "-h"]).exit_code == 0
    version = CliRunner().invoke(app, ["bench", "--version"])
    assert version.exit_code == 0 and "llama-cpp-python" in version.stdout


def test_fit_target_and_ctx_are_recorded_as_given_and_said_to_be_recorded_only(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """-fitt/-fitc: llama.cpp's fitting is in its common library, which llama-cpp-python does
    not ship. Each value is a test of its own, as in llama-bench, recorded in its fields, and
    the header says the values were not applied; never a silent acceptance."""
    from typer.testing import CliRunner

    _fake(monkeypatch, tmp_path)
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
            "-fitt",
            "512",
            "-fitc",
            "4096,8192",
            "-o",
            "json",
        ],
    )
    assert done.exit_code == 0, done.stderr
    rows = json.loads(done.stdout)
    assert [(r["fit_target"], r["fit_min_ctx"]) for r in rows] == [(512, 4096), (512, 8192)]
    assert "-fitt/-fitc are recorded as given, not applied" in " ".join(done.stderr.split())
    plain = CliRunner().invoke(app, ["bench", "-r", "1", "--no-history", "-p", "8", "-n", "0"])
    assert "-fitt/-fitc" not in plain.stderr
    bad = CliRunner().invoke(
        app, ["bench", "-r", "1", "--no-history", "-p", "8", "-n", "0", "-fitc", "lots"]
    )
    assert bad.exit_code == 2 and "-fitc/--fit-ctx: 'lots' is not a number" in bad.stderr
