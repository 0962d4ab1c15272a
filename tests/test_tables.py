"""Every table llmrun prints on a terminal keeps its figures whole (report.fitted): the table
where it fits, a block per row below its width; never a cut, wrapped or ellipsized figure."""

from __future__ import annotations

import ast
import dataclasses
import io
import math
from collections.abc import Callable
from pathlib import Path

import pytest
from rich.console import Console, RenderableType

from llmrun.cli.report import Fitted

from .fake import FAKE_MODEL, FAKE_SETTINGS

WIDTHS = (40, 60, 80, 120)
WIDE = ("129,098.7", "46,612.3")  # the figures the issue saw cut: they must come out whole


def text_of(renderable: RenderableType, width: int) -> str:
    console = Console(file=io.StringIO(), width=width, color_system=None)
    console.print(renderable)
    out = console.file.getvalue()  # type: ignore[attr-defined]
    assert isinstance(out, str)
    return out


def problems(out: str, width: int, figures: tuple[str, ...]) -> list[str]:
    """What is wrong with a rendered table: a line past the width, an ellipsis, a figure that
    is not whole on one line."""
    lines = out.splitlines()
    found = [f"line of {len(line)} cells: {line!r}" for line in lines if len(line) > width]
    found += ["an ellipsis"] if "…" in out else []
    found += [
        f"{figure} not whole" for figure in figures if not any(figure in line for line in lines)
    ]
    return found


# ---- one builder per table kind, each with wide figures -------------------------------------


def _row(
    shape: tuple[int, int],
    avg_ts: float,
    stddev_ts: float,
    *,
    model: str = "",
    n_batch: int = 512,
    **swept: object,
) -> object:
    from llmrun.runners.bench import sweep as sw
    from llmrun.runners.bench.results import Efficiency, Result, Row

    info = dataclasses.replace(FAKE_MODEL, name=model) if model else FAKE_MODEL
    settings = dataclasses.replace(FAKE_SETTINGS, n_threads=16, n_batch=n_batch)
    result = Result(
        shape=sw.Shape(*shape),
        combo=sw.Combo(n_batch=n_batch),
        model=info,
        settings=settings,
        load_s=0.1,
        samples_s=(1.0,),
        engine_samples_s=(),
        next_token=42,
    )
    return Row(
        result=result,
        avg_ts=avg_ts,
        stddev_ts=stddev_ts,
        ttft_ms=46_612.34,
        itl_p50_ms=918.3,
        itl_p99_ms=1_204.7,
        efficiency=Efficiency(),
        swept={"n_batch": n_batch, **swept},
        relative_ts=1.0,
    )


def sweep_table() -> tuple[Fitted, tuple[str, ...]]:
    from llmrun.cli.bench.output import results_table

    rows = [
        _row((512, 0), 129_098.7, 46_612.3, model="SmolLM2-135M-Instruct.Q8_0", fa=0),
        _row((0, 128), 46_612.3, 1_204.7, model="Qwen2.5-0.5B-Instruct.Q4_K_M", fa=1),
    ]
    return results_table(rows), (*WIDE, "1,204.7", "46,612.34", "918.3/1204.7")  # type: ignore[arg-type]


def chunk_table() -> tuple[Fitted, tuple[str, ...]]:
    from llmrun.cli.bench.output import chunk_report

    rows = [
        _row((4096, 0), 129_098.7, 1.0, n_batch=256),
        _row((4096, 0), 46_612.3, 1.0, n_batch=2048),
    ]
    report = chunk_report(rows)  # type: ignore[arg-type]
    assert report is not None
    return report[0], (*WIDE, "46,612.34")


def compare() -> tuple[Fitted, tuple[str, ...]]:
    from llmrun.cli.bench.output import compare_table
    from llmrun.runners.history import Change

    now = {"model_name": "SmolLM2", "n_threads": 16, "avg_ts": 129_098.7, "stddev_ts": 46.2}
    before = {**now, "avg_ts": 46_612.3, "stddev_ts": 12.9}
    changes = [
        Change("pp512", now, before, 7),
        Change("tg128", {**now, "avg_ts": 918.3}, None, None),
    ]
    return compare_table(changes), (*WIDE, "+177.0%", "improvement (run 7)")


def serving() -> tuple[Fitted, tuple[str, ...]]:
    from llmrun.cli.bench.serve import serving_table
    from llmrun.runners.serving import load as sv
    from llmrun.runners.serving.figures import RequestResult, metrics

    levels = []
    for concurrency, ttft_s in ((1, 15.4821), (16, 46.6123)):
        requests = [RequestResult(4096, 64, ttft_s, 129.0987, [0.9183] * 63)] * 8
        measured = metrics(requests, 1032.79, percentiles=[50, 99], slo={})
        levels.append(
            sv.ServingLevel(
                "local",
                "SmolLM2",
                concurrency,
                math.inf,
                8,
                4096,
                64,
                measured,
                policy="prefill-first",
            )
        )
    return serving_table(levels, [50, 99]), ("129,098.7", "46,612.3", "15,482.1", "918.3")


