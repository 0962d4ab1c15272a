"""`llmrun bench --endpoint URL`: serving load with vLLM's metrics, and prefill interference."""

from __future__ import annotations

import math
import threading
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from llmrun.cli.errors import EXIT_INTERRUPTED
from llmrun.runners.bench.sweep import parse_values
from llmrun.runners.errors import BadRequestError

from . import output as out

if TYPE_CHECKING:
    from llmrun.runners.serving import load as sv

METRICS = ("ttft", "tpot", "itl", "e2el")


def parse_rate(text: str) -> float:
    try:
        rate = float(text)
    except ValueError:
        raise BadRequestError(f"--request-rate: '{text}' is not a number or inf") from None
    if rate <= 0:
        raise BadRequestError("--request-rate must be above 0 (inf: all requests at once)")
    return rate


def serving_table(levels: list[sv.ServingLevel], percentiles: list[float]) -> Table:
    table = Table(title="serving benchmark (vLLM's definitions)", title_justify="left")
    table.add_column("metric")
    records = [level.record() for level in levels]
    for level in levels:
        policy = f" {level.policy}" if level.policy else ""
        table.add_column(f"c={level.concurrency} rate={level.rate_text}{policy}", justify="right")
    rows: list[tuple[str, str]] = [
        ("requests completed / failed", "{completed} / {failed}"),
        ("duration s", "{duration_s:.2f}"),
        ("request throughput req/s", "{request_throughput:.2f}"),
        ("output tokens/s", "{output_throughput:.1f}"),
        ("total tokens/s", "{total_token_throughput:.1f}"),
    ]
    if any(r.get("goodput") is not None for r in records):
        rows.append(("goodput req/s (met --slo)", "{goodput:.2f}"))
    for m in METRICS:
        for stat in ("mean", "median", "std", *(f"p{p:g}" for p in percentiles)):
            rows.append((f"{m.upper()} {stat} ms", f"{{{stat}_{m}_ms:,.1f}}"))
    for label, fmt in rows:
        cells = []
        for r in records:
            try:
                cells.append(fmt.format(**r))
            except (TypeError, ValueError, KeyError):
                cells.append("-")
        table.add_row(label, *cells)
    return table


def parse_percentiles(text: str) -> list[float]:
    """`50,90,99` -> [50.0, 90.0, 99.0]."""
    try:
        values = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise BadRequestError(
            f"--percentiles: '{text}' should be numbers such as 50,90,99"
        ) from None
    if not values or any(not 0 <= v <= 100 for v in values):
        raise BadRequestError("--percentiles: give values between 0 and 100, such as 50,90,99")
    return values


def parse_slo(text: str | None) -> dict[str, float]:
    """`ttft:500,tpot:50` (milliseconds) -> {"ttft": 0.5, "tpot": 0.05}."""
    slo: dict[str, float] = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        name, _, value = part.partition(":")
        name = name.strip().lower()
        if name not in ("ttft", "tpot", "e2el") or not value.strip():
            raise BadRequestError(f"--slo: '{part}' should be ttft:MS, tpot:MS or e2el:MS")
        try:
            slo[name] = float(value) / 1000
        except ValueError:
            slo[name] = math.nan
        if not math.isfinite(slo[name]) or slo[name] <= 0:
            raise BadRequestError(f"--slo: '{value}' is not a positive number of milliseconds")
    return slo


