"""How far long work is, and how long it has left, as plain data for a display to show.

`Tally` is counted by whoever does the work (the batched engine's loop, a client's threads) and
read by a display while that work blocks; `RepClock` estimates a run of repetitions of tests of
different lengths (a bench sweep) from the time each kind of test took. Neither draws anything.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping


def eta_s(elapsed_s: float, fraction: float) -> float | None:
    """Seconds left at the pace so far, or None before any work is done."""
    if fraction <= 0 or elapsed_s <= 0:
        return None
    if fraction >= 1:
        return 0.0
    return elapsed_s * (1 - fraction) / fraction


class Tally:
    """`done` of `total` items (requests, trials) and, for the estimate, `work` of `work_total`
    finer units (tokens): items that run side by side all finish at the end, their tokens do
    not. Adds are locked (several threads count); reads are of plain numbers.

    Tokens are paced from the first one where it came later than each of the others took: that
    wait (a prompt's prefill, a server's first request) is past once it comes, and counted in
    the pace it made one token look like seconds' worth (`bench interference` showed ETA 2:43
    for a 14 s run)."""

    __slots__ = ("_lock", "done", "first_work_s", "started_s", "total", "work", "work_total")

    def __init__(self, total: int, work_total: int = 0) -> None:
        self.total, self.work_total = total, work_total
        self.done = 0
        self.work = 0
        self.started_s = time.monotonic()
        self.first_work_s: float | None = None  # when the first fine unit came
        self._lock = threading.Lock()

    def add(self, done: int = 0, work: int = 0, now_s: float | None = None) -> None:
        with self._lock:
            self.done += done
            if work and self.first_work_s is None:
                self.first_work_s = time.monotonic() if now_s is None else now_s
            self.work += work

    @property
    def fraction(self) -> float:
        """The share of the work done: by the fine units where they are counted."""
        if self.work_total > 0:
            return min(1.0, self.work / self.work_total)
        return min(1.0, self.done / self.total) if self.total > 0 else 0.0

    def elapsed_s(self, now_s: float | None = None) -> float:
        return (time.monotonic() if now_s is None else now_s) - self.started_s

    def eta_s(self, now_s: float | None = None) -> float | None:
        first, work = self.first_work_s, self.work
        if self.work_total > 0 and first is not None and self.fraction < 1:
            if work < 2:
                return None  # one token tells the wait for it, not the pace
            since = (time.monotonic() if now_s is None else now_s) - first
            if first - self.started_s > since / (work - 1):  # it waited longer than each later
                return eta_s(since, self.fraction)
        return eta_s(self.elapsed_s(now_s), self.fraction)


class RepClock:
    """The time left in a run of repetitions of a few kinds of test (llama-bench's pp512, tg128,
    ...), which differ in length. Each kind keeps its first repetition's length as its share
    of the work; the recent pace (the last few repetitions against their kind's first) scales
    them all, so a sweep to slower settings, or a machine that got busier, moves the estimate
    from the next repetition on. A kind not yet seen counts as the mean of those seen. Within a
    repetition under way, its share done (tokens) gives its own end where it is known.

    Fed the time with every call (`now_s`), so it is tested without waiting."""

    RECENT = 3  # repetitions that set the pace

    def __init__(self) -> None:
        self._first: dict[str, float] = {}  # kind -> seconds of its first finished repetition
        self._pace: list[float] = []  # each finished repetition against its kind's first
        self._rep: tuple[str, float] | None = None  # the repetition under way: kind, start

    def started(self, kind: str, now_s: float) -> None:
        self._rep = (kind, now_s)

    def finished(self, now_s: float) -> None:
        if self._rep is not None:
            kind, start = self._rep
            length = now_s - start
            first = self._first.setdefault(kind, length)
            self._pace.append(length / first if first > 0 else 1.0)
            self._rep = None

    def eta_s(self, now_s: float, left: Mapping[str, int], fraction: float = 0.0) -> float | None:
        """Seconds left: the repetition under way (`fraction` of it done), then `left`
        repetitions of each kind not yet started. None while nothing tells the pace."""
        recent = self._pace[-self.RECENT :]
        pace = sum(recent) / len(recent) if recent else 1.0
        lengths = {kind: first * pace for kind, first in self._first.items()}
        mean = sum(lengths.values()) / len(lengths) if lengths else None
        current = 0.0
        if self._rep is not None:
            kind, start = self._rep
            spent = now_s - start
            if 0 < fraction < 1:  # this repetition's own pace is the best guide to its end
                current = eta_s(spent, fraction) or 0.0
                lengths.setdefault(kind, spent / fraction)
            elif (length := lengths.get(kind, mean)) is not None:
                current = max(0.0, length - spent)
            else:
                return None
            mean = mean if mean is not None else lengths.get(kind)
        if mean is None:
            return None
        return current + sum(n * lengths.get(k, mean) for k, n in left.items())
