"""One request on the runner's own context: prefill in timed chunks after the cached prefix,
decode one token a step, and the request's stats.

- prefill: one `llama_decode` per chunk of `n_batch` tokens, each followed by
  `llama_synchronize`; a progress event after every chunk;
- first token: sampled with a C sampler chain (perf counters on);
- decode: one `llama_decode` of one token, then one sample, per step (or a speculative step:
  speculation.py).

Time spent by the consumer of the events (printing, drawing) is measured and left out of every
phase figure; `e2e_s` is the wall time including it.
"""

from __future__ import annotations

import random
import secrets
import threading
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field

from . import rpc
from .base import Event, Finished, LocalLoaded, PrefillProgress, Request, SamplingParams, Token
from .errors import EngineError, PromptTooLongError
from .handles import Model, Sampler
from .library import llama_lib
from .prefix_cache import PrefixCache
from .prompts import Prompts
from .reasoning import TokenTagger, opens_thinking
from .serving import figures
from .speculation import Drafter
from .stats import (
    FINISH_CONTEXT,
    FINISH_INTERRUPTED,
    FINISH_LENGTH,
    FINISH_STOP,
    GenerationStats,
    PausedClock,
)
from .system import cpu_sample, measured_background
from .text import TextStream


def new_sampler(
    model: Model | None, sp: SamplingParams, seed: int, *, prompt: Sequence[int], n_ctx: int
) -> Sampler:
    """A C sampler chain for these settings (perf counters on); the repeat penalty sees the
    prompt, as in llama-cli (and needs the model's vocabulary). A repeat_last_n of -1 is the
    whole context of `n_ctx` tokens, as llama.cpp's common code makes it (its sampler takes -1
    as 0: off). The caller closes it."""
    lib = llama_lib()
    chain = Sampler(lib)
    try:
        last_n = n_ctx if sp.repeat_last_n == -1 else sp.repeat_last_n
        if sp.repeat_penalty != 1.0 and last_n > 0:
            assert model is not None
            penalties = lib.llama_sampler_init_penalties(
                model.n_vocab, last_n, sp.repeat_penalty, 0.0, 0.0
            )
            chain.add(penalties)
            chain.accept(prompt[-last_n:])
        if sp.temperature <= 0:
            chain.add(lib.llama_sampler_init_greedy())
        else:
            if sp.top_k > 0:
                chain.add(lib.llama_sampler_init_top_k(sp.top_k))
            if sp.top_p < 1.0:
                chain.add(lib.llama_sampler_init_top_p(sp.top_p, 1))
            if sp.min_p > 0.0:
                chain.add(lib.llama_sampler_init_min_p(sp.min_p, 1))
            chain.add(lib.llama_sampler_init_temp(sp.temperature))
            chain.add(lib.llama_sampler_init_dist(seed))
        return _with_grammar(chain, model, sp.grammar)  # the chain freed if the grammar fails
    except BaseException:
        chain.close()  # closing twice is nothing: add_grammar may have freed it
        raise


def _with_grammar(chain: Sampler, model: Model | None, grammar: str | None) -> Sampler:
    """The chain held to the grammar as llama.cpp's common_sampler does (it samples, the
    grammar checks the chosen token: `GrammarSampler`); the grammar must not see the prompt,
    which the chain has seen already."""
    if grammar is None:
        return chain
    from .grammar import Grammars, add_grammar

    assert model is not None
    if model.grammars is None:  # each grammar parsed once: later requests get a copy
        model.grammars = Grammars(model.lib, model.vocab)
    where = "the grammar (--json-schema, --grammar)"
    return add_grammar(chain, model.vocab, grammar, where, parsed=model.grammars)


@dataclass
class _Prefilled:
    prompt_tokens: int
    reused: int  # the cached prefix's tokens, not prefilled again
    seconds: float = 0.0  # completed chunks only
    evaluated: int = 0
    aborted: bool = False


@dataclass
class _Decoded:
    finish: str = FINISH_STOP
    times: list[float] = field(default_factory=list)  # each output token's time stamp
    first_sample_s: float = 0.0
    sample_s: float = 0.0  # in sampling (llama_sampler_sample) after the first token
    call_s: float = 0.0  # in llama_decode + llama_synchronize after the first token
    calls: int = 0
    text: str = ""
    tail: str = ""  # text held back until the end
    thinking_tokens: int = 0
    first_answer_s: float | None = None
    drafted: int = 0  # speculative decoding: tokens proposed, accepted, verification steps
    accepted: int = 0
    steps: int = 0
    rpc_wait_s: float | None = None  # --rpc: waiting on the servers (rpc.ServerWait)


