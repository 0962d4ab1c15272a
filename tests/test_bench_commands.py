"""One command per job: `bench` (the sweep), `bench serve`, `bench interference` and `tune` list
only the options their job uses, and every one of them reaches the job."""

from __future__ import annotations

import io
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import typer.main
from rich.console import Console
from typer.testing import CliRunner

from llmrun.cli.app import app
from llmrun.cli.bench import flags, interference, machine, serve, serving, sweep, tune
from llmrun.runners.errors import OptionError

# A value unlike the default for every option a --help lists (a new option needs one here).
SAMPLES: dict[str, list[str]] = {
    "--model": ["-m", "other.gguf"],
    "--energy": ["--energy", "off"],
    "--n-prompt": ["-p", "64"],
    "--n-gen": ["-n", "16"],
    "--pg": ["--pg", "8,8"],
    "--n-depth": ["-d", "32"],
    "--repetitions": ["-r", "2"],
    "--until-ci": ["--until-ci", "2%"],
    "--threads": ["-t", "1"],
    "--threads-batch": ["-tb", "1"],
    "--batch": ["-b", "64"],
    "--ubatch": ["-ub", "64"],
    "--gpu-layers": ["-ngl", "0"],
    "--flash-attn": ["-fa", "1"],
    "--cache-type-k": ["-ctk", "q8_0"],
    "--cache-type-v": ["-ctv", "q8_0"],
    "--repack": ["--repack", "0"],
    "--mmap": ["-mmp", "0"],
    "--direct-io": ["-dio", "1"],
    "--rpc": ["-rpc", "127.0.0.1:50052"],
    "--load-mode": ["-lm", "none"],
    "--no-kv-offload": ["-nkvo", "1"],
    "--split-mode": ["-sm", "row"],
    "--main-gpu": ["-mg", "1"],
    "--tensor-split": ["-ts", "3/1"],
    "--device": ["-dev", "CUDA1"],
    "--n-cpu-moe": ["-ncmoe", "2"],
    "--override-tensor": ["-ot", "exps=CPU"],
    "--cpu-mask": ["-C", "0x3"],
    "--cpu-strict": ["--cpu-strict", "1"],
    "--poll": ["--poll", "0"],
    "--numa": ["--numa", "distribute"],
    "--prio": ["--prio", "1"],
    "--delay": ["--delay", "1"],
    "--no-warmup": ["--no-warmup"],
    "--progress": ["--progress"],
    "--verbose": ["-v"],
    "--output-err": ["-oe", "csv"],
    "--embeddings": ["-embd", "1"],
    "--no-op-offload": ["-nopo", "1"],
    "--no-host": ["--no-host", "1"],
    "--lazy-mode": ["-lzm", "off"],
    "--fit-target": ["-fitt", "512"],
    "--fit-ctx": ["-fitc", "1024"],
    "--hf-repo": ["-hf", "owner/repo:Q4_0"],
    "--hf-file": ["-hf", "owner/repo", "-hff", "a.gguf"],
    "--hf-token": ["-hft", "secret"],
    "--offline": ["--offline"],
    "--list-devices": ["--list-devices"],
    "--ctx": ["-c", "2048"],
    "--scenarios": ["--scenarios"],
    "--scenario-scale": ["--scenarios", "--scenario-scale", "0.5"],
    "--cold": ["--cold"],
    "--draft": ["--draft", "4"],
    "--ppl": ["--ppl", "README.md"],
    "--kld": ["--kld"],
    "--tuned": ["--tuned"],
    "--version": ["--version"],
    "--output": ["-o", "json"],
    "--plot": ["--plot", "x.png"],
    "--compare": ["--compare"],
    "--no-history": ["--no-history"],
    "--seed": ["--seed", "7"],
    "--endpoint": ["--endpoint", "http://127.0.0.1:9"],
    "--api-key": ["--endpoint", "http://127.0.0.1:9", "--api-key", "k"],
    "--timeout": ["--endpoint", "http://127.0.0.1:9", "--timeout", "5"],
    "--concurrency": ["--concurrency", "2"],
    "--slots": ["--slots", "2"],
    "--max-concurrency": ["--max-concurrency", "2"],
    "--request-rate": ["--request-rate", "3"],
    "--num-prompts": ["--num-prompts", "3"],
    "--input-len": ["--input-len", "16"],
    "--output-len": ["--output-len", "8"],
    "--range-ratio": ["--range-ratio", "0.5"],
    "--shared-prefix": ["--shared-prefix", "8"],
    "--dataset": ["--dataset", "README.md"],  # not JSONL: refused in one line
    "--warmup": ["--warmup", "2"],
    "--percentiles": ["--percentiles", "50"],
    "--slo": ["--slo", "ttft:100"],
    "--policy": ["--policy", "chunked:32"],
    "--rate": ["--rate", "5"],
    "--prompt-len": ["--prompt-len", "64"],
    "--workload": ["--workload", "chat"],
    "--budget": ["--budget", "5m"],
    "--kv-unified": ["-kvu"],
}
# Options that only name where a result goes or which machine runs: the job reads them too.
COMMANDS = {
    ("bench",): (sweep, ("_sweep", "_list_devices")),
    ("bench", "serve"): (serve, ("_remote", "_local")),
    ("bench", "interference"): (interference, ("_remote", "_local")),
    ("tune",): (tune, ("_tune",)),
}


