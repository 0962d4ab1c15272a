"""Loading llama.cpp's C library once, with llmrun's log callback and abort handling in place
before the first backend call.

`llama_lib()` is the only way into the bindings: it installs the log callback (so llama.cpp's
lines land in LOG_LINES, never on the terminal, and a failed load can say why) and routes
ggml's aborts into one-line errors, then initialises the backend. `llama_c_library()` does the
same for the C library alone, for questions that need no bindings (`doctor`).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .errors import EngineAbortError
from .llama_cpp_adapter import libllama, libllama_path

# What llama.cpp logged last: the reason a model failed to load is only there.
LOG_LINES: collections.deque[str] = collections.deque(maxlen=2000)
_lib: Any = None
_log_callback: Any = None  # kept referenced: llama.cpp holds a raw pointer to it
_abort_callback: Any = None  # likewise
# Where llama.cpp's log lines also go (bench -v; None: LOG_LINES alone). runners/ writes
# nothing to a terminal: the CLI sets it (cli/terminal.set_verbose), and filters what a model
# file's strings (its name) could hold for a terminal.
echo_log: Callable[[str], None] | None = None


def _default_on_abort(error: EngineAbortError) -> None:
    with contextlib.suppress(OSError):
        os.write(2, f"{error}\n".encode(errors="replace"))


# What to do with a llama.cpp abort (GGML_ASSERT/GGML_ABORT) before the process exits with 1;
# the CLI sets its own, which prints the one-line error. It must not return into llama.cpp.
on_abort: Callable[[EngineAbortError], None] = _default_on_abort


_aborting = threading.Lock()


def _fatal(message: bytes | None) -> None:
    """ggml's abort callback: report one line and exit 1 instead of abort() and a backtrace.

    Several compute threads can fail the same assertion at once: the first reports, the others
    wait for the exit."""
    if not _aborting.acquire(blocking=False):
        time.sleep(3600)
    text = (message or b"").decode("utf-8", errors="replace")
    # "/tmp/pip-…/vendor/llama.cpp/ggml/src/ggml-cpu/ops.cpp:4132: GGML_ASSERT(…) failed"
    where, sep, what = text.partition(": ")
    if sep and "/" in where:
        text = f"{what} ({where.rsplit('/', 1)[-1]})"
    reason = " ".join(text.split()) or "no reason given"
    try:
        if sys.stdout is not None:
            sys.stdout.flush()  # generated text already written is kept
    except (OSError, ValueError):
        pass
    try:
        on_abort(EngineAbortError(reason))
    finally:
        os._exit(1)


def _install_abort_callback(lib_dir: Path) -> None:
    """Route ggml's aborts through `_fatal`. ggml_set_abort_callback lives in libggml-base, which
    can be mapped twice (llama_cpp opens libggml-base.so, libllama links libggml-base.so.0):
    the callback is set in every copy, so whichever one the compute threads call has it."""
    global _abort_callback
    if _abort_callback is not None:
        return  # set by the other way in (llama_c_library, llama_lib): one callback for both
    callback_type = ctypes.CFUNCTYPE(None, ctypes.c_char_p)
    _abort_callback = callback_type(_fatal)
    for path in sorted(lib_dir.glob("*ggml-base*")):
        try:
            setter = ctypes.CDLL(str(path)).ggml_set_abort_callback
        except (OSError, AttributeError):
            continue
        setter.restype = ctypes.c_void_p
        setter.argtypes = [callback_type]
        setter(_abort_callback)


class AbortFlag:
    """A stop flag llama.cpp's abort callback reads without entering Python.

    The CPU backend calls the abort callback before every graph node (about 500 times per
    decode step of a 30-layer model); a Python callback there takes the GIL each time, a
    quarter of a millisecond per step. So the callback is the C library's `strlen` on a
    two-byte buffer: '' (0, false) goes on, 'x' (1, true) aborts, and `set` is one byte's
    write. (`bool f(void *)` and `size_t strlen(const char *)` return through the same
    register, and strlen's 0 or 1 is a bool's value on every ABI llama.cpp builds for.)
    Where no C library's strlen is found, a Python callback does the same, slower."""

    def __init__(self) -> None:
        lib = llama_lib()
        self._buf = ctypes.create_string_buffer(2)
        self.data: Any = ctypes.cast(self._buf, ctypes.c_void_p)
        address = _strlen_address()
        if address is not None:
            self.callback: Any = lib.ggml_abort_callback(address)
        else:
            self.callback = lib.ggml_abort_callback(lambda _data: self.is_set())

    def set(self) -> None:
        self._buf[0] = b"x"

    def clear(self) -> None:
        self._buf[0] = b"\0"

    def is_set(self) -> bool:
        return self._buf[0] != b"\0"

    def install(self, ctx: Any) -> None:
        """Make it the context's abort callback (until `uninstall`)."""
        llama_lib().llama_set_abort_callback(ctx, self.callback, self.data)

    @staticmethod
    def uninstall(ctx: Any) -> None:
        lib = llama_lib()
        lib.llama_set_abort_callback(ctx, lib.ggml_abort_callback(), None)


