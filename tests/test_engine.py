"""The real engine on the real embedded model: events, timing consistency, cache, UTF-8."""

from __future__ import annotations

import dataclasses
import math
import threading

import pytest

from llmrun.runners.base import (
    Finished,
    LoadStarted,
    ModelLoaded,
    PrefillProgress,
    Request,
    SamplingParams,
    Token,
    generate,
)
from llmrun.runners.config import EngineConfig
from llmrun.runners.errors import EmptyPromptError, PromptTooLongError
from llmrun.runners.llamacpp import LlamaCppRunner
from llmrun.runners.stats import EngineSettings

from .conftest import HANG_S, SetAfter

GREEDY = SamplingParams(max_tokens=24, temperature=0)


def test_events_in_order_and_stats_consistent(model_path: str) -> None:
    with LlamaCppRunner(model_path, EngineConfig(n_ctx=1024, n_batch=32)) as r:
        request = Request.chat("Tell me about the sea. " * 10, sampling=GREEDY)
        events = list(r.stream(request))
    assert isinstance(events[0], LoadStarted)
    loaded = events[1]
    assert isinstance(loaded, ModelLoaded) and loaded.load_s > 0
    assert isinstance(loaded.settings, EngineSettings)  # a local load, not a server's
    assert loaded.settings.n_batch == 32 and loaded.settings.n_threads >= 1
    assert loaded.model is not None and loaded.model.quantization == "Q4_1"
    progress = [e for e in events if isinstance(e, PrefillProgress)]
    tokens = [e for e in events if isinstance(e, Token)]
    finished = events[-1]
    assert isinstance(finished, Finished)
    s = finished.stats
    # one progress event before the first chunk, then one per chunk of 32
    assert len(progress) == 1 + math.ceil(s.prompt_tokens / 32)
    assert [p.done_tokens for p in progress][-1] == s.prompt_tokens
    assert s.output_tokens == len(tokens) and len(s.itl_s) == len(tokens) - 1
    assert s.finish_reason in ("stop", "length")
    assert s.ttft_s == pytest.approx(s.template_tokenize_s + s.prefill_s + s.first_sample_s)
    # the phases account for the first token's time; what is left is Python between them:
    # microseconds on a quiet machine, a scheduler slice or more (~4 ms each) on a busy one
    assert tokens[0].t_s == pytest.approx(s.ttft_s, rel=0.02, abs=0.05)
    assert s.ttft_s is not None and s.decode_s is not None
    assert s.e2e_s >= s.ttft_s + s.decode_s
    # llama.cpp's own counters saw exactly the tokens we say we evaluated
    assert s.engine_n_prompt_eval == s.prompt_tokens
    assert s.engine_n_eval == s.output_tokens - (1 if s.finish_reason == "length" else 0)
    assert s.engine_prompt_eval_ms is not None
    assert s.prefill_s * 1000 >= s.engine_prompt_eval_ms * 0.98
    assert "".join(t.text for t in tokens) + finished.tail == finished.text


def test_kv_cache_reuse_between_requests(runner: LlamaCppRunner) -> None:
    runner.reset()
    system = "You are a terse assistant who answers in one sentence. " * 5
    first = generate(runner, Request.chat("What is rain?", system=system, sampling=GREEDY))
    assert first.stats.reused_tokens == 0
    second = generate(runner, Request.chat("What is snow?", system=system, sampling=GREEDY))
    s = second.stats
    assert s.reused_tokens > 40  # the system prompt stayed in the cache
    assert s.engine_n_prompt_eval == s.new_prompt_tokens
    same = generate(runner, Request.chat("What is snow?", system=system, sampling=GREEDY))
    assert same.stats.new_prompt_tokens == 1  # all but the last token reused
    assert same.text == second.text  # reuse does not change a greedy answer
    fresh = generate(
        runner, Request.chat("What is snow?", system=system, sampling=GREEDY, keep_cache=False)
    )
    assert fresh.stats.reused_tokens == 0 and fresh.text == second.text


def test_seeded_sampling_is_reproducible(runner: LlamaCppRunner) -> None:
    sp = SamplingParams(max_tokens=16, temperature=0.9, seed=1234)
    a = generate(runner, Request.chat("Invent a word.", sampling=sp, keep_cache=False))
    b = generate(runner, Request.chat("Invent a word.", sampling=sp, keep_cache=False))
    assert a.text == b.text and a.stats.seed == 1234


