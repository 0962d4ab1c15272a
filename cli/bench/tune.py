"""`llmrun tune`: search this machine's fastest engine settings for a model, and save them as
the defaults of run, chat and bench. The search is in runners/bench/tuning.py."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Annotated

import typer
from rich.console import Console

from llmrun.cli.engine import make_bench_runner
from llmrun.cli.errors import EXIT_INTERRUPTED, LineConsole, handled, usage_error
from llmrun.cli.options import Model
from llmrun.cli.progress import ProgressLine, Shown, clock
from llmrun.cli.report import Fitted, busy_warning, fitted_table
from llmrun.cli.session import ctrl_c_cancels
from llmrun.cli.terminal import set_verbose
from llmrun.runners.base import BenchRunner
from llmrun.runners.bench import tuning as tn
from llmrun.runners.bench.tuned import check_tuned_file, save_tuned
from llmrun.runners.bench.tuning import REPS, TunePlan, search
from llmrun.runners.config import EngineConfig
from llmrun.runners.errors import BadRequestError, OptionError
from llmrun.runners.progress import eta_s

from .machine import load_and_report


def tune(
    model: Model = None,  # run's and chat's: tune reaches no server
    workload: Annotated[
        str,
        typer.Option(
            "--workload",
            metavar="chat|document|both",
            help="What to optimise: chat (64-token prompt, 256-token answer),"
            " document (1024-token prompt, 16-token answer) or both, each saved.",
        ),
    ] = "both",
    budget: Annotated[
        str | None,
        typer.Option(
            "--budget",
            metavar="TIME",
            show_default=False,
            help="Stop after this long (90s, 5m, 1h30m) and save the fastest"
            " settings measured by then.",
        ),
    ] = None,
    verbose: Annotated[
        bool, typer.Option("-v", "--verbose", help="Show llama.cpp's own log on stderr.")
    ] = False,
) -> None:
    """Search threads, flash attention, repacking, batch/ubatch and prefill threads for this
    model; save the fastest for each --workload as the defaults of run, chat and bench.

    llmrun tune --workload chat --budget 5m

    Ctrl-C (or SIGTERM) stops the search and saves the fastest settings measured so far.
    """
    budget_s: float | None = None
    if budget is not None:
        try:
            budget_s = tn.parse_budget(budget)
        except BadRequestError as e:
            usage_error(str(e))
    with handled():
        err = LineConsole(stderr=True, highlight=False)
        if workload not in ("chat", "document", "both"):
            raise OptionError(f"--workload: '{workload}' is not chat, document or both")
        set_verbose(verbose)
        cancel = threading.Event()
        with ctrl_c_cancels(cancel):
            code = _tune(model, workload, cancel, err, budget_s)
        raise typer.Exit(code)


# The share of the first setting measured before its time is estimated: its first shape, the
# prompt's, whose rates are then kept (the decode shape takes longer: an estimate that errs low)
FIRST_ESTIMATE_SHARE = 0.5


def clock_s() -> float:
    """The budget's clock (a test gives it another)."""
    return time.monotonic()


class Budget:
    """--budget: the search's stop flag is set when the time is spent, counted from the start
    and checked at every step of the search (a few times per repetition)."""

    def __init__(self, seconds: float | None, stop: threading.Event) -> None:
        self.seconds, self.stop = seconds, stop
        self.started_s = clock_s()
        self.spent = threading.Event()

    def left_s(self) -> float | None:
        return (
            None if self.seconds is None else max(0.0, self.seconds - (clock_s() - self.started_s))
        )

    def check(self) -> None:
        if self.left_s() == 0.0 and not self.spent.is_set():
            self.spent.set()
            self.stop.set()


