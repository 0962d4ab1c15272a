"""What every energy source is to the meter: a counter of joules that only goes up."""

from __future__ import annotations

from typing import Protocol


class Unavailable(Exception):
    """A source cannot be read here; the message says why, in words for the user."""


class Counter(Protocol):
    """Cumulative joules since the counter was opened, wraparound already undone."""

    @property
    def name(self) -> str:
        """What is counted: 'RAPL package-0, package-0/dram', 'NVML GPU 0 (NVIDIA H200)'."""
        ...

    @property
    def kind(self) -> str:
        """'cpu' or 'gpu': a GPU counter counts only where layers run on that GPU."""
        ...

    def read_j(self) -> float:
        """Joules so far; raises `Unavailable` when a read fails."""
        ...

    def close(self) -> None: ...
