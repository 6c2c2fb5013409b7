"""`bench quant --llama-cpp` without llama-cpp-python: a clear refusal, never an import error (it is not a
dependency of loraplex)."""

from __future__ import annotations

import sys

import pytest

from loraplex.cli.bench.llama_cpp_baseline import LlamaCppBaseline


def test_without_llama_cpp_the_baseline_says_how_to_get_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # (import fails, as where it is not installed)
    with pytest.raises(ValueError, match="--llama-cpp needs llama-cpp-python importable"):
        LlamaCppBaseline("model.gguf", max_seqs=1, threads=1)


def test_the_baseline_needs_a_gguf_model():
    from loraplex.cli.bench.quant import run_quant_bench

    with pytest.raises(ValueError, match="--llama-cpp needs a GGUF model, 'synthetic:tiny' is synthetic"):
        run_quant_bench("synthetic:tiny", 4, "1", rounds=1, llama_cpp=True)
