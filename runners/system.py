"""Facts about this machine that decide good defaults (no terminal, no heavy imports)."""

from __future__ import annotations

import os
import re
import statistics
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .devices import DeviceBandwidth


# One part of a CPU list: a CPU, a range, or a range with a stride (used/group: in each group of
# `group` CPUs from the range's first, the first `used`), as the kernel's bitmap_parselist reads
_CPU_PART = re.compile(r"(\d{1,9})(?:-(\d{1,9})(?::(\d{1,9})/(\d{1,9}))?)?", re.ASCII)
MAX_CPUS = 1 << 16  # a list naming a CPU past this is not one a kernel writes (NR_CPUS <= 8192)


def parse_cpu_list(text: str) -> list[int]:
    """The CPUs of a Linux CPU list, in its order: '0-3,8,10-11' (cpuset(7)'s list format, as
    /sys and /proc write it), strided ranges '0-7:2/4' too, whitespace and the file's newline
    around it; an empty list names none. Anything else raises one ValueError that names the
    part it could not read."""
    body = text.strip()
    cpus: list[int] = []
    for part in body.split(",") if body else []:
        found = _CPU_PART.fullmatch(part.strip())
        start, end, used, group = found.groups() if found else ("", None, None, None)
        first, last = int(start or -1), int(end or start or -1)
        each, of = (int(used), int(group)) if used and group else (1, 1)
        if not 0 <= first <= last < MAX_CPUS or not 0 < each <= of:
            raise ValueError(
                f"CPU list {body!r}: {part.strip()!r} is not a CPU, a range such as"
                f" 0-3 or a strided range such as 0-7:2/4 (CPUs 0 to"
                f" {MAX_CPUS - 1})"
            )
        cpus += [c for c in range(first, last + 1) if (c - first) % of < each]
    return cpus


def format_cpu_list(cpus: Iterable[int]) -> str:
    """The CPUs as the kernel writes a CPU list, `parse_cpu_list`'s inverse: 0,2-5."""
    runs: list[list[int]] = []
    for cpu in sorted(set(cpus)):
        if runs and cpu == runs[-1][-1] + 1:
            runs[-1].append(cpu)
        else:
            runs.append([cpu])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def performance_cores(root: str = "/sys") -> int | None:
    """Physical performance cores of a hybrid CPU (Intel's P-cores beside E-cores), or None
    when the CPU is not hybrid. The kernel lists them in /sys/devices/cpu_core/cpus."""
    try:
        cpus = parse_cpu_list(Path(f"{root}/devices/cpu_core/cpus").read_text(encoding="utf-8"))
    except (OSError, ValueError):  # no such file, or not a CPU list: not a hybrid CPU we know
        return None
    cores: set[tuple[str, str]] = set()
    for cpu in cpus:
        topo = Path(f"{root}/devices/system/cpu/cpu{cpu}/topology")
        try:
            core = (topo / "core_id").read_text(encoding="utf-8").strip()
            package = (topo / "physical_package_id").read_text(encoding="utf-8").strip()
        except OSError:
            core, package = str(cpu), "0"
        cores.add((package, core))
    return len(cores) or None


def default_threads() -> int:
    """llmrun's thread count: the physical cores, or on a hybrid CPU its performance cores
    (decode is paced by the slowest thread, and an efficiency core is that thread)."""
    p_cores, cores = performance_cores(), physical_cores()
    return min(p_cores, cores) if p_cores else cores


def physical_cores() -> int:
    """Physical CPU cores (not hyper-threads), from /proc/cpuinfo; logical CPUs if unknown."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8")
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
    return min(len(cores) or os.cpu_count() or 1, logical_cpus())


def _cpuinfo(key: str) -> str | None:
    """What follows the ':' of /proc/cpuinfo's first line that starts with `key`, or None."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((line.partition(":")[2] for line in f if line.startswith(key)), None)
    except OSError:
        return None


def cpu_flags() -> frozenset[str]:
    return frozenset((_cpuinfo("flags") or "").split())


def cpu_model() -> str:
    name = _cpuinfo("model name")
    if name is not None:
        return " ".join(name.split())
    import platform

    return platform.processor() or platform.machine() or "unknown CPU"


