"""KV caches of 16- and 8-bit types (kv/kv_dtype.py) in each kernel that writes or reads them.

The C writer (lp_kv_store) gives the same bytes as kv_dtype.quantize; the C decode attention over a cache of
each type (any GQA group, head_dim and context) equals attention over that cache's dequantized values (fp32
math), and stays within the type's rounding of attention over the fp32 values; the fused decode step stays
bit-identical to the per-op path whatever the cache type; the torch_sdpa backend over each type stays within
tolerance of an fp32 cache.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from loraplex.engine.attention.torch_sdpa import TorchSdpaBackend, build_metadata
from loraplex.engine.kernels.cpu.layer_ops import decode_attention, kv_rows
from loraplex.engine.kv import kv_dtype
from loraplex.engine.kv.block_pool import allocate_kv_storage
from tests.kernels.test_cpu_decode_step import PROMPTS, _decode, _model_and_cache, _prefill

NARROW = [torch.bfloat16, torch.float16, torch.int8, torch.float8_e4m3fn]
KV_TYPES = pytest.mark.parametrize("dtype", NARROW, ids=["bf16", "f16", "int8", "fp8"])
# attention output against fp32 K/V, |error| bound per type (values ~N(0, 1), head_dim 64)
ATOL = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.int8: 3e-2, torch.float8_e4m3fn: 1.2e-1}


@KV_TYPES
def test_the_c_writer_gives_the_bytes_of_quantize(dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 64, generator=g) * torch.tensor([1e-3, 0.1, 1.0, 30.0, 1e4, 1.0]).unsqueeze(1)
    x[5] = 0.0  # an all-zero row: scale 0
    x[2, :8] = torch.tensor([0.5, 1.5, 2.5, -0.5, 3.0, -3.0, 0.0, -0.0])  # ties and signed zeros
    want = kv_dtype.raw(kv_dtype.quantize(x, dtype))
    assert torch.equal(kv_dtype.raw(kv_rows(x, dtype)), want)
    back = kv_dtype.dequantize(kv_dtype.quantize(x, dtype), 64, torch.float32)
    assert torch.equal(back[5], torch.zeros(64))
    amax = x.abs().amax(-1, keepdim=True)
    bound = {torch.bfloat16: 2**-8 * x.abs(),  # half an ulp of each type, relative or of the row's scale
             torch.float16: 2**-11 * x.abs() + 2**-25,  # (the 1e-3 row's values go subnormal)
             torch.int8: 0.5 * amax / 127,
             torch.float8_e4m3fn: 2**-4 * x.abs() + 2**-10 * amax / 448}[dtype]
    assert ((back - x).abs() <= bound * (1 + 1e-6)).all()


def test_an_8bit_row_is_its_values_then_an_fp32_scale():
    x = torch.tensor([[0.0, 1.0, -2.0, 4.0]])
    rows = kv_dtype.quantize(x, torch.int8)  # [1, 8]
    assert rows.shape == (1, 8)
    assert rows[0, :4].tolist() == [0, 32, -64, 127]  # round(x / (4 / 127)): 31.75 -> 32, 63.5 -> 64 (even)
    assert rows.view(torch.uint8)[0, 4:].view(torch.float32).item() == pytest.approx(4 / 127)


def _paged_cache(ks, vs, dtype, block_size, g):
    """Each sequence's K/V [len, kv, d] written (rounded/quantized) into shuffled blocks of a cache of `dtype`."""
    kv, d = ks[0].shape[1:]
    need = [math.ceil(k.shape[0] / block_size) for k in ks]
    storage = allocate_kv_storage(1, sum(need) + 2, block_size, kv, d, dtype, torch.device("cpu"))
    k_cache, v_cache = storage[0, 0], storage[0, 1]
    free = torch.randperm(sum(need) + 2, generator=g).tolist()
    tables = []
    for k, v, n in zip(ks, vs, need, strict=True):
        blocks = [free.pop() for _ in range(n)]
        j = torch.arange(k.shape[0])
        slots = torch.tensor(blocks)[j // block_size] * block_size + j % block_size
        kv_dtype.write_rows(k, k_cache, slots)
        kv_dtype.write_rows(v, v_cache, slots)
        tables.append(blocks + [0] * (max(need) + 1 - n))
    return k_cache, v_cache, torch.tensor(tables)


def _sdpa(q, k, v):
    """q [heads, d], k, v [len, kv, d] -> [heads, d], fp64."""
    return F.scaled_dot_product_attention(q.unsqueeze(1).double(), k.transpose(0, 1).double(),
                                          v.transpose(0, 1).double(), enable_gqa=q.shape[0] != k.shape[1]).squeeze(1)


@KV_TYPES
# 36: a tail of 4 past the 8-wide loads; 5: odd blocks; 520: too wide to widen an fp8 chunk first (AVX2: in place)
@pytest.mark.parametrize("d,bs", [(64, 16), (36, 5), (520, 16)])
def test_c_decode_attention_reads_each_type(dtype, d, bs):
    g = torch.Generator().manual_seed(d + bs)
    heads, kvh, lens = 8, 2, [1, 19, 130, 70]
    ks = [torch.randn(n, kvh, d, generator=g) for n in lens]
    vs = [torch.randn(n, kvh, d, generator=g) for n in lens]
    k_cache, v_cache, tables = _paged_cache(ks, vs, dtype, bs, g)
    q = torch.randn(len(lens), heads, d, generator=g)
    out = decode_attention(q, k_cache, v_cache, tables, torch.tensor(lens), max(lens), 1 / math.sqrt(d))
    for b in range(len(lens)):
        seen_k = kv_dtype.dequantize(kv_dtype.quantize(ks[b], dtype), d, torch.float32)  # what the cache holds
        seen_v = kv_dtype.dequantize(kv_dtype.quantize(vs[b], dtype), d, torch.float32)
        torch.testing.assert_close(out[b], _sdpa(q[b], seen_k, seen_v).float(), rtol=1e-5, atol=1e-5)
        assert (out[b] - _sdpa(q[b], ks[b], vs[b]).float()).abs().max() <= ATOL[dtype]


@pytest.mark.parametrize("heads,kvh", [(3, 3), (9, 3), (8, 2), (10, 2), (8, 1)], ids=["g1", "g3", "g4", "g5", "g8"])
# 128: two register blocks of 64; 80: a block with one vector and three masked off; 36: a 16-wide tail of 4
@pytest.mark.parametrize("d", [64, 128, 80, 36])
def test_c_decode_attention_over_gqa_groups_and_odd_contexts(heads, kvh, d):
    """AVX-512 builds take a kv head's query heads in sub-groups of up to 4 (g5: 4 + 1, g8: 4 + 4) and slots in
    sixteens: each group size and head_dim, contexts not a multiple of 16 or 64, through every 16- and 8-bit type,
    against attention over the cache's dequantized values."""
    g = torch.Generator().manual_seed(heads * 100 + kvh * 10 + d)
    lens = [1, 15, 17, 63, 65, 211]
    ks = [torch.randn(n, kvh, d, generator=g) for n in lens]
    vs = [torch.randn(n, kvh, d, generator=g) for n in lens]
    q = torch.randn(len(lens), heads, d, generator=g)
    for dtype in (torch.int8, torch.float8_e4m3fn, torch.bfloat16):
        k_cache, v_cache, tables = _paged_cache(ks, vs, dtype, 16, g)
        out = decode_attention(q, k_cache, v_cache, tables, torch.tensor(lens), max(lens), 1 / math.sqrt(d))
        for b in range(len(lens)):
            seen_k = kv_dtype.dequantize(kv_dtype.quantize(ks[b], dtype), d, torch.float32)
            seen_v = kv_dtype.dequantize(kv_dtype.quantize(vs[b], dtype), d, torch.float32)
            torch.testing.assert_close(out[b], _sdpa(q[b], seen_k, seen_v).float(), rtol=1e-5, atol=1e-5)


def test_c_decode_attention_refuses_a_cache_of_the_wrong_width():
    cache = torch.zeros(4, 16, 2, 64, dtype=torch.int8)  # an int8 row needs 64 + 4
    q, tables, lens = torch.zeros(1, 4, 64), torch.zeros(1, 2, dtype=torch.long), torch.tensor([3])
    with pytest.raises(ValueError, match="do not match"):
        decode_attention(q, cache, cache, tables, lens, 3, 0.1)
    with pytest.raises(ValueError, match=r"a KV cache of torch.int32 \(have: torch.float32"):
        decode_attention(q, cache.int(), cache.int(), tables, lens, 3, 0.1)


@pytest.mark.parametrize("dtype", [torch.float32, *NARROW], ids=["f32", "bf16", "f16", "int8", "fp8"])
def test_fused_decode_step_writes_and_reads_the_cache_type_as_the_per_op_path(dtype, monkeypatch):
    """Bit-identical logits and cache bytes: lp_kv_store quantizes as write_kv does, and both paths read
    through the same C attention."""
    g = torch.Generator().manual_seed(0)
    model, storage = _model_and_cache("tiny-bias")
    cfg = model.config
    storage = allocate_kv_storage(cfg.num_layers, storage.shape[2], storage.shape[3], cfg.num_kv_heads, cfg.head_dim,
                                  dtype, torch.device("cpu"))
    _prefill(model, storage, g)
    ids = torch.randint(0, cfg.vocab_size, (len(PROMPTS),), generator=g)
    raw = kv_dtype.raw(storage)  # (clone and torch.equal on the bytes: fp8 has no torch.equal)
    before = raw.clone()
    fused = _decode(model, storage, ids, torch.arange(len(PROMPTS)), None, True, monkeypatch)
    after_fused = raw.clone()
    raw.copy_(before)
    per_op = _decode(model, storage, ids, torch.arange(len(PROMPTS)), None, False, monkeypatch)
    assert torch.equal(fused, per_op) and torch.isfinite(fused).all()
    assert torch.equal(after_fused, raw)
    assert not torch.equal(before, raw)  # the step's K/V were written


@KV_TYPES
def test_torch_sdpa_over_each_type_is_close_to_an_fp32_cache(dtype):
    """A mixed step (a first prefill, a chunk after a context, decodes) over fp32 and over `dtype` caches."""
    g = torch.Generator().manual_seed(7)
    heads, kvh, d, bs = 6, 2, 32, 8
    seqs = [(0, 12, [1, 2]), (20, 9, [3, 4, 5, 6]), (30, 1, [7, 8, 9, 10]), (5, 1, [11])]
    history = {i: (torch.randn(c, kvh, d, generator=g), torch.randn(c, kvh, d, generator=g))
               for i, (c, _, _) in enumerate(seqs) if c}
    n_tok = sum(n for _, n, _ in seqs)
    q, k, v = (torch.randn(n_tok, h, d, generator=g) for h in (heads, kvh, kvh))
    outs = {}
    for dt in (torch.float32, dtype):
        storage = allocate_kv_storage(1, 12, bs, kvh, d, dt, torch.device("cpu"))
        kc, vc = storage[0, 0], storage[0, 1]
        for i, (hk, hv) in history.items():
            blocks = seqs[i][2]
            slots = torch.tensor([blocks[p // bs] * bs + p % bs for p in range(hk.shape[0])])
            kv_dtype.write_rows(hk, kc, slots)
            kv_dtype.write_rows(hv, vc, slots)
        meta = build_metadata(seqs, bs, "cpu")
        outs[dt] = TorchSdpaBackend().forward(q, k, v, kc, vc, meta)
    assert (outs[dtype] - outs[torch.float32]).abs().max() <= ATOL[dtype]
    assert not torch.equal(outs[dtype], outs[torch.float32])  # the narrower cache was read
