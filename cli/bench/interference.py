"""`llmrun bench --interference` without --endpoint: the seeds' prefill-decode interference,
measured in-process on llama.cpp's multi-sequence batches under each scheduling policy."""

from __future__ import annotations

import random
import sys
import threading
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from llmrun.cli.dashboard import sparkline
from llmrun.cli.engine import make_bench_runner
from llmrun.runners.batched import BatchedEngine, InterferenceReport, Policy, interference
from llmrun.runners.errors import BadRequestError
from llmrun.runners.llamacpp import EngineConfig, LlamaCppRunner

from . import output as out

STREAM_PROMPT = "Tell me a long story about a lighthouse keeper."
MAX_LONG_PROMPTS = 8


def run_local_interference(
    model: str | None,
    *,
    policies: str,
    rate: float,
    prompt_len: int,
    num_prompts: int,
    output_len: int,
    seed: int,
    output: out.OutputFormat | None,
    cancel: threading.Event,
    err: Console,
    show: Console,
    plot: Path | None = None,
) -> int:
    chosen = [Policy.parse(p) for p in policies.split(",") if p.strip()]
    if not chosen:
        raise BadRequestError(
            "--policy: give one or more of prefill-first, chunked:B, decode-first"
        )
    runner = make_bench_runner(model, EngineConfig(n_ctx=512), tuned=False)
    if not isinstance(runner, LlamaCppRunner):
        raise BadRequestError("--interference without --endpoint needs a local model")
    try:
        loaded = runner.load()
        rng = random.Random(seed)
        n_vocab = runner.vocab_size()
        count = min(num_prompts, MAX_LONG_PROMPTS)
        longs = [[rng.randrange(n_vocab) for _ in range(prompt_len)] for _ in range(count)]
        stream = runner.tokenize(
            f"<|im_start|>user\n{STREAM_PROMPT}<|im_end|>\n<|im_start|>assistant\n",
            add_special=False,
        )
        per_seq = max(prompt_len, len(stream) + output_len) + 16
        engine = BatchedEngine(runner, n_seq=count + 1, n_ctx_per_seq=per_seq)
        reports: list[InterferenceReport] = []
        try:
            with err.status("the stream alone ..."):
                reports.append(interference(engine, None, stream=stream, stream_tokens=output_len,
                                            long_prompts=longs, every_s=1 / rate))  # fmt: skip
            for policy in chosen:
                if cancel.is_set():
                    break
                with err.status(f"{policy}: the stream while {count} prompts of {prompt_len}"
                                f" tokens arrive, {rate:g}/s ..."):  # fmt: skip
                    reports.append(interference(engine, policy, stream=stream,
                                                stream_tokens=output_len, long_prompts=longs,
                                                every_s=1 / rate))  # fmt: skip
        finally:
            engine.close()
    finally:
        runner.close()
    records = [_record(r, loaded.model.name if loaded.model else "") for r in reports]
    if output is not None:
        sys.stdout.write(out.format_records(records, output, sql_table="llmrun_interference"))
        sys.stdout.flush()
    else:
        show.print(_table(reports))
        for r in reports:
            show.print(Text.assemble(f"{r.policy:<14} ", (sparkline(list(r.stream_itl_ms)),
                                                          "magenta")))  # fmt: skip
    for line in verdict(reports):
        err.print(line, markup=False)
    if plot is not None and reports:
        from .plot import plot_timeline

        plot_timeline(reports, plot)
        err.print(f"timeline written to {plot}", markup=False)
    return 130 if cancel.is_set() else 0


def _record(r: InterferenceReport, model: str) -> dict[str, Any]:
    prefill_steps = [s for s in r.steps if s.n_prefill]
    return {
        "model": model, "policy": r.policy, "stream_tokens": len(r.stream_itl_ms) + 1,
        "itl_p50_ms": _round(r.itl(50)), "itl_p99_ms": _round(r.itl(99)),
        "itl_max_ms": _round(max(r.stream_itl_ms, default=0.0)),
        "long_ttft_mean_ms": _round(sum(r.long_ttft_ms) / len(r.long_ttft_ms))
        if r.long_ttft_ms else None,
        "throughput_tps": round(r.throughput_tps, 3), "steps": len(r.steps),
        "max_prefill_tokens_per_step": max((s.n_prefill for s in r.steps), default=0),
        "mixed_steps": sum(1 for s in prefill_steps if s.n_decode),
        "prefill_ms": round(r.prefill_ms, 3), "prefill_in_stream_gaps_ms": round(
            r.prefill_in_gaps_ms, 3),
    }  # fmt: skip


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def _table(reports: list[InterferenceReport]) -> Table:
    table = Table(title="a decoding stream while long prompts arrive", title_justify="left")
    for col in ("policy", "ITL p50 ms", "ITL p99 ms", "ITL max ms", "long TTFT ms", "tok/s",
                "steps", "prefill in gaps"):  # fmt: skip
        table.add_column(col, justify="left" if col == "policy" else "right")
    for r in reports:
        ttft = sum(r.long_ttft_ms) / len(r.long_ttft_ms) if r.long_ttft_ms else None
        table.add_row(r.policy, out.cell(r.itl(50)), out.cell(r.itl(99)),
                      out.cell(max(r.stream_itl_ms, default=0.0)), out.cell(ttft),
                      f"{r.throughput_tps:,.1f}", str(len(r.steps)),
                      f"{r.prefill_in_gaps_ms:,.0f} of {r.prefill_ms:,.0f} ms")  # fmt: skip
    return table


