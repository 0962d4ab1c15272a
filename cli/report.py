"""Stats as text for people and as JSON for programs (pure functions of the records)."""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, RenderableType, RenderResult
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from llmrun.runners.errors import BadRequestError
from llmrun.runners.files import append_line
from llmrun.runners.limits import gib
from llmrun.runners.stats import (
    ENERGY_PHASES,
    FINISH_CONTEXT,
    Aggregate,
    EngineSettings,
    GenerationStats,
    ModelInfo,
    PhaseEnergy,
    ServerReport,
    human_count,
    rate,
)
from llmrun.runners.system import busy_advice, busy_machine, logical_cpus

from .terminal import fold, terminal_line


def warmup_text(seconds: float | None, probe_s: float | None = None) -> str:
    """' · warm-up 31.0 ms' after the load: the warm-up decode, its own part of the load; and
    the repack probe where one ran before it (a new quantization's first load)."""
    probe = "" if probe_s is None else f" · repack probe {ms(probe_s)} (once per quantization)"
    return ("" if seconds is None else f" · warm-up {ms(seconds)}") + probe


def ms(seconds: float | None) -> str:
    """Every duration a view shows, in one unit: milliseconds, as llama.cpp's own timings."""
    return "-" if seconds is None else f"{seconds * 1000:,.1f} ms"


def tps(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f} tok/s"


def summary_rows(stats: GenerationStats) -> list[tuple[str, str]]:
    """The closing summary as (label, value) rows, in the words llama.cpp and Ollama users know.
    A model's name, a path or a server's words inside are made safe for a terminal."""
    rows = _remote_rows(stats, stats.server) if stats.server is not None else _local_rows(stats)
    return [(label, terminal_line(value)) for label, value in rows]


def _local_rows(s: GenerationStats) -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = []
    if s.model and s.settings:
        st = s.settings
        repack = f" · repack {st.repack_note}" if st.repack_note.startswith("off:") else ""
        rows.append(
            ("model", f"{display_name(s.model)} · {engine_text(st)}{tuned_text(st)}{repack}")
        )
    facts = ""
    if s.model:
        m = s.model
        facts = (
            f" · {m.architecture} · {human_count(m.n_params)} params"
            f" · {human_count(m.size_bytes, 'B')} of weights"
        )
    memory = memory_text(s.settings) if s.settings else ""
    cut = (
        ""
        if s.prefilled_tokens is None
        else f"; {s.prefilled_tokens} evaluated before the interrupt"
    )
    rows += [
        *busy_rows(s),
        (
            "load",
            ms(s.load_s) + warmup_text(s.warmup_s, s.probe_s) + cache_text(s.settings) + facts,
        ),
        *([("memory", memory)] if memory else []),
        (
            "prompt",
            f"{s.prompt_tokens} tokens ({s.new_prompt_tokens} new, {s.reused_tokens} reused){cut}",
        ),
        ("prefill", f"{ms(s.prefill_s)} · {tps(s.prompt_tps)}"),
        (
            "ttft",
            f"{ms(s.ttft_s)} = template+tokenize {ms(s.template_tokenize_s)}"
            f" + prefill {ms(s.prefill_s)} + first sample {ms(s.first_sample_s)}",
        ),
    ]
    return rows + _output_rows(s)


def joules(j: float) -> str:
    """Energy in J, or mJ below one joule (a token's share)."""
    if abs(j) >= 10:
        return f"{j:,.1f} J"
    return f"{j:.2f} J" if abs(j) >= 1 else f"{j * 1000:.1f} mJ"


def _phase_energy(name: str, phase: PhaseEnergy | None) -> str:
    if phase is None:
        return f"{name} -"
    if phase.energy_j is None:
        return f"{name} - ({phase.note})"
    parts = [
        *([f"{joules(phase.j_per_token)}/token"] if phase.j_per_token is not None else []),
        *([f"{phase.power_w:,.1f} W"] if phase.power_w is not None else []),
        *([phase.note] if phase.note else []),
    ]
    return f"{name} {joules(phase.energy_j)}" + (f" ({', '.join(parts)})" if parts else "")