@pytest.mark.parametrize(
    ("prompt", "lowest"),
    [
        ("Emoji list: 🎉🚀🔥😀", 0x1F000),  # 4-byte characters, split over byte tokens
        ("Japanese: 日本語のテキスト。東京は", 0x3000),
        ("Deutsch: Grüße aus München, schöne Bären, Äpfel und Öl, süß", 0xC0),
    ],
)
def test_stream_equals_detokenized_output_in_any_language(
    runner: LlamaCppRunner, prompt: str, lowest: int
) -> None:
    sp = SamplingParams(max_tokens=30, temperature=0)
    events = list(runner.stream(Request(prompt=prompt, sampling=sp)))
    tokens = [e for e in events if isinstance(e, Token)]
    finished = events[-1]
    assert isinstance(finished, Finished)
    streamed = "".join(t.text for t in tokens) + finished.tail
    detok = b"".join(runner.piece(t.token_id) for t in tokens).decode("utf-8", errors="replace")
    assert streamed == detok == finished.text
    # Only a cut by max_tokens may end inside a character (how many threads llama.cpp ran
    # changes the greedy text, and so where 30 tokens end).
    whole = streamed.rstrip("\ufffd") if finished.stats.finish_reason == "length" else streamed
    assert "\ufffd" not in whole
    assert any(ord(ch) >= lowest for ch in whole)  # such characters did come out
    assert any(t.text == "" for t in tokens) or lowest < 0x1F000  # a character spanned tokens


def test_repeat_penalty_applies_to_the_last_n_tokens(runner: LlamaCppRunner) -> None:
    def answer(penalty: float, last_n: int = 64) -> str:
        sp = SamplingParams(
            max_tokens=8, temperature=0, repeat_penalty=penalty, repeat_last_n=last_n
        )
        return generate(runner, Request(prompt="1 1 1 1 1 1 1 1", sampling=sp)).text

    plain = answer(1.0)
    assert answer(3.0) != plain
    assert answer(3.0, last_n=0) == plain  # a window of 0 switches the penalty off
    # -1 is the whole context, as in llama.cpp (whose sampler takes -1 as 0: off)
    assert answer(3.0, last_n=-1) == answer(3.0, last_n=4096) != plain


def test_stop_string(runner: LlamaCppRunner) -> None:
    sp = SamplingParams(max_tokens=60, temperature=0, stop=("3",))
    result = generate(runner, Request.chat("Count from 1 to 10, comma separated.", sampling=sp))
    assert result.stats.finish_reason == "stop"
    assert "3" not in result.text and "2" in result.text


def test_max_tokens_and_ignore_eos(runner: LlamaCppRunner) -> None:
    sp = SamplingParams(max_tokens=7, temperature=0, ignore_eos=True)
    result = generate(runner, Request(token_ids=tuple(range(500, 540)), sampling=sp))
    assert result.stats.output_tokens == 7 and result.stats.finish_reason == "length"


def test_cancel_during_decode_keeps_partial_result(runner: LlamaCppRunner) -> None:
    cancel = threading.Event()
    sp = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    seen = 0
    finished = None
    for event in runner.stream(Request.chat("Write a long story.", sampling=sp), cancel=cancel):
        if isinstance(event, Token):
            seen += 1
            if seen == 5:
                cancel.set()
        if isinstance(event, Finished):
            finished = event
    assert finished is not None
    assert finished.stats.finish_reason == "interrupted" and finished.stats.output_tokens == 5
    # the engine is usable afterwards and its cache is consistent
    again = generate(runner, Request.chat("Say yes.", sampling=GREEDY))
    assert again.stats.output_tokens > 0


def test_cancel_during_prefill_aborts_the_chunk(model_path: str) -> None:
    with LlamaCppRunner(model_path, EngineConfig(n_ctx=2048, n_batch=1024)) as r:
        r.load()
        # set at the third look: the loop's before the first chunk, then the abort hook's inside
        # that chunk's graph (a 0.3 s timer landed in the second chunk on a fast CPU, and a
        # busy one stretched the abort past its wall-clock bound)
        cancel = SetAfter(3)
        tokens = tuple(range(1000, 2900))
        result = generate(r, Request(token_ids=tokens, sampling=GREEDY), cancel=cancel)
        s = result.stats
        assert s.finish_reason == "interrupted" and s.output_tokens == 0
        assert s.prefill_s == 0.0  # stopped inside the first chunk: its time counts nowhere
        assert r.cached_tokens == 0
        ok = generate(r, Request(token_ids=tokens[:50], sampling=GREEDY))
        assert ok.stats.reused_tokens == 0 and ok.stats.output_tokens > 0


def test_bad_prompts(runner: LlamaCppRunner) -> None:
    with pytest.raises(EmptyPromptError):
        generate(runner, Request(prompt="   "))
    with pytest.raises(PromptTooLongError) as e:
        generate(runner, Request(prompt="word " * 3000))
    assert e.value.n_ctx == 2048 and e.value.prompt_tokens > 2048


