"""llama.cpp's CPU threadpool as llama-bench makes one: a CPU mask, strict placement, polling
and priority for the threads that compute a context's graphs.

llama-cpp-python 0.3.36 binds none of it. `ggml_threadpool_new`/`_free` are found through
ggml's CPU backend registry (as llama-bench finds them, so the copy of libggml-cpu that
llama.cpp computes with makes the pool), `ggml_threadpool_params_init` in libggml-base and
`llama_attach_threadpool` in libllama. A context with default settings gets no pool of its own:
ggml then makes one per graph with these same defaults (no mask, poll 50, normal priority).

ggml applies the mask and priority in the threads that compute, at each graph, and never undoes
them: an OpenMP build (the default) leaves its worker threads and the calling thread pinned after
the pool is gone. When the last pool is freed, every thread of the process is given back the
CPUs and scheduling it had before the first pool. An OpenMP build also computes a one-thread
graph on the calling thread without applying either, and has no polling to tune (llama-bench
built the same way behaves the same).
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import BadRequestError, EngineError, OptionError
from .system import format_cpu_list

MAX_N_THREADS = 512  # GGML_MAX_N_THREADS (ggml.h): the CPUs a mask can name
MAX_MASK_DIGITS = MAX_N_THREADS // 4  # parse_cpu_mask reads at most 128 hex digits
PRIORITIES = {-1: "low", 0: "normal", 1: "medium", 2: "high", 3: "realtime"}  # ggml_sched_priority
DEFAULT_POLL = 50  # ggml_threadpool_params_init's


class _Params(ctypes.Structure):
    """struct ggml_threadpool_params (ggml.h); `_check_layout` verifies it on the loaded library."""

    _fields_ = [
        ("cpumask", ctypes.c_bool * MAX_N_THREADS),
        ("n_threads", ctypes.c_int),
        ("prio", ctypes.c_int),  # enum ggml_sched_priority
        ("poll", ctypes.c_uint32),
        ("strict_cpu", ctypes.c_bool),
        ("paused", ctypes.c_bool),
    ]


def parse_cpu_mask(text: str) -> frozenset[int]:
    """The CPUs a mask names, read as llama.cpp's parse_cpu_mask reads it: hex digits, the last
    one CPUs 0-3, with an optional `0x`. `0x0` names none (the default placement)."""
    digits = text[2:] if text.startswith("0x") else text
    if not digits:
        raise OptionError(f"-C/--cpu-mask '{text}': give a hex mask such as 0x3")
    bad = next((c for c in digits if c not in "0123456789abcdefABCDEF"), None)
    if bad is not None:
        raise OptionError(
            f"-C/--cpu-mask '{text}': '{bad}' is not a hex digit (a mask"
            " is hex, such as 0xff for CPUs 0-7)"
        )
    if len(digits) > MAX_MASK_DIGITS:
        raise OptionError(
            f"-C/--cpu-mask: at most {MAX_MASK_DIGITS} hex digits"
            f" ({MAX_N_THREADS} CPUs), not {len(digits)}"
        )
    value = int(digits, 16)
    return frozenset(cpu for cpu in range(MAX_N_THREADS) if value >> cpu & 1)


@functools.cache
def _process_placement() -> tuple[frozenset[int], int, int]:
    """The CPUs, scheduling policy and priority the process had before any pool pinned it."""
    return (
        frozenset(os.sched_getaffinity(0)),
        os.sched_getscheduler(0),
        os.sched_getparam(0).sched_priority,
    )


def available_cpus() -> frozenset[int]:
    """The CPUs this process may run on (taskset, cgroups), as it started; every CPU where the
    system has no affinity calls (macOS)."""
    if not hasattr(os, "sched_getaffinity"):
        return frozenset(range(os.cpu_count() or 1))
    return _process_placement()[0]


@dataclass(frozen=True)
class ThreadpoolSettings:
    """llama-bench's -C/--cpu-mask, --cpu-strict, --poll and --prio for a context's threads.

    `cpu_mask` is kept as given (llama-bench records it so); 0x0 means no mask."""

    cpu_mask: str = "0x0"
    strict: bool = False
    poll: int = DEFAULT_POLL  # 0: threads sleep between graphs; 100: they spin the longest
    prio: int = 0  # PRIORITIES

    def __post_init__(self) -> None:
        parse_cpu_mask(self.cpu_mask)
        if not 0 <= self.poll <= 100:
            raise BadRequestError(f"--poll {self.poll}: the polling level is 0..100")
        if self.prio not in PRIORITIES:
            raise BadRequestError(f"--prio {self.prio}: give -1, 0, 1, 2 or 3")

    @property
    def is_default(self) -> bool:
        """Whether ggml's own per-graph pool runs exactly this (no pool of llmrun's needed)."""
        return not self.cpus and not self.strict and self.poll == DEFAULT_POLL and not self.prio

    @property
    def cpus(self) -> frozenset[int]:
        return parse_cpu_mask(self.cpu_mask)

    def placement(self, n_threads: int) -> list[frozenset[int]]:
        """The CPUs each of `n_threads` threads may run on, as ggml_thread_cpumask_next deals
        them: the whole mask to every thread, or (strict) one CPU each in turn. Refused where
        a thread would have no CPU this process may use."""
        cpus, usable = self.cpus, available_cpus()
        if (cpus or self.prio) and not hasattr(os, "sched_getaffinity"):
            raise BadRequestError(
                "-C/--cpu-mask and --prio need Linux's CPU affinity calls, which this system lacks"
            )
        if not cpus:
            return [usable] * n_threads
        if not cpus & usable:
            raise BadRequestError(
                f"-C/--cpu-mask {self.cpu_mask}: no CPU it names ({format_cpu_list(cpus)}) is"
                f" one this process may run on ({format_cpu_list(usable)})"
            )
        if not self.strict:
            return [cpus & usable] * n_threads
        ordered = sorted(cpus)
        dealt = [frozenset({ordered[i % len(ordered)]}) for i in range(n_threads)]
        missing = sorted(c for one in dealt for c in one if c not in usable)
        if missing:
            raise BadRequestError(
                f"--cpu-strict 1 with -C {self.cpu_mask}: {n_threads} threads go to CPUs"
                f" {format_cpu_list(frozenset().union(*dealt))}, and this process may not run on"
                f" {format_cpu_list(set(missing))} (it may use {format_cpu_list(usable)})"
            )
        return dealt

    def record(self) -> dict[str, Any]:
        """The bench record's fields, as llama-bench writes them."""
        return {"cpu_mask": self.cpu_mask, "cpu_strict": self.strict, "poll": self.poll}


