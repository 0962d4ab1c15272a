"""What the loaded llama.cpp can compute on: its backends and devices, as ggml lists them.

ggml's device registry (`ggml_backend_dev_*` in libggml) is not wrapped by llama-cpp-python; it
is reached through ctypes. The queries sit behind `DeviceQuery` so that tests can hand in a
machine with GPUs that this one does not have.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from .errors import OptionError
from .lists import whole

_KINDS = {0: "CPU", 1: "GPU", 2: "ACCEL", 3: "iGPU"}  # enum ggml_backend_dev_type


@dataclass(frozen=True)
class Device:
    name: str  # CUDA0, Metal, CPU
    description: str  # NVIDIA H200, Apple M3 Max, AMD EPYC
    kind: str  # CPU, GPU, iGPU, ACCEL
    backend: str  # the registry the device belongs to: CUDA, Metal, CPU
    free_bytes: int | None = None
    total_bytes: int | None = None

    @property
    def is_gpu(self) -> bool:
        return self.kind in ("GPU", "iGPU")


@dataclass(frozen=True)
class DeviceBandwidth:
    """How fast a device's own memory is, and how that was found out."""

    device: str  # CUDA0
    bytes_s: float
    source: str  # "timed copy through ggml", "driver: ..."


class DeviceQuery(Protocol):
    def devices(self) -> list[Device]: ...
    def commit(self) -> str: ...
    def version(self) -> str: ...
    def bandwidth(self, device: Device) -> DeviceBandwidth | None: ...


def _lib_dir() -> Path:
    """The folder of the shared libraries llama_cpp loads; after `llama_c_library()`, so that
    llmrun's log callback is in place before the first backend call (a GPU backend logs its
    set-up, e.g. `ggml_cuda_init: found 1 CUDA devices`, when it is first reached)."""
    from .library import llama_c_library, llama_lib
    from .llama_cpp_adapter import package_dir

    llama_c_library()
    folder = package_dir()
    return folder / "lib" if folder is not None else Path(llama_lib().__file__).parent / "lib"


def registered(g: ctypes.CDLL) -> list[Device]:
    """Every device in the registry of the libggml `g` (a ctypes handle), as llama.cpp lists
    them, with their free and total memory."""
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    g.ggml_backend_dev_count.restype = sz
    g.ggml_backend_dev_get.restype, g.ggml_backend_dev_get.argtypes = vp, [sz]
    for fn in ("ggml_backend_dev_name", "ggml_backend_dev_description"):
        getattr(g, fn).restype, getattr(g, fn).argtypes = ctypes.c_char_p, [vp]
    g.ggml_backend_dev_type.restype, g.ggml_backend_dev_type.argtypes = ctypes.c_int, [vp]
    g.ggml_backend_dev_memory.argtypes = [vp, ctypes.POINTER(sz), ctypes.POINTER(sz)]
    g.ggml_backend_dev_backend_reg.restype = vp
    g.ggml_backend_dev_backend_reg.argtypes = [vp]
    g.ggml_backend_reg_name.restype, g.ggml_backend_reg_name.argtypes = ctypes.c_char_p, [vp]
    out = []
    for i in range(int(g.ggml_backend_dev_count())):
        dev = g.ggml_backend_dev_get(i)
        free, total = sz(0), sz(0)
        g.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        reg = g.ggml_backend_dev_backend_reg(dev)
        out.append(
            Device(
                name=_text(g.ggml_backend_dev_name(dev)),
                description=_text(g.ggml_backend_dev_description(dev)),
                kind=_KINDS.get(int(g.ggml_backend_dev_type(dev)), "?"),
                backend=_text(g.ggml_backend_reg_name(reg)) if reg else "?",
                free_bytes=free.value or None,
                total_bytes=total.value or None,
            )
        )
    return out


class GgmlDevices:
    """The devices of the libggml that llama_cpp loaded."""

    def __init__(self) -> None:
        lib_dir = _lib_dir()
        self._ggml = _open(lib_dir, "libggml.so")
        self._base = _open(lib_dir, "libggml-base.so")

    def devices(self) -> list[Device]:
        return [] if self._ggml is None else registered(self._ggml)

    def commit(self) -> str:
        return _call_text(self._base, "ggml_commit")

    def version(self) -> str:
        return _call_text(self._base, "ggml_version")

    def bandwidth(self, device: Device) -> DeviceBandwidth | None:
        """A GPU's memory bandwidth: a timed device-to-device copy through ggml, else (CUDA)
        the driver's memory clock and bus width."""
        if not device.is_gpu:
            return None
        runs = copy_bandwidth_runs(device.name)
        if runs:
            how = f"timed copy on {device.name} through ggml, read + write, median of {len(runs)}"
            return DeviceBandwidth(device.name, statistics.median(runs), how)
        index = whole(device.name[4:])
        if device.backend == "CUDA" and index is not None:
            return nvml_bandwidth(device.name, index)
        return None


