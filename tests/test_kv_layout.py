"""One llama.cpp context for `run --parallel`, and the KV layout (-kvu/--kv-unified) of the
batched engine's contexts: chosen on the command line, handed to llama.cpp, read back."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from llmrun.cli.app import app
from llmrun.runners.base import Finished, Request, SamplingParams
from llmrun.runners.config import EngineConfig
from llmrun.runners.contexts import kv_unified_of
from llmrun.runners.library import llama_lib
from llmrun.runners.llamacpp import LlamaCppRunner
from llmrun.runners.serving.batching import BatchedEngine
from llmrun.runners.serving.figures import metrics
from llmrun.runners.serving.load import ServingLevel
from llmrun.runners.serving.parallel import serve_requests

from .test_serve import llmrun_serve


def _requests(n: int, max_tokens: int = 6) -> list[Request]:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [Request(prompt=f"Count to {i}:", sampling=sampling) for i in range(n)]


@pytest.mark.parametrize("unified", [True, False])
def test_a_parallel_run_makes_one_context_for_its_sequences(model_path: str, unified: bool) -> None:
    lib = llama_lib()
    runner = LlamaCppRunner(model_path, EngineConfig(n_ctx=256, kv_unified=unified))
    try:
        requests = _requests(3)
        outcome, _ = serve_requests(runner, requests, n_seq=3)
        loaded = runner.loaded
        assert loaded is not None
        # the weights, then exactly one context: the runner's own, for the three sequences
        assert runner.contexts_made == 1
        ctx = runner.context.ptr
        assert int(lib.llama_n_seq_max(ctx)) == 3
        assert kv_unified_of(lib, ctx) is unified
        need = max(len(runner.request_tokens(r)) for r in requests) + 6 + 8
        assert int(lib.llama_n_ctx(ctx)) >= 3 * need
        n_ctx_seq = int(lib.llama_n_ctx_seq(ctx))
        assert n_ctx_seq == (
            int(lib.llama_n_ctx(ctx)) if unified else int(lib.llama_n_ctx(ctx)) // 3
        )
        for done in outcome:
            assert isinstance(done, Finished) and done.stats.output_tokens == 6
            s = done.stats.settings
            assert s is not None and s.n_ctx == need  # each sequence's, as the engine enforces
            assert (s.n_threads, s.n_threads_batch) == (
                int(lib.llama_n_threads(ctx)),
                int(lib.llama_n_threads_batch(ctx)),
            )
            assert s.params["n_seq_max"] == 3 and s.params["kv_unified"] is unified
            assert done.stats.load_s == loaded.load_s  # the weights and that one context
    finally:
        runner.close()


def test_a_parallel_run_with_c_sizes_each_sequence_by_it(model_path: str) -> None:
    lib = llama_lib()
    runner = LlamaCppRunner(model_path, EngineConfig(n_ctx=96, kv_unified=False))
    try:
        outcome, _ = serve_requests(runner, _requests(2), n_seq=2, n_ctx=96)
        assert runner.contexts_made == 1
        assert int(lib.llama_n_ctx_seq(runner.context.ptr)) >= 96
        assert all(
            isinstance(d, Finished)
            and d.stats.settings is not None
            and d.stats.settings.n_ctx == 96
            for d in outcome
        )
    finally:
        runner.close()


def test_the_engines_own_context_takes_the_runners_layout(runner: LlamaCppRunner) -> None:
    lib = llama_lib()
    for unified in (True, False):
        runner.config = dataclasses.replace(runner.config, kv_unified=unified)
        with BatchedEngine(runner, n_seq=2, n_ctx_per_seq=128, n_batch=64) as engine:
            assert engine.kv_unified is unified
            assert kv_unified_of(lib, engine.ctx.ptr) is unified
        with BatchedEngine(
            runner, n_seq=2, n_ctx_per_seq=128, n_batch=64, kv_unified=not unified
        ) as engine:
            assert engine.kv_unified is not unified  # an explicit choice wins
    runner.config = dataclasses.replace(runner.config, kv_unified=EngineConfig().kv_unified)


def test_run_parallel_hands_the_layout_to_llama_cpp(
    cli: CliRunner, model_path: str, tmp_path: Path
) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Say hi"}\n{"prompt": "Count to five"}\n')
    for flag, unified in (([], False), (["-no-kvu"], False), (["-kvu"], True)):
        result = cli.invoke(
            app,
            [
                "run",
                "--jsonl",
                str(prompts),
                "--parallel",
                "2",
                "-n",
                "3",
                "--temp",
                "0",
                "--json",
                "--no-warmup",
                *flag,
            ],
        )
        assert result.exit_code == 0, result.stderr
        for row in map(json.loads, result.stdout.splitlines()):
            params = row["stats"]["settings"]["params"]
            assert (params["n_seq_max"], params["kv_unified"]) == (2, unified)


def test_kv_unified_refused_where_it_does_not_apply(cli: CliRunner) -> None:
    cases = [
        (["run", "hi", "-kvu"], 2, "-kvu/--kv-unified: the KV layout of several sequences"),
        (["run", "hi", "--no-kv-unified"], 2, "only with --parallel N"),
        (
            ["run", "hi", "--parallel", "2", "--kv-unified", "--endpoint", "http://127.0.0.1:9"],
            2,
            "-kvu/--kv-unified: local-engine options",
        ),
        (
            ["bench", "serve", "--endpoint", "http://127.0.0.1:9", "--no-kv-unified"],
            2,
            "-kvu/--kv-unified: local-engine options",
        ),
        (
            ["bench", "interference", "--endpoint", "http://127.0.0.1:9", "-kvu"],
            2,
            "-kvu/--kv-unified: local-engine options",
        ),
        (["run", "hi", "--parallel", "2", "--kv-unified=0"], 2, "does not take a value"),
        (["serve", "--kv-unified=yes"], 2, "does not take a value"),
        (["bench", "serve", "--no-kv-unified=1"], 2, "does not take a value"),
    ]
    for args, code, says in cases:
        result = cli.invoke(app, args)
        assert result.exit_code == code, (args, result.output)
        err = result.stderr
        assert says in " ".join(err.split()), (args, err)
        assert "Traceback" not in err
        if code == 1:
            assert err.count("\n") == 1, err


def test_a_serving_level_says_its_layout() -> None:
    def level(unified: bool | None) -> ServingLevel:
        return ServingLevel(
            endpoint="local",
            model="m",
            concurrency=2,
            request_rate=float("inf"),
            num_prompts=1,
            input_len=8,
            output_len=4,
            metrics=metrics([], 1.0, percentiles=(50,), slo={}),
            policy="chunked:64",
            n_threads=1,
            n_threads_batch=1,
            background_cpus=0.0,
            kv_unified=unified,
        )

    unified, per_seq, remote = level(True).record(), level(False).record(), level(None).record()
    assert unified["kv_unified"] is True and unified["endpoint"] == "local chunked:64"
    assert per_seq["kv_unified"] is False and per_seq["endpoint"] == "local chunked:64 kv-per-seq"
    assert per_seq["test"].endswith("chunked:64 kv-per-seq")  # history keeps the two apart
    assert "kv_unified" not in remote


def test_bench_serve_records_the_layout_it_measured(cli: CliRunner, model_path: str) -> None:
    for flag, unified in (([], False), (["--kv-unified"], True)):
        result = cli.invoke(
            app,
            [
                "bench",
                "serve",
                "--concurrency",
                "2",
                "--num-prompts",
                "2",
                "--input-len",
                "8",
                "--output-len",
                "3",
                "--policy",
                "chunked:32",
                "-t",
                "1",
                "-o",
                "jsonl",
                "--no-history",
                *flag,
            ],
        )
        assert result.exit_code == 0, result.stderr
        [record] = [json.loads(line) for line in result.stdout.splitlines()]
        assert record["kv_unified"] is unified
        assert record["test"].endswith("kv-per-seq") is not unified


def test_serve_says_its_layout_in_its_ready_line(
    llmrun_env: dict[str, str], model_path: str
) -> None:
    for flag, says in (("--kv-unified", "KV unified"), ("--no-kv-unified", "KV per sequence")):
        with llmrun_serve(llmrun_env, "-np", "2", "--no-dashboard", flag) as server:
            [ready] = [line for line in server.lines if "listening on" in line]
            assert f"2 sequences x 512 tokens, {says}, policy" in ready
