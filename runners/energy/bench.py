"""A bench test's energy: the phases it counts (prefill for pp, decode for tg, both for a
prompt then generation), summed over its timed repetitions, then given per repetition.

Summing the repetitions' windows before dividing lets a phase shorter than the counter's
update interval be measured: each window's read is off by at most an update at either end,
and those errors do not grow with the repetitions as the energy does."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmrun.runners.stats import EnergyReport, PhaseEnergy


@dataclass(frozen=True)
class BenchEnergy(PhaseEnergy):
    """Joules above idle per repetition of a test's counted phases (the window and tokens per
    repetition too), or why there are none (`note`); its watts and joules per token are the
    phase's."""

    source: str = ""  # the counters read; "": none
    idle_w: float | None = None
    reps: int = 0

    @classmethod
    def of(cls, report: EnergyReport, *, prefill: bool, decode: bool, reps: int) -> BenchEnergy:
        """The test's phases out of a report summed over `reps` repetitions."""
        if not report.measured:
            return cls(None, 0.0, 0, note=report.reason, reps=reps)
        phases = [
            p
            for p, counted in ((report.prefill, prefill), (report.decode, decode))
            if counted and p is not None
        ]
        per = max(reps, 1)
        window = sum(p.window_s for p in phases) / per
        tokens = sum(p.tokens for p in phases) // per
        absent = next((p for p in phases if p.energy_j is None), None)
        notes = "; ".join(dict.fromkeys(p.note for p in phases if p.note))
        if report.left_out:
            notes = "; ".join(filter(None, (notes, f"not counted: {report.left_out}")))
        common: dict[str, Any] = {"source": report.source, "idle_w": report.idle_w, "reps": reps}
        if absent is not None or not phases:
            why = absent.note if absent is not None else "no phase measured"
            return cls(None, window, tokens, note=why, **common)
        joules = sum(p.energy_j for p in phases if p.energy_j is not None) / per
        return cls(joules, window, tokens, note=notes, **common)

    def fields(self) -> dict[str, Any]:
        """The record's energy fields, every one always there (null where absent)."""
        return {
            "energy_j": _round(self.energy_j, 6),
            "energy_j_per_token": _round(self.j_per_token, 6),
            "energy_w": _round(self.power_w, 3),
            "energy_idle_w": _round(self.idle_w, 3),
            "energy_source": self.source or None,
            "energy_note": self.note or None,
        }


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


# The record's energy fields, in their order (a csv header names them all)
ENERGY_FIELDS = tuple(BenchEnergy(None, 0.0).fields())
