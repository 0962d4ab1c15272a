"""Issue 29, "llama-bench records": bench's rows come in llama-bench's order (its
get_cmd_params_instances: the settings' nested loops, the depth between --cpu-strict and --poll,
and for each setting its pp tests, then tg, then pg; a value given twice is two tests), and
every spelling of llama-bench's options either works as there or is refused in one line that
names it (`-rpc` read as `-r pc`, `-dio 1` as a subcommand `1`)."""

from __future__ import annotations

import itertools
import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from llmrun.cli.app import app
from llmrun.cli.bench import sweep_options as o
from llmrun.runners.bench import sweep as sw
from llmrun.runners.config import EngineConfig

from . import llama_tools
from .conftest import HANG_S, free_port, which_llmrun

# llama-bench's loops in get_cmd_params_instances, outermost first, as the record fields they
# fill (the model's loop is outside them all)
LLAMA_BENCH_LOOPS = (
    "fit_target",
    "fit_min_ctx",
    "n_gpu_layers",
    "n_cpu_moe",
    "split_mode",
    "load_mode",
    "lazy_mode",
    "main_gpu",
    "devices",
    "tensor_split",
    "tensor_buft_overrides",
    "no_host",
    "repack",
    "embeddings",
    "no_op_offload",
    "n_batch",
    "n_ubatch",
    "type_k",
    "type_v",
    "no_kv_offload",
    "flash_attn",
    "n_threads",
    "cpu_mask",
    "cpu_strict",
    "n_depth",
    "poll",
)
# A sweep of several lists, each as bench's option and as llama-bench's record field's values
SWEEP: dict[str, tuple[list[str], list[Any]]] = {
    "-t": (["1,2"], [1, 2]),
    "-b": (["32,64"], [32, 64]),
    "-fa": (["0,1"], [0, 1]),
    "-ctk": (["f16,q8_0"], ["f16", "q8_0"]),
    "-d": (["0,8"], [0, 8]),
    "--poll": (["0,50"], [0, 50]),
}
FIELD_OF = {
    "-t": "n_threads",
    "-b": "n_batch",
    "-fa": "flash_attn",
    "-ctk": "type_k",
    "-d": "n_depth",
    "--poll": "poll",
}
PROMPTS, GENS, PAIRS = [16, 16], [4], [(8, 2)]  # 16 twice: two tests, as llama-bench


def _expected(swept: dict[str, list[Any]]) -> list[dict[str, Any]]:
    """llama-bench's instances, written out from its loops: the swept fields and the test."""
    order = [f for f in LLAMA_BENCH_LOOPS if f in swept]
    rows = []
    for values in itertools.product(*(swept[f] for f in order)):
        at = dict(zip(order, values, strict=True))
        tests = [(p, 0) for p in PROMPTS] + [(0, n) for n in GENS] + PAIRS
        rows += [at | {"n_prompt": p, "n_gen": n} for p, n in tests]
    return rows


def _llmrun_order(args: dict[str, list[str]]) -> list[dict[str, Any]]:
    """bench's tests for these options, in the order it runs them, as record fields."""
    given: dict[str, list[str] | None] = {x.name: None for x in o.LISTS}
    names = {flag: x.name for x in o.LISTS for flag in x.flags}
    for flag, value in args.items():
        given[names[flag]] = value
    lists = o.SweepLists(**given)
    sweep = lists.sweep(scenarios=False, scenario_scale=1.0, reps=1, seed=1)
    combos = sweep.combos(EngineConfig().with_llama_bench_defaults())
    codes = {"off": 0, "on": 1, "auto": -1}
    return [
        {
            "n_threads": c.n_threads,
            "n_batch": c.n_batch,
            "flash_attn": codes[str(c.flash_attn)],
            "type_k": c.type_k,
            "n_depth": s.n_depth,
            "poll": c.poll,
            "n_prompt": s.n_prompt,
            "n_gen": s.n_gen,
        }
        for c, shapes in sw.tests(combos, sweep.shapes, sweep.inside_depth())
        for s in shapes
    ]


def _pick(rows: list[dict[str, Any]], fields: list[str]) -> list[tuple[Any, ...]]:
    return [tuple(r[f] for f in fields) for r in rows]