def _options(path: tuple[str, ...]) -> list[str]:
    command: Any = typer.main.get_command(app)
    for name in path:
        command = command.commands[name]
    return [
        next(o for o in [*p.opts, *p.secondary_opts] if o.startswith("--"))
        for p in command.params
        if not getattr(p, "hidden", False) and p.name != "help"
    ]


def _run(monkeypatch: pytest.MonkeyPatch, path: tuple[str, ...], args: list[str]) -> Any:
    """What reached the job: the arguments of its entry point, the process settings and the
    Hub variables; or the exit code and stderr of a refusal."""
    module, entries = COMMANDS[path]
    seen: list[Any] = []

    def entered(name: str) -> Any:
        def record(*a: Any, **k: Any) -> int:
            values = [x for x in a if not isinstance(x, (threading.Event, Console, serving.Screen))]
            seen.append((name, values, k))
            return 0

        return record

    for entry in entries:
        monkeypatch.setattr(module, entry, entered(entry))
    monkeypatch.setattr(flags, "apply_process_settings", lambda **k: seen.append(k))
    monkeypatch.setattr(sweep, "set_verbose", lambda on: seen.append(("verbose", on)))
    monkeypatch.setattr(tune, "set_verbose", lambda on: seen.append(("verbose", on)))
    for var in ("HF_TOKEN", "HF_HUB_OFFLINE", "LLMRUN_ENDPOINT", "LLMRUN_MODEL"):
        monkeypatch.delenv(var, raising=False)
    result = CliRunner().invoke(app, [*path, *args])
    seen.append({v: os.environ.get(v) for v in ("HF_TOKEN", "HF_HUB_OFFLINE")})
    if result.exit_code != 0:
        return result.exit_code, result.stderr
    text = repr(seen)
    assert " at 0x" not in text, text  # only values: an object's address would always differ
    return text


