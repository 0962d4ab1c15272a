"""Is a difference between two sets of repetitions real? The ratio of their rates with a 95 %
confidence interval, a verdict, and how many repetitions would settle it.

Method: Welch's t on the logarithms of the rates (tok/s). The ratio is B's geometric mean over
A's; its interval is exp(d ± t·se), with d the difference of the mean log rates, se² = s²_A/n_A +
s²_B/n_B and t the Student quantile at the Welch-Satterthwaite degrees of freedom. Why this one:
rates are positive and what disturbs them is multiplicative (a busy core slows a repetition by a
share, not by a fixed number of tok/s), so on the log scale the noise is closer to symmetric and a
ratio is a difference; the two sides need not share a variance (a busy run scatters more than a
quiet one) nor a count; and, unlike a bootstrap, it gives an interval from 2 repetitions a side
and the same answer every time, with no seed.

Small samples: one repetition on a side has no spread, so there is no interval (the verdict says
so); at 2 or 3 a side the t quantile (12.7 at one degree of freedom) makes the interval wide, as
it should be. Zero spread (every repetition the same rate, or a timer too coarse to tell them
apart): the interval has no width, and the verdict is the ratio's direction; that is what the
repetitions show, not proof of a difference. Outliers are kept (a slow repetition on a shared
machine is a measurement, not an error): one outlier shifts the mean by 1/n of its distance and
raises the standard error by about as much, so alone it cannot push t past about 1; it widens
the interval and makes "no difference detectable" likelier, and never invents a difference.

The repetitions needed (`needed`) are per side, from the observed spread: the smallest n with
n ≥ 2·s²·(t₀.₉₇₅ + t₀.₈₀)²/δ², δ = ln(1 + resolve), t at 2n - 2 degrees of freedom, s² the
pooled variance of the log rates: the usual two-sample size for 80 % power at a 5 % two-sided
level, so that a true 2 % difference is called four times in five.

Pure arithmetic, no dependencies (scipy is not installed): the t distribution comes from the
regularized incomplete beta function (Numerical Recipes' continued fraction), its quantile by
Newton's method; both agree with the printed tables to 4 decimals.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

CONFIDENCE = 0.95
POWER = 0.80  # of the repetitions-needed estimate
RESOLVE = 0.02  # the difference the estimate is for: 2 %
MAX_NEEDED = 100_000  # beyond this the estimate says "over"

Verdict = Literal["faster", "slower", "no difference", "no interval"]


def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta function (modified Lentz)."""

    def off_zero(v: float) -> float:
        return v if abs(v) > 1e-300 else 1e-300

    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 / off_zero(1.0 - qab * x / qap)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        # each m takes two terms of the fraction: its even one, then its odd one
        for aa in (
            m * (b - m) * x / ((qam + m2) * (a + m2)),
            -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2)),
        ):
            d = 1.0 / off_zero(1.0 + aa * d)
            c = off_zero(1.0 + aa / c)
            step = d * c
            h *= step
        if abs(step - 1.0) < 1e-14:
            break
    return h


