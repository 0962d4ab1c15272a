"""The dashboard renders from fixed measurements into a captured console."""

from __future__ import annotations

import dataclasses
import io
import re

import pytest
from rich.console import Console, RenderableType

from llmrun.cli.dashboard import (
    LINE_ROWS,
    Dashboard,
    LiveState,
    folded,
    render,
    render_live,
    sparkline,
)
from llmrun.cli.report import phase_sentence, summary_lines
from llmrun.runners.base import LoadStarted, ModelLoaded, PrefillProgress, Token
from llmrun.runners.stats import GenerationStats

from .fake import FAKE_MODEL, FAKE_SETTINGS

STATS = GenerationStats(
    finish_reason="length",
    prompt_tokens=1000,
    reused_tokens=200,
    output_tokens=101,
    template_tokenize_s=0.004,
    prefill_s=2.0,
    first_sample_s=0.001,
    itl_s=tuple([0.01] * 90 + [0.02] * 10),
    e2e_s=3.2,
    load_s=0.25,
    seed=42,
    model=FAKE_MODEL,
    settings=FAKE_SETTINGS,
)


def text_of(renderable: RenderableType, width: int = 80) -> str:
    console = Console(file=io.StringIO(), width=width, color_system=None)
    console.print(renderable)
    out = console.file.getvalue()  # type: ignore[attr-defined]
    assert isinstance(out, str)
    return out


def test_summary_has_every_figure_and_fits_80_columns() -> None:
    out = text_of(render(STATS))
    assert all(len(line) <= 80 for line in out.splitlines())
    for expected in [
        "load     250.0 ms",
        "1000 tokens (800 new, 200 reused)",
        "prefill  2,000.0 ms · 400.0 tok/s",
        "ttft     2,005.0 ms = template+tokenize 4.0 ms + prefill 2,000.0 ms + first sample 1.0 ms",
        "101 tokens [length]",
        "decode   1,100.0 ms · 90.9 tok/s",
        "p50 10.0 ms · p90 11.0 ms · p99 20.0 ms",
        "total    3,200.0 ms (from the request: load not included) · seed 42",
        "prompt is 4.4x output",
    ]:
        assert " ".join(expected.split()) in " ".join(out.split()), expected
    bars = {m.group(1): len(m.group(2)) for m in re.finditer(r"(prompt|output) tok/s\s+(█+)", out)}
    assert bars["prompt"] > bars["output"] * 4  # one scale for both bars
    assert "Prefill dominated the wait: 2,005.0 ms (65% of TTFT + decode)" in out.replace("\n", " ")


def test_phase_sentence_names_decode_when_it_dominates() -> None:
    long_decode = GenerationStats(
        finish_reason="stop",
        prompt_tokens=10,
        reused_tokens=0,
        output_tokens=3,
        template_tokenize_s=0.0,
        prefill_s=0.1,
        first_sample_s=0.0,
        itl_s=(0.5, 0.5),
        e2e_s=1.1,
        load_s=0.1,
    )
    assert phase_sentence(long_decode).startswith(
        "Decode dominated the wait: 1,000.0 ms (91% of TTFT + decode)"
    )
    plain = summary_lines(long_decode)
    assert plain[-2] == "rates    prompt 100.0 tok/s vs output 2.0 tok/s: prompt is 50.0x output"


def test_live_panel_through_the_phases() -> None:
    state = LiveState()
    state.apply(LoadStarted("/models/tiny.gguf"))
    assert "loading tiny.gguf" in text_of(render_live(state))
    state.apply(ModelLoaded(FAKE_MODEL, FAKE_SETTINGS, 0.5))
    state.apply(PrefillProgress(600, 1000, 200, 1.0))
    out = text_of(render_live(state))
    assert "500.0 ms · fake-model" in out and "CPU 1t · batch 4 · ngl 0" in out
    assert "600/1000 tokens (200 reused) · 400.0 tok/s" in out  # the summary's word
    for i, t in enumerate([1.0, 1.01, 1.03, 1.04]):
        state.apply(Token(i, "x", t))
    out = text_of(render_live(state))
    assert "4 tokens · 75.0 tok/s · itl" in out and "10.0 ms" in out


def test_waiting_for_a_server_shows_the_wait() -> None:
    state = LiveState(loaded=ModelLoaded(FAKE_MODEL, FAKE_SETTINGS, 0.5), started_s=10.0)
    assert "wait     1,500.0 ms for the first token" in text_of(render_live(state, 11.5))
    state.apply(Token(0, "x", 1.6))
    assert "for the first token" not in text_of(render_live(state, 12.0))


def test_sparkline_is_anchored_at_zero() -> None:
    assert sparkline([1.0, 2.0, 4.0]) == "▃▅█"
    assert sparkline([14.0, 28.0, 20.0]) == "▅█▆"  # ordinary gaps: not "▁█▄", not spikes
    assert sparkline([2.0, 2.0]) == "██" and sparkline([]) == "" and sparkline([0.0]) == "▁"