def run_serving(
    *,
    endpoint: str,
    api_key: str | None,
    timeout_s: float,
    model: str | None,
    concurrency: str,
    request_rate: str,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    warmup: int,
    percentiles: str,
    slo: str | None,
    interference: bool,
    interference_rate: float,
    interference_prompt_len: int,
    seed: int,
    output: out.OutputFormat | None,
    compare: bool,
    store: bool,
    cancel: threading.Event,
    err: Console,
    show: Console,
) -> int:
    from llmrun.runners.remote import OpenAIRunner
    from llmrun.runners.serving import load as sv  # httpx: only when a server is measured

    levels = parse_values(concurrency, name="--concurrency")
    if any(c < 1 for c in levels):
        raise BadRequestError("--concurrency values must be at least 1")
    rate = parse_rate(request_rate)
    pcts = parse_percentiles(percentiles)
    slos = parse_slo(slo)
    runner = OpenAIRunner(endpoint, model=model, api_key=api_key, timeout_s=timeout_s,
                          max_connections=max(levels) + 8)  # fmt: skip
    endpoint = runner.endpoint  # from here on: credentials redacted
    done: list[sv.ServingLevel] = []
    found: sv.InterferenceResult | None = None
    try:
        loaded = runner.load()
        name = runner.model_name or loaded.name
        err.print(
            f"server   {endpoint} · model {name} · connect {loaded.load_s * 1000:.1f} ms",
            markup=False,
        )
        with err.status("preparing prompts (counting tokens with the server's tokenizer) ..."):
            prompts = sv.make_prompts(
                runner,
                count=num_prompts,
                input_len=input_len,
                output_len=output_len,
                range_ratio=range_ratio,
                seed=seed,
            )
            warm = sv.make_prompts(
                runner,
                count=warmup,
                input_len=input_len,
                output_len=min(output_len, 16),
                range_ratio=0.0,
                seed=seed + 1,
            )
        measured = sv.run_levels(runner, levels=levels, prompts=prompts, warm=warm,
                                 request_rate=rate, input_len=input_len, output_len=output_len,
                                 seed=seed, percentiles=pcts, slo=slos, cancel=cancel)  # fmt: skip
        for level in levels:
            with err.status(f"concurrency {level}: {warmup} warm-up, {num_prompts} requests ..."):
                result = next(measured, None)
            if result is None:
                break
            done.append(result)
            for e in result.metrics.get("errors") or []:
                err.print(f"c={level}: failed requests: {e}", markup=False, style="yellow")
        if interference and not cancel.is_set():
            with err.status(f"interference: one client decodes alone and while"
                            f" {interference_prompt_len}-token prompts arrive at"
                            f" {interference_rate:g}/s ..."):  # fmt: skip
                found = sv.run_interference(
                    runner, input_len=input_len, output_len=output_len, rate=interference_rate,
                    prompt_len=interference_prompt_len, seed=seed, cancel=cancel,
                )  # fmt: skip
            show.print(interference_sentence(found), markup=False)
    finally:
        runner.close()
    interrupted = cancel.is_set()
    records = [r.record() for r in done] + ([found.record()] if found else [])
    if interrupted:
        err.print(f"interrupted: keeping the {len(records)} finished results", style="yellow")
    changes = out.store_and_print(
        records, kind="serving", model=name, system={"endpoint": endpoint}, output=output,
        show=show, table=serving_table(done, pcts), store=store, compare=compare,
        markdown=lambda: serving_markdown(done, found), sql_table="llmrun_serving",
    )  # fmt: skip
    if changes is not None:
        show.print(out.compare_table(changes))
    return EXIT_INTERRUPTED if interrupted else 0


def interference_sentence(result: sv.InterferenceResult) -> str:
    rec = result.measured.record()
    return (
        f"interference: the steady client's ITL p50 {rec['itl_p50_alone_ms']} ms alone,"
        f" {rec['itl_p50_loaded_ms']} ms under prefill load (x{rec['itl_p50_ratio']});"
        f" p99 {rec['itl_p99_alone_ms']} -> {rec['itl_p99_loaded_ms']} ms"
        f" (x{rec['itl_p99_ratio']}); its TTFT {rec['ttft_alone_ms']} -> {rec['ttft_loaded_ms']}"
        f" ms; {rec['background_requests']} long prompts sent"
    )


SERVING_COLUMNS = (
    "test", "concurrency", "request_rate", "completed", "failed", "request_throughput",
    "output_throughput", "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "mean_itl_ms",
    "p99_itl_ms", "mean_e2el_ms", "goodput",
)  # fmt: skip


def serving_markdown(levels: list[sv.ServingLevel], found: sv.InterferenceResult | None) -> str:
    """The levels as a markdown table; the interference result as a line of its own figures."""
    lines = ["| " + " | ".join(SERVING_COLUMNS) + " |",
             "| " + " | ".join("---" for _ in SERVING_COLUMNS) + " |"]  # fmt: skip
    for level in levels:
        record = level.record()
        lines.append("| " + " | ".join(out.cell(record.get(c)) for c in SERVING_COLUMNS) + " |")
    text = "\n".join(lines) + "\n"
    if found is not None:
        figures = [f"{k} {out.cell(v)}" for k, v in found.measured.record().items()
                   if k.startswith(("itl_", "background"))]  # fmt: skip
        text += f"\n{found.test}: " + ", ".join(figures) + "\n"
    return text
