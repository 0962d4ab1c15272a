"""Whether llama.cpp's weight repacking is safe on this CPU, found out in a child process.

Repacking puts weights into the CPU backend's extra buffer types (AMX, AArch64 layouts) for
faster kernels. Some kernels crash the whole process: the llama.cpp in llama-cpp-python 0.3.36
dies with SIGILL on AMX CPUs as soon as a batch of more than one token reaches them (an invalid
tile config, llama.cpp PR #26954). Rather than guess from CPU flags, a short child process loads
the model with repacking on and decodes a few multi-token batches; its verdict is kept per
llama.cpp build, CPU and quantization, so a fixed llama.cpp brings the fast path back by itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from . import children
from .files import read_capped
from .paths import state_dir
from .system import cpu_flags, cpu_model

PROBE_TIMEOUT_S = 120.0
POLL_S = 0.1  # how often the wait for the child looks at the command's cancel
# Signals that end a probe from outside (a terminal's Ctrl-C reaches the child, as do a
# hang-up and a termination): how the probe ended then says nothing about llama.cpp's kernels.
# A SIGKILL does: the out-of-memory killer's, the one that comes unasked (the probe's own
# kills, on Ctrl-C and past its time, are judged before the child's end is read).
STOPPED_BY = (2, 1, 15)  # SIGINT, SIGHUP, SIGTERM
KILLED = 9  # SIGKILL

# The child: load with repacking, decode 2- and 8-token batches; exit 0 if all went through.
PROBE_CODE = r"""
import ctypes, os, sys
os.environ.setdefault("GGML_NO_BACKTRACE", "1")
import llama_cpp as l
quiet = l.llama_log_callback(lambda *a: None)  # kept referenced: llama.cpp calls it later
l.llama_log_set(quiet, ctypes.c_void_p(0))
l.llama_backend_init()
mp = l.llama_model_default_params()
mp.n_gpu_layers = 0
mp.use_extra_bufts = True
model = l.llama_model_load_from_file(sys.argv[1].encode(), mp)
if not model:
    sys.exit(3)
cp = l.llama_context_default_params()
cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = 64, 16, 16, 1
usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
cp.n_threads = cp.n_threads_batch = max(1, min(4, usable or 1))  # the CPUs llmrun may use
ctx = l.llama_init_from_model(model, cp)
if not ctx:
    sys.exit(3)
n_vocab = l.llama_vocab_n_tokens(l.llama_model_get_vocab(model))
for n in (2, 8):
    toks = (l.llama_token * n)(*[(i * 7 + 1) % n_vocab for i in range(n)])
    if l.llama_decode(ctx, l.llama_batch_get_one(toks, n)) != 0:
        sys.exit(4)
    l.llama_synchronize(ctx)
