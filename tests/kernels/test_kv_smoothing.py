"""K smoothing for 8-bit KV caches (kv/smoothing.py) in the per-op path, the fused CPU decode step and the engine.

Over an fp32 cache smoothing changes no result beyond float rounding (softmax ignores the per-query shift q.m,
and the scales cancel); the fused step applies it bit for bit as the per-op path does; over an int8 cache it
brings a model whose K has an offset channel closer to its fp32 results; the engine calibrates it for int8
caches only, unless turned off.
"""

from __future__ import annotations

import pytest
import torch

from loraplex.engine.config import EngineConfig
from loraplex.engine.core import EngineCore
from loraplex.engine.kv import kv_dtype, smoothing
from loraplex.engine.kv.block_pool import allocate_kv_storage
from loraplex.engine.models.llama import LlamaModel
from loraplex.engine.models.synthetic import synthetic_model
from tests.kernels.test_cpu_decode_step import BLOCK, BLOCKS_PER_SEQ, PROMPTS, _decode, _prefill


def _model(offset: float = 0.0) -> LlamaModel:
    """tiny-bias, with `offset` added to the K bias of each kv head's lowest-frequency channel pair (RoPE
    barely turns it over these positions: an offset K carries into the cache, as in Llama-family models)."""
    config, weights, _ = synthetic_model("tiny-bias")
    d, q = config.head_dim, config.q_size
    for layer in range(config.num_layers):
        bias = weights[f"layers.{layer}.qkv_bias"]
        for h in range(config.num_kv_heads):
            bias[q + h * d + d // 2 - 1] += offset
            bias[q + h * d + d - 1] += offset
    return LlamaModel(config, weights)


def _storage(model, dtype):
    cfg = model.config
    return allocate_kv_storage(cfg.num_layers, 1 + len(PROMPTS) * BLOCKS_PER_SEQ, BLOCK, cfg.num_kv_heads,
                               cfg.head_dim, dtype, torch.device("cpu"))


def _calibrate(model):
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in (40, 23, 61)]
    return smoothing.calibrate(model, prompts, BLOCK)


def _run(model, dtype, monkeypatch, fused=True):
    """Prefill PROMPTS (per-op path), then one decode step: (its logits, the cache's bytes)."""
    g = torch.Generator().manual_seed(0)
    storage = _storage(model, dtype)
    _prefill(model, storage, g)
    ids = torch.randint(0, model.config.vocab_size, (len(PROMPTS),), generator=g)
    logits = _decode(model, storage, ids, torch.arange(len(PROMPTS)), None, fused, monkeypatch)
    return logits, kv_dtype.raw(storage).clone()


