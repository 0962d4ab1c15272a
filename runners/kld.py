"""KL divergence of a model's next-token distributions from a base model's, on the same tokens and
windows as the perplexity: `llama-perplexity --kl-divergence`'s figures, by its definitions
(llama.cpp's tools/perplexity/perplexity.cpp: `log_softmax`, `process_logits`, `kl_divergence`).

The base model's log-probabilities are what the comparison needs, and a long text's are large
(vocabulary x positions: 49,152 x 2 bytes = 96 KiB per position for SmolLM2). As llama-perplexity's
base file, each position's are kept quantized to uint16 over the 16 nats below the most likely
token, with a scale and offset per position; the rows go to a temporary file, not to memory, and
are read back a chunk at a time while the later model is scored. Memory holds 8 bytes per
position of the base, and per compared position its KLD and Δp (4 bytes each)."""

from __future__ import annotations

import math
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO, Any

from .errors import BadRequestError

FLOOR_NATS = 16.0  # log-probs more than this below the top are stored as 0 and left out
ROWS = 32  # positions per vectorized chunk (ROWS x vocabulary float32 arrays)
LEVELS = 65535  # uint16's steps over the stored range


@dataclass(frozen=True)
class KldStats:
    """A model's next-token distributions against the base model's, over `positions` positions:
    llama-perplexity's `KL divergence statistics` and `Token probability statistics`. Δp is the
    probability the model gives the text's next token minus the base's (a fraction, not %);
    each `_unc` is the standard error of the mean beside it, as llama-perplexity's `±`."""

    positions: int
    kld_mean: float
    kld_mean_unc: float
    kld_median: float
    kld_p90: float
    kld_p95: float
    kld_p99: float
    kld_p999: float
    kld_max: float
    same_top_p: float  # positions where both models' most likely token is the same
    same_top_p_unc: float
    dp_mean: float
    dp_mean_unc: float
    dp_rms: float
    dp_rms_unc: float

    def record(self) -> dict[str, float | int]:
        """Bench's record fields (llmrun's extra columns), to 6 significant digits (a Q8_0's
        mean KLD can be 0.0001); -0.0 (a sum that rounded below zero) as 0."""
        return {
            name: float(f"{value:.6g}") + 0.0
            for name, value in vars(self).items()
            if name != "positions"
        }


# bench's record fields for a KLD, in order (the csv header names them all)
RECORD_FIELDS = tuple(name for name in KldStats.__dataclass_fields__ if name != "positions")


def mean_and_uncertainty(total: float, squares: float, count: int) -> tuple[float, float]:
    """The mean of `count` values from their sum and sum of squares, and its standard error
    (llama-perplexity's: none under 11 values)."""
    if count < 1:
        return 0.0, 0.0
    mean = total / count
    var = squares / count - mean * mean
    return mean, math.sqrt(var / (count - 1)) if var > 0 and count > 10 else 0.0


def percentile(ordered: Any, fraction: float) -> float:
    """llama-perplexity's percentile of sorted float32 values: linear between the two nearest,
    in float32 as its (so the figures agree to the last digit it prints)."""
    import numpy as np

    n = len(ordered)
    if fraction <= 0:
        return float(ordered[0])
    if fraction >= 1:
        return float(ordered[-1])
    p = np.float32(fraction) * np.float32(n - 1)
    i = int(p)
    p -= np.float32(i)
    low, high = np.float32(ordered[i]), np.float32(ordered[min(i + 1, n - 1)])
    return float((np.float32(1) - p) * low + p * high)


def _log_sum_exp(logits: Any) -> tuple[Any, Any, Any]:
    """Each row's top index, top logit and float32 log of the sum of exp(logit - top)."""
    import numpy as np

    top_index = logits.argmax(axis=1)
    top = logits[np.arange(len(logits)), top_index]
    sum_exp = np.exp(logits - top[:, None]).sum(axis=1, dtype=np.float64)
    return top_index, top, np.log(sum_exp).astype(np.float32)


