"""Several sequences in one context: isolation, equivalence, each policy's batches, the CLI."""

from __future__ import annotations

import json
import random
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmrun.runners.base import Request, SamplingParams, Token
from llmrun.runners.config import EngineConfig
from llmrun.runners.errors import BadRequestError
from llmrun.runners.llamacpp import LlamaCppRunner
from llmrun.runners.serving.batching import Arrival, BatchedEngine
from llmrun.runners.serving.policy import Policy

from .conftest import HANG_S, which_llmrun
from .greedy import NEAR_TIE, margin_at_divergence
from .test_bench import parse

POLICIES = ["prefill-first", "chunked:32", "decode-first", "decode-first:4"]
# the runner, its batched engine, one chat prompt's tokens and two long random prompts
Setup = tuple[LlamaCppRunner, BatchedEngine, tuple[int, ...], list[tuple[int, ...]]]


@pytest.fixture(scope="module")
def setup(model_path: str) -> Iterator[Setup]:
    runner = LlamaCppRunner(model_path, EngineConfig(n_ctx=1024))
    engine = BatchedEngine(runner, n_seq=3, n_ctx_per_seq=512, n_batch=256)
    stream = runner.tokenize(
        "<|im_start|>user\nList the numbers from 1 to 30.<|im_end|>\n<|im_start|>assistant\n",
        add_special=False,
    )
    rng = random.Random(3)
    longs = [tuple(rng.randrange(49152) for _ in range(100)) for _ in range(2)]
    yield runner, engine, tuple(stream), longs
    engine.close()
    runner.close()


def alone(engine: BatchedEngine, stream: tuple[int, ...]) -> list[int]:
    results, _ = engine.run([Arrival(0.0, stream, 40)], Policy("chunked", 256))
    return results[0].output


@pytest.fixture(scope="module")
def solos(setup: Setup) -> tuple[list[int], list[list[int]]]:
    """Each prompt served alone, once for every policy: the chat prompt's 40 tokens and the
    long prompts' 6 (greedy: the same output whenever it is asked)."""
    _, engine, stream, longs = setup
    plain = [engine.run([Arrival(0.0, p, 6)], Policy("chunked", 256))[0][0].output for p in longs]
    return alone(engine, stream), plain


@pytest.mark.parametrize("policy", POLICIES)
def test_each_sequence_gets_its_solo_output_whatever_the_policy(
    setup: Setup, solos: tuple[list[int], list[list[int]]], policy: str
) -> None:
    runner, engine, stream, longs = setup
    solo, plains = solos
    arrivals = [
        Arrival(0.0, stream, 40),
        *(Arrival(0.02 * (i + 1), p, 6) for i, p in enumerate(longs)),
    ]
    results, steps = engine.run(arrivals, Policy.parse(policy))
    together = results[0].output
    assert len(together) == 40 and all(len(r.output) == 6 for r in results[1:])
    assert margin_at_divergence(runner, list(stream), solo, together) < NEAR_TIE
    for r, p, plain in zip(results[1:], longs, plains, strict=True):  # the long prompts too
        assert margin_at_divergence(runner, list(p), plain, r.output) < NEAR_TIE
    budget = {"prefill-first": 256, "chunked:32": 32, "decode-first": 256, "decode-first:4": 256}[
        policy
    ]
    assert max(s.n_decode + s.n_prefill for s in steps) <= budget
    mixed = [s for s in steps if s.n_prefill and s.n_decode]
    if policy in ("chunked:32", "decode-first:4"):
        assert mixed  # decodes ride along with prefill chunks
    else:
        assert not mixed  # a prompt alone in its steps


def test_negative_control_another_prompt_in_view_changes_the_output(
    setup: Setup, solos: tuple[list[int], list[list[int]]]
) -> None:
    """What a leak between sequences would look like: the stream's own prompt with another
    prompt's tokens in front of it gives a different text, far from any near-tie, so the
    equivalence above would catch a sequence seeing another's KV entries."""
    runner, engine, stream, longs = setup
    solo, _ = solos
    seen, _ = engine.run([Arrival(0.0, longs[0] + stream, 40)], Policy("chunked", 256))
    assert margin_at_divergence(runner, list(stream), solo, seen[0].output) >= NEAR_TIE