def test_calibration_is_deterministic_and_floors_a_silent_channel():
    model = _model()
    a, b = _calibrate(model), _calibrate(model)
    assert all(torch.equal(x, y) for x, y in zip((a.q_scale, a.k_mean, a.k_inv_scale),
                                                 (b.q_scale, b.k_mean, b.k_inv_scale), strict=True))
    cfg = model.config
    assert a.q_scale.shape == (cfg.num_layers, cfg.num_heads, cfg.head_dim)
    assert a.k_mean.shape == a.k_inv_scale.shape == (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    # each query head carries its kv head's scale
    group = cfg.num_heads // cfg.num_kv_heads
    assert torch.allclose(a.q_scale[:, ::group] * a.k_inv_scale, torch.ones_like(a.k_inv_scale))
    # a K channel pair that never moves (zero weights and bias: zero after RoPE too) is scaled by the floor
    config, weights, _ = synthetic_model("tiny-bias")
    for layer in range(config.num_layers):
        for c in (3, 3 + config.head_dim // 2):
            weights[f"layers.{layer}.qkv"][config.q_size + c] = 0.0
            weights[f"layers.{layer}.qkv_bias"][config.q_size + c] = 0.0
    silent = _calibrate(LlamaModel(config, weights))
    assert torch.isfinite(silent.k_inv_scale).all()
    floor = smoothing.MIN_RELATIVE_SCALE * silent.q_scale[:, 0].mean(-1)  # [layers] ~ the floor of kv head 0
    assert (silent.q_scale[:, 0, 3] > 0.5 * floor).all() and (silent.q_scale[:, 0, 3] < 2 * floor).all()


def test_over_an_fp32_cache_smoothing_changes_no_result(monkeypatch):
    model = _model(offset=3.0)
    plain, plain_cache = _run(model, torch.float32, monkeypatch)
    model.kv_smoothing = _calibrate(model)
    smoothed, smoothed_cache = _run(model, torch.float32, monkeypatch)
    assert not torch.equal(plain_cache, smoothed_cache)  # the cache holds the centred, scaled K
    assert torch.allclose(plain, smoothed, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
def test_the_fused_step_smooths_as_the_per_op_path(dtype, monkeypatch):
    model = _model(offset=3.0)
    model.kv_smoothing = _calibrate(model)
    fused, fused_cache = _run(model, dtype, monkeypatch, fused=True)
    per_op, per_op_cache = _run(model, dtype, monkeypatch, fused=False)
    assert torch.equal(fused, per_op) and torch.isfinite(fused).all()
    assert torch.equal(fused_cache, per_op_cache)


def _attend(q, k, v):
    """q [n, heads, d] over k, v [T, kv_heads, d] (every query sees every key), fp32."""
    group = q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(group, dim=1) for x in (k, v))
    p = torch.softmax(torch.einsum("nhd,thd->nht", q, k) * q.shape[-1] ** -0.5, dim=-1)
    return torch.einsum("nht,thd->nhd", p, v)


def test_over_int8_rows_smoothing_keeps_attention_closer_to_fp32():
    """K with an offset channel and a wide one (as Llama-family K has): one scale per row spends the int8
    grid on them; centred and scaled per channel, the other channels keep their precision."""
    g = torch.Generator().manual_seed(3)
    t, heads, kvh, d = 300, 4, 2, 64
    k, v = (torch.randn(t, kvh, d, generator=g) for _ in range(2))
    k[..., d // 2 - 1] += 20.0
    k[..., 7] *= 8.0
    q = torch.randn(16, heads, d, generator=g) * 2

    def rows(x):  # as an int8 cache holds x and attention reads it back
        return kv_dtype.dequantize(kv_dtype.quantize(x, torch.int8), d, torch.float32)

    want = _attend(q, k, v)
    raw = _attend(q, rows(k), rows(v))
    sm = smoothing.from_k_rows(k.unsqueeze(0), heads // kvh)
    qs, ks = q.clone(), k.clone()
    sm.apply(0, qs, ks)
    assert torch.allclose(_attend(qs, ks, v), want, atol=1e-4)  # exact math: the shift q.m cancels in softmax
    smoothed = _attend(qs, rows(ks), rows(v))
    err_raw, err_smoothed = ((x - want).abs().max().item() for x in (raw, smoothed))
    assert err_smoothed * 3 < err_raw, (err_smoothed, err_raw)


def _engine(**kw) -> EngineCore:
    return EngineCore(EngineConfig(model="synthetic:tiny", device="cpu", dtype="float32", num_kv_blocks=32,
                                   block_size=16, **kw))


def test_the_engine_calibrates_int8_caches_only_unless_turned_off():
    assert isinstance(_engine(kv_cache_dtype="int8").runner.model.kv_smoothing, smoothing.KvSmoothing)
    assert _engine(kv_cache_dtype="int8", kv_cache_smoothing="off").runner.model.kv_smoothing is None
    for dtype in ("float32", "float16", "fp8"):
        assert _engine(kv_cache_dtype=dtype).runner.model.kv_smoothing is None
    with pytest.raises(ValueError, match="kv_cache_smoothing must be on or off"):
        EngineConfig(model="synthetic:tiny", kv_cache_smoothing="maybe")


def test_the_serve_flag_reaches_the_engine_and_a_bad_value_is_refused_by_the_parser(capsys):
    from tests.unit.test_memory_sizing import _args, build_engine

    for flag, smoothed in (("on", True), ("off", False)):
        engine = build_engine(_args("--model", "synthetic:tiny", "--device", "cpu", "--kv-cache-dtype", "int8",
                                    "--kv-cache-smoothing", flag, "--kv-cache-mb", "16"))
        try:
            assert (engine.core.runner.model.kv_smoothing is not None) == smoothed
        finally:
            engine.shutdown()
    with pytest.raises(SystemExit):
        _args("--kv-cache-smoothing", "maybe")
    assert "invalid choice: 'maybe'" in capsys.readouterr().err
