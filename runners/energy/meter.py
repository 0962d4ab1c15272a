"""Energy per phase: the counters read at the boundaries a runner's events mark (load, prefill,
decode), less the idle power measured just before the run.

The idle window also shows how often each counter updates: a phase shorter than two updates
gets no figure, and one spanning few updates is marked coarse. A counter that does not move
over a phase is named, never read as zero. Several requests' phases (`Spans`) sum into one
report, so bench measures a phase too short for the counter over its repetitions.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from llmrun.runners.base import Event, Finished, LoadStarted, ModelLoaded, PrefillProgress, Token
from llmrun.runners.stats import (
    ENERGY_PHASES,
    EnergyReport,
    EngineSettings,
    GenerationStats,
    PhaseEnergy,
    ServerSettings,
)

from .counter import Counter, Unavailable

IDLE_WINDOW_S = 0.5  # the idle baseline's length, before the load
POLL_S = 0.001  # how often the idle window reads the counters (RAPL updates about every 1 ms)
GUARD_S = 1.0  # during decode, a read at least this often: one wraparound at most between reads
COARSE_UPDATES = 10  # a phase spanning fewer counter updates than this is marked coarse
# No counter llmrun reads can show this much power: a CPU package draws at most about 500 W, a
# GPU about 1.2 kW (NVML counts one GPU a counter), and the RAPL sum covers a machine's sockets
# (8 at most). A counter past it (an LLMRUN_POWERCAP_ROOT that counts 10 MW, a driver's bug)
# gives no figure, never 'load -399,115.7 J (-1,008,621.2 W)'.
MAX_PLAUSIBLE_W = 10_000.0
BELOW_IDLE_UPDATES = 2  # a phase may read below idle by this many updates' idle energy
# and by this share of idle: a phase of I/O waits can draw a little less than the baseline
# (measured while the meter polled), never half as little while the machine works
BELOW_IDLE_SHARE = 0.5


def _not_a_power_counter(name: str, watts: float, over: str) -> str:
    return (
        f"the {name} counter read {watts:,.0f} W over {over}, past the {MAX_PLAUSIBLE_W:,.0f} W"
        " no machine's counter shows: not a power counter"
    )


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:,.1f} ms"


def on_nvidia_gpu(settings: EngineSettings | ServerSettings | None) -> bool:
    """Whether layers ran on an NVIDIA GPU (the only GPUs NVML counts)."""
    if not isinstance(settings, EngineSettings) or settings.n_gpu_layers <= 0:
        return False
    device = settings.device.upper()
    return device.startswith("CUDA") or "NVIDIA" in device


@dataclass(frozen=True)
class _Idle:
    watts: float
    update_s: float


@dataclass(frozen=True)
class Span:
    """One phase as its counter reads bound it: the wall time between them, each counter's
    joules (idle included), and the tokens; or why the phase has no reads."""

    window_s: float
    joules: tuple[float, ...]  # per counter, in the meter's order
    tokens: int
    absent: str = ""

    def plus(self, other: Span) -> Span:
        """Two repetitions' phases as one: their windows, joules and tokens summed (a phase
        too short for the counter alone is measured over its repetitions)."""
        if self.absent or other.absent:
            return self if self.absent else other
        joules = tuple(a + b for a, b in zip(self.joules, other.joules, strict=True))
        return Span(self.window_s + other.window_s, joules, self.tokens + other.tokens)


@dataclass(frozen=True)
class Spans:
    """A request's phases as read (`PhaseMeter.spans`), or several requests' summed."""

    stats: GenerationStats
    load: Span
    prefill: Span
    decode: Span
    failed: str = ""  # a read failed: why
    count: int = 1  # requests summed

    def plus(self, other: Spans) -> Spans:
        return Spans(
            stats=other.stats,
            load=self.load.plus(other.load),
            prefill=self.prefill.plus(other.prefill),
            decode=self.decode.plus(other.decode),
            failed=self.failed or other.failed,
            count=self.count + other.count,
        )


@dataclass(frozen=True)
class _Mark:
    t: float
    joules: tuple[float, ...]


class PhaseMeter:
    """Reads energy counters at a request's phase boundaries, as its events go by.

    `measure_idle` once before the run; then per request `begin`, `see` for every event before
    the last, and `attach` for the last (`Finished`), which it returns with the energy report.
    Without counters it only carries the reason."""

    def __init__(
        self,
        counters: Sequence[Counter] = (),
        *,
        reasons: dict[str, str] | None = None,
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
        idle_window_s: float = IDLE_WINDOW_S,
        poll_s: float = POLL_S,
    ) -> None:
        self._counters = list(counters)
        self.reasons = dict(reasons or {})  # "cpu"/"gpu" (or "all") -> why it has no counter
        self._clock = clock
        self._sleep = sleep
        self.idle_window_s = idle_window_s
        self._poll_s = poll_s
        self._idle: list[_Idle] = []
        self._failed = ""
        self._last_t = 0.0
        self._marks: dict[str, _Mark] = {}
        self._prefill_first = 0
        self._prefill_last = 0
        self._paused: _Mark | None = None
        self._skipped = _Mark(0.0, ())  # time and joules while paused, left out of the marks

    @classmethod
    def unmetered(cls, reason: str) -> PhaseMeter:
        """A meter whose every report is this reason (a server's model, replayed requests)."""
        return cls(reasons={"all": reason})

    @property
    def counters(self) -> tuple[Counter, ...]:
        return tuple(self._counters)

    def _read(self) -> tuple[float, ...] | None:
        try:
            values = tuple(c.read_j() for c in self._counters)
        except Unavailable as e:
            self._failed = str(e)
            return None
        self._last_t = self._clock()
        return values

    def measure_idle(self) -> None:
        """The idle baseline: each counter's mean power between its first and last change in
        the window (so its update steps do not bias it), and its update interval."""
        if not self._counters:
            return
        first = self._read()
        if first is None:
            return
        start, previous = self._last_t, first
        changes: list[list[tuple[float, float]]] = [[] for _ in self._counters]
        while self._last_t - start < self.idle_window_s:
            self._sleep(self._poll_s)
            values = self._read()
            if values is None:
                return
            for i, value in enumerate(values):
                if value != previous[i]:
                    changes[i].append((self._last_t, value))
            previous = values
        window = self.idle_window_s = self._last_t - start
        kept: list[Counter] = []
        for counter, seen in zip(self._counters, changes, strict=True):
            if len(seen) < 2:
                moved = "stood still" if not seen else "changed once"
                self.reasons[counter.kind] = (
                    f"the {counter.name} counter {moved} over {_ms(window)} of idle:"
                    " it does not update here"
                )
                counter.close()
                continue
            (t0, j0), (t1, j1) = seen[0], seen[-1]
            watts = (j1 - j0) / (t1 - t0)
            if not 0 <= watts <= MAX_PLAUSIBLE_W:
                self.reasons[counter.kind] = _not_a_power_counter(
                    counter.name, watts, f"{_ms(window)} of idle"
                )
                counter.close()
                continue
            kept.append(counter)
            self._idle.append(_Idle(watts, (t1 - t0) / (len(seen) - 1)))
        self._counters = kept

    def begin(self) -> None:
        """A new request: forget the previous one's marks."""
        self._marks = {}
        self._paused = None
        self._skipped = _Mark(0.0, tuple(0.0 for _ in self._counters))

    def pause(self) -> None:
        """The request's events stop for a while (bench draws its progress): what the
        counters count until `resume` is left out of its phases, as the runner's clock is."""
        if self._counters and not self._failed and (values := self._read()) is not None:
            self._paused = _Mark(self._last_t, values)

    def resume(self) -> None:
        paused, self._paused = self._paused, None
        if paused is None or self._failed or (values := self._read()) is None:
            return
        skipped = self._skipped
        self._skipped = _Mark(
            skipped.t + self._last_t - paused.t,
            tuple(s + b - a for s, a, b in zip(skipped.joules, paused.joules, values, strict=True)),
        )

    def _mark(self, name: str) -> None:
        values = self._read()
        if values is not None:
            skipped = self._skipped
            if skipped.joules:
                values = tuple(v - s for v, s in zip(values, skipped.joules, strict=True))
            self._marks[name] = _Mark(self._last_t - skipped.t, values)

    def see(self, event: Event) -> None:
        """Read the counters where this event ends or starts a phase."""
        if not self._counters or self._failed:
            return
        if isinstance(event, Token):
            if event.index == 0:
                self._mark("decode_start")
            elif self._clock() - self._last_t >= GUARD_S:
                self._read()
        elif isinstance(event, PrefillProgress):
            if "prefill_start" not in self._marks:
                self._mark("prefill_start")
                self._prefill_first = self._prefill_last = event.done_tokens
            else:
                self._mark("prefill_end")
                self._prefill_last = event.done_tokens
        elif isinstance(event, LoadStarted):
            self._mark("load_start")
        elif isinstance(event, ModelLoaded):
            self._mark("load_end")

    def attach(self, finished: Finished) -> Finished:
        """The request's last event, its stats carrying the energy report."""
        if not isinstance(finished.stats, GenerationStats):  # nothing to carry it
            return finished
        self.finish()
        stats = dataclasses.replace(finished.stats, energy=self.report(finished.stats))
        return Finished(stats, finished.text, finished.tail)

    def finish(self) -> None:
        """The request's last token has been seen: its decode ends here."""
        if self._counters and not self._failed:
            self._mark("decode_end")

    def spans(self, stats: GenerationStats) -> Spans:
        """The phases read so far in this request."""
        decode_tokens = max(0, stats.output_tokens - 1)
        return Spans(
            stats=stats,
            load=self._span("load", 0, "the model was loaded before this request"),
            prefill=self._span(
                "prefill",
                self._prefill_last - self._prefill_first,
                "no prefill in this request (every prompt token was reused)",
            ),
            decode=self._span(
                "decode",
                decode_tokens,
                "no decode in this request (fewer than two output tokens)",
                none=decode_tokens == 0,
            ),
            failed=self._failed,
        )

    def _span(self, name: str, tokens: int, absent: str, *, none: bool = False) -> Span:
        start, end = self._marks.get(f"{name}_start"), self._marks.get(f"{name}_end")
        if start is None or end is None or none:
            return Span(0.0, (), tokens, absent=absent)
        gross = tuple(b - a for a, b in zip(start.joules, end.joules, strict=True))
        return Span(end.t - start.t, gross, tokens)

    def report(self, stats: GenerationStats) -> EnergyReport:
        """The request's energy per phase, or why there is none."""
        return self.report_of(self.spans(stats))

    def report_of(self, spans: Spans) -> EnergyReport:
        """The energy per phase of a request's spans (or several requests' summed), or why
        there is none."""
        gpu = on_nvidia_gpu(spans.stats.settings)
        used, missing, why = self._used(gpu=gpu, failed=spans.failed)
        if not used:
            return EnergyReport(reason=why)
        implausible = self._implausible(spans, used)
        if implausible:
            return EnergyReport(reason=implausible)
        left_out = "; ".join(
            f"the {k.upper()}'s energy: {self.reasons.get(k, 'no energy counter')}" for k in missing
        )
        interval = max(self._idle[i].update_s for i in used)
        return EnergyReport(
            source=" + ".join(self._counters[i].name for i in used),
            idle_w=sum(self._idle[i].watts for i in used),
            idle_window_s=self.idle_window_s,
            update_interval_s=interval,
            load=self._phase(spans.load, used, spans.count),
            prefill=self._phase(spans.prefill, used, spans.count),
            decode=self._phase(spans.decode, used, spans.count),
            left_out=left_out,
        )

    def selection(self, *, gpu: bool) -> tuple[list[Counter], float, str]:
        """The counters that count work on this machine (the GPU's only where layers run on
        an NVIDIA GPU), their summed idle power, and why there are none ("" when some)."""
        used, _, why = self._used(gpu=gpu, failed=self._failed)
        idle_w = sum((self._idle[i].watts for i in used), 0.0)
        return [self._counters[i] for i in used], idle_w, why

    def _used(self, *, gpu: bool, failed: str) -> tuple[list[int], list[str], str]:
        """The counters of the kinds that count (the GPU's only with `gpu`), by index, the
        kinds that have none, and why none counts ("" when some do; a failed read's reason)."""
        if "all" in self.reasons or failed:
            return [], [], self.reasons.get("all") or failed
        kinds = ("cpu", "gpu") if gpu else ("cpu",)
        used = [i for i, c in enumerate(self._counters) if c.kind in kinds]
        missing = [k for k in kinds if not any(self._counters[i].kind == k for i in used)]
        if used:
            return used, missing, ""
        why = [(k, self.reasons.get(k, "no energy counter")) for k in missing]
        return used, missing, "; ".join(w if k == "cpu" else f"GPU: {w}" for k, w in why)

    def _implausible(self, spans: Spans, used: list[int]) -> str:
        """Why the counters' reads over these phases cannot be true ("" when they can): a
        counter past MAX_PLAUSIBLE_W over a phase, or a phase that drew less than half the
        idle baseline, and more than the counters' steps explain. The
        same baseline and counters make every phase's figure, so none is shown."""
        interval = max(self._idle[i].update_s for i in used)
        idle_w = sum(self._idle[i].watts for i in used)
        for name in ENERGY_PHASES:
            span: Span = getattr(spans, name)
            window = span.window_s
            if span.absent or window < 2 * interval:
                continue
            for i in used:
                watts = span.joules[i] / window
                if watts > MAX_PLAUSIBLE_W:
                    return _not_a_power_counter(
                        self._counters[i].name, watts, f"the {name} ({_ms(window)})"
                    )
            gross = sum(span.joules[i] for i in used)
            least = BELOW_IDLE_SHARE * idle_w * window - BELOW_IDLE_UPDATES * idle_w * interval
            if gross > 0 and gross < least:
                return (
                    f"the {name} read {gross / window:,.1f} W, below the idle baseline of"
                    f" {idle_w:,.1f} W: the counters' figures cannot be true"
                )
        return ""

    def _phase(self, span: Span, used: list[int], count: int) -> PhaseEnergy:
        tokens, window = span.tokens, span.window_s
        if span.absent:
            return PhaseEnergy(None, 0.0, tokens, span.absent)
        interval = max(self._idle[i].update_s for i in used)
        over = f" over {count} repetitions" if count > 1 else ""
        if window < 2 * interval:
            return PhaseEnergy(
                None,
                window,
                tokens,
                f"too short for the counter: {_ms(window)}{over} against an update every"
                f" {_ms(interval)}",
            )
        gross = [span.joules[i] for i in used]
        still = [self._counters[i].name for i, j in zip(used, gross, strict=True) if j <= 0]
        if still:
            return PhaseEnergy(
                None, window, tokens, f"the {still[0]} counter stood still for {_ms(window)}{over}"
            )
        net_j = sum(gross) - sum(self._idle[i].watts for i in used) * window
        updates = window / interval
        note = (
            f"coarse: {updates:.0f} counter updates of {_ms(interval)}{over}"
            if updates < COARSE_UPDATES
            else ""
        )
        return PhaseEnergy(net_j, window, tokens, note)

    def close(self) -> None:
        for counter in self._counters:
            counter.close()
        self._counters = []
