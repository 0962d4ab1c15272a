from __future__ import annotations

import json

import pytest

from llmrun.runners.stats import Aggregate, GenerationStats, percentile
from llmrun.runners.text import TextStream


def test_multibyte_characters_split_across_tokens() -> None:
    data = "Bär 日本 🎉!".encode()
    stream = TextStream()
    out = [stream.feed(data[i : i + 1]) for i in range(len(data))]
    assert "".join(out) + stream.flush() == "Bär 日本 🎉!"
    assert all("\ufffd" not in piece for piece in out)


def test_stop_string_across_pieces_is_cut_and_held_back() -> None:
    stream = TextStream(stop=["END"])
    assert stream.feed(b"hello E") == "hello "
    assert stream.feed(b"N") == ""
    assert stream.feed(b"D and more") == ""
    assert stream.stopped
    assert stream.flush() == ""


def test_partial_stop_released_when_it_cannot_match() -> None:
    stream = TextStream(stop=["END"])
    assert stream.feed(b"the E") == "the "
    assert stream.feed(b"ND") == ""  # completes END
    other = TextStream(stop=["END"])
    assert other.feed(b"the E") == "the "
    assert other.feed(b"gg") == "Egg"
    assert other.flush() == ""


def test_percentile_matches_linear_interpolation() -> None:
    assert percentile([], 50) is None
    assert percentile([5.0], 99) == 5.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([float(i) for i in range(101)], 90) == pytest.approx(90.0)


def make_stats(**kw: object) -> GenerationStats:
    base: dict[str, object] = dict(
        finish_reason="stop",
        prompt_tokens=100,
        reused_tokens=20,
        output_tokens=5,
        template_tokenize_s=0.01,
        prefill_s=0.2,
        first_sample_s=0.001,
        itl_s=(0.01, 0.02, 0.01, 0.04),
        e2e_s=0.3,
        load_s=0.1,
        engine_eval_ms=60.0,
        engine_n_eval=4,
        engine_sample_ms=4.0,
        engine_n_sample=5,
    )
    base.update(kw)
    return GenerationStats(**base)  # type: ignore[arg-type]


def test_computed_figures() -> None:
    s = make_stats()
    assert s.new_prompt_tokens == 80
    assert s.prompt_tps == pytest.approx(400.0)
    assert s.ttft_s == pytest.approx(0.211)
    assert s.decode_s == pytest.approx(0.08)
    assert s.output_tps == pytest.approx(4 / 0.08)  # tokens after the first over decode time
    assert s.itl_max_s == 0.04
    # 20 ms per step measured, 15 ms eval + 0.8 ms sampling accounted by llama.cpp
    assert s.python_overhead_per_token_ms == pytest.approx(20 - 15 - 0.8)
    # with the decode calls timed, their wall time replaces llama.cpp's eval counter
    timed = make_stats(decode_call_ms=15.5, sample_s=0.004)
    assert timed.python_overhead_per_token_ms == pytest.approx(20 - 15.5 - 1.0)
    assert timed.uncounted_decode_ms == pytest.approx(0.5)
    record = json.loads(json.dumps(s.to_dict()))
    assert record["itl_ms"] == [10.0, 20.0, 10.0, 40.0]
    assert record["ttft_s"] == pytest.approx(0.211)
    assert record["prompt_tps"] == pytest.approx(400.0)


def test_no_output_tokens_gives_no_rates() -> None:
    s = make_stats(output_tokens=0, itl_s=(), prefill_s=0.0)
    assert s.output_tps is None and s.prompt_tps is None and s.itl_p50_s is None


def test_aggregate() -> None:
    agg = Aggregate.of([make_stats(prefill_s=0.1), make_stats(prefill_s=0.2), make_stats()])
    assert agg.count == 3
    assert agg.figures["prompt_tps"]["p50"] == pytest.approx(400.0)


def test_run_and_chat_take_the_cores_a_busy_machine_leaves_free() -> None:
    from llmrun.runners.system import choose_threads

    quiet = choose_threads(8, 0.1, 16)
    assert (quiet.threads, quiet.reduced) == (8, False)
    assert choose_threads(8, 7.0, 16).threads == 8  # 8 spare CPUs: no contention
    busy = choose_threads(8, 12.3, 16)
    assert (busy.threads, busy.reduced) == (4, True)
    assert "12.3 of 16 CPUs busy" in busy.why and "-t 8" in busy.why
    assert choose_threads(2, 1.9, 2).threads == 1  # never fewer than one
    assert choose_threads(2, None, 2).threads == 2  # unknown load: the default