@pytest.mark.parametrize("path", list(COMMANDS), ids=" ".join)
def test_no_option_in_help_is_ignored_by_its_job(
    path: tuple[str, ...], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(Path(__file__).resolve().parent.parent)  # --ppl README.md
    baseline = _run(monkeypatch, path, [])
    assert isinstance(baseline, str), baseline
    for option in _options(path):
        args = SAMPLES[option]
        if path != ("bench",) and option in ("--api-key", "--timeout"):
            base = _run(monkeypatch, path, args[:2])  # against the same server, without it
        else:
            base = baseline
        got = _run(monkeypatch, path, args)
        if isinstance(got, tuple):  # refused: one line that names it, never ignored
            code, stderr = got
            assert code in (1, 2) and len(stderr.strip().splitlines()) == 1, (option, stderr)
            assert any(a in stderr for a in args if a.startswith("-")), (option, stderr)
        else:
            assert got != base, f"{' '.join(path)} {option}: listed in --help, ignored by the job"


def test_the_sweeps_options_before_a_subcommand_are_refused() -> None:
    result = CliRunner().invoke(app, ["bench", "-p", "8", "serve"])
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [
        "llmrun: error: -p: bench's own options; give them after no subcommand, not before `serve`"
    ]


def test_the_sweeps_settings_from_the_environment_are_not_typed_options() -> None:
    """LLMRUN_MODEL or LLMRUN_ENERGY in the environment is the user's setting for every command,
    not a sweep option typed before `serve` (it refused every `bench serve` run)."""
    group = typer.main.get_command(app).commands["bench"]  # type: ignore[attr-defined]
    samples = {"LLMRUN_MODEL": "other.gguf", "LLMRUN_ENERGY": "off", "LLMRUN_CTX": "256"}
    envvars = {str(p.envvar): p for p in group.params if isinstance(p.envvar, str)}
    assert {"LLMRUN_MODEL", "LLMRUN_ENERGY"} <= set(envvars), envvars
    for name in envvars:
        value = samples.get(name, "1")
        for sub in ("serve", "interference"):
            result = CliRunner().invoke(
                app, ["bench", sub, "--num-prompts", "0"], env={name: value}
            )
            assert result.exit_code == 2, (name, sub, result.stderr)
            assert "own options" not in result.stderr and "--num-prompts" in result.stderr, (
                name,
                sub,
                result.stderr,
            )
    typed = CliRunner().invoke(
        app, ["bench", "--energy", "off", "serve"], env={"LLMRUN_MODEL": "x"}
    )
    assert typed.exit_code == 2 and "--energy: bench's own options" in typed.stderr, typed.stderr


@pytest.mark.parametrize(
    "setting",
    ["LLMRUN_THREADS=1", "LLMRUN_GPU_LAYERS=0", "LLMRUN_RPC=127.0.0.1:9", "LLMRUN_CTX=512"],
)
@pytest.mark.parametrize(
    "command",
    [["run", "hi"], ["chat"], ["bench", "serve", "--num-prompts", "1"], ["bench", "interference"]],
    ids=" ".join,
)
def test_a_local_setting_from_the_environment_does_not_refuse_an_endpoint(
    setting: str, command: list[str]
) -> None:
    """LLMRUN_THREADS=1 made every `run --endpoint` a usage error (`-t/--threads:
    local-engine options`): the variable is the user's setting for the local engine, not an
    option typed against a server. Typed, it is still refused."""
    name, _, value = setting.partition("=")
    env = {name: value}
    argv = [*command, "--endpoint", "http://127.0.0.1:9"]
    result = CliRunner().invoke(app, argv, env=env, input="")
    assert "local-engine options" not in result.stderr, result.stderr
    assert "cannot connect" in result.stderr, result.stderr
    typed = CliRunner().invoke(app, [*command, "-t", "1"], env={"LLMRUN_ENDPOINT": "http://h:9"})
    assert "with LLMRUN_ENDPOINT the server's own settings decide" in typed.stderr, typed.stderr


def test_what_the_environment_set_is_named_by_its_variable() -> None:
    """LLMRUN_ENDPOINT=garbage said `give --endpoint as http://HOST:PORT`, an option the user
    never typed; a policy against LLMRUN_ENDPOINT's server was exit 1 where every other
    option that does not apply is a usage error."""
    bad = CliRunner().invoke(app, ["run", "-n", "1", "hi"], env={"LLMRUN_ENDPOINT": "garbage"})
    assert bad.exit_code == 2  # a value it cannot read, as LLMRUN_RPC's
    assert bad.stderr.strip().endswith("(give LLMRUN_ENDPOINT as http://HOST:PORT)"), bad.stderr
    env = {"LLMRUN_ENDPOINT": "http://127.0.0.1:9"}
    policy = CliRunner().invoke(app, ["bench", "serve", "--policy", "prefill-first"], env=env)
    assert policy.exit_code == 2, policy.stderr
    assert "--policy: the server schedules its own requests" in policy.stderr


def test_what_came_from_the_environment_is_the_current_command_lines_alone() -> None:
    import llmrun.cli

    CliRunner().invoke(
        app, ["run", "--endpoint", "http://127.0.0.1:9", "hi"], env={"LLMRUN_THREADS": "1"}
    )
    assert "--threads" in llmrun.cli.from_environment
    CliRunner().invoke(app, ["run", "--bogus"])  # refused while parsed, before it begins
    assert llmrun.cli.from_environment == frozenset()


def test_model_lists_are_read_as_llama_bench_reads_them() -> None:
    """llama-bench's getline gives `a.gguf,` one item, and `a,,b` an empty one."""
    assert flags.hub_models(["a.gguf,"], None, None, None, False) == ["a.gguf"]
    assert flags.hub_models(["a.gguf,b.gguf", "c"], None, None, None, False) == [
        "a.gguf",
        "b.gguf",
        "c",
    ]
    for bad in ("a,,b", ",a", ""):
        with pytest.raises(OptionError, match="an empty name names no model"):
            flags.hub_models([bad], None, None, None, False)


def test_each_help_lists_only_its_jobs_options() -> None:
    sweep_help, serve_help = _options(("bench",)), _options(("bench", "serve"))
    assert "--concurrency" not in sweep_help and "--endpoint" not in sweep_help
    assert "--n-prompt" not in serve_help and "--tune" not in sweep_help
    assert "--threads" in serve_help  # the local engine's (issue 21 item 11: -t 1 was ignored)
    assert set(_options(("tune",))) == {"--model", "--workload", "--budget", "--verbose"}


def test_the_header_names_the_settings_each_test_runs_with() -> None:
    """Issue 20 item 4: not the loaded engine's `ngl -1 (17 of 17 offloaded)` above a -ngl 0
    run, nor `2 threads` / `batch 512` under -t 1 or -b 64,256,1024."""
    from dataclasses import replace

    from llmrun.runners.bench import sweep as sw
    from llmrun.runners.config import EngineConfig

    from .fake import FAKE_SETTINGS

    st = replace(
        FAKE_SETTINGS,
        n_threads=2,
        n_batch=512,
        n_ubatch=512,
        n_gpu_layers=17,
        n_gpu_layers_asked=-1,
        n_layer_total=17,
        gpu_offload=True,
    )
    base = EngineConfig()
    plain = machine.settings_line(st, [sw.Combo()], base)
    assert plain.startswith("2 threads, batch 512, ubatch 512,") and "ngl -1 (17 of 17" in plain
    one = machine.settings_line(st, [sw.Combo(n_threads=1, n_gpu_layers=0)], base)
    assert one.startswith("1 threads, batch 512,") and "ngl 0:" in one and "offloaded" not in one
    swept = machine.settings_line(
        st, [sw.Combo(n_batch=b, n_ubatch=min(b, 512)) for b in (64, 256, 1024)], base
    )
    assert "batch 64/256/1024 (varies by test), ubatch 64/256/512 (varies by test)" in swept
    fa = machine.settings_line(st, [sw.Combo(flash_attn="off"), sw.Combo(flash_attn="on")], base)
    assert "flash attention off/on (varies by test)" in fa


def _row(shape: Any, avg_ts: float, **swept: Any) -> Any:
    """A typed result row as the terminal gets it (BenchRun.rows), with these figures."""
    from dataclasses import replace

    from llmrun.runners.bench import sweep as sw
    from llmrun.runners.bench.results import Efficiency, Result, Row

    from .fake import FAKE_MODEL, FAKE_SETTINGS

    result = Result(
        shape=shape,
        combo=sw.Combo(),
        model=FAKE_MODEL,
        settings=replace(FAKE_SETTINGS, n_threads=2),
        load_s=0.1,
        samples_s=(1.0,),
        engine_samples_s=(),
    )
    return Row(
        result=result,
        avg_ts=avg_ts,
        stddev_ts=0.0,
        ttft_ms=None,
        itl_p50_ms=None,
        itl_p99_ms=None,
        efficiency=Efficiency(),
        swept=swept,
    )


def test_the_sweep_chart_names_only_settings_a_row_has() -> None:
    """`--draft 0,2` rows: the plain row has no draft, and its label must not say draft=None."""
    from llmrun.cli.bench.output import sweep_chart
    from llmrun.runners.bench.sweep import Shape

    chart = sweep_chart([_row(Shape(0, 16), 100.0, draft=None), _row(Shape(0, 16), 120.0, draft=2)])
    assert chart is not None
    console = Console(record=True, width=100, color_system=None)
    console.print(chart)
    text = console.export_text()
    assert "None" not in text
    assert "draft=2" in text


def test_charts_take_the_kind_from_the_result_not_from_keys() -> None:
    """A --pg test (prompt then generation) is neither a prompt nor an output bar; pp and tg
    rows go to their own bars, by Result.kind."""
    from llmrun.cli.bench.output import depth_chart, sweep_chart
    from llmrun.runners.bench.sweep import Shape

    pp, tg, pg = _row(Shape(64, 0), 500.0), _row(Shape(0, 16), 50.0), _row(Shape(64, 16), 9.0)
    assert [r.kind for r in (pp, tg, pg)] == ["pp", "tg", "pg"]
    console = Console(record=True, width=100, color_system=None)
    console.print(sweep_chart([pp, tg, pg]))
    text = console.export_text()
    assert "t=2 prompt" in text and "t=2 output" in text and "9.0" not in text
    assert sweep_chart([pg]) is None
    deep = _row(Shape(0, 16, 512), 40.0)
    assert depth_chart([tg, deep, pg, _row(Shape(64, 0, 512), 1.0)]) is not None
    assert depth_chart([pp, _row(Shape(64, 0, 512), 1.0), pg]) is None  # no tg at two depths


@pytest.mark.parametrize("fmt", ["md", "csv", "json", "jsonl", "sql"])
def test_serve_and_interference_cut_before_a_result_end_their_format_as_bench_does(
    fmt: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ctrl-C before the first level (or policy) is done: json's `[]`, the others' nothing, as
    `bench` prints for a run cut with no row; serve's exit code 130."""
    from llmrun.cli.bench.output import OutputFormat
    from llmrun.runners.serving.options import ServeOptions

    cancel = threading.Event()
    cancel.set()
    display = Console(file=io.StringIO())
    options = ServeOptions(
        concurrency=(1,),
        request_rate=float("inf"),
        num_prompts=1,
        input_len=8,
        output_len=4,
        range_ratio=0.0,
        warmup=0,
        percentiles=(50.0,),
    )
    code = serve._report(
        [],
        options,
        serving.Screen(display, display, cancel),
        serve.Delivery(OutputFormat(fmt), compare=False, store=False),
        name="",
        endpoint="local",
    )
    served = capsys.readouterr().out
    interference._print([], OutputFormat(fmt))
    assert code == 130
    assert served == capsys.readouterr().out == ("[]\n" if fmt == "json" else "")


def test_a_finished_batch_of_records_is_written_as_bench_streams_them() -> None:
    """`bench serve`/`interference`'s records: csv's header and sql's table have every row's
    fields (one only a later row has too), md is a plain table of the command's columns (or of
    each row's own, a header again where they change), json the same objects."""
    import csv
    import json
    import sqlite3

    from llmrun.cli.bench.output import OutputFormat, format_records

    rows: list[dict[str, Any]] = [
        {"test": "c=1", "rate": 1.5, "errors": []},
        {"test": "c=4", "rate": None, "errors": ["boom"], "policy": "chunked:64"},
    ]
    head = next(csv.reader(io.StringIO(format_records(rows, OutputFormat.csv))))
    assert head == ["test", "rate", "errors", "policy"]
    db = sqlite3.connect(":memory:")
    db.executescript(format_records(rows, OutputFormat.sql, table="llmrun_serving"))
    assert db.execute("SELECT test, rate, policy FROM llmrun_serving").fetchall() == [
        ("c=1", 1.5, None),
        ("c=4", None, "chunked:64"),
    ]
    assert json.loads(format_records(rows, OutputFormat.json)) == rows
    md = format_records(rows, OutputFormat.md, md_columns=("test", "rate"))
    assert md == "| test | rate |\n| --- | --- |\n| c=1 | 1.50 |\n| c=4 | - |\n"
    own = format_records(rows, OutputFormat.md, md_columns=()).splitlines()
    assert [line for line in own if line.startswith("| test")] == [
        "| test | rate | errors |",
        "| test | rate | errors | policy |",
    ]
    assert own[-1] == "| c=4 | - | ['boom'] | chunked:64 |"


def test_the_defaults_table_fills_every_swept_setting() -> None:
    """One table declares bench's lists (as llama-bench's cmd_params_defaults): each row names
    a Sweep field or a test shape, and every list the Sweep takes has its row."""
    from dataclasses import fields

    from llmrun.cli.bench import sweep_options
    from llmrun.runners.bench import run

    single = {f.name for f in fields(sweep_options.Measured)}  # one value each, not swept
    lists = {f.name for f in fields(run.Sweep) if f.type in ("str", "str | None")} - single
    rows = {o.name for o in sweep_options.LISTS if not o.shape}
    assert rows == lists
    shapes = [o.name for o in sweep_options.LISTS if o.shape]
    assert shapes == ["n_prompt", "n_gen", "pg", "depth"]
    swept = sweep_options.SweepLists(**{o.name: None for o in sweep_options.LISTS})
    made = swept.sweep(scenarios=False, scenario_scale=1.0, reps=1, seed=1)
    assert (made.cache_type_k, made.threads) == ("f16", None)  # the table's default; the engine's
    assert [(s.n_prompt, s.n_gen) for s in made.shapes] == [(512, 0), (0, 128)]
