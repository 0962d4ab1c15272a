"""LocalScore's scenario matrix and score formula, on bench's results."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from .results import Result
from .sweep import Shape

# LocalScore's scenario matrix (prompt tokens, generated tokens).
LOCALSCORE_SCENARIOS = (
    (1024, 16),
    (4096, 256),
    (2048, 256),
    (2048, 768),
    (1024, 1024),
    (1280, 3072),
    (384, 1152),
    (64, 1024),
    (16, 1536),
)
DEFAULT_SCENARIO_SCALE = 1 / 16


def scenario_shapes(scale: float) -> list[Shape]:
    """LocalScore's matrix scaled down (at least 4 prompt and 4 generated tokens each)."""
    return [
        Shape(max(4, round(p * scale)), max(4, round(g * scale))) for p, g in LOCALSCORE_SCENARIOS
    ]


def localscore(results: Sequence[Result]) -> float | None:
    """LocalScore's formula: 10 · cbrt(mean prompt tok/s · mean gen tok/s · 1000 / mean TTFT ms).

    Prompt and generation rates are the phases' own (prefill alone, decode alone), from the
    scenario runs.
    """
    prompt, gen, ttft = [], [], []
    for r in results:
        if r.phases is not None:
            prompt += [r.phases.pp_ts] if r.phases.pp_ts else []
            gen += [r.phases.tg_ts] if r.phases.tg_ts else []
        ttft += list(r.ttft_s)
    if not (prompt and gen and ttft):
        return None
    mean_ttft_ms = statistics.fmean(ttft) * 1000
    return 10 * (statistics.fmean(prompt) * statistics.fmean(gen) * 1000 / mean_ttft_ms) ** (1 / 3)
