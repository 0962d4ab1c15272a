"""A busy machine and the threads llama.cpp gets: -t/-tb reach every engine (read back from
llama.cpp's contexts), every measurement records other processes' load and says when it was
busy, run and chat take the free cores, and the warnings name what would help.

Other processes' load is injected through runners/system.background_override (every
measurement reads it through measured_background, background_now or BackgroundMeter), in the
processes a test starts through tests/inject/sitecustomize.py, so no test loads the CPU to make
it busy. llmrun itself reads no variable for it.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner

from llmrun.cli import engine
from llmrun.cli.app import app
from llmrun.cli.bench.interference import verdict
from llmrun.runners import system
from llmrun.runners.base import Finished, Request, SamplingParams
from llmrun.runners.config import EngineConfig
from llmrun.runners.llamacpp import LlamaCppRunner
from llmrun.runners.serving.interference import InterferenceReport
from llmrun.runners.serving.load import ServingLevel
from llmrun.runners.serving.local import interfere_local, serve_local
from llmrun.runners.serving.options import InterferenceOptions, ServeOptions
from llmrun.runners.serving.parallel import serve_requests
from llmrun.runners.serving.policy import Policy
from llmrun.runners.system import (
    BackgroundMeter,
    CpuSample,
    background_cpus,
    background_now,
    busy_advice,
    default_threads,
    logical_cpus,
    measured_background,
)

from .conftest import BACKGROUND_ENV, HANG_S, INJECT, which_llmrun
from .fake import FakeRunner

# Other processes holding all but half a CPU: busy whatever the thread count, and the cores
# left free round to one.
BUSY = logical_cpus() - 0.5


def several_cores(test: Callable[..., None]) -> Callable[..., None]:
    """Two CPUs or more: `cores`, which `make test` runs with the whole machine."""
    test = pytest.mark.skipif(default_threads() < 2, reason="one core: nothing to take")(test)
    return pytest.mark.usefixtures("every_core")(test)


def busy(monkeypatch: pytest.MonkeyPatch, cpus: float = BUSY) -> None:
    """Other processes' load as `cpus`, in this process and in those the test starts."""
    monkeypatch.setattr(system, "background_override", cpus)
    monkeypatch.setenv(BACKGROUND_ENV, str(cpus))


def test_the_advice_names_the_threads_that_would_help_with_figures() -> None:
    advice = busy_advice(1.5, 2, logical=2)
    assert advice.startswith("try -t 1 (0.5 of 2 CPUs were free for 2 threads)")
    assert advice.endswith("running when the machine is quiet")
    assert "-t" not in busy_advice(1.5, 1, logical=2)  # one thread already: nothing fewer
    assert "--poll 0" in busy_advice(1.5, 1, logical=2, poll=True)
    assert "-t 4 (4.0 of 16" in busy_advice(12.0, 8, logical=16)


def test_a_faked_load_stands_for_other_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = CpuSample(0.0, 100.0, 10.0), CpuSample(1.0, 102.0, 10.5)
    busy(monkeypatch, 1.25)
    assert measured_background(a, b) == 1.25
    assert measured_background(None, None) == 1.25
    assert background_now() == 1.25
    assert BackgroundMeter(window_s=60).read() == 1.25
    assert background_cpus(a, b) == 1.5  # the measurement itself is never faked
    monkeypatch.setattr(system, "background_override", None)  # llmrun's own: it measures
    monkeypatch.setenv("LLMRUN_FAKE_BACKGROUND_CPUS", "1.25")  # the old test hook: no effect
    assert measured_background(a, b) == 1.5 and measured_background(None, None) is None
    assert BackgroundMeter(window_s=60).read() is None  # no window has ended yet


