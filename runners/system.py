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