def energy_rows(s: GenerationStats) -> list[tuple[str, str]]:
    """Joules per phase above the idle baseline, per token and in watts, and their source; or
    why there are none."""
    e = s.energy
    if e is None:
        return []
    if not e.measured:
        return [("energy", f"not available ({e.reason})")]
    phases = " · ".join(_phase_energy(name, getattr(e, name)) for name in ENERGY_PHASES)
    idle = f"{e.idle_w:,.1f} W" if e.idle_w is not None else "-"
    left_out = f" · not counted: {e.left_out}" if e.left_out else ""
    return [("energy", f"{phases} · above an idle {idle} · {e.source}{left_out}")]


def _output_rows(s: GenerationStats) -> list[tuple[str, str]]:
    seed = "" if s.seed is None else f" · seed {s.seed}"
    return [
        *thinking_rows(s),
        (
            "output",
            f"{s.output_tokens} {s.server.output_counted_as if s.server else 'tokens'}"
            f" [{s.finish_reason}]" + _context_hint(s),
        ),
        (
            "decode",
            f"{ms(s.decode_s)} · {tps(s.output_tps)}"
            if s.decode_s is not None
            else "- (no token arrived)",
        ),
        *speculation_rows(s),
        (
            "itl",
            f"p50 {ms(s.itl_p50_s)} · p90 {ms(s.itl_p90_s)} · p99 {ms(s.itl_p99_s)}"
            f" · max {ms(s.itl_max_s)}",
        ),
        *network_rows(s),
        ("total", f"{ms(s.e2e_s)} (from the request: load not included){seed}"),
        *energy_rows(s),
    ]


def network_rows(s: GenerationStats) -> list[tuple[str, str]]:
    """--rpc: the bytes to and from the servers per token of each phase (rpc_bytes_per_token,
    as bench's records count them), and the share of the decode spent waiting on the servers
    (rpc_wait_share: their compute and the network together, docs/hardware.md)."""

    def per_token(n: int | None) -> str:
        return "-" if n is None else f"{human_count(n, 'B')}/token"

    parts = []
    if s.rpc_decode_bytes is not None:
        parts.append(
            f"{per_token(s.rpc_bytes_per_token)} decode · "
            f"{per_token(s.rpc_bytes_per_prompt_token)} prefill (to and from the RPC servers)"
        )
    share = s.rpc_wait_share
    if share is not None:
        parts.append(
            f"{share:.0%} of the decode waiting on the servers"
            f" ({s.rpc_wait_ms_per_token:.2f} ms/token)"
        )
    return [("network", " · ".join(parts))] if parts else []


def engine_text(st: EngineSettings) -> str:
    """Where the model runs: the device and the layers on it, then the CPU's threads and batch
    ('CUDA0 NVIDIA H200 · ngl 31/31 · 0.21 GiB on the device · CPU 2t · batch 512')."""
    layers = f"ngl {st.n_gpu_layers}" + (f"/{st.n_layer_total}" if st.n_layer_total else "")
    cpu = f"CPU {st.n_threads}t · batch {st.n_batch}"
    if not st.n_gpu_layers:
        return f"{cpu} · {layers}"
    used = f" · {gib(st.device_memory_bytes)} on the device" if st.device_memory_bytes else ""
    return f"{st.device} · {layers}{used} · {cpu}"


def mib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def memory_text(st: EngineSettings) -> str:
    """What the load took, by llama.cpp's account: weights per buffer, KV cache (and per
    token), compute buffers, and the process's peak resident memory."""
    m = st.memory
    if m is None:
        return ""
    weights = " + ".join(f"{mib(n)} {name}" for name, n in m.weights.items()) or "-"
    per_token = f"{m.kv_bytes_per_token / 1024:.1f} KiB/token"
    kv_split, compute_split = _split(m.kv), _split(m.compute)
    kv_split = f"{kv_split}; " if kv_split else ""
    compute = f"compute {mib(m.compute_bytes)}" + (f" ({compute_split})" if compute_split else "")
    kv = f"KV {mib(m.kv_bytes)} ({kv_split}{per_token}, {st.type_k}/{st.type_v})"
    rss = f" · peak RSS {mib(m.peak_rss_bytes)}" if m.peak_rss_bytes else ""
    return f"weights {weights} · {kv} · {compute}{rss}"