def _open(lib_dir: Path, name: str) -> ctypes.CDLL | None:
    for path in (lib_dir / name, *sorted(lib_dir.glob(name + ".*"))):
        if path.exists():
            try:
                return ctypes.CDLL(str(path))
            except OSError:
                continue
    return None


def _text(value: bytes | None) -> str:
    return (value or b"").decode("utf-8", errors="replace").strip()


def _call_text(lib: ctypes.CDLL | None, name: str) -> str:
    fn = getattr(lib, name, None) if lib is not None else None
    if fn is None:
        return ""
    fn.restype, fn.argtypes = ctypes.c_char_p, []
    return _text(fn())


# ---- memory bandwidth of a device ----------------------------------------------------------

GGML_TYPE_I8 = 24


class _GgmlInitParams(ctypes.Structure):
    _fields_ = [
        ("mem_size", ctypes.c_size_t),
        ("mem_buffer", ctypes.c_void_p),
        ("no_alloc", ctypes.c_bool),
    ]


def copy_bandwidth_runs(name: str, *, size_bytes: int = 1 << 30, reps: int = 5) -> list[float]:
    """Bytes per second (read + write) of copies between two buffers in a device's memory,
    through ggml's own copy (on CUDA a device-to-device cudaMemcpy it waits for); [] when
    the device or the memory is not there. On the CPU device it times a memcpy."""
    import llama_cpp

    lib_dir = Path(llama_cpp.__file__).parent / "lib"
    g, base = _open(lib_dir, "libggml.so"), _open(lib_dir, "libggml-base.so")
    if g is None or base is None:
        return []
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    g.ggml_backend_dev_by_name.restype, g.ggml_backend_dev_by_name.argtypes = vp, [ctypes.c_char_p]
    signatures = {
        "ggml_backend_dev_buffer_type": (vp, [vp]),
        "ggml_backend_buft_alloc_buffer": (vp, [vp, sz]),
        "ggml_backend_buffer_get_base": (vp, [vp]),
        "ggml_backend_buffer_free": (None, [vp]),
        "ggml_init": (vp, [_GgmlInitParams]),
        "ggml_free": (None, [vp]),
        "ggml_new_tensor_1d": (vp, [vp, ctypes.c_int, ctypes.c_int64]),
        "ggml_backend_tensor_alloc": (ctypes.c_int, [vp, vp, vp]),
        "ggml_backend_tensor_copy": (None, [vp, vp]),
    }
    for fn, (restype, argtypes) in signatures.items():
        f = getattr(base, fn, None) or getattr(g, fn, None)
        if f is None:
            return []
        f.restype, f.argtypes = restype, argtypes
        setattr(base, fn, f)
    dev = g.ggml_backend_dev_by_name(name.encode())
    if not dev:
        return []
    buft = base.ggml_backend_dev_buffer_type(dev)
    ctx = base.ggml_init(_GgmlInitParams(1 << 20, None, True))
    buffers = [base.ggml_backend_buft_alloc_buffer(buft, size_bytes) for _ in range(2)]
    try:
        if not ctx or not all(buffers):
            return []
        tensors = []
        for buf in buffers:
            t = base.ggml_new_tensor_1d(ctx, GGML_TYPE_I8, size_bytes)
            if base.ggml_backend_tensor_alloc(buf, t, base.ggml_backend_buffer_get_base(buf)):
                return []
            tensors.append(t)
        base.ggml_backend_tensor_copy(tensors[0], tensors[1])  # first touch, outside the timing
        runs = []
        for _ in range(reps):
            t0 = time.perf_counter()
            base.ggml_backend_tensor_copy(tensors[0], tensors[1])
            runs.append(2 * size_bytes / max(time.perf_counter() - t0, 1e-9))
        return runs
    finally:
        for buf in buffers:
            if buf:
                base.ggml_backend_buffer_free(buf)
        if ctx:
            base.ggml_free(ctx)


def driver_bandwidth(clock_mhz: int, bus_width_bits: int) -> float:
    """Peak bytes per second from the memory's clock and bus width: two transfers per clock
    (DDR, and HBM likewise)."""
    return clock_mhz * 1e6 * 2 * bus_width_bits / 8