class _Api:
    """The threadpool functions of the llama.cpp that llama_cpp loaded."""

    def __init__(self) -> None:
        from .library import llama_lib
        from .llama_cpp_adapter import libllama

        llama_cpp = llama_lib()  # the log callback and abort handling come first
        lib_dir = Path(llama_cpp.__file__).parent / "lib"
        vp = ctypes.c_void_p
        self.llama = libllama()
        ggml, base = _linked(lib_dir, "ggml"), _linked(lib_dir, "ggml-base")
        for lib, name, restype, argtypes in (
            (self.llama, "llama_attach_threadpool", None, [vp, vp, vp]),
            (self.llama, "llama_detach_threadpool", None, [vp]),
            (ggml, "ggml_backend_dev_by_type", vp, [ctypes.c_int]),
            (ggml, "ggml_backend_dev_backend_reg", vp, [vp]),
            (ggml, "ggml_backend_reg_get_proc_address", vp, [vp, ctypes.c_char_p]),
        ):
            getattr(lib, name).restype, getattr(lib, name).argtypes = restype, argtypes
        cpu = ggml.ggml_backend_dev_by_type(0)  # GGML_BACKEND_DEVICE_TYPE_CPU
        reg = ggml.ggml_backend_dev_backend_reg(cpu) if cpu else None
        if not reg:
            raise EngineError("this llama.cpp has no CPU backend to make a threadpool for")

        def proc(name: str, restype: Any, *argtypes: Any) -> Any:
            address = ggml.ggml_backend_reg_get_proc_address(reg, name.encode())
            if not address:
                raise EngineError(f"this llama.cpp's CPU backend has no {name}")
            return ctypes.CFUNCTYPE(restype, *argtypes)(address)

        params = ctypes.POINTER(_Params)
        self.new = proc("ggml_threadpool_new", vp, params)
        self.free = proc("ggml_threadpool_free", None, vp)
        self.params_init = base.ggml_threadpool_params_init
        self.params_init.argtypes, self.params_init.restype = [vp, ctypes.c_int], None
        _check_layout(self.params_init)


