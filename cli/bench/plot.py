"""`bench --plot FILE.png`: the charts as a picture (matplotlib, the [plot] extra)."""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from llmrun.cli.inputs import output_file
from llmrun.runners.bench.results import Row
from llmrun.runners.errors import BadRequestError, OptionError


def _pyplot() -> Any:
    """matplotlib's pyplot, drawing to files only; one line when it is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BadRequestError(
            "--plot needs matplotlib: pip install 'llmrun[plot]' (make installs it)"
        ) from None
    return plt


def plot_file(text: str | None) -> Path | None:
    """--plot's file, checked before the run it draws (a bad name failed only after the whole
    run): a file name, not a folder, in a folder that exists, ending in a format matplotlib
    writes."""
    if text is None:
        return None
    if not text.strip():
        raise OptionError("--plot: give a file name such as charts.png")
    path = Path(text)
    # a folder, before the format its name lacks (a name is_dir cannot stat, one over 255
    # bytes, is output_file's to name below: it ended as "File name too long: <the path>")
    with contextlib.suppress(OSError):
        if path.is_dir():
            output_file("--plot", path, "charts.png")
    _pyplot()  # matplotlib is there, or one line that says how to get it
    from matplotlib.backend_bases import FigureCanvasBase

    formats = FigureCanvasBase.get_supported_filetypes()
    suffix = path.suffix.lower().removeprefix(".")
    if suffix not in formats:
        raise OptionError(
            f"--plot {text}: name the picture's format by its ending, one of"
            f" {', '.join(sorted(formats))} (charts.png)"
        )
    output_file("--plot", path, "charts.png")  # the run's end writes it: learn now it cannot
    return path


def _save(fig: Any, plt: Any, path: Path, dpi: int) -> None:
    try:
        fig.savefig(path, dpi=dpi)
    except OSError as e:
        raise BadRequestError(f"cannot write {path}: {e.strerror or e}") from None
    finally:
        plt.close(fig)


def plot(rows: Sequence[Row], path: Path) -> None:
    plt = _pyplot()
    pp = [r for r in rows if r.kind == "pp"]
    tg = [r for r in rows if r.kind == "tg"]
    depths = sorted({r.n_depth for r in tg})
    batches = sorted({r.n_batch for r in pp})
    n_panels = 1 + (len(depths) > 1) + (len(batches) > 1)
    fig, axes = plt.subplots(1, n_panels, figsize=(6 * n_panels, 4.5), squeeze=False)
    ax = axes[0][0]
    several = len({r.model_name for r in rows}) > 1
    labels = [
        (f"{r.model_name}\n" if several else "") + f"{r.test}\nt={r.n_threads} b={r.n_batch}"
        for r in pp + tg
    ]
    values = [r.avg_ts for r in pp + tg]
    errors = [r.stddev_ts for r in pp + tg]
    colors = ["tab:cyan"] * len(pp) + ["tab:purple"] * len(tg)
    ax.bar(range(len(values)), values, yerr=errors, color=colors)
    ax.set_xticks(range(len(values)), labels, fontsize=7)
    ax.set_ylabel("tokens/s")
    ax.set_title("prompt tok/s (cyan) vs output tok/s (purple)")
    panel = 1
    if len(depths) > 1:
        ax = axes[0][panel]
        panel += 1
        means = [statistics.fmean(r.avg_ts for r in tg if r.n_depth == d) for d in depths]
        ax.plot(depths, means, marker="o", color="tab:purple")
        ax.set_xlabel("context depth (tokens)")
        ax.set_ylabel("tokens/s")
        ax.set_ylim(bottom=0)  # from zero: a gentle slope must not look like a collapse
        ax.set_title("output tok/s by context depth (y from 0)")
    if len(batches) > 1:
        ax = axes[0][panel]
        rates = [statistics.fmean(r.avg_ts for r in pp if r.n_batch == x) for x in batches]
        ttft = [statistics.fmean(r.ttft_ms or 0 for r in pp if r.n_batch == x) for x in batches]
        ax.plot(batches, rates, marker="o", color="tab:cyan")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prefill chunk size (n_batch)")
        ax.set_ylabel("prompt tokens/s (cyan)")
        twin = ax.twinx()
        twin.plot(batches, ttft, marker="s", color="tab:orange")
        twin.set_ylabel("TTFT ms (orange)")
        ax.set_ylim(bottom=0)
        twin.set_ylim(bottom=0)
        ax.set_title("prefill rate and TTFT by chunk size")
    fig.tight_layout()
    _save(fig, plt, path, 110)


def plot_timeline(reports: Sequence[Any], path: Path) -> None:
    """Per policy: each step's batch (decode and prefill tokens, stacked, over time) and the
    decoding stream's gaps, so a whole-prompt stall and its smoothing by chunking show."""
    plt = _pyplot()
    fig, axes = plt.subplots(
        len(reports), 1, figsize=(10, 2.6 * len(reports)), squeeze=False, sharex=True
    )
    for ax, report in zip((row[0] for row in axes), reports, strict=True):
        starts = [s.start_s for s in report.steps]
        steps = {"width": [max(s.duration_s, 1e-4) for s in report.steps], "align": "edge"}
        decode = [s.n_decode for s in report.steps]
        prefill = [s.n_prefill for s in report.steps]
        ax.bar(starts, decode, **steps, color="tab:purple", label="decode")
        ax.bar(starts, prefill, **steps, bottom=decode, color="tab:cyan", label="prefill")
        ax.set_ylabel("tokens / step")
        ax.set_ylim(bottom=0)
        ax.set_title(
            f"{report.policy}: batch composition per step, and the stream's gaps", fontsize=9
        )
        twin = ax.twinx()
        gaps = list(report.stream_itl_ms)
        times = report.stream_times_s[1:] if report.stream_times_s else []
        twin.plot(times[: len(gaps)], gaps, color="tab:red", marker=".", linewidth=1)
        twin.set_ylabel("stream gap ms", color="tab:red")
        twin.set_ylim(bottom=0)
    axes[-1][0].set_xlabel("seconds")
    axes[0][0].legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    _save(fig, plt, path, 100)
