"""Facts about this machine that decide good defaults (no terminal, no heavy imports)."""

from __future__ import annotations

import os


def physical_cores() -> int:
    """Physical CPU cores (not hyper-threads), from /proc/cpuinfo; logical CPUs if unknown."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return os.cpu_count() or 1
    cores: set[tuple[str, str]] = set()
    physical = core = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key == "physical id":
            physical = value
        elif key == "core id":
            core = value
        elif not key and (physical or core):
            cores.add((physical, core))
            physical = core = ""
    if physical or core:
        cores.add((physical, core))
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    count = len(cores) or os.cpu_count() or 1
    return max(1, min(count, usable or count))


def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def repack_is_safe() -> bool:
    """Whether llama.cpp's weight repacking (extra CPU buffer types) is safe to use here.

    On CPUs with AMX, llama-cpp-python 0.3.36's AMX kernels crash the process with a
    segmentation fault on the first batch of more than one token (seen on this project's
    machines), so repacking is off by default there; `--repack` turns it back on.
    """
    return "amx_int8" not in cpu_flags()


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return " ".join(line.partition(":")[2].split())
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or "unknown CPU"


def logical_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def ram_bytes() -> int | None:
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def available_memory_bytes() -> int | None:
    """Memory that new allocations can get without swapping (MemAvailable), or None."""
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def memory_bandwidth(
    *, size_bytes: int = 256 << 20, threads: int | None = None, reps: int = 5
) -> float:
    """Bytes per second a streaming copy moves (read + write), best of `reps`.

    The copy is split over `threads` threads (numpy releases the GIL while copying), as decode
    reads the weights from every core at once. Arrays far larger than any cache measure RAM.
    """
    import threading
    import time

    import numpy as np

    n = threads or physical_cores()
    src = np.ones(size_bytes // 8, dtype=np.float64)
    dst = np.empty_like(src)
    bounds = np.linspace(0, src.size, n + 1, dtype=np.int64)

    def copy(i: int) -> None:
        np.copyto(dst[bounds[i] : bounds[i + 1]], src[bounds[i] : bounds[i + 1]])

    best = float("inf")
    for _ in range(reps):
        workers = [threading.Thread(target=copy, args=(i,)) for i in range(n)]
        t = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        best = min(best, time.perf_counter() - t)
    return 2 * src.nbytes / best