def test_no_color_drops_colors_but_keeps_the_bars(monkeypatch: pytest.MonkeyPatch) -> None:
    def raw() -> str:
        out = io.StringIO()
        Console(file=out, width=80, force_terminal=True).print(render(STATS))
        return out.getvalue()

    assert "\x1b[36m" in raw()  # cyan prompt bar
    monkeypatch.setenv("NO_COLOR", "1")
    out = raw()
    assert "\x1b[36m" not in out and "\x1b[35m" not in out and "█" in out


def test_text_through_the_dashboard_keeps_every_line_whole() -> None:
    """The terminal wraps the answer, not llmrun: each line of the text reaches it as one line
    (no break inserted at the width), so what is copied from the screen is the text."""
    console = Console(file=io.StringIO(), width=40, color_system=None)
    dash = Dashboard(console, show_text=True)
    dash.update(ModelLoaded(FAKE_MODEL, FAKE_SETTINGS, 0.5))  # starts the live panel
    text = "The quick brown fox jumps over the lazy dog. " * 12 + "\n    x = [1, 2]\n\nEnd"
    words = text.split(" ")
    for i, word in enumerate(words):
        dash.write(word if i == 0 else " " + word)
        rows = [
            ln for ln in text_of(render_live(dash.state, width=40), width=40).splitlines() if ln
        ]
        assert len(rows) <= LINE_ROWS + 2  # the live part stays a few rows high
    dash.close()
    out = console.file.getvalue()  # type: ignore[attr-defined]
    assert out.splitlines() == text.splitlines()


@pytest.mark.parametrize("width", [40, 60, 80, 120])
def test_the_line_being_written_is_cut_where_the_terminal_will_wrap_it(width: int) -> None:
    line = "0123456789" * 30
    rows = folded(line, width, rows=100)
    assert [r.plain for r in rows] == [line[i : i + width] for i in range(0, len(line), width)]
    assert [r.plain for r in folded(line, width, rows=2)] == [r.plain for r in rows[-2:]]


def test_prefill_shows_time_and_a_moving_estimate_between_chunks() -> None:
    state = LiveState(
        prefill=PrefillProgress(0, 994, 0, 0.0),
        prefill_started_s=10.0,
        prefill_at_s=10.0,
        prefill_rate=100.0,
    )
    at_2s = text_of(render_live(state, now_s=12.0))
    at_3s = text_of(render_live(state, now_s=13.0))
    assert "0/994 tokens" in at_2s and "2,000.0 ms" in at_2s and "~200 est." in at_2s
    assert "3,000.0 ms" in at_3s and "~300 est." in at_3s  # it moves with no event in between
    unknown = text_of(
        render_live(
            LiveState(prefill=PrefillProgress(0, 994, 0, 0.0), prefill_started_s=10.0), now_s=14.5
        )
    )
    assert "4,500.0 ms" in unknown and "est." not in unknown  # no rate yet: the clock alone
    done = text_of(
        render_live(
            LiveState(prefill=PrefillProgress(994, 994, 0, 2.0), prefill_started_s=10.0), now_s=20.0
        )
    )
    assert "est." not in done and "994/994" in done


def test_the_prefill_bar_tells_done_from_to_do_without_colour() -> None:
    empty = text_of(render_live(LiveState(prefill=PrefillProgress(0, 41, 0, 0.0))))
    full = text_of(render_live(LiveState(prefill=PrefillProgress(41, 41, 0, 0.1))))
    assert "╌" * 20 in empty and "━" not in empty  # text_of renders without colour
    assert "━" * 20 in full and "╌" not in full


@pytest.mark.parametrize("width", [40, 60, 80, 120])
def test_every_view_keeps_its_numbers_at_any_width(width: int) -> None:
    summary = text_of(render(STATS), width=width)
    assert all(len(line) <= width for line in summary.splitlines())
    flat = " ".join(summary.split())
    for figure in ("400.0", "90.9", "4.4x output", "101 tokens", "2,005.0 ms", "seed 42"):
        assert figure in flat, (width, figure)
    live = LiveState(
        prefill=PrefillProgress(600, 1000, 200, 1.0),
        prefill_started_s=1.0,
        prefill_at_s=1.0,
        prefill_rate=400.0,
    )
    panel = text_of(render_live(live, now_s=1.5), width=width)
    assert all(len(line) <= width for line in panel.splitlines())
    assert "600/1000" in " ".join(panel.split()) and "400.0 tok/s" in " ".join(panel.split())
    # one time format per view: every duration in milliseconds, none in seconds
    for view in (flat, " ".join(panel.split())):
        assert not re.search(r"\d s\b", view), view
        assert re.search(r"\d ms\b", view), view