def _tune(
    model: str | None,
    workload: str,
    cancel: threading.Event,
    err: Console,
    budget_s: float | None = None,
) -> int:
    """The staged search, saved as the model's defaults for each workload tuned (the others
    stay as they were); when stopped by Ctrl-C, SIGTERM or --budget, the fastest settings
    measured by then are saved."""
    workloads = tuple(tn.WORKLOADS) if workload == "both" else (workload,)
    check_tuned_file()  # a file the save would refuse is refused before minutes of measuring
    budget = Budget(budget_s, cancel)
    runner = make_bench_runner(model, EngineConfig(), tuned=False)
    try:
        load_and_report(runner, err, bandwidth=False, cancel=cancel, tuning=True)  # no efficiency
        start = tn.start_threads()  # run's choice: on a busy machine, the cores left free
        if start.reduced:
            err.print(f"llmrun: threads {start.why}", markup=False, emoji=False)
        found = show_search(
            runner, runner.config, err, cancel, workloads, budget, threads=start.threads
        )
    finally:
        runner.close()
    by_budget = budget.spent.is_set()
    why = f"the --budget of {clock(budget_s or 0)} was spent" if by_budget else "tuning interrupted"
    if found is None or (found.stopped and found.trials < 2):
        if not cancel.is_set():
            raise BadRequestError("tuning measured nothing: llmrun's defaults did not run")
        what = "only llmrun's defaults were measured"
        if found is None:
            what = "nothing was measured"
        elif not found.trials:  # its rates are in the table above
            what = "the first setting was measured in part"
        err.print(f"{why}: {what}; nothing saved", markup=False)
        return 1 if by_budget else EXIT_INTERRUPTED
    chosen = found.chosen
    if found.stopped:
        partial = f"{'stopped by --budget' if by_budget else 'interrupted'} after {found.trials}"
        chosen = {w: {**c, "partial": f"{partial} trials"} for w, c in chosen.items()}
    path = save_tuned(runner.model_path, chosen)
    for name, c in found.chosen.items():
        err.print(
            f"fastest for {name}: {c['n_threads']} threads ({c['n_threads_batch']}"
            f" for prefill), batch {c['n_batch']}, ubatch {c['n_ubatch']}, flash"
            f" attention {c['flash_attn']}, repacking"
            f" {'on' if c['repack'] else 'off'}",
            markup=False,
        )
    if found.stopped:
        err.print(
            f"{why}: saved the best of {found.trials} trials measured to {path}; run"
            " `llmrun tune` again to finish the search.",
            markup=False,
        )
        return 0 if by_budget else EXIT_INTERRUPTED
    err.print(
        f"saved to {path}. chat and run start from the chat settings, `run -f FILE` from"
        " the document ones (shown as 'tuned for ...').",
        markup=False,
    )
    return 0


def tried_table(tried: Sequence[tn.Tried], workloads: Sequence[str]) -> Fitted:
    """Every setting the search tried, in order, with its rates, scores and noise."""
    scores = (f"{w} score" for w in workloads)
    heads = ["stage", "settings", "pp t/s", "tg t/s", *scores, "spread", "verdict"]
    left = ("stage", "settings", "verdict")
    table = fitted_table("tuning: the settings measured", heads, left, wrap=("settings", "verdict"))
    for t in tried:
        busy = "busy machine: may be noise"
        table.add_row(
            t.stage,
            t.combo.describe(),
            f"{t.pp_ts:,.1f}" if t.pp_ts else "-",
            f"{t.tg_ts:,.1f}" if t.tg_ts else "-",
            *(f"{t.score(w):,.1f}" if t.samples else "-" for w in workloads),
            f"±{t.spread(workloads[0]) / 2:.0%}" if t.samples else "-",
            "; ".join(n for n in (t.note, busy if t.busy else "") if n),
        )
    return table


