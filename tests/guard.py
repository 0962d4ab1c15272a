"""The quick subset's guard: a test without the `model` or `pty` marker may neither load a
model through llama.cpp nor start a process, so `pytest -m "not model and not pty"` stays quick.

The markers come from fixtures (conftest.py): a test that loads the real model requests
`model_path` or a fixture built on it, one that starts a process requests `llmrun_env`. A test
that does either without the fixture fails here, naming what it did, even if it caught the
error. Importing llama_cpp stays allowed (its library answers device and type-size questions in
a fraction of a second); its model loaders are refused, never replaced by a fake.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

import pytest

GUARDED = ("model", "pty")
# Every way a test could start a process: subprocess, pexpect (pty.fork -> os.forkpty),
# multiprocessing and os.system all end in one of these.
SPAWNERS = ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system", "execv", "execve")
LOADERS = (
    "llama_model_load_from_file",
    "llama_model_load_from_splits",
    "llama_load_model_from_file",
)
HINT = (
    "request model_path if the test loads the model (a first load may start llama.cpp's "
    "repacking probe), llmrun_env if it starts a process"
)


class Violation(RuntimeError):
    """Raised where a quick test starts a process or loads a model."""


class _GuardLlamaCpp(importlib.abc.MetaPathFinder):
    """Lets llama_cpp be imported (its library answers device and type-size questions) and
    refuses its model loaders the moment it is."""

    def __init__(self, arm: Callable[[ModuleType], None]) -> None:
        self.arm = arm

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname != "llama_cpp":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        loader = spec.loader if spec is not None else None
        if spec is None or loader is None:
            return spec
        exec_module = loader.exec_module

        def exec_and_arm(module: ModuleType) -> None:
            exec_module(module)
            self.arm(module)

        loader.exec_module = exec_and_arm  # type: ignore[method-assign]
        return spec


def _refuse(seen: list[str], what: str) -> Callable[..., Any]:
    def refused(*args: object, **kwargs: object) -> Any:
        seen.append(what)
        raise Violation(f"a test without the model/pty marker calls {what}: {HINT}")

    return refused


@pytest.fixture(autouse=True)
def quick_guard(request: pytest.FixtureRequest) -> Iterator[None]:
    """Refuse processes and model loads to the tests that carry neither marker."""
    if any(request.node.get_closest_marker(m) for m in GUARDED):
        yield
        return
    seen: list[str] = []
    saved: list[tuple[object, str, object]] = []

    def patch(owner: object, name: str, value: object) -> None:
        if hasattr(owner, name):
            saved.append((owner, name, getattr(owner, name)))
            setattr(owner, name, value)

    for name in SPAWNERS:
        patch(os, name, _refuse(seen, f"os.{name}"))
    patch(subprocess.Popen, "_execute_child", _refuse(seen, "subprocess.Popen"))

    def arm(llama_cpp: ModuleType) -> None:
        # the package re-exports the bindings of llama_cpp.llama_cpp, where Llama looks them up
        for module in (llama_cpp, sys.modules.get("llama_cpp.llama_cpp")):
            for name in LOADERS if module is not None else ():
                patch(module, name, _refuse(seen, f"llama_cpp.{name}"))

    finder = _GuardLlamaCpp(arm)
    if "llama_cpp" in sys.modules:
        arm(sys.modules["llama_cpp"])
    else:
        sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        if finder in sys.meta_path:
            sys.meta_path.remove(finder)
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)
    if seen:
        pytest.fail(
            f"{request.node.nodeid} has no model/pty marker but calls "
            + ", ".join(sorted(set(seen)))
            + f": {HINT}",
            pytrace=False,
        )