def _args(flags: list[str]) -> dict[str, list[str]]:
    return {
        "-p": [",".join(map(str, PROMPTS))],
        "-n": [",".join(map(str, GENS))],
        "-pg": [f"{p},{n}" for p, n in PAIRS],
        **{f: SWEEP[f][0] for f in flags},
    }


@pytest.mark.parametrize(
    "flags",
    [
        ["-d"],
        ["-ctk", "-fa"],
        ["-t", "-b"],
        ["-d", "--poll"],
        list(SWEEP),
    ],
    ids=" ".join,
)
def test_the_tests_run_in_llama_bench_s_order(flags: list[str]) -> None:
    """The rows that differed (-d, -ctk with -fa, -t with -b, whole sweeps) and -p 16,16."""
    fields = [FIELD_OF[f] for f in flags] + ["n_prompt", "n_gen"]
    expected = _expected({FIELD_OF[f]: SWEEP[f][1] for f in flags})
    assert _pick(_llmrun_order(_args(flags)), fields) == _pick(expected, fields)


def test_a_value_given_twice_is_two_tests_in_its_place() -> None:
    """-t 2,2 with -d 0,8: llama-bench loops the depth inside the threads, so the rows are
    t2 d0, t2 d8, t2 d0, t2 d8 (not both t2 at d0 first); --poll 0,0 is inside the depth."""
    rows = _llmrun_order({"-p": ["8"], "-n": ["0"], "-t": ["2,2"], "-d": ["0,8"]})
    assert _pick(rows, ["n_threads", "n_depth"]) == [(2, 0), (2, 8), (2, 0), (2, 8)]
    rows = _llmrun_order({"-p": ["8"], "-n": ["0"], "--poll": ["0,0"], "-d": ["0,8"]})
    assert _pick(rows, ["poll", "n_depth"]) == [(0, 0), (0, 0), (0, 8), (0, 8)]
    rows = _llmrun_order({"-p": ["8"], "-n": ["0"], "-d": ["0,0"], "--poll": ["0,50"]})
    assert _pick(rows, ["n_depth", "poll"]) == [(0, 0), (0, 50), (0, 0), (0, 50)]


def test_every_setting_of_a_sweep_is_one_of_llama_bench_s_loops_in_its_order() -> None:
    """sweep's loops are llama-bench's (the record names -ot tensor_buft_overrides), but for
    --draft, llmrun's own, just outside the depth."""
    ours = [
        "tensor_buft_overrides" if f == "tensor_overrides" else f for f in sw.LOOPS if f != "draft"
    ]
    assert ours == list(LLAMA_BENCH_LOOPS)


@pytest.mark.slow
@pytest.mark.model
def test_rows_pair_with_llama_bench_s_by_position(
    llmrun_env: dict[str, str], model_path: str, llama_bench_path: Path
) -> None:
    """The real llama-bench and llmrun, one command line of several lists: row i of one is
    row i of the other, field by field (one thread: two spinning threads on this machine's
    shared cores make a run of minutes; no warm-up, which nearly doubled both runs' time and is
    not what is compared)."""
    folder, name = Path(model_path).parent, Path(model_path).name
    line = ["-m", name, "-r", "1", "--no-warmup", "-o", "json", "-p", "8,8", "-n", "2"]
    line += ["-pg", "4,2"]
    line += ["-t", "1", "-b", "32,64", "-ctk", "f16,q8_0", "-fa", "0,1", "-d", "0,4"]
    flags = llama_tools.cpu_flags("llama-bench", model_path)
    # both at once, one thread each on the machine's two cores: rows pair by position, and no
    # figure of one is compared with the other's
    children = [
        subprocess.Popen(
            command,
            env=llmrun_env,
            cwd=folder,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            stdin=subprocess.DEVNULL,
        )
        for command in (
            [str(llama_bench_path), *line, *flags],
            [which_llmrun(), "bench", "--no-history", *line, *flags],
        )
    ]
    outputs = []
    try:
        for child in children:
            out, err = child.communicate(timeout=HANG_S * 4)
            assert child.returncode == 0, err
            outputs.append(out)
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.communicate()
    theirs, ours = (json.loads(out) for out in outputs)
    keys = ["n_batch", "type_k", "flash_attn", "n_depth", "n_prompt", "n_gen"]
    assert len(theirs) == 2 * 2 * 2 * 2 * 4
    assert _pick(ours, keys) == _pick(theirs, keys)


