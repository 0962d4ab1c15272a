"""`llmrun bench interference`: one decoding stream alone, then while long prompts arrive: in
process under each scheduling policy, or against a server (--endpoint). The measuring is in
runners/serving/; this module shows it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.text import Text

from llmrun.cli import options as o
from llmrun.cli.dashboard import sparkline
from llmrun.cli.errors import EXIT_INTERRUPTED, handled
from llmrun.cli.records import OptionRecord, takes_records
from llmrun.cli.report import Fitted, busy_warning, fitted_table
from llmrun.cli.session import ctrl_c_cancels
from llmrun.runners.serving.interference import InterferenceReport
from llmrun.runners.serving.options import (
    DEFAULT_POLICIES,
    MAX_INPUT_LEN,
    MAX_OUTPUT_LEN,
    InterferenceOptions,
    parse_policies,
)

from . import output as out
from .serving import (
    LOCAL,
    Model1,
    Output,
    Policies,
    Screen,
    Server,
    ServingEngineOptions,
    _opt,
    local_runner,
    refuse_remote_only,
    run_stages,
)

Format = out.OutputFormat | None

if TYPE_CHECKING:
    from llmrun.runners.serving import load as sv

LAB = "The long prompts"


@dataclass(frozen=True, kw_only=True)
class LabOptions(OptionRecord):
    """The steady stream and the long prompts that interrupt it."""

    rate: Annotated[
        float,
        _opt("Long prompts per second.", "--rate", "--interference-rate", min=0.01, panel=LAB),
    ] = 2.0
    prompt_len: Annotated[
        int,
        _opt(
            "Tokens per long prompt.",
            "--prompt-len",
            "--interference-prompt-len",
            min=1,
            max=MAX_INPUT_LEN,
            panel=LAB,
        ),
    ] = 512
    output_len: Annotated[
        int,
        _opt(
            "Tokens the stream decodes (a server's: at least 64).",
            "--output-len",
            min=1,
            max=MAX_OUTPUT_LEN,
            panel=LAB,
        ),
    ] = 64
    input_len: Annotated[
        int,
        _opt(
            "A server's steady client: its prompt length (a short one).",
            "--input-len",
            min=1,
            max=64,
            panel="Against a server (--endpoint)",
        ),
    ] = 64
    num_prompts: Annotated[
        int,
        _opt(
            "Long prompts, each in a sequence of its own.",
            "--num-prompts",
            min=1,
            max=8,
            panel=LOCAL,
        ),
    ] = 8

    def interference_options(self, *, seed: int, policies: str | None) -> InterferenceOptions:
        """The job's record; the local engine's policies parsed where there is no server."""
        parsed = () if policies is None else parse_policies(policies)
        return InterferenceOptions(**vars(self), seed=seed, policies=parsed)


@takes_records
def interference(
    model: Model1 = None,
    *,
    remote: o.RemoteOptions,
    lab: LabOptions,
    policy: Policies = DEFAULT_POLICIES,
    plot: Annotated[
        str | None,
        _opt(
            "Also draw the stream's timeline into a PNG file.",
            "--plot",
            metavar="FILE.png",
            panel=LOCAL,
        ),
    ] = None,
    engine: ServingEngineOptions,
    seed: o.PromptSeed = 1234,
    output: Output = None,
) -> None:
    """Prefill-decode interference: a decoding stream's gaps alone and while long prompts arrive.

    llmrun bench interference --policy prefill-first,chunked:64   # this machine, in process

    llmrun bench interference --endpoint http://127.0.0.1:8080
    """
    with handled():
        endpoint = remote.endpoint
        options = lab.interference_options(seed=seed, policies=None if endpoint else policy)
        screen = Screen.open(output)
        with ctrl_c_cancels(screen.cancel):
            if endpoint:
                engine.refuse_for(endpoint)
                o.refuse_given(
                    {
                        "--policy": policy != DEFAULT_POLICIES,
                        "--num-prompts": lab.num_prompts != 8,
                        "--plot": plot,
                    },
                    "the local engine's; not with --endpoint",
                )
                server = Server(endpoint, model, remote.api_key, remote.timeout)
                code = _remote(server, options, screen, output)
            else:
                refuse_remote_only(remote, {"--input-len": lab.input_len != 64})
                from .plot import plot_file

                code = _local(model, options, screen, output, plot_file(plot), engine)
        raise typer.Exit(code)


def _remote(server: Server, options: InterferenceOptions, screen: Screen, output: Format) -> int:
    from llmrun.runners.serving import load as sv

    runner, _ = server.connect(screen.err)
    try:
        found = list(
            run_stages(
                sv.interfere_remote(runner, options, cancel=screen.cancel),
                screen.err,
                "interference ...",
            )
        )
    finally:
        runner.close()
    failed = [(which, why) for f in found for which, why in f.measured.failed]
    for f in found:
        if not f.measured.failed:
            screen.show.print(interference_sentence(f), markup=False)
    _print([f.record() for f in found], output)
    if screen.cancel.is_set():
        return EXIT_INTERRUPTED
    if not failed:
        return 0
    # as `bench serve` counts a failed request: no figures from it; one line for all (it was a
    # line each, the same 404 twice)
    whys = list(dict.fromkeys(why for _, why in failed))
    text = (
        f"{' and '.join(which for which, _ in failed)} failed: {whys[0]}"
        if len(whys) == 1
        else "failed: " + "; ".join(f"{which}: {why}" for which, why in failed)
    )
    screen.err.print(
        f"llmrun: error: the steady client's request {text}",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )
    return 1


def _print(records: Sequence[dict[str, Any]], output: Format) -> None:
    """The records on stdout (see `out.print_records`); md: a plain table of their fields."""
    out.print_records(records, output, table="llmrun_interference", md_columns=())


def interference_sentence(result: sv.InterferenceResult) -> str:
    rec = result.measured.record()
    return (
        f"interference: the steady client's ITL p50 {rec['itl_p50_alone_ms']} ms alone,"
        f" {rec['itl_p50_loaded_ms']} ms under prefill load (x{rec['itl_p50_ratio']});"
        f" p99 {rec['itl_p99_alone_ms']} -> {rec['itl_p99_loaded_ms']} ms"
        f" (x{rec['itl_p99_ratio']}); its TTFT {rec['ttft_alone_ms']} -> {rec['ttft_loaded_ms']}"
        f" ms; {rec['background_requests']} long prompts sent"
        + (
            f"; prompt tokens the server took from its cache: {rec['cached_tokens_alone']}"
            f" alone, {rec['cached_tokens_loaded']} loaded"
            if rec["cached_tokens_alone"] or rec["cached_tokens_loaded"]
            else ""
        )
    )


def _local(
    model: str | None,
    options: InterferenceOptions,
    screen: Screen,
    output: Format,
    plot: Path | None,
    engine: ServingEngineOptions,
) -> int:
    from llmrun.runners.serving.local import interfere_local

    runner = local_runner(model, "bench interference without --endpoint", engine)
    try:
        loaded = runner.load(cancel=screen.cancel)  # Ctrl-C ends the probe and the load too
        name = loaded.model.name if loaded.model else ""
        stages = interfere_local(runner, options, cancel=screen.cancel)
        reports: list[InterferenceReport] = list(run_stages(stages, screen.err, "loading ..."))
    finally:
        runner.close()
    kv_unified = engine.kv_unified is True
    records = [{**interference_record(r, name), "kv_unified": kv_unified} for r in reports]
    _print(records, output)
    if output is None:
        screen.show.print(_table(reports))
        for r in reports:
            screen.show.print(
                Text.assemble(f"{r.policy:<14} ", (sparkline(list(r.stream_itl_ms)), "magenta"))
            )
    for line in verdict(reports):
        screen.err.print(line, markup=False)
    if plot is not None and reports:
        from .plot import plot_timeline

        plot_timeline(reports, plot)
        screen.err.print(f"timeline written to {plot}", markup=False)
    return EXIT_INTERRUPTED if screen.cancel.is_set() else 0


def interference_record(r: InterferenceReport, model: str) -> dict[str, Any]:
    """The report as a row for the output formats."""
    prefill_steps = [s for s in r.steps if s.n_prefill]
    return {
        "model": model,
        "policy": r.policy,
        "stream_tokens": len(r.stream_itl_ms) + 1,
        "itl_p50_ms": _round(r.itl(50)),
        "itl_p99_ms": _round(r.itl(99)),
        "itl_max_ms": _round(max(r.stream_itl_ms, default=0.0)),
        "long_ttft_mean_ms": _round(sum(r.long_ttft_ms) / len(r.long_ttft_ms))
        if r.long_ttft_ms
        else None,
        "throughput_tps": round(r.throughput_tps, 3),
        "steps": len(r.steps),
        "max_prefill_tokens_per_step": max((s.n_prefill for s in r.steps), default=0),
        "mixed_steps": sum(1 for s in prefill_steps if s.n_decode),
        "prefill_ms": round(r.prefill_ms, 3),
        "prefill_in_stream_gaps_ms": round(r.prefill_in_gaps_ms, 3),
        "n_threads": r.n_threads,
        "n_threads_batch": r.n_threads_batch,
        "background_cpus": _round(r.background_cpus),
        "busy": r.busy,
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def _table(reports: Sequence[InterferenceReport]) -> Fitted:
    heads = ("policy", "ITL p50 ms", "ITL p99 ms", "ITL max ms", "long TTFT ms", "tok/s", "steps")
    title = "a decoding stream while long prompts arrive"
    table = fitted_table(title, (*heads, "prefill in gaps"), ("policy",))
    for r in reports:
        ttft = sum(r.long_ttft_ms) / len(r.long_ttft_ms) if r.long_ttft_ms else None
        table.add_row(
            r.policy,
            out.cell(r.itl(50)),
            out.cell(r.itl(99)),
            out.cell(max(r.stream_itl_ms, default=0.0)),
            out.cell(ttft),
            f"{r.throughput_tps:,.1f}",
            str(len(r.steps)),
            f"{r.prefill_in_gaps_ms:,.0f} of {r.prefill_ms:,.0f} ms",
        )
    return table


def verdict(reports: Sequence[InterferenceReport]) -> list[str]:
    """The seeds' claim, as measured: does chunking lower the stream's p99 gap against
    prefill-first, and what does it cost in the long prompts' TTFT and in throughput?"""
    whole = {r.policy: r for r in reports}.get("prefill-first")
    lines = []
    busy = [r for r in reports if r.busy]
    if busy:  # the stream's gaps then measure the other processes, not the policies
        threads = max(max(r.n_threads or 1, r.n_threads_batch or 1) for r in busy)
        lines.append(
            busy_warning(
                max(r.background_cpus or 0.0 for r in busy),
                threads,
                ", ".join(r.policy for r in busy),
            )
        )
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
            + (" (on a busy machine: not a clean result)" if r.busy or whole.busy else "")
        )
    return lines