def interference() -> tuple[Fitted, tuple[str, ...]]:
    from llmrun.cli.bench.interference import _table
    from llmrun.runners.serving.batching import Step
    from llmrun.runners.serving.interference import InterferenceReport

    steps = tuple(Step(i * 0.5, 0.4, 1, 512 * (i % 2)) for i in range(40))
    reports = [
        InterferenceReport(
            policy,
            (35_417.2, 129_098.7, 46_612.3),
            (129_098.7,),
            steps,
            1_234.5,
            stream_times_s=(0.0, 5.0, 19.0),
        )
        for policy in ("prefill-first", "chunked:256")
    ]
    return _table(reports), ("129,098.70", "46,612.30", "1,234.5", "7,600 of 8,000 ms")


def tuning() -> tuple[Fitted, tuple[str, ...]]:
    from llmrun.cli.bench.tune import tried_table
    from llmrun.runners.bench.sweep import Combo
    from llmrun.runners.bench.tuning import Tried

    tried = [
        Tried(
            Combo(n_threads=16, n_batch=2048, flash_attn="on"),
            129_098.7,
            46_612.3,
            samples=((129_098.7, 46_612.3), (129_000.0, 46_000.0)),
            stage="batch",
            note="chat: chosen; document: not chosen (within the noise)",
        )
    ]
    return tried_table(tried, ["chat", "document"]), (*WIDE,)


def models() -> tuple[Fitted, tuple[str, ...]]:
    from llmrun.cli.models import models_table
    from llmrun.runners.gguf import GGUFInfo
    from llmrun.runners.models import ListedModel

    path = (
        "/home/someone/.cache/huggingface/hub/models--bartowski--Qwen2.5-0.5B-Instruct-GGUF"
        "/snapshots/0123456789abcdef/Qwen2.5-0.5B-Instruct-Q4_K_M.gguf"
    )
    info = GGUFInfo(
        path=path,
        version=3,
        file_size_bytes=129_098_700_000,
        metadata={"general.architecture": "qwen2", "general.file_type": 15},
        n_tensors=290,
        n_params=46_612_300_000,
        data_size_bytes=1,
    )
    listed = [
        ListedModel(
            "bartowski/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M", path, "hub", 129_098_700_000, info
        )
    ]
    return models_table(listed), ("129 GB", "47B")


def aggregate() -> tuple[Fitted, tuple[str, ...]]:
    from llmrun.cli.report import aggregate_table
    from llmrun.runners.stats import Aggregate

    figures: dict[str, dict[str, float | None]] = {
        "ttft_s": {"p50": 46.6123, "p90": 129.0987},
        "prompt_tps": {"p50": 129_098.7, "p90": 46_612.3},
        "output_tps": {"p50": 918.3, "p90": 1_204.7},
    }
    return aggregate_table(Aggregate(3, figures)), ("46,612.3 ms", "129,098.7 tok/s")


def chat_turns() -> tuple[Fitted, tuple[str, ...]]:
    from llmrun.cli.chat import turns_view
    from llmrun.runners.conversation import Turn
    from llmrun.runners.stats import GenerationStats

    stats = GenerationStats(
        finish_reason="length",
        prompt_tokens=4096,
        reused_tokens=200,
        output_tokens=101,
        template_tokenize_s=0.004,
        prefill_s=46.6,
        first_sample_s=0.001,
        itl_s=(0.01,) * 100,
        e2e_s=50.0,
        load_s=1.0,
    )
    view = turns_view([Turn("a", "x", stats), Turn("b", "y", stats, in_context=False)])
    assert isinstance(view, Fitted)
    return view, ("3896+200", "46,605", "83.6")


TABLES: dict[str, Callable[[], tuple[Fitted, tuple[str, ...]]]] = {
    "sweep": sweep_table,
    "chunks": chunk_table,
    "compare": compare,
    "serving": serving,
    "interference": interference,
    "tune": tuning,
    "models": models,
    "aggregate": aggregate,
    "chat": chat_turns,
}


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("kind", TABLES)
def test_no_table_cuts_a_figure(kind: str, width: int) -> None:
    table, figures = TABLES[kind]()
    out = text_of(table, width)
    assert problems(out, width, figures) == [], out


@pytest.mark.parametrize("kind", TABLES)
def test_the_old_cropping_path_fails_the_same_check(kind: str) -> None:
    """The negative control: each table printed as rich draws it alone, at 40 columns, cuts a
    figure (so the check above can fail, and the figures above are wide enough to matter)."""
    table, figures = TABLES[kind]()
    assert problems(text_of(table.table, 40), 40, figures), kind


@pytest.mark.parametrize("kind", TABLES)
def test_a_table_stays_a_table_where_it_fits(kind: str) -> None:
    table, _ = TABLES[kind]()
    out = text_of(table, 250)
    assert "┃" in out or "─" in out, out  # rich's table, not the stacked blocks