def quantize(logits: Any) -> tuple[Any, Any, Any]:
    """Rows of float32 logits as llama-perplexity's base file keeps them: per row a scale and the
    least log-prob kept (float32), and each token's log-prob as uint16 steps above it; tokens
    more than 16 nats under the top are 0. (llama.cpp can round the top token's step to 65536,
    which its uint16 wraps to 0; here it stays at 65535.)"""
    import numpy as np

    logits = np.asarray(logits, dtype=np.float32)
    _, top, lse = _log_sum_exp(logits)
    low = np.maximum(logits.min(axis=1), top - np.float32(FLOOR_NATS))
    least = low - top - lse
    scale = (top - low) / np.float32(LEVELS)
    inverse = np.divide(np.float32(1), scale, out=np.zeros_like(scale), where=scale > 0).astype(
        np.float32
    )
    steps = np.rint(inverse[:, None] * (logits - low[:, None]))
    steps = np.where(logits > low[:, None], np.minimum(steps, LEVELS), 0)
    return scale.astype(np.float32), least.astype(np.float32), steps.astype(np.uint16)


@dataclass(frozen=True)
class Compared:
    """One chunk of positions compared: each one's KLD and Δp, and how many kept the top token."""

    kld: Any  # float32 per position
    p_diff: Any  # float32 per position
    same_top: int


def compare_rows(logits: Any, targets: Any, scale: Any, least: Any, steps: Any) -> Compared:
    """One chunk of positions: the model's float32 logits against the base's quantized
    log-probs, with the text's next token at each (llama-perplexity's KL `log_softmax`)."""
    import numpy as np

    logits = np.asarray(logits, dtype=np.float32)
    rows = np.arange(len(logits))
    top_index, top, lse = _log_sum_exp(logits)
    nll = top + lse - logits[rows, targets]
    base_log_p = scale[:, None] * steps.astype(np.float32) + least[:, None]
    nll_base = -base_log_p[rows, targets]
    log_z = top + lse  # the model's log-prob of token i is logits[i] - log_z
    terms = np.exp(base_log_p) * (base_log_p - logits + log_z[:, None])
    kld = np.where(base_log_p > -np.float32(FLOOR_NATS), terms, 0).sum(axis=1, dtype=np.float64)
    same = int((top_index == steps.argmax(axis=1)).sum())
    p_diff = np.exp(-nll) - np.exp(-nll_base)
    return Compared(kld.astype(np.float32), p_diff.astype(np.float32), same)


def statistics(kld: Any, p_diff: Any, same_top: int) -> KldStats:
    """llama-perplexity's summary of per-position KLDs and Δps (the sums in double precision)."""
    import numpy as np

    count = len(kld)
    if count == 0:
        raise BadRequestError("--kld: no position was scored")
    k64, d64 = kld.astype(np.float64), p_diff.astype(np.float64)
    mean, mean_unc = mean_and_uncertainty(float(k64.sum()), float((k64 * k64).sum()), count)
    dp, dp_unc = mean_and_uncertainty(float(d64.sum()), float((d64 * d64).sum()), count)
    d2 = d64 * d64
    mse, mse_unc = mean_and_uncertainty(float(d2.sum()), float((d2 * d2).sum()), count)
    rms = math.sqrt(mse)
    top = same_top / count
    ordered = np.sort(kld)
    half = count // 2
    median = (
        0.5 * (float(ordered[half]) + float(ordered[half - 1]))
        if count % 2 == 0
        else float(ordered[half])
    )
    return KldStats(
        positions=count,
        kld_mean=mean,
        kld_mean_unc=mean_unc,
        kld_median=median,
        kld_p90=percentile(ordered, 0.9),
        kld_p95=percentile(ordered, 0.95),
        kld_p99=percentile(ordered, 0.99),
        kld_p999=percentile(ordered, 0.999),
        kld_max=float(ordered[-1]),
        same_top_p=top,
        same_top_p_unc=math.sqrt(top * (1 - top) / (count - 1)) if count > 1 else 0.0,
        dp_mean=dp,
        dp_mean_unc=dp_unc,
        dp_rms=rms,
        dp_rms_unc=0.5 / rms * mse_unc if rms > 0 else 0.0,
    )


