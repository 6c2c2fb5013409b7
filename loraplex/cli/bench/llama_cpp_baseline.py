"""llama.cpp on the same GGUF as a baseline for `loraplex bench quant --llama-cpp`, through llama-cpp-python's
low-level API (never a dependency of the project: the bench says so when it is missing).

- One context with a sequence per request (n_seq_max = the largest batch), so a batch of B decodes is one
  llama_decode of B tokens, as loraplex's engine steps B sequences at once.
- Greedy: each sequence's next token is the argmax of its logits (numpy over llama.cpp's buffer).
- tokens/s: generated tokens over the whole run, prompts included, as step_interleaved counts loraplex's.
"""

from __future__ import annotations

import ctypes
import time

import numpy as np


class LlamaCppBaseline:
    def __init__(self, path: str, max_seqs: int, threads: int, n_ctx_per_seq: int = 512):
        try:
            import llama_cpp
        except ImportError as e:
            raise ValueError("--llama-cpp needs llama-cpp-python importable (pip install llama-cpp-python; it is "
                             "not a dependency of loraplex)") from e
        self.lc = llama_cpp
        self._quiet = llama_cpp.llama_log_callback(lambda level, text, user_data: None)  # (kept: C holds it)
        llama_cpp.llama_log_set(self._quiet, ctypes.c_void_p(0))  # its load log would bury the bench's output
        llama_cpp.llama_backend_init()
        self.model = llama_cpp.llama_model_load_from_file(path.encode(), llama_cpp.llama_model_default_params())
        if not self.model:
            raise ValueError(f"llama.cpp could not load {path}")
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = n_ctx_per_seq * max_seqs
        params.n_batch = params.n_ubatch = n_ctx_per_seq * max_seqs
        params.n_seq_max = max_seqs
        params.n_threads = params.n_threads_batch = threads
        self.ctx = llama_cpp.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise ValueError("llama.cpp could not make a context")
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self.capacity = params.n_batch
        self.batch = llama_cpp.llama_batch_init(self.capacity, 0, 1)

    def tokenize(self, text: str) -> list[int]:
        raw = text.encode()
        out = (self.lc.llama_token * (len(raw) + 8))()
        n = self.lc.llama_tokenize(self.vocab, raw, len(raw), out, len(out), False, True)
        return list(out[:n])

    def _decode(self, tokens: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode over (token, position, sequence, wants logits) entries."""
        b = self.batch
        for i, (tok, pos, seq, logits) in enumerate(tokens):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, logits
            b.seq_id[i][0] = seq
        b.n_tokens = len(tokens)
        if self.lc.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")

    def _argmax(self, i: int) -> int:
        ptr = self.lc.llama_get_logits_ith(self.ctx, i)
        return int(np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), (self.n_vocab,)).argmax())

    def tokens_per_s(self, prompts: list[str], new_tokens: int) -> float:
        """Greedy generation of new_tokens for every prompt at once, from an empty cache."""
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)
        ids = [self.tokenize(p) for p in prompts]
        t0 = time.perf_counter()
        entries = [(tok, pos, s, pos == len(p) - 1) for s, p in enumerate(ids) for pos, tok in enumerate(p)]
        self._decode(entries)
        rows = [i for i, e in enumerate(entries) if e[3]]  # each sequence's last prompt token
        nxt = [self._argmax(i) for i in rows]
        for step in range(1, new_tokens):
            self._decode([(tok, len(p) + step - 1, s, True) for s, (tok, p) in enumerate(zip(nxt, ids, strict=True))])
            nxt = [self._argmax(i) for i in range(len(ids))]
        return len(prompts) * new_tokens / (time.perf_counter() - t0)