@pytest.mark.slow
def test_list_devices_prints_llama_bench_s_lines(
    llmrun_env: dict[str, str], llama_bench_path: Path
) -> None:
    """`--list-devices` from the real llama-bench and from llmrun, on the same libggml: the same
    lines (`  (none)` on a CPU-only build), but for the free memory, which may move between
    the two calls."""
    said = [
        subprocess.run(command, env=llmrun_env, capture_output=True, text=True, timeout=HANG_S)
        for command in (
            [str(llama_bench_path), "--list-devices"],
            [which_llmrun(), "bench", "--list-devices"],
        )
    ]
    assert [s.returncode for s in said] == [0, 0], [s.stderr[-2000:] for s in said]
    theirs, ours = (re.sub(r"\d+ MiB free", "N MiB free", s.stdout) for s in said)
    assert ours == theirs and ours.startswith("Available devices:\n")


# Each spelling of llama-bench's print_usage (and the older -mmp and -dio), with a value unlike
# its default where it takes one: bench either runs with it or refuses it in one line naming it
LLAMA_BENCH_SPELLINGS = [
    ["--numa", "distribute"],
    ["-r", "2"],
    ["--repetitions", "2"],
    ["--prio", "0"],
    ["--delay", "0"],
    ["-o", "csv"],
    ["--output", "json"],
    ["-oe", "csv"],
    ["--output-err", "md"],
    ["--list-devices"],
    ["-v"],
    ["--verbose"],
    ["--progress"],
    ["--no-warmup"],
    ["-fitt", "512"],
    ["--fit-target", "512"],
    ["-fitc", "1024"],
    ["--fit-ctx", "1024"],
    ["-rpc", "127.0.0.1:50052"],
    ["--rpc", "127.0.0.1:50052"],
    ["-m", "nowhere.gguf"],
    ["--model", "nowhere.gguf"],
    ["-hf", "owner/repo"],
    ["-hfr", "owner/repo"],
    ["--hf-repo", "owner/repo"],
    ["-hf", "owner/repo", "-hff", "a.gguf"],
    ["-hf", "owner/repo", "--hf-file", "a.gguf"],
    ["-hft", "secret"],
    ["--hf-token", "secret"],
    ["--offline"],
    ["-p", "16"],
    ["--n-prompt", "16"],
    ["-n", "4"],
    ["--n-gen", "4"],
    ["-pg", "8,2"],
    ["-d", "4"],
    ["--n-depth", "4"],
    ["-b", "64"],
    ["--batch-size", "64"],
    ["-ub", "64"],
    ["--ubatch-size", "64"],
    ["-ctk", "q8_0"],
    ["--cache-type-k", "q8_0"],
    ["-ctv", "q8_0"],
    ["--cache-type-v", "q8_0"],
    ["-t", "1"],
    ["--threads", "1"],
    ["-C", "0x1"],
    ["--cpu-mask", "0x1"],
    ["--cpu-strict", "1"],
    ["--poll", "0"],
    ["-ngl", "0"],
    ["--n-gpu-layers", "0"],
    ["-ncmoe", "1"],
    ["--n-cpu-moe", "1"],
    ["-sm", "row"],
    ["--split-mode", "row"],
    ["-mg", "1"],
    ["--main-gpu", "1"],
    ["-nkvo", "1"],
    ["--no-kv-offload", "1"],
    ["-fa", "1"],
    ["--flash-attn", "on"],
    ["-dev", "CUDA1"],
    ["--device", "CUDA1"],
    ["-lm", "none"],
    ["--load-mode", "none"],
    ["-lzm", "off"],
    ["--lazy-mode", "off"],
    ["-embd", "1"],
    ["--embeddings", "1"],
    ["-ts", "3/1"],
    ["--tensor-split", "3/1"],
    ["-ot", "exps=CPU"],
    ["--override-tensor", "exps=CPU"],
    ["-nopo", "1"],
    ["--no-op-offload", "1"],
    ["--no-host", "1"],
    ["--repack", "0"],
    ["-mmp", "0"],
    ["--mmap", "0"],
    ["-dio", "1"],
    ["--direct-io", "1"],
    # llama-bench refuses these (its long options spelt with one dash); so does bench, by name
    ["-cpu-mask", "0x1"],
    ["-cpu-strict", "1"],
    ["-poll", "0"],
    ["-prio", "1"],
    ["-delay", "0"],
    ["-repack", "0"],
    ["-no-warmup"],
]


