"""The names llmrun takes from inside rich's live display, which rich does not publish; every use
goes through here. pyproject.toml pins the range they were checked on (rich>=13.7,<16), and
tests/test_adapters.py fails when one of them moves.

- `Live._lock`: the lock a refresh holds while it draws; the dashboard holds it to draw lines
  above the panel in the same redraw, and to keep the panel off the screen while Ctrl-Z has
  stopped the program.
- `Live._live_render`: the region Live redraws; the dashboard's own (`_ReflowRender`) counts
  the rows a narrowed terminal re-wrapped.
- `LiveRender._shape`: the width and height drawn last; None makes the next draw start afresh
  where the cursor is.
"""

from __future__ import annotations

import threading

from rich.live import Live
from rich.live_render import LiveRender


def live_lock(live: Live) -> threading.RLock:
    """The lock Live's refreshes hold while they draw."""
    return live._lock


def live_render(live: Live) -> LiveRender:
    """The region Live redraws."""
    return live._live_render


def set_live_render(live: Live, render: LiveRender) -> None:
    live._live_render = render


def drawn_shape(render: LiveRender) -> tuple[int, int] | None:
    """The (width, height) of the last draw, None before the first."""
    return render._shape


def forget_drawn(render: LiveRender) -> None:
    """The next draw starts afresh where the cursor is (nothing above it is erased)."""
    render._shape = None