def _betai(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(
        math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    )
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T ≤ t) for Student's t with `df` (any positive real) degrees of freedom."""
    if math.isinf(df):
        return statistics.NormalDist().cdf(t)
    tail = 0.5 * _betai(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


def t_pdf(t: float, df: float) -> float:
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    return math.exp(log_c - (df + 1) / 2 * math.log1p(t * t / df))


def t_quantile(p: float, df: float) -> float:
    """The t with P(T <= t) = p (0.5 <= p < 1): Newton's method from the normal quantile, which
    lies below it; the CDF is concave there, so every step stays below and converges."""
    if not 0.5 <= p < 1.0:
        raise ValueError(f"p must be in [0.5, 1), not {p}")
    z = statistics.NormalDist().inv_cdf(p)
    if math.isinf(df) or df > 1e7:
        return z
    t = z
    for _ in range(200):
        step = (p - t_cdf(t, df)) / t_pdf(t, df)
        t += step
        if abs(step) < 1e-12 * max(1.0, t):
            break
    return t


@dataclass(frozen=True)
class LogSample:
    """One side's repetitions on the log scale: what Welch's t reads."""

    n: int
    mean: float  # of ln(rate)
    variance: float  # sample variance of ln(rate); 0 with one repetition

    @classmethod
    def of(cls, rates: Iterable[float]) -> LogSample:
        """From rates; a rate that is not positive and finite measured nothing and is left out."""
        logs = [math.log(r) for r in rates if isinstance(r, (int, float)) and 0 < r < math.inf]
        if not logs:
            return cls(0, math.nan, math.nan)
        variance = statistics.variance(logs) if len(logs) > 1 else 0.0
        return cls(len(logs), statistics.fmean(logs), variance)

    def halfwidth(self, confidence: float = CONFIDENCE) -> float | None:
        """The relative half-width of the geometric mean's interval (0.02: ±2 %), None under 2
        repetitions."""
        if self.n < 2:
            return None
        se = math.sqrt(self.variance / self.n)
        try:
            return math.expm1(t_quantile(0.5 + confidence / 2, self.n - 1) * se)
        except OverflowError:  # repetitions 10^300 apart: no bound at all
            return math.inf


@dataclass(frozen=True)
class Difference:
    """B against A: the ratio of geometric mean rates, its interval, and the verdict."""

    ratio: float | None  # B / A; None when a side has no repetition
    low: float | None  # the 95 % interval; None with one repetition on a side
    high: float | None
    n_a: int
    n_b: int
    df: float | None  # Welch-Satterthwaite degrees of freedom (inf at zero spread)
    needed: int | None  # repetitions a side that would resolve RESOLVE (None: not estimable)
    busy: bool = False  # other processes took the CPU during either side
    resolve: float = RESOLVE

    @property
    def verdict(self) -> Verdict:
        if self.ratio is None or self.low is None or self.high is None:
            return "no interval"
        if self.low > 1.0:
            return "faster"
        if self.high < 1.0:
            return "slower"
        return "no difference"

    @property
    def text(self) -> str:
        """The verdict in words, with the busy machine's mark: it marks, never hides."""
        return describe(
            self.verdict,
            needed=self.needed,
            reps=(self.n_a, self.n_b),
            busy=self.busy,
            resolve=self.resolve,
        )

    @property
    def interval(self) -> str:
        """`x1.02 (0.99-1.05)`, or the ratio alone where there is no interval."""
        if self.ratio is None:
            return "-"
        if self.low is None or self.high is None:
            return f"x{self.ratio:.3f}"
        return f"x{self.ratio:.3f} ({self.low:.3f}-{self.high:.3f})"


def describe(
    verdict: str,
    *,
    needed: int | None,
    reps: tuple[int, int],
    busy: bool = False,
    resolve: float = RESOLVE,
) -> str:
    """A verdict in words (from a `Difference`, or from the fields `record_fields` wrote)."""
    share = f"{resolve:.0%}".replace("%", " %")
    if verdict == "no interval":
        return (
            "no interval: a side has no repetition"
            if 0 in reps
            else "no interval: one repetition on a side (2 or more each give one)"
        ) + (" (busy machine: may be noise)" if busy else "")
    if verdict != "no difference":
        words = verdict
    elif needed is None:
        words = f"the repetitions cannot tell how many would resolve {share}"
    elif needed <= min(reps):
        words = f"{min(reps)} repetitions already resolve {share}"
    elif needed >= MAX_NEEDED:
        words = f"over {MAX_NEEDED:,} repetitions would resolve {share}"
    else:
        words = f"about {needed} repetitions would resolve {share}"
    if verdict == "no difference":
        words = f"no difference detectable: {words}"
    return words + (" (busy machine: may be noise)" if busy else "")


def needed_repetitions(
    variance: float, *, resolve: float = RESOLVE, power: float = POWER
) -> int | None:
    """Repetitions a side for a two-sided 95 % Welch test to find a `resolve` share with
    `power`, from the log rates' variance (see the module's docstring)."""
    if not math.isfinite(variance) or variance < 0:
        return None
    delta = math.log1p(resolve)

    def want(n: int) -> int:
        """The size the formula asks for with t at n repetitions a side (falls as n grows)."""
        df = 2 * n - 2
        t = t_quantile(0.5 + CONFIDENCE / 2, df) + t_quantile(power, df)
        return max(2, math.ceil(2 * variance * t * t / (delta * delta)))

    # the smallest n with want(n) <= n: the normal quantiles' size is below it, want(it) above
    z = statistics.NormalDist().inv_cdf
    low = max(2, math.ceil(2 * variance * (z(0.5 + CONFIDENCE / 2) + z(power)) ** 2 / delta**2))
    if low >= MAX_NEEDED:
        return MAX_NEEDED
    high = want(low)
    if high <= low:
        return low
    while low < high:
        mid = (low + high) // 2
        if want(mid) <= mid:
            high = mid
        else:
            low = mid + 1
    return min(low, MAX_NEEDED)


def _exp(x: float) -> float:
    """e**x, an infinity past a float's range: rates 10^300 apart are a ratio, not an error."""
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


def compare(
    a: Iterable[float], b: Iterable[float], *, busy: bool = False, resolve: float = RESOLVE
) -> Difference:
    """B's repetitions (rates) against A's: ratio B/A of the geometric means, its 95 % interval
    by Welch's t on the log rates, the repetitions needed to resolve `resolve`."""
    sa, sb = LogSample.of(a), LogSample.of(b)
    if not (sa.n and sb.n):
        return Difference(None, None, None, sa.n, sb.n, None, None, busy, resolve)
    ratio = _exp(sb.mean - sa.mean)
    needed = None
    spread = [s for s in (sa, sb) if s.n > 1]  # the pooled variance of the sides that have one
    if spread:
        pooled = sum((s.n - 1) * s.variance for s in spread) / sum(s.n - 1 for s in spread)
        needed = needed_repetitions(pooled, resolve=resolve)
    if sa.n < 2 or sb.n < 2:
        return Difference(ratio, None, None, sa.n, sb.n, None, needed, busy, resolve)
    va, vb = sa.variance / sa.n, sb.variance / sb.n
    se = math.sqrt(va + vb)
    d = sb.mean - sa.mean
    if se == 0.0:
        return Difference(ratio, ratio, ratio, sa.n, sb.n, math.inf, needed, busy, resolve)
    df = (va + vb) ** 2 / (va * va / (sa.n - 1) + vb * vb / (sb.n - 1))
    t = t_quantile(0.5 + CONFIDENCE / 2, df)
    low, high = _exp(d - t * se), _exp(d + t * se)
    return Difference(ratio, low, high, sa.n, sb.n, df, needed, busy, resolve)


def record_fields(found: Difference | None, prefix: str) -> dict[str, Any]:
    """A difference as record fields, for history to pool and scripts to read: the ratio of
    geometric means, its 95 % interval, the verdict's word, the repetitions a side it rests on
    and those that would resolve 2 % (None where unknown)."""
    if found is None:
        names = ("ratio", "low", "high", "verdict", "busy", "reps", "needed_reps")
        return {f"{prefix}_{k}": None for k in names}
    return {
        f"{prefix}_ratio": None if found.ratio is None else round(found.ratio, 4),
        f"{prefix}_low": None if found.low is None else round(found.low, 4),
        f"{prefix}_high": None if found.high is None else round(found.high, 4),
        f"{prefix}_verdict": found.verdict,
        f"{prefix}_busy": found.busy,
        f"{prefix}_reps": [found.n_a, found.n_b],
        f"{prefix}_needed_reps": found.needed,
    }
