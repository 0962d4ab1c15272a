"""`llmrun --version`: one line, from package metadata alone (no command module, no llama.cpp),
so that it answers at once."""

from __future__ import annotations

import importlib.metadata
import platform


def version_line() -> str:
    """llmrun's and llama-cpp-python's versions, Python's, and the platform."""
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