def _split(buffers: dict[str, int]) -> str:
    """A total's part on each device ('2.1 MiB CPU + 3.6 MiB RPC0[127.0.0.1:50052]'), where
    more than one holds some (each layer's KV sits on its layer's device), or where the one
    is an RPC server (every layer there: none of it in this machine's memory); '' otherwise."""
    if len(buffers) < 2 and not any(name.startswith("RPC") for name in buffers):
        return ""
    return " + ".join(f"{mib(n)} {name}" for name, n in buffers.items())


def cache_text(st: EngineSettings | None) -> str:
    """Whether the load read the file from disk or from the page cache (orders of magnitude
    apart for a large model)."""
    share = st.memory.file_resident_before if st and st.memory else None
    if share is None:
        return ""
    return " (cold: from disk)" if share < 0.05 else f" ({share:.0%} of the file in page cache)"


def tuned_text(st: EngineSettings) -> str:
    """Why the settings are what they are, when `llmrun tune` chose them."""
    return f" · tuned for {st.tuned_for or 'chat'}" if st.tuned else ""


def speculation_rows(s: GenerationStats) -> list[tuple[str, str]]:
    if not s.decode_steps:
        return []
    rate_text = f" ({s.acceptance_rate:.0%})" if s.acceptance_rate is not None else ""
    per_step = f"{s.tokens_per_step:.2f}" if s.tokens_per_step is not None else "-"
    return [
        (
            "draft",
            f"{s.draft_tokens} drafted · {s.accepted_tokens} accepted{rate_text} ·"
            f" {per_step} tokens per decode step",
        )
    ]


def thinking_rows(s: GenerationStats) -> list[tuple[str, str]]:
    """For a model that thought before answering: the thinking, and the answer on its own."""
    if not s.thinking_tokens:
        return []
    answer = (
        f"first answer token at {ms(s.first_answer_s)} (TTFT {ms(s.ttft_s)}) ·"
        f" {s.answer_tokens} answer tokens · {tps(s.answer_tps)}"
        if s.first_answer_s is not None
        else "no answer after the thinking"
    )
    return [("thinking", f"{s.thinking_tokens} tokens · {ms(s.thinking_s)}"), ("answer", answer)]


def display_name(m: ModelInfo) -> str:
    """The file name with its quantization, once (SmolLM2-135M-Instruct.Q4_1, not ... Q4_1)."""
    if m.quantization and m.quantization.lower() not in m.name.lower():
        return f"{m.name} {m.quantization}"
    return m.name


def _context_hint(s: GenerationStats) -> str:
    """Output cut by a full context is not -n's doing: say so, and what to change."""
    if s.finish_reason != FINISH_CONTEXT:
        return ""
    n_ctx = s.settings.n_ctx if s.settings else 0
    return f": the {n_ctx}-token context is full (raise -c/--ctx or shorten the prompt)"


def context_note(asked: int | None, ran: int) -> str | None:
    """-c is never changed silently: llama.cpp pads the context (to a multiple of 256 on most
    builds), so the context that ran is said when it differs from the one asked for."""
    if not asked or not ran or asked == ran:
        return None
    return (
        f"note: -c {asked}: llama.cpp sized the context to {ran} tokens"
        f" ({'its padding' if ran > asked else 'its limit'}); {ran} is what ran"
    )


def ran_busy(s: GenerationStats) -> bool:
    """Whether other processes took the CPU time these figures needed: every view of a
    request's figures (summary, chat's turn line and table) marks them by this one test."""
    threads = s.settings.n_threads if s.settings else 1
    return busy_machine(s.background_cpus, threads)  # False where not measured (None)


