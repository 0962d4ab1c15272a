"""`make test`'s first part: pytest-xdist workers pinned to CPUs of their own (--one-cpu-each,
tests/conftest.py), the processes their tests start pinned with them, and a `cores` test
refused there. Run on a small suite of its own that uses conftest's hooks."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from .conftest import HANG_S, ROOT

CONFTEST = """\
from tests.conftest import (  # noqa: F401
    PINNED,
    every_core,
    pytest_addoption,
    pytest_collection_modifyitems,
    pytest_configure,
    pytest_runtest_setup,
)
"""

SUITE = """\
import json, os, subprocess, sys
import pytest

@pytest.mark.parametrize("n", range(6))
def test_where(n, tmp_path_factory):
    child = subprocess.run(
        [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
        capture_output=True, text=True, check=True,
    )
    seen = {
        "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
        "cpus": sorted(os.sched_getaffinity(0)),
        "child": json.loads(child.stdout),
    }
    out = os.path.join(os.environ["SEEN_DIR"], f"{n}.json")
    with open(out, "w") as f:
        json.dump(seen, f)

def test_two_threads(every_core):
    pass
"""

pytestmark = [
    pytest.mark.usefixtures("every_core"),  # a pinned worker has one CPU of two
    pytest.mark.skipif(
        not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
        reason="pinning needs two CPUs",
    ),
]


def _run(tmp_path: Path, env: dict[str, str], *flags: str) -> tuple[int, str, list[dict]]:
    suite = tmp_path / "suite"
    seen = tmp_path / "seen"
    for folder in (suite, seen):  # afresh: no earlier run's records or __pycache__
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
    (suite / "conftest.py").write_text(CONFTEST)
    (suite / "test_suite.py").write_text(SUITE)
    path = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env = {k: v for k, v in env.items() if not k.startswith("PYTEST_XDIST_")}  # not a worker
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *flags, str(suite)],
        cwd=suite,
        env=dict(env, PYTHONPATH=path, SEEN_DIR=str(seen)),
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    records = [json.loads(p.read_text()) for p in sorted(seen.iterdir())]
    return done.returncode, done.stdout + done.stderr, records


def test_pinned_workers_keep_to_their_cpus_and_refuse_a_cores_test(
    llmrun_env: dict[str, str], tmp_path: Path
) -> None:
    every = sorted(os.sched_getaffinity(0))
    # the run without the flag beside the run with it (each in its own folder): the two
    # pytest runs' start-ups were most of this test's time, one after the other
    with ThreadPoolExecutor(1) as pool:
        unpinned = pool.submit(_run, tmp_path / "unpinned", llmrun_env, "-n", "2")
        code, out, records = _run(tmp_path / "pinned", llmrun_env, "-n", "2", "--one-cpu-each")
    assert code == 1, out
    assert "6 passed" in out and "1 error" in out, out  # refused in its set-up
    assert "test_two_threads needs every CPU (marked `cores`)" in out, out
    by_worker = {r["worker"]: r["cpus"] for r in records}
    assert sorted(by_worker) == ["gw0", "gw1"], records
    share = len(every) // 2
    assert by_worker["gw0"] == every[:share] and by_worker["gw1"] == every[share : 2 * share]
    assert all(r["child"] == r["cpus"] for r in records), records  # what a test starts too

    # without the flag the same suite has the whole machine
    code, out, records = unpinned.result()
    assert code == 0 and "7 passed" in out, out
    assert all(r["cpus"] == r["child"] == every for r in records), records
