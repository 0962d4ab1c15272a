"""`llmrun run`: one-shot generation from arguments, stdin, files or JSONL, for pipelines."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import shutil
import signal
import stat
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Annotated, TextIO

import typer
from rich.console import Console
from rich.text import Text

from llmrun.runners.base import Event, Finished, Runner, SamplingParams
from llmrun.runners.config import EngineConfig
from llmrun.runners.errors import BadRequestError, LlmrunError
from llmrun.runners.lists import whole
from llmrun.runners.stats import FINISH_INCOMPLETE, Aggregate, GenerationStats, rate

from . import options as o
from .dashboard import Dashboard, TerminalConsole, render
from .errors import (
    EXIT_BROKEN_PIPE,
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    DisplayThatMayFail,
    handled,
    incomplete_message,
    message,
    quiet_broken_pipe,
    usage_error,
)
from .inputs import Job, collect_jobs, output_file
from .progress import PlainPhases
from .records import OptionRecord, takes_records
from .report import (
    aggregate_table,
    append_stats_file,
    context_note,
    ms,
    ran_busy,
    stats_json,
    stats_record,
    summary_lines,
    tps,
)
from .session import (
    EventView,
    KeysHeld,
    TextOut,
    TextSink,
    ctrl_c_cancels,
    drive,
    dumb_terminal,
    handling,
    live_terminal,
    thinking_route,
)
from .terminal import fold, say, terminal_line, terminal_width


class StatsFormat(str, Enum):
    text = "text"
    json = "json"


@dataclass(frozen=True, kw_only=True)
class Prompts(OptionRecord):
    """Where the prompts come from, and how they are sent."""

    prompt: Annotated[
        list[str] | None,
        typer.Argument(help="The prompt; with piped stdin, the instruction for that material."),
    ] = None
    text: Annotated[
        str | None,
        typer.Option(
            "-p", "--prompt", help="The prompt as llama.cpp's -p gives it (or the argument)."
        ),
    ] = None
    file: Annotated[
        list[Path] | None,
        typer.Option(
            "-f", "--file", help="Read a prompt from FILE (repeatable: one request each)."
        ),
    ] = None
    jsonl: Annotated[
        Path | None,
        typer.Option(
            "--jsonl",
            help='One request per line: {"prompt": ...} or '
            '{"messages": [...]}, with optional per-line options.',
        ),
    ] = None
    system: o.System = None
    raw: Annotated[
        bool, typer.Option("--raw", help="Send the text as a plain completion, no chat template.")
    ] = False

    def words(self) -> list[str]:
        """The prompt's words: the argument's, or -p's (llama-cli's habit), not both."""
        if self.text is None:
            return self.prompt or []
        if self.prompt:
            usage_error("-p/--prompt: give the prompt once, as -p or as the argument, not both")
        return [self.text]


@dataclass(frozen=True, kw_only=True)
class Report(OptionRecord):
    """What is printed where: the text, the stats, the dashboard."""

    quiet: Annotated[bool, typer.Option("-q", "--quiet", help="No stats on stderr.")] = False
    no_dashboard: o.NoDashboard = False
    stats: Annotated[
        StatsFormat,
        typer.Option(
            "--stats", help="Stats on stderr as a text summary or one JSON object per request."
        ),
    ] = StatsFormat.text
    stats_file: Annotated[
        Path | None,
        typer.Option(
            "--stats-file",
            help="Append every request's stats to PATH as JSON lines.",
            metavar="PATH",
        ),
    ] = None
    json_out: Annotated[
        bool,
        typer.Option(
            "--json",
            help="Print one JSON object per request (text and stats) on stdout "
            "instead of streaming the text.",
        ),
    ] = False


@takes_records
def run(
    *,
    prompts: Prompts,
    report: Report,
    parallel: Annotated[
        int,
        typer.Option(
            "-np",
            "--parallel",
            min=1,
            max=64,
            help="Serve the prompts (--jsonl, several -f) N at a time in one llama.cpp context"
            " (continuous batching); each keeps its own stats, and the total throughput is"
            " printed. (default: 1, one after another)",
            show_default=False,
        ),
    ] = 1,
    kv_unified: o.KvUnified = None,
    json_schema: o.JsonSchemaFile = None,
    grammar: o.GrammarFile = None,
    generation: o.GenerationOptions,
) -> None:
    """Generate text for a prompt and report load, prefill and decode separately.

    The text streams to stdout; stats go to stderr. Examples:

      llmrun run "Why is the sky blue?"

      cat notes.txt | llmrun run "Summarize this" -n 200

      llmrun run --jsonl prompts.jsonl --stats-file stats.jsonl -q
    """
    DisplayThatMayFail.install()  # the text reaches stdout and --stats-file all the same
    with handled():
        params, config = generation.settings(prompts.system)
        params = _with_grammar(params, generation, json_schema, grammar)
        jobs = collect_jobs(
            words=prompts.words(),
            files=prompts.file or [],
            jsonl=prompts.jsonl,
            system=prompts.system,
            raw=prompts.raw,
            sampling=params,
        )
        quiet = report.quiet
        if prompts.file:  # a document: the settings --tune found for long prompts, where saved
            config = dataclasses.replace(config, workload="document")
        config = _with_parallel(config, generation, parallel, kv_unified)
        if report.stats_file is not None:  # before the load: a bad name cost the whole run
            output_file("--stats-file", report.stats_file, "stats.jsonl")
        runner = generation.runner(config, quiet=quiet)
        try:
            served, cut_short = (
                _serve_in_parallel(runner, jobs, parallel, quiet=quiet, n_ctx=config.n_ctx)
                if parallel > 1
                else (None, False)
            )
            printing = Printing(
                report=report,
                reply=generation.reply,
                dashboard=not report.no_dashboard and parallel == 1,
                asked_ctx=config.n_ctx,
            )
            code = _run_jobs(runner, jobs, printing, served=served)
        finally:
            runner.close()
        if code == EXIT_BROKEN_PIPE:
            quiet_broken_pipe()
        raise typer.Exit(EXIT_INTERRUPTED if cut_short and code != EXIT_BROKEN_PIPE else code)


def _with_grammar(
    params: SamplingParams,
    generation: o.GenerationOptions,
    json_schema: Path | None,
    grammar: Path | None,
) -> SamplingParams:
    """The sampling with --json-schema's or --grammar's grammar: refused against a server and
    with speculative decoding, which does not check drafts against it."""
    given = {"--json-schema": json_schema, "--grammar": grammar}
    o.refuse_for_endpoint(generation.remote.endpoint, given)
    if generation.reply.draft or generation.reply.draft_model:
        o.refuse_given(given, "speculative decoding does not check drafts against it")
    if params.stop and (json_schema or grammar):  # a stop string would cut the grammar's JSON
        flag = "--json-schema" if json_schema else "--grammar"
        usage_error(
            f"--stop, {flag}: a stop string cuts the answer the grammar keeps whole;"
            " give one or the other"
        )
    return dataclasses.replace(params, grammar=o.read_grammar(json_schema, grammar))


def _with_parallel(
    config: EngineConfig, generation: o.GenerationOptions, parallel: int, kv_unified: bool | None
) -> EngineConfig:
    """The engine for --parallel's batched context (with -kvu's KV layout): refused against a
    server, with speculation (one token per sequence and step), and -kvu without it."""
    reply = generation.reply
    kvu_given = None if kv_unified is None else "given"  # --no-kv-unified counts
    o.refuse_for_endpoint(
        generation.remote.endpoint,
        {"--parallel": parallel if parallel > 1 else None, "-kvu/--kv-unified": kvu_given},
    )
    if parallel == 1:
        o.refuse_given(
            {"-kvu/--kv-unified": kvu_given},
            "the KV layout of several sequences; only with --parallel N",
        )
        return config
    o.refuse_given(
        {"--draft": reply.draft, "--draft-model": reply.draft_model},
        "--parallel does not speculate; drop one or the other",
    )
    return dataclasses.replace(config, kv_unified=kv_unified is True)


def _serve_in_parallel(
    runner: Runner, jobs: list[Job], parallel: int, *, quiet: bool, n_ctx: int | None
) -> tuple[Iterator[Iterator[Event]] | None, bool]:
    """Every job's request served at once, `parallel` at a time; returns, per request in
    order, its events for the usual printing (a request that failed alone fails there, in its
    turn), and whether Ctrl-C cut the run short. Says the total throughput."""
    from llmrun.runners.llamacpp import LlamaCppRunner
    from llmrun.runners.serving.parallel import ParallelRun, serve_requests

    if not isinstance(runner, LlamaCppRunner):
        raise BadRequestError("--parallel needs a local model")
    requests = [job.request for job in jobs if job.error is None and job.request is not None]
    if not requests:
        return None, False
    cancel = threading.Event()
    with ctrl_c_cancels(cancel):
        outcomes, seconds = serve_requests(
            runner, requests, n_seq=parallel, n_ctx=n_ctx, cancel=cancel
        )
    served = ParallelRun(tuple(outcomes), seconds, cancel.is_set())
    finished = [f for f in served.outcomes if isinstance(f, Finished)]
    if not quiet:
        tokens = sum(f.stats.output_tokens for f in finished)
        prompt = sum(f.stats.prompt_tokens for f in finished)
        left = len(requests) - len(finished)
        cut = f" (interrupted: {left} not served)" if served.interrupted else ""
        say(
            f"parallel {parallel}: {len(finished)} requests in {ms(seconds)}:"
            f" {tps(rate(tokens, seconds))} output, {tps(rate(tokens + prompt, seconds))} in all"
            f" (prompt and output tokens){cut}"
        )
    return served.events(), served.interrupted


def stdout_may_reach_this_terminal() -> bool:
    """Whether text on stdout may land on the terminal that stderr draws on without being the
    terminal itself: a pipe or socket (`| cat`, `| tee out.txt`, `| less`), whose reader prints
    it there. A live panel on stderr would redraw over those lines. A regular file or
    /dev/null cannot."""
    if sys.stdout is None or sys.stdout.isatty():
        return False
    try:
        mode = os.fstat(sys.stdout.fileno()).st_mode
    except (OSError, ValueError):
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)


PAGERS = ("less", "more", "most", "pg", "moar", "ov", "bat")


def pager_reading_stdout() -> int | None:
    """The process id of a pager reading our stdout through a pipe (`| less`), on Linux."""
    if not stdout_may_reach_this_terminal() or not os.path.isdir("/proc/self/fd"):
        return None
    try:
        pipe = f"pipe:[{os.fstat(sys.stdout.fileno()).st_ino}]"
        group = os.getpgrp()
    except (OSError, ValueError):
        return None
    names = {*PAGERS, os.path.basename(os.environ.get("PAGER", "").split(" ")[0])} - {""}
    for entry in os.scandir("/proc"):
        if whole(entry.name) in (None, os.getpid()):
            continue
        try:
            stat_line = Path(f"/proc/{entry.name}/stat").read_text()
            fields = stat_line.rsplit(")", 1)[1].split()
            if int(fields[2]) != group:  # a pipeline is one process group
                continue
            if os.readlink(f"/proc/{entry.name}/fd/0") != pipe:
                continue
            comm = stat_line[stat_line.index("(") + 1 : stat_line.rindex(")")]
        except (OSError, ValueError, IndexError):
            continue
        return int(entry.name) if comm in names else None
    return None


def _after_the_pager(pid: int, text: str) -> None:
    """End our stdout (the pager shows its end), wait for the pager to quit, then print what
    was held for stderr, so it stays on the screen."""
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.flush()
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    with handling(signal.SIGINT, signal.SIG_IGN):  # Ctrl-C in the pager is its own
        while os.path.exists(f"/proc/{pid}"):
            with contextlib.suppress(OSError):
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
                if state == "Z":
                    break
            time.sleep(0.1)
    sys.stderr.write(text)
    sys.stderr.flush()


@dataclass(frozen=True, kw_only=True)
class Printing:
    """What a run prints where, as its options asked: built by `run`, read by `_run_jobs`."""

    report: Report
    reply: o.ReplyOptions  # where the thinking goes
    dashboard: bool
    asked_ctx: int | None


@dataclass
class _Screens:
    """Where the text and the stats go: stdout's sink, stderr (or what is held for after a
    pager), the width plain lines fold at, and the live view if there is one."""

    out: TextSink
    errfile: TextIO
    err: Console
    width: int | None  # None: a pipe or a file, lines kept whole
    held: io.StringIO | None
    pager: int | None
    dash: Dashboard | None
    final_panel: bool  # the closing summary as the dashboard draws it, without a live view
    view: EventView | None


def _screens(printing: Printing, cancel: threading.Event) -> _Screens:
    """The screens for this terminal (or pipe, file, pager) and these options."""
    quiet = printing.report.quiet
    out: TextSink = TextOut(cancel=cancel)
    pager = pager_reading_stdout() if not quiet else None
    # Behind a pager, stderr would draw over its screen and be gone after `q`: the stats are
    # held and printed once the pager has quit.
    held = io.StringIO() if pager is not None else None
    errfile: TextIO = held or sys.stderr
    err = Console(
        file=errfile,
        highlight=False,
        soft_wrap=True,
        force_terminal=live_terminal(sys.stderr) if held else None,
        width=shutil.get_terminal_size().columns if held else None,
    )
    # plain lines on a terminal are folded at spaces; in a pipe or a file they stay whole
    width = shutil.get_terminal_size().columns if held else terminal_width()
    dash: Dashboard | None = None
    final_panel = False
    if printing.dashboard and not quiet and live_terminal(sys.stderr):
        if stdout_may_reach_this_terminal():
            final_panel = True  # `| cat`, `| tee`: live redraws would erase the piped text
        else:
            dash = Dashboard(
                TerminalConsole(stderr=True, highlight=False),
                show_text=live_terminal(sys.stdout) and not printing.report.json_out,
            )
            if dash.show_text:
                out = dash
    view: EventView | None = dash
    if dash is None and not final_panel and not quiet and held is None and dumb_terminal():
        view = PlainPhases(errfile)  # no live view: the load and prefill say they started
    return _Screens(out, errfile, err, width, held, pager, dash, final_panel, view)


def _print_stats(
    s: GenerationStats, job: Job, printing: Printing, screens: _Screens, *, many: bool
) -> None:
    """One request's stats on stderr, as --stats asked and the screen allows."""
    err = screens.err
    if printing.report.stats is StatsFormat.json:
        print(stats_json(s, job.id), file=screens.errfile, flush=True)
        return
    if many:
        err.print(Text(terminal_line(job.label), style="bold"))
    if screens.dash is not None:
        screens.dash.console.print(render(s))
    elif screens.final_panel:
        err.print(render(s))
    else:
        for line in summary_lines(s, screens.width):
            err.print(line, markup=False)