def generate(
    request: Request,
    cancel: threading.Event,
    *,
    loaded: LocalLoaded,
    model: Model,
    kv: PrefixCache,
    prompts: Prompts,
    drafter: Callable[[SamplingParams], Drafter | None],
) -> Iterator[Event]:
    """Prefill, then decode, then the stats. `drafter` gives the speculative decoding's
    drafter for the request's settings (None: one token a step)."""
    lib = llama_lib()
    clock = PausedClock()
    lib.llama_perf_context_reset(kv.ptr)
    cpu0 = cpu_sample()
    prompt_text, tokens = prompts.text_and_tokens(request)
    if len(tokens) + 1 > loaded.settings.n_ctx:
        raise PromptTooLongError(len(tokens), loaded.settings.n_ctx)
    reused = kv.reuse_prefix(tokens) if request.keep_cache else kv.truncate(0)
    t_tok = clock.now()
    sp = request.sampling
    seed = sp.seed if sp.seed is not None else secrets.randbelow(2**31)
    chain = new_sampler(model, sp, seed, prompt=tokens, n_ctx=loaded.settings.n_ctx)
    try:
        with clock.paused():
            net = rpc.traffic()  # --rpc: the network's part of each phase (None: no servers)
        prefill = yield from _prefill(kv, loaded.settings.n_batch, tokens, reused, cancel, clock)
        with clock.paused():
            net_prefilled = rpc.traffic()
        decode = _Decoded()
        if not prefill.aborted:
            tagger = None  # random benchmark tokens have no thinking to tell apart
            if request.token_ids is None:
                tagger = TokenTagger(thinking=opens_thinking(prompt_text))
            decode = yield from _decode(
                kv,
                model,
                loaded.settings.n_ctx,
                chain,
                sp,
                cancel,
                clock,
                tagger,
                drafter(sp),
                decode_only=request.decode_only,
            )
        # the request's record: the phases as timed here, llama.cpp's own counters beside them
        perf, (sample_ms, n_sample) = lib.llama_perf_context(kv.ptr), chain.perf()
        e2e_s = clock.wall()
        background = measured_background(cpu0, cpu_sample())
        stats = GenerationStats(
            finish_reason=FINISH_INTERRUPTED if prefill.aborted else decode.finish,
            prompt_tokens=prefill.prompt_tokens,
            reused_tokens=prefill.reused,
            output_tokens=len(decode.times),
            template_tokenize_s=t_tok,
            prefill_s=prefill.seconds,
            first_sample_s=decode.first_sample_s,
            sample_s=decode.sample_s,
            decode_call_ms=decode.call_s * 1000 / decode.calls if decode.calls else None,
            itl_s=tuple(figures.itl_s(decode.times)),  # the one definition (serving/figures.py)
            e2e_s=e2e_s,
            load_s=loaded.load_s,
            warmup_s=loaded.warmup_s,
            probe_s=loaded.probe_s,
            engine_prompt_eval_ms=float(perf.t_p_eval_ms),
            engine_eval_ms=float(perf.t_eval_ms),
            engine_n_prompt_eval=int(perf.n_p_eval),
            engine_n_eval=int(perf.n_eval),
            engine_sample_ms=sample_ms,
            engine_n_sample=n_sample,
            seed=seed if sp.temperature > 0 else None,
            prefilled_tokens=prefill.evaluated if prefill.aborted else None,
            background_cpus=background,
            thinking_tokens=decode.thinking_tokens,
            first_answer_s=decode.first_answer_s,
            draft_tokens=decode.drafted,
            accepted_tokens=decode.accepted,
            decode_steps=decode.steps,
            rpc_decode_wait_s=decode.rpc_wait_s,
            model=loaded.model,
            settings=loaded.settings,
        )
        if net is not None and net_prefilled is not None:
            stats = rpc.with_traffic(stats, net, net_prefilled, rpc.traffic())
        yield Finished(stats=stats, text=decode.text, tail=decode.tail)
    finally:
        chain.close()
        # KV entries beyond what we recorded (an aborted chunk) must not survive.
        kv.truncate(len(kv.tokens))


def _prefill(
    kv: PrefixCache,
    n_batch: int,
    tokens: list[int],
    reused: int,
    cancel: threading.Event,
    clock: PausedClock,
) -> Generator[Event, None, _Prefilled]:
    """llama_decode per chunk of n_batch new tokens, each timed up to a synchronize."""
    lib = llama_lib()
    new = tokens[reused:]
    arr = (lib.llama_token * len(new))(*new)
    done = _Prefilled(len(tokens), reused)
    with clock.paused():
        yield PrefillProgress(reused, len(tokens), reused, 0.0)
    kv.abortable(cancel)
    try:
        for off in range(0, len(new), n_batch):
            if cancel.is_set():
                done.aborted = True
                break
            n = min(n_batch, len(new) - off)
            t_chunk = time.perf_counter()
            rc = kv.decode_slice(arr, off, n)
            lib.llama_synchronize(kv.ptr)
            if rc == 2 or (rc != 0 and cancel.is_set()):
                done.aborted = True  # this chunk's time and tokens count nowhere
                break
            if rc != 0:
                raise EngineError(f"llama_decode failed during prefill (code {rc})")
            done.seconds += time.perf_counter() - t_chunk
            done.evaluated += n
            kv.tokens.extend(new[off : off + n])
            with clock.paused():
                yield PrefillProgress(reused + off + n, len(tokens), reused, done.seconds)
    finally:
        kv.unabortable()
    return done


class _NoWait:
    """ServerWait's face without servers: each step's calls cost nothing extra."""

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def count(self) -> None: ...