def test_three_sequences_give_the_runners_own_greedy_output(setup: Setup) -> None:
    """The engine's greedy pick (one argmax over every sequence's logits) against the runner's
    plain decode with llama.cpp's greedy sampler, for one sequence among three."""
    runner, engine, stream, longs = setup
    sampling = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    plain = [
        e.token_id
        for e in runner.stream(Request(token_ids=stream, sampling=sampling, keep_cache=False))
        if isinstance(e, Token)
    ]
    results, _ = engine.run(
        [
            Arrival(0.0, stream, 40, ignore_eos=True),
            *(Arrival(0.0, p, 40, ignore_eos=True) for p in longs),
        ],
        Policy("chunked", 256),
    )
    assert len(plain) == 40 and len(results[0].output) == 40
    assert margin_at_divergence(runner, list(stream), plain, results[0].output) < NEAR_TIE


def test_the_runner_closes_a_batched_context_before_its_model(model_path: str) -> None:
    runner = LlamaCppRunner(model_path, EngineConfig(n_ctx=256))
    engine = BatchedEngine(runner, n_seq=2, n_ctx_per_seq=128, n_batch=64)
    sampling = SamplingParams(max_tokens=4, temperature=0.7, seed=7, ignore_eos=True)
    results, _ = engine.run(
        [
            Arrival(0.0, (1, 2, 3), 4, ignore_eos=True, sampling=sampling),
            Arrival(0.0, (4, 5, 6), 4, ignore_eos=True),
        ],
        Policy("chunked", 64),
    )
    assert [len(r.output) for r in results] == [4, 4]
    chain = engine.new_chain(sampling, 7, prompt=[1, 2, 3])
    runner.close()  # the engine's context goes first, while the weights are still loaded
    assert engine.ctx.ptr is None and engine.batch.struct is not None
    engine.close()
    engine.close()  # again: nothing left to free
    assert engine.batch.struct is None
    chain.close()
    chain.close()
    assert chain.ptr is None


def test_policies_parse() -> None:
    assert str(Policy.parse("chunked:64")) == "chunked:64"
    assert str(Policy.parse("decode-first:8")) == "decode-first:8"
    for bad in ("chunked", "chunked:x", "fastest", "prefill-first:3"):
        with pytest.raises(BadRequestError):
            Policy.parse(bad)