def verdict(reports: list[InterferenceReport]) -> list[str]:
    """The seeds' claim, as measured: does chunking lower the stream's p99 gap against
    prefill-first, and what does it cost in the long prompts' TTFT and in throughput?"""
    by = {r.policy: r for r in reports}
    whole = by.get("prefill-first")
    lines = []
    for r in reports:
        if not r.policy.startswith("chunked") or whole is None:
            continue
        p99, base = r.itl(99), whole.itl(99)
        if p99 is None or base is None:
            continue
        ttft = sum(r.long_ttft_ms) / max(len(r.long_ttft_ms), 1)
        base_ttft = sum(whole.long_ttft_ms) / max(len(whole.long_ttft_ms), 1)
        lines.append(
            f"{r.policy} against prefill-first: the stream's ITL p99 {p99:,.1f} against"
            f" {base:,.1f} ms (x{p99 / base:.2f}); the long prompts' TTFT {ttft:,.0f} against"
            f" {base_ttft:,.0f} ms (x{ttft / base_ttft if base_ttft else 0:.2f}); throughput"
            f" {r.throughput_tps:,.1f} against {whole.throughput_tps:,.1f} tok/s"
        )
    return lines


def run_local_serving(
    model: str | None,
    *,
    policies: str,
    concurrency: str,
    request_rate: str,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    percentiles: str,
    slo: str | None,
    seed: int,
    output: out.OutputFormat | None,
    compare: bool,
    store: bool,
    cancel: threading.Event,
    err: Console,
    show: Console,
) -> int:
    """The serving benchmark (vLLM's metrics) on this machine's engine, for every concurrency
    level and policy: the same records and tables as against a server."""
    from llmrun.runners.batched import serve
    from llmrun.runners.bench.sweep import parse_values
    from llmrun.runners.serving import load as sv

    from .serve import (
        parse_percentiles,
        parse_rate,
        parse_slo,
        serving_markdown,
        serving_table,
    )

    levels = parse_values(concurrency, name="--concurrency")
    if any(c < 1 for c in levels):
        raise BadRequestError("--concurrency values must be at least 1")
    rate, pcts, slos = parse_rate(request_rate), parse_percentiles(percentiles), parse_slo(slo)
    chosen = [Policy.parse(p) for p in policies.split(",") if p.strip()]
    runner = make_bench_runner(model, EngineConfig(n_ctx=512), tuned=False)
    if not isinstance(runner, LlamaCppRunner):
        raise BadRequestError("the local serving benchmark needs a local model")
    done: list[sv.ServingLevel] = []
    try:
        loaded = runner.load()
        name = loaded.model.name if loaded.model else ""
        rng = random.Random(seed)
        n_vocab = runner.vocab_size()

        def length(mean: int) -> int:
            low = max(1, round(mean * (1 - range_ratio)))
            return rng.randint(low, max(low, round(mean * (1 + range_ratio))))

        prompts = [(tuple(rng.randrange(n_vocab) for _ in range(length(input_len))),
                    length(output_len)) for _ in range(num_prompts)]  # fmt: skip
        per_seq = max(len(p) + n for p, n in prompts) + 8
        for level in levels:
            engine = BatchedEngine(runner, n_seq=level, n_ctx_per_seq=per_seq)
            try:
                for policy in chosen:
                    if cancel.is_set():
                        break
                    with err.status(f"local engine, {policy}, concurrency {level}:"
                                    f" {num_prompts} requests ..."):  # fmt: skip
                        results, duration = serve(engine, policy, prompts, request_rate=rate,
                                                  seed=seed, cancel=cancel)  # fmt: skip
                    measured = [sv.RequestResult(
                        input_tokens=r.prompt_tokens, output_tokens=len(r.output),
                        ttft_s=r.ttft_s, latency_s=r.e2e_s or 0.0, itl_s=r.gaps_s,
                        error=None if r.times else "cancelled",
                    ) for r in results]  # fmt: skip
                    done.append(sv.ServingLevel(
                        endpoint=f"local {policy}", model=name, concurrency=level,
                        request_rate=rate, num_prompts=num_prompts, input_len=input_len,
                        output_len=output_len,
                        metrics=sv.metrics(measured, duration, percentiles=pcts, slo=slos),
                        interrupted=cancel.is_set(),
                    ))  # fmt: skip
            finally:
                engine.close()
    finally:
        runner.close()
    records = [{**r.record(), "policy": r.policy} for r in done]
    changes = out.store_and_print(
        records, kind="serving", model=name, system={"endpoint": "local"}, output=output,
        show=show, table=serving_table(done, pcts), store=store, compare=compare,
        markdown=lambda: serving_markdown(done, None), sql_table="llmrun_serving",
    )  # fmt: skip
    if changes is not None:
        show.print(out.compare_table(changes))
    return 130 if cancel.is_set() else 0