def _run_jobs(
    runner: Runner,
    jobs: list[Job],
    printing: Printing,
    *,
    served: Iterator[Iterator[Event]] | None = None,
) -> int:
    cancel = threading.Event()
    screens = _screens(printing, cancel)
    out, errfile, err, width = screens.out, screens.errfile, screens.err, screens.width
    report, reply = printing.report, printing.reply
    view, quiet, json_out = screens.view, report.quiet, report.json_out
    stats_file = report.stats_file
    thinking = thinking_route(
        hide=reply.hide_thinking, on_stdout=reply.thinking_stdout, dash=screens.dash
    )
    many = len(jobs) > 1
    done: list[GenerationStats] = []
    failed = False
    with ctrl_c_cancels(cancel), KeysHeld(screens.dash):
        for job in jobs:
            if job.error is not None or job.request is None:
                print(
                    terminal_line(f"llmrun: error: {job.label}: {job.error}"),
                    file=errfile,
                    flush=True,
                )
                failed = True
                continue
            try:
                finished = drive(
                    runner,
                    job.request,
                    out=None if json_out else out,
                    view=view,
                    cancel=cancel,
                    thinking=thinking,
                    events=None if served is None else next(served),
                )
            except LlmrunError as e:
                if not many or runner.loaded is None:
                    raise
                print(message(e).replace("error: ", f"error: {job.label}: ", 1), file=errfile)
                failed = True
                continue
            finally:
                if view is not None:
                    view.close()
            s = finished.stats
            note = None
            if not done and s.settings is not None and not quiet:
                note = context_note(printing.asked_ctx, s.settings.n_ctx)
            done.append(s)
            if json_out:
                record = {"id": job.id, "text": finished.text, "stats": stats_record(s, job.id)}
                out.write(json.dumps(record, ensure_ascii=False) + "\n")
            else:
                out.end_line()
                if many:
                    out.write("\n")
            if note:  # after the text's line, so a shared terminal or `2>&1` keeps them apart
                print(fold(note, width), file=errfile, flush=True)
            if stats_file is not None:  # before stderr, which a closed terminal (SIGHUP) fails
                append_stats_file(stats_file, [stats_json(s, job.id)])
            if not quiet:
                _print_stats(s, job, printing, screens, many=many)
            if s.finish_reason == FINISH_INCOMPLETE:
                print(fold(incomplete_message(s), width), file=errfile)
                failed = True
                break
            # Ctrl-C here stops the rest; a request --parallel's interrupt cut does not
            if out.closed or (s.interrupted and cancel.is_set()):
                break
    if len(done) > 1 and not quiet and not out.closed:
        err.print(aggregate_table(Aggregate.of(done), busy=sum(map(ran_busy, done))))
    if screens.held is not None and screens.pager is not None:
        _after_the_pager(screens.pager, screens.held.getvalue())
    if out.closed:
        return EXIT_BROKEN_PIPE
    if cancel.is_set():
        return EXIT_INTERRUPTED
    return EXIT_ERROR if failed else 0
