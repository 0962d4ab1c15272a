"""Owners of llama.cpp's C objects: each class holds one handle and frees it exactly once.

As llama-cpp-python's `_internals.py` does: `close()` frees and forgets the pointer, a second
`close()` does nothing, and a context is closed before the model it was made from (the runner
keeps track of the contexts it hands out). Nothing outside these classes frees a handle.
"""

from __future__ import annotations

import ctypes
import functools
import time
from collections.abc import Callable, Iterable
from typing import Any

from .errors import EngineError


class Model:
    """A loaded llama_model and its vocabulary, and the grammars parsed on it (freed first)."""

    def __init__(self, lib: Any, ptr: Any) -> None:
        self.lib, self.ptr = lib, ptr
        self.vocab = lib.llama_model_get_vocab(ptr)
        self.n_vocab = int(lib.llama_vocab_n_tokens(self.vocab))
        self._piece_buf = ctypes.create_string_buffer(256)
        self._to_piece = lib.llama_token_to_piece
        self._is_eog = lib.llama_vocab_is_eog
        self.grammars: Any = None  # grammar.Grammars parsed on this vocabulary, once asked for

    def to_tokens(self, text: str, *, add_special: bool) -> list[int]:
        lib, data = self.lib, text.encode("utf-8")
        n_max = len(data) + 8
        for _ in range(2):
            buf = (lib.llama_token * n_max)()
            n = lib.llama_tokenize(self.vocab, data, len(data), buf, n_max, add_special, True)
            if n >= 0:
                return list(buf[:n])
            n_max = -n
        raise EngineError("tokenization failed")

    def to_piece(self, token: int, *, special: bool = False) -> bytes:
        n = self._to_piece(self.vocab, token, self._piece_buf, 256, 0, special)
        if n < 0:
            big = ctypes.create_string_buffer(-n)
            n = self._to_piece(self.vocab, token, big, -n, 0, special)
            return big.raw[:n]
        return self._piece_buf.raw[:n]

    def is_eog(self, token: int) -> bool:
        """Whether the token ends a generation (end of sequence, end of turn)."""
        return bool(self._is_eog(self.vocab, token))

    def desc(self) -> str:
        """llama.cpp's description of the model, as llama-bench's model_type ('llama 256M Q4_1')."""
        buf = ctypes.create_string_buffer(256)
        n = self.lib.llama_model_desc(self.ptr, buf, len(buf))
        return buf.value.decode("utf-8", errors="replace") if n > 0 else ""

    def close(self) -> None:
        if self.grammars is not None:  # they point into the vocabulary
            self.grammars.close()
            self.grammars = None
        if self.ptr is not None:
            self.lib.llama_model_free(self.ptr)
            self.ptr = None