def busy_mark(s: GenerationStats) -> str:
    """The short mark for a one-line view of a request measured on a busy machine, or ""."""
    if not ran_busy(s) or s.background_cpus is None:
        return ""
    return f"busy: others kept {s.background_cpus:.1f} of {logical_cpus()} CPUs, unreliable"


def busy_rows(s: GenerationStats) -> list[tuple[str, str]]:
    """A warning row when other processes took the CPU time these figures needed."""
    threads = s.settings.n_threads if s.settings else 1
    if s.background_cpus is None or not ran_busy(s):
        return []
    logical = logical_cpus()
    fewer = max(1, round(logical - s.background_cpus)) < threads  # -t was given: say what helps
    advice = f"; {busy_advice(s.background_cpus, threads, logical=logical)}" if fewer else ""
    return [
        (
            "warning",
            f"other processes kept {s.background_cpus:.1f} CPUs busy during this run"
            f" ({logical} in all, {threads} for llama.cpp): these figures"
            f" are unreliable{advice}",
        )
    ]


def busy_warning(background: float, threads: int, during: str, *, poll: bool = False) -> str:
    """One line for figures measured on a busy machine: how busy, and what would help."""
    logical = logical_cpus()
    advice = busy_advice(background, threads, logical=logical, poll=poll)
    return (
        f"llmrun: warning: other processes kept up to {background:.1f} of {logical} CPUs"
        f" busy during {during} ({threads} threads for llama.cpp): those figures are"
        f" unreliable; {advice}"
    )


def _remote_rows(s: GenerationStats, server: ServerReport) -> list[tuple[str, str]]:
    """A server's request: the client's view, and the server's own timings beside it."""
    prompt = (
        f"{s.prompt_tokens} tokens ({s.new_prompt_tokens} new, {s.reused_tokens} cached)"
        if s.prompt_tokens
        else "not reported by the server"
    )
    rows = [
        ("model", f"{server.model} · remote {server.host}"),
        ("connect", f"{ms(s.load_s)} (GET /v1/models)"),
        ("prompt", prompt),
        (
            "ttft",
            f"{ms(s.ttft_s)} on the client: network, queueing and the server's prefill"
            if s.ttft_s is not None
            else "- (no token arrived)",
        ),
    ]
    t = server.timings
    if t is not None and t.prompt_ms is not None:
        p_ms, p_n = t.prompt_ms, t.prompt_n or 0
        d_ms, d_n = t.predicted_ms or 0.0, t.predicted_n or 0
        rows += [
            (
                "server",
                f"prefill {ms(p_ms / 1000)} for {p_n} tokens"
                f" ({t.cache_n or 0} cached) · {tps(rate(p_n, p_ms / 1000))}"
                f" · decode {ms(d_ms / 1000)} for {d_n} tokens"
                f" · {tps(t.decode_tps)}",
            ),
            (
                "network",
                f"{ms((server.network_queue_ms or 0) / 1000)} of the TTFT was network and"
                " queueing (client TTFT minus the server's prefill)",
            ),
        ]
    rows += _output_rows(s)
    if server.implausible:
        left_out = "; ".join(server.implausible)
        rows.append(
            ("warning", f"the server's figures that cannot be true were left out: {left_out}")
        )
    if server.error:
        rows.append(("error", f"{server.error}; the text so far is kept"))
    return rows


def ratio_text(stats: GenerationStats) -> str:
    """How many times faster prompt tokens were processed than output tokens were produced."""
    prompt, output = stats.prompt_tps, stats.output_tps
    return f"prompt is {prompt / output:,.1f}x output" if prompt and output else "no ratio"


def phase_sentence(s: GenerationStats) -> str:
    """Which phase this request's wait went to, in one sentence."""
    ttft = s.ttft_s
    decode = s.decode_s
    if ttft is None or decode is None:
        return f"No first token: the request ended after {ms(s.e2e_s)}."
    wait = ttft + decode
    if s.output_tokens == 0 or wait <= 0:
        return f"No output; the prompt phase took {ms(ttft)}."
    if ttft >= decode:
        return (
            f"Prefill dominated the wait: {ms(ttft)} ({ttft / wait:.0%} of TTFT + decode)"
            f" before the first token against {ms(decode)} of decode."
        )
    return (
        f"Decode dominated the wait: {ms(decode)} ({decode / wait:.0%} of TTFT + decode)"
        " generating"
        f" {s.output_tokens} tokens against {ms(ttft)} to the first token."
    )