def test_bench_measures_interference_locally(llmrun_env: dict[str, str], tmp_path: Path) -> None:
    png = tmp_path / "timeline.png"
    done = subprocess.run(
        [
            which_llmrun(),
            "bench",
            "interference",
            "--policy",
            "prefill-first,chunked:32",
            "--num-prompts",
            "2",
            "--prompt-len",
            "64",  # two chunks of 32
            "--rate",
            "10",
            "--output-len",
            "24",
            "-o",
            "json",
            "--plot",
            str(png),
        ],
        env=llmrun_env,
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    assert [r["policy"] for r in rows] == ["alone", "prefill-first", "chunked:32"]
    assert all(r["stream_tokens"] == 24 and r["itl_p99_ms"] > 0 for r in rows)
    assert rows[2]["max_prefill_tokens_per_step"] <= 32 and rows[1]["mixed_steps"] == 0
    assert 0 <= rows[1]["prefill_in_stream_gaps_ms"] <= rows[1]["prefill_ms"]
    assert rows[0]["prefill_in_stream_gaps_ms"] == 0  # alone: no prompt lands mid-stream
    assert "chunked:32 against prefill-first: the stream's ITL p99" in done.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the timeline


def test_interference_piped_without_o_prints_its_records_as_md(llmrun_env: dict[str, str]) -> None:
    """No -o and stdout no terminal: the local lab's records on stdout as md, as against a
    server and as every bench command; its table and verdict are display, on stderr."""
    done = subprocess.run(
        [
            which_llmrun(),
            "bench",
            "interference",
            "--policy",
            "chunked:32",
            "--num-prompts",
            "1",
            "--prompt-len",
            "32",
            "--rate",
            "10",
            "--output-len",
            "8",
        ],
        env=llmrun_env,
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert done.returncode == 0, done.stderr
    rows = parse("md", done.stdout)
    assert [r["policy"] for r in rows] == ["alone", "chunked:32"]
    assert all(r["stream_tokens"] == "8" for r in rows)
    assert "a decoding stream while long prompts arrive" in done.stderr


def test_the_serving_benchmark_runs_on_the_local_engine(llmrun_env: dict[str, str]) -> None:
    done = subprocess.run(
        [
            which_llmrun(),
            "bench",
            "serve",
            "--concurrency",
            "1,2",
            "--num-prompts",
            "3",
            "--input-len",
            "16",
            "--output-len",
            "4",
            "--policy",
            "chunked:32",
            "-o",
            "json",
            "--no-history",
        ],
        env=llmrun_env,
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    assert [(r["concurrency"], r["policy"]) for r in rows] == [(1, "chunked:32"), (2, "chunked:32")]
    for r in rows:
        assert (r["completed"], r["failed"], r["total_output_tokens"]) == (3, 0, 12)
        assert (
            r["mean_ttft_ms"] > 0
            and r["p99_itl_ms"] > 0
            and r["test"].endswith("chunked:32" + (" kv-per-seq" if r["concurrency"] > 1 else ""))
        )


def test_run_serves_a_jsonl_batch_in_parallel(llmrun_env: dict[str, str], tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        '{"prompt": "Say hi"}\n{"prompt": "Count to five"}\n'
        '{"messages": [{"role": "user", "content": "Name a color"}]}\n'
    )
    done = subprocess.run(
        [
            which_llmrun(),
            "run",
            "--jsonl",
            str(prompts),
            "--parallel",
            "3",
            "-n",
            "12",
            "--temp",
            "0",
            "--json",
            "--stats",
            "json",
        ],
        env=llmrun_env,
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert [r["id"].rsplit(":", 1)[-1] for r in rows] == ["1", "2", "3"]
    assert all(r["text"] and r["stats"]["output_tokens"] <= 12 for r in rows)
    assert "parallel 3: 3 requests in" in done.stderr
    refused = subprocess.run(
        [which_llmrun(), "run", "hi", "--parallel", "2", "--endpoint", "http://127.0.0.1:9"],
        env=llmrun_env,
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert refused.returncode == 2 and "--parallel" in refused.stderr  # does not apply: usage


def test_a_parallel_run_gives_each_request_its_events_in_order_and_fails_one_alone() -> None:
    """run --parallel's interface: per request, in order, its text as one Token (at its first
    token's time) then its Finished; a request that failed alone raises when its turn comes,
    and the ones after it still come."""
    from llmrun.runners.base import Finished
    from llmrun.runners.serving.parallel import NotStartedError, ParallelRun
    from llmrun.runners.stats import GenerationStats

    stats = GenerationStats(
        finish_reason="length",
        prompt_tokens=4,
        reused_tokens=0,
        output_tokens=3,
        template_tokenize_s=0.0,
        prefill_s=0.1,
        first_sample_s=0.0,
        itl_s=(0.01, 0.01),
        e2e_s=0.3,
        load_s=0.1,
        first_token_s=0.25,
    )
    held = Finished(stats, "hello world", tail="ld")
    empty = Finished(stats, "")
    run = ParallelRun((held, NotStartedError(), empty), seconds=1.0, interrupted=True)
    first, second, third = run.events()
    assert list(first) == [Token(0, "hello wor", 0.25), held]  # the tail comes with Finished
    with pytest.raises(NotStartedError):
        list(second)
    assert list(third) == [empty]