@pytest.mark.parametrize("width", [40, 60, 80, 120])
def test_stats_all_never_crops_a_figure(width: int) -> None:
    from llmrun.cli.chat import turns_view
    from llmrun.runners.conversation import Turn

    turns = [
        Turn("a", "x", STATS),
        Turn("b", "y", STATS, in_context=False),
        Turn("c", "z", STATS, in_context=False, cleared=True),
    ]
    out = text_of(turns_view(turns), width=width)
    assert all(len(line) <= width for line in out.splitlines())
    flat = " ".join(out.split())
    assert "…" not in out and flat.count("800+200") + flat.count("800 new + 200") == 3
    for figure in ("2,005", "400", "90.9", "101"):
        assert figure in flat, (width, figure)


def test_the_live_panel_shows_drafted_runs_landing() -> None:
    state = LiveState()
    for i, t in enumerate([1.0, 1.01, 1.01, 1.01, 1.02]):  # three tokens land together
        state.apply(Token(i, "x", t))
    panel = text_of(render_live(state, now_s=1.03))
    assert "2 landed in drafted runs (last 1)" in " ".join(panel.split())
    assert list(state.gaps_s) == pytest.approx([0.01, 0.01])  # a run's tokens are no gaps


@pytest.mark.parametrize("width", [40, 60, 80, 120])
def test_live_rows_hang_under_their_value_at_any_width(width: int) -> None:
    """A wrapped live row continues under its value, as the closing summary does: nothing but
    a label starts at column 0."""
    import dataclasses

    from llmrun.runners.stats import MemoryReport

    memory = MemoryReport(
        weights={"CPU_Mapped": 96 << 20, "CPU_REPACK": 40 << 20},
        kv_bytes=48 << 20,
        compute_bytes=9 << 20,
        n_ctx=2048,
        peak_rss_bytes=300 << 20,
    )
    settings = dataclasses.replace(FAKE_SETTINGS, memory=memory)
    state = LiveState(
        load_seen=True,
        loaded=ModelLoaded(FAKE_MODEL, settings, 0.5),
        prefill=PrefillProgress(600, 100000, 200, 1.0),
        prefill_started_s=1.0,
        prefill_at_s=1.0,
        prefill_rate=400.0,
    )
    for i, t in enumerate([1.0, 1.01, 1.03]):
        state.apply(Token(i, "x", t, thinking=True))
    panel = text_of(render_live(state, now_s=2.5, width=width), width=width)
    labels = ("load", "memory", "prefill", "decode")
    for line in panel.splitlines():
        assert len(line) <= width
        assert not line or line.startswith(labels) or line.startswith(" " * 9), (width, panel)
    flat = " ".join(panel.split())
    assert "compute 9.0 MiB" in flat and "~1200 est." in flat and "(3 thinking)" in flat


@pytest.mark.parametrize("width", [40, 60, 80, 120])
def test_a_fitted_table_never_cuts_a_figure(width: int) -> None:
    """report.fitted: the table where it fits, a block per row below its natural width."""
    from rich.table import Table

    from llmrun.cli.report import fitted

    table = Table(title="serving")
    for name in ("level", "TTFT p50 ms", "TTFT p99 ms", "ITL p99 ms", "output tok/s", "errors"):
        table.add_column(name, justify="right")
    rows = [
        ("c=1", "35,417.2", "129,098.4", "918.3", "12,345.6", "0"),
        ("c=16", "46,612.9", "15,482.1", "1,204.7", "98,765.4", "3"),
    ]
    for row in rows:
        table.add_row(*row)
    out = text_of(fitted(table), width=width)
    assert "…" not in out
    assert all(len(line) <= width for line in out.splitlines()), out
    for row in rows:
        for figure in row:
            assert figure in out, (width, figure)
    stacked = re.search(r"^  TTFT p99 ms +129,098\.4$", out, re.MULTILINE) is not None
    assert stacked == (width < 76), out  # whole where it fits (75 columns), else blocks


@pytest.mark.parametrize("width", [40, 60, 80])
def test_the_summary_folds_a_word_wider_than_its_column_instead_of_cutting_it(width: int) -> None:
    name = "Meta-Llama-3.1-8B-Instruct-abliterated-and-then-some.Q4_K_M"
    stats = dataclasses.replace(STATS, model=dataclasses.replace(FAKE_MODEL, name=name))
    out = text_of(render(stats), width=width)
    assert "…" not in out
    assert all(len(line) <= width for line in out.splitlines())
    assert name in "".join(out.split())  # whole, once the folded lines are joined


@pytest.mark.parametrize("width", [40, 80])
def test_bar_labels_of_wide_characters_are_whole(width: int) -> None:
    """The labels' column was sized in characters: `模型模型 prompt` showed as `模型模型 p…`."""
    from llmrun.cli.dashboard import bars

    out = io.StringIO()
    rows = [("模型模型 prompt", 120.0, ""), ("decode", 30.0, "")]
    Console(file=out, width=width, color_system=None).print(bars(rows))
    assert "模型模型 prompt" in out.getvalue() and "120.0" in out.getvalue()