def _strlen_address() -> int | None:
    for name in (None, "msvcrt", "c"):
        with contextlib.suppress(OSError, AttributeError):
            return ctypes.cast(ctypes.CDLL(name).strlen, ctypes.c_void_p).value
    return None


_logged = 0  # lines logged so far (LOG_LINES keeps the last 2,000)
_log_lock = threading.Lock()  # the callback runs on whichever thread logs


def log_since(count: int) -> list[str]:
    """The lines llama.cpp logged after the first `count` (those LOG_LINES still holds)."""
    with _log_lock:
        lines, total = list(LOG_LINES), _logged
    new = min(total - count, len(lines))
    return lines[len(lines) - new :] if new > 0 else []


def logged() -> int:
    with _log_lock:
        return _logged


def _log(level: int, text: bytes, user_data: Any) -> None:
    """llama.cpp's log callback: its lines into LOG_LINES, and on stderr with bench -v."""
    global _logged
    line = text.decode("utf-8", errors="replace")
    with _log_lock:
        LOG_LINES.append(line)
        _logged += 1
    echo = echo_log
    if echo is not None:
        with contextlib.suppress(OSError):
            echo(line)


def llama_lib() -> Any:
    """Import llama_cpp once, route its log into LOG_LINES and its aborts into one-line errors,
    and initialise the backend."""
    global _lib, _log_callback
    if _lib is None:
        os.environ.setdefault("GGML_NO_BACKTRACE", "1")  # no gdb backtrace on stdout, ever
        import llama_cpp

        _log_callback = llama_cpp.llama_log_callback(_log)
        llama_cpp.llama_log_set(_log_callback, ctypes.c_void_p(0))
        _install_abort_callback(Path(llama_cpp.__file__).parent / "lib")
        llama_cpp.llama_backend_init()
        _lib = llama_cpp
    return _lib


def max_sequences() -> int:
    """The most sequences one context holds in this llama.cpp (LLAMA_MAX_SEQ, 256 in 0.3.36)."""
    return int(llama_lib().llama_max_parallel_sequences())


_c_library: Any = None
_c_log_callback: Any = None  # kept referenced, as _log_callback


def llama_c_library() -> Any:
    """libllama itself (a ctypes library), set up as `llama_lib()` sets it up (log, aborts,
    backend) but without importing the llama_cpp package, which imports numpy and more: for
    the reports that only ask the build about itself (`doctor`). Its functions used here have
    their types declared: llama_print_system_info, llama_supports_gpu_offload. Once llama_cpp
    is imported, the bindings' own handle of the same library."""
    global _c_library, _c_log_callback
    if _lib is not None:
        return libllama()
    if _c_library is None:
        path = libllama_path()
        if path is None:  # not a platform whose loader llmrun mirrors: the bindings load it
            llama_lib()
            return libllama()
        os.environ.setdefault("GGML_NO_BACKTRACE", "1")
        lib = ctypes.CDLL(str(path))
        callback_type = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
        _c_log_callback = callback_type(_log)
        lib.llama_log_set.argtypes, lib.llama_log_set.restype = (
            [callback_type, ctypes.c_void_p],
            None,
        )
        lib.llama_log_set(_c_log_callback, None)
        _install_abort_callback(path.parent)
        lib.llama_backend_init.argtypes, lib.llama_backend_init.restype = [], None
        lib.llama_backend_init()
        lib.llama_print_system_info.argtypes = []
        lib.llama_print_system_info.restype = ctypes.c_char_p
        lib.llama_supports_gpu_offload.argtypes = []
        lib.llama_supports_gpu_offload.restype = ctypes.c_bool
        _c_library = lib
    return _c_library


def last_log_error() -> str:
    """The reason llama.cpp logged for a failure: the telling line before its generic
    "failed to load model" / "failed to initialize" conclusion, with llama.cpp's prefixes cut."""
    lines = [" ".join(ln.split()) for ln in list(LOG_LINES) if ln.strip()]
    generic = ("failed to load model", "failed to initialize", "llama_model_load_from_file")
    telling = (
        "error",
        "failed",
        "invalid",
        "not within",
        "unknown",
        "not found",
        "missing",
        "unsupported",
        "wrong",
        "exceed",
        "cannot",
        "could not",
    )
    for ln in reversed(lines):
        low = ln.lower()
        if any(w in low for w in telling) and not any(g in low for g in generic):
            return _strip_log_prefix(ln)
    for ln in reversed(lines):
        if any(w in ln.lower() for w in telling):
            return _strip_log_prefix(ln)
    return _strip_log_prefix(lines[-1]) if lines else "no reason given"


def _strip_log_prefix(line: str) -> str:
    """'llama_model_load: error loading model: X' -> 'X' (the function names mean nothing to
    users; the last 'error ...:' clause is the reason)."""
    for marker in ("error loading model: ", "error loading model architecture: ", "error: "):
        if marker in line:
            line = line.rsplit(marker, 1)[1]
            break
    else:
        head, sep, rest = line.partition(": ")
        if sep and head.replace("_", "").isalnum() and "_" in head:
            line = rest
    return line.strip() or "no reason given"