class Context:
    """A llama_context on a model, and the threadpools attached to it (freed after it)."""

    def __init__(self, lib: Any, ptr: Any, pools: Iterable[Any] = ()) -> None:
        self.lib, self.ptr = lib, ptr
        self.pools = tuple(pools)

    @property
    def _as_parameter_(self) -> Any:  # ctypes passes the pointer where a context is expected
        return self.ptr

    def clear(self) -> None:
        """Drop every KV entry of every sequence."""
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ptr), True)

    def remove(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        """Drop sequence seq_id's KV entries in [p0, p1) (-1: open); False where the model's
        memory cannot cut a sequence (recurrent models)."""
        return bool(
            self.lib.llama_memory_seq_rm(self.lib.llama_get_memory(self.ptr), seq_id, p0, p1)
        )

    def close(self) -> None:
        if self.ptr is not None:
            self.lib.llama_free(self.ptr)
            self.ptr = None
            for pool in self.pools:  # the context no longer computes with them
                pool.close()


class Sampler:
    """A llama.cpp sampler chain (the chain owns the samplers added to it)."""

    def __init__(self, lib: Any, *, perf: bool = True) -> None:
        params = lib.llama_sampler_chain_default_params()
        params.no_perf = not perf
        self.lib = lib
        self.ptr = lib.llama_sampler_chain_init(params)
        self._sample = lib.llama_sampler_sample

    @classmethod
    def greedy(cls, lib: Any) -> Sampler:
        chain = cls(lib, perf=False)
        chain.add(lib.llama_sampler_init_greedy())
        return chain

    @property
    def _as_parameter_(self) -> Any:
        return self.ptr

    def add(self, sampler: Any) -> None:
        """Append a sampler (llama_sampler_init_*); the chain frees it."""
        self.lib.llama_sampler_chain_add(self.ptr, sampler)

    def accept(self, tokens: Iterable[int]) -> None:
        """Tell the chain about tokens already in the context (the repeat penalty counts them)."""
        for token in tokens:
            self.lib.llama_sampler_accept(self.ptr, token)

    def sample(self, ctx: Context | Any, index: int = -1) -> int:
        """The next token from the logits of batch entry `index` (-1: the last)."""
        return int(self._sample(self.ptr, ctx, index))

    def sampling(self) -> Callable[[Any, int], int]:
        """`sample` as one call for a hot loop: here the C function bound to the chain."""
        return functools.partial(self._sample, self.ptr)

    def perf(self) -> tuple[float, int]:
        """llama.cpp's sampling counters: (milliseconds spent, tokens sampled)."""
        p = self.lib.llama_perf_sampler(self.ptr)
        return float(p.t_sample_ms), int(p.n_sample)

    def close(self) -> None:
        if self.ptr is not None:
            self.lib.llama_sampler_free(self.ptr)
            self.ptr = None


@functools.lru_cache(maxsize=4)
def _token_ids(n_vocab: int) -> Any:
    """0 .. n_vocab-1 as int32, shared by every grammar sampler of one vocabulary (read-only)."""
    import numpy as np

    ids = np.arange(n_vocab, dtype=np.int32)
    ids.flags.writeable = False
    return ids


def _is_greedy(lib: Any, chain: Any) -> bool:
    """Whether `chain` is a repeat penalty at most, then greedy: it keeps every candidate in
    place and selects the first of highest logit."""
    names = [
        lib.llama_sampler_name(lib.llama_sampler_chain_get(chain, i))
        for i in range(lib.llama_sampler_chain_n(chain))
    ]
    return bool(names) and names[-1] == b"greedy" and set(names[:-1]) <= {b"penalties"}


def _candidates(lib: Any, n: int) -> tuple[Any, Any]:
    """`n` llama_token_data cells as a numpy view (id, logit, p), and the
    llama_token_data_array over them (the view keeps the cells alive)."""
    import numpy as np

    cells = (lib.llama_token_data * n)()
    view = np.frombuffer(cells, dtype=np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")]))
    pointer = ctypes.cast(cells, ctypes.POINTER(lib.llama_token_data))
    return view, lib.llama_token_data_array(pointer, n, -1, False)


def _set_candidates(view: Any, array: Any, ids: Any, logits: Any) -> None:
    """`_candidates`' cells: these tokens with their logits, unsorted, nothing selected."""
    view["id"], view["logit"], view["p"] = ids, logits, 0.0
    array.size, array.selected, array.sorted = len(ids), -1, False


class GrammarSampler(Sampler):
    """A sampler chain held to a grammar as llama.cpp's own `common_sampler_sample` does it
    (common/sampling.cpp): the chain samples first; only the chosen token is checked against
    the grammar (a one-entry candidate array through `llama_sampler_apply`, refused if its logit
    becomes -inf); a refused token is sampled again with the grammar masking every candidate
    before the chain. The grammar, then the chain, accept the token kept, so a refused first
    try is never learned by the repeat penalties. The grammar tests one token a step instead of
    the whole vocabulary, except after a refusal.

    A greedy chain (a repeat penalty at most, then greedy: `new_sampler` at temperature 0) takes
    a refusal more cheaply, with the same token: the grammar checks the `TOP` candidates of
    highest (penalised) logit in the chain's order, best first, and the best it allows is the
    token the whole-vocabulary pass would pick; only when it allows none of them (or a logit
    outside ties with it) does it mask the whole vocabulary. That pass costs tens of
    milliseconds with a schema's grammar, and llmrun's grammars refuse more often than
    llama-server's: llama-cpp-python's converter allows one space between JSON tokens where
    llama.cpp's allows newlines and indentation, which chat models write.

    The candidate array is built from `llama_get_logits_ith` with numpy (imported here, so only
    a grammar's use imports it), as `llama_sampler_sample` builds it in C. It owns `chain`'s
    pointer and `grammar` (a `llama_sampler_init_grammar` sampler); `perf()` is its own count:
    the time in `sample` and the tokens it sampled (the grammar's checks included)."""

    TOP = 128  # the candidates checked after a greedy chain's refused token

    def __init__(self, chain: Sampler, grammar: Any, n_vocab: int) -> None:
        import numpy as np

        lib = chain.lib
        self.n_vocab = n_vocab
        self._np = np
        self._apply, self._accept = lib.llama_sampler_apply, lib.llama_sampler_accept
        self._logits_ith = lib.llama_get_logits_ith
        self._view, self._all = _candidates(lib, n_vocab)
        self._ids = _token_ids(n_vocab)
        self._one_cell = lib.llama_token_data()
        self._one = lib.llama_token_data_array(ctypes.pointer(self._one_cell), 1, -1, False)
        self._all_ref, self._one_ref = ctypes.byref(self._all), ctypes.byref(self._one)
        self._greedy = _is_greedy(lib, chain.ptr)
        self._top_view, self._top = _candidates(lib, min(self.TOP, n_vocab))
        self._top_ref = ctypes.byref(self._top)
        self.resampled = 0  # tokens the grammar refused, sampled again
        self.masked_all = 0  # of those, the ones the grammar masked the whole vocabulary for
        self._t_s, self._n = 0.0, 0
        # the handles last, once nothing above can fail: the caller still owns them until here
        self.lib, self.grammar, self._sample = lib, grammar, chain._sample
        self.ptr, chain.ptr = chain.ptr, None

    def _fill(self, ctx: Any, index: int) -> None:
        """Every token with its logit, unsorted, nothing selected (llama.cpp's `set_logits`)."""
        ptr = self._logits_ith(ctx, index)
        if not ptr:
            raise EngineError(f"llama.cpp has no logits for batch entry {index}")
        logits = self._np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))
        _set_candidates(self._view, self._all, self._ids, logits)

    def _chosen(self) -> int:
        """The token the chain selected; EngineError when none can be: every candidate is
        masked, so the grammar allows no token of this model here (llama.cpp asserts)."""
        a = self._all
        if not 0 <= a.selected < a.size or a.data[a.selected].logit == float("-inf"):
            raise EngineError("the grammar allows no token of this model at this point")
        return int(a.data[a.selected].id)

    def _best_allowed(self) -> int | None:
        """After a greedy chain's refused token: the token greedy picks once the grammar masks
        every candidate, found among the `TOP` of highest logit (the chain's penalties are in
        the logits already, in token order); None when it may lie outside them."""
        np = self._np
        logits = self._view["logit"]
        k = self._top_view.size
        top = np.argpartition(-logits, k - 1)[:k] if k < logits.size else np.arange(k)
        top = top[np.lexsort((top, -logits[top]))]  # best first; greedy keeps the lowest id
        view = self._top_view
        _set_candidates(view, self._top, top, logits[top])
        self._apply(self.grammar, self._top_ref)
        allowed = np.flatnonzero(view["logit"] != float("-inf"))
        if not allowed.size:
            return None
        i = int(allowed[0])
        if k < logits.size and view["logit"][i] <= logits[top[-1]]:
            return None  # a token outside the TOP may tie with it and come first
        return int(view["id"][i])

    def sample(self, ctx: Context | Any, index: int = -1) -> int:
        t0 = time.perf_counter()
        apply = self._apply
        self._fill(ctx, index)
        apply(self.ptr, self._all_ref)
        token = self._chosen()
        one, cell = self._one, self._one_cell
        cell.id, cell.logit, cell.p = token, 1.0, 0.0
        one.size, one.selected, one.sorted = 1, -1, False
        apply(self.grammar, self._one_ref)
        if cell.logit == float("-inf"):  # refused: the best allowed, or mask all, then chain
            self.resampled += 1
            best = self._best_allowed() if self._greedy else None
            if best is None:
                self.masked_all += 1
                self._fill(ctx, index)
                apply(self.grammar, self._all_ref)
                apply(self.ptr, self._all_ref)
                token = self._chosen()
            else:
                token = best
        self._accept(self.grammar, token)
        self._accept(self.ptr, token)
        self._t_s += time.perf_counter() - t0
        self._n += 1
        return token

    def sampling(self) -> Callable[[Any, int], int]:
        return self.sample

    def perf(self) -> tuple[float, int]:
        return self._t_s * 1000.0, self._n

    def close(self) -> None:
        if self.grammar is not None:
            self.lib.llama_sampler_free(self.grammar)
            self.grammar = None
        super().close()


