"""`llmrun tune`: search this machine's fastest engine settings for a model, and save them as
the defaults of run, chat and bench. The search is in runners/bench/tuning.py."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from llmrun.cli.engine import make_bench_runner
from llmrun.cli.errors import EXIT_INTERRUPTED, handled
from llmrun.cli.report import Fitted, fitted
from llmrun.cli.session import ctrl_c_cancels
from llmrun.runners.base import BenchRunner
from llmrun.runners.bench import tuning as tn
from llmrun.runners.bench.tuning import REPS, save_tuned, search
from llmrun.runners.config import EngineConfig
from llmrun.runners.errors import BadRequestError
from llmrun.runners.library import set_verbose

from .serve import Model1
from .sweep import load_and_report


def tune(
    model: Model1 = None,
    workload: Annotated[
        str, typer.Option("--workload", metavar="chat|document|both",
                          help="What to optimise: chat (64-token prompt, 256-token answer),"
                          " document (1024-token prompt, 16-token answer) or both, each saved."),
    ] = "both",
    verbose: Annotated[
        bool, typer.Option("-v", "--verbose", help="Show llama.cpp's own log on stderr."),
    ] = False,
) -> None:  # fmt: skip
    """Search threads, flash attention, repacking, batch/ubatch and prefill threads for this
    model; save the fastest for each --workload as the defaults of run, chat and bench.

    llmrun tune --workload chat
    """
    with handled():
        err = Console(stderr=True, highlight=False)
        if workload not in ("chat", "document", "both"):
            raise BadRequestError(f"--workload: '{workload}' is not chat, document or both")
        set_verbose(verbose)
        cancel = threading.Event()
        with ctrl_c_cancels(cancel):
            code = _tune(model, workload, cancel, err)
        raise typer.Exit(code)


def _tune(model: str | None, workload: str, cancel: threading.Event, err: Console) -> int:
    """The staged search, saved as the model's defaults
    for each workload tuned (the others stay as they were)."""
    workloads = tuple(tn.WORKLOADS) if workload == "both" else (workload,)
    runner = make_bench_runner(model, EngineConfig(), tuned=False)
    try:
        load_and_report(runner, err, bandwidth=False)  # tuning reports no efficiency
        best = show_search(runner, runner.config, err, cancel, workloads)
    finally:
        runner.close()
    if best is None:
        err.print("tuning interrupted; nothing saved")
        return EXIT_INTERRUPTED
    path = save_tuned(runner.model_path, best)
    for name, found in best.items():
        err.print(f"fastest for {name}: {found['n_threads']} threads ({found['n_threads_batch']}"
                  f" for prefill), batch {found['n_batch']}, ubatch {found['n_ubatch']}, flash"
                  f" attention {found['flash_attn']}, repacking"
                  f" {'on' if found['repack'] else 'off'}", markup=False)  # fmt: skip
    err.print(f"saved to {path}. chat and run start from the chat settings, `run -f FILE` from"
              " the document ones (shown as 'tuned for ...').", markup=False)  # fmt: skip
    return 0


def tried_table(tried: Sequence[tn.Tried], workloads: Sequence[str]) -> Fitted:
    """Every setting the search tried, in order, with its rates, scores and noise."""
    table = Table(title="tuning: every setting tried", title_justify="left")
    heads = ["stage", "settings", "pp t/s", "tg t/s", *(f"{w} score" for w in workloads),
             "spread", "verdict"]  # fmt: skip
    for col in heads:
        left = col in ("stage", "settings", "verdict")
        table.add_column(col, justify="left" if left else "right")
    for t in tried:
        table.add_row(t.stage, t.combo.describe(), f"{t.pp_ts:,.1f}" if t.pp_ts else "-",
                      f"{t.tg_ts:,.1f}" if t.tg_ts else "-",
                      *(f"{t.score(w):,.1f}" for w in workloads),
                      f"±{t.spread(workloads[0]) / 2:.0%}", t.note)  # fmt: skip
    return fitted(table, wrap=("settings", "verdict"))


def show_search(
    runner: BenchRunner,
    base: EngineConfig,
    err: Console,
    cancel: threading.Event,
    workloads: Sequence[str] = tuple(tn.WORKLOADS),
) -> dict[str, dict[str, Any]] | None:
    """Run the tuning search and show every setting it tried, each once, with its noise."""
    found = search(runner, base, cancel=cancel, workloads=workloads,
                   on_stage=lambda name: err.print(f"tuning {name} ...", markup=False))  # fmt: skip
    if found is None:
        return None
    best, tried = found
    err.print(tried_table(tried, workloads))
    shapes = " and ".join(s.name for s in tn.SHAPES)
    kinds = "; ".join(f"{w}: a {p}-token prompt and a {g}-token answer"
                      for w, (p, g) in tn.WORKLOADS.items() if w in workloads)  # fmt: skip
    err.print(f"Measured: {shapes}, {REPS} repetitions per setting. A workload's score is its"
              f" request's tokens per second of its time ({kinds}), from each repetition's"
              " prompt and output rates. An alternative replaces the setting before it only"
              " when its median score is above that setting's best (else: within the noise, and"
              " the earlier setting stays). The first row is llmrun's defaults (physical or"
              " performance cores, batch 512, no flash attention, repacking where probed safe);"
              " llama.cpp's own defaults are batch 2048 and flash attention auto.",
              markup=False)  # fmt: skip
    return best