def logical_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _proc_kib_bytes(path: str, key: str) -> int | None:
    """One `key: N kB` figure of a /proc file in bytes, or None (not Linux, or not there)."""
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.startswith(f"{key}:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def ram_bytes() -> int | None:
    return _proc_kib_bytes("/proc/meminfo", "MemTotal")


def available_memory_bytes() -> int | None:
    """Memory that new allocations can get without swapping (MemAvailable), or None."""
    return _proc_kib_bytes("/proc/meminfo", "MemAvailable")


def memory_bandwidth_runs(
    *, size_bytes: int = 256 << 20, threads: int | None = None, reps: int = 7
) -> list[float]:
    """Bytes per second a streaming copy moves (read + write), one figure per repetition.

    The copy is split over `threads` threads (numpy releases the GIL while copying), as decode
    reads the weights from every core at once. Arrays far larger than any cache measure RAM.
    One copy is a noisy figure on a shared machine (17.6 to 38.7 GB/s were seen): the caller
    takes the median and reports the spread. The two arrays (2 x 256 MiB) are taken out of the
    process's peak memory again (`peak_rss_bytes`), which bench records as the model's.
    """
    before = peak_rss_bytes()
    rates = _copy_rates(size_bytes, threads or physical_cores(), reps)  # its arrays freed
    _reset_peak(before)
    return rates


def _copy_rates(size_bytes: int, n: int, reps: int) -> list[float]:
    import numpy as np

    src = np.ones(size_bytes // 8, dtype=np.float64)
    dst = np.empty_like(src)
    bounds = np.linspace(0, src.size, n + 1, dtype=np.int64)

    def copy(i: int) -> None:
        np.copyto(dst[bounds[i] : bounds[i + 1]], src[bounds[i] : bounds[i + 1]])

    np.copyto(dst, src)  # fault the pages in once, outside the timed copies
    rates = []
    for _ in range(reps):
        workers = [threading.Thread(target=copy, args=(i,)) for i in range(n)]
        t = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        rates.append(2 * src.nbytes / max(time.perf_counter() - t, 1e-9))
    return rates


# The peak resident memory as it stood before the bandwidth probe: the probe resets the
# kernel's high-water mark to what is resident after it, and the peak is the larger of the two
_peak_floor_bytes = 0


def peak_rss_bytes() -> int | None:
    """The process's peak resident set size so far, less the bandwidth probe's arrays: Linux's
    high-water mark (VmHWM, which the probe resets), elsewhere getrusage's (KiB on Linux, bytes
    on macOS), which nothing resets."""
    hwm = _proc_kib_bytes("/proc/self/status", "VmHWM")
    if hwm is not None:
        return max(hwm, _peak_floor_bytes)
    try:
        import resource
        import sys

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(peak if sys.platform == "darwin" else peak * 1024)
    except (ImportError, OSError):
        return None


def _reset_peak(before: int | None) -> None:
    """The high-water mark back to what is resident now (Linux's clear_refs 5), keeping the
    peak reached before as a floor; where it cannot be reset, the arrays stay in the peak."""
    global _peak_floor_bytes
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
    except OSError:
        return
    _peak_floor_bytes = max(_peak_floor_bytes, before or 0)


# ---- other processes' load during a measurement -------------------------------------------


@dataclass(frozen=True)
class CpuSample:
    wall_s: float
    busy_s: float  # CPU time all processes spent, summed over CPUs (/proc/stat)
    own_s: float  # CPU time this process spent (all its threads)


def cpu_sample() -> CpuSample | None:
    """The machine's and this process's CPU time now; None where /proc/stat is missing."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 8:
        return None
    # user nice system idle iowait irq softirq steal: all but idle and iowait are busy.
    ticks = [int(x) for x in fields[1:9]]
    busy = sum(ticks) - ticks[3] - ticks[4]
    t = os.times()
    return CpuSample(time.perf_counter(), busy / os.sysconf("SC_CLK_TCK"), t.user + t.system)


# Below this, /proc/stat's 10 ms ticks make the figure meaningless.
MIN_SAMPLE_S = 0.2


# What every measurement of other processes' load reports instead of measuring: None (always,
# in llmrun) measures. Tests set it to a number of CPUs (0.0: a quiet machine), in their own
# process and, through tests/inject/sitecustomize.py, in the llmrun processes they start, so
# busy-machine behaviour is tested without loading the CPU and no test depends on this
# machine's load. Nothing outside the process can set it: no variable or option reaches it.
background_override: float | None = None


def background_cpus(start: CpuSample | None, end: CpuSample | None) -> float | None:
    """CPUs' worth of work other processes did between two samples (0.0 on a quiet machine)."""
    if start is None or end is None or end.wall_s - start.wall_s < MIN_SAMPLE_S:
        return None
    others = (end.busy_s - start.busy_s) - (end.own_s - start.own_s)
    return max(0.0, others / (end.wall_s - start.wall_s))


def measured_background(start: CpuSample | None, end: CpuSample | None) -> float | None:
    """Other processes' load over a measurement (as background_cpus), or the tests' figure."""
    return background_override if background_override is not None else background_cpus(start, end)


def busy_machine(background: float | None, n_threads: int, logical: int | None = None) -> bool:
    """Whether other processes took CPU time llama.cpp's threads needed (they spin-wait, so even
    a little contention on a fully used machine ruins prefill figures)."""
    if background is None:
        return False
    spare = (logical or logical_cpus()) - n_threads
    return background > max(0.25, spare - 0.25)


def busy_advice(
    background: float, n_threads: int, *, logical: int | None = None, poll: bool = False
) -> str:
    """What would measure honestly on a machine this busy, with the figures: fewer threads
    (llama.cpp's threads wait for each other, so one that loses its CPU stalls them all),
    threads that sleep instead of spinning, or a quiet machine."""
    logical = logical or logical_cpus()
    free = max(1, round(logical - background))
    ways = []
    if free < n_threads:
        left = max(0.0, logical - background)
        ways.append(f"-t {free} ({left:.1f} of {logical} CPUs were free for {n_threads} threads)")
    if poll:
        ways.append("--poll 0 (waiting threads sleep instead of spinning)")
    ways.append("running when the machine is quiet")
    return "try " + ", or ".join(ways)


@dataclass(frozen=True)
class ThreadChoice:
    """How many threads llama.cpp gets where the answer is wanted (run, chat), and why."""

    threads: int
    default: int  # what a quiet machine gets: the physical (or performance) cores
    background: float | None  # CPUs' worth of other processes' work when it was chosen
    logical: int

    @property
    def reduced(self) -> bool:
        return self.threads < self.default

    @property
    def why(self) -> str:
        if self.background is None:
            return f"{self.default}: the {_cores_word()} (the load of others is unknown here)"
        if not self.reduced:
            return (
                f"{self.threads}: the {_cores_word()}; other processes use"
                f" {self.background:.1f} of {self.logical} CPUs"
            )
        return (
            f"{self.threads} of {self.default}: other processes keep {self.background:.1f}"
            f" of {self.logical} CPUs busy, and llama.cpp's spinning threads would wait on"
            f" them (-t {self.default} to use every core anyway)"
        )


def _cores_word() -> str:
    return "performance cores" if performance_cores() else "physical cores"


def choose_threads(default: int, background: float | None, logical: int) -> ThreadChoice:
    """The cores other processes leave free, at most `default`, at least one. A busy machine
    makes every llama.cpp thread wait for the slowest one: 10-30x slower at full threads."""
    if background is None or not busy_machine(background, default, logical):
        return ThreadChoice(default, default, background, logical)
    free = max(1, round(logical - background))
    return ThreadChoice(min(default, free), default, background, logical)


def background_now(seconds: float = 0.25) -> float | None:
    """Other processes' CPU use over a short look now (None where /proc/stat is missing)."""
    if background_override is not None:
        return background_override
    start = cpu_sample()
    if start is None:
        return None
    time.sleep(max(seconds, MIN_SAMPLE_S))
    return measured_background(start, cpu_sample())


class BackgroundMeter:
    """Other processes' CPU use over successive windows of at least `window_s`, for a process
    that runs for long (a server's /metrics and log). Safe to read from several threads."""

    def __init__(self, window_s: float = 1.0) -> None:
        self.window_s = max(window_s, MIN_SAMPLE_S)
        self._lock = threading.Lock()
        self._start = cpu_sample()
        self._last: float | None = background_override

    def read(self) -> float | None:
        """The figure over the window that ended last (None until one has)."""
        with self._lock:
            now = cpu_sample()
            if self._start is None or now is None:
                return background_override
            if now.wall_s - self._start.wall_s >= self.window_s:
                self._last = measured_background(self._start, now)
                self._start = now
            return self._last


# ---- the machine report of bench ---------------------------------------------------------


@dataclass(frozen=True)
class SystemInfo:
    cpu: str
    physical_cores: int
    logical_cpus: int
    ram_bytes: int | None
    build: str  # llama-cpp-python version
    features: str  # llama.cpp's system info line (backends and CPU features)
    gpu: str  # for people: the GPUs llama.cpp can use, or why none
    mem_bw_bytes_s: float | None
    build_commit: str = "unknown"  # the loaded llama.cpp's commit (ggml_commit), as llama-bench's
    build_number: int = 0  # llama.cpp's "unknown": the shared libraries do not carry it
    gpu_info: str = ""  # llama-bench's gpu_info: GPU descriptions, empty without one
    backends: str = "CPU"  # llama-bench's backends: the accelerator registries, else CPU
    ggml_version: str = ""
    mem_bw_spread: float | None = None  # (max - min) / median of the bandwidth probe's runs
    device_bandwidths: tuple[DeviceBandwidth, ...] = ()  # each GPU's memory, when probed

    @classmethod
    def collect(cls, *, bandwidth: bool = True) -> SystemInfo:
        from . import devices as dv
        from . import rpc
        from .library import llama_lib  # only when a report is asked for

        lib = llama_lib()
        info = lib.llama_print_system_info()
        features = info.decode(errors="replace") if isinstance(info, bytes) else str(info)
        q = dv.query()
        found = q.devices()
        bw = memory_bandwidth_runs() if bandwidth else []
        gpu_bw = [q.bandwidth(d) for d in found if d.is_gpu] if bandwidth else []
        return cls(
            cpu=dv.cpu_info(found) or cpu_model(),
            physical_cores=physical_cores(),
            logical_cpus=logical_cpus(),
            ram_bytes=ram_bytes(),
            build=f"llama-cpp-python {getattr(lib, '__version__', '?')}",
            features=_features(features),
            gpu=dv.describe_gpus(
                found, bool(lib.llama_supports_gpu_offload()), dv.host_gpus(), rpc.devices()
            ),
            mem_bw_bytes_s=statistics.median(bw) if bw else None,
            build_commit=dv.build_commit(q.commit()),
            gpu_info=dv.gpu_info(found),
            backends=dv.backends(found),
            ggml_version=q.version(),
            mem_bw_spread=(max(bw) - min(bw)) / statistics.median(bw) if len(bw) > 1 else None,
            device_bandwidths=tuple(b for b in gpu_bw if b is not None),
        )


# ---- the memory decode reads the weights from ----------------------------------------------

HOST_SOURCE = "streaming copy on the CPU, read + write"


@dataclass(frozen=True)
class WeightsMemory:
    """One memory that decode streams weights from: its share of them and its bandwidth."""

    name: str  # "RAM" (the host's) or a device: "CUDA0"
    share: float  # of the weights decode reads per token
    bytes_s: float | None  # None: not measured
    source: str  # how bytes_s was found


def weights_memories(
    system: SystemInfo, *, devices: str, n_offloaded: int, n_layers: int
) -> tuple[WeightsMemory, ...]:
    """Where decode reads the weights: the offloaded layers' share from the GPUs' memory
    (split evenly between several), the rest from the host's RAM.

    Shares count offloadable layers (the repeating ones and the output), as llama.cpp
    offloads them: each is read once per token. The input embedding is left out: llama.cpp
    keeps it on the CPU and decode reads one row of it per token.
    """
    names = [n.strip() for n in devices.split(",") if n.strip() and n.strip() != "CPU"]
    on_device = min(1.0, n_offloaded / n_layers) if names and n_layers and n_offloaded > 0 else 0.0
    out = []
    if on_device < 1:
        host = system.mem_bw_bytes_s
        out.append(
            WeightsMemory("RAM", 1 - on_device, host, HOST_SOURCE if host else "not measured")
        )
    for name in names if on_device > 0 else []:
        bw = next((b for b in system.device_bandwidths if b.device == name), None)
        out.append(
            WeightsMemory(
                name,
                on_device / len(names),
                bw.bytes_s if bw else None,
                bw.source if bw else "not measured",
            )
        )
    return tuple(out)


def decode_bandwidth(
    memories: tuple[WeightsMemory, ...], bytes_per_token: float, tok_s: float
) -> dict[str, Any]:
    """A decode test's bandwidth figures against the memories its weights are in.

    The roofline is the decode rate if every memory delivered its bandwidth: a token takes
    the sum over memories of (its share of the bytes / its bandwidth), since the layers run
    one after another. `bw_util` is the measured rate's share of it; `weights_bw_gbs` the
    bandwidth that roofline amounts to (a single memory's own, or the split's combination).
    """
    where = "; ".join(
        f"{m.name} {m.share:.0%} of the weights, "
        + (f"{m.bytes_s / 1e9:,.1f} GB/s ({m.source})" if m.bytes_s else "not measured")
        for m in memories
    )
    fields: dict[str, Any] = dict.fromkeys(("bw_util", "weights_bw_gbs", "decode_roofline_ts"))
    fields["mem_bw_source"] = where or None
    if not memories or any(m.share > 0 and not m.bytes_s for m in memories) or bytes_per_token <= 0:
        return fields
    roofline_s = sum(m.share * bytes_per_token / m.bytes_s for m in memories if m.bytes_s)
    if roofline_s <= 0:
        return fields
    fields.update(
        bw_util=round(tok_s * roofline_s, 4),
        weights_bw_gbs=round(bytes_per_token / roofline_s / 1e9, 3),
        decode_roofline_ts=round(1 / roofline_s, 3),
    )
    return fields


def _features(info: str) -> str:
    """llama.cpp's 'CPU : SSE3 = 1 | AVX = 1 | ...' as 'CPU: SSE3 AVX ...' (the ones it has)."""
    out: list[str] = []
    for part in info.split("|"):
        backend, sep, rest = part.partition(" : ")
        if sep:
            out.append(f"{backend.strip()}:")
            part = rest
        name, eq, value = part.partition("=")
        if eq and value.strip() not in ("0", ""):
            out.append(name.strip())
        elif not eq and part.strip():
            out.append(part.strip())
    return " ".join(out)


# ---- the model file in the page cache -------------------------------------------------------


def resident_fraction(path: str) -> float | None:
    """The share of the file's pages in the page cache now (mincore on a mapping of it): a
    load from the cache takes a fraction of one from disk."""
    import ctypes
    import mmap

    try:
        size = os.path.getsize(path)
        if size == 0:
            return None
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        vp, sz, i = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
        libc.mmap.argtypes = [vp, sz, i, i, i, ctypes.c_long]
        libc.munmap.argtypes = [vp, sz]
        libc.mincore.argtypes = [vp, sz, vp]
        pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        vec = (ctypes.c_ubyte * pages)()
        fd = os.open(path, os.O_RDONLY)
        try:
            address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        finally:
            os.close(fd)
        if address in (None, ctypes.c_void_p(-1).value):
            return None
        try:
            rc = libc.mincore(address, size, vec)  # reads no page: only asks where they are
        finally:
            libc.munmap(address, size)
        return sum(v & 1 for v in vec) / pages if rc == 0 else None
    except (OSError, ValueError, AttributeError):
        return None


def evict_from_page_cache(path: str) -> bool:
    """Ask the kernel to drop the file's cached pages (posix_fadvise DONTNEED; no root needed;
    pages another process has mapped stay). True when the advice was given."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return True
    except (OSError, AttributeError):
        return False
    finally:
        os.close(fd)