def _fake(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from llmrun.cli import engine

    from .fake import FakeBenchRunner

    monkeypatch.setenv("LLMRUN_HOME", str(tmp_path))
    monkeypatch.setattr(
        engine, "BENCH_RUNNER_FACTORY", lambda model, config, tuned: FakeBenchRunner()
    )


@pytest.mark.parametrize("args", LLAMA_BENCH_SPELLINGS, ids=" ".join)
def test_every_llama_bench_spelling_works_or_is_refused_by_name(
    args: list[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _fake(monkeypatch, tmp_path)
    for var in ("HF_TOKEN", "HF_HUB_OFFLINE", "LLMRUN_MODEL"):
        monkeypatch.delenv(var, raising=False)
    base = ["bench", "--no-history", "-r", "1", "-p", "8", "-n", "0"]
    done = CliRunner().invoke(app, [*base, *args])
    if done.exit_code == 0:
        return
    lines = done.stderr.strip().splitlines()
    assert done.exit_code in (1, 2) and len(lines) == 1, (done.exit_code, done.stderr)
    assert any(a in lines[0] for a in args), lines
    assert "Traceback" not in done.stderr and "No such command" not in lines[0]


def test_every_spelling_of_llama_bench_s_usage_is_listed_here(llama_cpp_source: Path) -> None:
    """The list above covers print_usage's options (-h aside)."""
    source = (llama_cpp_source / "tools" / "llama-bench" / "llama-bench.cpp").read_text()
    usage = source[source.index("static void print_usage") :]
    usage = usage[: usage.index("\n}\n")]

    named = set(re.findall(r'printf\("\s+((?:-{1,2}[\w-]+(?:, |\s))+)', usage))
    spellings = {s for group in named for s in re.findall(r"-{1,2}[\w-]+", group)}
    listed = {a for args in LLAMA_BENCH_SPELLINGS for a in args if a.startswith("-")}
    assert spellings - {"-h", "--help", "--version"} <= listed, spellings - listed


def test_rpc_is_refused_with_the_reason_and_records_say_none(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """-rpc was `-r pc` ("Invalid value for '-r'"); a server that is not there (or a backend
    not built) is one line before any model, and without -rpc the record's `rpc` is
    llama-bench's empty string (tests/test_rpc.py runs real servers)."""
    _fake(monkeypatch, tmp_path)
    port = free_port()
    done = CliRunner().invoke(app, ["bench", "-rpc", f"127.0.0.1:{port}", "-p", "8", "-n", "0"])
    assert done.exit_code == 1
    (line,) = done.stderr.strip().splitlines()
    assert f"RPC server 127.0.0.1:{port} cannot be reached" in line or "make rpc-server" in line
    run = CliRunner().invoke(
        app, ["bench", "--no-history", "-r", "1", "-p", "8", "-n", "0", "-o", "json"]
    )
    assert run.exit_code == 0, run.stderr
    (row,) = json.loads(run.stdout)
    assert row["rpc"] == ""


def test_dio_is_the_direct_io_load_mode() -> None:
    """-dio 1 was `-d io` and a subcommand `1`: older llama-bench's direct I/O, -lm dio."""
    rows = _llmrun_order({"-p": ["8"], "-n": ["0"]})
    assert len(rows) == 1
    given: dict[str, list[str] | None] = {x.name: None for x in o.LISTS}
    given["direct_io"] = ["1,0"]
    sweep = o.SweepLists(**given).sweep(scenarios=False, scenario_scale=1.0, reps=1, seed=1)
    combos = sweep.combos(EngineConfig().with_llama_bench_defaults())
    assert [c.load_mode for c in combos] == ["dio", "auto"]
