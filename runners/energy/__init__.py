"""Energy per phase from the machine's own counters, each source in its own module: Linux
powercap/RAPL for the CPU packages and DRAM (powercap), NVML's total-energy counter for NVIDIA
GPUs (nvml). `open_meter` opens what can be read here and measures the idle baseline; the
`PhaseMeter` (meter) reads the counters at the phase boundaries of a runner's events.

Apple Silicon has no source here: its energy counters are read by `powermetrics`, which needs
root, or through IOReport, a private API; neither is read.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from types import ModuleType

from .counter import Counter, Unavailable
from .meter import IDLE_WINDOW_S, PhaseMeter, on_nvidia_gpu
from .nvml import open_nvml
from .powercap import ROOT_ENV, open_powercap

__all__ = [
    "IDLE_WINDOW_S",
    "Counter",
    "PhaseMeter",
    "Unavailable",
    "on_nvidia_gpu",
    "open_meter",
]

NO_MACOS = (
    "no energy counter on macOS without root (powermetrics needs sudo; IOReport is a private"
    " API llmrun does not read)"
)


def _cpu_counter(root: str | os.PathLike[str] | None) -> Counter:
    if root is None and not os.environ.get(ROOT_ENV):
        if sys.platform == "darwin":
            raise Unavailable(NO_MACOS)
        if not sys.platform.startswith("linux"):
            raise Unavailable(f"no CPU energy counter llmrun reads on {sys.platform}")
    return open_powercap(root)


def open_meter(
    *,
    gpu: bool = True,
    powercap_root: str | os.PathLike[str] | None = None,
    nvml_module: ModuleType | None = None,
    clock: Callable[[], float] = time.perf_counter,
    sleep: Callable[[float], None] = time.sleep,
    idle_window_s: float = IDLE_WINDOW_S,
) -> PhaseMeter:
    """The counters that can be read here (NVML only if `gpu`: layers may run on a GPU), with
    the idle baseline measured now; the reasons for those that cannot."""
    counters: list[Counter] = []
    reasons: dict[str, str] = {}
    try:
        counters.append(_cpu_counter(powercap_root))
    except Unavailable as e:
        reasons["cpu"] = str(e)
    if gpu:
        try:
            counters.append(open_nvml(nvml_module))
        except Unavailable as e:
            reasons["gpu"] = str(e)
    else:
        reasons["gpu"] = "no layers were to run on a GPU"
    meter = PhaseMeter(
        counters, reasons=reasons, clock=clock, sleep=sleep, idle_window_s=idle_window_s
    )
    meter.measure_idle()
    return meter
