"""The tests' figure for other processes' load, in the processes a test starts.

tests/conftest.py puts this folder first on PYTHONPATH, so every Python child of a test (the
`llmrun` command through pipes, a pseudo-terminal or tmux, `llmrun serve`) runs this file at
start-up, before llmrun is imported. Where the child's environment carries TESTS_BACKGROUND_CPUS
(a number of CPUs; conftest sets 0, a quiet machine), it becomes runners/system.py's
`background_override`, as conftest sets it in the tests' own process; without it the child
measures the machine. llmrun itself reads no such variable: only a process started with this
folder on its path does.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys

BACKGROUND_ENV = "TESTS_BACKGROUND_CPUS"


def _install() -> None:
    text = os.environ.get(BACKGROUND_ENV)
    if text is None:
        return
    cpus = float(text)  # not a number: Python prints "Error in sitecustomize" on stderr
    try:
        from llmrun.runners import system
    except ImportError:  # a Python without llmrun (a tool a test starts): nothing to fake
        return
    system.background_override = cpus


def _chain() -> None:
    """Run the sitecustomize this file hides (a distribution's), as Python would have."""
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


_install()
_chain()
