"""Shared fixtures: engines on synthetic tiny models, and the real default model loaded once."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("LORAPLEX_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".cache", "test"))
torch.set_num_threads(min(2, torch.get_num_threads()))


def make_core(model: str = "synthetic:tiny", **overrides):
    from loraplex.engine.config import EngineConfig
    from loraplex.engine.core import EngineCore

    params = {"device": "cpu", "dtype": "float32", "num_kv_blocks": 256, "block_size": 16}
    params.update(overrides)
    return EngineCore(EngineConfig(model=model, **params), loaded=_loaded(model))


_LOADED: dict = {}


def _loaded(model: str):
    """Loads each model once per test session (weights are read-only to the engine)."""
    from loraplex.engine.models.loader import load_model, resolve_model

    if model not in _LOADED:
        _LOADED[model] = load_model(resolve_model(model), torch.float32, torch.device("cpu"))
    return _LOADED[model]


@pytest.fixture
def tiny_core():
    return make_core()


@pytest.fixture(scope="session")
def default_model():
    return _loaded("smollm2-135m")