class Batch:
    """A llama_batch of up to `capacity` tokens, each in one of up to `n_seq_max` sequences."""

    def __init__(self, lib: Any, capacity: int, n_seq_max: int = 1) -> None:
        self.lib, self.capacity = lib, capacity
        self.struct: Any = lib.llama_batch_init(capacity, 0, n_seq_max)
        self._token, self._pos = self.struct.token, self.struct.pos
        self._n_seq_id, self._seq_id = self.struct.n_seq_id, self.struct.seq_id
        self._logits = self.struct.logits

    @property
    def _as_parameter_(self) -> Any:  # llama_decode takes the struct by value
        return self.struct

    def set(self, i: int, token: int, pos: int, seq_id: int = 0, logits: bool = True) -> None:
        """Entry i: `token` at position `pos` of sequence `seq_id`, its logits kept or not."""
        self._token[i] = token
        self._pos[i] = pos
        self._n_seq_id[i] = 1
        self._seq_id[i][0] = seq_id
        self._logits[i] = logits

    @property
    def n_tokens(self) -> int:
        return int(self.struct.n_tokens)

    @n_tokens.setter
    def n_tokens(self, n: int) -> None:
        if not 0 <= n <= self.capacity:
            raise ValueError(f"a batch of {self.capacity} tokens cannot hold {n}")
        self.struct.n_tokens = n

    def close(self) -> None:
        if self.struct is not None:
            self.lib.llama_batch_free(self.struct)
            self.struct = None