SUMMARY_INDENT = 9  # the label column of `summary_lines`, where a folded value goes on


def summary_lines(stats: GenerationStats, width: int | None = None) -> list[str]:
    """The closing summary as plain lines, for a stderr that cannot redraw (a file, a pipe,
    TERM=dumb): whole, one record a line, or folded at spaces to `width` (a terminal's,
    terminal.terminal_width), a row going on under its value at SUMMARY_INDENT."""
    lines = [f"{label:<8} {value}" for label, value in summary_rows(stats)]
    rates = f"prompt {tps(stats.prompt_tps)} vs output {tps(stats.output_tps)}: {ratio_text(stats)}"
    lines += [f"{'rates':<8} {rates}", phase_sentence(stats)]
    return [fold(x, width, indent=SUMMARY_INDENT if x[8:9] == " " else 0) for x in lines]


def stats_record(stats: GenerationStats, label: str | int) -> dict[str, Any]:
    return {"id": label, **stats.to_dict()}


def stats_json(stats: GenerationStats, label: str | int) -> str:
    return json.dumps(stats_record(stats, label), ensure_ascii=False)


def append_stats_file(path: Path, lines: Sequence[str]) -> None:
    try:
        for line in lines:
            append_line(path, line)  # whole lines only, even on a full disk
    except OSError as e:
        raise BadRequestError(f"cannot write the stats file {path}: {e.strerror or e}") from None


def aggregate_table(agg: Aggregate, *, busy: int = 0) -> Fitted:
    """The percentiles over several requests; `busy` of them ran on a busy machine (ran_busy),
    which the caption says, as each request's summary does."""
    table = fitted_table(f"{agg.count} requests", ("figure", "p50", "p90"), ("figure",))
    if busy:
        table.table.caption = f"{busy} of {agg.count} on a busy machine: unreliable"
        table.table.caption_justify = "left"
    formats = {
        "ttft_s": ("TTFT", ms),
        "prompt_tps": ("prompt tok/s", tps),
        "output_tps": ("output tok/s", tps),
    }
    for key, (name, fmt) in formats.items():
        figures = agg.figures[key]
        table.add_row(name, fmt(figures["p50"]), fmt(figures["p90"]))
    return table


def fitted_table(
    title: str | Text | None,
    heads: Iterable[str],
    left: Collection[str],
    *,
    wrap: Collection[str] = (),
) -> Fitted:
    """A new table of these columns, `fitted`: the text ones named in `left` flush left, the
    figures right."""
    table = Table(title=title, title_justify="left")
    for head in heads:
        table.add_column(head, justify="left" if head in left else "right")
    return fitted(table, wrap=wrap)


WRAP_FLOOR_CELLS = 20  # a text column named in `fitted(wrap=...)` is never made narrower


def fitted(table: Table, *, wrap: Collection[str] = (), by_column: bool = False) -> Fitted:
    """The one way a table reaches a terminal: whole where it fits, else stacked (a block per
    row: its key, then `label  value` lines with a hanging indent), so a figure is never cut,
    wrapped or ellipsized. Every column is kept on one line except the text columns named in
    `wrap` (a path, a list of settings), which may fold down to WRAP_FLOOR_CELLS before the
    table stacks. by_column: stacked, a block per column instead (a table whose columns are
    the things measured, as the serving levels)."""
    for column in table.columns:
        if _plain(column.header) in wrap:
            column.no_wrap, column.overflow = False, "fold"
        else:
            column.no_wrap = True
    return Fitted(table, by_column=by_column)