class KldBase:
    """The base model's quantized log-probs of every scored position, in a temporary file (gone
    when closed), with the tokens and windows they were scored on: `add` takes each batch's
    logits as the base model's perplexity runs, `compare` starts a later model's comparison."""

    def __init__(self, *, directory: str | None = None) -> None:
        # held open across the models' scoring; close() ends it
        self._file: IO[bytes] = tempfile.TemporaryFile(  # noqa: SIM115
            prefix="llmrun-kld-", dir=directory
        )
        self.n_vocab = 0
        self.tokens: tuple[int, ...] = ()
        self.n_ctx = 0
        self.positions = 0
        self._scales: list[Any] = []
        self._leasts: list[Any] = []

    def start(self, tokens: Sequence[int], *, n_ctx: int, n_vocab: int) -> None:
        """The text and windows the base model is about to score."""
        self.tokens, self.n_ctx, self.n_vocab = tuple(tokens), n_ctx, n_vocab

    def add(self, logits: Any, targets: Sequence[int]) -> None:
        """A batch's scored positions: rows of the base model's logits (the next tokens are the
        text's; the base's own figures need none)."""
        for at in range(0, len(logits), ROWS):
            scale, least, steps = quantize(logits[at : at + ROWS])
            try:
                self._file.write(steps.tobytes())
            except OSError as e:
                raise BadRequestError(
                    f"--kld: cannot store the first model's log-probabilities in"
                    f" {tempfile.gettempdir()} ({e.strerror or e}; they take"
                    f" {2 * self.n_vocab:,} bytes per scored token): set TMPDIR to a larger disk"
                ) from None
            self._scales.append(scale)
            self._leasts.append(least)
            self.positions += len(steps)

    def comparable(self, tokens: Sequence[int], *, n_ctx: int, n_vocab: int) -> str | None:
        """Why a model scoring these tokens cannot be compared with the base, else None."""
        if n_vocab != self.n_vocab:
            return f"its vocabulary has {n_vocab:,} tokens, the first model's {self.n_vocab:,}"
        if n_ctx != self.n_ctx or tuple(tokens) != self.tokens:
            return "it tokenizes the text differently from the first model"
        return None

    def compare(self) -> KldComparison:
        import numpy as np

        self._file.flush()
        self._file.seek(0)
        return KldComparison(
            self, np.concatenate(self._scales or [[]]), np.concatenate(self._leasts or [[]])
        )

    def read(self, rows: int) -> Any:
        import numpy as np

        data = self._file.read(rows * self.n_vocab * 2)
        return np.frombuffer(data, dtype=np.uint16).reshape(-1, self.n_vocab)

    def close(self) -> None:
        self._file.close()


class KldComparison:
    """A later model's scoring against the base, a batch at a time in the base's order."""

    def __init__(self, base: KldBase, scales: Any, leasts: Any) -> None:
        self._base = base
        self._scales, self._leasts = scales, leasts
        self._at = 0
        self._kld: list[Any] = []
        self._p_diff: list[Any] = []
        self._same_top = 0

    def add(self, logits: Any, targets: Sequence[int]) -> None:
        import numpy as np

        for at in range(0, len(logits), ROWS):
            chunk = logits[at : at + ROWS]
            n = len(chunk)
            steps = self._base.read(n)
            if len(steps) != n:
                raise BadRequestError("--kld: the model scored more positions than the first")
            rows = slice(self._at, self._at + n)
            found = compare_rows(
                chunk,
                np.asarray(targets[at : at + n]),
                self._scales[rows],
                self._leasts[rows],
                steps,
            )
            self._kld.append(found.kld)
            self._p_diff.append(found.p_diff)
            self._same_top += found.same_top
            self._at += n

    def result(self) -> KldStats:
        import numpy as np

        if self._at != self._base.positions:
            raise BadRequestError("--kld: the model scored fewer positions than the first")
        return statistics(np.concatenate(self._kld), np.concatenate(self._p_diff), self._same_top)