def _linked(lib_dir: Path, name: str) -> ctypes.CDLL:
    """The copy of lib`name` that libllama links (its soname, `.so.0`): the wheel ships the
    library several times under other names, each a separate copy once loaded."""
    for candidate in (f"lib{name}.so.0", f"lib{name}.so", f"lib{name}.dylib", f"{name}.dll"):
        path = lib_dir / candidate
        if path.exists():
            return ctypes.CDLL(str(path))
    raise EngineError(f"lib{name} is not in {lib_dir}")


def _check_layout(params_init: Any) -> None:
    """That ggml's params are the struct above: initialised over a larger buffer, n_threads and
    poll land where expected, and nothing past its end is written."""
    size = ctypes.sizeof(_Params)
    buf = (ctypes.c_ubyte * (size + 256))(*([0xAB] * (size + 256)))
    params_init(ctypes.addressof(buf), 7)
    p = _Params.from_buffer(buf)
    if (
        (p.n_threads, p.poll, p.prio, p.strict_cpu, p.paused) != (7, DEFAULT_POLL, 0, False, False)
        or any(b != 0xAB for b in buf[size:])
        or any(p.cpumask)
    ):
        raise EngineError(
            "this llama.cpp's ggml_threadpool_params is not the layout llmrun"
            " knows (GGML_MAX_N_THREADS 512): cannot make a threadpool"
        )


_api = functools.cache(_Api)  # made once, on the first pool


_live_lock = threading.Lock()
_live_pools = 0  # pools not yet freed: the process's placement is given back after the last


class Threadpool:
    """One ggml_threadpool, freed exactly once (after the contexts that use it)."""

    def __init__(self, settings: ThreadpoolSettings, n_threads: int) -> None:
        global _live_pools
        if n_threads < 1:
            raise BadRequestError(f"a threadpool needs at least one thread, not {n_threads}")
        settings.placement(n_threads)  # refused before anything is made
        api = _api()
        p = _Params()
        api.params_init(ctypes.addressof(p), n_threads)
        for cpu in settings.cpus:
            p.cpumask[cpu] = True
        p.strict_cpu, p.poll, p.prio = settings.strict, settings.poll, settings.prio
        self._api, self.settings, self.n_threads = api, settings, n_threads
        # what was handed over, read back from the struct: this is what the record says
        self.applied = {
            "cpu_mask": settings.cpu_mask,
            "cpu_strict": bool(p.strict_cpu),
            "poll": int(p.poll),
        }
        with _live_lock:
            self.ptr: Any = api.new(ctypes.byref(p))
            if not self.ptr:
                raise EngineError(f"llama.cpp could not make a threadpool of {n_threads} threads")
            _live_pools += 1

    @property
    def _as_parameter_(self) -> Any:
        return ctypes.c_void_p(self.ptr)

    def close(self) -> None:
        global _live_pools
        with _live_lock:  # two closers at once (a server's stop and the runner's close)
            if self.ptr is None:
                return
            self._api.free(self.ptr)
            self.ptr = None
            _live_pools -= 1
            if _live_pools == 0:
                _give_back_placement()


def _give_back_placement() -> None:
    """Every thread of the process back on the CPUs and scheduling it had before the pools."""
    cpus, policy, priority = _process_placement()
    for tid in _thread_ids():
        try:
            if os.sched_getaffinity(tid) != cpus:
                os.sched_setaffinity(tid, cpus)
            now = os.sched_getscheduler(tid), os.sched_getparam(tid).sched_priority
            if now != (policy, priority):
                os.sched_setscheduler(tid, policy, os.sched_param(priority))
        except OSError:  # the thread has ended, or the change needs a privilege
            continue


def _thread_ids() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [threading.get_native_id()]


def attach(
    ctx: Any, settings: ThreadpoolSettings, *, n_threads: int, n_threads_batch: int
) -> tuple[Threadpool, ...]:
    """Pools for a context's graphs, attached to it, for the context to free after itself: one
    pool, or a second for batches when their thread count differs (the pool must have as many
    threads as the graph asks for). None with default settings."""
    if settings.is_default:
        return ()
    pools = [Threadpool(settings, n_threads)]
    try:
        if n_threads_batch != n_threads:
            pools.append(Threadpool(settings, n_threads_batch))
    except BaseException:
        pools[0].close()
        raise
    _api().llama.llama_attach_threadpool(ctx, pools[0], pools[-1])
    return tuple(pools)