class Fitted:
    """A table that never crops a figure: see `fitted`."""

    def __init__(self, table: Table, *, by_column: bool = False) -> None:
        self.table = table
        self.by_column = by_column

    def add_row(self, *cells: RenderableType | None) -> None:
        self.table.add_row(*cells)

    def fits(self, console: Console, options: ConsoleOptions) -> bool:
        """Whether the table shows every figure whole in the width: its natural width, less
        what its wrapping text columns can give up (rich narrows only those)."""
        width = options.max_width
        wide = options.update(width=10_000)
        natural = Measurement.get(console, wide, self.table).maximum
        if natural <= width:
            return True
        give = 0
        for column in self.table.columns:
            if column.no_wrap:
                continue
            cells = [column.header, *column.cells]
            widest = max(Measurement.get(console, wide, c).maximum for c in cells)
            give += max(0, widest - WRAP_FLOOR_CELLS)
        return natural - width <= give

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        if self.fits(console, options):
            yield self.table
        else:
            yield stacked(self.table, by_column=self.by_column)

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        return Measurement(1, options.max_width)


def stacked(table: Table, *, by_column: bool = False) -> Stacked:
    """A table as blocks, one per row (or per column): the row's first cell, then each other
    column's header and value."""
    headers = [_text(c.header) for c in table.columns]
    columns = [[_text(cell) for cell in c.cells] for c in table.columns]
    rows = [
        [col[i] if i < len(col) else Text("") for col in columns] for i in range(table.row_count)
    ]
    if by_column:  # a block per column: its header, then each row's first cell and its value
        blocks = [(headers[j], [(row[0], row[j]) for row in rows]) for j in range(1, len(headers))]
    else:
        blocks = [
            (row[0] if row[0].plain else headers[0], list(zip(headers[1:], row[1:], strict=True)))
            for row in rows
        ]
    return Stacked(
        title=_text(table.title) if table.title else None,
        blocks=blocks,
        caption=_text(table.caption) if table.caption else None,
    )


@dataclass(frozen=True)
class Stacked:
    """Blocks of `label  value` lines; a value that wraps goes on under itself (a hanging
    indent), and where the labels leave it too little room, under its label."""

    title: Text | None
    blocks: list[tuple[Text, list[tuple[Text, Text]]]]
    caption: Text | None
    indent: int = 2
    gap: int = 2
    room_cells: int = 20  # the narrowest value column worth aligning the values in

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        width = options.max_width
        if self.title is not None:
            yield Text(self.title.plain, style="bold")
        pairs = [pair for _, block in self.blocks for pair in block]
        label_cells = max((cell_len(label.plain) for label, _ in pairs), default=0)
        room = width - self.indent - label_cells - self.gap
        longest = max((cell_len(value.plain) for _, value in pairs), default=0)
        aligned = room >= min(longest, self.room_cells) and room > 0
        for key, block in self.blocks:
            yield Text(key.plain, style="bold")
            for label, value in block:
                if aligned:
                    head = Text(" " * self.indent) + label + " " * self.gap
                    head.pad_right(label_cells - cell_len(label.plain))
                    yield from _hanging(console, head, value, room)
                else:
                    yield Text(" " * self.indent) + label
                    deeper = max(0, min(2 * self.indent, width - longest))  # a figure whole
                    yield from _hanging(console, Text(" " * deeper), value, max(1, width - deeper))
        if self.caption is not None:
            yield Text(self.caption.plain, style="dim")


def _hanging(console: Console, head: Text, value: Text, room: int) -> Iterator[Text]:
    """`head` then the value wrapped to `room` cells, its further lines under its first."""
    lines = value.wrap(console, room, overflow="fold")
    if not lines:
        yield head
    for i, line in enumerate(lines):
        line.rstrip()
        yield (head if i == 0 else Text(" " * cell_len(head.plain))) + line


def _text(cell: object) -> Text:
    """A cell as Text, newlines as spaces (a two-line header is one label)."""
    text = cell.copy() if isinstance(cell, Text) else Text(_plain(cell))
    return Text(" ").join(text.split("\n")) if "\n" in text.plain else text


def _plain(cell: object) -> str:
    if isinstance(cell, Text):
        return cell.plain
    return str(cell) if cell is not None else ""
