"""Stats as text for people and as JSON for programs (pure functions of the records)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.table import Table

from llmrun.runners.errors import BadRequestError
from llmrun.runners.stats import Aggregate, GenerationStats


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:,.1f} ms"


def secs(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds:.3f} s" if seconds < 10 else f"{seconds:,.1f} s"


def tps(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f} tok/s"


def summary_lines(stats: GenerationStats) -> list[str]:
    """The compact closing summary, in the words llama.cpp and Ollama users know."""
    s = stats
    head = f"[{s.finish_reason}]"
    model = ""
    if s.model and s.settings:
        m, st = s.model, s.settings
        model = (
            f" {m.name} {m.quantization} · {st.backend} {st.n_threads}t · batch {st.n_batch}"
            f" · ngl {st.n_gpu_layers}" + (" · tuned" if st.tuned else "")
        )
    return [
        f"{head}{model} · load {secs(s.load_s)}",
        f"prompt   {s.prompt_tokens} tokens ({s.new_prompt_tokens} new, {s.reused_tokens} reused)"
        f" · prefill {secs(s.prefill_s)} · {tps(s.prompt_tps)}",
        f"ttft     {secs(s.ttft_s)} = template+tokenize {ms(s.template_tokenize_s)}"
        f" + prefill {ms(s.prefill_s)} + first sample {ms(s.first_sample_s)}",
        f"output   {s.output_tokens} tokens · decode {secs(s.decode_s)} · {tps(s.output_tps)}"
        f" · itl p50 {ms(s.itl_p50_s)} p90 {ms(s.itl_p90_s)} p99 {ms(s.itl_p99_s)}"
        f" max {ms(s.itl_max_s)}",
        f"total    {secs(s.e2e_s)}" + (f" · seed {s.seed}" if s.seed is not None else ""),
    ]


def stats_record(stats: GenerationStats, label: str) -> dict[str, Any]:
    return {"id": label, **stats.to_dict()}


def stats_json(stats: GenerationStats, label: str) -> str:
    return json.dumps(stats_record(stats, label), ensure_ascii=False)


def append_stats_file(path: Path, lines: Sequence[str]) -> None:
    try:
        with path.open("a", encoding="utf-8") as f:
            for line in lines:
                f.write(line + "\n")
    except OSError as e:
        raise BadRequestError(f"cannot write the stats file {path}: {e.strerror or e}") from None


def aggregate_table(agg: Aggregate) -> Table:
    table = Table(title=f"{agg.count} requests", title_justify="left")
    table.add_column("figure")
    table.add_column("p50", justify="right")
    table.add_column("p90", justify="right")
    formats = {"ttft_s": ("TTFT", secs), "prompt_tps": ("prompt tok/s", tps),
               "output_tps": ("output tok/s", tps)}  # fmt: skip
    for key, (name, fmt) in formats.items():
        figures = agg.figures[key]
        table.add_row(name, fmt(figures["p50"]), fmt(figures["p90"]))
    return table