def doctor_load(env: dict[str, str]) -> str:
    """`llmrun doctor`'s load row: a child llmrun's look at other processes' load."""
    done = subprocess.run(
        [which_llmrun(), "doctor"],
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_S,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stderr
    return next(x for x in done.stdout.splitlines() if x.startswith("load "))


def test_a_child_llmrun_takes_the_tests_figure_and_no_variable_of_its_own(
    llmrun_env: dict[str, str],
) -> None:
    """The tests' figure reaches a child through tests/inject alone; the variable llmrun once
    read as a test hook (anyone could set it and get a falsely quiet or busy report) is ignored."""
    assert f"busy: other processes use 1.5 of {logical_cpus()}" in doctor_load(
        {**llmrun_env, BACKGROUND_ENV: "1.5"}
    )
    plain = {k: v for k, v in llmrun_env.items() if k != BACKGROUND_ENV}  # as a user's shell
    plain["PYTHONPATH"] = os.pathsep.join(
        p for p in llmrun_env["PYTHONPATH"].split(os.pathsep) if p != str(INJECT)
    )
    row = doctor_load({**plain, "LLMRUN_FAKE_BACKGROUND_CPUS": "12345"})
    measured = float(row.split("other processes use ")[1].split()[0])  # the machine's, measured
    # the whole machine's load, whatever share of it this process may use
    assert measured != 12345 and 0 <= measured <= (os.cpu_count() or 1) + 1, row


@several_cores
def test_run_and_chat_take_the_free_cores_and_say_so(
    cli: CliRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    configs: list[EngineConfig] = []

    def factory(model: str | None, config: EngineConfig) -> FakeRunner:
        configs.append(config)
        return FakeRunner()

    monkeypatch.setattr(engine, "RUNNER_FACTORY", factory)
    busy(monkeypatch)
    result = cli.invoke(app, ["run", "hello"])
    assert result.exit_code == 0, result.stderr
    assert configs[-1].n_threads == 1
    line = f"llmrun: threads 1 of {default_threads()}: other processes keep {BUSY:.1f} of"
    assert [x for x in result.stderr.splitlines() if x.startswith("llmrun: threads")] == [
        next(x for x in result.stderr.splitlines() if x.startswith(line))
    ]
    assert f"-t {default_threads()} to use every core anyway" in result.stderr
    result = cli.invoke(app, ["chat"], input="hi\n")
    assert result.exit_code == 0, result.stderr
    assert configs[-1].n_threads == 1 and line in result.stderr

    result = cli.invoke(app, ["run", "hello", "-t", "2"])  # asked: kept
    assert configs[-1].n_threads == 2 and "llmrun: threads" not in result.stderr
    result = cli.invoke(app, ["run", "hello", "-q"])  # quiet: the stats say it, not a line
    assert configs[-1].n_threads == 1 and "llmrun: threads" not in result.stderr
    busy(monkeypatch, 0.0)
    result = cli.invoke(app, ["run", "hello"])
    assert configs[-1].n_threads is None and "llmrun: threads" not in result.stderr


def test_threads_apply_only_to_the_local_engine(cli: CliRunner) -> None:
    for job in (["bench", "serve"], ["bench", "interference"]):
        result = cli.invoke(app, [*job, "--endpoint", "http://127.0.0.1:9", "-t", "1"])
        assert result.exit_code == 2 and "-t/--threads: local-engine options" in result.stderr


@pytest.mark.usefixtures("every_core")  # llama.cpp on two threads
def test_the_batched_engines_run_with_the_threads_asked_and_record_the_load(
    model_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The serving lab, the interference lab and run --parallel: the threads llama.cpp's
    contexts report are the ones asked, and each result says how busy the machine was."""
    cancel = threading.Event()
    serve_opts = ServeOptions(
        concurrency=(1,),
        request_rate=float("inf"),
        num_prompts=2,
        input_len=8,
        output_len=3,
        range_ratio=0.0,
        warmup=0,
        percentiles=(50.0,),
        slo={},
        seed=1,
        policies=(Policy.parse("chunked:16"),),
    )
    lab_opts = InterferenceOptions(
        rate=50.0,
        prompt_len=16,
        output_len=4,
        seed=1,
        input_len=8,
        num_prompts=1,
        policies=(Policy.parse("chunked:8"),),
    )
    requests = [Request(prompt="One two", sampling=SamplingParams(max_tokens=3, temperature=0))]
    runner = LlamaCppRunner(model_path, EngineConfig(n_ctx=512, n_threads=1, n_threads_batch=2))
    try:
        for threads, load in (((1, 2), BUSY), ((2, 1), 0.0)):
            runner.reconfigure(
                EngineConfig(n_ctx=512, n_threads=threads[0], n_threads_batch=threads[1])
            )
            busy(monkeypatch, load)
            [level] = [
                x
                for x in serve_local(runner, serve_opts, cancel=cancel)
                if isinstance(x, ServingLevel)
            ]
            rec = level.record()
            assert (rec["n_threads"], rec["n_threads_batch"]) == threads
            assert rec["background_cpus"] == round(load, 3) and rec["busy"] is (load > 0)
            reports = [
                x
                for x in interfere_local(runner, lab_opts, cancel=cancel)
                if isinstance(x, InterferenceReport)
            ]
            assert [r.policy for r in reports] == ["alone", "chunked:8"]
            for r in reports:
                assert (r.n_threads, r.n_threads_batch) == threads
                assert r.background_cpus == load and r.busy is (load > 0)
            [done], _ = serve_requests(runner, requests, n_seq=2)
            assert isinstance(done, Finished)
            stats = done.stats
            assert stats.settings is not None
            assert (stats.settings.n_threads, stats.settings.n_threads_batch) == threads
            assert stats.background_cpus == load
    finally:
        runner.close()


@several_cores
def test_bench_serve_and_interference_take_t_and_a_busy_run_is_not_clean(
    cli: CliRunner, model_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    busy(monkeypatch)
    result = cli.invoke(
        app,
        [
            "bench",
            "serve",
            "--concurrency",
            "1",
            "--num-prompts",
            "2",
            "--input-len",
            "8",
            "--output-len",
            "3",
            "--policy",
            "chunked:16",
            "-o",
            "json",
            "--no-history",
        ],
    )
    assert result.exit_code == 0, result.stderr
    [row] = json.loads(result.stdout)
    assert row["n_threads"] == default_threads() and row["busy"] is True
    err = " ".join(result.stderr.split())
    assert f"kept up to {BUSY:.1f} of {logical_cpus()} CPUs busy during 1 of 1 tests" in err
    assert "try -t 1 (0.5 of" in err and "running when the machine is quiet" in err

    result = cli.invoke(
        app,
        [
            "bench",
            "interference",
            "-t",
            "1",
            "-tb",
            "2",
            "--num-prompts",
            "1",
            "--prompt-len",
            "16",
            "--output-len",
            "4",
            "--rate",
            "50",
            "--policy",
            "prefill-first,chunked:8",
            "-o",
            "json",
        ],
    )
    assert result.exit_code == 0, result.stderr
    rows = json.loads(result.stdout)
    assert [(r["n_threads"], r["n_threads_batch"], r["busy"]) for r in rows] == [(1, 2, True)] * 3
    err = " ".join(result.stderr.split())
    assert "busy during alone, prefill-first, chunked:8" in err
    assert "chunked:8 against prefill-first" in err and "not a clean result" in err


def test_the_interference_verdict_stands_alone_only_on_a_quiet_machine() -> None:
    def report(policy: str, itl_ms: float, background: float) -> InterferenceReport:
        return InterferenceReport(
            policy,
            (itl_ms,) * 4,
            (50.0,),
            (),
            100.0,
            n_threads=2,
            n_threads_batch=2,
            background_cpus=background,
        )

    quiet = verdict([report("prefill-first", 10.0, 0.0), report("chunked:8", 5.0, 0.0)])
    assert len(quiet) == 1 and quiet[0].startswith("chunked:8 against prefill-first")
    assert "busy" not in quiet[0]
    loaded = verdict([report("prefill-first", 10.0, 0.0), report("chunked:8", 5.0, BUSY)])
    assert loaded[0].startswith(f"llmrun: warning: other processes kept up to {BUSY:.1f}")
    assert "busy during chunked:8 (2 threads" in loaded[0]
    assert loaded[1].endswith("(on a busy machine: not a clean result)")


@several_cores
def test_run_parallel_reads_back_its_threads_and_warns_when_busy(
    cli: CliRunner, model_path: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Say hi"}\n{"prompt": "Count to five"}\n')
    busy(monkeypatch)
    result = cli.invoke(
        app,
        [
            "run",
            "--jsonl",
            str(prompts),
            "--parallel",
            "2",
            "-t",
            "2",
            "-tb",
            "1",
            "-n",
            "3",
            "--temp",
            "0",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    for r in rows:
        settings = r["stats"]["settings"]
        assert (settings["n_threads"], settings["n_threads_batch"]) == (2, 1)
        assert r["stats"]["background_cpus"] == BUSY
    err = " ".join(result.stderr.split())
    assert err.count("CPUs busy during this run") == 2  # each summary's warning row
    assert err.count("try -t 1 (0.5 of") == 2  # -t 2 was asked: what would help


@several_cores
def test_bench_keeps_its_threads_and_its_warning_says_what_would_help(
    cli: CliRunner, model_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    busy(monkeypatch)
    result = cli.invoke(
        app, ["bench", "-r", "1", "-p", "8", "-n", "0", "-o", "json", "--no-history"]
    )
    assert result.exit_code == 0, result.stderr
    [row] = json.loads(result.stdout)
    assert row["n_threads"] == default_threads() and row["busy"] is True  # kept, not reduced
    err = " ".join(result.stderr.split())
    assert f"busy during 1 of 1 tests ({default_threads()} threads for llama.cpp)" in err
    assert "try -t 1" in err and "--poll 0 (waiting threads sleep" in err  # it spun at 50


def test_the_servers_metrics_say_whether_the_machine_is_busy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from llmrun.runners.serving.api_metrics import ServerMetrics

    def gauges() -> dict[str, float]:
        metrics = ServerMetrics(running=lambda: 0, queued=lambda: 0)
        metrics.threads = (2, 1)
        lines = metrics.text().decode().splitlines()
        return {
            n: float(v)
            for n, v in (x.split() for x in lines if not x.startswith("#"))
            if n.startswith(("llmrun_engine", "llmrun_background", "llmrun_machine"))
        }

    busy(monkeypatch)
    assert gauges() == {
        "llmrun_engine_threads": 2,
        "llmrun_engine_threads_batch": 1,
        "llmrun_background_cpus": BUSY,
        "llmrun_machine_busy": 1,
    }
    busy(monkeypatch, 0.0)
    assert gauges()["llmrun_machine_busy"] == 0


def test_a_request_the_interrupt_cut_counts_as_cancelled_not_as_finished() -> None:
    """An interrupted local level keeps its requests, but one cut mid-decode is no finished
    request with a short output: its throughput and E2E would flatter the level."""
    from llmrun.runners.serving.batching import FINISH_CANCELLED, FINISH_LENGTH, SeqResult
    from llmrun.runners.serving.local import request_result

    done = SeqResult(0.0, 8, output=[1, 2], times=[0.1, 0.2], started_s=0.0, finish=FINISH_LENGTH)
    cut = SeqResult(0.0, 8, output=[1], times=[0.1], started_s=0.0, finish=FINISH_CANCELLED)
    never = SeqResult(0.0, 8, finish=FINISH_CANCELLED)
    assert request_result(done).error is None
    assert request_result(cut).error == "cancelled"
    assert request_result(never).error == "cancelled"
