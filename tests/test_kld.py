"""KL divergence beside perplexity (bench --ppl FILE --kld): llama-perplexity --kl-divergence's
figures on synthetic distributions with known answers, the base kept on disk, bench's records
and table, and the embedded model against its own quantization."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from llmrun.cli.app import app
from llmrun.runners.errors import BadRequestError
from llmrun.runners.kld import (
    Compared,
    KldBase,
    compare_rows,
    mean_and_uncertainty,
    percentile,
    quantize,
    statistics,
)

from .conftest import HANG_S, which_llmrun
from .llama_tools import cpu_flags, tool
from .test_bench import parse
from .test_trust_bench import _fake_models

REPO = Path(__file__).resolve().parent.parent
TEXT = REPO / "examples" / "declaration_of_independence.txt"


def _kl(p_logits: np.ndarray, q_logits: np.ndarray) -> np.ndarray:
    """The exact KL(P || Q) of each row, in float64."""
    lp = p_logits - np.log(np.exp(p_logits).sum(axis=1, keepdims=True))
    lq = q_logits - np.log(np.exp(q_logits).sum(axis=1, keepdims=True))
    return (np.exp(lp) * (lp - lq)).sum(axis=1)


def _against(base: np.ndarray, model: np.ndarray, targets: np.ndarray) -> Compared:
    scale, least, steps = quantize(base.astype(np.float32))
    return compare_rows(model.astype(np.float32), targets, scale, least, steps)


def test_identical_distributions_diverge_by_nothing() -> None:
    """Nothing but the base's rounding: its log-probs in 16/65535-nat steps move each position's
    KLD by about 1e-5 nats either way, so the mean over many positions is nearer 0 still."""
    rng = np.random.default_rng(1)
    logits = rng.normal(0, 3, size=(50, 1000))
    targets = rng.integers(0, 1000, size=50)
    found = _against(logits, logits, targets)
    assert np.abs(found.kld).max() < 1e-4
    assert abs(found.kld.mean()) < 1e-5
    assert found.same_top == 50
    assert np.abs(found.p_diff).max() < 1e-4


def test_known_pairs_score_their_exact_divergence() -> None:
    """Two-token and many-token pairs with known KL: the uint16 base costs under 1e-4 nats."""
    coin = np.log(np.array([[0.5, 0.5], [0.9, 0.1], [0.99, 0.01]]))
    fair = np.log(np.full((3, 2), 0.5))
    found = _against(coin, fair, np.zeros(3, dtype=int))
    # KL(p, 1-p || 1/2, 1/2) = ln 2 - H(p)
    exact = [math.log(2) + p * math.log(p) + (1 - p) * math.log(1 - p) for p in (0.5, 0.9, 0.99)]
    assert np.allclose(found.kld, exact, atol=1e-4)
    assert found.same_top == 3  # ties go to the first token, as llama-perplexity's
    rng = np.random.default_rng(2)
    base = rng.normal(0, 2, size=(40, 500))
    model = base + rng.normal(0, 0.3, size=base.shape)
    found = _against(base, model, rng.integers(0, 500, size=40))
    assert np.allclose(found.kld, _kl(base, model), atol=1e-4)


def test_the_top_token_and_delta_p() -> None:
    """Δp is the model's probability of the text's next token less the base's; the top agrees
    where both put their most probability on the same token."""
    base = np.log(np.array([[0.7, 0.2, 0.1], [0.2, 0.7, 0.1]]))
    model = np.log(np.array([[0.5, 0.4, 0.1], [0.6, 0.3, 0.1]]))
    found = _against(base, model, np.array([0, 1]))
    assert found.same_top == 1
    assert np.allclose(found.p_diff, [0.5 - 0.7, 0.3 - 0.7], atol=1e-4)


def test_statistics_as_llama_perplexity_summarises() -> None:
    kld = np.arange(1, 21, dtype=np.float32)  # 1..20
    p_diff = np.array([0.1, -0.1] * 10, dtype=np.float32)
    stats = statistics(kld, p_diff, same_top=15)
    assert stats.kld_mean == pytest.approx(10.5)
    assert stats.kld_mean_unc == pytest.approx(np.std(kld, ddof=0) / math.sqrt(19))
    assert stats.kld_median == pytest.approx(10.5)
    assert stats.kld_p99 == pytest.approx(19 + 0.81)  # 0.99 x 19 = 18.81: between 19 and 20
    assert stats.kld_max == 20
    assert stats.same_top_p == 0.75
    assert stats.same_top_p_unc == pytest.approx(math.sqrt(0.75 * 0.25 / 19))
    assert stats.dp_mean == pytest.approx(0, abs=1e-9)
    assert stats.dp_rms == pytest.approx(0.1)
    assert stats.dp_rms_unc == pytest.approx(0, abs=1e-6)  # every Δp² the same
    assert mean_and_uncertainty(5.0, 25.0, 1) == (5.0, 0.0)  # no spread under 11 values
    assert percentile(np.array([1.0, 3.0]), 0.5) == 2.0
    assert stats.record()["kld_mean"] == 10.5 and "positions" not in stats.record()


def test_the_base_lives_on_disk_and_batches_need_not_line_up() -> None:
    """The base's rows go to a temporary file (2 bytes per vocabulary entry), and a later model
    scored in other batch sizes reads them back in order: the same figures as at once."""
    rng = np.random.default_rng(3)
    base_logits = rng.normal(0, 2, size=(100, 300)).astype(np.float32)
    model_logits = base_logits + rng.normal(0, 0.5, size=base_logits.shape).astype(np.float32)
    targets = list(rng.integers(0, 300, size=100))
    base = KldBase()
    base.start([1, 2, 3], n_ctx=8, n_vocab=300)
    for at in range(0, 100, 45):
        base.add(base_logits[at : at + 45], targets[at : at + 45])
    assert base._file.tell() == 100 * 300 * 2
    comparison = base.compare()
    for at in range(0, 100, 7):
        comparison.add(model_logits[at : at + 7], targets[at : at + 7])
    stats = comparison.result()
    assert stats.positions == 100
    assert stats.kld_mean == pytest.approx(_kl(base_logits, model_logits).mean(), abs=1e-4)
    again = base.compare()
    again.add(base_logits, targets)
    assert again.result().kld_mean < 1e-6 and again.result().same_top_p == 1.0
    short = base.compare()
    short.add(model_logits[:50], targets[:50])
    with pytest.raises(BadRequestError, match="fewer positions"):
        short.result()
    assert base.comparable([1, 2, 3], n_ctx=8, n_vocab=300) is None
    assert "vocabulary" in str(base.comparable([1, 2, 3], n_ctx=8, n_vocab=301))
    assert "tokenizes" in str(base.comparable([1, 2, 4], n_ctx=8, n_vocab=300))
    base.close()


@pytest.fixture
def text(tmp_path: Path) -> Path:
    path = tmp_path / "text.txt"
    path.write_text("The quick brown fox jumps over the lazy dog, again and again. " * 100)
    return path


def test_bench_kld_records_each_later_model_against_the_first(
    text: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("LLMRUN_HOME", str(tmp_path))
    _fake_models(monkeypatch)
    models = ["-m", "a", "-m", "b", "-m", "a"]
    common = ["bench", "-p", "8", "-n", "0", "-r", "1", "--no-history", *models]
    done = CliRunner().invoke(app, [*common, "--ppl", str(text), "--kld", "-o", "json"])
    assert done.exit_code == 0, done.stderr
    rows = json.loads(done.stdout)
    assert [r["model_filename"] or r["model_type"] for r in rows] and len(rows) == 3
    first, other, same = rows
    assert first.get("kld_mean") is None  # the base
    assert other["kld_mean"] > 0.01 and other["kld_p99"] >= other["kld_median"]
    assert 0 <= other["same_top_p"] <= 1 and other["dp_rms"] > 0
    assert same["kld_mean"] < 1e-5 and same["same_top_p"] == 1.0  # the first model again
    assert done.stderr.count("KLD against the first: mean") == 2
    md = CliRunner().invoke(app, [*common, "--ppl", str(text), "--kld", "-o", "md"])
    assert md.exit_code == 0, md.stderr
    assert "KLD vs first" in md.stdout.splitlines()[0]
    assert len(parse("md", md.stdout)) == 3
    csv_out = CliRunner().invoke(app, [*common, "--ppl", str(text), "--kld", "-o", "csv"])
    assert {"kld_mean", "same_top_p", "dp_mean"} <= set(parse("csv", csv_out.stdout)[1])


@pytest.mark.parametrize(
    "args", [["-m", "a", "-m", "b"], ["-m", "a", "--ppl", "TEXT"]], ids=["no-ppl", "one-model"]
)
def test_bench_kld_without_a_text_or_a_second_model_is_refused(
    args: list[str], text: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("LLMRUN_HOME", str(tmp_path))
    _fake_models(monkeypatch)
    args = [str(text) if a == "TEXT" else a for a in args]
    done = CliRunner().invoke(app, ["bench", "-p", "8", "-n", "0", "-r", "1", *args, "--kld"])
    assert done.exit_code == 2  # options that do not go together: a usage error
    assert done.stderr.strip().splitlines()[-1].startswith("llmrun: error: --kld compares")
    assert "Traceback" not in done.stderr


def test_bench_kld_on_the_embedded_model_against_its_q8_0_copy(
    llmrun_env: dict[str, str], model_path: str, q8_model: str, tmp_path: Path
) -> None:
    """The Q8_0 copy as the base, the embedded Q4_1 against it: a small divergence, most top
    tokens the same (the base against itself: test_bench_kld_records_each_later_model_...).
    (Four windows of 128 tokens: docs/measurement.md has the whole text's figures beside
    llama-perplexity's.)"""
    text = tmp_path / "excerpt.txt"
    text.write_text(TEXT.read_text()[:2400])
    done = subprocess.run(
        [
            which_llmrun(),
            "bench",
            *("-m", q8_model, "-m", model_path),
            *("-p", "8", "-n", "0", "-r", "1", "--no-history"),
            *("--ppl", str(text), "-c", "128", "--kld", "-o", "json"),
        ],
        env=llmrun_env,
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert done.returncode == 0, done.stderr
    base, q41 = json.loads(done.stdout)
    assert base.get("kld_mean") is None and q41["ppl_tokens"] == base["ppl_tokens"] > 100
    assert 0.001 < q41["kld_mean"] < 0.2 and q41["kld_mean_unc"] < q41["kld_mean"] / 3
    assert q41["kld_p99"] > q41["kld_mean"] and 0.8 < q41["same_top_p"] < 1.0
    assert abs(q41["dp_mean"]) < q41["dp_rms"]
    assert "KLD against the first: mean" in done.stderr


def _llama_perplexity_figures(out: str) -> dict[str, float]:
    """The summary lines of llama-perplexity --kl-divergence, as fractions."""
    import re

    found: dict[str, float] = {}
    for key, pattern, scale in (
        ("kld_mean", r"Mean    KLD:\s+(-?[\d.]+)", 1.0),
        ("kld_p99", r"99\.0%   KLD:\s+(-?[\d.]+)", 1.0),
        ("kld_max", r"Maximum KLD:\s+(-?[\d.]+)", 1.0),
        ("dp_mean", r"Mean    Δp:\s+(-?[\d.]+)", 0.01),
        ("dp_rms", r"RMS Δp    :\s+(-?[\d.]+)", 0.01),
        ("same_top_p", r"Same top p:\s+(-?[\d.]+)", 0.01),
    ):
        match = re.search(pattern, out)
        assert match, f"no {key} in llama-perplexity's output: {out[-2000:]}"
        found[key] = float(match[1]) * scale
    return found


@pytest.mark.slow
def test_the_figures_are_llama_perplexitys(
    llmrun_env: dict[str, str], model_path: str, q8_model: str, tmp_path: Path
) -> None:
    """The same text, windows (-c 128, -b 128) and models through llama-perplexity
    --kl-divergence-base/--kl-divergence from the same llama.cpp: every figure it prints agrees
    with bench --kld's to its last printed digit (docs/measurement.md, "Agreement")."""
    binary = tool("llama-perplexity")
    text = tmp_path / "excerpt.txt"
    text.write_text(TEXT.read_text()[:2400])
    base_file = tmp_path / "base.kld"
    common = ["-f", str(text), "-c", "128", "-b", "128", "-t", "2"]
    runs = (
        (q8_model, ["--kl-divergence-base", str(base_file)]),
        (model_path, ["--kl-divergence-base", str(base_file), "--kl-divergence"]),
    )
    for model, kld in runs:
        flags = cpu_flags("llama-perplexity", model)
        done = subprocess.run(
            [str(binary), "-m", model, *common, *flags, *kld],
            capture_output=True,
            text=True,
            timeout=HANG_S,
        )
        assert done.returncode == 0, done.stderr[-2000:]
    theirs = _llama_perplexity_figures(done.stdout + done.stderr)
    ours_run = subprocess.run(
        [
            which_llmrun(),
            "bench",
            *("-m", q8_model, "-m", model_path),
            *("-p", "8", "-n", "0", "-r", "1", "--no-history"),
            *("--ppl", str(text), "-c", "128", "--kld", "-o", "json"),
        ],
        env=llmrun_env,
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert ours_run.returncode == 0, ours_run.stderr
    ours = json.loads(ours_run.stdout)[1]
    # llama-perplexity prints 6 decimals for KLD and 3 for percentages (of fractions: 5)
    for key, digits in (("kld_mean", 6), ("kld_p99", 6), ("kld_max", 6)):
        assert abs(ours[key] - theirs[key]) <= 1.5 * 10**-digits, (key, ours[key], theirs[key])
    for key in ("dp_mean", "dp_rms", "same_top_p"):
        assert abs(ours[key] - theirs[key]) <= 1.5e-5, (key, ours[key], theirs[key])


def test_a_ppl_text_too_short_is_refused_before_any_test_runs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The text is tokenized as the model is ready: too short for one window, it is said at
    once, not after the speed tests (whose rows never come)."""
    monkeypatch.setenv("LLMRUN_HOME", str(tmp_path))
    _fake_models(monkeypatch)
    short = tmp_path / "short.txt"
    short.write_text("four words, no more")
    args = ["bench", "-p", "8", "-n", "0", "-r", "1", "--no-history", "-m", "a", "-o", "md"]
    done = CliRunner().invoke(app, [*args, "--ppl", str(short)])
    assert done.exit_code == 1, done.output
    assert "perplexity needs at least one window of 512 tokens; the text has 4" in done.stderr
    assert done.stdout == ""