def nvml_bandwidth(name: str, index: int) -> DeviceBandwidth | None:
    """The driver's figures for an NVIDIA GPU (NVML, the library nvidia-smi reads): its
    maximum memory clock and bus width. The CUDA index is taken as NVML's, which holds unless
    CUDA_DEVICE_ORDER reorders the GPUs of a machine with several."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    clock, bus, handle = ctypes.c_uint(0), ctypes.c_uint(0), ctypes.c_void_p()
    if nvml.nvmlInit_v2() != 0:
        return None
    try:
        nvml_clock_mem = 2
        if (
            nvml.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(index), ctypes.byref(handle))
            or nvml.nvmlDeviceGetMaxClockInfo(handle, nvml_clock_mem, ctypes.byref(clock))
            or nvml.nvmlDeviceGetMemoryBusWidth(handle, ctypes.byref(bus))
        ):
            return None
    finally:
        nvml.nvmlShutdown()
    if not clock.value or not bus.value:
        return None
    return driver_figures(name, clock.value, bus.value)


def driver_figures(name: str, clock_mhz: int, bus_width_bits: int) -> DeviceBandwidth:
    source = f"driver: {clock_mhz:,} MHz x {bus_width_bits:,}-bit bus x 2"
    return DeviceBandwidth(name, driver_bandwidth(clock_mhz, bus_width_bits), source)


QUERY: DeviceQuery | None = None  # tests put a fake machine here


_ggml_devices = functools.cache(GgmlDevices)  # opened once, on the first query


def query() -> DeviceQuery:
    return QUERY if QUERY is not None else _ggml_devices()


# ---- what llama-bench reports ---------------------------------------------------------------


def gpu_info(devices: list[Device]) -> str:
    """llama-bench's gpu_info: the GPUs' descriptions, ', '-joined; empty without one."""
    return ", ".join(d.description for d in devices if d.is_gpu)


def cpu_info(devices: list[Device]) -> str:
    return ", ".join(d.description for d in devices if d.kind == "CPU")


def backends(devices: list[Device]) -> str:
    """llama-bench's backends: the accelerator registries in use, then CPU (e.g. 'CUDA', 'CPU')."""
    return ",".join(dict.fromkeys(d.backend for d in devices if d.kind != "CPU")) or "CPU"


def build_commit(commit: str) -> str:
    """ggml's commit as llama-bench records it: a pip build's tree is 'dirty' (its patches),
    llama-bench's own build_commit of the same sources is the bare hash."""
    return commit.removesuffix("-dirty") or "unknown"


def describe_gpus(
    devices: list[Device],
    offload: bool,
    host: list[tuple[str, str]] | None = None,
    attached: list[Device] | None = None,
) -> str:
    """For people: each GPU llama.cpp can use with its free memory, or why there is none.
    `attached` --rpc servers' devices (rpc.devices()) come first, as llama.cpp lists them
    (`RPC0 host:port`, llama-bench's gpu_info): `devices` is another libggml's registry, which
    never sees them."""
    gpus = [d for d in [*(attached or []), *devices] if d.is_gpu]
    if gpus:
        return ", ".join(f"{d.name} {d.description}" + _memory(d) for d in gpus)
    if offload:
        return "none usable (this llama.cpp build can offload)"
    unused = unused_gpu_note(host or [], offload)
    return "none (CPU-only build)" + (f": {unused}" if unused else "")


def _memory(d: Device) -> str:
    if not d.total_bytes:
        return ""
    gib = 1024**3
    return f" ({(d.free_bytes or 0) / gib:.1f} of {d.total_bytes / gib:.1f} GiB free)"


# ---- GPUs the machine has, whatever this build can use ---------------------------------------