def test_runners_import_no_circle() -> None:
    """EngineConfig lives in config.py and the C-library plumbing in library.py so that no
    module of runners/ imports, even lazily or for types only, one that imports it back."""
    import ast
    from pathlib import Path

    folder = Path(__file__).resolve().parent.parent / "runners"
    graph: dict[str, set[str]] = {}
    for path in folder.rglob("*.py"):
        parts = list(path.relative_to(folder).with_suffix("").parts)
        package = parts[:-1]
        if parts[-1] == "__init__":
            parts = package
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ImportFrom):
                continue
            module = (node.module or "").split(".") if node.module else []
            if node.level:  # lazy, TYPE_CHECKING and top-level imports alike
                target = package[: len(package) - node.level + 1] + module
            elif module[:2] == ["llmrun", "runners"]:
                target = module[2:]
            else:
                continue
            for alias in node.names:  # `from . import devices` may name a module itself
                deps.add(".".join([*target, alias.name]))
        graph[".".join(parts)] = deps

    def known(dep: str) -> str | None:
        while dep and dep not in graph:
            dep = dep.rpartition(".")[0]
        return dep if dep in graph else None

    def circle_from(start: str) -> list[str] | None:
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for dep in filter(None, map(known, graph[node])):
                if dep == start and len(path) > 1:
                    return [*path, dep]
                if dep not in seen and dep != node:
                    seen.add(dep)
                    stack.append((dep, [*path, dep]))
        return None

    circles = [c for c in map(circle_from, sorted(graph)) if c]
    assert not circles, circles


def test_handles_free_once_and_contexts_go_before_the_model(model_path: str) -> None:
    """The public pieces a batched engine builds on: a context of its own over the runner's
    weights, owned batches and samplers; closing twice frees once, and the runner closes the
    context it handed out before it frees the model."""
    from llmrun.runners.handles import Batch, Sampler
    from llmrun.runners.library import llama_lib

    lib = llama_lib()
    r = LlamaCppRunner(model_path, EngineConfig(n_ctx=512))
    expected = generate(r, Request(prompt="The capital of France is", sampling=GREEDY)).stats
    prompt = r.tokenize("The capital of France is", add_special=True)
    context = r.make_context(n_seq=2, n_ctx=256, n_batch=64)
    batch = Batch(lib, 64, n_seq_max=2)
    for seq in (0, 1):  # the same prompt in two sequences: both predict the same token
        for i, token in enumerate(prompt):
            batch.set(seq * len(prompt) + i, token, i, seq, i == len(prompt) - 1)
    batch.n_tokens = 2 * len(prompt)
    assert lib.llama_decode(context, batch) == 0
    greedy = Sampler.greedy(lib)
    seeded = r.new_sampler(SamplingParams(temperature=0.7, seed=3), seed=3, prompt=prompt)
    first = greedy.sample(context, len(prompt) - 1)
    assert greedy.sample(context, 2 * len(prompt) - 1) == first
    assert 0 <= seeded.sample(context, len(prompt) - 1) < r.vocab_size()
    assert not r.is_eog(first) and r.piece(first).strip()
    with pytest.raises(ValueError):
        batch.n_tokens = 65
    for handle in (batch, greedy, seeded):
        handle.close()
        handle.close()  # a second close frees nothing (a double free would abort the process)
    assert greedy.ptr is None and batch.struct is None
    r.close()
    assert context.ptr is None  # closed with the runner, before its model
    context.close()
    assert expected.output_tokens > 0


def test_decode_only_is_llama_benchs_tg_nothing_sampled(runner: LlamaCppRunner) -> None:
    """bench's tg times what llama-bench's does: a decode and a synchronize per step, the next
    token fed at random, no sampling (llama.cpp's sampler counter stays at zero)."""
    runner.reset()
    sampling = SamplingParams(max_tokens=9, temperature=0, ignore_eos=True)
    request = Request(token_ids=(1, 2, 3), sampling=sampling, keep_cache=False, decode_only=True)
    s = generate(runner, request).stats
    assert s.output_tokens == 9 and len(s.itl_s) == 8
    assert s.engine_n_eval == 8 and s.engine_n_sample == 0 and s.sample_s == 0.0
    sampled = generate(runner, dataclasses.replace(request, decode_only=False)).stats
    assert sampled.engine_n_sample == 9 and sampled.sample_s is not None and sampled.sample_s > 0


def test_the_overhead_leaves_out_llamacpps_eval_and_sampling_calls(runner: LlamaCppRunner) -> None:
    runner.reset()
    s = generate(runner, Request(prompt="Once upon a time", sampling=GREEDY)).stats
    assert s.sample_s is not None and s.engine_eval_ms is not None and s.engine_n_eval
    assert s.decode_call_ms is not None
    step_ms = sum(s.itl_s) * 1000 / len(s.itl_s)
    expected = step_ms - s.decode_call_ms - s.sample_s * 1000 / len(s.itl_s)
    assert s.python_overhead_per_token_ms == pytest.approx(expected)
    assert s.to_dict()["sample_s"] == s.sample_s
    # llama.cpp's eval clock runs inside the timed call pair, so what it leaves out is >= 0
    # (to the microsecond its clock counts in)
    assert s.uncounted_decode_ms is not None and s.uncounted_decode_ms > -0.002
    assert s.to_dict()["uncounted_decode_ms"] == s.uncounted_decode_ms