print("ok")
"""


@dataclass(frozen=True)
class Verdict:
    safe: bool
    why: str  # for the stats: "probed", or how the probe died
    # The child process's time when the probe ran now (a new quantization or llama.cpp build),
    # None when the verdict came from the cache: the first load's own figure, not load time
    probe_s: float | None = None
    interrupted: bool = False  # a signal ended the probe (Ctrl-C reaches its process group too)


def _build_id() -> str:
    """The llama.cpp that would run: llama_cpp's version and its CPU library's identity."""
    import importlib.util

    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.origin:
        return "unknown"
    lib_dir = Path(spec.origin).parent / "lib"
    parts = []
    for path in sorted(lib_dir.glob("*ggml-cpu*")) + sorted(lib_dir.glob("libllama*")):
        with contextlib.suppress(OSError):
            st = path.stat()
            parts.append(f"{path.name}:{st.st_size}:{int(st.st_mtime)}")
    return ";".join(parts) or spec.origin


def probe_key(quantization: str) -> str:
    cpu = f"{cpu_model()}|{' '.join(sorted(cpu_flags()))}"
    raw = f"{_build_id()}|{cpu}|{quantization}"
    return hashlib.sha256(raw.encode()).hexdigest()[:32]


def _cache_file() -> Path:
    return state_dir() / "repack-probe.json"


MAX_CACHE_BYTES = 2**20  # a verdict per model and CPU: a few hundred bytes each


def _read_cache() -> dict[str, object]:
    """The verdicts saved, or none when the file is missing or damaged (probed again). Read as a
    regular file only: a FIFO put there blocked the open of every run, SIGTERM included."""
    try:
        raw = read_capped(_cache_file(), max_bytes=MAX_CACHE_BYTES, regular=True)
        data = json.loads(raw.decode("utf-8"))
    except (OSError, ValueError, RecursionError):  # FileTooLargeError and bad UTF-8 are ValueErrors
        return {}
    return data if isinstance(data, dict) else {}


def _write_cache(key: str, verdict: Verdict) -> None:
    data = _read_cache()
    data[key] = {"safe": verdict.safe, "why": verdict.why}
    path = _cache_file()
    with contextlib.suppress(OSError):  # no state directory: probe again next time
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
        tmp.replace(path)


def run_probe(
    model_path: str, command: list[str] | None = None, cancel: threading.Event | None = None
) -> Verdict:
    """Run the probe child (or `command`, for tests) and judge how it ended. Setting `cancel`
    (the command's Ctrl-C or SIGTERM, which a child outside the terminal's process group
    never sees) ends the child at once: an interrupted probe, no verdict."""
    argv = command or [sys.executable, "-c", PROBE_CODE, model_path]
    env = {**os.environ, "GGML_NO_BACKTRACE": "1"}
    try:  # a Ctrl-C inside Popen must not leave the probe running unheld
        child, held = children.popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            stdin=subprocess.DEVNULL,
        )
    except OSError as e:
        return Verdict(False, f"the probe could not start ({e.strerror or e})")
    with child:
        try:
            if held is not None:  # delivered now that the child is ours to kill
                signal.raise_signal(held)
            deadline = time.monotonic() + PROBE_TIMEOUT_S
            while True:
                try:
                    child.communicate(timeout=POLL_S)  # a signal's handler runs in between
                    break
                except subprocess.TimeoutExpired:
                    if cancel is not None and cancel.is_set():
                        child.kill()
                        child.communicate()
                        return Verdict(False, "the probe was interrupted", interrupted=True)
                    if time.monotonic() > deadline:
                        child.kill()
                        child.communicate()
                        return Verdict(False, f"the probe did not finish in {PROBE_TIMEOUT_S:g} s")
        except BaseException:  # a second Ctrl-C: the child goes with the command
            child.kill()
            raise
    if child.returncode == 0:
        return Verdict(True, "probed")
    if child.returncode < 0:
        if -child.returncode in STOPPED_BY:  # no verdict: kept for this load, never cached
            return Verdict(False, "the probe was interrupted", interrupted=True)
        if -child.returncode == KILLED:  # a verdict, cached: probing again would do it again
            return Verdict(False, "a probe was killed (SIGKILL: out of memory, most likely)")
        try:
            name = signal.Signals(-child.returncode).name
        except ValueError:
            name = f"signal {-child.returncode}"
        return Verdict(False, f"llama.cpp's repacked kernels crashed a probe ({name})")
    return Verdict(False, f"the probe failed (exit {child.returncode})")


def repack_verdict(
    model_path: str, quantization: str, cancel: threading.Event | None = None
) -> Verdict:
    """Whether repacking is safe for this model's quantization here (probed once, then kept);
    `cancel` ends a probe under way."""
    key = probe_key(quantization)
    cached = _read_cache().get(key)
    if isinstance(cached, dict) and isinstance(cached.get("safe"), bool):
        return Verdict(bool(cached["safe"]), str(cached.get("why", "probed")))
    t0 = time.perf_counter()
    verdict = run_probe(model_path, cancel=cancel)
    if not verdict.interrupted:  # a Ctrl-C in the first load disabled repacking for good
        _write_cache(key, verdict)
    return dataclasses.replace(verdict, probe_s=time.perf_counter() - t0)