def _fed_tokens(model: Model, sp: SamplingParams) -> list[int]:
    """llama-bench's tg: `std::rand() % n_vocab` after each step, unsampled (last first)."""
    rng = random.Random(sp.seed or 0)
    return [rng.randrange(model.n_vocab) for _ in range(sp.max_tokens + 1)][::-1]


def _end(
    text: TextStream, made: int, max_tokens: int, cached: int, n_ctx: int, cancel: threading.Event
) -> str | None:
    """Why the generation ends after an output token, or None to go on."""
    if text.stopped:
        return FINISH_STOP
    if made >= max_tokens:
        return FINISH_LENGTH
    if cached >= n_ctx:  # no room for the next token's KV entry
        return FINISH_CONTEXT
    if cancel.is_set():
        return FINISH_INTERRUPTED
    return None


def _decode(
    kv: PrefixCache,
    model: Model,
    n_ctx: int,
    chain: Sampler,
    sp: SamplingParams,
    cancel: threading.Event,
    clock: PausedClock,
    tagger: TokenTagger | None,
    drafter: Drafter | None,
    *,
    decode_only: bool = False,
) -> Generator[Event, None, _Decoded]:
    """The first token from the prefill's logits, then one llama_decode per token (or a
    drafter's step, which it closes at the end).

    The hot path: per token one llama_decode, one llama_synchronize, one sample (timed on
    its own, so that llama.cpp's sampling is told apart from llmrun's time), one piece of
    text and the Token event; every C function and bound method is looked up once.
    `decode_only` is llama-bench's tg: random tokens are fed, nothing is sampled."""
    lib = llama_lib()
    ctx = kv.ptr
    out = _Decoded()
    text = TextStream(sp.stop)
    parts: list[str] = []
    perf = time.perf_counter
    decode_c, sync_c = lib.llama_decode, lib.llama_synchronize
    sample_c = chain.sampling()  # the C call bound to the chain; a grammar's check in Python
    is_eog = model.is_eog
    to_piece, feed, emit = model.to_piece, text.feed, parts.append
    times, cache = out.times, kv.tokens
    check_eog, max_tokens = not sp.ignore_eos, sp.max_tokens
    fed = _fed_tokens(model, sp) if decode_only else []
    if decode_only:
        token = fed.pop()
    else:
        t_sample = perf()
        token = sample_c(ctx, -1)
        out.first_sample_s = perf() - t_sample
    one = (lib.llama_token * 1)()
    batch_one = lib.llama_batch_get_one(one, 1)
    queued: list[int] = []  # accepted draft tokens: in the KV cache, not yet emitted
    pending = token  # the next token not yet in the KV cache
    sample_s = call_s = 0.0
    calls = 0
    server_wait = rpc.server_wait()  # --rpc: the steps' time waiting on the servers
    wait = server_wait or _NoWait()
    try:
        while True:
            in_kv = bool(queued)
            token = queued.pop(0) if in_kv else pending
            stamp = perf() - clock.start - clock.paused_s
            if check_eog and is_eog(token):
                out.finish = FINISH_STOP
                break
            times.append(stamp)
            wait.count()  # the step that made this token is in the decode phase
            piece = "" if decode_only else feed(to_piece(token))
            emit(piece)
            thinking = tagger.tag(piece) if tagger is not None else False
            t_yield = perf()
            yield Token(len(times) - 1, piece, stamp, token, thinking)
            clock.paused_s += perf() - t_yield
            finish = _end(text, len(times), max_tokens, len(cache), n_ctx, cancel)
            if finish is not None:
                out.finish = finish
                break
            if in_kv:
                continue
            if drafter is not None:
                room = min(n_ctx - len(cache) - 1, max_tokens - len(times))
                wait.start()
                queued, pending = drafter.step(ctx, chain, token, max(0, room))
                wait.stop()
                continue
            one[0] = token
            wait.start()
            t_call = perf()
            rc = decode_c(ctx, batch_one)
            if rc != 0:
                raise EngineError(f"llama_decode failed during generation (code {rc})")
            sync_c(ctx)  # llama.cpp's eval counter stops here; the sample is timed apart
            call_s += perf() - t_call
            calls += 1
            wait.stop()
            cache.append(token)
            if decode_only:
                pending = fed.pop()
                continue
            t_sample = perf()  # after the wait's reading: that is llmrun's time, not sampling's
            pending = sample_c(ctx, -1)
            sample_s += perf() - t_sample
    finally:
        out.sample_s = sample_s
        out.call_s, out.calls = call_s, calls
        if server_wait is not None:
            server_wait.close()
            out.rpc_wait_s = server_wait.seconds
        if drafter is not None:
            drafter.unused(len(queued))
            drafter.close()
            out.drafted, out.accepted, out.steps = drafter.drafted, drafter.accepted, drafter.steps
    out.tail = text.flush()
    out.text = "".join(parts) + out.tail
    if tagger is not None and tagger.seen_thinking:
        out.thinking_tokens = tagger.thinking_tokens
        if tagger.first_answer is not None:
            out.first_answer_s = out.times[tagger.first_answer]
    return out
