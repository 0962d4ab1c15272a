"""`llmrun bench` for llama-bench users: their tools read its results, their flags work."""

from __future__ import annotations

import ast
import json
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from llmrun.runners import devices as dv
from llmrun.runners.base import Request, SamplingParams, generate
from llmrun.runners.bench import run
from llmrun.runners.bench import sweep as sw
from llmrun.runners.bench.results import LLAMA_BENCH_FIELDS, llmrun_build
from llmrun.runners.bench.tuned import save_tuned
from llmrun.runners.config import EngineConfig
from llmrun.runners.errors import BadRequestError
from llmrun.runners.llamacpp import LlamaCppRunner

from . import llama_tools
from .conftest import HANG_S, which_llmrun

TINY = ["bench", "-r", "1", "--no-history"]
SHAPES = ["-p", "8", "-n", "2"]  # repeated options add values, as in llama-bench: given once


def bench(*args: str, env: dict[str, str], shapes: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [which_llmrun(), *TINY, *(SHAPES if shapes else []), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_S,
        stdin=subprocess.DEVNULL,
    )


def records(*args: str, env: dict[str, str], shapes: bool = True) -> list[dict[str, Any]]:
    done = bench("-o", "json", *args, env=env, shapes=shapes)
    assert done.returncode == 0, done.stderr
    return list(json.loads(done.stdout))


# The CPU a test runs as: this one, or an Intel Xeon with AMX, where llmrun's probe finds weight
# repacking unsafe (llama_tools.answer_probe fakes its answer), so every machine runs both.
CPUS = ["this CPU", "an AMX CPU"]


@pytest.mark.parametrize("cpu", CPUS)
def test_records_are_llama_bench_records_in_its_terms(
    llmrun_env: dict[str, str], model_path: str, cpu: str
) -> None:
    if cpu != "this CPU":
        llama_tools.answer_probe(model_path, safe=False)
    repack = llama_tools.repack_safe(model_path)  # llmrun's probe, as the llmrun it starts asks
    rows = records("-ngl", "99", "-fa", "0,1", env=llmrun_env)
    assert [r["test"] for r in rows] == ["pp8", "tg2", "pp8", "tg2"]
    for r in rows:
        assert tuple(r)[: len(LLAMA_BENCH_FIELDS)] == LLAMA_BENCH_FIELDS  # its order, first
        assert r["build_commit"] == llmrun_build(dv.build_commit(dv.query().commit()))
        assert not r["build_commit"].startswith("llama-cpp-python")
        assert r["model_type"] == "llama 256M Q4_1"  # llama_model_desc, as llama-bench says
        assert r["gpu_info"] == "" and r["backends"] == "CPU"
        assert r["n_gpu_layers"] == 99 and r["n_gpu_layers_offloaded"] == 0  # CPU-only build
        assert r["cpu_strict"] is False and r["no_kv_offload"] is False
        assert r["repack"] is repack  # llama-bench's default (on), but where it is unsafe here
        assert (r["poll"], r["load_mode"], r["split_mode"]) == (50, "auto", "layer")
    assert [r["flash_attn"] for r in rows] == [0, 0, 1, 1]  # llama-bench's encoding
    assert [r["flash_attn_mode"] for r in rows] == ["off", "off", "on", "on"]


def _script_schema(script: Path) -> dict[str, str]:
    """LLAMA_BENCH_DB_FIELDS and _TYPES as compare-llama-bench.py declares them."""
    tree = ast.parse(script.read_text())
    found: dict[str, list[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            if name in ("LLAMA_BENCH_DB_FIELDS", "LLAMA_BENCH_DB_TYPES"):
                found[name] = ast.literal_eval(node.value)
    return dict(zip(found["LLAMA_BENCH_DB_FIELDS"], found["LLAMA_BENCH_DB_TYPES"], strict=True))


def test_compare_llama_bench_reads_and_compares_two_runs(
    llmrun_env: dict[str, str], tmp_path: Path
) -> None:
    script = llama_tools.compare_script()
    db = tmp_path / "llama-bench.sqlite"
    runs = []
    for _ in range(2):
        done = bench("-o", "sql", env=llmrun_env)
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("CREATE TABLE IF NOT EXISTS llama_bench (")
        runs.append(done.stdout)
    with sqlite3.connect(db) as con:
        con.executescript(runs[0])
        columns = {row[1]: row[2] for row in con.execute("PRAGMA table_info(llama_bench)")}
        for field, kind in _script_schema(script).items():  # every column, the same type
            assert columns.get(field) == kind, field
        # The first run stands for an older llama.cpp build: the script compares builds.
        con.execute("UPDATE llama_bench SET build_commit = 'b1a2c3d'")
        con.executescript(runs[1])
        commit = con.execute(
            "SELECT DISTINCT build_commit FROM llama_bench WHERE build_commit != 'b1a2c3d'"
        ).fetchone()[0]
    done = subprocess.run(
        [sys.executable, str(script), "-i", str(db), "-b", "b1a2c3d", "-c", commit],
        capture_output=True,
        text=True,
        timeout=HANG_S,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    lines = [ln for ln in done.stdout.splitlines() if "llama 256M Q4_1" in ln]
    assert [ln.split("|")[3].strip() for ln in lines] == ["pp8", "tg2"], done.stdout
    for ln in lines:
        assert float(ln.split("|")[-2]) > 0  # the speedup column


def test_markdown_is_llama_bench_table_with_its_footer(llmrun_env: dict[str, str]) -> None:
    done = bench("-o", "md", env=llmrun_env)
    lines = done.stdout.splitlines()
    assert lines[0].startswith(
        "| model                          |       size |     params | backend    | threads |"
    )
    assert "|  92.10 MiB |   134.52 M | CPU        |" in lines[2]
    assert lines[-1] == f"build: {llmrun_build(dv.build_commit(dv.query().commit()))} (0)"


def test_several_models_run_the_same_tests(
    llmrun_env: dict[str, str], q8_model: str, model_path: str
) -> None:
    rows = records("-m", model_path, "-m", q8_model, env=llmrun_env)
    assert [(r["model_type"], r["test"]) for r in rows] == [
        ("llama 256M Q4_1", "pp8"),
        ("llama 256M Q4_1", "tg2"),
        ("llama 256M Q8_0", "pp8"),
        ("llama 256M Q8_0", "tg2"),
    ]
    assert [r["relative_ts"] for r in rows[:2]] == [1.0, 1.0]
    assert all(r["relative_ts"] > 0 for r in rows[2:])
    done = bench("-m", model_path, "-m", q8_model, "-o", "md", env=llmrun_env)
    assert "vs first" in done.stdout.splitlines()[0]


def test_llama_bench_spellings_parse_and_act(llmrun_env: dict[str, str]) -> None:
    rows = records(
        "-pg",
        "8,2",
        "-p",
        "0",
        "-n",
        "0",
        "-mmp",
        "0",
        "-nkvo",
        "1",
        "--repack",
        "0",
        "--delay",
        "0",
        "--no-warmup",
        "--numa",
        "distribute",
        env=llmrun_env,
        shapes=False,
    )
    assert [r["test"] for r in rows] == ["pp8+tg2"]
    r = rows[0]
    assert (r["load_mode"], r["no_kv_offload"], r["repack"]) == ("none", True, False)
    done = bench("-o", "csv", "-oe", "json", "--progress", "-v", env=llmrun_env)
    assert done.returncode == 0
    assert done.stdout.startswith("build_commit,build_number,cpu_info,")
    assert '"build_commit":' in done.stderr and "llama_model_loader" in done.stderr  # -oe, -v
    defaults = bench(
        "-o",
        "json",
        "-embd",
        "0",
        "-nopo",
        "0",
        "--no-host",
        "0",
        "-lzm",
        "auto",
        "-fitt",
        "0",
        "--offline",
        env=llmrun_env,
    )
    assert defaults.returncode == 0, defaults.stderr  # llama-bench's defaults: accepted
    listing = subprocess.run(
        [which_llmrun(), "bench", "--list-devices"],
        env=llmrun_env,
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert listing.returncode == 0 and listing.stdout.startswith("Available devices:\n")


@pytest.mark.parametrize(
    ("args", "says", "code"),
    [  # a value the option cannot read is a usage error (2); what cannot run here, 1
        (["-C", "0xzz"], "'z' is not a hex digit", 2),
        (["--poll", "101"], "--poll: 101 is out of range 0..100", 2),
        (["--cpu-strict", "2"], "--cpu-strict: '2' is not 0 or 1", 2),
        (["-sm", "row"], "no GPU backend", 1),
        (["-ts", "3/1"], "no GPU backend", 1),
        (["--numa", "everywhere"], "is not one of distribute", 2),
        (["-fa", "sometimes"], "-fa/--flash-attn: 'sometimes' is not on, off or auto", 2),
        (["-b", "4096", "-c", "256"], "every test was skipped", 1),
        (["-embd", "2"], "-embd/--embeddings: '2' is not 0 or 1", 2),
        (["-nopo", "yes,maybe"], "-nopo/--no-op-offload: 'maybe' is not 0 or 1", 2),
        (["--no-host", "-1"], "--no-host: '-1' is not 0 or 1", 2),
        (["-lzm", "sometimes"], "-lzm/--lazy-mode: 'sometimes' is not on, auto or off", 2),
        (["-hff", "model.gguf"], "give the repository", 1),
    ],
)
def test_what_cannot_run_says_why_and_fails(
    llmrun_env: dict[str, str], args: list[str], says: str, code: int
) -> None:
    done = bench("-o", "json", *args, env=llmrun_env)
    assert done.returncode == code, done.stderr
    assert says in done.stderr and "Traceback" not in done.stderr
    assert done.stdout == ""


def test_tuned_settings_are_named_and_never_cost_a_requested_value(
    llmrun_env: dict[str, str], model_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LLMRUN_HOME", llmrun_env["LLMRUN_HOME"])
    save_tuned(model_path, {"n_threads": 1, "n_batch": 512, "n_ubatch": 256, "flash_attn": "off"})
    rows = records("--tuned", "-b", "64,128", "-p", "8", "-n", "0", env=llmrun_env, shapes=False)
    assert [(r["n_batch"], r["n_ubatch"]) for r in rows] == [(64, 64), (128, 128)]
    assert all(r["tuned"] and r["n_threads"] == 1 for r in rows)
    for flags in ([], ["--no-tuned"]):  # without --tuned: llama-bench's defaults, tuning or not
        plain = records(*flags, "-p", "8", "-n", "0", env=llmrun_env, shapes=False)
        assert not plain[0]["tuned"] and (plain[0]["n_batch"], plain[0]["n_ubatch"]) == (2048, 512)


def _sweep(**lists: Any) -> run.Sweep:
    return run.Sweep(
        shapes=[sw.Shape(8, 0)],
        threads=None,
        batch=None,
        ubatch=None,
        gpu_layers=None,
        flash_attn=None,
        cache_type_k="f16",
        cache_type_v="f16",
        reps=1,
        ctx=None,
        seed=1,
        scenarios=False,
        **lists,
    )


def test_lazy_mode_host_embeddings_and_op_offload_sweep_in_llama_bench_order() -> None:
    base = EngineConfig().with_llama_bench_defaults()
    combos = _sweep(lazy_mode="off,on", no_host="0,1", embeddings="1,0", no_op_offload="1").combos(
        base
    )
    got = [(c.lazy_mode, c.no_host, c.embeddings, c.no_op_offload) for c in combos]
    assert got == [
        (lz, nh, em, True) for lz in ("off", "on") for nh in (False, True) for em in (True, False)
    ]
    assert run.varied_fields(_sweep(), combos) >= {"lazy_mode", "no_host", "embeddings"}
    plain = _sweep().combos(base)
    assert [(c.lazy_mode, c.no_host, c.embeddings, c.no_op_offload) for c in plain] == [
        ("auto", False, False, False)
    ]
    config = combos[0].config(base, 64)  # handed to the engine; model-side ones reload
    assert (config.lazy_mode, config.embeddings, config.no_op_offload) == ("off", True, True)
    assert not config.same_model(base) and combos[1].config(base, 64).same_model(config)
    with pytest.raises(BadRequestError, match="'sometimes' is not on, auto or off"):
        _sweep(lazy_mode="on,sometimes").combos(base)


def test_llama_bench_model_and_context_flags_run_and_are_recorded(
    llmrun_env: dict[str, str],
) -> None:
    """-lzm, --no-host, -embd and -nopo at other values than the defaults: each value its own
    test, as llama-bench runs them, recorded from the parameters handed to llama.cpp."""
    rows = records("-lzm", "on", "--no-host", "1", "-nopo", "1", "-embd", "0,1", env=llmrun_env)
    assert [(r["embeddings"], r["test"]) for r in rows] == [
        (False, "pp8"),
        (False, "tg2"),
        (True, "pp8"),
        (True, "tg2"),
    ]
    for r in rows:
        assert (r["lazy_mode"], r["no_host"], r["no_op_offload"]) == ("on", True, 1)
        assert r["avg_ts"] > 0
    off = records("-lzm", "off", "-p", "8", "-n", "0", env=llmrun_env, shapes=False)
    assert [(r["lazy_mode"], r["embeddings"], r["no_host"]) for r in off] == [("off", False, False)]
    done = bench("-embd", "0,1", "-o", "md", env=llmrun_env)
    assert done.returncode == 0 and " embd |" in done.stdout.splitlines()[0], done.stdout


def test_with_embeddings_on_the_logits_still_come_out(runner: LlamaCppRunner) -> None:
    """embeddings=true outputs every token's logits with its embedding: sampling still sees
    them, and greedy text is the same as without."""
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    request = Request(prompt="The capital of France is", sampling=greedy)
    plain = generate(runner, request)
    config = runner.config
    try:
        loaded = runner.reconfigure(
            EngineConfig(n_ctx=config.n_ctx, flash_attn="off", embeddings=True, no_op_offload=True)
        )
        assert (loaded.settings.params["embeddings"], loaded.settings.params["no_op_offload"]) == (
            True,
            1,
        )
        runner.reset()
        with_embd = generate(runner, request)
    finally:
        runner.reconfigure(config)
    assert with_embd.stats.output_tokens == 6
    assert with_embd.text == plain.text
