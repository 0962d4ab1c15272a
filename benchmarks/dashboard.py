"""Does the live dashboard slow decoding? Decode tok/s with it on against the same run off.

Each repetition runs the same greedy request twice, dashboard on and off in alternating order,
and measures the decode rate the way a user experiences it: wall-clock time between the first
and last token as the consumer sees them, drawing included. The dashboard renders into a real
terminal-style console (escape codes and all) written to /dev/null. Neighbouring runs share the
machine's load, so the on/off ratio within each pair is the estimate; its median must be at
least 0.98. The CPU time `Live` spends redrawing is measured as well, a figure noise cannot move.

    .venv/bin/python benchmarks/dashboard.py [--model PATH] [--reps 12] [--gen 256]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from typing import Any

from rich.console import Console
from rich.live import Live

from llmrun.cli.dashboard import Dashboard
from llmrun.cli.session import EventView, TextOut, drive
from llmrun.runners.base import Event, Request, SamplingParams, Token
from llmrun.runners.config import EngineConfig
from llmrun.runners.llamacpp import LlamaCppRunner
from llmrun.runners.models import resolve_model

DRAW_CPU_S = [0.0]


def _timed_refresh(refresh: Any) -> Any:
    def wrapper(self: Live) -> None:
        t = time.thread_time()
        refresh(self)
        DRAW_CPU_S[0] += time.thread_time() - t

    return wrapper


class TokenClock:
    """Records when the consumer received each token, then passes events on."""

    def __init__(self, inner: EventView | None) -> None:
        self.inner = inner
        self.times: list[float] = []

    def update(self, event: Event) -> None:
        if self.inner is not None:
            self.inner.update(event)
        if isinstance(event, Token):
            self.times.append(time.perf_counter())

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()


def decode_rate(
    runner: LlamaCppRunner, request: Request, *, dashboard: bool
) -> tuple[float, float]:
    """(tokens per wall second after the first token, seconds of that decode)."""
    with open(os.devnull, "w") as devnull:
        dash = None
        if dashboard:
            dash = Dashboard(Console(file=devnull, force_terminal=True, width=80), show_text=True)
        clock = TokenClock(dash)
        out = dash if dash is not None else TextOut(devnull)
        drive(runner, request, out=out, view=clock, cancel=threading.Event())
        clock.close()
    seconds = clock.times[-1] - clock.times[0]
    return (len(clock.times) - 1) / seconds, seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--reps", type=int, default=12)
    parser.add_argument("--gen", type=int, default=256)
    args = parser.parse_args()

    Live.refresh = _timed_refresh(Live.refresh)  # type: ignore[method-assign]
    runner = LlamaCppRunner(resolve_model(args.model).path, EngineConfig(n_ctx=2048))
    loaded = runner.load()
    print(f"model {loaded.model.name} · {loaded.settings.n_threads} threads", file=sys.stderr)
    sampling = SamplingParams(max_tokens=args.gen, temperature=0, ignore_eos=True)
    request = Request.chat("Tell me a long story.", sampling=sampling, keep_cache=False)
    decode_rate(runner, request, dashboard=False)  # warm-up
    rates: dict[bool, list[float]] = {True: [], False: []}
    decode_on_s = 0.0
    for rep in range(args.reps):
        for shown in (rep % 2 == 0, rep % 2 == 1):
            value, seconds = decode_rate(runner, request, dashboard=shown)
            rates[shown].append(value)
            decode_on_s += seconds if shown else 0.0
            print(
                f"rep {rep} dashboard {'on ' if shown else 'off'} {value:7.1f} tok/s",
                file=sys.stderr,
            )
    runner.close()
    on, off = statistics.median(rates[True]), statistics.median(rates[False])
    ratio = statistics.median(a / b for a, b in zip(rates[True], rates[False], strict=True))
    print(
        f"decode tok/s (wall, as the consumer sees it): dashboard on {on:.1f}, off {off:.1f};"
        f" median on/off within a pair = {ratio:.3f} (target >= 0.98)"
    )
    print(
        f"Live redraws used {DRAW_CPU_S[0] * 1000:.0f} ms of CPU in {decode_on_s:.1f} s of"
        f" decode ({DRAW_CPU_S[0] / decode_on_s:.2%})"
    )
    return 0 if ratio >= 0.98 else 1


if __name__ == "__main__":
    import script  # benchmarks/script.py: Ctrl-C is exit 130

    script.run(main)