def test_stacked_rows_hang_under_their_values() -> None:
    """Below its width: a block per row, its key at column 0, then `label  value` lines; a value
    that wraps goes on under itself."""
    table, _ = sweep_table()
    out = text_of(table, 40)
    lines = out.splitlines()
    assert "SmolLM2-135M-Instruct.Q8_0" in lines[1:3], out
    start = next(i for i, line in enumerate(lines) if line.startswith("  t/s"))
    value_at = lines[start].index("129,098.7")
    assert lines[start] == "  t/s" + " " * (value_at - 5) + "129,098.7 ± 46,612.3", out
    assert all(line.startswith("  ") or not line.startswith(" ") for line in lines)


def test_the_serving_table_stacks_a_block_per_level() -> None:
    """The serving table's columns are the levels: stacked, each level is a block."""
    table, _ = serving()
    out = text_of(table, 60)
    lines = out.splitlines()
    level = "slots=16 rate=inf prefill-first"
    assert level in lines and lines[lines.index(level) + 1].startswith("  requests completed")


def test_the_bench_header_folds_a_long_path_instead_of_cutting_it() -> None:
    from llmrun.cli.bench.machine import label_grid

    path = "/models/" + "x" * 70 + ".gguf"
    out = text_of(label_grid([("model", path), ("memory", "129,098.7 MB/s")]), 40)
    assert "…" not in out and "".join(line[9:].strip() for line in out.splitlines()[:-1]) == path


def test_every_table_in_cli_goes_through_fitted() -> None:
    """A rich Table built anywhere in cli/ is printed through report.fitted: the function that
    builds it calls fitted, or is called inside a fitted(...) call."""
    root = Path(__file__).resolve().parents[1] / "cli"
    unfitted = []
    for path in root.rglob("*.py"):
        tree = ast.parse(path.read_text())
        wrapped = {
            inner.func.id
            for call in _calls_of(tree, "fitted")
            for inner in call.args
            if isinstance(inner, ast.Call) and isinstance(inner.func, ast.Name)
        }
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef):
                continue
            builds = any(_calls_of(fn, "Table"))
            fits = any(_calls_of(fn, "fitted"))
            if builds and not fits and fn.name not in wrapped:
                unfitted.append(f"{path.name}:{fn.name}")
    assert unfitted == []


def _calls_of(tree: ast.AST, name: str) -> list[ast.Call]:
    """The calls of `name(...)` (a plain name: Table.grid is no table of figures)."""
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == name
    ]


@pytest.mark.parametrize("width", WIDTHS)
def test_bar_charts_keep_their_figures(width: int) -> None:
    """The sweep's and the models' bar charts: with long labels on a narrow terminal, each
    label goes on a line of its own and its bar and figure under it."""
    from llmrun.cli.bench.output import model_chart, sweep_chart

    names = ("SmolLM2-135M-Instruct.Q8_0", "Qwen2.5-0.5B-Instruct.Q4_K_M")
    rows = [
        _row(shape, ts, 1.0, model=name, fa=i)
        for i, name in enumerate(names)
        for shape, ts in (((512, 0), 129_098.7), ((0, 128), 46_612.3))
    ]
    for chart in (sweep_chart(rows), model_chart(rows)):  # type: ignore[arg-type]
        assert chart is not None
        out = text_of(chart, width)
        assert problems(out, width, WIDE) == [], out
        assert "Qwen2.5-0.5B-Instruct.Q4_K_M" in out


def test_history_on_a_40_column_terminal(llmrun_env: dict[str, str]) -> None:
    """`llmrun history` in a real pseudo-terminal 40 columns wide, replayed through a terminal
    emulator: every figure whole on a screen line, no ellipsis."""
    pexpect = pytest.importorskip("pexpect")
    pyte = pytest.importorskip("pyte")
    from llmrun.runners.history import History

    from .conftest import HANG_S, which_llmrun

    record = {
        "test": "pp512",
        "model_name": "SmolLM2-135M-Instruct.Q8_0",
        "n_threads": 16,
        "n_prompt": 512,
        "n_gen": 0,
        "avg_ts": 46_612.3,
        "stddev_ts": 12.9,
    }
    path = Path(llmrun_env["LLMRUN_HOME"]) / "data" / "history.sqlite"
    with History(path) as history:
        for avg_ts in (46_612.3, 129_098.7):
            history.store([{**record, "avg_ts": avg_ts}], kind="local", model="SmolLM2", system={})
    screen = pyte.Screen(40, 200)
    stream = pyte.ByteStream(screen)
    child = pexpect.spawn(
        which_llmrun(),
        ["history"],
        env={**llmrun_env, "COLUMNS": ""},
        dimensions=(24, 40),
        timeout=HANG_S,
    )
    try:
        stream.feed(child.read())
    finally:
        child.close(force=True)
    assert child.exitstatus == 0
    shown = "\n".join(line.rstrip() for line in screen.display).strip()
    assert "…" not in shown, shown
    for figure in ("129,098.7 ± 12.9", "46,612.3 ± 12.9", "+177.0%"):
        assert any(figure in line for line in screen.display), shown