def test_flash_attention_is_llamacpps_auto_and_the_record_says_what_ran(model_path: str) -> None:
    with LlamaCppRunner(model_path, EngineConfig(n_ctx=256)) as default:
        settings = default.load().settings
    assert settings.flash_attn == "auto"  # no rule measured elsewhere: llama.cpp decides
    assert settings.flash_attn_enabled is not None  # and the record says what it decided
    with LlamaCppRunner(model_path, EngineConfig(n_ctx=256, flash_attn="off")) as off:
        assert off.load().settings.flash_attn_enabled is False


def test_warm_up_while_loading_is_its_own_figure_and_leaves_nothing(model_path: str) -> None:
    """One warm-up decode during the load (llama-cli's), timed apart from the load; the cache
    and llama.cpp's counters are cleared after it, so the first request counts only itself."""
    with LlamaCppRunner(model_path, EngineConfig(n_ctx=512)) as r:
        loaded = r.load()
        assert loaded.warmup_s is not None and loaded.warmup_s > 0
        assert r.cached_tokens == 0
        s = generate(r, Request(prompt="Hello there", sampling=GREEDY)).stats
        assert s.warmup_s == loaded.warmup_s and s.reused_tokens == 0
        assert s.engine_n_prompt_eval == s.prompt_tokens  # the warm-up's tokens are not in it
    with LlamaCppRunner(model_path, EngineConfig(n_ctx=512, warmup=False)) as r:
        assert r.load().warmup_s is None


def test_no_warmup_reaches_the_engine_config(monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from llmrun.cli import engine
    from llmrun.cli.app import app

    from .fake import FakeRunner

    configs: list[EngineConfig] = []

    def factory(model: str | None, config: EngineConfig) -> FakeRunner:
        configs.append(config)
        return FakeRunner()

    monkeypatch.setattr(engine, "RUNNER_FACTORY", factory)
    for args, warmup in (
        (["run", "hi"], True),
        (["run", "hi", "--no-warmup"], False),
        (["chat", "--no-warmup"], False),
    ):
        result = CliRunner().invoke(app, args, input="hello\n")
        assert result.exit_code == 0, result.output
        assert configs[-1].warmup is warmup


def test_list_devices_prints_only_llmruns_lines(llmrun_env: dict[str, str]) -> None:
    """llama.cpp logs its backends' set-up (`ggml_cuda_init: found 1 CUDA devices`) on the
    first device call: llmrun's log callback must be in place before it, so that
    `bench --list-devices` prints its own lines only."""
    import subprocess
    import sys

    probe = (
        "from llmrun.runners import devices, library\n"
        "assert library._lib is None and library._c_library is None\n"
        "devices.query().devices()\n"
        "placed = library._lib is not None or library._c_library is not None\n"
        "print('callback first' if placed else 'callback late')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        env=llmrun_env,
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert out.stdout.strip() == "callback first", out.stdout + out.stderr
    from .conftest import which_llmrun

    listed = subprocess.run(
        [which_llmrun(), "bench", "--list-devices"],
        env=llmrun_env,
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.startswith("Available devices:") and listed.stderr == ""
    assert all(ln.startswith(("Available devices:", "  ")) for ln in listed.stdout.splitlines())


def test_a_batched_context_keeps_the_runners_kv_types(model_path: str) -> None:
    """The contexts a batched engine makes (run --parallel, bench serve) were f16 whatever
    -ctk/-ctv said: the same tokens' KV state is smaller in q8_0 than in f16."""
    from llmrun.runners.handles import Batch
    from llmrun.runners.library import llama_lib

    lib = llama_lib()
    sizes = {}
    for kv in ("f16", "q8_0"):
        cfg = EngineConfig(n_ctx=256, cache_type_k=kv, cache_type_v=kv, flash_attn="on")
        r = LlamaCppRunner(model_path, cfg)
        prompt = r.tokenize("The capital of France is Paris, and of Italy", add_special=True)
        context = r.make_context(n_seq=2, n_ctx=128, n_batch=64)
        batch = Batch(lib, 64, n_seq_max=2)
        for i, token in enumerate(prompt):
            batch.set(i, token, i, 0, i == len(prompt) - 1)
        batch.n_tokens = len(prompt)
        assert lib.llama_decode(context.ptr, batch) == 0
        sizes[kv] = int(lib.llama_state_seq_get_size(context.ptr, 0))
        batch.close()
        r.close()
    assert sizes["q8_0"] < 0.75 * sizes["f16"], sizes
