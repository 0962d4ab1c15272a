"""The repack probe is its own figure, apart from the load (issue 29): the first load of a new
quantization ran a child-process probe inside the load's clock (6,359.7 ms against about 0.9 s
after)."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest

from llmrun.cli.report import summary_lines
from llmrun.runners import loading
from llmrun.runners.config import EngineConfig
from llmrun.runners.probe import Verdict
from tests.test_energy import stats as local_stats

PROBE_S = 0.3


def test_a_probe_that_runs_during_the_load_is_not_load_time(
    model_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def probing(path: str, quantization: str, cancel: object = None) -> Verdict:
        t0 = time.perf_counter()
        time.sleep(PROBE_S)  # the child process's time, as repack_verdict measures it
        return Verdict(True, "probed", probe_s=time.perf_counter() - t0)

    monkeypatch.setattr(loading, "repack_verdict", probing)
    t0 = time.perf_counter()
    weights = loading.load_weights(model_path, EngineConfig(), cancel=threading.Event())
    wall_s = time.perf_counter() - t0
    try:
        assert weights.probe_s is not None and weights.probe_s >= PROBE_S
        assert weights.load_s <= wall_s - weights.probe_s
    finally:
        weights.model.close()


def test_a_kept_verdict_adds_no_probe_figure(
    model_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        loading, "repack_verdict", lambda path, q, cancel=None: Verdict(True, "probed")
    )
    weights = loading.load_weights(model_path, EngineConfig(), cancel=threading.Event())
    try:
        assert weights.probe_s is None
    finally:
        weights.model.close()
    cfg = dataclasses.replace(EngineConfig(), repack=False)  # none asked: no verdict at all
    assert loading.choose_repack(model_path, cfg, weights.info) == (False, "off (asked)", None)


def test_the_summary_names_the_probe_beside_the_load() -> None:
    probed = dataclasses.replace(local_stats(), probe_s=5.4321)
    line = next(x for x in summary_lines(probed) if x.startswith("load"))
    assert "2,000.0 ms" in line and "repack probe 5,432.1 ms (once per quantization)" in line
    assert "repack probe" not in "".join(summary_lines(local_stats()))
