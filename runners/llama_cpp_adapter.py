"""The names llmrun takes from inside llama-cpp-python, which it does not publish; every use goes
through here. pyproject.toml pins the range they were checked on (>=0.3.36,<0.4), and
tests/test_adapters.py fails when one of them moves.

- `llama_cpp.llama_cpp._lib`: the ctypes handle of libllama that the bindings loaded; llama.cpp's
  threadpool functions, which the bindings do not wrap, are called through it.
- `Jinja2ChatFormatter._environment`: the compiled chat template a formatter renders; llmrun
  puts the template compiled in its bounded sandbox there (the rest of `__call__`, the stop
  token and the response, stays the library's).
- The file the bindings' loader opens (`_ctypes_extensions.load_shared_library`): `doctor` asks
  that same libllama about the build without importing the package, which imports numpy.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any


def libllama() -> Any:
    """The ctypes library (CDLL) of the libllama that llama_cpp loaded."""
    import llama_cpp.llama_cpp

    return llama_cpp.llama_cpp._lib


def set_compiled_template(formatter: Any, template: Any) -> None:
    """Make a Jinja2ChatFormatter render `template` (anything with `render(**context)`)."""
    formatter._environment = template


def package_dir() -> Path | None:
    """The installed llama_cpp package's folder, found without importing it."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def libllama_path() -> Path | None:
    """The libllama file that `import llama_cpp` opens (the same names in the same order), so
    that opening it with ctypes first gives the same loaded library, not a second copy; None
    where llmrun does not mirror the loader."""
    folder = package_dir()
    if folder is None:
        return None
    lib = folder / "lib"
    if sys.platform.startswith(("linux", "freebsd")):
        names = ["libllama.so"]
    elif sys.platform == "darwin":
        names = ["libllama.so", "libllama.dylib"]
    else:  # Windows also puts the folder on the DLL search path first: left to the bindings
        return None
    return next((lib / name for name in names if (lib / name).exists()), None)