def show_search(
    runner: BenchRunner,
    base: EngineConfig,
    err: Console,
    cancel: threading.Event,
    workloads: Sequence[str] = tuple(tn.WORKLOADS),
    budget: Budget | None = None,
    *,
    threads: int | None = None,
) -> tn.Found | None:
    """Run the tuning search with its progress line (stage, trials done of those expected,
    time taken, an estimate of the time left, the budget left), then show every setting it
    tried, each once, with its noise."""
    with ProgressLine(err) as line:
        found = search(
            runner,
            base,
            TunePlan(workloads=workloads, threads=threads),
            cancel=cancel,
            on_progress=_SearchProgress(line, err, budget).update,
            on_stage=lambda name: err.print(f"tuning {name} ...", markup=False),
        )
    if found is not None:
        _show_found(found, workloads, err)
    return found


class _SearchProgress:
    """The search's progress on its line, and the budget's check at each step: a budget too
    short for the first setting stops the search with what was measured."""

    def __init__(self, line: ProgressLine, err: Console, budget: Budget | None) -> None:
        self.line, self.err, self.budget = line, err, budget
        self.started = time.monotonic()
        self.last: tn.TuneProgress | None = None

    def view(self, now_s: float) -> Shown:
        p = self.last
        assert p is not None
        elapsed = now_s - self.started
        left = self.budget.left_s() if self.budget is not None else None
        return Shown(
            p.stage,
            p.trials,
            p.planned,
            "trials",
            elapsed,
            eta_s(elapsed, p.fraction),
            "" if left is None else f"budget {clock(left)} left",
        )

    def update(self, p: tn.TuneProgress) -> None:
        if self.last is None:
            self.line.follow(p.stage, self.view)
        self.last = p
        budget = self.budget
        if budget is not None:
            budget.check()
            if budget.seconds is not None and p.trials == 0 and p.share >= FIRST_ESTIMATE_SHARE:
                self._too_short(budget, budget.seconds, p.share)

    def _too_short(self, budget: Budget, seconds: float, share: float) -> None:
        """The first setting's part measured shows that the budget cannot hold it whole:
        say so, and stop with what was measured (the budget waited to its end, at 0 trials)."""
        trial_s = (clock_s() - budget.started_s) / share
        if trial_s <= seconds or budget.spent.is_set():
            return
        budget.spent.set()
        budget.stop.set()
        self.err.print(
            f"llmrun: one setting takes about {clock(trial_s)} to measure here ({REPS}"
            f" repetitions of each shape), more than the --budget of {clock(seconds)}"
            " holds: stopping with what was measured (give --budget"
            f" {clock(trial_s * 10)} or more, or tune when the machine is quiet)",
            markup=False,
        )


def _show_found(found: tn.Found, workloads: Sequence[str], err: Console) -> None:
    """Every setting tried, a busy machine's warning, and how the settings were compared."""
    err.print(tried_table([*found.tried, *found.cut], workloads))
    if found.busy:
        worst = max(t.background_cpus or 0.0 for t in found.busy)
        most = max(max(t.combo.n_threads or 1, t.combo.n_threads_batch or 1) for t in found.busy)
        settings = len(found.tried) + len(found.cut)
        warning = busy_warning(worst, most, f"{len(found.busy)} of {settings} settings")
        err.print(warning, markup=False, emoji=False)
    shapes = " and ".join(s.name for s in tn.SHAPES)
    kinds = "; ".join(
        f"{w}: a {p}-token prompt and a {g}-token answer"
        for w, (p, g) in tn.WORKLOADS.items()
        if w in workloads
    )
    err.print(
        f"Measured: {shapes}, {REPS} repetitions per setting. A workload's score is its"
        f" request's tokens per second of its time ({kinds}), from each repetition's"
        " prompt and output rates. An alternative replaces the setting before it only"
        " when its median score is above that setting's best (else: within the noise, and"
        " the earlier setting stays). The first row is llmrun's defaults, what run uses"
        " when given no option (physical or performance cores, batch 512, flash attention"
        " auto: llama.cpp's choice for the device, repacking where probed safe); llama.cpp's"
        " own defaults are batch 2048 and flash attention auto.",
        markup=False,
    )