def _read_text(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read(65536)
    except OSError:
        return None


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def host_gpus(
    *,
    read: Callable[[str], str | None] = _read_text,
    listdir: Callable[[str], list[str]] = _listdir,
    exists: Callable[[str], bool] = os.path.exists,
    system: str | None = None,
    machine: str | None = None,
) -> list[tuple[str, str]]:
    """(GPU, the `make GPU=` value that builds for it), from the drivers' files: no process is
    started, so every run can ask. The arguments are for tests."""
    found: list[tuple[str, str]] = []
    for gpu in sorted(listdir("/proc/driver/nvidia/gpus")):
        info = read(f"/proc/driver/nvidia/gpus/{gpu}/information") or ""
        model = next(
            (ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("Model:")),
            "NVIDIA GPU",
        )
        found.append((model, "cuda"))
    if exists("/dev/kfd"):  # ROCm's compute device
        for card in sorted(listdir("/sys/class/drm")):
            if card.startswith("card") and whole(card[4:]) is not None:
                vendor = (read(f"/sys/class/drm/{card}/device/vendor") or "").strip()
                if vendor == "0x1002":
                    found.append(("AMD GPU", "hip"))
    system = system or platform.system()
    machine = machine or platform.machine()
    if system == "Darwin" and machine in ("arm64", "aarch64"):
        found.append(("Apple Silicon GPU", "metal"))
    return found


def unused_gpu_note(gpus: list[tuple[str, str]], offload: bool) -> str | None:
    """One line when the machine has a GPU that this CPU-only build cannot use."""
    if offload or not gpus:
        return None
    names = ", ".join(dict.fromkeys(name for name, _ in gpus))
    backend = gpus[0][1]
    return (
        f"this machine has {names}, but this llama.cpp build is CPU-only, so every figure"
        f" is the CPU's; rebuild with it: make clean && make GPU={backend}"
    )


# ---- placing tensors and choosing devices (llama-bench's -ot, -ncmoe, -dev) ----------------


class BuftOverride(ctypes.Structure):
    """llama_model_tensor_buft_override: a tensor-name pattern and the buffer type to use."""

    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


def buffer_type(name: str) -> int | None:
    """A ggml buffer type by llama-bench's name: CPU, or a device's (CUDA0, Metal)."""
    lib_dir = _lib_dir()
    if name.upper() == "CPU":
        cpu = _open(lib_dir, "libggml-cpu.so")
        if cpu is None:
            return None
        cpu.ggml_backend_cpu_buffer_type.restype = ctypes.c_void_p
        return cpu.ggml_backend_cpu_buffer_type()
    dev = device_by_name(name)
    ggml = _open(lib_dir, "libggml.so")
    if dev is None or ggml is None:
        return None
    ggml.ggml_backend_dev_buffer_type.restype = ctypes.c_void_p
    ggml.ggml_backend_dev_buffer_type.argtypes = [ctypes.c_void_p]
    return ggml.ggml_backend_dev_buffer_type(dev)


def device_by_name(name: str) -> int | None:
    ggml = _open(_lib_dir(), "libggml.so")
    if ggml is None:
        return None
    ggml.ggml_backend_dev_by_name.restype = ctypes.c_void_p
    ggml.ggml_backend_dev_by_name.argtypes = [ctypes.c_char_p]
    found = ggml.ggml_backend_dev_by_name(name.encode())
    return int(found) if found else None


# llama.cpp's LLAMA_MAX_LAYERS: no model has more blocks, so -ncmoe above it means "all"
MAX_LAYERS = 512


def moe_cpu_patterns(n_layers: int) -> list[str]:
    """llama.cpp's --n-cpu-moe: the expert tensors of the first N layers stay on the CPU."""
    return [
        rf"blk\.{i}\.ffn_(up|down|gate|gate_up)_(ch|)exps" for i in range(min(n_layers, MAX_LAYERS))
    ]


# llama.cpp matches -ot patterns with std::regex, which backtracks: a repetition inside a
# repetition, such as (.*)*, takes time exponential in a tensor name's length, and many
# repetitions in a row a high power of it. Such a pattern is refused before the model loads.
MAX_PATTERN_REPEATS = 6


def tensor_overrides(text: str | None) -> list[tuple[str, str]]:
    """-ot's PATTERN=BUFFER;... as (pattern, buffer) pairs, refused as a usage error where a
    part is no such pair or its pattern no regular expression llama.cpp could match in time."""
    pairs = []
    for part in (text or "").split(";"):
        if part.strip():
            pattern, sep, buffer = part.strip().rpartition("=")
            if not sep or not pattern or not buffer:
                raise OptionError(f"-ot: '{part.strip()}' is not PATTERN=BUFFER (e.g. ffn_.*=CPU)")
            check_tensor_pattern(pattern)
            pairs.append((pattern, buffer))
    return pairs


def check_tensor_pattern(pattern: str) -> None:
    """Refuse an -ot pattern that is no regular expression or that could match for ever."""
    from . import re_adapter as sre  # the stdlib's own parser

    try:
        parsed = sre.parse(pattern)
    except (re.error, RecursionError, OverflowError):
        raise OptionError(f"-ot: '{pattern}' is not a regular expression") from None
    repeats = 0

    def walk(items: Any, inside_repeat: bool) -> None:
        nonlocal repeats
        for op, arg in items:
            if op in sre.REPEATS:
                _low, high, body = arg
                if high > 1:
                    if inside_repeat:
                        raise OptionError(
                            f"-ot: '{pattern}' repeats a repetition, which llama.cpp's regex"
                            " matcher could take for ever over; write it without the nesting"
                        )
                    repeats += 1
                walk(body, inside_repeat or high > 1)
            elif op == sre.SUBPATTERN:
                walk(arg[-1], inside_repeat)
            elif op == sre.BRANCH:
                for branch in arg[1]:
                    walk(branch, inside_repeat)
            elif op in sre.ASSERTS:
                walk(arg[1], inside_repeat)

    walk(parsed.data, False)
    if repeats > MAX_PATTERN_REPEATS:
        raise OptionError(
            f"-ot: '{pattern}' has {repeats} repetitions; at most"
            f" {MAX_PATTERN_REPEATS}, as llama.cpp's matcher backtracks"
        )
