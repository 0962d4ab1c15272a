"""Prompt-lookup speculative decoding: the same greedy text, fewer decode steps."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest
from typer.testing import CliRunner

from llmrun.cli.app import app
from llmrun.runners import speculation
from llmrun.runners.base import Finished, Request, SamplingParams, Token
from llmrun.runners.config import EngineConfig
from llmrun.runners.llamacpp import LlamaCppRunner

from .conftest import HANG_S, ROOT, which_llmrun
from .greedy import NEAR_TIE, margin_at_divergence

TEXT = (ROOT / "examples" / "declaration_of_independence.txt").read_text()[:1200]


@pytest.fixture(scope="module")
def runner(model_path: str) -> LlamaCppRunner:
    return LlamaCppRunner(model_path, EngineConfig(n_ctx=2048))


def token_ids(runner: LlamaCppRunner, prompt: str, draft: int, n: int = 80) -> list[int]:
    request = Request.chat(
        prompt, sampling=SamplingParams(max_tokens=n, temperature=0, draft=draft)
    )
    return [e.token_id for e in runner.stream(request) if isinstance(e, Token)]


def margin(runner: LlamaCppRunner, prompt: str, a: list[int], b: list[int]) -> float:
    return margin_at_divergence(runner, runner.request_tokens(Request.chat(prompt)), a, b)


@pytest.mark.parametrize(
    "prompt",
    [
        "List the numbers from 1 to 40, separated by commas.",
        f"Repeat this text exactly:\n\n{TEXT}",
        "Write a short poem about the sea.",
    ],
)
def test_speculation_keeps_the_greedy_text(runner: LlamaCppRunner, prompt: str) -> None:
    """Identical, except where the top two tokens are a near-tie that kernel rounding (a batch
    of tokens against one at a time) can flip; then the two choices' logits are that close."""
    plain, fast = token_ids(runner, prompt, 0), token_ids(runner, prompt, 8)
    assert margin(runner, prompt, plain, fast) < NEAR_TIE


def test_lookup_drafts_are_accepted_where_the_text_repeats(runner: LlamaCppRunner) -> None:
    request = Request.chat(
        f"Repeat this text exactly:\n\n{TEXT}",
        sampling=SamplingParams(max_tokens=80, temperature=0, draft=8),
    )
    finished = [e for e in runner.stream(request) if isinstance(e, Finished)][-1]
    s = finished.stats
    assert s.draft_tokens > 0 and s.accepted_tokens > 10
    assert (
        s.tokens_per_step is not None and s.tokens_per_step > 1.3
    )  # fewer decode steps than tokens
    assert s.decode_steps < s.output_tokens - 1


def test_negative_control_unchecked_drafts_change_the_text(
    runner: LlamaCppRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Accepting drafts without checking them breaks the text far from any near-tie."""
    prompt = "Write a short poem about the sea, then repeat its first line."
    plain = token_ids(runner, prompt, 0)
    original = speculation.Drafter.step

    def unchecked(
        self: speculation.Drafter, ctx: Any, chain: Any, token: int, room: int
    ) -> tuple[list[int], int]:
        accepted, following = original(self, ctx, chain, token, room)
        history = [*self.cache[: -len(accepted) - 1], token]
        drafts = self.propose(history, room) if room else []
        return (drafts or accepted), following

    monkeypatch.setattr(speculation.Drafter, "step", unchecked)
    broken = token_ids(runner, prompt, 8)
    assert broken != plain
    assert margin(runner, prompt, plain, broken) >= NEAR_TIE


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--draft", "lookup"], "add --temp 0"),
        (["--temp", "0", "--draft", "tree:3"], "is not lookup"),
        (["--temp", "0", "--draft", "model:4"], "goes with --draft-model"),
        (["--temp", "0", "--draft", "lookup:0"], "from 1 to 64"),
        (["--temp", "0", "--draft", "lookup:²"], "'²' is not a count from 1 to 64"),
        (["--temp", "0", "--draft", " "], "give lookup[:N], or model[:N] with --draft-model"),
        (["--temp", "0", "--draft", "lookup", "--endpoint", "http://127.0.0.1:9"], "--draft"),
    ],
)
def test_draft_options_are_checked(args: list[str], says: str) -> None:
    result = CliRunner().invoke(app, ["run", "hi", *args])
    assert result.exit_code == 2 and says in result.stderr  # a usage error


def test_a_draft_model_drafts_and_keeps_the_greedy_text(model_path: str, q8_model: str) -> None:
    plain_runner = LlamaCppRunner(model_path, EngineConfig(n_ctx=2048))
    drafted = LlamaCppRunner(model_path, EngineConfig(n_ctx=2048, draft_model=q8_model))
    try:
        prompt = "Write a short poem about the sea."
        plain, fast = token_ids(plain_runner, prompt, 0), token_ids(drafted, prompt, 6)
        assert margin(plain_runner, prompt, plain, fast) < NEAR_TIE
        request = Request.chat(
            prompt, sampling=SamplingParams(max_tokens=60, temperature=0, draft=6)
        )
        s = [e for e in drafted.stream(request) if isinstance(e, Finished)][-1].stats
        assert s.acceptance_rate is not None and s.tokens_per_step is not None
        assert s.acceptance_rate > 0.5 and s.tokens_per_step > 2  # the same model, requantized
    finally:
        plain_runner.close()
        drafted.close()


def test_bench_measures_decode_with_and_without_speculation_in_one_run(
    llmrun_env: dict[str, str],
) -> None:
    done = subprocess.run(
        [
            which_llmrun(),
            "bench",
            "-p",
            "0",
            "-n",
            "32",
            "-r",
            "1",
            "--draft",
            "0,4",
            "--no-history",
            "-o",
            "json",
        ],
        env=llmrun_env,
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert done.returncode == 0, done.stderr
    plain, fast = json.loads(done.stdout)
    assert "draft" not in plain and fast["draft"] == 4
    assert fast["tokens_per_step"] >= 1.0  # every decode step counted, drafts found or not
    assert fast["acceptance_rate"] is None or 0 <= fast["acceptance_rate"] <= 1
    assert plain["avg_ts"] > 0 and fast["avg_ts"] > 0
