"""The runner's own context and the tokens whose KV entries it holds, kept between requests:
the prefix a new prompt shares with them is not prefilled again."""

from __future__ import annotations

import ctypes
import threading
from typing import Any

from .errors import EngineError
from .handles import Context
from .library import llama_lib


class PrefixCache:
    """The runner's own context and the tokens whose KV entries it holds (sequence 0), kept
    between requests so that a prompt sharing a prefix with the last one prefills the rest.

    `cancel` is the running request's event: a load's progress callback and the prefill's
    abort callback read it, so Ctrl-C stops either within a tensor or a chunk."""

    def __init__(self) -> None:
        self.context: Context | None = None
        self.tokens: list[int] = []  # never replaced: drafters share the list
        self.cancel = threading.Event()
        self._abort_cb: Any = None

    def attach(self, context: Context) -> None:
        """Use this context, empty. A Python abort callback on purpose (not AbortFlag's C
        one): prefill runs on the main thread, where Python's signal handlers run only while
        Python code does, so this is what lets Ctrl-C set `cancel` in the middle of a long
        chunk. About 500 calls per graph: ~0.1 % of a 512-token chunk. Decode steps run
        without it."""
        self.context = context
        self._abort_cb = llama_lib().ggml_abort_callback(lambda _data: self.cancel.is_set())

    def detach(self) -> None:
        """Free the context and forget its tokens."""
        if self.context is not None:
            self.context.close()
            self.context = None
        self.tokens.clear()

    @property
    def ptr(self) -> Any:
        assert self.context is not None, "no context: load() first"
        return self.context.ptr

    def truncate(self, n: int) -> int:
        """Keep the KV entries of the first n cached tokens; returns how many were kept."""
        lib = llama_lib()
        mem = lib.llama_get_memory(self.ptr)
        if not lib.llama_memory_seq_rm(mem, 0, n, -1):  # e.g. recurrent models: all or nothing
            lib.llama_memory_clear(mem, True)
            n = 0
        del self.tokens[n:]
        return n

    def reuse_prefix(self, tokens: list[int]) -> int:
        """Keep the cached KV entries of the prompt's longest cached prefix (at least one token
        is always evaluated, for the logits); returns how many were kept."""
        cached = self.tokens
        limit = min(len(tokens) - 1, len(cached))
        n = 0
        while n < limit and cached[n] == tokens[n]:
            n += 1
        return self.truncate(n)

    def decode_slice(self, arr: Any, off: int, n: int) -> int:
        """llama_decode of tokens arr[off:off + n], without copying them."""
        lib = llama_lib()
        ptr = ctypes.cast(
            ctypes.addressof(arr) + off * ctypes.sizeof(lib.llama_token), lib.llama_token_p
        )
        return int(lib.llama_decode(self.ptr, lib.llama_batch_get_one(ptr, n)))

    def abortable(self, cancel: threading.Event) -> None:
        """From now on `cancel` stops the context's decodes within a graph."""
        self.cancel = cancel
        llama_lib().llama_set_abort_callback(self.ptr, self._abort_cb, None)

    def unabortable(self) -> None:
        lib = llama_lib()
        lib.llama_set_abort_callback(self.ptr, lib.ggml_abort_callback(), None)

    def eval_tokens(self, tokens: list[int], n_batch: int, cancel: threading.Event) -> None:
        """Append tokens to the cache in chunks of n_batch (no sampling, no timing).

        Setting `cancel` stops within the running chunk; the cache then holds what completed."""
        lib = llama_lib()
        arr = (lib.llama_token * len(tokens))(*tokens)
        self.abortable(cancel)
        try:
            for off in range(0, len(tokens), n_batch):
                if cancel.is_set():
                    break
                n = min(n_batch, len(tokens) - off)
                rc = self.decode_slice(arr, off, n)
                if rc != 0 and cancel.is_set():
                    break
                if rc != 0:
                    raise EngineError(f"llama_decode failed (code {rc})")
                self.tokens.extend(tokens[off : off + n])
            lib.llama_synchronize(self.ptr)
        finally:
            self.unabortable()
            self.truncate(len(self.tokens))
