"""The version line of `--version`, `bench --version` and `doctor`: the packages' versions
read from their metadata, without loading llama.cpp."""

from __future__ import annotations

import importlib.metadata
import platform


def version_line() -> str:
    """One line, without loading llama.cpp: fast enough for `--version`."""
    host = f"{platform.system()} {platform.machine()}"
    return (
        f"llmrun {_version('llmrun')} · llama-cpp-python {_version('llama_cpp_python')}"
        f" · Python {platform.python_version()} · {host}"
    )


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"
